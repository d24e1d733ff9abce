"""Read-only views of a captured log: ``show``, ``stats``, ``timeline``, ``export``.

Every view streams the log once (``timeline`` twice): memory is bounded by the requests alive
at a time, plus a few integers per request where a view must rank or align them. Every view
accepts a file, a directory holding one log's segments, or a list of segment files. A log
damaged part-way (a torn tail after a crash, a corrupt frame, a broken segment chain) still
gives everything before the damage, and the result says where and why reading stopped
(``damage``: file, byte offset, reason). A log that cannot be read at all (not a kvledger log,
a newer major format, a damaged first header, no ``*.kvlog`` file) raises
:class:`LogUnreadable`.

States are the recorded ones: ``show``, ``stats`` and ``timeline`` fold the recorded events,
input facts *and* decisions, with :func:`tracker.state.fold` under the configuration of the
log's header, so each state is exactly what the recording tracker held after that event.
(Re-deriving the decisions with this version of the code and comparing them is
``kvledger check``'s job, not a view's.)
"""

from __future__ import annotations

import contextlib
import enum
import html
import json
import math
import os
import sys
import typing
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from tracker import events as ev
from tracker.config import ConfigError, TrackerConfig
from tracker.log import Frame, LogFormatError, LogReader, RawFrame, StopInfo
from tracker.numbering import RequestNumbers
from tracker.state import Phase, RequestState, advance_decoded, fold

__all__ = [
    "EXPORT_COLUMNS",
    "ExportResult",
    "LogSource",
    "LogUnreadable",
    "RequestLife",
    "RequestNotFound",
    "Row",
    "Stats",
    "TimelineResult",
    "describe_event",
    "event_fields",
    "export",
    "open_log",
    "show",
    "stats",
    "timeline",
]

PathLike = str | os.PathLike[str]
LogPath = PathLike | Sequence[PathLike]

POOL = ""  # req_id of the pool's own events (ChunkStored, ChunkEvicted)

# Finished request ids remembered (to number a reused id's next life), as the Tracker does.
_RETIRED_MEMORY = 65536


class LogUnreadable(Exception):
    """Nothing at all could be read from the log: the message says which file and why."""


class RequestNotFound(LookupError):
    """``show`` found no request with that id; ``candidates`` are ids that contain it."""

    def __init__(self, request: str, candidates: Sequence[str] = ()) -> None:
        self.request = request
        self.candidates = tuple(candidates)
        if len(self.candidates) > 1:
            shown = ", ".join(self.candidates[:10])
            more = "" if len(self.candidates) <= 10 else f" (+{len(self.candidates) - 10} more)"
            msg = f"request {request!r} is ambiguous: {shown}{more}"
        else:
            msg = f"no request {request!r} in the log"
        super().__init__(msg)


# --- opening a log ----------------------------------------------------------------------------


def _tracker_config(config: Any) -> tuple[TrackerConfig, str | None]:
    """The TrackerConfig from a header's ``config`` (which also holds connector keys such as
    ``vllm_version``): only TrackerConfig's fields, never strict. Falls back to the defaults,
    with the reason, when the header's values are unusable."""
    if not isinstance(config, dict):
        return TrackerConfig(), "header config is not a map; using the default configuration"
    names = {f.name for f in attrs.fields(TrackerConfig)}
    values = {k: v for k, v in config.items() if k in names}
    values["strict"] = False
    try:
        return TrackerConfig(**values), None
    except (ConfigError, TypeError) as e:
        return TrackerConfig(), f"header config unusable ({e}); using the default configuration"


class LogSource:
    """One log opened for reading: its header, the tracker configuration it was written with,
    and :meth:`frames`, a fresh pass over its frames each time. After a pass, :attr:`damage`
    says where and why reading stopped early (None after a clean end)."""

    def __init__(self, path: LogPath) -> None:
        self.name = _name_of(path)
        try:
            self.reader = LogReader(path)
            header = self.reader.header
        except LogFormatError as e:
            raise LogUnreadable(str(e)) from None
        except (OSError, ValueError) as e:
            raise LogUnreadable(f"{self.name}: {e}") from None
        if not self.reader.paths:
            raise LogUnreadable(f"{self.name}: no *.kvlog file")
        if header is None:
            stop = self.reader.stop
            why = stop.describe() if stop is not None else "unreadable header"
            raise LogUnreadable(why)
        self.header: dict[str, Any] = header
        self.config, self.config_problem = _tracker_config(header.get("config"))
        self.damage: StopInfo | None = None

    @property
    def paths(self) -> list[Path]:
        return list(self.reader.paths)

    def file_bytes(self) -> int:
        total = 0
        for p in self.reader.paths:
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def frames(self) -> Iterator[Frame]:
        """Every readable frame, in order; sets :attr:`damage` when the pass ends."""
        self.damage = None
        try:
            yield from self.reader
        except LogFormatError as e:
            # A later segment that is not a kvledger log at all (zero-filled after a crash,
            # say): LogReader raises instead of stopping; it is damage like any other.
            self.damage = self._format_damage(e)
            return
        self.damage = self.reader.stop

    def raw_frames(self) -> Iterator[RawFrame]:
        """Like :meth:`frames`, as raw records (``LogReader.iter_raw``: no event objects)."""
        self.damage = None
        try:
            yield from self.reader.iter_raw()
        except LogFormatError as e:
            self.damage = self._format_damage(e)
            return
        self.damage = self.reader.stop

    def _format_damage(self, e: LogFormatError) -> StopInfo:
        text = str(e)
        path = text.split(": offset", 1)[0] if ": offset" in text else self.name
        return StopInfo(path, 0, text, "bad_header")


