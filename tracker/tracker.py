"""Tracker: applies events, keeps the live states and the chunk index, derives decisions,
runs invariants, writes the log, and reports violations.

The four verbs: ``apply(event) -> decisions``, ``end_step()``, ``state(req_id)``, ``close()``.
The named helpers (``lookup``, ``scheduled``, ...) only build the input event for the current
step and call ``apply``. A replay builds a Tracker without a log and feeds it the recorded
input events: the decisions it returns are what this code decides now.

A violation never raises (unless ``strict``): it is recorded as a ``ViolationRecorded`` event,
counted, told to the ``logger`` the caller passed (the connector passes its structlog logger; a
replay passes none), and the request falls back to recompute (no load, no save) for the rest
of its life. The core itself writes nowhere: with no logger it is silent (:data:`SILENT`).
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from kvledger.tracker import decoded, invariants
from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.codec import EncodeError, escaped
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import DIGEST_TYPES, DigestBook
from kvledger.tracker.history import RETIRED_MEMORY, retires
from kvledger.tracker.index_fold import apply_decision, apply_input
from kvledger.tracker.numbering import NUMBERED, RequestNumbers
from kvledger.tracker.plans import answer_lookup, plan_load, plan_save
from kvledger.tracker.remote import REMOTE_TYPES, apply_remote, foreign_violations
from kvledger.tracker.state import (
    Phase,
    RequestState,
    advance_decoded,
    fold,
    steady_decode,
    steady_limit,
)
from kvledger.tracker.violation import InvariantViolation, Violation
from kvledger.tracker.wellformed import Wellformed, sound_but_nums

__all__ = ["SILENT", "LogSink", "Tracker", "close_log", "seal_log"]

# Keys of the violation log record that a violation's detail must not shadow.
_RESERVED_LOG_KEYS = frozenset({"event", "event_type", "req_id", "step", "rule", "state"})


class LogSink(Protocol):
    """Where events go: ``connector.logwriter.LogWriter`` or anything with these two methods."""

    def append(self, event: ev.Event) -> None: ...

    def end_step(self, step: int) -> None: ...


# A sink may also close and seal (LogWriter does; a list in a test does not). The Tracker and
# connector/recording.py's recorder both end their logs through these two, so a failing close
# or seal is handed to the owner's failure path the same way in both.


def seal_log(log: Any, stop: str, failed: Callable[[Exception], None]) -> bool:
    """``log.seal(stop)`` if it has one; an error goes to ``failed``. False: not sealed."""
    sealer = getattr(log, "seal", None)
    if sealer is None:
        return False
    try:
        return bool(sealer(stop))
    except Exception as exc:
        failed(exc)
        return False


def close_log(log: Any, failed: Callable[[Exception], None]) -> None:
    """``log.close()`` if it has one; an error goes to ``failed``."""
    closer = getattr(log, "close", None)
    if closer is not None:
        try:
            closer()
        except Exception as exc:
            failed(exc)


class _Hot:
    """The hot path's view of one live request, derived when first read after its state was
    stored (``Tracker.decode_step_ok``). Derived only; never the source of truth. (A slotted
    class: its attributes read faster than a NamedTuple's, and ``decode_step_ok`` reads them
    for every request every step.)"""

    __slots__ = ("capacity", "limit", "num", "num_tokens")

    def __init__(self, num: int, num_tokens: int, limit: int, capacity: int) -> None:
        self.num = num  # its request number
        self.num_tokens = num_tokens  # tokens its state counts (pending steps not included)
        self.limit = limit  # steady_limit(state): the highest num_tokens steady steps reach
        self.capacity = capacity  # tokens its block table holds (pending blocks not included)


# The offset of a position no member of the batch holds: no count of vLLM's matches it.
_NEVER = -(1 << 62)


class _Decoding:
    """The requests of the steady decode steps a replay applies (``StepDecoded``), and for
    each the steps it may still take steadily, as two bounds in one shared count of steps:
    request ``num`` is steady at step count ``s`` iff ``cap[num] >= s`` (its block table,
    appended blocks included) and ``lim[num] >= s`` (``steady_limit``). This is
    ``steady_decode``'s test, rearranged so that a step of the same requests costs the same
    for 8 requests as for 800: the shared count goes up by one, and each request's own count
    of steps not yet folded is that count less ``base[num]``, added to ``Tracker._pending``
    only when someone reads the request (:meth:`settle`). The two minimums are kept as lower
    bounds, computed again (one ``min`` in C) only when one falls below the count. A request
    whose state changed since (``dirty``, told by ``Tracker._store``) or that just joined has
    its bounds derived again from its state; one whose number was given back leaves.

    The connector's steady step (:meth:`Tracker.decode_batch`) is checked the same way, with
    one more bound: vLLM's ``num_computed`` must be the count the request's state gives it,
    ``off[num]`` plus the shared count, compared for the whole step in one ``map`` in C."""

    __slots__ = (
        "aligned",
        "base",
        "cap",
        "dirty",
        "lim",
        "min_cap",
        "min_lim",
        "nums",
        "off",
        "req",
        "steps",
    )

    def __init__(self) -> None:
        self.nums: tuple[int, ...] = ()
        self.cap: dict[int, int] = {}
        self.lim: dict[int, int] = {}
        self.req: dict[int, str] = {}
        self.base: dict[int, int] = {}  # the count when the request's steps were last settled
        # Tokens the request's state counts, less the shared count (both when derived).
        self.off: dict[int, int] = {}
        # ``off`` in the order of ``nums`` (None: derive it again), for the connector's step.
        self.aligned: list[int] | None = None
        self.min_cap = self.min_lim = 0
        self.dirty: set[str] = set()
        self.steps = 0

    def settle(self, t: Tracker, num: int) -> None:
        """Add the request's steps taken in the batch since the last settle to
        ``t._pending``: what a reader of its state must fold in first (nothing for a number
        not in the batch)."""
        base = self.base.get(num)
        if base is not None and base != self.steps:
            t._pending[self.req[num]] += self.steps - base
            self.base[num] = self.steps

    def settle_all(self, t: Tracker) -> None:
        for num in self.base:
            self.settle(t, num)

    def drop(self, t: Tracker, num: int) -> None:
        if num in self.base:
            self.settle(t, num)
            del self.cap[num], self.lim[num], self.req[num], self.base[num], self.off[num]
            self.nums = ()
            self.aligned = None

    def _derive(self, t: Tracker, num: int, req_id: str | None) -> bool:
        state = t._states.get(req_id) if req_id is not None else None
        if state is None or req_id is None:
            return False
        self.settle(t, num)
        config = t.config
        tokens = state.num_tokens + t._pending.setdefault(req_id, 0)
        grown = t._pending_blocks.get(req_id)
        capacity = (len(state.block_ids) + (len(grown) if grown else 0)) * config.block_size
        cap = self.cap[num] = capacity - tokens + self.steps
        lim = self.lim[num] = steady_limit(state, config) - tokens + self.steps
        self.min_cap = min(self.min_cap, cap)
        self.min_lim = min(self.min_lim, lim)
        self.req[num] = req_id
        self.base[num] = self.steps
        self.off[num] = tokens - self.steps
        self.aligned = None
        return True

    def _follow(self, t: Tracker, nums: tuple[int, ...], *, strict: bool) -> bool:
        """Make the batch the requests of ``nums``: those no longer named leave, those that
        joined or changed since (``dirty``) have their bounds derived again. One that cannot
        be (no live state): ``strict`` (a replay), False at once, and the caller checks the
        step request by request; else (the connector) it stays out of the batch. A replay's
        numbers are also refused when one is named twice (the connector's ``-1`` repeats)."""
        cap = self.cap
        joined: Iterable[int] = ()
        if nums is not self.nums and nums != self.nums:
            now = set(nums)
            if strict and len(now) != len(nums):
                return False  # a number twice: the record is malformed (field_repeated)
            joined = now - cap.keys()
            # Members not named leave; when the new ones make up the difference, none left
            # (a finished request left at its Finished already: the common case).
            if len(now) - len(joined) != len(cap):
                for num in cap.keys() - now:
                    self.drop(t, num)
            self.nums = nums
        # The members whose state changed, before those that joined: a request that joined
        # this step changed too (its admission was stored), and is derived once, below.
        if self.dirty:
            num_of = t._num_of
            for req_id in self.dirty:
                changed = num_of.get(req_id)
                if changed is not None and changed in cap and not self._derive(t, changed, req_id):
                    if strict:
                        return False
                    self.drop(t, changed)
            self.dirty.clear()
        if joined:
            req_of = t._req_of
            for num in joined:
                if not self._derive(t, num, req_of.get(num)) and strict:
                    return False
        return True

    def _bounds_hold(self, s: int) -> bool:
        """Whether every member may take step count ``s`` steadily. The minimums are lower
        bounds (a capacity only grows until derived again, a derivation lowers them), so
        they are computed again, in C, only when one falls below ``s``."""
        if self.min_cap < s:
            self.min_cap = min(self.cap.values(), default=s)
        if self.min_lim < s:
            self.min_lim = min(self.lim.values(), default=s)
        return self.min_cap >= s and self.min_lim >= s

    def take(
        self,
        t: Tracker,
        nums: tuple[int, ...],
        num_computed: Sequence[int],
        grown: Mapping[int, int],
    ) -> list[int]:
        """The connector's step (see :meth:`Tracker.decode_batch`): advance the requests of
        ``nums`` that are steady (a request without a number is ``-1``, never a member);
        return the positions of the others, in order. Those leave the batch, their steps so
        far settled, and are derived again when they come back."""
        cap, lim = self.cap, self.lim
        self._follow(t, nums, strict=False)
        aligned = self.aligned
        if aligned is None:
            off = self.off
            # A position no member holds can never match: it is checked one by one.
            aligned = self.aligned = [off.get(num, _NEVER) for num in nums]
        steps = self.steps
        bad: list[int] = []
        moved = [*map(operator.sub, num_computed, aligned)]
        if moved.count(steps) != len(moved):  # counted: a set hashed every one
            bad = [
                i
                for i, (c, o) in enumerate(zip(num_computed, aligned, strict=True))
                if c - o != steps
            ]
        b = t.config.block_size
        for i in grown:
            if nums[i] in cap:
                cap[nums[i]] += b
        s = steps + 1
        if not self._bounds_hold(s):
            short = {num for num in cap if cap[num] < s or lim[num] < s}
            bad = sorted({*bad, *(i for i, num in enumerate(nums) if num in short)})
        for i in bad:
            num = nums[i]
            if num in cap:
                if i in grown:
                    cap[num] -= b
                self.drop(t, num)
        self.steps = s
        if grown:
            req, blocks = self.req, t._pending_blocks
            for i, block in grown.items():
                num = nums[i]
                if num in req:
                    blocks.setdefault(req[num], []).append(block)
        return bad

    def step(self, t: Tracker, event: ev.StepDecoded) -> bool:
        """Apply ``event`` if every request it names is steady (True); else change nothing
        that a reader could tell (False: the caller settles the batch and checks the
        requests one by one)."""
        nums, cap = event.nums, self.cap
        grown = event.block_pairs()
        # After _follow the batch's members are exactly the numbers of ``nums``.
        if (
            grown is None
            or not self._follow(t, nums, strict=True)
            or not grown.keys() <= cap.keys()
        ):
            return False
        b = t.config.block_size
        for num in grown:
            cap[num] += b
        s = self.steps + 1
        if not self._bounds_hold(s):
            for num in grown:
                cap[num] -= b
            return False
        self.steps = s
        if grown:
            req, blocks = self.req, t._pending_blocks
            for num, block in grown.items():
                blocks.setdefault(req[num], []).append(block)
        return True


# The inputs the Tracker derives decisions from (``_decide``): an event of another type
# skips that call.
_DECIDED: Final = frozenset({ev.LookupAsked, ev.Scheduled})


class _Silent:
    """A logger that tells nobody: the default of a Tracker whose caller passed none (a replay,
    a test, a library user). Violations are still recorded and counted."""

    def warning(self, *_: Any, **__: Any) -> None:
        pass

    error = warning


SILENT = _Silent()


class Tracker:
    """Holds the per-request states and the chunk index; the only way in is an event."""

    def __init__(
        self,
        config: TrackerConfig | None = None,
        *,
        log: LogSink | None = None,
        logger: Any = None,
    ) -> None:
        self.config = config or TrackerConfig()
        self.index = ChunkIndex(self.config.num_slots)
        self._states: dict[str, RequestState] = {}
        # Steady decode steps folded lazily (StepDecoded): req id -> steps not applied yet.
        # A Counter: a step counts every request of a replayed batch in one C call.
        self._pending: Counter[str] = Counter()
        # Blocks appended by those steps: req id -> block ids not applied yet.
        self._pending_blocks: dict[str, list[int]] = {}
        self._hot: dict[str, _Hot] = {}
        # How many more steady steps each request of the last replayed StepDecoded may take
        # (None: none replayed yet): a replay checks a step against these in C (_Decoding).
        self._decoding: _Decoding | None = None
        # Request numbers for StepDecoded: the lowest free number, taken at RequestAdded,
        # freed at Finished; a replay of the same events assigns the same numbers.
        self._numbers = RequestNumbers()
        self._num_of = self._numbers.num_of  # read on the hot path
        self._req_of = self._numbers.req_of
        # The last step's request ids (a copy), the numbering's version then, and their
        # numbers: for the connector's steady step (_nums_of).
        self._ids_seen: tuple[list[str], int, tuple[int, ...]] | None = None
        self.violations: list[Violation] = []
        self.step = 0
        self.counts: dict[str, int] = {
            "events": 0,
            "decisions": 0,
            "preemptions": 0,
            "tokens_loaded": 0,
            "tokens_saved": 0,
            "finished": 0,
        }
        self._log = log
        # A sink that takes a steady step's parts (LogWriter.append_decoded), or None.
        self._append_decoded: Callable[[int, Sequence[int], Sequence[int]], None] | None = getattr(
            log, "append_decoded", None
        )
        # Why the log stopped being written, if it did (the engine goes on without it).
        self.log_error: str | None = None
        # What the shell wants told (a structlog-shaped logger); the core itself writes nowhere.
        self._logger = logger if logger is not None else SILENT
        self._retired: OrderedDict[str, None] = OrderedDict()
        # Chunks a request's load will read, pinned from its Allocated (vLLM committed to the
        # external tokens) until its admission's LoadPlanned pins them itself: in between,
        # another request's save in the same step must not evict them.
        self._reserved: dict[str, tuple[bytes, ...]] = {}
        # The KV-content digests recorded so far, and the rules that judge a load by them
        # (tracker/digests.py).
        self.digests = DigestBook()
        # What no event can say (tracker/wellformed.py), asked about every event applied.
        self._wellformed = Wellformed()

    # --- the core verb ------------------------------------------------------------------

    def apply(self, event: ev.Event) -> list[ev.DecisionEvent]:
        """Fold an input event, derive and fold its decisions, check, log. Never raises for
        bad input unless the configuration is strict."""
        self.counts["events"] += 1
        if event.__class__ is ev.StepDecoded and self._batch_takes(event):
            return []
        handler = _APPLY.get(event.__class__, Tracker._apply_request_event)
        found = self._wellformed.check(event)
        if found:
            return self._apply_malformed(event, handler, found)
        return handler(self, event)

    def _apply_malformed(
        self,
        event: ev.Event,
        handler: Callable[[Tracker, Any], list[ev.DecisionEvent]],
        found: list[Violation],
    ) -> list[ev.DecisionEvent]:
        """An event that says something impossible (tracker/wellformed.py), each rule it
        breaks a violation. A fact about one request is folded as any other (the fold is
        total) and the request falls back to recompute before anything is decided for it.
        The pool's, the remote store's and the digests' folds take in nothing malformed
        (nothing says which part of it is right), and a malformed ``StepDecoded`` advances
        no request: the request it names is checked at its next event."""
        if handler is Tracker._apply_request_event:
            return self._apply_request_event(event, tuple(found))
        if event.__class__ is ev.StepDecoded:
            self._record(event, ())
            decisions: list[ev.DecisionEvent] = []
        else:
            decisions = handler(self, event)
        state = self.state(event.req_id) if event.req_id else None
        if state is not None and not state.recompute_only:
            state = state._replace(recompute_only=True)
            self._store(event.req_id, state)
        return decisions + self._report(found, state)

    def _apply_pool_event(self, event: ev.Event) -> list[ev.DecisionEvent]:
        """ChunkStored, ChunkEvicted: the index alone changes."""
        apply_input(self.index, event, None, None, self.config)
        self._record(event, ())
        return []

    def _apply_remote_event(self, event: ev.Event) -> list[ev.DecisionEvent]:
        """The remote tier's facts: the index's remote keys alone change (tracker/remote.py).
        A value that was not its chunk's is a violation (``foreign_value``) that changes no
        request: nothing of it was loaded, and the request's own save heals the tier."""
        apply_remote(self.index, event)
        self._record(event, ())
        found = foreign_violations(event)
        return self._report(found, self.state(event.req_id)) if found else []

    def _apply_digest_event(self, event: ev.Event) -> list[ev.DecisionEvent]:
        """The worker's digests (BlockDigested, LoadDigested): the digest book alone changes;
        a load that broke a digest rule is a violation of its request, which falls back to
        recompute (its KV is wrong: nothing more of it is saved)."""
        found = self.digests.apply(event)
        self._record(event, ())
        decisions: list[ev.DecisionEvent] = []
        for v in found:
            state = self.state(v.req_id)
            if state is not None and not state.recompute_only:
                state = state._replace(recompute_only=True)
                self._store(v.req_id, state)
            if v.step != event.step:
                # Judged at the load's step; recorded in this step's frame, saying which.
                v = attrs.evolve(v, step=event.step, detail={**v.detail, "load_step": v.step})
            decisions.extend(self._report((v,), state))
        return decisions

    def _apply_request_event(
        self, event: ev.Event, malformed: tuple[Violation, ...] = ()
    ) -> list[ev.DecisionEvent]:
        config = self.config
        req_id = event.req_id
        if req_id in self._pending:
            self._materialize(req_id)
        before = self._states.get(req_id)
        if before is None and req_id in self._retired and not isinstance(event, ev.RequestAdded):
            violations: tuple[Violation, ...] = (
                Violation("event_after_finish", event.step, req_id, type(event).__name__, {}),
            )
            self._record(event, ())
            reported = self._report(malformed, None)
            self._report(violations, None)
            return reported
        reserved = self._reserved.pop(req_id, ())  # released once this event is decided
        state, violations = fold(before, event, config)
        violations = malformed + violations
        if state is not None:
            apply_input(self.index, event, before, state, config)
            if before is not None and state.life.num_preemptions > before.life.num_preemptions:
                self.counts["preemptions"] += 1  # signalled or inferred, counted once
            # Check the input's invariants before deciding: a request whose state is already
            # wrong (tokens beyond its blocks, say) must get no load and no save this step,
            # only a refusal. Checked after planning, the plans went out regardless.
            violations = violations + tuple(invariants.check(state, event, config))
        if violations and state is not None:
            state = state._replace(recompute_only=True)

        decisions: list[ev.DecisionEvent] = []
        if state is not None:
            cls = event.__class__
            if cls in _DECIDED:  # only these derive decisions (most events do not)
                state, decisions, more = self._decide(state, event)
                violations = violations + more
                checked: list[Violation] = []
                for d in decisions:
                    checked.extend(invariants.check(state, d, config))
                if checked:
                    violations = violations + tuple(checked)
                    state = state._replace(recompute_only=True)
            if cls is ev.Allocated and not state.recompute_only:
                self._reserve(state, event.step)
            if cls is ev.Finished:
                self._stop_decoding(req_id)  # a finished request never decodes again
            if cls in NUMBERED:
                self._numbers.follow(event)
            self._store(req_id, state)
            if retires(state):
                self._retire(req_id)
        if reserved:
            self.index.unpin(reserved)
        if self._log is not None:
            self._record(event, decisions)
        if violations:
            decisions.extend(self._report(violations, state))
        return decisions

    def end_step(self) -> int:
        """Close the current step: its events become one log frame. Returns the next step."""
        if self._log is not None:
            try:
                self._log.end_step(self.step)
            except Exception as exc:
                self._log_failed(exc)
        self.step += 1
        return self.step

    def recomputing(self, req_id: str) -> bool:
        """Whether the request fell back to recompute (a broken rule, a refused load): read
        without folding its pending steady steps in, which never change it."""
        state = self._states.get(req_id)
        return state is not None and state.recompute_only

    def state(self, req_id: str) -> RequestState | None:
        if req_id in self._pending:
            self._materialize(req_id)
        return self._states.get(req_id)

    @property
    def states(self) -> dict[str, RequestState]:
        """The live states (every pending steady decode step folded in first)."""
        for req_id in list(self._pending):
            self._materialize(req_id)
        return self._states

    # --- steady decode: the hot path -----------------------------------------------------

    def entries_of(self, event: ev.StepDecoded) -> tuple[list[decoded.Entry], list[Violation]]:
        """``event``'s entries under this tracker's numbering (``tracker.decoded.entries``):
        for a reader that splits a steady step request by request (a what-if replay)."""
        return decoded.entries(event, self._req_of)

    def decode_step_ok(
        self, req_id: str, num_computed: int, new_block: int | None = None
    ) -> int | None:
        """The request's number if its single-token step, at vLLM's ``num_computed`` and with
        at most one new block, is steady (see ``StepDecoded``); None: use ``scheduled``.
        A few integer comparisons: the bounds are derived once after the state last changed."""
        if self._decoding is not None:  # a replay's batch counts its steps lazily
            self._end_batch()
        hot = self._hot.get(req_id)
        if hot is None:
            num = self._num_of.get(req_id)
            state = self._states.get(req_id)
            if num is None or state is None:
                return None
            hot = self._hot[req_id] = _Hot(
                num,
                state.num_tokens,
                steady_limit(state, self.config),
                len(state.block_ids) * self.config.block_size,
            )
        expected = hot.num_tokens + self._pending.get(req_id, 0)
        if num_computed != expected or expected + 1 > hot.limit:
            return None
        capacity = hot.capacity
        grown = self._pending_blocks.get(req_id)
        if grown:
            capacity += len(grown) * self.config.block_size
        if new_block is not None:
            capacity += self.config.block_size
        if expected + 1 > capacity:
            return None
        return hot.num

    def decode_batch(
        self, req_ids: Sequence[str], num_computed: Sequence[int], grown: Mapping[int, int]
    ) -> tuple[list[int], Sequence[int], list[tuple[int, int]]]:
        """The connector's steady step as a batch: ``req_ids`` were each scheduled exactly one
        token at vLLM's ``num_computed`` (the same positions), none resumed; ``grown`` maps a
        position to the one block its table grew by. Those that ``decode_step_ok`` would take
        are counted as it would count them, in one shared count (``_Decoding``), so that a
        step of the requests of the step before costs the same for 8 as for 800. Returns the
        positions of the others (for the caller to schedule one by one), and the numbers and
        (number, block) pairs of those counted, for :meth:`record_decoded`."""
        if self._decoding is None:
            self._decoding = _Decoding()
        nums = self._nums_of(req_ids)
        bad = self._decoding.take(self, nums, num_computed, grown)
        if not bad:
            return bad, nums, [(nums[i], block) for i, block in grown.items()]
        out = set(bad)
        steady = [n for i, n in enumerate(nums) if i not in out]
        pairs = [(nums[i], block) for i, block in grown.items() if i not in out]
        return bad, steady, pairs

    def _nums_of(self, req_ids: Sequence[str]) -> tuple[int, ...]:
        """The numbers of ``req_ids`` (-1: none). A step's list of vLLM's that equals the step
        before's, under the same numbering (nothing taken or given back since), has the same
        numbers: the list comparison reads only pointers (vLLM hands the same string objects
        every step), where looking each id up reads every string, cold by then."""
        seen = self._ids_seen
        version = self._numbers.version
        if seen is not None and seen[1] == version and type(req_ids) is list and req_ids == seen[0]:
            return seen[2]
        nums = tuple(map(self._num_of.get, req_ids, itertools.repeat(-1)))
        self._ids_seen = (list(req_ids), version, nums)
        return nums

    def record_decoded(self, nums: Sequence[int], grown: Sequence[tuple[int, int]] = ()) -> None:
        """Write the ``StepDecoded`` of steps already counted (:meth:`decode_batch`)."""
        if not nums:
            return
        self.counts["events"] += 1
        if self._log is None:
            return  # nothing reads the event but the log: not built (a step's hot path)
        flat = tuple(itertools.chain.from_iterable(grown))
        if self._append_decoded is None:
            self._record(ev.StepDecoded(self.step, "", tuple(nums), flat), ())
            return
        # The sink builds the event where it packs it (LogWriter.append_decoded): off vLLM's
        # scheduler thread when the log has its own.
        try:
            self._append_decoded(self.step, nums, flat)
        except Exception as exc:
            self._log_failed(exc)

    def decoded(self, nums: Sequence[int], grown: Sequence[tuple[int, int]] = ()) -> None:
        """Record one step of steady decodes for these request numbers, each admitted by
        ``decode_step_ok`` in this step (so not checked again; a replay checks them);
        ``grown``: (number, block id) of those whose table grew by one block."""
        if not nums:
            return
        if self._decoding is not None:
            self._end_batch()
        req_of = self._req_of
        # Every request counted in one C call (Counter.update): a third of a Python loop's
        # cost alone (27 against 91 us for 256 requests, timeit); bench/scheduler_overhead.py
        # could not tell it from its noise (docs/performance.md).
        self._pending.update(map(req_of.__getitem__, nums))
        for num, block in grown:
            self._pending_blocks.setdefault(req_of[num], []).append(block)
        self.record_decoded(nums, grown)

    def _store(self, req_id: str, state: RequestState) -> None:
        self._states[req_id] = state
        if self._decoding is not None:
            self._decoding.dirty.add(req_id)
        # Derived again when next read (decode_step_ok): a replay and the connector's batch
        # never read it, and most states are stored several times a step.
        self._hot.pop(req_id, None)

    def _batch_takes(self, event: ev.StepDecoded) -> bool:
        """Apply a replay's steady step as a batch (_Decoding), if every request it names is
        steady (True). Most steps are the last one's requests again. Its numbers' own rules
        (none negative, none twice) are the batch's to prove: each number it takes names a
        live request, and it counts them whenever they change; the record's other rules are
        checked here (``sound_but_nums``). A step it refuses, well-formed or not, goes the
        way of every other event: :meth:`apply` checks it whole, and
        :meth:`_apply_step_decoded` takes it request by request."""
        if not event.nums or not sound_but_nums(event):
            return False
        if self._decoding is None:
            self._decoding = _Decoding()
        if self._decoding.step(self, event):
            self._record(event, ())
            return True
        self._end_batch()  # the requests below change one by one: start again
        return False

    def _apply_step_decoded(self, event: ev.StepDecoded) -> list[ev.DecisionEvent]:
        # A recorded event is validated with the same bound that admitted it to the fast
        # path, so a replay of a wrong log names the request and the step; reached only
        # when the batch (_batch_takes) cannot tell every request steady.
        pending, states, config = self._pending, self._states, self.config

        def judge(entry: decoded.Entry) -> Violation | None:
            num, req_id, block, _ = entry
            state = states.get(req_id)
            if state is None:
                # A number whose request holds no state: nothing to advance, none to name.
                return decoded.unknown(event, num)
            k = pending.get(req_id, 0)
            grown = self._pending_blocks.get(req_id, [])
            if not steady_decode(state, config, k, len(grown) + (block is not None)):
                self._materialize(req_id)
                self._store(req_id, states[req_id]._replace(recompute_only=True))
                return decoded.not_steady(event, req_id, num_tokens=state.num_tokens + k)
            pending[req_id] = k + 1
            if block is not None:
                self._pending_blocks.setdefault(req_id, []).append(block)
            return None

        bad = decoded.entries(event, self._req_of, judge=judge)[1]
        self._record(event, ())
        return self._report(bad, None) if bad else []

    def _end_batch(self) -> None:
        """Every step a replay's batch took, into ``_pending``; no batch until the next
        ``StepDecoded``."""
        if self._decoding is not None:
            self._decoding.settle_all(self)
            self._decoding = None

    def _materialize(self, req_id: str) -> None:
        num = self._num_of.get(req_id)
        if self._decoding is not None and num is not None:
            self._decoding.settle(self, num)
        k = self._pending.pop(req_id, 0)
        blocks = self._pending_blocks.pop(req_id, ())
        state = self._states.get(req_id)
        if k and state is not None:
            self._store(req_id, advance_decoded(state, k, blocks))

    def _free_number(self, req_id: str) -> None:
        """At Finished: a finished request never decodes again. Freed on this recorded fact
        alone (not on retirement, which waits for transfer results), so a reader resolves
        StepDecoded numbers from RequestAdded and Finished events only."""
        self._stop_decoding(req_id)
        self._numbers.give_back(req_id)

    def _stop_decoding(self, req_id: str) -> None:
        """Before its number is given back (another request may take it): out of the hot
        path's view and out of a replay's batch."""
        self._hot.pop(req_id, None)
        num = self._num_of.get(req_id)
        if self._decoding is not None and num is not None:
            self._decoding.drop(self, num)

    def seal(self, stop: str) -> bool:
        """Make the log complete as of now, and keep it so, for an engine asked to stop
        (``stop`` says how): see ``LogWriter.seal``. Call it only between callbacks, when no
        event is half applied. False when there is no log, or it cannot be sealed."""
        return seal_log(self._log, stop, self._log_failed)

    def close(self) -> None:
        close_log(self._log, self._log_failed)

    def _log_failed(self, exc: Exception) -> None:
        """The log cannot be written (disk full, a failed fsync): say so once, loudly, and go
        on without it. Bookkeeping must never stop the engine; the states stay exact, only the
        record of them ends here."""
        if self.log_error is None:
            self.log_error = f"{type(exc).__name__}: {exc}"
            self._logger.error("kvledger.log_failed", step=self.step, error=self.log_error)
        self._log = None

    # --- decisions ----------------------------------------------------------------------

    def _decide(
        self, state: RequestState, event: ev.Event
    ) -> tuple[RequestState, list[ev.DecisionEvent], tuple[Violation, ...]]:
        config, index = self.config, self.index
        decisions: list[ev.DecisionEvent] = []
        violations: tuple[Violation, ...] = ()

        def take(state: RequestState, d: ev.DecisionEvent) -> RequestState:
            # Fold and apply each decision before deriving the next: the save plan must see
            # the pins of this step's load, or it may evict the very chunks being loaded.
            nonlocal violations
            decisions.append(d)
            after, more = fold(state, d, config)
            violations = violations + more
            apply_decision(index, d, config, after)
            if isinstance(d, (ev.LoadPlanned, ev.SavePlanned)) and d.keys:
                counter = "tokens_loaded" if isinstance(d, ev.LoadPlanned) else "tokens_saved"
                self.counts[counter] += d.end - d.start
            return state if after is None else after  # never None: a known request

        if isinstance(event, ev.LookupAsked):
            hit, external = answer_lookup(state, index, config, event.local_hit, event.num_tokens)
            state = take(state, ev.LookupAnswered(event.step, state.req_id, hit, external))
        elif isinstance(event, ev.Scheduled) and state.phase is Phase.RUNNING:
            if event.admission is not ev.Admission.RUNNING:
                load, refused = plan_load(state, index, config, event.step)
                if load is not None:
                    state = take(state, load)
                    if refused:
                        violations = violations + refused
                        state = state._replace(recompute_only=True)
            if not state.recompute_only:
                save = plan_save(state, index, config, event.step)
                if save is not None:
                    state = take(state, save)
        self.counts["decisions"] += len(decisions)
        return state, decisions, violations

    def _reserve(self, state: RequestState, step: int) -> None:
        load, _ = plan_load(state, self.index, self.config, step)
        if load is not None and load.keys:
            self.index.pin(load.keys)
            self._reserved[state.req_id] = load.keys

    # --- bookkeeping ----------------------------------------------------------------------

    def _retire(self, req_id: str) -> None:
        del self._states[req_id]
        self._pending.pop(req_id, None)
        self._pending_blocks.pop(req_id, None)
        self._free_number(req_id)
        self.counts["finished"] += 1
        self._retired[req_id] = None
        if len(self._retired) > RETIRED_MEMORY:
            self._retired.popitem(last=False)

    def _record(self, event: ev.Event, decisions: Sequence[ev.DecisionEvent]) -> None:
        if self._log is None:
            return
        self._append(event)
        for d in decisions:
            self._append(d)

    def _append(self, event: ev.Event) -> None:
        if self._log is None:
            return
        try:
            self._log.append(event)
        except EncodeError as exc:
            if isinstance(event, ev.ViolationRecorded):
                self._append_escaped(event, exc)
            else:
                self._record_lost(event, exc)
        except Exception as exc:
            self._log_failed(exc)

    def _append_escaped(self, v: ev.ViolationRecorded, exc: EncodeError) -> None:
        """A violation the log cannot hold as it is: its request id, or a text in its detail,
        holds what UTF-8 cannot (a lone surrogate, which a JSON request id can carry into
        vLLM). Written again with those escaped (``\\ud800``), so that a lost record is
        still on record and the rest of the run is logged; the log is given up only when
        even that cannot be written."""
        try:
            assert self._log is not None
            self._log.append(attrs.evolve(v, req_id=escaped(v.req_id), detail=escaped(v.detail)))
        except Exception:
            self._log_failed(exc)  # not even the loss can be written

    def _record_lost(self, event: ev.Event, exc: EncodeError) -> None:
        """One record could not be encoded (a value msgpack cannot hold): it alone is lost.
        The loss takes its place in the log as the violation ``record_lost``, and its request
        falls back to recompute, so the log and a replay of it still agree on that request's
        decisions; every other request's record goes on."""
        self.counts["records_lost"] = self.counts.get("records_lost", 0) + 1
        req_id = event.req_id if isinstance(event.req_id, str) else ""
        if event.__class__ is ev.RequestAdded:
            # A reader numbers requests from their RequestAdded records alone
            # (tracker/numbering.py), and will never see this one: the request gives its
            # number back, so every later number means the same to the log's readers. It
            # then never decodes in a batch; its records go one by one.
            self._free_number(req_id)
        self.mark_violation(req_id, "record_lost", type(event).__name__, reason=str(exc))

    def _report(
        self, violations: Iterable[Violation], state: RequestState | None
    ) -> list[ev.DecisionEvent]:
        recorded: list[ev.DecisionEvent] = []
        for v in violations:
            self.violations.append(v)
            detail = ",".join(f"{k}={val}" for k, val in v.detail.items())
            record = ev.ViolationRecorded(v.step, v.req_id, v.rule, v.event, detail)
            recorded.append(record)
            self._append(record)
            self._logger.warning(
                "kvledger.violation",
                req_id=v.req_id,
                step=v.step,
                rule=v.rule,
                # ``event`` is structlog's own positional (the message): passing it as a
                # keyword raised TypeError on every violation, crashing the caller.
                event_type=v.event,
                **{k: val for k, val in v.detail.items() if k not in _RESERVED_LOG_KEYS},
                state=state.summary() if state is not None else None,
            )
        if self.config.strict and recorded:
            raise InvariantViolation(self.violations[-len(recorded)])
        return recorded

    def mark_violation(self, req_id: str, rule: str, event: str, **detail: Any) -> None:
        """Record a violation found outside the fold (the connector could not read vLLM's
        object, say): the request falls back to recompute like any other violation."""
        state = self.state(req_id)
        if state is not None:
            state = state._replace(recompute_only=True)
            self._store(req_id, state)
        self._report((Violation(rule, self.step, req_id, event, detail),), state)

    # --- one helper per callback: build the event for the current step, apply it ---------

    def add_request(
        self, req_id: str, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> None:
        self.apply(ev.RequestAdded(self.step, req_id, ev.int_tuple(prompt_token_ids), cache_salt))

    def lookup(
        self,
        req_id: str,
        local_hit: int,
        all_token_ids: Sequence[int],
        preempted: bool = False,
    ) -> int:
        """Answer ``get_num_new_matched_tokens``: the external tokens to offer vLLM. Sends the
        tracker only the token ids it does not know yet."""
        state = self.state(req_id)
        start = len(state.token_ids) if state is not None else 0
        start = min(start, len(all_token_ids))
        decisions = self.apply(
            ev.LookupAsked(
                self.step,
                req_id,
                local_hit,
                len(all_token_ids),
                start,
                ev.int_tuple(all_token_ids[start:]),
                preempted,
            )
        )
        for d in decisions:
            if isinstance(d, ev.LookupAnswered):
                return d.external
        return 0

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        self.apply(ev.Allocated(self.step, req_id, ev.int_tuple(block_ids), num_external))

    def scheduled(
        self,
        req_id: str,
        *,
        num_computed: int,
        num_scheduled: int,
        all_token_ids: Sequence[int],
        block_ids: Sequence[int] | None = (),
        admission: ev.Admission = ev.Admission.RUNNING,
    ) -> list[ev.DecisionEvent]:
        """One request's share of ``build_connector_meta``. ``all_token_ids`` is the request's
        full token list as vLLM has it now (it may trail ``num_computed + num_scheduled`` under
        async scheduling); only the unknown tail is recorded."""
        admission = ev.Admission(admission)  # a plain int from a caller is fine too
        state = self.state(req_id)
        known = len(state.token_ids) if state is not None else 0
        start = min(known, len(all_token_ids))
        end = min(len(all_token_ids), num_computed + num_scheduled)
        if admission is not ev.Admission.RUNNING:
            end = len(all_token_ids)  # an admission learns every token vLLM has
        tokens = ev.int_tuple(all_token_ids[start:end]) if end > start else ()
        return self.apply(
            ev.Scheduled(
                self.step,
                req_id,
                num_computed,
                num_scheduled,
                start,
                tokens,
                ev.int_tuple(block_ids or ()),  # vLLM sends None for "no new blocks"
                admission,
            )
        )

    def preempted(self, req_id: str) -> None:
        self.apply(ev.Preempted(self.step, req_id))

    def finished(self, req_id: str, reason: str = "stopped") -> bool:
        """Returns True when saves still read the request's blocks (vLLM must delay freeing)."""
        self.apply(ev.Finished(self.step, req_id, reason))
        state = self.state(req_id)
        return state is not None and bool(state.save.pending)

    def save_done(self, req_id: str, keys: Iterable[bytes]) -> None:
        self.apply(ev.SaveDone(self.step, req_id, tuple(keys)))

    def save_failed(self, req_id: str, keys: Iterable[bytes]) -> None:
        self.apply(ev.SaveFailed(self.step, req_id, tuple(keys)))

    def load_done(self, req_id: str) -> None:
        self.apply(ev.LoadDone(self.step, req_id))

    def load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        self.apply(ev.LoadFailed(self.step, req_id, ev.int_tuple(block_ids)))


# Event types that are not about one request; every other type is. Built after the class, not
# in its body, where mypyc cannot compile a table of the class's own functions
# (bench/compiled_check.py).
_APPLY: Final[dict[type[ev.Event], Callable[[Tracker, Any], list[ev.DecisionEvent]]]] = {
    ev.ChunkStored: Tracker._apply_pool_event,
    ev.ChunkEvicted: Tracker._apply_pool_event,
    ev.StepDecoded: Tracker._apply_step_decoded,
    **dict.fromkeys(REMOTE_TYPES, Tracker._apply_remote_event),
    **dict.fromkeys(DIGEST_TYPES, Tracker._apply_digest_event),
}
