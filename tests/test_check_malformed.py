"""Events whose fields contradict each other or are impossible are named problems in
``kvledger check``, each at its event (position, frame, byte offset), in a connector's log and
in a recorder's; ``stats``, ``show`` and ``sql`` (the ``problems`` table) say so too.

Before tracker/wellformed.py, ``check`` was clean on all of these (issue 19, point 6): a
``RemoteFound`` with 2 keys and 5 answers was cut short by ``zip``, digest keys and values of
different lengths likewise, and negative starts, ranks and block ids, outages twice in a row
went by unremarked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig

KEY, KEY2 = bytes(range(16)), bytes(range(16, 32))
PROMPT = tuple(range(100, 148))


def _write(
    path: Path,
    steps: list[list[ev.Event]],
    *,
    recorder: bool = False,
    config: TrackerConfig | None = None,
    recorder_format: int = 1,
) -> Path:
    header = (config or TrackerConfig(block_size=16, chunk_size=16)).to_dict()
    if recorder:
        header["recorder"] = {"format": recorder_format, "inner": "Test", "inner_class": "t.Test"}
    with LogWriter(path, header, fsync="never") as w:
        for step, events in enumerate(steps):
            for e in events:
                w.append(attrs.evolve(e, step=step))
            w.end_step(step)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out


def _offsets(path: Path) -> list[int]:
    """The byte offset of the frame each event was read from, by event position."""
    return [f.offset for f in LogReader(path).iter_raw() for _ in f.records]


CONNECTOR = [
    [ev.RequestAdded(0, "a", PROMPT)],
    [ev.RemoteFound(1, "a", (KEY, KEY2), (1, 1, 1, 0, 1))],  # 2 keys, 5 answers
    [ev.BlockDigested(2, "a", 0, (KEY, KEY2), (7,))],  # 2 keys, 1 digest
    [ev.LoadDigested(3, "a", -3, (KEY,), (1,), (2,), rank=-1)],  # negative start and rank
    [ev.RemoteOutage(4, "", "refused"), ev.RemoteOutage(4, "", "refused")],  # twice
    [ev.RemoteRestored(5, ""), ev.RemoteRestored(5, "")],  # twice
    [ev.Allocated(6, "a", (1, -2, 3), 0)],  # a negative block id
    [ev.ChunkStored(7, "", KEY, -1, 16)],  # a negative slot
    [ev.StepDecoded(8, "", (0, 0))],  # one request twice in one step
]
# (position of the event in the log, the rules check names there)
CONNECTOR_NAMED = {
    1: {"field_lengths"},
    2: {"field_lengths"},
    3: {"field_negative"},
    5: {"remote_outage_twice"},
    7: {"remote_restored_twice"},
    8: {"field_negative"},
    9: {"field_negative"},
    10: {"field_repeated"},
}

RECORDER = [
    [ev.RequestAdded(0, "a", PROMPT), ev.LookupAsked(0, "a", 0, 48)],
    [ev.InnerLookupAnswered(0, "a", 5), ev.Allocated(0, "a", (1, -2, 3), 5)],  # block -2
    [ev.InnerFinishedAnswered(1, "a", True, (4, -1))],  # a negative block id
    [ev.InnerLoadErrors(2, "a", (1,))],  # about blocks, never a request
    [ev.InnerStats(3, "", "elsewhere", "{}")],  # neither worker nor scheduler
    [ev.RecordLost(4, "a", "", "boom")],  # which callback?
    [ev.LookupAsked(5, "a", 60, 48)],  # a local hit above the tokens asked
]
RECORDER_NAMED = {
    3: {"field_negative"},
    4: {"field_negative"},
    5: {"req_id_unexpected"},
    6: {"field_range"},
    7: {"field_empty"},
    8: {"field_order"},
}


def _named(problems: list[dict[str, Any]]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for p in problems:
        if p["kind"] == "violation" and (p["name"].startswith(("field_", "remote_", "req_id"))):
            out.setdefault(p["index"], set()).add(p["name"])
    return out


@pytest.mark.parametrize(
    ("steps", "named", "recorder"),
    [(CONNECTOR, CONNECTOR_NAMED, False), (RECORDER, RECORDER_NAMED, True)],
    ids=["connector", "recorder"],
)
def test_check_names_each_malformed_event_at_its_offset(
    steps: list[list[ev.Event]],
    named: dict[int, set[str]],
    recorder: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = _write(tmp_path / "bad.kvlog", steps, recorder=recorder)
    code, out = _run(capsys, "check", "--json", str(log))
    result = json.loads(out)
    assert code == 1 and result["exit_code"] == 1
    assert _named(result["problems"]) == named
    offsets = _offsets(log)
    for p in result["problems"]:
        if p["index"] in named:
            assert p["offset"] == offsets[p["index"]] and p["path"] == str(log)
    code, text = _run(capsys, "check", str(log))
    assert code == 1
    first = min(named)
    assert (
        f"(event #{first}, frame seq {first if not recorder else 1} at byte {offsets[first]}"
        in text
    )


def test_the_field_and_the_numbers_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = _write(tmp_path / "bad.kvlog", CONNECTOR)
    _, out = _run(capsys, "check", str(log))
    assert "rule field_lengths broken at RemoteFound" in out
    assert "detail    field=keys/found,lengths=2/5" in out
    assert "detail    field=start,value=-3" in out and "field=rank,value=-1" in out
    assert "rule remote_outage_twice broken at RemoteOutage" in out


def test_stats_show_and_sql_say_it_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write(tmp_path / "bad.kvlog", CONNECTOR)
    code, out = _run(capsys, "stats", "--json", str(log))
    assert code == 0 and json.loads(out)["malformed"] == {
        "field_negative": 4,  # the LoadDigested breaks it twice (start, rank)
        "field_lengths": 2,
        "remote_outage_twice": 1,
        "remote_restored_twice": 1,
        "field_repeated": 1,
    }
    code, out = _run(capsys, "show", str(log), "-r", "a")
    assert code == 0
    assert "keys=2 found=[1 1 1 0 1] ! malformed: field_lengths keys/found" in out
    code, out = _run(capsys, "show", str(log), "-r", "a", "--json")
    rows = {r["event"]: r for r in json.loads(out)["rows"]}
    assert rows["LoadDigested"]["violation"] == "field_negative"
    code, out = _run(
        capsys,
        "sql",
        str(log),
        "SELECT name, count(*) AS n FROM problems WHERE kind = 'violation' GROUP BY name ORDER BY name",
        "--json",
    )
    by_rule = {r["name"]: r["n"] for r in json.loads(out)}
    assert code == 0 and by_rule["field_lengths"] == 2 and by_rule["remote_restored_twice"] == 1


def test_a_clean_log_names_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rules never fire on a sound log: vLLM's real scheduler's (tests/data)."""
    for log in sorted((Path(__file__).parent / "data").glob("replay-*.kvlog")):
        _, out = _run(capsys, "check", "--json", str(log))
        assert _named(json.loads(out)["problems"]) == {}, log
        _, out = _run(capsys, "stats", "--json", str(log))
        assert json.loads(out)["malformed"] == {}