def open_log(path: LogPath | LogSource) -> LogSource:
    """A :class:`LogSource` for ``path`` (a file, a directory, a list of segment files)."""
    return path if isinstance(path, LogSource) else LogSource(path)


def _name_of(path: LogPath) -> str:
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    items = [os.fspath(p) for p in path]
    return items[0] if len(items) == 1 else f"{items[0]} (+{len(items) - 1} segments)"


def damage_dict(d: StopInfo | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"file": d.path, "offset": d.offset, "kind": d.kind, "reason": d.reason}


# --- events as plain values ---------------------------------------------------------------------

_FIELDS: dict[type[ev.Event], tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls))[2:] for cls in ev.EVENT_TYPES
}


def field_names(cls: type[ev.Event]) -> tuple[str, ...]:
    """An event type's own fields (after ``step`` and ``req_id``), in wire order."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in attrs.fields(cls))[2:]
    return names


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple):
        if value and isinstance(value[0], bytes):
            return [v.hex() for v in value]
        return list(value)
    return value


def event_fields(e: ev.Event) -> dict[str, Any]:
    """The event's own fields as JSON values: bytes as hex, enums by name, tuples as lists."""
    return {name: _plain(getattr(e, name)) for name in field_names(type(e))}


def event_content(e: ev.Event) -> tuple[Any, ...]:
    """What two runs must agree on: the type and every field but ``step`` and ``req_id``."""
    return (type(e), *(getattr(e, name) for name in field_names(type(e))))


def _short_ints(values: Sequence[int], limit: int = 6) -> str:
    if len(values) <= limit:
        return "[" + " ".join(map(str, values)) + "]"
    head = " ".join(map(str, values[: limit - 2]))
    return f"[{head} … {values[-1]}]({len(values)})"


def describe_event(e: ev.Event) -> str:
    """One short line for a table: the fields that say something, sequences abridged."""
    if isinstance(e, ev.RequestAdded):
        salt = f" salt={e.cache_salt}" if e.cache_salt else ""
        return f"prompt {len(e.prompt_token_ids)} tokens{salt}"
    if isinstance(e, ev.StepDecoded):
        n = len(e.nums)
        return f"+1 token for each of {n} request{'s' if n != 1 else ''} nums={_short_ints(e.nums)}"
    parts: list[str] = []
    cls = type(e)
    for f in attrs.fields(cls)[2:]:
        value = getattr(e, f.name)
        name = f.name
        if isinstance(value, enum.Enum):
            parts.insert(0, value.name)
        elif isinstance(value, bool):
            if value:
                parts.append(name)
        elif isinstance(value, bytes):
            parts.append(f"{name}={value.hex()[:8]}")
        elif isinstance(value, tuple):
            if name == "token_ids":
                if value:
                    parts.append(f"+{len(value)} ids")
            elif value and isinstance(value[0], bytes):
                parts.append(f"{name}={len(value)}")
            elif value or f.default is attrs.NOTHING:
                parts.append(f"{name}={_short_ints(value)}")
        elif name == "token_start":
            continue  # where the new ids go: noise in a table
        elif isinstance(value, str):
            if value:
                parts.append(f"{name}={value}")
        elif f.default is attrs.NOTHING or value != f.default:
            parts.append(f"{name}={value}")
    return " ".join(parts)


# --- request lives ----------------------------------------------------------------------------


class _Lives:
    """Names each request's life: its id, then ``id#2``, ``id#3`` when vLLM reuses an id after
    the request finished (a ``RequestAdded`` after the ``Finished`` starts a new life). A late
    event of a finished life (a save result) keeps that life's name."""

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
        if len(self.count) > _RETIRED_MEMORY:
            self.count.popitem(last=False)


# (position in the log, frame, event, life label, starts a life)
Labelled = tuple[int, Frame, ev.Event, str, bool]
# (position in the log, frame, event, req_id, life label, starts a life, state before, after)
Folded = tuple[int, Frame, ev.Event, str, str, bool, "RequestState | None", "RequestState | None"]

# Events about no one request (their req_id is empty): the pool's own, and StepDecoded (one
# steady decode step of several requests, named by their request numbers).
_GLOBAL_TYPES = (ev.ChunkStored, ev.ChunkEvicted, ev.StepDecoded)


def _labelled(src: LogSource) -> Iterator[Labelled]:
    """Every event with its position in the log and its request's life label; the events
    about no one request (ChunkStored, ChunkEvicted, StepDecoded) under :data:`POOL`."""
    lives = _Lives()
    live_get = lives.live.get
    label = lives.label
    added, finished = ev.RequestAdded, ev.Finished
    pos = -1
    for frame in src.frames():
        for e in frame.events:
            pos += 1
            cls = e.__class__
            if cls is not added and cls is not finished:
                current = live_get(e.req_id)
                if current is not None:  # the hot path: an event of a live request
                    yield pos, frame, e, current[0], False
                    continue
                if not e.req_id and cls in _GLOBAL_TYPES:
                    yield pos, frame, e, POOL, False
                    continue
            name, new = label(e.req_id, cls)
            yield pos, frame, e, name, new


def _idle_finished(state: RequestState) -> bool:
    """Finished, with no save or load in flight: the Tracker retires it."""
    return (
        state.phase is Phase.FINISHED
        and not state.save.pending
        and (state.load is None or state.load.done)
    )


