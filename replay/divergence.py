"""The first divergence between two logs, overall and per request.

Two runs of the same workload rarely keep the same steps (a different chunk size changes what
is loaded, which changes what vLLM schedules) nor the same request ids (vLLM appends random
suffixes). So ``diff`` compares, for each request, the *sequence* of its events (input facts
and decisions) by content: type and every field but ``step`` and ``req_id``. It reports, per
request, the first pair of events that differ (or the first event one side lacks), with both
steps and both positions in the logs, and overall the earliest of those.

Requests are aligned, in this order:

1. by id, where both logs hold the id (the ``n``-th life of an id reused after it finished
   with the ``n``-th life on the other side);
2. then by the hash of the prompt (``RequestAdded.prompt_token_ids`` and the cache salt) and
   arrival order: the ``k``-th request with that prompt in A with the ``k``-th in B;
3. then by id with vLLM's random suffix removed (``-`` and 8 hex digits, as vLLM's
   ``lifecycle.py`` normalises it), for a request whose prompt changed as well as its id.

What is left is unmatched (``unmatched_a``, ``unmatched_b``).

Two relaxations, both off by default:

- ``ignore``: field names left out of the comparison wherever an event type has them
  (``block_ids`` and ``slots`` differ between runs whose pools were used in another order;
  ``keys`` between runs with another salt). :func:`ignorable_fields` lists the names.
- ``order="async"``: compare a run under vLLM's async scheduling with one under sync
  scheduling (or two async runs). Async scheduling applies the output of step N after step N+1
  was scheduled; it changes *when* facts arrive, not *what* happened. Under this order two
  requests are the same when they agree on:

  1. their progress, in order: every event but the worker's reports, with (a) a lookup asked
     again and answered the same way while the request waits counted once (how many steps a
     request waits for blocks depends on when the previous step's blocks were freed),
     (b) a one-token ``Scheduled`` of a running request and a steady ``StepDecoded`` both
     read as "one token decoded" (the steady path needs the previous output applied), and
     (c) the token ids a lookup or a ``Scheduled`` brings left out (they arrive in bulk with
     whichever event comes first; the prompt is compared in ``RequestAdded``);
  2. the worker's reports (``SaveDone``, ``SaveFailed``, ``LoadDone``, ``LoadFailed``), in
     order among themselves: async scheduling moves them a step later relative to the
     request's progress, never past one another. A save plan that copies nothing (it moves
     the watermark over chunks another request stored) goes with them: it waits for that
     request's ``SaveDone``, which comes a step later.

  A divergence's ``position`` then counts the events of its sequence (``stream``:
  ``"progress"`` or ``"reports"``), after folding.

Memory: one small entry per request (id, prompt hash) for the alignment, plus, while both logs
are read side by side, the events of a request that one log has and the other has not reached
yet (nothing when the logs agree).
"""

from __future__ import annotations

import hashlib
import re
import typing
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from kvledger.replay.format import describe_event, event_content, event_fields, field_names
from kvledger.replay.source import LogPath, LogSource, damage_dict, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.framing import StopInfo
from kvledger.tracker.history import GLOBAL_TYPES, POOL, Lives, labelled, walk

__all__ = ["ORDERS", "DiffResult", "Divergence", "EventAt", "diff", "ignorable_fields"]

# How the events of a request are compared: "strict", every event in its order; "async",
# modulo what async scheduling legitimately changes (see the module's text).
ORDERS = ("strict", "async")

# The worker's reports: under async scheduling they are applied a step later.
_REPORTS: frozenset[type[ev.Event]] = frozenset(
    {ev.SaveDone, ev.SaveFailed, ev.LoadDone, ev.LoadFailed}
)
# Fields that carry token ids learned along the way (left out under the async order).
_LEARNED_IDS = frozenset({"token_ids", "token_start"})


def ignorable_fields() -> tuple[str, ...]:
    """Every field name of an event type but ``step`` and ``req_id``: what ``ignore`` takes."""
    return tuple(sorted({n for cls in ev.EVENT_TYPES for n in field_names(cls)}))


def _check_ignore(ignore: Sequence[str]) -> frozenset[str]:
    valid = ignorable_fields()
    unknown = [f for f in ignore if f not in valid]
    if unknown:
        raise ValueError(
            f"cannot ignore {', '.join(map(repr, unknown))}: not a field of any event; "
            f"valid: {', '.join(valid)}"
        )
    return frozenset(ignore)


_SUFFIX = re.compile(r"-[0-9a-f]{8}$")

# Matched events kept per request before a divergence, to show what led to it.
_CONTEXT = 3


