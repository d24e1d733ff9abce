"""``check``: replay a captured log through this code and report every disagreement.

For each recorded **input** event (what a vLLM callback told the connector), in log order, the
replay sets the tracker's step, applies the event to a fresh :class:`~tracker.tracker.Tracker`
built from the configuration in the log header, and compares the decisions it derives now
(``LookupAnswered``, ``LoadPlanned``, ``SavePlanned``, ``ViolationRecorded``) with the decisions
the recorded run logged right after that input. Each disagreement is a :class:`Problem` that
names the step, the request, the input event, what was recorded, what this code derives, and
the request's state before and after. Every rule this code finds broken is a problem too,
whether the run recorded it or not (the run may have been an older version).

A ``ViolationRecorded`` that nothing in the fold can derive (the connector's
``Tracker.mark_violation``, rule ``adapter_error``: it could not read one of vLLM's objects) is
a fact of the run: it is applied as the fold applies it (the request falls back to recompute)
and listed in :attr:`CheckResult.recorded_violations`, not as a problem.

The replay streams: it holds one frame and the live requests' states (the tracker retires
finished requests), never the whole log. A damaged log (torn tail, checksum mismatch, ...)
ends the check after every complete frame before the damage was checked;
:attr:`CheckResult.stop` says where and why, and the exit code is 2.

**What-if.** ``check(path, chunk_size=512)`` replays the recorded inputs under a changed
configuration and compares the plans: tokens loaded and saved, per request and in total,
recorded vs what-if. It is an estimate of the plans, not a re-simulation of vLLM: vLLM's own
later decisions (its schedule, its token counts) stay as recorded. To keep the estimate
meaningful the what-if replay assumes that vLLM accepts what this configuration offers (as far
as the recorded step had room for), and that every planned transfer succeeds: recorded worker
results, which name the recorded run's chunks, are replaced by results for the what-if plans.
Admissions where the offer differs from what vLLM accepted in the run are counted as
*divergent admissions*, not reported as problems.

The two are separate paths over one replay loop (:class:`_Replay`: read the frames, fold each
input, collect the recorded decisions that follow it): :class:`_Check` compares; :class:`_WhatIf`
rewrites the inputs through the loop's two hooks (each frame, each input) and tallies the plans.
A check pays nothing for the what-if's hooks.
"""

from __future__ import annotations

import os
import time
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvledger.replay.counts import moved
from kvledger.replay.malformed import detail_text
from kvledger.replay.naming import RequestNotFound, resolve
from kvledger.replay.recorded import check_recorded_into
from kvledger.replay.results import CheckResult, Problem, RecordedViolation, WhatIf
from kvledger.replay.source import ConfigUnusable, LogPath, LogSource, LogUnreadable, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.config import ConfigError, TrackerConfig
from kvledger.tracker.framing import Frame, LogFormatError
from kvledger.tracker.state import RequestState
from kvledger.tracker.tracker import Tracker
from kvledger.tracker.wellformed import malformed, sound

__all__ = [
    "DIVERGENT_ADMISSION_RULES",
    "EXTERNAL_RULES",
    "CheckResult",
    "Problem",
    "RecordedViolation",
    "WhatIf",
    "check",
    "parse_overrides",
]

# Rules recorded by the connector outside the fold (``Tracker.mark_violation``): facts of the
# run that no replay can derive.
EXTERNAL_RULES = frozenset({"adapter_error"})

# Rules that compare vLLM's counts with what the lookup offered. Under a what-if
# configuration the offers differ from the run's, so these are expected, and counted as
# divergent admissions rather than reported.
DIVERGENT_ADMISSION_RULES = frozenset({"accepted_equals_answer", "admission_matches_lookup"})

