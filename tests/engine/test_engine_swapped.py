"""vLLM's real engine on CPU facing a redis-server whose values were swapped between their keys
(issue 30: an operator's ``RENAME``, a buggy client). One engine writes its chunks; every two
of its values trade keys; a second engine runs the same prompts. Before values were bound to
their keys it loaded them and served wrong tokens, and its log checked clean. Now: the same
tokens as without the connector, every swapped value a recorded ``misplaced`` miss that names
the chunk it belongs to, and ``kvledger check`` exits 1 naming ``foreign_value``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _redis import RedisServer, require_redis_server
from _verdicts import events_of

from connector.testing.engine import EngineSpec
from tracker import events as ev

from .conftest import EngineRuns, Workload, assert_same_outputs, prompts, run_workloads

BLOCK = 32
ENGINE = dict(num_blocks=5, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
# A lookup bound a loaded test machine cannot miss: an outage here would be the machine's.
CONNECTOR = {"chunk_size": BLOCK, "remote_lookup_timeout_ms": 2000, "remote_retry_ms": 20}


def workloads(model: str) -> list[Workload]:
    # Prompts of full chunks and a tail, a shared prefix: every chunk is written, then found.
    ps = prompts(model, 23, [70, 90, 100], shared_prefix=40)
    return [Workload("swapped", [(ps, 16)])]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    redis = RedisServer(require_redis_server(), tmp_path_factory.mktemp("redis"))
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def reader(tiny_model: str, server: RedisServer, base: EngineRuns) -> tuple[EngineRuns, dict]:
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