def _walk(src: LogSource, want: Callable[[str], bool] | None = None) -> Iterator[Folded]:
    """Fold the recorded events, input facts and decisions, request by request, as the
    recording Tracker did; yield each event with its request's state before and after it.

    ``StepDecoded`` (one steady decode step of several requests, by request number) is
    yielded once as itself (req_id and label :data:`POOL`, no states), then once per request
    it names, with that request's id, label and states. Request numbers follow the log
    format's rule: the lowest free number, taken when a request is added and freed at its
    ``Finished``.

    ``want(req_id)`` limits what is yielded (every request is still folded: numbers depend
    on all of them); without it the events about no request are yielded too. A retired
    request's state is dropped: memory follows the live requests."""
    config = src.config
    states: dict[str, RequestState] = {}
    get = states.get
    lives = _Lives()
    live = lives.live
    numbers = RequestNumbers()  # the log format's rule, as the recording Tracker applied it
    req_of = numbers.req_of
    added, finished, decoded = ev.RequestAdded, ev.Finished, ev.StepDecoded
    pos = -1
    for frame in src.frames():
        for e in frame.events:
            pos += 1
            cls = e.__class__
            rid = e.req_id
            if not rid and cls in _GLOBAL_TYPES:
                if want is None:
                    yield pos, frame, e, POOL, POOL, False, None, None
                if cls is decoded:
                    grew = e.new_blocks() or {}  # type: ignore[attr-defined]
                    for num in e.nums:  # type: ignore[attr-defined]
                        r = req_of.get(num)
                        state = get(r) if r is not None else None
                        if r is None or state is None:
                            continue  # an unknown number: kvledger check names it
                        # As the recording Tracker did (it validates only on replay).
                        block = grew.get(num)
                        advanced = advance_decoded(state, 1, () if block is None else (block,))
                        states[r] = advanced
                        if want is None or want(r):
                            label = live[r][0] if r in live else r
                            yield pos, frame, e, r, label, False, state, advanced
                continue
            current = live.get(rid)
            if current is not None and cls is not added and cls is not finished:
                label, new = current[0], False
            else:
                label, new = lives.label(rid, cls)
            before = get(rid)
            after: RequestState | None = None
            if before is not None or cls is added:
                after = fold(before, e, config)[0]
                if after is not None:
                    if cls is added:
                        numbers.take(rid)
                    elif cls is finished:
                        numbers.give_back(rid)
                    if _idle_finished(after):
                        states.pop(rid, None)
                    else:
                        states[rid] = after
            if want is None or want(rid):
                yield pos, frame, e, rid, label, new, before, after


# --- show ---------------------------------------------------------------------------------------


@attrs.frozen
class Row:
    """One event of a request's life and the request's state right after it."""

    index: int  # position of the event in the log (0-based, over all events)
    step: int
    event: str
    detail: str
    life: str
    phase: str
    tokens_known: int
    num_tokens: int
    num_computed: int
    block_ids: tuple[int, ...]
    saved: int
    saves_in_flight: int
    load: tuple[int, int] | None
    load_done: bool
    preempted: bool
    preemptions: int
    recompute_only: bool
    violation: str = ""  # the rule, on a ViolationRecorded row

    @property
    def blocks(self) -> int:
        return len(self.block_ids)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["block_ids"] = list(self.block_ids)
        d["load"] = None if self.load is None else list(self.load)
        d["blocks"] = self.blocks
        return d


class RequestLife(list[Row]):
    """``show``'s result: the rows, plus the request's id, the config and any read damage."""

    request: str
    config: TrackerConfig
    damage: StopInfo | None
    log: str

    def __init__(
        self,
        rows: Iterable[Row],
        request: str,
        config: TrackerConfig,
        damage: StopInfo | None,
        log: str,
    ) -> None:
        super().__init__(rows)
        self.request = request
        self.config = config
        self.damage = damage
        self.log = log

    def to_dict(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "request": self.request,
            "rows": [r.to_dict() for r in self],
            "damage": damage_dict(self.damage),
        }


def _row(item: Folded) -> Row:
    pos, _, e, _, label, _, _, s = item
    violation = e.rule if isinstance(e, ev.ViolationRecorded) else ""
    if s is None:  # an event about a request the log never added
        return Row(pos, e.step, type(e).__name__, describe_event(e), label,
                   "unknown", 0, 0, 0, (), 0, 0, None, False, False, 0, False, violation)  # fmt: skip
    return Row(
        index=pos,
        step=e.step,
        event=type(e).__name__,
        detail=describe_event(e),
        life=label,
        phase=s.phase.name.lower(),
        tokens_known=len(s.token_ids),
        num_tokens=s.num_tokens,
        num_computed=s.num_computed,
        block_ids=tuple(s.block_ids),
        saved=s.saved,
        saves_in_flight=len(s.save.pending),
        load=None if s.load is None else (s.load.start, s.load.end),
        load_done=bool(s.load is not None and s.load.done),
        preempted=s.preempted,
        preemptions=s.life.num_preemptions,
        recompute_only=s.recompute_only,
        violation=violation,
    )


def show(path: LogPath | LogSource, request: str) -> RequestLife:
    """One request's life: a :class:`Row` per event of the request (every life of the id,
    when vLLM reused it), with the request's state after the event.

    ``request`` is the exact id, or a part of exactly one id (vLLM's ids carry long random
    suffixes); :class:`RequestNotFound` otherwise, with the ids that matched."""
    src = open_log(path)
    rows = [_row(s) for s in _walk(src, lambda rid: rid == request)]
    if rows:
        return RequestLife(rows, request, src.config, src.damage, src.name)
    damage = src.damage
    candidates: dict[str, None] = {}
    for frame in src.frames():
        for e in frame.events:
            if request in e.req_id and e.req_id != POOL:
                candidates[e.req_id] = None
    candidates_list = list(candidates)
    if len(candidates_list) != 1:
        raise RequestNotFound(request, candidates_list)
    rid = candidates_list[0]
    rows = [_row(s) for s in _walk(src, lambda r: r == rid)]
    return RequestLife(rows, rid, src.config, src.damage or damage, src.name)


# --- stats ----------------------------------------------------------------------------------------


