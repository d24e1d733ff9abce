"""The bug-shape zoo's byte faults on vLLM's real CPU engine (docs/bug-zoo.md): a real forward
pass over the KV a faulty load wrote, recorded by KVLedgerRecorder with sampled digests and
judged by ``kvledger check`` of the log alone.

One engine runs every fault in turn (``kvledger.connector.testing.zoo:EngineLoadFault``: vLLM builds a
connector from its class alone, so the fault is chosen between workloads with
``set_engine_fault``), each workload with prompts of its own, computed in a first round and
reloaded from the connector's pool in a second (vLLM's prefix cache off, a pool large enough
that the second round gets blocks that never held those prompts). The clean twin is the same
workload with no fault: its outputs are the engine's without a connector, token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.connector.testing.engine import EngineSpec

from .conftest import EngineRuns, Workload, prompts, run_workloads

BLOCK = 32
ENGINE = dict(num_blocks=16, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
RECORDER = {"inner": "kvledger.connector.testing.zoo:EngineLoadFault", "digests": "sampled"}
CONNECTOR = {"chunk_size": BLOCK}

# workload -> (the fault, the rules check may name for its second round)
FAULTS: dict[str, tuple[str | None, set[str]]] = {
    "lmcache_4463": ("swap_kv", {"digest_mismatch"}),  # K and V exchanged on load
    "dynamo_15079": ("skip", {"load_unchanged"}),  # a failed load marked complete
    "sglang_40193": ("short", {"load_unchanged"}),  # a hit silently shortened to one chunk
    "twin": (None, set()),  # the same loads, done right
}


def _fault(kind: str | None) -> Callable[[bool], None]:
    def setup(on: bool) -> None:
        from kvledger.connector.testing.zoo import set_engine_fault

        set_engine_fault(kind if on else None)

    return setup


def workloads(model: str) -> list[Workload]:
    out = []
    for seed, (name, (kind, _)) in enumerate(sorted(FAULTS.items()), start=80):
        ps = prompts(model, seed, [70, 70])  # two whole chunks each, reloaded in round two
        out.append(Workload(name, [(ps, 4), (ps, 8)], setup=_fault(kind)))
    return out


@pytest.fixture(scope="module")
def zoo(tiny_model: str, base: EngineRuns) -> EngineRuns:
    spec = EngineSpec(model=tiny_model, extra_config=CONNECTOR, recorder=RECORDER, **ENGINE)
    return run_workloads(spec, workloads(tiny_model))


def _named(zoo: EngineRuns) -> dict[str, set[str]]:
    """vLLM's external request id -> the rules check named for it (the engine core's ids are
    the external ids with a suffix)."""
    assert zoo.check is not None
    from kvledger.replay.replayer import check

    assert zoo.log_path is not None
    out: dict[str, set[str]] = {}
    for p in check(zoo.log_path).problems:
        out.setdefault(p.req_id.rsplit("-", 1)[0], set()).add(p.name)
    return out


def test_the_clean_twin_matches_the_engine_without_a_connector(
    base: EngineRuns, zoo: EngineRuns
) -> None:
    assert zoo.outputs("twin") == base.outputs("twin")
    assert zoo.total("twin", "tokens_loaded") > 0
    named = _named(zoo)
    assert not any(rid in named for run in zoo.runs["twin"] for rid in run.request_ids)


@pytest.mark.parametrize("name", sorted(n for n in FAULTS if n != "twin"))
def test_a_byte_fault_changes_the_outputs_and_check_names_its_requests(
    base: EngineRuns, zoo: EngineRuns, name: str
) -> None:
    """The first round computes the prompts (no load, same outputs as the engine alone); the
    second reloads them through the faulty load: greedy decoding over that KV picks other
    tokens, and check names exactly the second round's requests, with the fault's rule."""
    first, second = zoo.runs[name]
    assert first.outputs == base.runs[name][0].outputs
    assert second.worker.get("tokens_loaded", 0) > 0 or name == "dynamo_15079"
    assert second.outputs != base.runs[name][1].outputs
    named = _named(zoo)
    assert not any(rid in named for rid in first.request_ids)
    for rid in second.request_ids:
        assert named.get(rid), f"{name}: request {rid} not named"
        assert named[rid] <= FAULTS[name][1]
    assert zoo.check is not None and zoo.check.returncode == 1
