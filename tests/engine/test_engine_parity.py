"""Greedy outputs on vLLM's real CPU engine are the same with KVLedgerConnector as without it,
token for token, through preemption, resumption and reloads of whole and partial chunks.

vLLM's prefix caching is off here, so every reused token either comes from kvledger's pool
or is recomputed: the workloads are built so that loads must happen, and each test asserts
they did. The connector saves the prefill's partial chunk too (``discard_partial_chunks``
off), so loads end inside a block.
"""

from __future__ import annotations

from .conftest import EngineRuns, Workload, assert_same_outputs, prompts

BLOCK = 32
# 5 blocks of 32 tokens (vLLM keeps one as its null block): #1969's two requests of 34 + 35
# tokens need 3 blocks each, so one is preempted and resumes.
ENGINE = dict(num_blocks=5, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
CONNECTOR = {"chunk_size": BLOCK, "discard_partial_chunks": False}


def workloads(model: str) -> list[Workload]:
    partial = prompts(model, 3, [40, 50, 63, 90])
    again = prompts(model, 4, [64, 70, 96])
    return [
        Workload("1969", [(prompts(model, 1969, [34, 34]), 35)]),
        Workload(
            "shared_prefix",
            [(prompts(model, 2, [44, 48, 52, 56, 60, 64], shared_prefix=40), 30)],
        ),
        Workload("partial", [(partial, 4), (partial, 12)]),
        Workload("second_round", [(again, 8), (again, 16)]),
    ]


def test_1969_preempted_request_resumes_from_the_pool(base: EngineRuns, kv: EngineRuns) -> None:
    assert_same_outputs(base, kv, "1969")
    assert [len(o) for o in kv.runs["1969"][0].outputs] == [35, 35]
    # The geometry preempts without the connector too; with it, the resumed request's
    # prompt (its whole chunk and its 2-token partial chunk) comes back from the pool.
    assert base.runs["1969"][0].preemptions >= 1
    run = kv.runs["1969"][0]
    assert run.preemptions >= 1
    assert run.scheduler["tokens_loaded_on_resume"] > 0
    assert run.worker["tokens_loaded"] > 0


def test_shared_prefix_repeated_preemption(base: EngineRuns, kv: EngineRuns) -> None:
    assert_same_outputs(base, kv, "shared_prefix")
    run = kv.runs["shared_prefix"][0]
    assert run.preemptions >= 2
    assert run.scheduler["tokens_loaded_on_resume"] > 0
    assert run.worker["tokens_loaded"] > 0


def test_partial_chunk_reloads(base: EngineRuns, kv: EngineRuns) -> None:
    """Prompts of 40, 50, 63 and 90 tokens end inside a block; the second round loads each
    one's partial chunk, written into the middle of a block."""
    assert_same_outputs(base, kv, "partial")
    second = kv.runs["partial"][1]
    assert second.scheduler["full_hits"] >= 1
    assert second.worker["tokens_loaded"] % BLOCK != 0, second.worker


def test_second_round_reloads_the_first_rounds_prompts(base: EngineRuns, kv: EngineRuns) -> None:
    assert_same_outputs(base, kv, "second_round")
    first, second = kv.runs["second_round"]
    # Every prompt's whole chunks at least (prefix caching is off: nothing hits locally).
    assert second.worker["tokens_loaded"] >= sum((n - 1) // BLOCK * BLOCK for n in (64, 70, 96))
    assert second.worker["tokens_loaded"] > first.worker["tokens_loaded"]


def test_log_checks_clean_and_counts_the_loads(kv: EngineRuns) -> None:
    # vLLM built KVLedgerConnector itself, from kv_connector_module_path, in both roles.
    assert kv.connector_classes == ("kvledger.connector.vllm.KVLedgerConnector",) * 2
    kv.assert_check_clean()
    st = kv.stats
    assert st.violations_total == 0
    assert st.preemptions > 0
    assert st.tokens_loaded == sum(kv.total(name, "tokens_loaded") for name in kv.runs)
    assert st.tokens_loaded > 0
