"""What a step did, counted off its recorded events: one table from event type to what it adds.

``kvledger tail`` prints a line of it per step, the tables' ``steps`` rows carry it, ``kvledger
stats`` sums it over the log, and ``kvledger check`` totals the plans' tokens with the same rule
(:func:`moved`): a load, a save, a confirmation or a violation is counted here and nowhere else,
so a number in one of them is the same number in the others.

The counts need no request's state: each is read off one event. What does need the fold (a
request admitted, preempted or finished, tokens computed) is counted by the readers that walk
it (``tracker.history.walk``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvledger.tracker import events as ev

__all__ = ["COUNTERS", "SUMMED", "StepCounts", "moved"]


def moved(e: ev.Event) -> tuple[int, int]:
    """(tokens loaded, tokens saved) by a plan. A plan moves tokens when it names chunks over a
    range that is not empty; a refused load (no chunks, only the blocks it refuses) moves
    none, and neither does any other event."""
    if e.__class__ is ev.LoadPlanned or e.__class__ is ev.SavePlanned:
        assert isinstance(e, (ev.LoadPlanned, ev.SavePlanned))
        if e.keys and e.end > e.start:
            n = e.end - e.start
            return (n, 0) if e.__class__ is ev.LoadPlanned else (0, n)
    return 0, 0


@attrs.define(slots=True)
class StepCounts:
    """The counts of one step (or of any run of events: ``stats`` sums them, see
    :data:`SUMMED`). Feed it the step's events with :meth:`add`."""

    step: int = 0
    lookups: int = 0  # LookupAsked: vLLM asks again every step a request waits
    answers: int = 0  # LookupAnswered
    tokens_offered: int = 0  # to vLLM, from the pool (LookupAnswered.external)
    loads: int = 0  # load plans that move tokens (moved)
    tokens_loaded: int = 0
    loads_refused: int = 0  # load plans that refuse blocks vLLM counted as loaded
    loads_done: int = 0  # LoadDone
    load_failures: int = 0  # LoadFailed
    saves: int = 0  # save plans that move tokens (moved)
    tokens_saved: int = 0
    chunks_saved: int = 0  # chunks of those plans
    chunks_evicted: int = 0  # by those plans, and ChunkEvicted
    chunks_confirmed: int = 0  # SaveDone's chunks
    chunks_failed: int = 0  # SaveFailed's chunks
    violations: list[tuple[str, str]] = attrs.field(factory=list)  # (rule, req_id), in order

    def add(self, e: ev.Event) -> None:
        count = COUNTERS.get(e.__class__)
        if count is not None:
            count(self, e)


def _lookup_asked(c: StepCounts, e: ev.Event) -> None:
    c.lookups += 1


def _lookup_answered(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.LookupAnswered)
    c.answers += 1
    c.tokens_offered += e.external


def _load_planned(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.LoadPlanned)
    tokens = moved(e)[0]
    if tokens:
        c.loads += 1
        c.tokens_loaded += tokens
    if e.refused_blocks:
        c.loads_refused += 1


def _load_done(c: StepCounts, e: ev.Event) -> None:
    c.loads_done += 1


def _load_failed(c: StepCounts, e: ev.Event) -> None:
    c.load_failures += 1


def _save_planned(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.SavePlanned)
    tokens = moved(e)[1]
    if tokens:
        c.saves += 1
        c.tokens_saved += tokens
        c.chunks_saved += len(e.keys)
        c.chunks_evicted += len(e.evicted)


def _save_done(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.SaveDone)
    c.chunks_confirmed += len(e.keys)


def _save_failed(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.SaveFailed)
    c.chunks_failed += len(e.keys)


def _chunk_evicted(c: StepCounts, e: ev.Event) -> None:
    c.chunks_evicted += 1


def _violation(c: StepCounts, e: ev.Event) -> None:
    assert isinstance(e, ev.ViolationRecorded)
    c.violations.append((e.rule, e.req_id))


COUNTERS: dict[type[ev.Event], Callable[[StepCounts, ev.Event], None]] = {
    ev.LookupAsked: _lookup_asked,
    ev.LookupAnswered: _lookup_answered,
    ev.LoadPlanned: _load_planned,
    ev.LoadDone: _load_done,
    ev.LoadFailed: _load_failed,
    ev.SavePlanned: _save_planned,
    ev.SaveDone: _save_done,
    ev.SaveFailed: _save_failed,
    ev.ChunkEvicted: _chunk_evicted,
    ev.ViolationRecorded: _violation,
}
"""What each event type adds to a step's counts; the types not here add nothing."""

SUMMED = (
    "loads",
    "tokens_loaded",
    "loads_refused",
    "load_failures",
    "saves",
    "tokens_saved",
    "chunks_saved",
    "chunks_confirmed",
    "chunks_failed",
)
"""The counts ``stats`` sums over the log (its fields of the same names)."""
