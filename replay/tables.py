"""The tidy tables of a log, for SQL: one table per thing, keys that link them.

Every row is read off the fold, never re-derived: the requests' states come from
``tracker.history.walk`` (the recording Tracker's own fold), the pool's from
``tracker.index_fold`` applied to the recorded events in log order (as the Tracker applied
them), and the problems from ``replay.replayer.check`` itself. A number here and the same
number in ``kvledger stats`` or ``kvledger check`` have one home.

The tables (:data:`TABLES` lists every column with its type and meaning):

- ``requests``: one row per request life (``request``: its id, ``id#2`` for an id vLLM reused);
- ``admissions``: one row per admission (``request``, ``admission``): what the lookup asked and
  found, what was offered, accepted, loaded and refused, whether a preemption came before;
- ``saves``: one row per chunk a save plan wrote (``request``, ``key``), with its result;
- ``steps``: one row per scheduler step: batch, running / waiting / preempted counts, tokens
  computed, loaded and saved, pool use;
- ``events``: one row per event (``event``, its position in the log), and one table per event
  type (``ev_lookup_asked``, ``ev_load_planned``, ...) holding that type's own fields, typed,
  keyed by ``event``; ``ev_step_decoded`` has one row per request a ``StepDecoded`` named;
- ``misses``: one row per span of missed tokens of an admission's lookup and its reason, as
  ``kvledger explain`` finds them (``replay.explain``);
- ``problems``: what ``kvledger check`` reports, one row per problem.

Keys: ``request`` (the life label) links ``requests``, ``admissions``, ``saves``, ``events``,
the ``ev_`` tables and ``problems``; ``(request, admission)`` links ``admissions`` and
``saves`` and ``misses``; ``step`` links everything to ``steps``; ``event`` links ``events``, the ``ev_``
tables and ``problems``, and an admission to its events (``lookup_event``, ``answer_event``,
``allocated_event``, ``event`` for its ``Scheduled``, ``load_event``).

Writing the tables (parquet, JSON lines, a Hive tree of many logs) is ``replay.writers``;
querying them is ``replay.sql``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvledger.replay.counts import COUNTERS, StepCounts
from kvledger.replay.explainer import Explainer
from kvledger.replay.format import plain_fields
from kvledger.replay.misses import AdmissionMisses
from kvledger.replay.source import LogPath, LogSource, MissingSegments, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.framing import StopInfo
from kvledger.tracker.history import GLOBAL_TYPES, POOL, retires, walk
from kvledger.tracker.state import Phase, RequestState

__all__ = [
    "EVENT_TABLES",
    "TABLES",
    "Column",
    "TableRows",
    "collect",
    "event_table",
    "markdown_reference",
    "table_rows",
]


class Column(NamedTuple):
    name: str
    kind: str  # int, float, bool, str, int_list, str_list
    doc: str


def _c(name: str, kind: str, doc: str) -> Column:
    return Column(name, kind, doc)


_REQUEST = _c("request", "str", "the request's life: its id, or id#2, id#3 for a reused id")
_REQ_ID = _c("req_id", "str", "vLLM's request id")
_EVENT = _c("event", "int", "the event's position in the log (0-based, every event counted)")
_STEP = _c("step", "int", "the scheduler step")

REQUESTS: tuple[Column, ...] = (
    _REQUEST,
    _REQ_ID,
    _c("added_step", "int", "step of its RequestAdded"),
    _c("prompt_len", "int", "prompt tokens"),
    _c("admissions", "int", "times vLLM admitted it (first admission, then re-admissions)"),
    _c("preemptions", "int", "preemptions, signalled or inferred (the fold's count)"),
    _c("lookups", "int", "LookupAsked events: vLLM asks again every step a request waits"),
    _c("scheduled_steps", "int", "steps it was scheduled in (Scheduled and steady decodes)"),
    _c("steady_steps", "int", "of them, steady single-token decode steps (StepDecoded)"),
    _c("tokens_computed", "int", "tokens vLLM scheduled for it, over all admissions"),
    _c("first_local_hit", "int", "vLLM's prefix-cache hit at the first admission (-1: none)"),
    _c("first_external", "int", "tokens accepted from the pool at the first admission"),
    _c("tokens_loaded", "int", "tokens loaded from the pool (planned), whole life"),
    _c("tokens_saved", "int", "tokens saved to the pool (planned), whole life"),
    _c("loads_refused", "int", "load plans that refused blocks vLLM counted as loaded"),
    _c("load_failures", "int", "LoadFailed events"),
    _c("violations", "int", "ViolationRecorded events about it"),
    _c("recompute_only", "bool", "fell back to recompute (a violation) at some point"),
    _c("finished_step", "int", "step of its Finished (null: not finished in the log)"),
    _c("finish_reason", "str", "Finished.reason (null: not finished)"),
    _c("last_step", "int", "step of its last event"),
    _c("phase", "str", "its phase after its last event: waiting, running, preempted, finished"),
)

ADMISSIONS: tuple[Column, ...] = (
    _REQUEST,
    _REQ_ID,
    _c(
        "admission",
        "int",
        "1 for the first admission, 2 for the re-admission after a preemption, ...",
    ),
    _c("event", "int", "the admission's Scheduled event"),
    _c("step", "int", "the step it was admitted in"),
    _c("how", "str", "new or resumed (Scheduled.admission)"),
    _c("preempted_before", "bool", "a preemption came before it (a re-admission)"),
    _c("waiting_since", "int", "step the wait began: added, or preempted"),
    _c("lookups", "int", "LookupAsked events during that wait (one per step it waited)"),
    _c("lookup_event", "int", "the last LookupAsked before the admission (null: none)"),
    _c("lookup_step", "int", "its step"),
    _c("answer_event", "int", "the LookupAnswered that answered it"),
    _c("asked", "int", "tokens the admission's lookup asked about (null: no lookup)"),
    _c("local_hit", "int", "of them, in vLLM's own prefix cache"),
    _c("hit", "int", "of them, in the pool (a prefix of chunks)"),
    _c("offered", "int", "tokens offered to vLLM (LookupAnswered.external)"),
    _c("accepted", "int", "tokens vLLM accepted from the pool (Allocated.num_external)"),
    _c("allocated_event", "int", "the Allocated event (null: none)"),
    _c("allocated_step", "int", "its step"),
    _c("num_computed", "int", "vLLM's num_computed at admission (local hit + accepted)"),
    _c("num_scheduled", "int", "tokens scheduled in the admission step"),
    _c("blocks", "int", "blocks of the table at admission"),
    _c("load_event", "int", "the admission's LoadPlanned (null: none)"),
    _c("load_step", "int", "its step"),
    _c("load_start", "int", "first token of the planned load (null: no load)"),
    _c("load_end", "int", "end of the planned load"),
    _c("loaded", "int", "tokens the load plan loads (0: none)"),
    _c("refused_blocks", "int", "blocks vLLM counted as loaded that the plan refused"),
    _c("load_result", "str", "done, failed, or null (no load, or no result in the log)"),
    _c("load_result_step", "int", "step of the load's result"),
    _c("tokens_saved", "int", "tokens planned for saving during this admission"),
    _c("end_step", "int", "step it ended (null: still running at the end of the log)"),
    _c("ended_by", "str", "preempted or finished (null: still running)"),
    _c("tokens_at_end", "int", "tokens computed or computing when it ended (or at log end)"),
)

SAVES: tuple[Column, ...] = (
    _REQUEST,
    _REQ_ID,
    _c("admission", "int", "the admission that planned it"),
    _c("event", "int", "the SavePlanned event"),
    _c("step", "int", "the step it was planned in"),
    _c("key", "str", "the chunk key (hex)"),
    _c("start", "int", "its first token"),
    _c("slot", "int", "the host slot reserved for it"),
    _c("result", "str", "done, failed, or null (no result in the log)"),
    _c("result_step", "int", "step of the result"),
)

STEPS: tuple[Column, ...] = (
    _STEP,
    _c("seq", "int", "sequence number of its first frame"),
    _c("wall_ns", "int", "when its first frame was written (ns since the epoch)"),
    _c("events", "int", "events recorded in the step"),
    _c("scheduled", "int", "requests scheduled (the batch): Scheduled + steady decodes"),
    _c("admitted", "int", "of them, admitted (new or resumed)"),
    _c("steady", "int", "of them, steady single-token decodes (StepDecoded)"),
    _c("tokens_computed", "int", "tokens scheduled for computing"),
    _c("lookups", "int", "LookupAsked events (waiting requests ask again every step)"),
    _c("preemptions", "int", "preemptions in the step"),
    _c("finished", "int", "requests finished in the step"),
    _c("tokens_loaded", "int", "tokens of the load plans"),
    _c("loads_refused", "int", "load plans with refused blocks"),
    _c("load_failures", "int", "LoadFailed events"),
    _c("tokens_saved", "int", "tokens of the save plans"),
    _c("chunks_saved", "int", "chunks of the save plans"),
    _c("chunks_confirmed", "int", "chunks SaveDone confirmed"),
    _c("chunks_failed", "int", "chunks SaveFailed reported"),
    _c("chunks_evicted", "int", "chunks evicted (by save plans, and ChunkEvicted)"),
    _c("violations", "int", "ViolationRecorded events"),
    _c("running", "int", "requests running after the step"),
    _c("waiting", "int", "requests waiting for their first admission after the step"),
    _c("preempted", "int", "requests preempted, waiting for re-admission, after the step"),
    _c("pool_stored", "int", "chunks stored in the pool after the step"),
    _c("pool_writing", "int", "chunks being written (planned, not confirmed)"),
    _c("pool_used", "int", "slots in use (stored + writing)"),
    _c("pool_slots", "int", "slots in the pool (the config's num_slots)"),
    _c("remote_chunks", "int", "chunks the remote store was last seen to hold (0: none, or down)"),
)

EVENTS: tuple[Column, ...] = (
    _EVENT,
    _c("seq", "int", "sequence number of its frame"),
    _STEP,
    _c("wall_ns", "int", "when its frame was written"),
    _c("type", "str", "the event type (its own fields: table ev_<type in snake case>)"),
    _c("kind", "str", "input (a fact vLLM or the worker reported) or decision (the tracker's)"),
    _c("request", "str", "the request's life (null: the events about no one request)"),
    _c("req_id", "str", "vLLM's request id (null likewise)"),
)

MISSES: tuple[Column, ...] = (
    _REQUEST,
    _REQ_ID,
    _c("admission", "int", "the admission whose lookup missed them (admissions.admission)"),
    _c("step", "int", "the step it was admitted in"),
    _c("lookup_step", "int", "the step of the lookup vLLM acted on"),
    _c("start", "int", "the first missed token of the span"),
    _c("end", "int", "the end of the span (exclusive)"),
    _c("tokens", "int", "end - start"),
    _c("reason", "str", "why they missed (docs/why-missed.md lists every reason)"),
    _c("at_step", "int", "the step of the fact that explains it (an eviction, a failure, ...)"),
    _c("by_request", "str", "the request involved: the evicting one, the one that computed it"),
    _c("diverged_at", "int", "prefix_diverged: the first token that differs"),
    _c("detail", "str", "more words on the reason (null: none)"),
)

PROBLEMS: tuple[Column, ...] = (
    _c("problem", "int", "1, 2, ...: check's order"),
    _c("kind", "str", "decision, violation, unexplained or error (docs/debugging.md)"),
    _c("name", "str", "the decision type, or the rule"),
    _c("rule", "str", "the rule, for a violation (else null)"),
    _STEP,
    _c("request", "str", "the request's life (null: none)"),
    _c("req_id", "str", "vLLM's request id (null: none)"),
    _EVENT,
    _c("event_type", "str", "the type of the event it was found at"),
    _c("headline", "str", "check's one-line description"),
    _c("detail", "str", "the numbers involved"),
    _c("recorded_too", "bool", "a violation the run recorded as well"),
    _c("recorded", "str", "the recorded decisions, as check prints them"),
    _c("derived", "str", "the decisions this code derives"),
)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def event_table(cls: type[ev.Event]) -> str:
    """The table of an event type's own fields: ``ev_`` and its name in snake case."""
    return "ev_" + _snake(cls.__name__)