@attrs.define
class LookupStats:
    """Lookups at admission: what vLLM asked (``tokens``), what the pool held (``hit``),
    what vLLM's own prefix cache covered (``local``), what it accepted from us (``external``)."""

    admissions: int = 0
    tokens: int = 0
    hit: int = 0
    local: int = 0
    external: int = 0
    without_lookup: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hit / self.tokens if self.tokens else None

    @property
    def local_rate(self) -> float | None:
        return self.local / self.tokens if self.tokens else None

    @property
    def external_rate(self) -> float | None:
        return self.external / self.tokens if self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d.update(hit_rate=self.hit_rate, local_rate=self.local_rate)
        d["external_rate"] = self.external_rate
        return d


@attrs.define
class Stats:
    """What a log holds, counted in one pass. See :func:`stats`."""

    log: str
    files: list[str]
    file_bytes: int = 0
    frames: int = 0
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    seconds: float | None = None  # wall time from the first frame to the last
    events: int = 0
    # Events counting a StepDecoded once per request it names: what the log would hold
    # without the hot path's one-record-per-step encoding.
    logical_events: int = 0
    input_events: int = 0
    decision_events: int = 0
    events_by_type: dict[str, int] = attrs.field(factory=dict)
    requests: int = 0  # request lives (an id reused after it finished counts again)
    finished: int = 0
    finish_reasons: dict[str, int] = attrs.field(factory=dict)
    preemptions: int = 0  # signalled or inferred at re-admission
    readmissions: int = 0
    first_lookup: LookupStats = attrs.field(factory=LookupStats)
    all_lookups: LookupStats = attrs.field(factory=LookupStats)
    loads: int = 0
    tokens_loaded: int = 0
    loads_refused: int = 0
    load_failures: int = 0
    saves: int = 0
    tokens_saved: int = 0
    chunks_saved: int = 0
    chunks_confirmed: int = 0
    chunks_failed: int = 0
    violations: dict[str, int] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)
    library_version: str = ""
    format_version: str = ""
    run_id: str = ""
    config_problem: str | None = None
    damage: StopInfo | None = None

    @property
    def bytes_per_event(self) -> float | None:
        return self.file_bytes / self.events if self.events else None

    @property
    def bytes_per_logical_event(self) -> float | None:
        return self.file_bytes / self.logical_events if self.logical_events else None

    @property
    def violations_total(self) -> int:
        return sum(self.violations.values())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in attrs.fields(Stats):
            value = getattr(self, f.name)
            if isinstance(value, LookupStats):
                value = value.to_dict()
            elif isinstance(value, StopInfo):
                value = damage_dict(value)
            d[f.name] = value
        d["bytes_per_event"] = self.bytes_per_event
        d["bytes_per_logical_event"] = self.bytes_per_logical_event
        return d


def stats(path: LogPath | LogSource) -> Stats:
    """Count what a log holds: requests, steps, events by type, preemptions, lookup hit rates
    at first admission and at every admission, tokens loaded and saved, violations by rule,
    bytes per event (file size / events; also per logical event, a ``StepDecoded`` counting
    once per request it names), the header's configuration, and read damage."""
    src = open_log(path)
    h = src.header
    st = Stats(
        log=src.name,
        files=[str(p) for p in src.paths],
        file_bytes=src.file_bytes(),
        config=dict(h.get("config") or {}),
        library_version=str(h.get("library_version", "")),
        format_version=f"{h.get('major', '?')}.{h.get('minor', '?')}",
        run_id=str(h.get("run_id", "")),
        config_problem=src.config_problem,
    )
    by_type: Counter[type[ev.Event]] = Counter()
    reasons: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    last_frame: Frame | None = None
    first_wall: int | None = None
    prev_step: int | None = None
    running = ev.Admission.RUNNING
    # Preemption happens only in these folds (signalled, inferred from a lookup of a running
    # request, or from a re-admission); checking only them keeps the decode path cheap.
    may_preempt = (ev.Preempted, ev.LookupAsked)
    last_pos = -1
    decoded = 0
    for pos, frame, e, _, _, new, before, after in _walk(src):
        if pos == last_pos:
            continue  # StepDecoded again, for one of its requests: counted once
        last_pos = pos
        if frame is not last_frame:
            last_frame = frame
            st.frames += 1
            if first_wall is None:
                first_wall = frame.wall_ns
                st.first_step = frame.step
            if frame.step != prev_step:
                st.steps += 1
                prev_step = frame.step
        cls = e.__class__
        by_type[cls] += 1
        if cls is ev.Scheduled:
            if e.admission is running:  # type: ignore[attr-defined]
                continue  # the hot path: nothing to count beyond the type
            if before is not None:
                _count_lookup(st.all_lookups, before)
                if before.life.first_local_hit < 0:
                    _count_lookup(st.first_lookup, before)
                else:
                    st.readmissions += 1
        elif cls is ev.RequestAdded:
            if new:
                st.requests += 1
        elif cls is ev.Finished:
            if before is not None and not before.finished:
                st.finished += 1
                reasons[e.reason] += 1  # type: ignore[attr-defined]
        elif cls is ev.LoadPlanned:
            assert isinstance(e, ev.LoadPlanned)
            if e.end > e.start:
                st.loads += 1
                st.tokens_loaded += e.end - e.start
            if e.refused_blocks:
                st.loads_refused += 1
        elif cls is ev.LoadFailed:
            st.load_failures += 1
        elif cls is ev.SavePlanned:
            assert isinstance(e, ev.SavePlanned)
            if e.keys:
                st.saves += 1
                st.tokens_saved += e.end - e.start
                st.chunks_saved += len(e.keys)
        elif cls is ev.SaveDone:
            st.chunks_confirmed += len(e.keys)  # type: ignore[attr-defined]
        elif cls is ev.SaveFailed:
            st.chunks_failed += len(e.keys)  # type: ignore[attr-defined]
        elif cls is ev.ViolationRecorded:
            rules[e.rule] += 1  # type: ignore[attr-defined]
        elif cls is ev.StepDecoded:
            decoded += len(e.nums)  # type: ignore[attr-defined]
        if (
            (cls is ev.Scheduled or cls in may_preempt)
            and before is not None
            and after is not None
            and after.life.num_preemptions > before.life.num_preemptions
        ):
            st.preemptions += 1
    if last_frame is not None:
        st.last_step = last_frame.step
        if first_wall is not None:
            st.seconds = (last_frame.wall_ns - first_wall) / 1e9
    st.events = sum(by_type.values())
    st.logical_events = st.events - by_type[ev.StepDecoded] + decoded
    st.decision_events = sum(n for cls, n in by_type.items() if cls.KIND == "decision")
    st.input_events = st.events - st.decision_events
    st.events_by_type = {cls.__name__: n for cls, n in by_type.most_common()}
    st.finish_reasons = dict(reasons.most_common())
    st.violations = dict(rules.most_common())
    st.damage = src.damage
    return st


