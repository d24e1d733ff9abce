"""Recorded history, walked as the recording Tracker lived it.

The rules of a request's life outside the fold live here, once, for both readers of them: the
``Tracker`` that writes a log and every reader that walks one back (``kvledger show``,
``stats``, ``timeline``, ``export``, ``diff``). Were they written twice, a view could drift
from what the Tracker did and show a state the run never had.

- **Retirement**: a finished request with no load or save in flight is dropped
  (:func:`retires`); its id is remembered (the last :data:`RETIRED_MEMORY`) so that a late
  event about it is named for what it is.
- **Lives**: vLLM may reuse a request id once the request finished; a ``RequestAdded`` after
  the ``Finished`` starts a new life, labelled ``id#2``, ``id#3`` (:class:`Lives`).
- **Request numbers and steady decode steps**: a ``StepDecoded`` names requests by number
  (``tracker.numbering``); each number stands for one more single-token step of that request
  (:func:`tracker.state.advance_decoded`). A malformed one (a number twice, a negative one:
  ``tracker.wellformed``) advances no request, as in the ``Tracker``.

:func:`walk` folds recorded events, input facts *and* decisions, with
:func:`tracker.state.fold`, so each state it yields is exactly what the recording Tracker held
after that event. It takes any iterable of frames (anything with ``.events``), does no I/O, and
keeps memory to the live requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.decoded import entries as decoded_entries
from kvledger.tracker.numbering import RequestNumbers
from kvledger.tracker.state import Phase, RequestState, advance_decoded, fold, learn_decoded
from kvledger.tracker.wellformed import sound

__all__ = [
    "GLOBAL_TYPES",
    "POOL",
    "RETIRED_MEMORY",
    "Folded",
    "Labelled",
    "Lives",
    "idle",
    "labelled",
    "retires",
    "walk",
]

# Finished request ids remembered after retirement: the Tracker, to name a late event about
# one `event_after_finish`; a reader, to number a reused id's next life.
RETIRED_MEMORY = 65536

# req_id (and life label) of the events about no one request.
POOL = ""

# Events about no one request (their req_id is empty): the pool's own, StepDecoded (one
# steady decode step of several requests, named by their request numbers), and the
# recorder's global facts.
GLOBAL_TYPES: tuple[type[ev.Event], ...] = (
    ev.ChunkStored,
    ev.ChunkEvicted,
    ev.StepDecoded,
    ev.RemoteOutage,
    ev.RemoteRestored,
    # The recorder's (connector/recorder.py): block-level and stats facts, and a raise or a
    # lost record that concerned no one request.
    ev.InnerLoadErrors,
    ev.InnerStats,
    ev.InnerRaised,
    ev.RecordLost,
    ev.InnerStored,
    ev.InnerRemoved,
)


def idle(state: RequestState) -> bool:
    """No save or load of the request is in flight."""
    return not state.save.pending and (state.load is None or state.load.done)


def retires(state: RequestState) -> bool:
    """Finished and idle: the Tracker drops the request; a walk forgets its state."""
    return state.phase is Phase.FINISHED and idle(state)


class Lives:
    """Names each request's life: its id, then ``id#2``, ``id#3`` when vLLM reuses an id after
    the request finished. A late event of a finished life (a save result) keeps that life's
    name. Memory: the live requests, plus the last :data:`RETIRED_MEMORY` finished ids."""

    __slots__ = ("count", "live")

    def __init__(self) -> None:
        self.live: dict[str, tuple[str, int]] = {}  # req_id -> (label, life number)
        self.count: OrderedDict[str, int] = OrderedDict()  # finished ids -> lives so far

    def label(self, rid: str, cls: type[ev.Event]) -> tuple[str, bool]:
        """(label, new): the life an event of type ``cls`` about ``rid`` belongs to; ``new``
        when it starts one."""
        current = self.live.get(rid)
        if current is None:
            lives = self.count.get(rid)
            if cls is not ev.RequestAdded and lives is not None:
                return (rid if lives == 1 else f"{rid}#{lives}"), False  # a late event
            n = self.count.pop(rid, 0) + 1
            label = rid if n == 1 else f"{rid}#{n}"
            if cls is ev.Finished:  # a life of one event (unknown request)
                self._retire(rid, n)
            else:
                self.live[rid] = (label, n)
            return label, True
        if cls is ev.Finished:
            del self.live[rid]
            self._retire(rid, current[1])
        return current[0], False

    def _retire(self, rid: str, n: int) -> None:
        self.count[rid] = n
        if len(self.count) > RETIRED_MEMORY:
            self.count.popitem(last=False)


class _HasEvents(Protocol):
    @property
    def events(self) -> Sequence[ev.Event]: ...


class Labelled(NamedTuple):
    """One recorded event with its position in the log and its request's life."""

    pos: int  # position of the event in the log (0-based, over all events)
    frame: Any  # what the event was read from (``tracker.framing.Frame`` for a log)
    event: ev.Event
    life: str  # the life label (:data:`POOL` for the events about no one request)
    new: bool  # the event starts that life


