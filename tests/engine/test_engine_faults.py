"""Injected load failures under ``kv_load_failure_policy="recompute"``: vLLM recomputes what
failed and the outputs stay the same. And the suite can fail: a deliberately wrong load
(every loaded chunk's K and V doubled) changes the outputs.

The connector here is ``FaultyEngineConnector`` (connector/testing/engine.py), which vLLM
loads by ``kv_connector_module_path`` like the real one: ``KVLedgerConnector`` whose worker
fails the chosen chunk loads, or scales them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.connector.testing.engine import EngineSpec, set_load_fault, set_load_scale

from .conftest import EngineRuns, Workload, assert_same_outputs, prompts, run_workloads

BLOCK = 32
ENGINE = dict(num_blocks=5, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
CONNECTOR = {"chunk_size": BLOCK, "discard_partial_chunks": False}


def _second_chunks_fail(on: bool) -> None:
    # Each load's chunk at tokens 32-63 fails: the first chunk lands, vLLM recomputes the rest.
    set_load_fault((lambda req_id, chunk: chunk.token_start == BLOCK) if on else None)


def _doubled(on: bool) -> None:
    set_load_scale(2.0 if on else 1.0)


def _workload(name: str, seed: int, setup: Callable[[bool], None]) -> Callable[[str], Workload]:
    def make(model: str) -> Workload:
        # Two prompts of 70 tokens: preempted in the first round, reloaded in the second.
        ps = prompts(model, seed, [70, 70, 90])
        return Workload(name, [(ps, 20), (ps, 20)], setup=setup)

    return make


WORKLOADS = [_workload("faults", 31, _second_chunks_fail), _workload("scaled", 32, _doubled)]


def workloads(model: str) -> list[Workload]:
    return [make(model) for make in WORKLOADS]


@pytest.fixture(scope="module")
def faulty(tiny_model: str, base: EngineRuns) -> EngineRuns:
    spec = EngineSpec(model=tiny_model, faulty=True, extra_config=CONNECTOR, **ENGINE)
    return run_workloads(spec, workloads(tiny_model))


def test_failed_loads_are_recomputed_and_outputs_match(
    base: EngineRuns, faulty: EngineRuns
) -> None:
    assert_same_outputs(base, faulty, "faults")
    # Loads both landed (each first chunk) and failed (each second chunk).
    assert faulty.total("faults", "tokens_loaded") > 0
    assert faulty.stats.load_failures > 0


def test_log_of_the_faulty_run_checks_clean(faulty: EngineRuns) -> None:
    faulty.assert_check_clean()
    assert faulty.stats.violations_total == 0


def test_wrong_kv_changes_the_outputs(base: EngineRuns, faulty: EngineRuns) -> None:
    """The suite can fail: KV loaded doubled makes greedy pick other tokens."""
    assert faulty.total("scaled", "tokens_loaded") > 0
    assert faulty.outputs("scaled") != base.outputs("scaled")
    # Only the rounds and requests that loaded something may differ; the second round
    # reloads every prompt, so every one of its outputs changes.
    second_base, second_wrong = base.runs["scaled"][1], faulty.runs["scaled"][1]
    assert all(a != b for a, b in zip(second_base.outputs, second_wrong.outputs, strict=True))