def _count_lookup(bucket: LookupStats, before: RequestState) -> None:
    bucket.admissions += 1
    lookup = before.lookup
    if lookup is None:
        bucket.without_lookup += 1
        return
    bucket.tokens += lookup.num_tokens
    bucket.hit += lookup.hit
    bucket.local += lookup.local_hit
    bucket.external += before.accepted


# --- timeline --------------------------------------------------------------------------------------


@attrs.define
class Series:
    """One request's curves over steps (a sample after each step it had events in)."""

    label: str
    steps: list[int] = attrs.field(factory=list)
    computed: list[int] = attrs.field(factory=list)  # num_tokens: KV existing or computing
    saved: list[int] = attrs.field(factory=list)  # confirmed saved watermark
    loads: list[tuple[int, int, int]] = attrs.field(factory=list)  # (step, start, end)
    load_failures: list[int] = attrs.field(factory=list)  # steps of LoadFailed
    preemptions: list[int] = attrs.field(factory=list)  # steps
    violations: list[tuple[int, str]] = attrs.field(factory=list)  # (step, rule)
    finished: int | None = None


@attrs.frozen
class TimelineResult:
    out: str
    format: str
    series: tuple[Series, ...]
    requests: int
    damage: StopInfo | None


def _rank(src: LogSource) -> tuple[list[tuple[str, str]], int]:
    """The requests worth a picture first: with violations, then preempted ones, then by
    tokens computed; ties by arrival. Returns ((label, req_id) in that order, request lives)."""
    # label -> [violations, preemptions, tokens scheduled, arrival, req_id]
    score: dict[str, list[Any]] = {}
    scheduled, decoded = ev.Scheduled, ev.StepDecoded
    for _, _, e, rid, label, _, before, after in _walk(src):
        if label is POOL and not rid:
            continue
        entry = score.get(label)
        if entry is None:
            entry = score[label] = [0, 0, 0, len(score), rid]
        cls = e.__class__
        if cls is scheduled:
            entry[2] += e.num_scheduled  # type: ignore[attr-defined]
        elif cls is decoded:
            entry[2] += 1
        elif cls is ev.ViolationRecorded:
            entry[0] += 1
        if (
            before is not None
            and after is not None
            and after.life.num_preemptions > before.life.num_preemptions
        ):
            entry[1] += 1
    ranked = sorted(score, key=lambda k: (-score[k][0], -score[k][1], -score[k][2], score[k][3]))
    return [(label, score[label][4]) for label in ranked], len(score)


def _collect(src: LogSource, chosen: Sequence[tuple[str, str]]) -> list[Series]:
    wanted = {label: Series(label) for label, _ in chosen}
    ids = {rid for _, rid in chosen}
    touched: dict[str, RequestState] = {}
    frame: Frame | None = None

    def flush(step: int) -> None:
        for label, state in touched.items():
            series = wanted[label]
            if series.steps and series.steps[-1] == step:
                series.computed[-1], series.saved[-1] = state.num_tokens, state.saved
                continue
            series.steps.append(step)
            series.computed.append(state.num_tokens)
            series.saved.append(state.saved)
        touched.clear()

    for _, at, e, _, label, _, before, after in _walk(src, ids.__contains__):
        if at is not frame:
            if frame is not None:
                flush(frame.step)
            frame = at
        series = wanted.get(label)
        if series is None or after is None:
            continue
        touched[label] = after
        if isinstance(e, ev.LoadPlanned) and e.end > e.start:
            series.loads.append((e.step, e.start, e.end))
        elif isinstance(e, ev.LoadFailed):
            series.load_failures.append(e.step)
        elif isinstance(e, ev.ViolationRecorded):
            series.violations.append((e.step, e.rule))
        elif isinstance(e, ev.Finished) and series.finished is None:
            series.finished = e.step
        if before is not None and after.life.num_preemptions > before.life.num_preemptions:
            series.preemptions.append(e.step)
    if frame is not None:
        flush(frame.step)
    return [wanted[label] for label, _ in chosen]


