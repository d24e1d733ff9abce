"""``show``: one request's life, a row per event with the request's state after it.

States are the recorded ones: the walk (``tracker.history.walk``) folds the recorded events,
input facts *and* decisions, under the configuration of the log's header, so each state is
exactly what the recording Tracker held after that event. (Re-deriving the decisions with this
version of the code and comparing them is ``kvledger check``'s job, not a view's.) An event
that says something impossible (``tracker.wellformed``, asked through ``replay.malformed`` about
every record of the log, in order, as ``check`` asks it) says so on its row: its ``detail``
ends with the rules it breaks, and ``violation`` names them. (``show``'s list of requests
names every malformed record of the log, about one request or none: ``replay.malformed.read``.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvledger.replay.format import describe_event
from kvledger.replay.malformed import MalformedRecords
from kvledger.replay.naming import RequestNotFound, resolve
from kvledger.replay.source import LogPath, LogSource, damage_dict, open_log
from kvledger.replay.steps import StepRange
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.framing import StopInfo
from kvledger.tracker.history import GLOBAL_TYPES, POOL, Folded, walk
from kvledger.tracker.violation import Violation

__all__ = [
    "Fold",
    "RequestLife",
    "RequestLine",
    "RequestNotFound",
    "Row",
    "collapse",
    "parse_types",
    "request_lines",
    "select",
    "show",
]


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
    # The rule, on a ViolationRecorded row; on an event that breaks tracker.wellformed's
    # rules, those rules (comma-separated).
    violation: str = ""

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


def _row(item: Folded, bad: list[Violation]) -> Row:
    """``item``'s row; ``bad``: the rules its record breaks (``replay.malformed``)."""
    pos, e, label, s = item.pos, item.event, item.life, item.after
    violation = e.rule if isinstance(e, ev.ViolationRecorded) else ""
    detail = describe_event(e)
    if bad:
        violation = ",".join(dict.fromkeys(v.rule for v in bad))
        said = ", ".join(f"{v.rule} {v.detail.get('field', '')}".rstrip() for v in bad)
        detail = f"{detail} ! malformed: {said}".lstrip()
    if s is None:  # an event about a request the log never added
        return Row(pos, e.step, type(e).__name__, detail, label,
                   "unknown", 0, 0, 0, (), 0, 0, None, False, False, 0, False, violation)  # fmt: skip
    return Row(
        index=pos,
        step=e.step,
        event=type(e).__name__,
        detail=detail,
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

    ``request`` names the request as every command does (``replay.naming``): an id, or a part
    of exactly one id (vLLM's ids carry long random suffixes); :class:`RequestNotFound`
    otherwise, with the ids that contain it or the nearest ones."""
    src = open_log(path)
    config = src.config()
    rows = _rows(src, config, request)
    if rows:
        return RequestLife(rows, request, config, src.damage, src.name)
    damage = src.damage
    ids: dict[str, str] = {}  # every id, in arrival order (its lives are read below)
    for frame in src.frames():
        for e in frame.events:
            if e.req_id and e.req_id != POOL:
                ids.setdefault(e.req_id, e.req_id)
    why = None if damage is None else damage.describe()
    rid = ids[resolve(request, ids, read_in_part=why)[0]]
    rows = _rows(src, config, rid)
    return RequestLife(rows, rid, config, src.damage or damage, src.name)


def _rows(src: LogSource, config: TrackerConfig, req_id: str) -> list[Row]:
    """The rows of request ``req_id``'s lives. Every record of the log is walked and judged,
    in order (a record is malformed against the records before it: an outage twice), and the
    request's kept: a walk for the request alone (``walk``'s ``want``) would skip the rest."""
    feed = MalformedRecords(keep=0, recorded=src.recorded).feed
    rows = []
    for item in walk(src.frames(), config, recorded=src.recorded):
        bad = feed(item)
        # (The events about no request come once under POOL, "": never a request's row.)
        if item.req_id == req_id and (req_id or item.event.__class__ not in GLOBAL_TYPES):
            rows.append(_row(item, bad))
    return rows


# --- less noise: select and fold ------------------------------------------------------------

_TYPE_NAMES: dict[str, str] = {cls.__name__.lower(): cls.__name__ for cls in ev.EVENT_TYPES}


def parse_types(values: Iterable[str]) -> frozenset[str]:
    """Event type names from ``--type`` values (each a comma list; any case), or
    ``ValueError`` naming the unknown ones and every valid name."""
    names: set[str] = set()
    unknown: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            name = _TYPE_NAMES.get(part.lower())
            if name is None:
                unknown.append(part)
            else:
                names.add(name)
    if unknown:
        valid = ", ".join(sorted(_TYPE_NAMES.values()))
        raise ValueError(f"unknown event type {', '.join(map(repr, unknown))}; valid: {valid}")
    return frozenset(names)


def select(
    rows: Iterable[Row],
    types: frozenset[str] | None = None,
    steps: StepRange | None = None,
) -> list[Row]:
    """The rows of the named event types (``None``: all) within ``steps`` (both ends
    included, ``None`` for an open end)."""
    lo, hi = steps if steps is not None else (None, None)
    return [
        r
        for r in rows
        if (types is None or r.event in types)
        and (lo is None or r.step >= lo)
        and (hi is None or r.step <= hi)
    ]


@attrs.frozen
class Fold:
    """Consecutive steps that say the same thing, folded into one entry by :func:`collapse`.

    ``kind``: ``"lookup"``, a waiting request asking the same lookup and getting the same
    answer every step (nothing else happened to it in those steps); ``"decode"``, steady
    decode steps (one ``StepDecoded`` a step, with no save, load, preemption or phase change
    in between). ``rows`` are every folded row; the state shown is the last one's."""

    kind: str
    rows: tuple[Row, ...]
    steps: int  # how many steps were folded

    @property
    def first(self) -> Row:
        return self.rows[0]

    @property
    def last(self) -> Row:
        return self.rows[-1]

    @property
    def event(self) -> str:
        return self.first.event

    def summary(self) -> str:
        """``0 hit, each step (hit=0 external=0)`` for a lookup; ``+9 tokens steady decode,
        num_tokens 31 -> 39`` for decode steps."""
        if self.kind == "lookup":
            answers = [r for r in self.rows if r.event == "LookupAnswered"]
            if not answers:
                return f"the same lookup each step: {self.first.detail}"
            return f"{_hit(answers[-1].detail)} hit, each step ({answers[-1].detail})"
        grown = self.last.num_tokens - self.first.num_tokens + 1
        return (
            f"+{grown} token{'s' if grown != 1 else ''} steady decode, "
            f"num_tokens {self.first.num_tokens} -> {self.last.num_tokens}"
        )

    def describe(self) -> str:
        """``LookupAsked x14 (steps 3-16): 0 hit``."""
        return f"{self.event} x{self.steps} (steps {self.first.step}-{self.last.step}): " + (
            self.summary()
        )

    def to_dict(self) -> dict[str, Any]:
        d = self.last.to_dict()
        d.update(
            folded=self.kind,
            event=self.event,
            detail=self.summary(),
            count=self.steps,
            events=len(self.rows),
            first_step=self.first.step,
            last_step=self.last.step,
            first_index=self.first.index,
        )
        return d


Entry = Row | Fold

_LOOKUP = frozenset({"LookupAsked", "LookupAnswered"})


def _hit(detail: str) -> str:
    for part in detail.split():
        if part.startswith("hit="):
            return part[4:]
    return "?"


def _same_state(a: Row, b: Row, *, decoding: bool) -> bool:
    """Whether nothing but the decode's own progress (one more token, maybe a new block)
    changed from ``a`` to ``b``."""
    if decoding:
        return (a.life, a.phase, a.saved, a.saves_in_flight, a.load, a.load_done) == (
            b.life, b.phase, b.saved, b.saves_in_flight, b.load, b.load_done
        ) and (a.preempted, a.recompute_only, a.violation) == (
            b.preempted, b.recompute_only, b.violation
        )  # fmt: skip
    return attrs.evolve(a, index=0, step=0) == attrs.evolve(b, index=0, step=0)


def _signature(step_rows: Sequence[Row]) -> tuple[str, tuple[Any, ...]] | None:
    """What makes a step foldable with the next one like it: ``("lookup", ...)`` for a step
    that only asked and answered a lookup, ``("decode", ...)`` for one steady decode step."""
    events = [r.event for r in step_rows]
    if all(e in _LOOKUP for e in events):
        return "lookup", tuple((r.event, r.detail) for r in step_rows)
    if events == ["StepDecoded"]:
        return "decode", ()
    return None


def _foldable(prev: Sequence[Row], cur: Sequence[Row]) -> bool:
    sp, sc = _signature(prev), _signature(cur)
    if sp is None or sp != sc:
        return False
    if sp[0] == "decode":
        return _same_state(prev[-1], cur[-1], decoding=True)
    return all(_same_state(x, y, decoding=False) for x, y in zip(prev, cur, strict=True))


def collapse(rows: Sequence[Row]) -> list[Entry]:
    """The rows with runs of two or more like steps folded into one :class:`Fold` each: a
    lookup asked again and answered the same way every step while the request waits, and
    steady decode steps. A step that did anything else (an allocation, a save, a new chunk of
    prompt) is never folded, so what changed stays on its own row."""
    by_step: list[list[Row]] = []
    for r in rows:
        if by_step and by_step[-1][0].step == r.step:
            by_step[-1].append(r)
        else:
            by_step.append([r])
    out: list[Entry] = []
    i = 0
    while i < len(by_step):
        j = i + 1
        while j < len(by_step) and _foldable(by_step[j - 1], by_step[j]):
            j += 1
        sig = _signature(by_step[i])
        if j - i >= 2 and sig is not None:
            folded = tuple(r for group in by_step[i:j] for r in group)
            out.append(Fold(sig[0], folded, j - i))
        else:
            out.extend(by_step[i])
            j = i + 1
        i = j
    return out


# --- every request, one line each ----------------------------------------------------------


@attrs.frozen
class RequestLine:
    """One request life in ``show``'s list: what ``show --request`` would tell at length."""

    request: str  # its life label (id, or id#2 for a reused id's second life)
    req_id: str
    admissions: int
    preemptions: int
    prompt: int
    asked: int  # tokens its admissions' lookups asked about
    local: int  # of them, in vLLM's own prefix cache
    loaded: int  # tokens loaded from the pool (planned), whole life
    missed: int  # tokens missed (kvledger explain), by its admissions' lookups
    problems: int  # kvledger check's problems about it
    end: str  # its finish reason, or its phase at the end of the log

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def request_lines(path: LogPath | LogSource) -> tuple[list[RequestLine], StopInfo | None]:
    """Every request life of a log, in arrival order, from its tidy tables
    (``replay.tables``: the same numbers as ``export``, ``sql``, ``stats`` and ``explain``),
    and the log's damage."""
    from kvledger.replay.tables import collect  # the tables' builder: loaded only for the list

    rows, info = collect(path, ["requests", "admissions", "misses", "problems"])
    asked: dict[str, int] = {}
    local: dict[str, int] = {}
    for a in rows["admissions"]:
        asked[a["request"]] = asked.get(a["request"], 0) + (a["asked"] or 0)
        local[a["request"]] = local.get(a["request"], 0) + (a["local_hit"] or 0)
    missed: dict[str, int] = {}
    for m in rows["misses"]:
        missed[m["request"]] = missed.get(m["request"], 0) + m["tokens"]
    problems: dict[str, int] = {}
    for p in rows["problems"]:
        if p["request"] is not None:
            problems[p["request"]] = problems.get(p["request"], 0) + 1
    requests = sorted(rows["requests"], key=lambda r: (r["added_step"], r["request"]))
    lines = [
        RequestLine(
            r["request"],
            r["req_id"],
            r["admissions"],
            r["preemptions"],
            r["prompt_len"],
            asked.get(r["request"], 0),
            local.get(r["request"], 0),
            r["tokens_loaded"],
            missed.get(r["request"], 0),
            problems.get(r["request"], 0),
            r["finish_reason"] or r["phase"],
        )
        for r in requests
    ]
    return lines, info.damage
