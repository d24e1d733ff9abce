"""The chunk index's fold: how each recorded event changes ``ChunkIndex``.

``state.py`` folds an event into one request's state; this module folds the same event into
the index the whole pool shares, by two tables from event type to effect (input facts, and the
Tracker's own decisions), so a reader finds every way the index can change in one place. Like the state fold it is a function of recorded facts
alone (the event and the request's state before and after it), so a replay rebuilds the index
exactly; the chunk arithmetic it needs comes from ``plans.py``.

The effects:

- a save plan reserves its slots (evicting what it names); a save result stores or releases
  each chunk; a pool event (``ChunkStored``, ``ChunkEvicted``) stores or drops one chunk;
- a load plan pins the chunks it reads; its result unpins them. A failed load also drops the
  chunks it could not read (a later lookup would fail the same way) and cancels the writes of
  saves over the failed range (their KV was computed over wrong KV);
- any other event that revoked a load still in flight (a preemption) unpins its chunks. A
  finished request keeps its pins until its load result: the worker may still read the slots.

A pool event or a plan that says something impossible (``tracker.wellformed``: an empty key, a
negative slot, keys and slots of different lengths) changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.plans import failed_load_keys, save_aliases
from kvledger.tracker.remote import REMOTE_TYPES, apply_remote
from kvledger.tracker.state import RequestState
from kvledger.tracker.wellformed import malformed

__all__ = ["DECISION_EFFECTS", "INPUT_EFFECTS", "apply_decision", "apply_input", "apply_recorded"]

Effect = Callable[
    [ChunkIndex, ev.Event, "RequestState | None", "RequestState | None", TrackerConfig], None
]


def _load_in_flight(state: RequestState | None) -> bool:
    return state is not None and state.load is not None and not state.load.done


def _revoke(
    index: ChunkIndex,
    event: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    # Revoked (preemption) before the worker reported back.
    if _load_in_flight(before) and after is not None and after.load is None:
        assert before is not None and before.load is not None
        index.unpin(before.load.keys)


def _save_planned(
    index: ChunkIndex,
    e: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    assert isinstance(e, ev.SavePlanned)
    # Sound by now: the Tracker derived it, or apply_recorded checked it (checked once).
    if e.keys:
        aliases = save_aliases(e, after, config) if after is not None else ()
        index.apply_save_planned(e.keys, e.slots, e.evicted, aliases)


def _load_planned(index: ChunkIndex, e: ev.Event, *_: object) -> None:
    assert isinstance(e, ev.LoadPlanned)
    if e.keys:
        index.pin(e.keys)


def _save_done(index: ChunkIndex, e: ev.Event, *_: object) -> None:
    assert isinstance(e, ev.SaveDone)
    for key in e.keys:
        index.apply_save_done(key)


def _save_failed(index: ChunkIndex, e: ev.Event, *_: object) -> None:
    assert isinstance(e, ev.SaveFailed)
    for key in e.keys:
        index.apply_save_failed(key)


def _load_done(
    index: ChunkIndex,
    e: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    if _load_in_flight(before):
        assert before is not None and before.load is not None
        index.unpin(before.load.keys)


def _load_failed(
    index: ChunkIndex,
    e: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    assert isinstance(e, ev.LoadFailed)
    _load_done(index, e, before, after, config)  # like any load result: unpin first
    if _load_in_flight(before):
        assert before is not None
        # The pool could not serve these chunks: never offer them again; the recomputed KV
        # is saved anew.
        index.drop_unread(failed_load_keys(before, e.block_ids, config))
    if after is not None:
        # KV computed over the failed range is wrong: never store chunks from there on.
        for key, start in after.save.pending:
            if start >= after.num_tokens:
                index.cancel_write(key)


def _chunk_stored(index: ChunkIndex, e: ev.Event, *_: object) -> None:
    assert isinstance(e, ev.ChunkStored)
    if not malformed(e):
        index.apply_stored(e.key, e.slot)


def _chunk_evicted(index: ChunkIndex, e: ev.Event, *_: object) -> None:
    assert isinstance(e, ev.ChunkEvicted)
    if not malformed(e):
        index.apply_evicted(e.key)


def _nothing(*_: object) -> None:
    pass


# What the facts vLLM and the worker report do to the index. Any other input event (a
# decision type arriving as input included: only the Tracker's own decisions reserve or pin)
# can only revoke a load.
INPUT_EFFECTS: dict[type[ev.Event], Effect] = {
    ev.SaveDone: _save_done,
    ev.SaveFailed: _save_failed,
    ev.LoadDone: _load_done,
    ev.LoadFailed: _load_failed,
    ev.ChunkStored: _chunk_stored,
    ev.ChunkEvicted: _chunk_evicted,
}

# What the Tracker's own decisions do, as each is derived (a save plan must see the pins of
# the same step's load). A lookup answer touches no chunk.
DECISION_EFFECTS: dict[type[ev.Event], Effect] = {
    ev.LoadPlanned: _load_planned,
    ev.SavePlanned: _save_planned,
    ev.LookupAnswered: _nothing,
}


def apply_input(
    index: ChunkIndex,
    event: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    """Apply an input event's effect (``before``/``after``: the request's state around the
    event's fold; None for the events about no one request)."""
    INPUT_EFFECTS.get(event.__class__, _revoke)(index, event, before, after, config)


def apply_decision(
    index: ChunkIndex,
    decision: ev.DecisionEvent,
    config: TrackerConfig,
    state: RequestState | None = None,
) -> None:
    """Apply the effect of a decision the Tracker just derived, or a recorded one that
    ``tracker.wellformed`` found sound (``state``: the request's state with the decision
    folded in; a save plan's aliases are read from its token ids)."""
    DECISION_EFFECTS.get(decision.__class__, _nothing)(index, decision, None, state, config)


# The input events about no one request that change the index (the pool's own).
_POOL_INPUTS = (ev.ChunkStored, ev.ChunkEvicted)


def apply_recorded(
    index: ChunkIndex,
    event: ev.Event,
    before: RequestState | None,
    after: RequestState | None,
    config: TrackerConfig,
) -> None:
    """Apply one event of a recorded log, in log order, as the recording Tracker applied it:
    the remote store's facts, the Tracker's own decisions, the pool's events, and the input
    facts of a request it knew (``after``: the request's state after the event's fold, None
    for an unknown request). A reader that folds a log this way holds the run's index."""
    cls = event.__class__
    if cls in REMOTE_TYPES:
        apply_remote(index, event)
    elif cls.KIND == "decision":
        # A log may hold anything (a hostile or damaged one): a malformed plan is left out
        # of the index, and kvledger check names it (tracker/wellformed.py).
        if not malformed(event):
            apply_decision(index, event, config, after)  # type: ignore[arg-type]
    elif after is not None or cls in _POOL_INPUTS:
        apply_input(index, event, before, after, config)