_KINDS = {"int": "int", "bool": "bool", "str": "str", "hex": "str", "int_list": "int_list"}
_KINDS["hex_list"] = "str_list"
# The events about no one request but StepDecoded: the pool's and the remote store's own.
_POOL_TYPES = tuple(t for t in GLOBAL_TYPES if t is not ev.StepDecoded)


def _event_columns(cls: type[ev.Event]) -> tuple[Column, ...]:
    if cls is ev.StepDecoded:  # one row per request it names, not one overloaded row
        return (
            _EVENT,
            _STEP,
            _REQUEST,
            _REQ_ID,
            _c("new_block", "int", "the block appended to its table in the step (null: none)"),
            _c("token", "int", "the token id the step made known (a recorder's log; null: none)"),
        )
    head = (_EVENT, _STEP) if cls in _POOL_TYPES else (_EVENT, _STEP, _REQUEST, _REQ_ID)
    own = tuple(
        _c(_own_column(f.name), _KINDS[f.kind], f"{cls.__name__}.{f.name}")
        for f in plain_fields(cls)
    )
    return head + own


# An event field whose name is a key column's: ViolationRecorded.event (the type of the event
# the rule was broken at) is event_type, as in the problems table.
_RENAMED = {"event": "event_type"}
_KEYS = frozenset({"event", "step", "request", "req_id"})