def timeline(path: LogPath | LogSource, out: PathLike, top: int = 8) -> TimelineResult:
    """A picture of the ``top`` most telling requests over the steps: tokens computed (KV
    existing or being computed), saved watermark, loads (the loaded token range at its step),
    preemptions and violations marked. ``out`` ending in ``.html`` gives a self-contained page
    with inline SVG (no extra needed); ``.png`` (or ``.svg``, ``.pdf``) uses matplotlib (the
    ``timeline`` extra). Requests are ranked: with violations first, then preempted ones, then
    by tokens computed."""
    out_s = os.fspath(out)
    fmt = Path(out_s).suffix.lower().lstrip(".")
    if fmt not in ("html", "htm", "png", "svg", "pdf"):
        raise ValueError(f"timeline output must end in .html or .png (got {out_s!r})")
    if fmt != "html" and fmt != "htm":
        _require("matplotlib", "timeline", f"a .{fmt} timeline (or write .html instead)")
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    src = open_log(path)
    ranked, n = _rank(src)
    chosen = ranked[:top]
    series = _collect(src, chosen)
    title = f"{src.name}: {len(chosen)} of {n} requests"
    if fmt in ("html", "htm"):
        _write_atomic(out_s, _timeline_html(series, title, src.damage).encode())
    else:
        _timeline_matplotlib(series, title, src.damage, out_s)
    return TimelineResult(out_s, fmt, tuple(series), n, src.damage)


_COLORS = {"computed": "#1f77b4", "saved": "#ff7f0e", "loaded": "#2ca02c", "bad": "#d62728"}


def _timeline_html(series: Sequence[Series], title: str, damage: StopInfo | None) -> str:
    width, left, right, panel, gap, top_pad = 1000, 150, 20, 70, 18, 30
    steps = [st for s in series for st in s.steps] + [st for s in series for st, _, _ in s.loads]
    x0 = min(steps, default=0)
    x1 = max(steps, default=1)
    if x1 == x0:
        x1 = x0 + 1
    plot_w = width - left - right
    height = top_pad + len(series) * (panel + gap) + 30

    def x(step: float) -> float:
        return left + (step - x0) / (x1 - x0) * plot_w

    out: list[str] = []
    w = out.append
    w(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    )
    legend = [
        ("computed", "tokens computed"),
        ("saved", "saved watermark"),
        ("loaded", "loaded range (v: load failed)"),
        ("bad", "preemption (dashed) / violation (x)"),
    ]
    lx = left
    for key, text in legend:
        w(f'<rect x="{lx}" y="8" width="12" height="4" fill="{_COLORS[key]}"/>')
        w(f'<text x="{lx + 16}" y="14">{html.escape(text)}</text>')
        lx += 30 + 7 * len(text)
    for i, s in enumerate(series):
        y_top = top_pad + i * (panel + gap)
        y_bot = y_top + panel
        ymax = max([*s.computed, *s.saved, *(end for _, _, end in s.loads), 1])

        def y(v: float, y_bot: float = y_bot, ymax: int = ymax) -> float:
            return y_bot - v / ymax * panel

        label = html.escape(s.label)
        w(f'<g class="request" data-request="{label}">')
        w(f"<title>{label}</title>")
        w(
            f'<rect x="{left}" y="{y_top}" width="{plot_w}" height="{panel}" fill="none" '
            'stroke="#ccc"/>'
        )
        w(f'<text x="{left - 8}" y="{y_top + panel / 2 + 4}" text-anchor="end">{label}</text>')
        w(f'<text x="{left - 8}" y="{y_top + 10}" text-anchor="end" fill="#888">{ymax}</text>')
        for key, values in (("computed", s.computed), ("saved", s.saved)):
            pts = _step_points(s.steps, values, x, y)
            if pts:
                w(
                    f'<polyline class="{key}" fill="none" stroke="{_COLORS[key]}" '
                    f'stroke-width="1.5" points="{pts}"/>'
                )
        for step, start, end in s.loads:
            w(
                f'<line class="loaded" x1="{x(step):.1f}" x2="{x(step):.1f}" '
                f'y1="{y(start):.1f}" y2="{y(end):.1f}" stroke="{_COLORS["loaded"]}" '
                f'stroke-width="5"><title>step {step}: loaded [{start}, {end})</title></line>'
            )
        for step in s.load_failures:
            cx = x(step)
            w(
                f'<path class="load-failed" d="M{cx - 4:.1f},{y_bot - 9:.1f} L{cx + 4:.1f},'
                f'{y_bot - 9:.1f} L{cx:.1f},{y_bot - 1:.1f} Z" fill="#006400">'
                f"<title>step {step}: load failed</title></path>"
            )
        for step in s.preemptions:
            w(
                f'<line class="preempted" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{y_top}" '
                f'y2="{y_bot}" stroke="{_COLORS["bad"]}" stroke-dasharray="4 3">'
                f"<title>step {step}: preempted</title></line>"
            )
        for step, rule in s.violations:
            cx, cy = x(step), y_top + 6
            w(
                f'<path class="violation" d="M{cx - 4:.1f},{cy - 4:.1f} L{cx + 4:.1f},'
                f'{cy + 4:.1f} M{cx - 4:.1f},{cy + 4:.1f} L{cx + 4:.1f},{cy - 4:.1f}" '
                f'stroke="{_COLORS["bad"]}" stroke-width="2">'
                f"<title>step {step}: {html.escape(rule)}</title></path>"
            )
        if s.finished is not None:
            w(
                f'<circle class="finished" cx="{x(s.finished):.1f}" cy="{y_bot}" r="3" '
                f'fill="#555"><title>step {s.finished}: finished</title></circle>'
            )
        w("</g>")
    axis_y = top_pad + len(series) * (panel + gap) + 2
    for tick in _ticks(x0, x1):
        w(f'<text x="{x(tick):.1f}" y="{axis_y + 10}" text-anchor="middle">{tick}</text>')
    w(f'<text x="{left + plot_w / 2}" y="{axis_y + 24}" text-anchor="middle">step</text>')
    w("</svg>")
    note = ""
    if damage is not None:
        note = (
            f'<p class="damage">Read stopped early: {html.escape(damage.describe())}. '
            "Everything before it is shown.</p>"
        )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f'<title>{html.escape(title)}</title></head>\n<body style="font-family:sans-serif">\n'
        f"<h3>{html.escape(title)}</h3>\n{note}\n" + "\n".join(out) + "\n</body></html>\n"
    )