@attrs.frozen
class EventAt:
    """An event and where it is: ``index`` is its position among all events of its log."""

    index: int
    step: int
    event: ev.Event

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "step": self.step,
            "type": type(self.event).__name__,
            "request": self.event.req_id,
            "fields": event_fields(self.event),
        }

    def describe(self) -> str:
        e = self.event
        return f"step {self.step} #{self.index} {type(e).__name__} {describe_event(e)}".rstrip()


@attrs.frozen
class Divergence:
    """The first difference in one request's events.

    ``kind``: ``"differ"`` (both have an event at ``position``, with different content),
    ``"missing"`` (A has events from ``position`` on that B lacks), ``"extra"`` (B has
    events from ``position`` on that A lacks). ``position`` counts the request's own events
    from 0. ``fields`` names the fields that differ (``("type",)`` for two types).
    ``context`` holds the last events both agreed on (as read in A)."""

    request_a: str
    request_b: str
    kind: str
    position: int
    a: EventAt | None
    b: EventAt | None
    fields: tuple[str, ...] = ()
    context: tuple[EventAt, ...] = ()
    stream: str = "events"  # "events" (strict order); "progress" or "reports" (async order)

    @property
    def step_a(self) -> int | None:
        return None if self.a is None else self.a.step

    @property
    def step_b(self) -> int | None:
        return None if self.b is None else self.b.step

    @property
    def step(self) -> int:
        """The earlier of the two steps: where to start looking."""
        return min(s for s in (self.step_a, self.step_b) if s is not None)

    @property
    def request(self) -> str:
        return (
            self.request_a
            if self.request_a == self.request_b
            else (f"{self.request_a} ~ {self.request_b}")
        )

    def sort_key(self) -> tuple[int, int, int]:
        side = self.a if self.a is not None else self.b
        assert side is not None
        return (self.step, 0 if self.a is not None else 1, side.index)

    def describe(self) -> str:
        where = f"{self.request}, event {self.position}"
        if self.stream != "events":
            where += f" of its {self.stream}"
        if self.kind == "differ":
            assert self.a is not None and self.b is not None
            what = ", ".join(self.fields)
            return f"{where}: {what} differ\n  A: {self.a.describe()}\n  B: {self.b.describe()}"
        if self.kind == "missing":
            assert self.a is not None
            return f"{where}: B lacks A's events from\n  A: {self.a.describe()}"
        assert self.b is not None
        return f"{where}: B has events A lacks, from\n  B: {self.b.describe()}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_a": self.request_a,
            "request_b": self.request_b,
            "kind": self.kind,
            "position": self.position,
            "step_a": self.step_a,
            "step_b": self.step_b,
            "fields": list(self.fields),
            "stream": self.stream,
            "a": None if self.a is None else self.a.to_dict(),
            "b": None if self.b is None else self.b.to_dict(),
            "context": [c.to_dict() for c in self.context],
        }


@attrs.frozen
class DiffResult:
    """What :func:`diff` found. ``identical``: every request of each log has a counterpart
    with the same events in the same order (configuration differences and read damage are
    reported, but only what the events say decides)."""

    a: str
    b: str
    first: Divergence | None
    per_request: dict[str, Divergence]  # by A's request label, in the order of their steps
    unmatched_a: tuple[str, ...]
    unmatched_b: tuple[str, ...]
    matched: dict[str, str]  # A's label -> B's label
    aligned_by: dict[str, int]  # "id" | "prompt" | "suffix" -> requests aligned that way
    events_a: int
    events_b: int
    config_changes: dict[str, tuple[Any, Any]]
    damage_a: StopInfo | None
    damage_b: StopInfo | None
    ignored: tuple[str, ...] = ()
    order: str = "strict"

    @property
    def identical(self) -> bool:
        return self.first is None and not self.unmatched_a and not self.unmatched_b

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "first": None if self.first is None else self.first.to_dict(),
            "per_request": {k: v.to_dict() for k, v in self.per_request.items()},
            "unmatched_a": list(self.unmatched_a),
            "unmatched_b": list(self.unmatched_b),
            "matched": len(self.matched),
            "renamed": {k: v for k, v in self.matched.items() if k != v},
            "aligned_by": self.aligned_by,
            "events_a": self.events_a,
            "events_b": self.events_b,
            "config_changes": {k: list(v) for k, v in self.config_changes.items()},
            "damage_a": damage_dict(self.damage_a),
            "damage_b": damage_dict(self.damage_b),
            "ignored": list(self.ignored),
            "order": self.order,
        }


# --- alignment ----------------------------------------------------------------------------


