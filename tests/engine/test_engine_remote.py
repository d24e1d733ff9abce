"""vLLM's real engine on CPU facing a redis-server full of keys of the wrong type: the chunks
one engine wrote, each replaced by a list, a hash, a set, a sorted set or a stream, on a server
then out of memory for writes. A second engine finds the keys (``EXISTS`` takes any type), and
each ``GET`` is a ``WRONGTYPE`` error reply and each write an ``OOM`` one: load failures vLLM
recomputes and failed saves, recorded, never a raise into vLLM. Every request finishes with
the same tokens as without the connector, and the log checks clean.
"""

from __future__ import annotations

from typing import Any

import pytest
from _redis import RedisServer
from _verdicts import events_of

from kvledger.connector.testing.engine import EngineSpec
from kvledger.tracker import events as ev

from .conftest import (
    REDIS_CONNECTOR,
    REDIS_ENGINE,
    EngineRuns,
    Workload,
    assert_same_outputs,
    prompts,
    run_workloads,
)

ENGINE = REDIS_ENGINE
CONNECTOR = REDIS_CONNECTOR


def workloads(model: str) -> list[Workload]:
    # Prompts of full chunks and a tail, a shared prefix: every chunk is written, then found.
    ps = prompts(model, 19, [70, 90, 100], shared_prefix=40)
    return [Workload("wrong_type", [(ps, 16)])]


@pytest.fixture(scope="module")
def server(redis: RedisServer) -> RedisServer:
    return redis


@pytest.fixture(scope="module")
def writer(tiny_model: str, server: RedisServer, base: EngineRuns) -> EngineRuns:
    extra = {**CONNECTOR, "remote_url": server.url}
    return run_workloads(
        EngineSpec(model=tiny_model, extra_config=extra, **ENGINE), workloads(tiny_model)
    )


_WRONG_TYPES: tuple[Any, ...] = (
    lambda raw, name: raw.rpush(name, b"a", b"b"),
    lambda raw, name: raw.hset(name, b"field", b"value"),
    lambda raw, name: raw.sadd(name, b"member"),
    lambda raw, name: raw.zadd(name, {b"member": 1.0}),
    lambda raw, name: raw.xadd(name, {b"field": b"value"}),
)


@pytest.fixture(scope="module")
def reader(
    tiny_model: str, server: RedisServer, writer: EngineRuns
) -> tuple[EngineRuns, list[bytes]]:
    raw = server.client()
    names = sorted(raw.keys(b"kvledger:*"))
    for i, name in enumerate(names):
        raw.delete(name)
        _WRONG_TYPES[i % len(_WRONG_TYPES)](raw, name)
    # And no room for a write: every SET is refused, out of memory.
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", max(1, int(raw.info("memory")["used_memory"]) - (1 << 20)))
    extra = {**CONNECTOR, "remote_url": server.url}
    spec = EngineSpec(model=tiny_model, extra_config=extra, **ENGINE)
    runs = run_workloads(spec, workloads(tiny_model))
    raw.config_set("maxmemory", 0)
    return runs, names


def test_the_writer_shares_its_chunks(writer: EngineRuns, server: RedisServer) -> None:
    writer.assert_check_clean()
    assert writer.total("wrong_type", "remote_chunks_saved") > 0


def test_wrong_type_keys_and_refused_writes_keep_the_tokens_and_the_log_checks(
    base: EngineRuns, reader: tuple[EngineRuns, list[bytes]]
) -> None:
    runs, names = reader
    assert len(names) >= 4
    assert_same_outputs(base, runs, "wrong_type")  # every request, token for token
    runs.assert_check_clean()  # kvledger check LOG: exit 0
    assert runs.stats.violations_total == 0
    assert runs.total("wrong_type", "remote_chunks_loaded") == 0  # nothing wrong was loaded
    assert runs.log_path is not None
    events = events_of(runs.log_path)
    found = [e for e in events if isinstance(e, ev.RemoteFound) and any(e.found)]
    assert found  # the keys were there, of another type
    failed = [e for e in events if isinstance(e, ev.RemoteLoadFailed)]
    assert failed and all(
        e.reason.startswith("refused: ResponseError: WRONGTYPE") for e in failed
    ), {e.reason for e in failed}
    assert any(isinstance(e, ev.LoadFailed) for e in events)  # vLLM recomputed them
    refused = [e for e in events if isinstance(e, ev.RemoteSaveFailed)]
    assert refused and all(e.reason.startswith("refused: OutOfMemoryError") for e in refused), {
        e.reason for e in refused
    }
    assert not [e for e in events if isinstance(e, ev.RemoteOutage)]  # the server stayed up