def _step_points(
    steps: Sequence[int],
    values: Sequence[int],
    x: Callable[[float], float],
    y: Callable[[float], float],
) -> str:
    """A step function's polyline, at most four points per pixel column (the first, lowest,
    highest and last value in it), so a request that lived 100,000 steps stays a small page."""
    points: list[tuple[float, float]] = []
    column: list[tuple[float, float]] = []
    prev: int | None = None

    def flush() -> None:
        if len(column) <= 4:
            points.extend(column)
        else:
            lo = min(column, key=lambda p: p[1])
            hi = max(column, key=lambda p: p[1])
            points.extend((column[0], lo, hi, column[-1]))
        column.clear()

    for st, v in zip(steps, values, strict=True):
        px = x(st)
        if column and round(column[-1][0]) != round(px):
            flush()
        if prev is not None:  # hold the previous value up to this step, then move
            column.append((px, y(prev)))
        column.append((px, y(v)))
        prev = v
    flush()
    if len(points) == 1:
        points.append(points[0])
    return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)


def _ticks(x0: int, x1: int, n: int = 8) -> list[int]:
    span = x1 - x0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), 10 * mag)
    step = max(1, int(step))
    first = (x0 + step - 1) // step * step
    return list(range(first, x1 + 1, step))


def _timeline_matplotlib(
    series: Sequence[Series], title: str, damage: StopInfo | None, out: str
) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    n = max(1, len(series))
    height = 1.0 + 1.35 * n  # inches: title and legend, then one panel per request
    fig, axes = plt.subplots(n, 1, sharex=True, figsize=(11, height), squeeze=False)
    for ax, s in zip(axes[:, 0], series, strict=False):
        ax.step(s.steps, s.computed, where="post", color=_COLORS["computed"], lw=1.5)
        ax.step(s.steps, s.saved, where="post", color=_COLORS["saved"], lw=1.5)
        for step, start, end in s.loads:
            ax.vlines(step, start, end, color=_COLORS["loaded"], lw=5)
        for step in s.load_failures:
            ax.plot([step], [0], marker="v", color="#006400", ms=6, clip_on=False)
        for step in s.preemptions:
            ax.axvline(step, color=_COLORS["bad"], ls="--", lw=1)
        ymax = max([*s.computed, *s.saved, *(end for _, _, end in s.loads), 1])
        for step, _rule in s.violations:
            ax.plot([step], [ymax * 1.05], marker="x", color=_COLORS["bad"], ms=8, mew=2)
        if s.finished is not None:
            ax.plot([s.finished], [0], marker="o", color="#555", ms=4, clip_on=False)
        ax.set_ylim(0, ymax * 1.15)
        ax.set_title(s.label, loc="left", fontsize=9, pad=2)
        ax.set_ylabel("tokens", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="#eee")
    axes[-1, 0].set_xlabel("step")
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=_COLORS["computed"], lw=1.5, label="tokens computed"),
        Line2D([], [], color=_COLORS["saved"], lw=1.5, label="saved watermark"),
        Line2D([], [], color=_COLORS["loaded"], lw=5, label="loaded range"),
        Line2D([], [], color="#006400", marker="v", ls="", label="load failed"),
        Line2D([], [], color=_COLORS["bad"], ls="--", label="preemption"),
        Line2D([], [], color=_COLORS["bad"], marker="x", ls="", mew=2, label="violation"),
        Line2D([], [], color="#555", marker="o", ls="", label="finished"),
    ]
    suptitle = title if damage is None else f"{title} (read stopped early: {damage.kind})"
    fig.text(0.01, 1 - 0.12 / height, suptitle, fontsize=10, va="top", ha="left")
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, 1 - 0.38 / height),
        ncol=7,
        fontsize=8,
        frameon=False,
    )
    fig.subplots_adjust(
        left=0.07, right=0.99, top=1 - 0.95 / height, bottom=0.55 / height, hspace=0.45
    )
    tmp = out + ".tmp"
    fig.savefig(tmp, dpi=110, format=Path(out).suffix.lstrip(".").lower())
    plt.close(fig)
    os.replace(tmp, out)


# --- export ----------------------------------------------------------------------------------------

_BASE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("index", "int"),  # position of the event in the log
    ("seq", "int"),  # frame sequence number
    ("step", "int"),
    ("wall_ns", "int"),  # when the frame was written
    ("type", "str"),
    ("kind", "str"),  # input | decision
    ("request", "str"),  # req_id ("" for the events about no one request)
    ("requests", "str_list"),  # StepDecoded: the ids of the requests it names
)


def _column_kind(hint: Any) -> str:
    if hint is bool:
        return "bool"
    if hint is int:
        return "int"
    if hint is str:
        return "str"
    if hint is bytes:
        return "hex"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "str"
    if typing.get_origin(hint) is tuple:
        (elem, *_rest) = typing.get_args(hint)
        return "hex_list" if elem is bytes else "int_list"
    raise TypeError(f"no export column type for {hint!r}")


def _export_columns() -> tuple[tuple[str, str], ...]:
    cols: dict[str, str] = dict(_BASE_COLUMNS)
    for cls in ev.EVENT_TYPES:
        hints = typing.get_type_hints(cls)
        for name in field_names(cls):
            kind = _column_kind(hints[name])
            col = name if name not in dict(_BASE_COLUMNS) else f"field_{name}"
            if cols.get(col, kind) != kind:
                raise TypeError(f"export column {col!r} has two types: {cols[col]}, {kind}")
            cols[col] = kind
    return tuple(cols.items())


