"""One malformed record, one verdict, whatever reads it (issue 26): ``check`` of a connector's
log (the ``Tracker``), ``check`` of a recorder's log (``tracker.recorded_rules``), ``explain``
and ``show`` (the list of requests, and the request's own rows) name each record that says
something impossible by the same rule, at the same step and position.

Before replay/malformed.py, ``explain`` named none of them, ``show`` named none about no request
(a pool event, a ``StepDecoded``, an event whose request id is empty) and never an outage or a
return twice, and ``check`` of a connector's log stamped a malformed ``LoadDigested`` at the
step of the load it names (its ``load_step``, 2**63 when that is what the record says) where
every other reader said the record's own step.

The malformations are tests/test_wellformed.py's (each rule of each type's spec broken alone),
the leftover rules (``Spec.extra``) and the rules that need the records before; hypothesis
places one in a log, alone or among a request's sound events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_check_malformed import _run, _write
from test_wellformed import _breakers, _sound_event

from kvledger.tracker import events as ev
from kvledger.tracker.codec import Encoder
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.wellformed import ANY, RULES, SPECS, Spec

KEY = bytes(range(16))
R = "r"  # the request of the log (tests/test_wellformed.py's sound events are about it)
PROMPT = tuple(range(100, 132))


class Case(NamedTuple):
    """Records that, written in this order, make the last one break ``rule``."""

    label: str
    records: tuple[ev.Event, ...]
    rule: str


def _writable(e: ev.Event) -> bool:
    """Whether a log can hold ``e``: its record packs (a 64-bit count plus a delta may not)."""
    try:
        msgpack.packb(Encoder().encode(e))
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _cases() -> dict[type[ev.Event], list[Case]]:
    out: dict[type[ev.Event], list[Case]] = {cls: [] for cls in ev.EVENT_TYPES}
    for cls in ev.EVENT_TYPES:
        for rule, field, changes in _breakers(cls):
            bad = attrs.evolve(_sound_event(cls), **changes)
            if _writable(bad):
                out[cls].append(Case(f"{rule} {field}", (bad,), rule))
    # The leftover rules of the table (Spec.extra), and the two that need the records before.
    for bad, rule in [
        (ev.LookupAsked(0, R, 0, 2, 0, (1, 2, 3)), "field_order"),  # ids past num_tokens
        (ev.Scheduled(0, R, 4, 1, 4, (1, 2), (), ev.Admission.RUNNING), "field_order"),
        (ev.RemoteFound(0, R, (KEY,), (2,)), "field_range"),  # found neither 0 nor 1
        (ev.LoadPlanned(0, R, 0, 16, (KEY,), (-2,)), "field_range"),  # a slot below -1
        (ev.StepDecoded(0, "", (1,), (), (5, 6)), "field_lengths"),  # two tokens, one number
        (ev.InnerStats(0, "", "elsewhere", "{}"), "field_range"),  # neither side
        (ev.RemoteRestored(0, ""), "remote_restored_twice"),  # the store was up
        # A load's digests of the wrong length, naming a load two steps before.
        (ev.LoadDigested(0, R, 0, (KEY, KEY), (1,), (1,), load_step=0), "field_lengths"),
        # Well formed, yet unreadable under the log's numbering (tracker.decoded): a number no
        # live request holds; a block paired with a number the record does not name.
        (ev.StepDecoded(0, "", (7,), (), (5,)), "decoded_unknown"),
        (ev.StepDecoded(0, "", (7,), (3, 9), (5,)), "decoded_blocks"),
    ]:
        out[type(bad)].append(Case(f"{rule} (extra)", (bad,), rule))
    twice = ev.RemoteOutage(0, "", "refused")
    out[ev.RemoteOutage].append(Case("twice", (twice, twice), "remote_outage_twice"))
    return out


CASES = _cases()


def _admitted(recorder: bool) -> list[ev.Event]:
    """Request ``r`` asked, answered and admitted (32 tokens, two blocks of 16)."""
    answer = ev.InnerLookupAnswered(0, R, 0) if recorder else ev.LookupAnswered(0, R, 0, 0)
    return [
        ev.RequestAdded(0, R, PROMPT),
        ev.LookupAsked(0, R, 0, 32, 0, ()),
        answer,
        ev.Allocated(0, R, (1, 2), 0),
        ev.Scheduled(0, R, 0, 32, 32, (), (1, 2), ev.Admission.NEW),
    ]


class Placed(NamedTuple):
    steps: list[list[ev.Event]]
    index: int  # the malformed record's position in the log
    step: int


def _place(case: Case, recorder: bool, admitted: bool, gap: int, after: bool) -> Placed:
    """The case's records in a log of their own: after ``r``'s admission (``admitted``) and
    ``gap`` empty steps, in one step; ``after``: then ``r`` finished."""
    steps: list[list[ev.Event]] = [_admitted(recorder) if admitted else []]
    steps += [[] for _ in range(gap)]
    steps.append(list(case.records))
    index = sum(map(len, steps)) - 1
    step = len(steps) - 1
    if after and admitted:
        steps.append([ev.Finished(0, R, "stop")])
    return Placed(steps, index, step)


Verdict = set[tuple[int, str, int]]  # (position, rule, step)

# What every reader names: the rules of tracker.wellformed, and those of a StepDecoded's
# entries that its numbering alone decides (decoded_not_steady is a judgement of the fold).
NAMED = {*RULES, "decoded_blocks", "decoded_unknown"}


def _check(capsys: pytest.CaptureFixture[str], log: Path) -> Verdict:
    code, out = _run(capsys, "check", "--json", str(log))
    assert code == 1
    return {
        (p["index"], p["name"], p["step"])
        for p in json.loads(out)["problems"]
        if p["kind"] == "violation" and p["name"] in NAMED
    }


def _records(doc: dict[str, Any]) -> Verdict:
    malformed = doc["malformed"]
    records = {(m["index"], m["rule"], m["step"]) for m in malformed["records"]}
    assert malformed["total"] == len(malformed["records"]) == sum(malformed["by_rule"].values())
    return records


def _explain(capsys: pytest.CaptureFixture[str], log: Path) -> Verdict:
    code, out = _run(capsys, "explain", "--json", str(log))
    assert code == 0
    doc = json.loads(out)
    # Its sums hold around a malformed record: asked = hit + missed, the reasons sum to missed.
    for r in doc["requests"]:
        for a in r["admissions"]:
            assert a["tokens_hit"] + a["missed_tokens"] == a["tokens_asked"], a
            assert sum(a["reasons"].values()) == a["missed_tokens"], a
    assert doc["tokens_hit"] + doc["missed_tokens"] == doc["tokens_asked"]
    return _records(doc)


def _show(capsys: pytest.CaptureFixture[str], log: Path) -> tuple[Verdict, Verdict, set[int]]:
    """show's list of requests, and ``r``'s rows (with the positions of its rows)."""
    code, out = _run(capsys, "show", "--json", str(log))
    assert code == 0
    listed = _records(json.loads(out))
    code, out = _run(capsys, "show", "--json", str(log), "-r", R)
    if code != 0:  # no request r in the log: the list is all show says
        return listed, set(), set()
    rows = json.loads(out)["rows"]
    marked = {
        (row["index"], rule, row["step"])
        for row in rows
        if "! malformed:" in row["detail"]
        for rule in row["violation"].split(",")
    }
    return listed, marked, {row["index"] for row in rows}


@pytest.mark.parametrize("cls", [c for c in ev.EVENT_TYPES if CASES[c]], ids=lambda c: c.__name__)
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_reader_names_a_malformed_record_alike(
    cls: type[ev.Event],
    data: st.DataObject,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A malformed record of type ``cls`` (one of its malformations, drawn) in a connector's
    log and in a recorder's: ``check``, ``explain``, ``show``'s list and ``show --request``'s
    rows name the same rules at the same steps and positions, and the record's own rule
    among them."""
    case = data.draw(st.sampled_from(CASES[cls]), label="case")
    admitted = data.draw(st.booleans(), label="admitted")
    gap = data.draw(st.integers(0, 2), label="gap")
    after = data.draw(st.booleans(), label="after")
    d = tmp_path_factory.mktemp("malformed")
    config = TrackerConfig(block_size=16, chunk_size=16)
    verdicts: dict[str, Verdict] = {}
    for recorder in (False, True):
        placed = _place(case, recorder, admitted, gap, after)
        kind = "recorded" if recorder else "kvledger"
        log = _write(
            d / f"{kind}.kvlog", placed.steps, recorder=recorder, config=config, recorder_format=2
        )
        checked = _check(capsys, log)
        assert (placed.index, case.rule, placed.step) in checked, (kind, case.label, checked)
        verdicts[f"check ({kind})"] = checked
        verdicts[f"explain ({kind})"] = _explain(capsys, log)
        listed, marked, rows = _show(capsys, log)
        verdicts[f"show ({kind})"] = listed
        # The request's rows: the rules of its records, and its malformed record among them.
        assert marked == {v for v in checked if v[0] in rows}, (kind, case.label)
        assert (placed.index in rows) == (case.records[-1].req_id == R), (kind, case.label)
    first = verdicts["check (kvledger)"]
    assert all(v == first for v in verdicts.values()), (case.label, verdicts)


