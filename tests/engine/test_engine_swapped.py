"""vLLM's real engine on CPU facing a redis-server whose values were swapped between their keys
(issue 30: an operator's ``RENAME``, a buggy client). One engine writes its chunks; every two
of its values trade keys; a second engine runs the same prompts. Before values were bound to
their keys it loaded them and served wrong tokens, and its log checked clean. Now: the same
tokens as without the connector, every swapped value a recorded ``misplaced`` miss that names
the chunk it belongs to, and ``kvledger check`` exits 1 naming ``foreign_value``.
"""

from __future__ import annotations

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
    ps = prompts(model, 23, [70, 90, 100], shared_prefix=40)
    return [Workload("swapped", [(ps, 16)])]


@pytest.fixture(scope="module")
def reader(tiny_model: str, redis: RedisServer, base: EngineRuns) -> tuple[EngineRuns, dict]:
    server = redis
    extra = {**CONNECTOR, "remote_url": server.url}
    spec = EngineSpec(model=tiny_model, extra_config=extra, **ENGINE)
    writer = run_workloads(spec, workloads(tiny_model))
    writer.assert_check_clean()
    raw = server.client()
    names = sorted(raw.keys(b"kvledger:v2:*"))
    partner: dict[bytes, bytes] = {}
    for a, b in zip(names[::2], names[1::2], strict=False):
        raw.rename(a, b"swap-tmp")
        raw.rename(b, a)
        raw.rename(b"swap-tmp", b)
        ka, kb = (bytes.fromhex(n.split(b":")[2].decode()) for n in (a, b))
        partner[ka], partner[kb] = kb, ka
    assert len(partner) >= 4
    return run_workloads(spec, workloads(tiny_model)), partner


def test_swapped_values_serve_no_wrong_token_and_the_log_names_them(
    base: EngineRuns, reader: tuple[EngineRuns, dict]
) -> None:
    runs, partner = reader
    assert_same_outputs(base, runs, "swapped")  # every request, token for token
    assert runs.log_path is not None
    events = events_of(runs.log_path)
    refused = [e for e in events if isinstance(e, ev.RemoteLoadFailed)]
    assert refused
    for e in refused:
        (key,) = e.keys
        assert e.reason == f"misplaced: the value of chunk {partner[key].hex()}"
    assert any(isinstance(e, ev.LoadFailed) for e in events)  # vLLM recomputed them
    assert runs.check is not None and runs.check.returncode == 1
    assert "foreign_value" in runs.check.stdout
    assert runs.stats.violations_total == len(refused)