EXPORT_COLUMNS: tuple[tuple[str, str], ...] = _export_columns()
"""``(column, kind)`` of an export: the base columns, then every event field of every type
(a field absent from an event type is null in its rows). Kinds: int, bool, str, hex (bytes as
hex), int_list, hex_list, str_list."""

_BASE_NAMES = frozenset(name for name, _ in _BASE_COLUMNS)


@attrs.frozen
class ExportResult:
    out: str
    format: str
    rows: int
    rows_by_type: dict[str, int]
    damage: StopInfo | None


def _row_makers() -> dict[type[ev.Event], tuple[tuple[str, str, Callable[[Any], Any] | None], ...]]:
    """Per event type: (attribute, column, converter or None) for each field. Tuples of ints
    need no converter (JSON and pyarrow take them as arrays)."""
    out: dict[type[ev.Event], tuple[tuple[str, str, Callable[[Any], Any] | None], ...]] = {}
    convert: dict[str, Callable[[Any], Any] | None] = {
        "int": None,
        "bool": None,
        "str": None,
        "hex": bytes.hex,
        "int_list": None,
        "hex_list": lambda keys: [k.hex() for k in keys],
    }
    for cls in ev.EVENT_TYPES:
        hints = typing.get_type_hints(cls)
        fields = []
        for name in field_names(cls):
            hint = hints[name]
            fn = convert[_column_kind(hint)]
            if isinstance(hint, type) and issubclass(hint, enum.Enum):
                fn = _enum_name
            fields.append((name, name if name not in _BASE_NAMES else f"field_{name}", fn))
        out[cls] = tuple(fields)
    return out


def _enum_name(value: enum.Enum) -> str:
    return value.name


def _export_rows(src: LogSource) -> Iterator[dict[str, Any]]:
    makers = _row_makers()
    row: dict[str, Any] | None = None
    last_pos = -1
    for pos, frame, e, rid, _, _, _, _ in _walk(src):
        if pos == last_pos:  # StepDecoded, once more for each request it names
            assert row is not None
            row["requests"].append(rid)
            continue
        if row is not None:
            yield row
        last_pos = pos
        cls = e.__class__
        row = {
            "index": pos,
            "seq": frame.seq,
            "step": frame.step,
            "wall_ns": frame.wall_ns,
            "type": cls.__name__,
            "kind": cls.KIND,
            "request": e.req_id,
        }
        if cls is ev.StepDecoded:
            row["requests"] = []
        for name, column, fn in makers[cls]:
            value = getattr(e, name)
            row[column] = value if fn is None else fn(value)
    if row is not None:
        yield row


def export(
    path: LogPath | LogSource, out: PathLike, fmt: str = "jsonl", *, batch_rows: int = 65536
) -> ExportResult:
    """One row per event: ``index, seq, step, wall_ns, type, kind, request`` and the event's
    fields as columns (bytes as hex, enums by name), for DuckDB or pandas; a ``StepDecoded``
    row also has ``requests``, the ids its request numbers stood for. ``fmt="jsonl"``
    writes one JSON object per line (only the event's own fields; ``out="-"``: standard
    output); ``fmt="parquet"`` writes every column of :data:`EXPORT_COLUMNS` (pyarrow, the
    ``parquet`` extra), in row groups of ``batch_rows``. The file appears complete or not at
    all (written aside, then renamed)."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"export format must be 'jsonl' or 'parquet', got {fmt!r}")
    if fmt == "parquet":
        _require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    src = open_log(path)
    out_s = os.fspath(out)
    counts: Counter[str] = Counter()
    if fmt == "jsonl":
        if out_s == "-":
            n = _write_jsonl(src, sys.stdout, counts)
        else:
            tmp = out_s + ".tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    n = _write_jsonl(src, f, counts)
                os.replace(tmp, out_s)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    else:
        n = _write_parquet(src, out_s, counts, batch_rows)
    return ExportResult(out_s, fmt, n, dict(counts.most_common()), src.damage)


def _write_jsonl(src: LogSource, f: IO[str], counts: Counter[str]) -> int:
    n = 0
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    write = f.write
    for row in _export_rows(src):
        write(dumps(row))
        write("\n")
        counts[row["type"]] += 1
        n += 1
    f.flush()
    return n


def _write_parquet(src: LogSource, out: str, counts: Counter[str], batch_rows: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "int": pa.int64(),
        "bool": pa.bool_(),
        "str": pa.string(),
        "hex": pa.string(),
        "int_list": pa.list_(pa.int64()),
        "hex_list": pa.list_(pa.string()),
        "str_list": pa.list_(pa.string()),
    }
    schema = pa.schema([(name, types[kind]) for name, kind in EXPORT_COLUMNS])
    names = [name for name, _ in EXPORT_COLUMNS]
    tmp = out + ".tmp"
    n = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[dict[str, Any]] = []
            for row in _export_rows(src):
                batch.append(row)
                counts[row["type"]] += 1
                n += 1
                if len(batch) >= batch_rows:
                    writer.write_table(_table(pa, schema, names, batch))
                    batch = []
            if batch or n == 0:
                writer.write_table(_table(pa, schema, names, batch))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def _table(pa: Any, schema: Any, names: Sequence[str], rows: Sequence[dict[str, Any]]) -> Any:
    columns = {name: [row.get(name) for row in rows] for name in names}
    return pa.Table.from_pydict(columns, schema=schema)


# --- helpers --------------------------------------------------------------------------------------


class MissingExtra(ImportError):
    """An optional dependency is not installed: the message says which extra to install."""


def _require(module: str, extra: str, what: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise MissingExtra(
            f"{what} needs {module}, which is not installed: pip install kvledger[{extra}]"
        ) from None


def _write_atomic(out: str, data: bytes) -> None:
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)
