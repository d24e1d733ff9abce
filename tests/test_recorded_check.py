"""``kvledger check`` of a recorder's log, written here event by event (no vLLM): the rules
run automatically on such a log and name the rule, the request and the step; the differential
mode names the first lookup where the wrapped connector and kvledger differ, with both
answers; ``--differential`` on a log kvledger itself wrote is a usage error."""

from __future__ import annotations

import json
from typing import Any

from _verdicts import write_recorded

from kvledger.replay.cli import main
from kvledger.tracker import events as ev

PROMPT = tuple(range(100, 148))  # 48 tokens
REPEAT = tuple(range(100, 148))


def _write(path, events, *, recorder=True):
    return write_recorded(path, events, recorder_format=1 if recorder else None)


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _life(rid, step, offered, accepted, *, blocks=(1, 2, 3), tokens=PROMPT):
    n = len(tokens)
    return [
        ev.RequestAdded(step, rid, tokens),
        ev.LookupAsked(step, rid, 0, n, n, ()),
        ev.InnerLookupAnswered(step, rid, offered, False),
        ev.Allocated(step, rid, blocks, accepted),
        ev.Scheduled(step, rid, accepted, n - accepted, n, (), blocks, 1),
        ev.Finished(step + 1, rid, "finished_length_capped"),
        ev.InnerFinishedAnswered(step + 1, rid, False, blocks),
    ]


def test_clean_recorded_log(tmp_path, capsys):
    # The second request repeats the first's prompt (three whole chunks): every token but the
    # last offered, as kvledger would offer them too.
    path = _write(
        tmp_path / "a.kvlog", _life("a", 0, 0, 0) + _life("b", 2, 47, 47, blocks=(4, 5, 6))
    )
    code, out, _ = _run(capsys, "check", path)
    assert code == 0, out
    assert "recorder  wrapping Test: 2 lookups answered, 1 loads accepted" in out
    assert "result: clean: no rule broken by the wrapped connector (exit 0)" in out
    code, out, _ = _run(capsys, "check", path, "--differential")
    assert code == 0, out
    assert "2 lookups compared with kvledger's answer: 0 differ" in out


def test_broken_rule_named_with_request_and_step(tmp_path, capsys):
    path = _write(
        tmp_path / "b.kvlog", _life("a", 0, 0, 0) + _life("b", 2, 16, 32, blocks=(4, 5, 6))
    )
    code, out, _ = _run(capsys, "check", path)
    assert code == 1, out
    assert "problem 1: step 2, request b: rule accepted_beyond_offer broken at Allocated" in out
    assert "detail    accepted=32,offered=16" in out
    code, out, _ = _run(capsys, "check", path, "--json")
    result = json.loads(out)
    assert [(p["rule"], p["step"], p["req_id"]) for p in result["problems"]] == [
        ("accepted_beyond_offer", 2, "b")
    ]


def test_differential_names_first_difference(tmp_path, capsys):
    # The inner offers 16 tokens for a prompt nobody computed before: kvledger would offer 0.
    path = _write(
        tmp_path / "c.kvlog", _life("a", 0, 16, 16) + _life("b", 2, 47, 47, blocks=(4, 5, 6))
    )
    code, out, _ = _run(capsys, "check", path)
    assert code == 0, out  # no rule any connector keeps is broken: only kvledger disagrees
    code, out, _ = _run(capsys, "check", path, "--differential")
    assert code == 1, out
    assert "problem 1: step 0, request a: the wrapped connector's LookupAnswered differs" in out
    assert "inner     LookupAnswered hit=16 external=16" in out
    assert (
        "kvledger  LookupAnswered" in out
        and "external=0" in out.split("kvledger  ")[1].split("\n")[0]
    )
    assert "the wrapped connector offered 16 external tokens, kvledger would offer 0" in out
    assert "1 requests (the first of each is reported)" in out


def test_differential_needs_a_recorder_log(tmp_path, capsys):
    path = _write(tmp_path / "d.kvlog", [ev.RequestAdded(0, "a", PROMPT)], recorder=False)
    code, _out, err = _run(capsys, "check", path, "--differential")
    assert code == 2
    assert "--differential" in err and "KVLedgerRecorder" in err
    assert "Traceback" not in err


def test_timeline_of_a_recorded_log_draws_no_short_loads(tmp_path):
    """A recorder's log holds no load plan (the wrapped connector's loads are not observable):
    an accepted load is not drawn as a short one; only check's problems say otherwise."""
    from kvledger.replay.charts import timeline

    path = _write(
        tmp_path / "e.kvlog", _life("a", 0, 0, 0) + _life("b", 2, 47, 47, blocks=(4, 5, 6))
    )
    result = timeline(path, tmp_path / "t.html")
    accepted = [a.accepted for s in result.series for a in s.admissions]
    assert 47 in accepted
    assert result.short_loads() == []