class _Life(typing.NamedTuple):
    label: str
    req_id: str
    prompt: bytes | None  # hash of the prompt and salt; None: no RequestAdded seen


def _prompt_hash(tokens: Sequence[int], salt: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(salt).encode())
    h.update(b"\0")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def _lives(src: LogSource) -> list[_Life]:
    """Every request life of the log, in arrival order, with its prompt's hash."""
    if _raw_request_added(src.header):
        return _lives_raw(src)
    out: list[_Life] = []
    for item in labelled(src.frames()):
        e, label, new = item.event, item.life, item.new
        if new:
            prompt = (
                _prompt_hash(e.prompt_token_ids, e.cache_salt)
                if isinstance(e, ev.RequestAdded)
                else None
            )
            out.append(_Life(label, e.req_id, prompt))
    return out


def _raw_request_added(header: dict[str, Any]) -> bool:
    """Whether the log writes RequestAdded as this version does: then its raw records can
    be read as ``[tag, req_id, prompt_token_ids, cache_salt?]`` (twice as fast)."""
    schemas = header.get("schemas")
    entry = schemas.get(ev.RequestAdded.TAG) if isinstance(schemas, dict) else None
    return entry == [
        "RequestAdded",
        ev.RequestAdded.VERSION,
        ["req_id", *field_names(ev.RequestAdded)],
    ]


def _lives_raw(src: LogSource) -> list[_Life]:
    lives = Lives()
    live = lives.live
    added, finished = ev.RequestAdded.TAG, ev.Finished.TAG
    pool = {cls.TAG for cls in GLOBAL_TYPES}
    out: list[_Life] = []
    for frame in src.raw_frames():
        for rec in frame.records:
            tag, rid = rec[0], rec[1]
            if tag != added and tag != finished:
                if rid in live or (not rid and tag in pool):
                    continue
                label, new = lives.label(rid, ev.Event)
            else:
                label, new = lives.label(rid, ev.RequestAdded if tag == added else ev.Finished)
            if new:
                prompt = None
                if tag == added and len(rec) >= 3:
                    prompt = _prompt_hash(rec[2], rec[3] if len(rec) > 3 else "")
                out.append(_Life(label, rid, prompt))
    return out


def _align(la: Sequence[_Life], lb: Sequence[_Life]) -> tuple[dict[str, str], dict[str, int]]:
    matched: dict[str, str] = {POOL: POOL}
    how = {"id": 0, "prompt": 0, "suffix": 0}
    b_labels = {life.label for life in lb}
    for life in la:
        if life.label in b_labels:
            matched[life.label] = life.label
            how["id"] += 1
    taken = set(matched.values())
    rest_a = [life for life in la if life.label not in matched]
    rest_b = [life for life in lb if life.label not in taken]
    by_prompt: dict[bytes, deque[_Life]] = {}
    for life in rest_b:
        if life.prompt is not None:
            by_prompt.setdefault(life.prompt, deque()).append(life)
    still_a: list[_Life] = []
    for life in rest_a:
        queue = by_prompt.get(life.prompt) if life.prompt is not None else None
        if queue:
            other = queue.popleft()
            matched[life.label] = other.label
            taken.add(other.label)
            how["prompt"] += 1
        else:
            still_a.append(life)
    by_stem: dict[str, deque[_Life]] = {}
    for life in rest_b:
        if life.label not in taken:
            by_stem.setdefault(_stem(life), deque()).append(life)
    for life in still_a:
        queue = by_stem.get(_stem(life))
        if queue:
            other = queue.popleft()
            matched[life.label] = other.label
            how["suffix"] += 1
    return matched, how


def _stem(life: _Life) -> str:
    rid = _SUFFIX.sub("", life.req_id)
    return life.label.replace(life.req_id, rid, 1)


# --- comparison ---------------------------------------------------------------------------


# An event in a queue: (position in its log, step, event, what is compared).
_At = tuple[int, int, ev.Event, Any]

_STREAMS = {"strict": ("events",), "async": ("progress", "reports")}


class _Side:
    """One log's half of a pair: its queues (events the other log has not reached yet, by
    stream) and, under the async order, the lookup round being read."""

    __slots__ = ("asked", "last_round", "queues")

    def __init__(self, streams: int) -> None:
        self.queues: tuple[deque[_At], ...] = tuple(deque() for _ in range(streams))
        self.asked: _At | None = None  # a LookupAsked waiting for its answer
        self.last_round: Any = None  # the last lookup round kept, while nothing else happened