def _own_column(name: str) -> str:
    column = _RENAMED.get(name, name)
    if column in _KEYS:
        raise TypeError(f"event field {name!r} would shadow the key column {column!r}")
    return column


EVENT_TABLES: dict[type[ev.Event], str] = {cls: event_table(cls) for cls in ev.EVENT_TYPES}

TABLES: dict[str, tuple[Column, ...]] = {
    "requests": REQUESTS,
    "admissions": ADMISSIONS,
    "saves": SAVES,
    "steps": STEPS,
    "events": EVENTS,
    "misses": MISSES,
    "problems": PROBLEMS,
    **{EVENT_TABLES[cls]: _event_columns(cls) for cls in ev.EVENT_TYPES},
}
"""Every table and its columns, in order (the writers' schemas, the docs' reference)."""


Row = dict[str, Any]
Emit = Callable[[str, Row], None]


class TableRows(NamedTuple):
    """What :func:`table_rows` read: the log's damage, check's error (the problems table is
    then empty or partial), and the log's segment files that were not there."""

    damage: StopInfo | None
    check_error: str | None
    missing: MissingSegments | None = None


_PHASES = {
    Phase.WAITING: "waiting",
    Phase.RUNNING: "running",
    Phase.PREEMPTED: "preempted",
    Phase.FINISHED: "finished",
}


