"""``tracker.wellformed``: what no event can say, per type, and the folds that take in nothing
malformed.

The table is checked three ways: each rule of each type, broken on purpose in an otherwise
sound event, is named (and nothing else is); the generated check (``sound``) agrees with the
report (``broken``) on events of every tag; and the folds of the remote store, the digests and
the pool do not use what a malformed event says (no silent ``zip``).
"""

from __future__ import annotations

import typing
from typing import Any

import attrs
import pytest
from hypothesis import given
from test_event_fuzz import EVENTS

from kvledger.tracker import events as ev
from kvledger.tracker import wellformed as wf
from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import DigestBook
from kvledger.tracker.index_fold import apply_input, apply_recorded
from kvledger.tracker.recorded_rules import RecordedRules
from kvledger.tracker.remote import apply_remote
from kvledger.tracker.tracker import Tracker

KEY = bytes(range(16))


def _sound_event(cls: type[ev.Event]) -> ev.Event:
    """An event of ``cls`` that breaks none of its rules: small values that line up."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {"step": 3, "req_id": "" if wf.SPECS[cls].about == wf.NONE else "r"}
    for f in attrs.fields(cls)[2:]:
        hint = hints[f.name]
        if hint is bool:
            values[f.name] = False
        elif hint is int:
            values[f.name] = 0
        elif hint is str:
            values[f.name] = "worker" if cls is ev.InnerStats else "x"
        elif hint is bytes:
            values[f.name] = KEY
        elif typing.get_origin(hint) is tuple:
            values[f.name] = (KEY,) if typing.get_args(hint)[0] is bytes else (1,)
        else:
            values[f.name] = f.default
    if cls is ev.StepDecoded:
        values["blocks"] = (1, 7)  # number 1 grew block 7
    if cls is ev.LookupAsked:
        values["num_tokens"] = 1
    if cls is ev.Scheduled:
        values["num_scheduled"] = 1
    if cls is ev.InnerStored:
        values["block_size"] = 1  # one token per key
    return cls(**values)


def _breakers(cls: type[ev.Event]) -> list[tuple[str, str, dict[str, Any]]]:
    """(rule, field, changes) for every rule of ``cls``'s spec, broken alone."""
    spec = wf.SPECS[cls]
    base = _sound_event(cls)
    hints = typing.get_type_hints(cls)
    out = []
    if spec.about == wf.ONE:
        out.append(("field_empty", "req_id", {"req_id": ""}))
    elif spec.about == wf.NONE:
        out.append(("req_id_unexpected", "req_id", {"req_id": "r"}))
    for name in wf._int_fields(cls):
        if name not in spec.nonneg:
            out.append(("field_range", name, {name: 1 << 63}))
    for name in spec.nonneg:
        array = typing.get_origin(hints[name]) is tuple
        out.append(
            ("field_negative", name, {name: (-1, 1)[: 1 + (name == "blocks")] if array else -1})
        )
        out.append(("field_range", name, {name: ((1 << 64) - 1,) if array else (1 << 64) - 1}))
    for name in spec.signed64:
        out.append(("field_range", name, {name: (1 << 63,)}))
    for group in spec.pairs:
        out.append(("field_lengths", "/".join(group), {group[0]: (*getattr(base, group[0]),) * 2}))
    for low, high in spec.order:
        out.append(("field_order", high, {low: getattr(base, high) + 1}))
    for name in spec.nonempty:
        array = typing.get_origin(hints[name]) is tuple
        out.append(("field_empty", name, {name: (b"",) if array else type(getattr(base, name))()}))
    for name in spec.distinct:
        out.append(("field_repeated", name, {name: (1, 1), "blocks": ()}))
    return out


CASES = [
    pytest.param(cls, rule, field, changes, id=f"{cls.__name__}-{rule}-{field}")
    for cls in ev.EVENT_TYPES
    for rule, field, changes in _breakers(cls)
]


@pytest.mark.parametrize("cls", ev.EVENT_TYPES, ids=lambda c: c.__name__)
def test_a_sound_event_of_every_type_breaks_nothing(cls: type[ev.Event]) -> None:
    assert wf.malformed(_sound_event(cls)) == []


@pytest.mark.parametrize(("cls", "rule", "field", "changes"), CASES)
def test_each_rule_broken_alone_is_named(
    cls: type[ev.Event], rule: str, field: str, changes: dict[str, Any]
) -> None:
    e = attrs.evolve(_sound_event(cls), **changes)
    found = [(v.rule, v.detail["field"]) for v in wf.malformed(e)]
    assert (rule, field) in found, found
    # The event, the step and the request are named too.
    v = wf.malformed(e)[0]
    assert (v.event, v.step, v.req_id) == (cls.__name__, 3, e.req_id)


@given(EVENTS)
def test_the_generated_check_agrees_with_the_report(e: ev.Event) -> None:
    assert wf.sound(e) == (wf.broken(e) == [])
    assert bool(wf.malformed(e)) == (not wf.sound(e))


# --- the cases of issue 19 --------------------------------------------------------------------


def _rules(e: ev.Event) -> list[str]:
    return [v.rule for v in wf.malformed(e)]