# --- one damaged StepDecoded, two readings: the same rule at the same step ---------------------

DECODED_PROMPT = tuple(range(100, 120))


def _decoded_log(path: Path, damaged: ev.StepDecoded, *, recorder: bool) -> Path:
    """Request ``a`` (20 tokens, six blocks of 4) admitted in step 0, then ``damaged``: in
    kvledger's own log, or in a recorder's (whose entries carry their token)."""
    a = "a"
    answered: ev.Event = (
        ev.InnerLookupAnswered(0, a, 0) if recorder else ev.LookupAnswered(0, a, 0, 0)
    )
    table = (1, 2, 3, 4, 5, 6)
    steps: list[list[ev.Event]] = [
        [
            ev.RequestAdded(0, a, DECODED_PROMPT),
            ev.LookupAsked(0, a, 0, 20, 20, ()),
            answered,
            ev.Allocated(0, a, table, 0),
            ev.Scheduled(0, a, 0, 20, 20, (), table, ev.Admission.NEW),
        ],
        [damaged],
    ]
    config = TrackerConfig(block_size=4, chunk_size=8)
    return _write(path, steps, recorder=recorder, config=config, recorder_format=2)


def _rules_at(path: Path, index: int) -> set[tuple[str, int]]:
    from kvledger.replay.replayer import check

    return {(p.name, p.step) for p in check(path).problems if p.index == index}


@settings(max_examples=60, deadline=None)
@given(
    nums=st.lists(st.integers(-2, 3), max_size=4),
    blocks=st.lists(st.integers(-1, 3), max_size=5),
    tokens=st.sampled_from(["none", "one each", "one more"]),
    req_id=st.sampled_from(["", "a"]),
)
def test_a_damaged_step_is_named_alike_in_both_kinds_of_log(
    tmp_path_factory: pytest.TempPathFactory,
    nums: list[int],
    blocks: list[int],
    tokens: str,
    req_id: str,
) -> None:
    """A StepDecoded that names a number twice, a negative or unknown one, carries a request
    id, blocks that do not pair, or tokens that do not align: ``check`` of kvledger's own log
    (the Tracker) and of a recorder's (``RecordedRules.judge``) name the same rules at the same
    step, and a malformed one the rules ``tracker.wellformed`` gives it."""
    from kvledger.tracker.wellformed import malformed

    count = {"none": 0, "one each": len(nums), "one more": len(nums) + 1}[tokens]
    own_tokens = tuple(range(7, 7 + count)) if tokens != "none" or not nums else ()
    damaged = ev.StepDecoded(1, req_id, tuple(nums), tuple(blocks), own_tokens)
    # A recorder's steady entry always carries its token: "none" is one each there.
    carried = (
        damaged
        if tokens != "none"
        else attrs.evolve(damaged, tokens=tuple(range(7, 7 + len(nums))))
    )
    d = tmp_path_factory.mktemp("decoded")
    own = _rules_at(_decoded_log(d / "own.kvlog", damaged, recorder=False), 5)
    recorded = _rules_at(_decoded_log(d / "rec.kvlog", carried, recorder=True), 5)
    assert own == recorded
    bad = {(v.rule, 1) for v in malformed(damaged)}
    if bad:
        assert own == bad