# Decision types compared one by one (violations are compared separately).
_COMPARED: tuple[type[ev.DecisionEvent], ...] = (ev.LookupAnswered, ev.LoadPlanned, ev.SavePlanned)
_WORKER_RESULTS = (ev.SaveDone, ev.SaveFailed, ev.LoadDone, ev.LoadFailed)
_UNBOUNDED_LAG = 1 << 30
Progress = Callable[[int, int], None]


# --- configuration ------------------------------------------------------------------------


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["chunk_size=512", "save_decode_cache=true"]`` -> typed values, by the types of
    ``TrackerConfig``'s fields. Raises :class:`tracker.config.ConfigError` naming the key."""
    fields = {f.name: f for f in attrs.fields(TrackerConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--with expects key=value, got {item!r}")
        if key not in fields:
            raise ConfigError(f"unknown tracker config key {key!r}; accepted: {sorted(fields)}")
        default = fields[key].default
        text = text.strip()
        if isinstance(default, bool):
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                out[key] = True
            elif low in ("0", "false", "no", "off"):
                out[key] = False
            else:
                raise ConfigError(f"{key} expects true or false, got {text!r}")
        elif isinstance(default, int):
            try:
                out[key] = int(text)
            except ValueError:
                raise ConfigError(f"{key} expects an integer, got {text!r}") from None
        else:
            out[key] = text
    return out


# --- the replay: what check and what-if share ---------------------------------------------

# An input waiting for the recorded decisions that follow it: (the input, the request's state
# before it, the decisions this code derived, the frame it was read from, its index).
Pending = tuple[ev.Event, "RequestState | None", list[ev.DecisionEvent], Any, int]


class _Replay:
    """Fold a log's recorded inputs, in log order, through a fresh ``Tracker`` built from the
    log's configuration, and hand each input's derived decisions, with the recorded decisions
    that follow it, to :meth:`_judge`. The two paths are the subclasses: :class:`_Check`
    compares the decisions with the run's; :class:`_WhatIf` changes the inputs as vLLM would
    have sent them under another configuration, and tallies the plans."""

    def __init__(
        self,
        result: CheckResult,
        config: TrackerConfig,
        *,
        request: str | None,
        progress: Progress | None,
        max_problems: int,
    ) -> None:
        self.result = result
        # The replay reports violations itself: given no logger, the tracker says nothing.
        self.tracker = Tracker(config)
        self.request = request
        self.request_seen = False
        self.progress = progress
        self.max_problems = max_problems
        self.done = False
        # What-if's hooks, called by run() (None on a check, which then pays nothing for them):
        # before each frame's events (the frame, whether it starts a step); and each recorded
        # input, rewritten (None: left out) before the tracker applies it.
        self.prepare: Callable[[Frame, bool], None] | None = None
        self.rewrite: Callable[[ev.Event, RequestState | None], ev.Event | None] | None = None
        # Plans' tokens per request, by column (0 recorded, 1 derived): what-if's tally.
        self.tally: Callable[[str, int, int, int], None] | None = None
        self._begin()

    def _begin(self) -> None:
        """A path's own setup, after the replay's: what a subclass would otherwise do in a
        constructor of its own. One that passed its arguments on as ``**kw`` was called wrong
        once compiled by mypyc (docs/performance.md, the core compiled)."""

    # --- problems -----------------------------------------------------------------------

    def _add(self, problem: Problem) -> None:
        if self.result.add(problem, self.max_problems):
            self.done = True

    def _summary(self, state: RequestState | None) -> dict[str, Any] | None:
        return None if state is None else state.summary()

    def _context(
        self, event: ev.Event, before: RequestState | None, frame: Any, index: int
    ) -> dict[str, Any]:
        """A problem's fields about the input it was found at."""
        return {
            # A digest verdict is stamped with the step of the load it judges. A malformed
            # LoadDigested judges no load (the digests take in nothing malformed): like every
            # malformed record, it is named at its own step (replay/malformed.py).
            "step": event.judged_step
            if event.__class__ is ev.LoadDigested and sound(event)
            else event.step,
            "req_id": event.req_id,
            "event": event,
            "before": self._summary(before),
            "after": self._summary(self.tracker.state(event.req_id)),
            "path": frame.path,
            "offset": frame.offset,
            "seq": frame.seq,
            "index": index,
        }

    def _about(self, v: ev.ViolationRecorded, context: dict[str, Any]) -> dict[str, Any]:
        """A violation about another request than the input's (StepDecoded is about several):
        its own request, and that request's state now."""
        if v.req_id == context["req_id"]:
            return context
        after = self._summary(self.tracker.state(v.req_id))
        return {**context, "req_id": v.req_id, "before": None, "after": after}

    # --- one input's decisions ----------------------------------------------------------

    def _finish(self, pending: Pending, recorded: list[ev.DecisionEvent]) -> None:
        derived = pending[2]
        totals = self.result.totals
        tally = self.tally
        for side, decisions, t in (
            (0, recorded, totals["recorded"]),
            (1, derived, totals["derived"]),
        ):
            for d in decisions:
                lo, sa = moved(d)
                if lo or sa:
                    t["tokens_loaded"] += lo
                    t["tokens_saved"] += sa
                    t["loads" if lo else "saves"] += 1
                    if tally is not None:
                        tally(d.req_id, lo, sa, side)
        self._judge(pending, recorded)

    def _judge(self, pending: Pending, recorded: list[ev.DecisionEvent]) -> None:
        """What this path makes of an input's derived decisions (``pending``: the input, the
        request's state before it, the decisions, where it was read) and the recorded ones."""
        raise NotImplementedError

    def _stray(self, d: ev.DecisionEvent, frame: Any, index: int) -> bool:
        """A recorded decision that follows no input event; returns whether the check is
        done (``--first``)."""
        raise NotImplementedError

    def _apply_now(self, e: ev.Event, before: RequestState | None) -> None:
        """Apply an input of the replay's own (not read from the log) and judge what it
        derives, with nothing recorded to compare it with."""
        self.tracker.step = e.step
        derived = self.tracker.apply(e)
        if derived:
            self._finish((e, before, derived, _NO_FRAME, -1), [])

    # --- recorded facts -----------------------------------------------------------------

    def _fact(self, v: ev.ViolationRecorded, frame: Any, index: int) -> None:
        """A violation recorded outside the fold: apply it the way the fold does."""
        tracker = self.tracker
        tracker.step = v.step
        tracker.mark_violation(v.req_id, v.rule, v.event)  # the request: recompute only
        tracker.violations.clear()
        if self.request is None or v.req_id == self.request:
            if len(self.result.recorded_violations) < self.max_problems:
                self.result.recorded_violations.append(
                    RecordedViolation(
                        v.step, v.req_id, v.rule, v.event, v.detail, frame.path, frame.offset, index
                    )
                )

    def _malformed(self, d: ev.Event, frame: Any, index: int) -> bool:
        """A recorded decision that says something impossible (tracker/wellformed.py): each
        rule it breaks is a problem. It is still compared with what this code derives, as
        any recorded decision. Returns whether the check is done (``--first``)."""
        for v in malformed(d):
            self._add(
                Problem(
                    "violation",
                    v.rule,
                    d.step,
                    d.req_id,
                    d,
                    recorded=(typing.cast(ev.DecisionEvent, d),),
                    path=frame.path,
                    offset=frame.offset,
                    seq=frame.seq,
                    index=index,
                    detail=detail_text(v),
                )
            )
        return self.done

    def _raised(
        self, e: ev.Event, before: RequestState | None, frame: Any, index: int, exc: Exception
    ) -> None:
        """The tracker raised on an event: a bug in tracker/ (the fold must be total)."""
        self._add(
            Problem(
                "error",
                "tracker_error",
                e.step,
                e.req_id,
                e,
                before=self._summary(before),
                path=frame.path,
                offset=frame.offset,
                seq=frame.seq,
                index=index,
                detail=f"{type(exc).__name__}: {exc}"[:300],
            )
        )

    # --- the loop -----------------------------------------------------------------------

    def run(self, source: LogSource) -> None:
        result = self.result
        tracker = self.tracker
        state_of = tracker.state
        live_states = tracker.states  # the live dict itself (read for its size only)
        apply = tracker.apply
        prepare, rewrite = self.prepare, self.rewrite
        report = None if self.progress is None else ReadProgress(self.progress, source.paths)
        by_type: Counter[type] = Counter()
        count_types = by_type.update
        recorded: list[ev.DecisionEvent] = []
        pending: Pending | None = None
        pending_derived: list[ev.DecisionEvent] = []
        index = 0
        frames = steps = inputs = 0
        last_step: int | None = None
        requests = 0
        peak_live = 0
        RequestAdded = ev.RequestAdded
        ViolationRecorded = ev.ViolationRecorded
        StepDecoded = ev.StepDecoded
        bad_decision = malformed
        steady = 0
        # An empty id names no request: the events about none (StepDecoded, ChunkStored) carry
        # req_id "", and matching them called a log clean for `--request ''`.
        wanted = self.request or None
        gaps = source.gaps  # filled as the reader meets loss records
        for frame in source.frames():
            if gaps:
                # The writer dropped steps here (the disk fell behind): what follows was
                # decided on facts the log lacks, so a replay cannot judge it.
                result.incomplete = _gap_text(gaps[0], last_step)
                break
            frames += 1
            events = frame.events
            count_types(map(type, events))
            new_step = frame.step != last_step
            if new_step:
                steps += 1
                last_step = frame.step
            if prepare is not None:
                if new_step and pending is not None:
                    self._finish(pending, recorded)
                    pending, recorded, pending_derived = None, [], []
                prepare(frame, new_step)
            for e in events:
                if e.KIND == "input":
                    if pending is not None and (recorded or pending_derived):
                        self._finish(pending, recorded)
                        if self.done:
                            break
                        recorded = []
                    pending = None
                    inputs += 1
                    if e.__class__ is StepDecoded:
                        steady += len(e.nums)
                    rid = e.req_id
                    if rid == wanted:
                        self.request_seen = True
                    before = state_of(rid)
                    if rewrite is not None:
                        rewritten = rewrite(e, before)
                        if rewritten is None:
                            index += 1
                            continue
                        e = rewritten
                    if e.__class__ is RequestAdded and (before is None or before.finished):
                        requests += 1
                    tracker.step = e.step
                    try:
                        pending_derived = apply(e)
                    except Exception as exc:  # a tracker bug: report it, keep going
                        self._raised(e, before, frame, index, exc)
                        pending_derived = []
                        if self.done:
                            break
                    pending = (e, before, pending_derived, frame, index)
                elif bad_decision(e) and self._malformed(e, frame, index):
                    break
                elif e.__class__ is ViolationRecorded and e.rule in EXTERNAL_RULES:
                    self._fact(e, frame, index)
                elif pending is None:
                    if self._stray(typing.cast(ev.DecisionEvent, e), frame, index):
                        break
                else:
                    recorded.append(typing.cast(ev.DecisionEvent, e))  # (KIND: not input)
                index += 1
            if self.done:
                break
            live = len(live_states)
            if live > peak_live:
                peak_live = live
            if report is not None:
                report.at(frame)
        if pending is not None and not self.done:
            self._finish(pending, recorded)
        if self.done:
            result.stopped_early = True
        elif gaps and result.incomplete is None:
            # Steps dropped at the very end (the loss record is the log's last word): the
            # run's last steps are not in it.
            result.incomplete = _gap_text(gaps[0], last_step)
        if report is not None and not self.done:
            report.end()
        result.read_to(source)
        result.counts = {
            "events": index,
            "inputs": inputs,
            "decisions": index - inputs,
            "frames": frames,
            "steps": steps,
            "requests": requests,
            "peak_live_requests": peak_live,
            # Steady decode steps, one per request in each StepDecoded record.
            "steady_decode_steps": steady,
            "by_type": {cls.__name__: n for cls, n in sorted(by_type.items(), key=_type_order)},
            # The KV-content digests (tracker/digests.py): blocks digested, loaded blocks
            # checked, verified, mismatched, unchanged, unverifiable (no digest for the key).
            "digests": tracker.digests.stats.to_dict(),
        }


class ReadProgress:
    """``progress(bytes done, bytes total)``, a few times a second: the bytes of the segments
    before the frame's, plus the frame's offset."""

    def __init__(self, progress: Progress, paths: Sequence[Path]) -> None:
        self.progress = progress
        self.before: dict[str, int] = {}
        total = 0
        for p in paths:
            self.before[str(p)] = total
            total += p.stat().st_size if p.is_file() else 0
        self.total = total
        self.next = time.monotonic() + 0.1

    def at(self, frame: Frame) -> None:
        if time.monotonic() >= self.next:
            self.next = time.monotonic() + 0.1
            self.progress(self.before.get(frame.path, 0) + frame.offset, self.total)

    def end(self) -> None:
        self.progress(self.total, self.total)


class _NoFrame:
    path = ""
    offset = -1
    seq = -1


_NO_FRAME = _NoFrame()


def _type_order(item: tuple[type, int]) -> int:
    return getattr(item[0], "TAG", 999)


# --- check: the run's decisions against this code's -------------------------------------


class _Check(_Replay):
    """``check``: every decision this code derives, compared with the one the run recorded
    after the same input; every rule broken, recorded or not."""

    def _judge(self, pending: Pending, recorded: list[ev.DecisionEvent]) -> None:
        event, before, derived, frame, index = pending
        derived_v = [d for d in derived if d.__class__ is ev.ViolationRecorded]
        if recorded == derived and not derived_v:
            return
        self.tracker.violations.clear()  # the replay keeps its own (bounded) list
        context = self._context(event, before, frame, index)
        for cls in _COMPARED:
            rec = tuple(x for x in recorded if x.__class__ is cls)
            der = tuple(x for x in derived if x.__class__ is cls)
            if rec != der:
                self._add(Problem("decision", cls.__name__, recorded=rec, derived=der, **context))
        recorded_v = [d for d in recorded if d.__class__ is ev.ViolationRecorded]
        for v in derived_v:
            self._add(
                Problem(
                    "violation",
                    v.rule,
                    recorded=tuple(x for x in recorded_v if x == v),
                    derived=(v,),
                    recorded_too=v in recorded_v,
                    detail=v.detail,
                    **self._about(v, context),
                )
            )
        for v in recorded_v:
            if v not in derived_v:
                self._add(
                    Problem(
                        "unexplained",
                        f"ViolationRecorded {v.rule}",
                        recorded=(v,),
                        detail=v.detail,
                        **self._about(v, context),
                    )
                )
        others = [d for d in recorded if d.__class__ not in _COMPARED and d not in recorded_v]
        for d in others:  # a decision type this code does not know how to compare
            self._add(Problem("unexplained", type(d).__name__, recorded=(d,), **context))

    def _stray(self, d: ev.DecisionEvent, frame: Any, index: int) -> bool:
        self._add(
            Problem(
                "unexplained",
                type(d).__name__,
                d.step,
                d.req_id,
                None,
                recorded=(d,),
                path=frame.path,
                offset=frame.offset,
                seq=frame.seq,
                index=index,
                detail="a decision that follows no input event",
            )
        )
        return self.done


# --- what-if: the plans under another configuration ---------------------------------------


class _WhatIf(_Replay):
    """``check --with``: the recorded inputs as vLLM would have sent them had it accepted this
    configuration's offers (see the module docstring), every planned transfer taken as
    succeeded, and the plans tallied per request against the recorded ones."""

    def _begin(self) -> None:
        assert self.result.what_if is not None
        self.what_if: WhatIf = self.result.what_if
        # Each admission of the frame: its request -> the tokens vLLM computes at it.
        self.admissions: dict[str, int] = {}
        self.prepare = self._prepare
        self.rewrite = self._rewrite
        self.tally = self._tally

    def _tally(self, req_id: str, loaded: int, saved: int, column: int) -> None:
        row = self.what_if.per_request.get(req_id)
        if row is None:
            row = self.what_if.per_request[req_id] = {"loaded": [0, 0], "saved": [0, 0]}
        row["loaded"][column] += loaded
        row["saved"][column] += saved

    def _judge(self, pending: Pending, recorded: list[ev.DecisionEvent]) -> None:
        event, before, derived, frame, index = pending
        self.tracker.violations.clear()  # the replay keeps its own (bounded) list
        context = self._context(event, before, frame, index)
        for v in [d for d in derived if d.__class__ is ev.ViolationRecorded]:
            if v.rule in DIVERGENT_ADMISSION_RULES:
                self.what_if.divergent_admissions += 1
            else:
                self._add(Problem("violation", v.rule, derived=(v,), **self._about(v, context)))

    def _stray(self, d: ev.DecisionEvent, frame: Any, index: int) -> bool:
        return False  # the recorded result it followed was replaced: nothing to judge

    def _prepare(self, frame: Frame, new_step: bool) -> None:
        if new_step:
            self._complete_transfers(frame.step)
        self.admissions = {
            e.req_id: e.num_computed + e.num_scheduled
            for e in frame.events
            if e.__class__ is ev.Scheduled and e.admission is not ev.Admission.RUNNING
        }

    def _rewrite(self, e: ev.Event, before: RequestState | None) -> ev.Event | None:
        """The input as vLLM would have sent it had it accepted this configuration's offer
        (see the module docstring), or None for a recorded worker result (replaced)."""
        w = self.what_if
        if isinstance(e, _WORKER_RESULTS):
            w.worker_results_replaced += 1
            if isinstance(e, (ev.LoadFailed, ev.SaveFailed)):
                w.recorded_failures_ignored += 1
            return None
        if isinstance(e, ev.StepDecoded):
            return self._split_decoded(e)
        if before is None:
            return e
        lookup = before.lookup
        if isinstance(e, ev.Allocated):
            if before.allocated and e.num_external == 0:
                return e  # the second call after an async load
            offered = lookup.external if lookup is not None else 0
            local = lookup.local_hit if lookup is not None else 0
            total = self.admissions.get(e.req_id)
            if lookup is not None and total is not None and offered > total - 1 - local:
                # vLLM's recorded step has no room for the whole offer (its admission
                # computes fewer tokens than the offer would skip): offer what fits, as
                # a connector capping its answer would, and keep the recorded schedule.
                offered = max(0, total - 1 - local)
                self._apply_now(ev.LookupAnswered(e.step, e.req_id, lookup.hit, offered), before)
            if offered != e.num_external:
                w.divergent_admissions += 1
                return attrs.evolve(e, num_external=offered)
            return e
        if isinstance(e, ev.Scheduled) and e.admission is not ev.Admission.RUNNING:
            computed = (
                lookup.local_hit if lookup is not None else e.num_computed
            ) + before.accepted
            total = e.num_computed + e.num_scheduled
            if computed != e.num_computed and 0 <= computed < total:
                return attrs.evolve(e, num_computed=computed, num_scheduled=total - computed)
        return e

    def _split_decoded(self, e: ev.StepDecoded) -> ev.Event | None:
        """The recorded run folded these requests' single-token steps as steady
        (``StepDecoded``). Under the what-if config some may not be steady (a decode chunk is
        due with ``save_decode_cache``, say): those go through ``Scheduled`` as the connector
        would have sent them, except for the token ids, which the run learned later, in bulk
        (the what-if config tolerates the lag, see ``_check_into``). The rest stay steady."""
        tracker = self.tracker
        found, bad = tracker.entries_of(e)
        if any(v.rule == "decoded_blocks" for v in bad):
            return e  # no entry can be trusted: the tracker names the record as it stands
        split = {entry.num: entry for entry in found}
        steady: list[int] = []
        grown: list[int] = []
        for num in e.nums:
            entry = split.get(num)
            state = tracker.state(entry.req_id) if entry is not None else None
            if (
                entry is None  # an unknown number: the tracker names it
                or state is None
                or tracker.decode_step_ok(entry.req_id, state.num_tokens, entry.block) is not None
            ):
                steady.append(num)
                if entry is not None and entry.block is not None:
                    grown += (num, entry.block)
                continue
            if len(state.token_ids) <= state.num_tokens:
                self.what_if.steps_without_token_ids += 1
            block = () if entry.block is None else (entry.block,)
            scheduled = ev.Scheduled(
                e.step, entry.req_id, state.num_tokens, 1, len(state.token_ids), (), block
            )
            self._apply_now(scheduled, state)
        if not steady:
            return None
        if len(steady) == len(e.nums):
            return e
        return ev.StepDecoded(e.step, "", tuple(steady), tuple(grown))

    def _complete_transfers(self, step: int) -> None:
        """Every transfer planned before ``step`` succeeded."""
        tracker = self.tracker
        for req_id, state in list(tracker.states.items()):
            events: list[ev.Event] = []
            if state.load is not None and not state.load.done:
                events.append(ev.LoadDone(step, req_id))
            if state.save.pending:
                events.append(ev.SaveDone(step, req_id, tuple(k for k, _ in state.save.pending)))
            for e in events:
                self._apply_now(e, tracker.state(req_id))


# --- the entry point ----------------------------------------------------------------------


def check(
    path: LogPath,
    *,
    request: str | None = None,
    first: bool = False,
    progress: Progress | None = None,
    max_problems: int = 10_000,
    differential: bool = False,
    **config_overrides: Any,
) -> CheckResult:
    """Replay the log at ``path`` (a file, a list of segment files, or a directory holding one
    log's segments) and report every disagreement; see the module docstring.

    ``request``: report only this request's problems (the whole log is still folded: the
    chunk index is shared by all requests). ``first``: stop at the first problem.
    ``progress(bytes_done, bytes_total)``: called a few times a second. ``config_overrides``
    (``chunk_size=512``, ...): a what-if replay under a changed configuration. Never raises
    for a bad log: an unreadable one gives a result with :attr:`CheckResult.error` set.

    A recorder's log (``KVLedgerRecorder`` wrapping another connector) is judged by the rules
    any connector must keep (:mod:`replay.recorded`); ``differential`` also compares each of
    the wrapped connector's lookup answers with kvledger's on the same recorded inputs.
    """
    started = time.perf_counter()
    if isinstance(path, (str, os.PathLike)):
        names = [os.fspath(path)]
    else:
        names = [os.fspath(p) for p in path]
    result = CheckResult(paths=names, request=request, first=first)
    try:
        _check_into(result, path, request, progress, max_problems, config_overrides, differential)
    except LogUnreadable as e:
        # Not a log, an unknown major version, a damaged first header, a missing file.
        result.error = str(e)
        result.stop = e.stop
    result.seconds = time.perf_counter() - started
    return result


def _check_into(
    result: CheckResult,
    path: LogPath,
    request: str | None,
    progress: Progress | None,
    max_problems: int,
    overrides: dict[str, Any],
    differential: bool = False,
) -> None:
    source = open_log(path)
    result.paths = [str(p) for p in source.paths]
    header = source.header
    if header.get("segment", 0):
        start = header["segment"]
        result.error = (
            f"the log starts at segment {start}: segments 0 to {start - 1} are missing "
            "(deleted?), and a replay needs the log from its start to rebuild every state; "
            "kvledger show and stats still read what is there"
        )
        return
    result.run_info = {
        **source.run_info,
        **{
            k: header[k]
            for k in ("library_version", "run_id", "created_wall_ns", "major", "minor")
            if k in header
        },
    }
    try:
        recorded = source.config()
    except ConfigUnusable as e:  # the one refusal every command makes (replay.source)
        result.error = e.problem
        return
    overrides = {k: v for k, v in overrides.items() if k != "strict"}
    try:
        config = recorded.with_changes(**overrides)
    except (ConfigError, TypeError) as e:
        result.error = f"what-if configuration: {e}"
        result.bad_option = str(e)
        return
    result.config = config.to_dict()
    if request:  # an empty one names no request: said after the replay, as ever
        try:
            request = result.request = _resolve_request(source, request)
        except RequestNotFound as e:
            # None, or several (naming.py's message names them): exit 2, after the replay
            # (its summary is still shown, as for a request that is not there).
            result.error = str(e)
    if source.recorded:
        # A recorder's log: the wrapped connector decided, kvledger recorded; nothing to
        # re-derive, the rules any connector keeps to judge (--with sets the differential's pool).
        check_recorded_into(
            result,
            source,
            config,
            request=request,
            max_problems=max_problems,
            differential=differential,
        )
        return
    if differential:
        result.error = result.bad_option = (
            "--differential compares a wrapped connector with kvledger: it needs a log "
            "written by KVLedgerRecorder, and this one was written by KVLedgerConnector"
        )
        return
    replay: _Replay
    if overrides:
        result.what_if = WhatIf(dict(overrides), recorded.to_dict(), config.to_dict())
        replay_config = config
        if "max_async_lag" not in overrides:
            # Steady decode steps of the run learned their token ids later, in bulk; a what-if
            # step that is not steady under the new config goes through Scheduled without them.
            replay_config = config.with_changes(max_async_lag=_UNBOUNDED_LAG)
        replay = _WhatIf(
            result,
            replay_config,
            request=request,
            progress=progress,
            max_problems=max_problems,
        )
    else:
        replay = _Check(
            result, config, request=request, progress=progress, max_problems=max_problems
        )
    try:
        replay.run(source)
    except (LogFormatError, OSError) as e:
        # A later segment that cannot be read at all: what came before was checked.
        result.error = str(e)
        result.stop = source.stop
    if request is not None and not replay.request_seen and result.error is None:
        # Never "clean" for a request that is not there (a typo, another log).
        result.error = str(RequestNotFound(request))


def _resolve_request(source: LogSource, name: str) -> str:
    """The vLLM request id ``name`` means, by the rule every command names a request with
    (``replay.naming.resolve``: an id, or a part of exactly one id); :class:`RequestNotFound`
    (ambiguous, or the nearest ids) when it means none. The log's ids are read first, without
    a fold; a log that cannot be read that far keeps ``name`` as given (the replay says why)."""
    ids: dict[str, str] = {}  # every id, in arrival order
    try:
        for frame in source.frames():
            for e in frame.events:
                if e.req_id:  # the events about no request carry ""
                    ids.setdefault(e.req_id, e.req_id)
    except (LogFormatError, OSError):
        return name
    if name in ids:
        return name
    return ids[resolve(name, ids)[0]]


def _gap_text(gap: dict[str, int], last_step: int | None) -> str:
    """What a replay says of the steps its writer dropped (a loss record, ``LogSource.gaps``)."""
    return (
        f"steps {gap['first_step']} to {gap['last_step']} were not recorded (the disk fell "
        f"behind: {gap['frames']} frames, {gap['records']} records dropped); checked up to "
        f"step {last_step}"
    )