# The steps table's columns that are a step's counts (replay.counts), under the same names.
_COUNTED = (
    "lookups",
    "tokens_loaded",
    "loads_refused",
    "load_failures",
    "tokens_saved",
    "chunks_saved",
    "chunks_confirmed",
    "chunks_failed",
    "chunks_evicted",
)


def _new_step(step: int, frame: Any, config: TrackerConfig) -> Row:
    row: Row = {c.name: 0 for c in STEPS}
    row.update(step=step, seq=frame.seq, wall_ns=frame.wall_ns, pool_slots=config.num_slots)
    return row


class _Builder:
    """One pass over the walk: rows for every table. Events and steps stream out; a request's
    rows (its admissions, its saves) go out when the walk retires it, or at the end."""

    def __init__(self, config: TrackerConfig, emit: Emit, *, recorded: bool = False) -> None:
        self.config = config
        self.emit = emit
        self.requests: dict[str, Row] = {}
        self.admissions: dict[str, list[Row]] = {}
        self.saves: dict[str, dict[bytes, Row]] = {}  # request -> key -> its latest save
        self.wait: dict[str, list[int]] = {}  # request -> [waiting since, lookups]
        # request -> the events the coming admission links to (its lookup, answer, allocation)
        self.links: dict[str, Row] = {}
        self.tokens: dict[str, int] = {}  # request -> its num_tokens after its latest event
        # Requests the walk retired in this step: their rows go out when the step closes (a
        # violation recorded about the retiring event still counts), and are forgotten, so
        # memory follows the live requests, as the walk's does.
        self.retiring: list[str] = []
        self.phase_counts = {p: 0 for p in Phase}
        # Every admission's misses, explained as `kvledger explain` explains them; the
        # explainer folds the pool's index from the recorded events, read here for pool use.
        self.explainer = Explainer(config, self._misses, recorded=recorded)
        self.index: ChunkIndex = self.explainer.index
        self.step_row: Row | None = None
        # The step's counts read off its events (replay.counts: tail's and stats' too).
        self.step_counts = StepCounts()
        self.makers = {
            cls: tuple((f.name, _own_column(f.name), f.convert) for f in plain_fields(cls))
            for cls in ev.EVENT_TYPES
        }

    # --- the pass ------------------------------------------------------------------------

    def run(self, src: LogSource) -> None:
        last_pos = -1
        feed = self.explainer.feed
        count_of = COUNTERS.get
        for item in walk(src.frames(), self.config, recorded=src.recorded):
            pos, frame, e, label = item.pos, item.frame, item.event, item.life
            before, after = item.before, item.after
            if pos == last_pos:  # a StepDecoded, once more for each request it names
                self._decoded(pos, e, label, item.req_id, before, after)
                continue
            last_pos = pos
            step = e.step
            srow = self.step_row
            if srow is None or srow["step"] != frame.step:  # a step's events: one frame
                if srow is not None:
                    self._close_step(srow)
                srow = self.step_row = _new_step(frame.step, frame, self.config)
                self.step_counts = StepCounts(frame.step)
            feed(item)  # after the step before was closed: its pool counts are its own
            srow["events"] += 1
            cls = e.__class__
            count = count_of(cls)
            if count is not None:
                count(self.step_counts, e)
            request = None if label == POOL else label
            self.emit(
                "events",
                {
                    "event": pos,
                    "seq": frame.seq,
                    "step": step,
                    "wall_ns": frame.wall_ns,
                    "type": cls.__name__,
                    "kind": cls.KIND,
                    "request": request,
                    "req_id": None if request is None else e.req_id,
                },
            )
            if cls is not ev.StepDecoded:
                self._own_fields(pos, e, request)
            if request is not None:
                self._request_event(pos, e, request, item.new, before, after, srow)
        if self.step_row is not None:
            self._close_step(self.step_row)

    def _own_fields(self, pos: int, e: ev.Event, request: str | None) -> None:
        cls = e.__class__
        row: Row = {"event": pos, "step": e.step}
        if cls not in _POOL_TYPES:
            row["request"] = request
            row["req_id"] = None if request is None else e.req_id
        for name, column, convert in self.makers[cls]:
            value = getattr(e, name)
            row[column] = value if convert is None else convert(value)
        self.emit(EVENT_TABLES[cls], row)

    def _decoded(
        self,
        pos: int,
        e: ev.Event,
        label: str,
        req_id: str,
        before: RequestState | None,
        after: RequestState | None,
    ) -> None:
        grew = (
            after.block_ids[-1]
            if after is not None
            and before is not None
            and len(after.block_ids) > len(before.block_ids)
            else None
        )
        learned = (
            after.token_ids[-1]
            if after is not None
            and before is not None
            and len(after.token_ids) > len(before.token_ids)
            else None
        )
        self.emit(
            "ev_step_decoded",
            {
                "event": pos,
                "step": e.step,
                "request": label,
                "req_id": req_id,
                "new_block": grew,
                "token": learned,
            },
        )
        srow = self.step_row
        assert srow is not None
        srow["scheduled"] += 1
        srow["steady"] += 1
        srow["tokens_computed"] += 1
        r = self.requests.get(label)
        if r is not None:
            r["scheduled_steps"] += 1
            r["steady_steps"] += 1
            r["tokens_computed"] += 1
            r["last_step"] = e.step
        if after is not None:
            self.tokens[label] = after.num_tokens

    def _count_phase(self, state: RequestState | None, delta: int) -> None:
        if state is not None:
            self.phase_counts[state.phase] += delta

    def _request_event(
        self,
        pos: int,
        e: ev.Event,
        request: str,
        new: bool,
        before: RequestState | None,
        after: RequestState | None,
        srow: Row,
    ) -> None:
        cls = e.__class__
        step = e.step
        # (The pool's index follows the recorded events in the explainer: run() feeds it.)
        if after is not None or before is not None:
            self._count_phase(before, -1)
            self._count_phase(None if after is None or retires(after) else after, +1)
        if cls is ev.RequestAdded and new:
            self._added(e, request, after)
        r = self.requests.get(request)
        if r is not None:
            r["last_step"] = step
            if after is not None:
                life = after.life
                r["preemptions"] = life.num_preemptions
                r["first_local_hit"] = life.first_local_hit
                r["first_external"] = life.first_external
                r["tokens_loaded"] = life.tokens_loaded
                r["tokens_saved"] = life.tokens_saved
                r["recompute_only"] = r["recompute_only"] or after.recompute_only
                r["phase"] = _PHASES[after.phase]
        if after is not None:
            self.tokens[request] = after.num_tokens
            if retires(after):
                self.retiring.append(request)
        preempted = (
            before is not None
            and after is not None
            and after.life.num_preemptions > before.life.num_preemptions
        )
        if preempted:
            srow["preemptions"] += 1
            assert before is not None
            self._end_admission(request, step, "preempted", before.num_tokens)
            self.wait[request] = [step, 0]
            self.links.pop(request, None)
        handler = _HANDLERS.get(cls)
        if handler is not None:
            handler(self, pos, e, request, before, after, srow, r)

    def _added(self, e: ev.Event, request: str, after: RequestState | None) -> None:
        assert isinstance(e, ev.RequestAdded)
        row: Row = {c.name: 0 for c in REQUESTS}
        row.update(
            request=request,
            req_id=e.req_id,
            added_step=e.step,
            prompt_len=len(e.prompt_token_ids),
            first_local_hit=-1,
            first_external=-1,
            recompute_only=False,
            finished_step=None,
            finish_reason=None,
            last_step=e.step,
            phase=None if after is None else _PHASES[after.phase],
        )
        self.requests[request] = row
        self.wait[request] = [e.step, 0]

    def _open_admission(self, request: str) -> Row | None:
        rows = self.admissions.get(request)
        if rows and rows[-1]["ended_by"] is None:
            return rows[-1]
        return None

    def _end_admission(self, request: str, step: int, how: str, tokens: int) -> None:
        a = self._open_admission(request)
        if a is not None:
            a.update(end_step=step, ended_by=how, tokens_at_end=tokens)

    # --- per event type ------------------------------------------------------------------

    def _lookup_asked(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        r = rest[-1]
        if r is not None:
            r["lookups"] += 1
        wait = self.wait.setdefault(request, [e.step, 0])
        wait[1] += 1
        links = self.links.setdefault(request, {})
        links.update(lookup_event=pos, lookup_step=e.step, answer_event=None)

    def _lookup_answered(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        self.links.setdefault(request, {})["answer_event"] = pos

    def _allocated(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        self.links.setdefault(request, {}).update(allocated_event=pos, allocated_step=e.step)

    def _scheduled(
        self,
        pos: int,
        e: Any,
        request: str,
        before: RequestState | None,
        after: RequestState | None,
        srow: Row,
        r: Row | None,
    ) -> None:
        srow["scheduled"] += 1
        srow["tokens_computed"] += e.num_scheduled
        if r is not None:
            r["scheduled_steps"] += 1
            r["tokens_computed"] += e.num_scheduled
        if e.admission is ev.Admission.RUNNING or before is None or after is None:
            return
        srow["admitted"] += 1
        rows = self.admissions.setdefault(request, [])
        lookup = before.lookup  # what the admission's lookup asked and found (the fold's)
        since, lookups = self.wait.pop(request, [e.step, 0])
        links = self.links.pop(request, {})
        rows.append(
            {
                "request": request,
                "req_id": e.req_id,
                "admission": len(rows) + 1,
                "event": pos,
                "step": e.step,
                "how": e.admission.name.lower(),
                "preempted_before": after.life.num_preemptions > 0,
                "waiting_since": since,
                "lookups": lookups,
                "lookup_event": links.get("lookup_event"),
                "lookup_step": links.get("lookup_step"),
                "answer_event": links.get("answer_event"),
                "asked": None if lookup is None else lookup.num_tokens,
                "local_hit": None if lookup is None else lookup.local_hit,
                "hit": None if lookup is None else lookup.hit,
                "offered": None if lookup is None else lookup.external,
                "accepted": before.accepted,
                "allocated_event": links.get("allocated_event"),
                "allocated_step": links.get("allocated_step"),
                "num_computed": e.num_computed,
                "num_scheduled": e.num_scheduled,
                "blocks": len(after.block_ids),
                "load_event": None,
                "load_step": None,
                "load_start": None,
                "load_end": None,
                "loaded": 0,
                "refused_blocks": 0,
                "load_result": None,
                "load_result_step": None,
                "tokens_saved": 0,
                "end_step": None,
                "ended_by": None,
                "tokens_at_end": None,
            }
        )
        if r is not None:
            r["admissions"] += 1

    def _load_planned(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        r = rest[-1]
        tokens = max(0, e.end - e.start)
        if e.refused_blocks and r is not None:
            r["loads_refused"] += 1
        a = self._open_admission(request)
        if a is not None:
            a.update(load_event=pos, load_step=e.step)
            if tokens:
                a.update(load_start=e.start, load_end=e.end, loaded=tokens)
            a["refused_blocks"] += len(e.refused_blocks)

    def _load_result(
        self,
        pos: int,
        e: Any,
        request: str,
        before: RequestState | None,
        after: RequestState | None,
        srow: Row,
        r: Row | None,
    ) -> None:
        failed = isinstance(e, ev.LoadFailed)
        if failed and r is not None:
            r["load_failures"] += 1
        # The result of the latest admission's load (a revoked load's result comes after
        # the preemption: it still belongs to the admission that planned it).
        for a in reversed(self.admissions.get(request, ())):
            if a["loaded"] and a["load_result"] is None:
                a.update(load_result="failed" if failed else "done", load_result_step=e.step)
                break

    def _save_planned(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        if not e.keys:
            return
        a = self._open_admission(request)
        if a is not None:
            a["tokens_saved"] += e.end - e.start
        admission = None if a is None else a["admission"]
        mine = self.saves.setdefault(request, {})
        c = self.config.chunk_size
        for i, (key, slot) in enumerate(zip(e.keys, e.slots, strict=False)):
            row = {
                "request": request,
                "req_id": e.req_id,
                "admission": admission,
                "event": pos,
                "step": e.step,
                "key": key.hex(),
                "start": e.start + i * c,
                "slot": slot,
                "result": None,
                "result_step": None,
            }
            previous = mine.get(key)
            if previous is not None:
                self.emit("saves", previous)
            mine[key] = row

    def _save_result(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        done = isinstance(e, ev.SaveDone)
        mine = self.saves.get(request, {})
        for key in e.keys:
            row = mine.pop(key, None)
            if row is not None:
                row.update(result="done" if done else "failed", result_step=e.step)
                self.emit("saves", row)

    def _finished(
        self,
        pos: int,
        e: Any,
        request: str,
        before: RequestState | None,
        after: RequestState | None,
        srow: Row,
        r: Row | None,
    ) -> None:
        if before is None or before.finished:
            return  # an unknown request's, or a second Finished (check names it)
        srow["finished"] += 1
        self._end_admission(request, e.step, "finished", before.num_tokens)
        if r is not None:
            r.update(finished_step=e.step, finish_reason=e.reason)

    def _violation(self, pos: int, e: Any, request: str, *rest: Any) -> None:
        r = rest[-1]
        if r is not None:
            r["violations"] += 1

    def _misses(self, a: AdmissionMisses) -> None:
        for m in a.misses:
            self.emit(
                "misses",
                {
                    "request": a.request,
                    "req_id": a.req_id,
                    "admission": a.admission,
                    "step": a.step,
                    "lookup_step": a.lookup_step,
                    "start": m.start,
                    "end": m.end,
                    "tokens": m.tokens,
                    "reason": m.reason,
                    "at_step": m.step,
                    "by_request": m.by,
                    "diverged_at": m.at_token,
                    "detail": m.detail or None,
                },
            )

    # --- closing -------------------------------------------------------------------------

    def _close_step(self, srow: Row) -> None:
        for request in self.retiring:
            self._emit_request(request)
        self.retiring.clear()
        counts = self.phase_counts
        stats = self.index.stats()
        done = self.step_counts
        srow.update({name: getattr(done, name) for name in _COUNTED})
        srow.update(
            violations=len(done.violations),
            running=counts[Phase.RUNNING],
            waiting=counts[Phase.WAITING],
            preempted=counts[Phase.PREEMPTED],
            pool_stored=stats["stored"],
            pool_writing=stats["writing"],
            pool_used=self.config.num_slots - stats["free"],
            remote_chunks=len(self.index.remote),
        )
        self.emit("steps", srow)

    def _emit_request(self, request: str) -> None:
        row = self.requests.pop(request, None)
        if row is not None:
            self.emit("requests", row)
        rows = self.admissions.pop(request, [])
        if rows and rows[-1]["ended_by"] is None:
            rows[-1]["tokens_at_end"] = self.tokens.get(request)
        for a in rows:
            self.emit("admissions", a)
        for save in self.saves.pop(request, {}).values():  # no result in the log
            self.emit("saves", save)
        self.tokens.pop(request, None)
        self.wait.pop(request, None)
        self.links.pop(request, None)

    def finish(self) -> None:
        """The requests still alive (or never retired) at the end of the log."""
        self.explainer.finish()
        for request in [*self.requests, *self.admissions, *self.saves]:
            self._emit_request(request)


_HANDLERS: dict[type[ev.Event], Callable[..., None]] = {
    ev.LookupAsked: _Builder._lookup_asked,
    ev.LookupAnswered: _Builder._lookup_answered,
    ev.Allocated: _Builder._allocated,
    ev.Scheduled: _Builder._scheduled,
    ev.LoadPlanned: _Builder._load_planned,
    ev.LoadDone: _Builder._load_result,
    ev.LoadFailed: _Builder._load_result,
    ev.SavePlanned: _Builder._save_planned,
    ev.SaveDone: _Builder._save_result,
    ev.SaveFailed: _Builder._save_result,
    ev.Finished: _Builder._finished,
    ev.ViolationRecorded: _Builder._violation,
}


def _problems(path: LogPath) -> tuple[list[Row], str | None]:
    """check's problems as rows (``request`` still the raw id), and check's error."""
    from kvledger.replay.format import format_event
    from kvledger.replay.replayer import check  # the Tracker: loaded only when the problems are

    result = check(path, max_problems=1 << 62)
    rows = [
        {
            "problem": n,
            "kind": p.kind,
            "name": p.name,
            "rule": p.rule,
            "step": p.step,
            "request": p.req_id or None,
            "req_id": p.req_id or None,
            "event": p.index if p.index >= 0 else None,
            "event_type": None if p.event is None else type(p.event).__name__,
            "headline": p.headline(),
            "detail": p.detail or None,
            "recorded_too": p.recorded_too,
            "recorded": "; ".join(format_event(d) for d in p.recorded) or None,
            "derived": "; ".join(format_event(d) for d in p.derived) or None,
        }
        for n, p in enumerate(result.problems, 1)
    ]
    return rows, result.error


def table_rows(path: LogPath | LogSource, emit: Emit, *, problems: bool = True) -> TableRows:
    """Read the log once (and replay it once with ``check`` for ``problems``) and call
    ``emit(table, row)`` for every row of every table of :data:`TABLES`. The rows of a table
    come in no promised order (steps and events in log order). A row is a dict holding every
    column of its table."""
    src = open_log(path)
    config = src.config()
    labels: dict[int, str] = {}
    problem_rows: list[Row] = []
    check_error = None
    if problems:
        paths = src.paths if len(src.paths) > 1 else src.paths[0]
        problem_rows, check_error = _problems(paths)
    wanted = {row["event"] for row in problem_rows if row["event"] is not None}

    def emit_and_label(table: str, row: Row) -> None:
        if table == "events" and row["event"] in wanted and row["request"] is not None:
            labels[row["event"]] = row["request"]
        emit(table, row)

    builder = _Builder(config, emit_and_label if wanted else emit, recorded=src.recorded)
    builder.run(src)
    builder.finish()
    for row in problem_rows:
        if row["event"] in labels:
            row["request"] = labels[row["event"]]
        emit("problems", row)
    return TableRows(src.damage, check_error, src.missing_segments())


def collect(
    path: LogPath | LogSource, tables: Sequence[str] | None = None, *, problems: bool = True
) -> tuple[dict[str, list[Row]], TableRows]:
    """The rows of ``tables`` (every table by default), in memory, and what was read."""
    wanted = set(TABLES if tables is None else tables)
    unknown = wanted - set(TABLES)
    if unknown:
        raise ValueError(f"no table {sorted(unknown)[0]!r}: the tables are {', '.join(TABLES)}")
    rows: dict[str, list[Row]] = {t: [] for t in TABLES if t in wanted}

    def keep(table: str, row: Row) -> None:
        bucket = rows.get(table)
        if bucket is not None:
            bucket.append(row)

    info = table_rows(path, keep, problems=problems and "problems" in wanted)
    return rows, info


_ABOUT = {
    "requests": "One row per request life. Key: `request`.",
    "admissions": "One row per admission: the lookup that fed it, the offer, what vLLM "
    "accepted, the load, how it ended. Key: (`request`, `admission`).",
    "saves": "One row per chunk a save plan wrote (a chunk saved again: one row each time). "
    "Key: (`request`, `event`, `key`).",
    "steps": "One row per scheduler step in the log, the counts taken after the step. Key: `step`.",
    "events": "One row per event of the log; its own fields are in its type's `ev_` table. "
    "Key: `event`.",
    "misses": "One row per span of tokens an admission's lookup missed, with its reason "
    "(`kvledger explain`; [Why did my prompt miss?](why-missed.md)). The tokens of a reason "
    "sum to `kvledger explain`'s and `kvledger stats`'. Key: (`request`, `admission`, `start`).",
    "problems": "What `kvledger check` reports, one row per problem, in its order. Key: `problem`.",
}


def markdown_reference() -> str:
    """Every table and column as Markdown (the reference in docs/sql.md)."""
    out: list[str] = []
    for table, columns in TABLES.items():
        if table.startswith("ev_"):
            continue
        out += [f"### `{table}`", "", _ABOUT[table], "", "| column | type | meaning |"]
        out.append("|---|---|---|")
        out += [f"| `{c.name}` | {c.kind} | {c.doc} |" for c in columns]
        out.append("")
    out += [
        "### `ev_<type>`: one table per event type",
        "",
        "Each holds its type's own fields, typed (chunk keys as hex strings, enums by name; "
        "[Events](events.md) says what each field means), after the keys `event`, `step`, "
        "and `request`, `req_id` for the events about one request. `ev_step_decoded` has one "
        "row per request a `StepDecoded` named, with `new_block`; `ev_violation_recorded`'s "
        "`event` field is `event_type`.",
        "",
        "| table | columns |",
        "|---|---|",
    ]
    for table, columns in TABLES.items():
        if table.startswith("ev_"):
            out.append(f"| `{table}` | {', '.join(f'`{c.name}`' for c in columns)} |")
    return "\n".join(out) + "\n"