def test_the_issues_cases_are_named() -> None:
    assert _rules(ev.RemoteFound(0, "a", (KEY, KEY), (1, 1, 1, 0, 1))) == ["field_lengths"]
    assert _rules(ev.BlockDigested(0, "a", 0, (KEY, KEY), (5,))) == ["field_lengths"]
    assert _rules(ev.LoadDigested(0, "a", 0, (KEY,), (1,), (2, 3))) == ["field_lengths"]
    assert _rules(ev.BlockDigested(0, "a", -4, (KEY,), (5,))) == ["field_negative"]
    assert _rules(ev.BlockDigested(0, "a", 0, (KEY,), (5,), rank=-1)) == ["field_negative"]
    assert _rules(ev.LoadPlanned(0, "a", 32, 16)) == ["field_order"]
    # Not impossible: vLLM's ExampleConnector answers its cached prefix minus a longer local
    # hit, below zero, and the recorder writes what it answered (-1 is None).
    assert _rules(ev.InnerLookupAnswered(0, "a", -5)) == []
    assert _rules(ev.StepDecoded(0, "", (2, 2))) == ["field_repeated"]
    rules = wf.Wellformed()
    seen = [
        [v.rule for v in rules.check(e)]
        for e in (
            ev.RemoteOutage(1, "", "refused"),
            ev.RemoteOutage(2, "", "refused"),
            ev.RemoteRestored(3, ""),
            ev.RemoteRestored(4, ""),
        )
    ]
    assert seen == [[], ["remote_outage_twice"], [], ["remote_restored_twice"]]


def test_every_type_has_rules_and_every_rule_is_documented() -> None:
    assert set(wf.SPECS) == set(ev.EVENT_TYPES)
    named = {rule for cls in ev.EVENT_TYPES for rule, _, _ in _breakers(cls)}
    assert named | {"remote_outage_twice", "remote_restored_twice"} == set(wf.RULES)


# --- the folds take in nothing malformed --------------------------------------------------------


def test_a_remote_found_that_does_not_line_up_changes_nothing() -> None:
    index = ChunkIndex(8)
    apply_remote(index, ev.RemoteFound(0, "a", (KEY, b"k" * 16), (1, 1, 0, 1, 1)))
    assert KEY not in index.remote and len(index.remote) == 0
    apply_remote(index, ev.RemoteFound(0, "a", (KEY, b"k" * 16), (1, 0)))
    assert KEY in index.remote and b"k" * 16 not in index.remote


def test_a_digest_that_does_not_line_up_is_neither_recorded_nor_judged() -> None:
    book = DigestBook()
    assert book.apply(ev.BlockDigested(0, "a", 0, (KEY,), (5, 6))) == []
    assert book.digests_of(KEY) == () and book.stats.digested == 0
    assert book.apply(ev.LoadDigested(0, "a", 0, (KEY,), (1, 1), (1,))) == []
    assert book.stats.loaded == 0
    book.apply(ev.BlockDigested(0, "a", 0, (KEY,), (5,)))
    assert [v.rule for v in book.apply(ev.LoadDigested(1, "a", 0, (KEY,), (1,), (9,)))] == [
        "digest_mismatch"
    ]


def test_the_pool_takes_in_no_malformed_event() -> None:
    index = ChunkIndex(4)
    config = TrackerConfig()
    apply_input(index, ev.ChunkStored(0, "", b"", 1, 16), None, None, config)
    apply_input(index, ev.ChunkStored(0, "", KEY, -1, 16), None, None, config)
    assert index.slot_of(b"") is None and index.slot_of(KEY) is None
    # A recorded save plan whose keys and slots differ in number (a reader applying
    # recorded decisions, kvledger export's pool columns) is not applied, and does not raise:
    # apply_recorded checks it, once (apply_decision takes only sound decisions).
    plan = ev.SavePlanned(0, "a", 0, 32, (KEY, KEY[::-1]), (0,))
    apply_recorded(index, plan, None, None, config)
    assert index.slot_of(KEY) is None


def test_the_tracker_reports_and_recomputes() -> None:
    t = Tracker(TrackerConfig(block_size=16, chunk_size=16))
    t.add_request("a", list(range(40)))
    decisions = t.apply(ev.RemoteFound(0, "a", (KEY,), (1, 1)))
    assert [(d.rule, d.detail) for d in decisions if isinstance(d, ev.ViolationRecorded)] == [
        ("field_lengths", "field=keys/found,lengths=1/2")
    ]
    state = t.state("a")
    assert state is not None and state.recompute_only
    decisions = t.apply(ev.Scheduled(0, "a", -5, 1, 0, (), (1, 2, 3), ev.Admission.NEW))
    assert "field_negative" in [d.rule for d in decisions if isinstance(d, ev.ViolationRecorded)]
    # A malformed StepDecoded advances no request.
    before = t.state("a")
    assert [d.rule for d in t.apply(ev.StepDecoded(1, "", (0, 0)))] == ["field_repeated"]
    assert t.state("a") == before


def test_the_recorded_rules_judge_nothing_malformed() -> None:
    rules = RecordedRules(16)
    rules.apply(ev.RequestAdded(0, "a", tuple(range(40))))
    rules.apply(ev.LookupAsked(0, "a", 0, 40))
    rules.apply(ev.InnerLookupAnswered(0, "a", 0))
    # A negative block id is named, and the allocation judged by no other rule: the
    # acceptance beyond the offer it also shows is not reported from it.
    assert [v.rule for v in rules.apply(ev.Allocated(0, "a", (1, -2, 3), 16))] == ["field_negative"]
    assert [v.rule for v in rules.apply(ev.Allocated(0, "a", (1, 2, 3), 16))] == [
        "accepted_beyond_offer"
    ]


def test_a_value_of_the_wrong_type_is_named_not_raised() -> None:
    """Events read from a log hold the codec's types; one built in memory may not (a None
    where vLLM gave nothing): the check stays total."""
    e = ev.Scheduled(0, "a", None, 1)  # type: ignore[arg-type]
    assert not wf.sound(e)
    assert [(v.rule, v.detail["field"]) for v in wf.malformed(e)] == [("field_range", "?")]
