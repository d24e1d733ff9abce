"""What no event can say: the rules on an event's own fields, one table for every type.

The codec checks that each field has its wire type. An event can still say what no vLLM and
no writer of ours ever says: a negative count, an end before its start, parallel arrays of
different lengths, a 64-bit value beyond 64 bits, a request id on an event about no request,
an outage reported while the store was already down. Read back from a log (which can come
from anywhere), each such event is a ``Violation`` named by its rule, with the field and the
numbers, found here and nowhere else:

- the ``Tracker`` asks :class:`Wellformed` about every event it applies (a live engine, and
  ``kvledger check``'s replay of a connector's log); ``tracker.recorded_rules`` about every
  event of a recorder's log; the replay about every recorded decision; ``show`` and ``stats``
  about every event they present;
- the folds never take in what does not line up: a malformed fact about the pool, the remote
  store or the digests changes nothing (``tracker.index_fold``, ``tracker.remote``,
  ``tracker.digests`` ask :func:`malformed`), and a malformed fact about a request is folded
  as the fold folds anything (it is total) while the request falls back to recompute.

The rules (:data:`RULES`, and per type :data:`SPECS`):

- ``field_negative``: a count, a position, a block id, a slot, a rank or a request number
  below zero;
- ``field_lengths``: fields that pair up element by element (``keys`` and ``found``, ``keys``
  and ``digests``, ``keys`` and ``slots``) of different lengths: nothing says which element
  is missing, so none is used;
- ``field_order``: an end before its start, or a part larger than its whole (a lookup's local
  hit above its tokens, an answer's external tokens above its hit);
- ``field_range``: a value outside its domain: an integer that does not fit in 64 bits
  (signed), ``RemoteFound.found`` not 0 or 1, a load's slot below -1 (the remote store), a
  stats side other than ``worker`` or ``scheduler``;
- ``field_empty``: a field that names something is empty: a chunk key, a rule, a callback,
  the request id of an event about one request;
- ``field_repeated``: a request number twice in one ``StepDecoded``;
- ``req_id_unexpected``: a request id on an event about no request (``StepDecoded``, the
  pool's, the remote store's outages, the recorder's block and stats facts);
- ``remote_outage_twice`` / ``remote_restored_twice``: the connector records an outage once,
  and the return once after it; two in a row contradict each other.

Pure and total: no I/O, and :func:`malformed` never raises for any event.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, NamedTuple

from kvledger.tracker import events as ev
from kvledger.tracker.violation import Violation

__all__ = [
    "RULES",
    "SPECS",
    "Spec",
    "Wellformed",
    "broken",
    "malformed",
    "sound",
    "sound_but_nums",
]

RULES: dict[str, str] = {
    "field_negative": "a count, position, block id, slot, rank or request number below zero",
    "field_lengths": "fields that pair up element by element have different lengths",
    "field_order": "an end before its start, or a part larger than its whole",
    "field_range": "a value outside its domain (64-bit integers, found 0/1, slot >= -1, ...)",
    "field_empty": "an empty chunk key, rule, callback, or request id of a request's event",
    "field_repeated": "a request number twice in one StepDecoded",
    "req_id_unexpected": "a request id on an event about no request",
    "remote_outage_twice": "a RemoteOutage while the store was already down",
    "remote_restored_twice": "a RemoteRestored while the store was up",
}

_MIN64, _MAX64 = -(1 << 63), (1 << 63) - 1

# Whom an event is about: one request (its req_id is set), no request (empty), either.
ONE, NONE, ANY = "one", "none", "any"


class Spec(NamedTuple):
    """The rules of one event type, by field name (the table below has one per type)."""

    about: str = ONE  # ONE, NONE or ANY: whether req_id must be set, empty, or either
    nonneg: tuple[str, ...] = ()  # int fields, or int-array fields (every element), >= 0
    signed64: tuple[str, ...] = ()  # int-array fields whose elements fit in a signed int64
    pairs: tuple[tuple[str, ...], ...] = ()  # array fields of one length, element by element
    order: tuple[tuple[str, str], ...] = ()  # (low, high): low <= high
    nonempty: tuple[str, ...] = ()  # str or bytes fields, or bytes-array fields (each element)
    distinct: tuple[str, ...] = ()  # array fields without a repeated element
    # The leftover rule, as (rule, field, detail) when broken; its docstring says what it
    # refuses (docs/reliability.md prints it), ``extra_rule`` its name.
    extra: Callable[[Any], list[tuple[str, str, dict[str, Any]]]] | None = None
    extra_rule: str = "field_range"


def _lookup_tokens(e: ev.LookupAsked) -> list[tuple[str, str, dict[str, Any]]]:
    """`token_start + len(token_ids)` > `num_tokens` (the ids sent are
    `all_token_ids[token_start:]`, and `num_tokens` is their whole length)"""
    end = e.token_start + len(e.token_ids)
    if e.token_start >= 0 and end > e.num_tokens:
        return [("field_order", "token_ids", {"token_end": end, "num_tokens": e.num_tokens})]
    return []


def _scheduled_tokens(e: ev.Scheduled) -> list[tuple[str, str, dict[str, Any]]]:
    """a running request's new ids end past `num_computed + num_scheduled` (an
    admission learns every id vLLM has, which may run past the tokens it schedules now)"""
    if e.admission is not ev.Admission.RUNNING or not e.token_ids or e.token_start < 0:
        return []
    end, scheduled = e.token_start + len(e.token_ids), e.num_computed + e.num_scheduled
    if end > scheduled:
        return [("field_order", "token_ids", {"token_end": end, "scheduled_end": scheduled})]
    return []


def _found_bits(e: ev.RemoteFound) -> list[tuple[str, str, dict[str, Any]]]:
    """an element of `found` other than 0 and 1"""
    bad = next((f for f in e.found if f not in (0, 1)), None)
    return [] if bad is None else [("field_range", "found", {"value": bad, "expected": "0 or 1"})]


def _slots_or_remote(e: ev.LoadPlanned) -> list[tuple[str, str, dict[str, Any]]]:
    """an element of `slots` below -1 (a host slot, or -1: the remote store)"""
    bad = next((s for s in e.slots if s < -1 or s > _MAX64), None)
    return [] if bad is None else [("field_range", "slots", {"value": bad, "expected": ">= -1"})]


def _decoded_tokens(e: ev.StepDecoded) -> list[tuple[str, str, dict[str, Any]]]:
    """`tokens` neither empty (kvledger's own log) nor one per number in `nums` (a
    recorder's log: the token each entry made known)"""
    if e.tokens and len(e.tokens) != len(e.nums):
        return [("field_lengths", "tokens", {"tokens": len(e.tokens), "nums": len(e.nums)})]
    return []


def _stored_tokens(e: ev.InnerStored) -> list[tuple[str, str, dict[str, Any]]]:
    """`token_ids` neither empty (an inner that does not publish them) nor `block_size` per
    key of `hashes`"""
    if e.token_ids and len(e.token_ids) != len(e.hashes) * e.block_size:
        return [
            (
                "field_lengths",
                "token_ids",
                {"tokens": len(e.token_ids), "hashes": len(e.hashes), "block_size": e.block_size},
            )
        ]
    return []


def _stats_side(e: ev.InnerStats) -> list[tuple[str, str, dict[str, Any]]]:
    """`side` neither `worker` nor `scheduler`"""
    if e.side not in ("worker", "scheduler"):
        return [("field_range", "side", {"length": len(e.side), "expected": "worker|scheduler"})]
    return []


SPECS: dict[type[ev.Event], Spec] = {
    ev.RequestAdded: Spec(),  # token ids: the fold's token_ids_valid (uint32)
    ev.LookupAsked: Spec(
        nonneg=("local_hit", "num_tokens", "token_start"),
        order=(("local_hit", "num_tokens"),),
        extra=_lookup_tokens,
        extra_rule="field_order",
    ),
    # num_external may be negative: vLLM passes on what the connector offered, and a wrapped
    # connector may offer below zero (see InnerLookupAnswered).
    ev.Allocated: Spec(nonneg=("block_ids",)),
    ev.Scheduled: Spec(
        nonneg=("num_computed", "num_scheduled", "token_start", "block_ids"),
        extra=_scheduled_tokens,
        extra_rule="field_order",
    ),
    ev.Preempted: Spec(),
    ev.Finished: Spec(),
    ev.SaveDone: Spec(nonempty=("keys",)),
    ev.SaveFailed: Spec(nonempty=("keys",)),
    ev.LoadDone: Spec(),
    ev.LoadFailed: Spec(nonneg=("block_ids",)),
    ev.ChunkStored: Spec(about=NONE, nonneg=("slot", "num_tokens"), nonempty=("key",)),
    ev.ChunkEvicted: Spec(about=NONE, nonempty=("key",)),
    ev.StepDecoded: Spec(
        about=NONE,
        nonneg=("nums", "blocks"),
        distinct=("nums",),
        extra=_decoded_tokens,
        extra_rule="field_lengths",
    ),
    # Facts about chunks: the request they were for is said, not relied on.
    ev.RemoteFound: Spec(
        about=ANY, pairs=(("keys", "found"),), nonempty=("keys",), extra=_found_bits
    ),
    ev.RemoteSaveDone: Spec(about=ANY, nonempty=("keys",)),
    ev.RemoteSaveFailed: Spec(about=ANY, nonempty=("keys",)),
    ev.RemoteLoadFailed: Spec(about=ANY, nonempty=("keys",)),
    ev.RemoteOutage: Spec(about=NONE),
    ev.RemoteRestored: Spec(about=NONE),
    # Any int: the recorder writes what the inner answered (-1 for None), and inners do answer
    # below -1 (vLLM's ExampleConnector: its cached prefix minus a longer local hit).
    ev.InnerLookupAnswered: Spec(),
    ev.InnerFinishedAnswered: Spec(nonneg=("block_ids",)),
    ev.InnerSendDone: Spec(),
    ev.InnerRecvDone: Spec(),
    ev.InnerLoadErrors: Spec(about=NONE, nonneg=("block_ids",)),
    ev.InnerStats: Spec(about=NONE, extra=_stats_side),
    ev.InnerRaised: Spec(about=ANY, nonempty=("callback",)),
    ev.RecordLost: Spec(about=ANY, nonempty=("callback",)),
    ev.InnerStored: Spec(
        about=NONE,
        nonneg=("token_ids", "block_size"),
        nonempty=("hashes",),
        extra=_stored_tokens,
        extra_rule="field_lengths",
    ),
    ev.InnerRemoved: Spec(about=NONE, nonempty=("hashes",)),
    ev.BlockDigested: Spec(
        nonneg=("start", "rank"),
        signed64=("digests",),
        pairs=(("keys", "digests"),),
        nonempty=("keys",),
    ),
    ev.LoadDigested: Spec(
        nonneg=("start", "rank"),
        signed64=("before", "after"),
        pairs=(("keys", "before", "after"),),
        nonempty=("keys",),
    ),
    ev.LookupAnswered: Spec(nonneg=("hit", "external"), order=(("external", "hit"),)),
    ev.LoadPlanned: Spec(
        nonneg=("start", "end", "refused_blocks"),
        pairs=(("keys", "slots"),),
        order=(("start", "end"),),
        nonempty=("keys",),
        extra=_slots_or_remote,
    ),
    ev.SavePlanned: Spec(
        nonneg=("start", "end", "slots", "skip_to"),
        pairs=(("keys", "slots"),),
        order=(("start", "end"),),
        nonempty=("keys", "evicted"),
    ),
    ev.ViolationRecorded: Spec(about=ANY, nonempty=("rule",)),
}
"""The rules of each event type. Every type has an entry (checked at import): a new type is
written with its rules, or with ``Spec()`` and a reason it has none."""


def _int_fields(cls: type[ev.Event]) -> tuple[str, ...]:
    # Every int field but ``step`` (the frame's, never negative: the reader checks it).
    return tuple(
        name for name, hint in typing.get_type_hints(cls).items() if hint is int and name != "step"
    )


def _sound_source(cls: type[ev.Event], spec: Spec, ints: tuple[str, ...]) -> str:
    """The source of ``sound(event) -> bool``: True when no rule of ``spec`` is broken. The
    common case costs a few comparisons; only an event that breaks a rule pays for
    :func:`malformed`'s report of which. Derived from the table alone, never from data."""
    tests = []
    if spec.about is ONE:
        tests.append("not e.req_id")
    elif spec.about is NONE:
        tests.append("e.req_id")
    hints = typing.get_type_hints(cls)
    for name in ints:
        low = "0" if name in spec.nonneg else "MIN"
        tests.append(f"not {low} <= e.{name} <= MAX")
    for name in spec.nonneg:
        if name not in ints:
            tests.append(f"(e.{name} and (min(e.{name}) < 0 or max(e.{name}) > MAX))")
    for name in spec.signed64:
        tests.append(f"(e.{name} and (min(e.{name}) < MIN or max(e.{name}) > MAX))")
    for group in spec.pairs:
        tests += [f"len(e.{group[0]}) != len(e.{other})" for other in group[1:]]
    tests += [f"e.{low} > e.{high}" for low, high in spec.order]
    for name in spec.nonempty:
        array = typing.get_origin(hints[name]) is tuple
        tests.append(f'b"" in e.{name}' if array else f"not e.{name}")
    tests += [f"len(set(e.{name})) != len(e.{name})" for name in spec.distinct]
    if spec.extra is not None:
        tests.append("extra(e)")
    body = " or ".join(tests) or "False"
    return f"def sound(e):\n    return not ({body})\n"


def _check_specs() -> dict[type[ev.Event], tuple[Spec, tuple[str, ...], Callable[[Any], bool]]]:
    # Like the codec's upcasters: a type without rules, or a rule naming a field the type
    # does not have, is an import error, not a check that silently never runs.
    out = {}
    for cls in ev.EVENT_TYPES:
        spec = SPECS.get(cls)
        if spec is None:
            raise RuntimeError(f"tracker.wellformed: {cls.__name__} has no entry in SPECS")
        names = set(typing.get_type_hints(cls))
        named = [*spec.nonneg, *spec.signed64, *spec.nonempty, *spec.distinct]
        named += [f for group in spec.pairs for f in group] + [f for o in spec.order for f in o]
        unknown = sorted(set(named) - names)
        if unknown:
            raise RuntimeError(f"tracker.wellformed: {cls.__name__} has no field {unknown}")
        ints = _int_fields(cls)
        out[cls] = (spec, ints, _compiled(cls, spec, ints, cls.__name__))
    return out


def _compiled(
    cls: type[ev.Event], spec: Spec, ints: tuple[str, ...], name: str
) -> Callable[[Any], bool]:
    namespace: dict[str, Any] = {"MIN": _MIN64, "MAX": _MAX64, "extra": spec.extra}
    source = _sound_source(cls, spec, ints)
    exec(compile(source, f"<kvledger wellformed {name}>", "exec"), namespace)
    sound_fn: Callable[[Any], bool] = namespace["sound"]
    return sound_fn


_TABLE = _check_specs()


def _sound_but(cls: type[ev.Event], fields: frozenset[str]) -> Callable[[Any], bool]:
    """``sound`` for ``cls`` less its rules on ``fields``, generated from the same table: for
    a reader that proves those rules another way (see :data:`sound_but_nums`)."""
    spec = SPECS[cls]
    spec = spec._replace(
        nonneg=tuple(f for f in spec.nonneg if f not in fields),
        distinct=tuple(f for f in spec.distinct if f not in fields),
    )
    return _compiled(cls, spec, _int_fields(cls), f"{cls.__name__} but {sorted(fields)}")


sound_but_nums = _sound_but(ev.StepDecoded, frozenset({"nums"}))
"""A ``StepDecoded``'s rules other than those on ``nums`` (not negative, not repeated): the
replay's batch (``Tracker``'s ``_Decoding``) proves those itself, as every number it takes is
one the numbering gave a live request (never negative) and it counts the distinct numbers
whenever they change. Its step is 256 numbers long; three passes over them in C are a
twentieth of ``check``'s time (docs/performance.md). Any step the batch refuses is checked
with :func:`malformed` as every other event, so the verdict on a record is the same."""


def malformed(event: ev.Event) -> list[Violation]:
    """What is impossible about ``event`` on its own (empty when nothing): a ``Violation``
    per broken rule, naming the field. Never raises."""
    entry = _TABLE.get(event.__class__)
    try:
        if entry is None or entry[2](event):  # sound: the common case, a few comparisons
            return []
        found = broken(event)
    except Exception as exc:  # a value of a type no log holds (an event built in memory)
        found = [("field_range", "?", {"error": f"{type(exc).__name__}: {exc}"[:200]})]
    name = event.__class__.__name__
    rid = event.req_id
    return [Violation(rule, event.step, rid, name, {"field": f, **d}) for rule, f, d in found]


def broken(event: ev.Event) -> list[tuple[str, str, dict[str, Any]]]:
    """Every rule ``event`` breaks, as (rule, field, detail): the report behind
    :func:`malformed`, which asks it only when the generated check found something."""
    entry = _TABLE.get(event.__class__)
    if entry is None:
        return []
    spec, ints, _ = entry
    found: list[tuple[str, str, dict[str, Any]]] = []
    rid = event.req_id
    if spec.about is ONE and not rid:
        found.append(("field_empty", "req_id", {}))
    elif spec.about is NONE and rid:
        found.append(("req_id_unexpected", "req_id", {"length": len(rid)}))
    for name in ints:
        value = getattr(event, name)
        if not _MIN64 <= value <= _MAX64:
            found.append(("field_range", name, {"value": value, "expected": "a 64-bit integer"}))
    for name in spec.nonneg:
        value = getattr(event, name)
        if type(value) is tuple:
            if value:
                low, high = min(value), max(value)
                if low < 0:
                    index = value.index(low)
                    found.append(("field_negative", name, {"value": low, "index": index}))
                if high > _MAX64:
                    found.append(("field_range", name, {"value": high, "expected": "int64"}))
        elif value < 0:
            found.append(("field_negative", name, {"value": value}))
    for name in spec.signed64:
        value = getattr(event, name)
        if value and (min(value) < _MIN64 or max(value) > _MAX64):
            found.append(("field_range", name, {"expected": "a signed 64-bit digest"}))
    for group in spec.pairs:
        lengths = [len(getattr(event, name)) for name in group]
        if len(set(lengths)) > 1:
            lengths_text = "/".join(map(str, lengths))
            found.append(("field_lengths", "/".join(group), {"lengths": lengths_text}))
    for low, high in spec.order:
        a, b = getattr(event, low), getattr(event, high)
        if a > b:
            found.append(("field_order", high, {low: a, high: b}))
    for name in spec.nonempty:
        value = getattr(event, name)
        if type(value) is tuple:
            if value and not all(value):
                found.append(("field_empty", name, {"index": value.index(b"")}))
        elif not value:
            found.append(("field_empty", name, {}))
    for name in spec.distinct:
        value = getattr(event, name)
        if len(set(value)) != len(value):
            seen: set[Any] = set()
            for v in value:
                if v in seen:
                    found.append(("field_repeated", name, {"value": v}))
                    break
                seen.add(v)
    if spec.extra is not None:
        found += spec.extra(event)
    return found


def sound(event: ev.Event) -> bool:
    """Whether ``event`` breaks none of its type's rules: the check :func:`malformed` runs
    first, generated from :data:`SPECS` (a type it does not know is sound). Never raises."""
    entry = _TABLE.get(event.__class__)
    try:
        return entry is None or bool(entry[2](event))
    except Exception:
        return False


class Wellformed:
    """:func:`malformed`, and the rules that need the events before: the remote store's
    outages and returns alternate (the connector records each once). One per reader of a
    log, fed every event in log order; :meth:`check` returns the violations an event shows."""

    __slots__ = ("remote_down",)

    def __init__(self) -> None:
        self.remote_down = False

    def check(self, event: ev.Event) -> list[Violation]:
        found = malformed(event)
        cls = event.__class__
        if cls is ev.RemoteOutage:
            if self.remote_down:
                found.append(Violation("remote_outage_twice", event.step, "", "RemoteOutage"))
            self.remote_down = True
        elif cls is ev.RemoteRestored:
            if not self.remote_down:
                found.append(Violation("remote_restored_twice", event.step, "", "RemoteRestored"))
            self.remote_down = False
        return found