class Folded(NamedTuple):
    """One recorded event with its request's state before and after it. A ``StepDecoded``
    comes once as itself (``req_id`` :data:`POOL`, no states), then once per request it
    names, with that request's id, life and states."""

    pos: int
    frame: Any
    event: ev.Event
    req_id: str
    life: str
    new: bool
    before: RequestState | None
    after: RequestState | None


def labelled(frames: Iterable[_HasEvents]) -> Iterator[Labelled]:
    """Every event with its position and its request's life label; the events about no one
    request (ChunkStored, ChunkEvicted, StepDecoded) under :data:`POOL`. No fold: cheap."""
    lives = Lives()
    live_get = lives.live.get
    label = lives.label
    added, finished = ev.RequestAdded, ev.Finished
    pos = -1
    # A NamedTuple built through tuple.__new__: a quarter of the cost of calling the class,
    # on the path every reader takes for every event.
    new = tuple.__new__
    for frame in frames:
        for e in frame.events:
            pos += 1
            cls = e.__class__
            if cls is not added and cls is not finished:
                current = live_get(e.req_id)
                if current is not None:  # the hot path: an event of a live request
                    yield new(Labelled, (pos, frame, e, current[0], False))
                    continue
                if not e.req_id and cls in GLOBAL_TYPES:
                    yield new(Labelled, (pos, frame, e, POOL, False))
                    continue
            name, starts = label(e.req_id, cls)
            yield new(Labelled, (pos, frame, e, name, starts))


def walk(
    frames: Iterable[_HasEvents],
    config: TrackerConfig,
    want: Callable[[str], bool] | None = None,
    *,
    recorded: bool = False,
) -> Iterator[Folded]:
    """Fold the recorded events request by request, as the recording Tracker did, and yield
    each with its request's state before and after it (see :class:`Folded`).

    ``want(req_id)`` limits what is yielded (every request is still folded: request numbers
    depend on all of them); without it the events about no request are yielded too. A retired
    request's state is dropped: memory follows the live requests. ``recorded``: a recorder's
    log, whose writer numbered every request it logged, where the Tracker numbers only those
    its fold gives a state (``tracker.numbering``)."""
    states: dict[str, RequestState] = {}
    get = states.get
    lives = Lives()
    live = lives.live
    numbers = RequestNumbers()
    req_of = numbers.req_of
    added, finished, decoded = ev.RequestAdded, ev.Finished, ev.StepDecoded
    pos = -1
    # A NamedTuple built through tuple.__new__: a quarter of the cost of calling the class,
    # on the path every reader takes for every event.
    new = tuple.__new__
    for frame in frames:
        for e in frame.events:
            pos += 1
            cls = e.__class__
            rid = e.req_id
            if not rid and cls in GLOBAL_TYPES:
                if want is None:
                    yield new(Folded, (pos, frame, e, POOL, POOL, False, None, None))
                if cls is decoded and sound(e):  # a malformed one advances no request
                    assert isinstance(e, ev.StepDecoded)
                    # A recorder's log carries each step's token id (kvledger's own does not);
                    # an unknown number is skipped here and named by kvledger check.
                    for _, r, block, token in decoded_entries(e, req_of)[0]:
                        state = get(r)
                        if state is None:
                            continue
                        # As the recording Tracker did (it validates only on replay).
                        advanced = advance_decoded(state, 1, () if block is None else (block,))
                        if token is not None:
                            advanced = learn_decoded(advanced, token, e, config)
                        states[r] = advanced
                        if want is None or want(r):
                            label = live[r][0] if r in live else r
                            yield new(Folded, (pos, frame, e, r, label, False, state, advanced))
                continue
            current = live.get(rid)
            if current is not None and cls is not added and cls is not finished:
                label, new_life = current[0], False
            else:
                label, new_life = lives.label(rid, cls)
            before = get(rid)
            after: RequestState | None = None
            if before is not None or cls is added:
                after = fold(before, e, config)[0]
                if after is not None:
                    if retires(after):
                        states.pop(rid, None)
                    else:
                        states[rid] = after
            # The writer's numbering: the Tracker's follows what its fold accepted; a
            # recorder's, every RequestAdded and Finished it logged.
            if (cls is added or cls is finished) and (recorded or after is not None):
                numbers.follow(e)
            if want is None or want(rid):
                yield new(Folded, (pos, frame, e, rid, label, new_life, before, after))