class _Pair:
    __slots__ = ("context", "diverged", "label_b", "position", "sides")

    def __init__(self, label_b: str, streams: int) -> None:
        self.label_b = label_b
        self.sides = (_Side(streams), _Side(streams))
        self.position = [0] * streams  # events compared and equal so far, by stream
        self.context: deque[_At] = deque(maxlen=_CONTEXT)
        self.diverged = False


def _at(item: _At | None) -> EventAt | None:
    return None if item is None else EventAt(item[0], item[1], item[2])


def _content(e: ev.Event, leave_out: frozenset[str]) -> tuple[Any, ...]:
    """What two runs must agree on: :func:`replay.format.event_content` without the fields
    in ``leave_out``; a ``StepDecoded``, seen from one of its requests, says only: one more
    token."""
    cls = e.__class__
    if cls is ev.StepDecoded:
        return (cls,)
    if not leave_out:
        return event_content(e)
    return (cls, *(getattr(e, n) for n in field_names(cls) if n not in leave_out))


def _differing_fields(x: ev.Event, y: ev.Event, leave_out: frozenset[str]) -> tuple[str, ...]:
    if type(x) is not type(y):
        return ("type",)
    return tuple(
        n for n in field_names(type(x)) if n not in leave_out and getattr(x, n) != getattr(y, n)
    )


_DECODED = ("one token decoded",)


def _async_key(e: ev.Event, ignore: frozenset[str]) -> Any:
    """What a progress event says under the async order (see the module's text)."""
    cls = e.__class__
    if cls is ev.StepDecoded:
        return _DECODED
    if isinstance(e, ev.Scheduled) and e.admission == ev.Admission.RUNNING and e.num_scheduled == 1:
        return _DECODED
    return _content(e, ignore | _LEARNED_IDS)


