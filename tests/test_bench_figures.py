"""The scheduler benches' target figure (bench/scheduler_overhead.py, ``paired_ratios``): each
turn of a variant over the reference's same turn, the median of those per round. Synthetic
turns with a known answer; no timing here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scheduler_overhead as so

# A round's turns: what the machine and the workload made each turn cost both variants (the
# machine's speed drifting twofold and more between turns, a block boundary's heavier step).
rounds_of_turns = st.lists(
    st.lists(st.floats(200.0, 20_000.0), min_size=3, max_size=40), min_size=1, max_size=6
)


def _variant(turns: list[list[float]]) -> SimpleNamespace:
    return SimpleNamespace(turns=turns)


@given(shared=rounds_of_turns, cost=st.floats(0.9, 1.2))
def test_a_cost_reads_the_same_however_the_turns_drift(
    shared: list[list[float]], cost: float
) -> None:
    """A variant ``cost`` times the reference, turn by turn, reads ``cost`` in every round,
    whatever the turns shared (the figure is read on the pairs, not on either's spread)."""
    ref = _variant(shared)
    v = _variant([[cost * t for t in turns] for turns in shared])
    for r in so.paired_ratios(v, ref):
        assert abs(r - cost) < 1e-9 * cost
    assert abs(so.paired_ratio(v, ref) - cost) < 1e-9 * cost


@given(
    shared=rounds_of_turns, cost=st.floats(0.9, 1.2), burst=st.floats(2.0, 500.0), data=st.data()
)
def test_one_burst_a_round_leaves_the_figure(
    shared: list[list[float]], cost: float, burst: float, data: st.DataObject
) -> None:
    """A burst that lands in one turn of one variant (a collection, the log thread's round, a
    stolen CPU) is one pair of the round: with three turns or more, the median leaves it out."""
    v_turns = [[cost * t for t in turns] for turns in shared]
    for turns in v_turns:
        i = data.draw(st.integers(0, len(turns) - 1))
        turns[i] *= burst
    for r in so.paired_ratios(_variant(v_turns), _variant(shared)):
        assert abs(r - cost) < 1e-9 * cost


def test_turns_are_paired_by_position_not_by_size() -> None:
    """The same turns in another order are not the same variant: turn t pairs with turn t (a
    figure of the two sorted would read 1.000 here)."""
    ref = _variant([[1000.0, 2000.0, 1000.0, 2000.0, 1000.0]])
    swapped = _variant([[2000.0, 1000.0, 2000.0, 1000.0, 2000.0]])
    assert so.paired_ratios(swapped, ref) == [2.0]


def test_a_step_time_in_two_modes_does_not_tip_the_figure() -> None:
    """Steps on these machines come in a fast and a slow mode (p10 to p90 twofold). A variant
    equal to the reference but for one turn that fell in the slow mode reads 1.000 paired;
    the ratio of the two medians reads 3.000, the median having tipped from one mode to the
    other."""
    ref = _variant([[1000.0, 1000.0, 1000.0, 3000.0, 3000.0]])
    v = _variant([[1000.0, 1000.0, 3000.0, 3000.0, 3000.0]])
    assert so.paired_ratios(v, ref) == [1.0]