def test_every_type_with_a_rule_has_a_malformation() -> None:
    """No event type escapes the test above but one with no rule at all (``Spec(about=ANY)``:
    it can say nothing impossible)."""
    assert [c for c in ev.EVENT_TYPES if not CASES[c] and SPECS[c] != Spec(about=ANY)] == []


def test_explain_and_show_print_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text: explain and show's list print each rule broken, its step and position, as
    check does; a clean log prints no such table."""
    steps: list[list[ev.Event]] = [
        _admitted(False),
        [ev.ChunkStored(0, "", KEY, -1, 16), ev.RemoteRestored(0, "")],
        [ev.LoadDigested(0, R, 0, (KEY, KEY), (1,), (1,), load_step=0)],
    ]
    log = _write(tmp_path / "bad.kvlog", steps)
    checked = _check(capsys, log)
    assert checked == {
        (5, "field_negative", 1),
        (6, "remote_restored_twice", 1),
        (7, "field_lengths", 2),
    }
    for argv in (["explain", str(log)], ["show", str(log)]):
        code, out = _run(capsys, *argv)
        assert code == 0
        assert "malformed records: 3 rules broken" in out, argv
        lines = out.splitlines()
        for index, rule, step in checked:
            assert any(
                line.split()[:2] == [str(step), str(index)] and rule in line for line in lines
            ), (argv, rule)
    clean = _write(tmp_path / "clean.kvlog", [_admitted(False)])
    for argv in (["explain", str(clean)], ["show", str(clean)]):
        _, out = _run(capsys, *argv)
        assert "malformed records" not in out


def test_a_request_the_fold_refused_takes_no_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In kvledger's own log, a ``RequestAdded`` whose prompt is no uint32 ids
    (``token_ids_valid``) gets no state from the writing Tracker, so no number: the numbers of
    the requests after it are one lower than counting every ``RequestAdded``. explain and show
    number as check does (before, they named three ``decoded_unknown`` where check named
    none). A recorder numbers every request it logs: there the same record takes one."""
    bad = ev.RequestAdded(0, "x", (-1,))
    steps: list[list[ev.Event]] = [[bad], _admitted(False), [ev.Finished(0, "x", "stop")]]
    # r is number 0 in the Tracker's numbering; counting x as well, it would be 1.
    steps += [[ev.StepDecoded(0, "", (0,))] for _ in range(3)]
    log = _write(tmp_path / "refused.kvlog", steps, config=TrackerConfig(block_size=16))
    code, out = _run(capsys, "check", "--json", str(log))
    # Number 0 is r: check judges r's steps (a table of 32 tokens is full: not steady).
    steps_of = {(p["name"], p["req_id"]) for p in json.loads(out)["problems"]}
    assert ("decoded_not_steady", R) in steps_of and ("token_ids_valid", "x") in steps_of
    assert _check(capsys, log) == _explain(capsys, log) == _show(capsys, log)[0] == set()

    # The recorder took a number for x, so r is 1, and a step naming 0 names x's number.
    recorded = [[bad], _admitted(True), [ev.StepDecoded(0, "", (1,), (), (7,))]]
    log = _write(tmp_path / "recorded.kvlog", recorded, recorder=True, recorder_format=2)
    code, out = _run(capsys, "check", "--json", str(log))
    assert code == 0, out  # the step stands for r's next Scheduled, which keeps every rule
    assert _explain(capsys, log) == _show(capsys, log)[0] == set()
    # show's walk numbers the recorder's way too: the step is r's, its last row.
    _, _, rows = _show(capsys, log)
    assert max(rows) == sum(map(len, recorded)) - 1, rows
