"""With vLLM's prefix caching on, the connector still changes no output token.

vLLM then reuses the blocks it still holds and asks the connector only for the rest: with 4
usable blocks of 32 tokens they are evicted fast, so the pool still serves the resumed and
repeated prompts. The connector runs its defaults here (partial chunks discarded) with
chunks of two blocks, so every load spans two blocks.
"""

from __future__ import annotations

from .conftest import EngineRuns, Workload, assert_same_outputs, prompts

ENGINE = dict(num_blocks=5, block_size=32, max_model_len=128, max_num_seqs=4, prefix_caching=True)
CONNECTOR = {"chunk_size": 64}


def workloads(model: str) -> list[Workload]:
    again = prompts(model, 14, [70, 80, 96, 100])
    return [
        Workload(
            "shared_prefix",
            [(prompts(model, 12, [70, 72, 76, 80, 84], shared_prefix=66), 24)],
        ),
        Workload("second_round", [(again, 6), (again, 12)]),
    ]


def test_shared_prefix_with_prefix_caching(base: EngineRuns, kv: EngineRuns) -> None:
    assert_same_outputs(base, kv, "shared_prefix")
    assert kv.runs["shared_prefix"][0].preemptions >= 1


def test_second_round_with_prefix_caching(base: EngineRuns, kv: EngineRuns) -> None:
    assert_same_outputs(base, kv, "second_round")
    # 4 blocks cannot keep four prompts of 70 to 100 tokens: the second round loads from
    # the pool what vLLM's own cache lost.
    assert kv.runs["second_round"][1].worker["tokens_loaded"] > 0


def test_log_checks_clean(kv: EngineRuns) -> None:
    kv.assert_check_clean()
    assert kv.stats.violations_total == 0
    assert kv.stats.tokens_loaded == sum(kv.total(n, "tokens_loaded") for n in kv.runs) > 0