def diff(
    a: LogPath | LogSource,
    b: LogPath | LogSource,
    *,
    ignore: Sequence[str] = (),
    order: str = "strict",
) -> DiffResult:
    """The first divergence between logs ``a`` and ``b`` (files, directories of one log's
    segments, or lists of segment files), overall and per request; see the module's text.
    ``ignore``: fields left out of the comparison (:func:`ignorable_fields`; ``ValueError``
    for another name); ``order``: ``"strict"`` or ``"async"`` (a run under async scheduling
    against one under sync scheduling). Raises :class:`replay.source.LogUnreadable` when
    either log cannot be read at all."""
    leave_out = _check_ignore(ignore)
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; valid: {', '.join(ORDERS)}")
    streams = _STREAMS[order]
    relaxed = order == "async"
    src_a, src_b = open_log(a), open_log(b)
    lives_a, lives_b = _lives(src_a), _lives(src_b)
    matched, how = _align(lives_a, lives_b)
    matched_b = set(matched.values())
    unmatched_a = tuple(life.label for life in lives_a if life.label not in matched)
    unmatched_b = tuple(life.label for life in lives_b if life.label not in matched_b)
    del lives_a, lives_b
    pairs: dict[str, _Pair] = {}  # by A's label, for live pairs
    by_b: dict[str, str] = {lb: la for la, lb in matched.items()}
    found: list[Divergence] = []

    def pair_of(label_a: str) -> _Pair | None:
        p = pairs.get(label_a)
        if p is None:
            label_b = matched.get(label_a)
            if label_b is None:
                return None
            p = pairs[label_a] = _Pair(label_b, len(streams))
        return p

    def compare(label_a: str, p: _Pair, stream: int) -> None:
        qa, qb = p.sides[0].queues[stream], p.sides[1].queues[stream]
        while qa and qb:
            x, y = qa.popleft(), qb.popleft()
            ex, ey = x[2], y[2]
            # Equal events of equal ids and steps compare equal at once; otherwise by content
            # (computed here, when needed: most events of agreeing logs are equal).
            if relaxed:
                same = x[3] == y[3]
            else:
                same = ex == ey or (
                    ex.__class__ is ey.__class__
                    and _content(ex, leave_out) == _content(ey, leave_out)
                )
            if same:
                p.position[stream] += 1
                p.context.append(x)
                continue
            fields = _differing_fields(ex, ey, leave_out | (_LEARNED_IDS if relaxed else set()))
            found.append(
                Divergence(
                    label_a,
                    p.label_b,
                    "differ",
                    p.position[stream],
                    _at(x),
                    _at(y),
                    fields or ("type",),
                    tuple(EventAt(c[0], c[1], c[2]) for c in p.context),
                    streams[stream],
                )
            )
            p.diverged = True
            for side in p.sides:
                for q in side.queues:
                    q.clear()
            return

    def put(label_a: str, p: _Pair, side: int, item: _At, stream: int = 0) -> None:
        p.sides[side].queues[stream].append(item)
        compare(label_a, p, stream)

    def put_async(label_a: str, p: _Pair, side: int, index: int, step: int, e: ev.Event) -> None:
        """The async order: reports to their own stream; a lookup round asked again with the
        same answer, while nothing else happened to the request, dropped."""
        s = p.sides[side]
        cls = e.__class__
        if cls in _REPORTS or (cls is ev.SavePlanned and not e.keys):  # type: ignore[attr-defined]
            put(label_a, p, side, (index, step, e, _content(e, leave_out)), 1)
            return
        if cls is ev.LookupAsked:
            if s.asked is not None:  # asked twice without an answer: keep the first
                put(label_a, p, side, s.asked)
            s.asked = (index, step, e, _async_key(e, leave_out))
            return
        if cls is ev.LookupAnswered and s.asked is not None:
            asked, s.asked = s.asked, None
            answered = (index, step, e, _async_key(e, leave_out))
            this_round = (asked[3], answered[3])
            if this_round == s.last_round:
                return  # the same question, the same answer: the request still waits
            s.last_round = this_round
            put(label_a, p, side, asked)
            if not p.diverged:
                put(label_a, p, side, answered)
            return
        if s.asked is not None:
            put(label_a, p, side, s.asked)
            s.asked = None
        s.last_round = None
        if not p.diverged:
            put(label_a, p, side, (index, step, e, _async_key(e, leave_out)))

    decoded = ev.StepDecoded
    counts = [0, 0]  # items read (a StepDecoded is one item per request it names, and one)
    events = [0, 0]
    walks = (
        walk(src_a.frames(), src_a.config(), recorded=src_a.recorded),
        walk(src_b.frames(), src_b.config(), recorded=src_b.recorded),
    )
    done = [False, False]
    # Read both logs side by side, always advancing the one that has read fewer events, so
    # that agreeing logs never queue more than a few events.
    while not (done[0] and done[1]):
        side = 0 if (not done[0] and (done[1] or counts[0] <= counts[1])) else 1
        item = next(walks[side], None)
        if item is None:
            done[side] = True
            continue
        counts[side] += 1
        index, frame, e, rid, label = item.pos, item.frame, item.event, item.req_id, item.life
        events[side] = index + 1
        if not rid and e.__class__ is decoded:
            continue  # compared through its requests
        label_a = label if side == 0 else by_b.get(label)
        if label_a is None:
            continue
        p = pair_of(label_a)
        if p is None or p.diverged:
            continue
        if relaxed:
            put_async(label_a, p, side, index, frame.step, e)
        else:
            put(label_a, p, side, (index, frame.step, e, None))
    for label_a, p in pairs.items():
        for side_no, s in enumerate(p.sides):  # a lookup still waiting for its answer
            if s.asked is not None and not p.diverged:
                put(label_a, p, side_no, s.asked)
        if p.diverged:
            continue
        context = tuple(EventAt(c[0], c[1], c[2]) for c in p.context)
        for stream, name in enumerate(streams):
            qa, qb = p.sides[0].queues[stream], p.sides[1].queues[stream]
            if qa or qb:
                kind, x, y = ("missing", qa[0], None) if qa else ("extra", None, qb[0])
                found.append(
                    Divergence(
                        label_a,
                        p.label_b,
                        kind,
                        p.position[stream],
                        _at(x),
                        _at(y),
                        (),
                        context,
                        name,
                    )
                )
                break
    found.sort(key=Divergence.sort_key)
    per_request = {d.request_a: d for d in found}
    config_changes = _config_changes(src_a.header, src_b.header)
    matched.pop(POOL, None)
    return DiffResult(
        a=src_a.name,
        b=src_b.name,
        first=found[0] if found else None,
        per_request=per_request,
        unmatched_a=unmatched_a,
        unmatched_b=unmatched_b,
        matched=matched,
        aligned_by=how,
        events_a=events[0],
        events_b=events[1],
        config_changes=config_changes,
        damage_a=src_a.damage,
        damage_b=src_b.damage,
        ignored=tuple(sorted(leave_out)),
        order=order,
    )


def _config_changes(ha: dict[str, Any], hb: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    ca, cb = ha.get("config") or {}, hb.get("config") or {}
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(ca) | set(cb), key=str):
        if ca.get(key) != cb.get(key):
            out[str(key)] = (ca.get(key), cb.get(key))
    for key in ("library_version",):
        if ha.get(key) != hb.get(key):
            out[key] = (ha.get(key), hb.get(key))
    return out
