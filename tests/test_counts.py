"""One count of what each step did (``replay.counts``), read by ``tail``, the ``steps`` table,
``stats`` and ``check``: on every log, step by step, they say the same numbers; and the rule of
what a plan moves holds on any plan, hostile ones included."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import replay
from kvledger.replay.counts import StepCounts, moved
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import check
from kvledger.replay.tables import collect
from kvledger.replay.tail import news
from kvledger.tracker import events as ev

DATA = Path(__file__).resolve().parent / "data"
LOGS = sorted(
    [DATA / "replay-clean.kvlog", DATA / "replay-short-load.kvlog", *DATA.glob("zoo/*.kvlog")]
)


def _agree(path: Path) -> None:
    tail = {n.step: n for n in news(LogReader(path))}
    rows, _ = collect(path, ("steps",), problems=False)
    steps = {r["step"]: r for r in rows["steps"]}
    assert tail.keys() == steps.keys()
    for step, n in tail.items():
        row = steps[step]
        said = (n.load_tokens, n.save_tokens, n.chunks_saved, n.save_failures, n.load_failures)
        tabled = (row["tokens_loaded"], row["tokens_saved"], row["chunks_confirmed"])
        tabled += (row["chunks_failed"], row["load_failures"])
        assert said == tabled, step
        assert len(n.violations) == row["violations"], step
    st_ = replay.stats(path)
    for column in ("tokens_loaded", "loads_refused", "load_failures", "tokens_saved"):
        assert getattr(st_, column) == sum(r[column] for r in steps.values()), column
    for column in ("chunks_saved", "chunks_confirmed", "chunks_failed"):
        assert getattr(st_, column) == sum(r[column] for r in steps.values()), column
    assert st_.loads == sum(n.loads for n in tail.values())
    assert st_.saves == sum(n.saves for n in tail.values())
    assert st_.violations == dict(
        Counter(rule for n in tail.values() for rule, _ in n.violations).most_common()
    )
    if not st_.recorded:  # check totals the recorded plans by the same rule
        recorded = check(path).totals["recorded"]
        assert (recorded["loads"], recorded["tokens_loaded"]) == (st_.loads, st_.tokens_loaded)
        assert (recorded["saves"], recorded["tokens_saved"]) == (st_.saves, st_.tokens_saved)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_tail_the_steps_table_stats_and_check_count_alike(path: Path) -> None:
    _agree(path)


def test_they_count_alike_on_a_log_with_a_violation_and_loads(synthetic_log: Path) -> None:
    assert replay.stats(synthetic_log).violations == {"accepted_equals_answer": 1}
    _agree(synthetic_log)


_KEY = st.binary(min_size=1, max_size=4)


@given(
    cls=st.sampled_from([ev.LoadPlanned, ev.SavePlanned]),
    start=st.integers(-5, 40),
    end=st.integers(-5, 40),
    keys=st.lists(_KEY, max_size=3),
    refused=st.lists(st.integers(0, 9), max_size=2),
)
def test_a_plan_moves_tokens_only_with_chunks_over_a_range(
    cls: type, start: int, end: int, keys: list[bytes], refused: list[int]
) -> None:
    """Whatever a plan says (a hostile log: an empty or reversed range, no chunks), it counts
    as moving ``end - start`` tokens exactly when it names chunks over a range that is not
    empty, in the step's counts as in ``moved``."""
    slots = list(range(len(keys)))
    if cls is ev.LoadPlanned:
        e = ev.LoadPlanned(3, "r", start, end, keys, slots, refused)
    else:
        e = ev.SavePlanned(3, "r", start, end, keys, slots)
    tokens = end - start if keys and end > start else 0
    loaded, saved = moved(e)
    c = StepCounts(3)
    c.add(e)
    if cls is ev.LoadPlanned:
        assert (loaded, saved) == (tokens, 0)
        assert (c.loads, c.tokens_loaded) == (int(tokens > 0), tokens)
        assert c.loads_refused == int(bool(refused))
    else:
        assert (loaded, saved) == (0, tokens)
        assert (c.saves, c.tokens_saved, c.chunks_saved) == (
            int(tokens > 0),
            tokens,
            len(keys) if tokens else 0,
        )
