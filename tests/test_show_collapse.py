"""``kvledger show``: less noise where people read. Repeated identical lookups of a waiting
request and steady decode steps fold into one row with a count and a step range
(``--collapse``, the default for text), and ``--type`` / ``--steps`` select rows. On a
synthetic log and on a log of vLLM's real scheduler where a preempted request waits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvledger import replay
from kvledger.replay import cli
from kvledger.replay.lives import Fold, Row, collapse, parse_types, select
from kvledger.replay.source import open_log
from kvledger.replay.steps import parse_steps


def _flatten(entries: list[Row | Fold]) -> list[Row]:
    out: list[Row] = []
    for e in entries:
        out.extend(e.rows if isinstance(e, Fold) else [e])
    return out


def _waiting_request(path: Path) -> str:
    """A preempted request of the log (it waits, asking the same lookup every step)."""
    for frame in open_log(path).frames():
        for e in frame.events:
            if type(e).__name__ == "Preempted":
                return e.req_id
    raise AssertionError("no preempted request in the log")


def test_folding_loses_no_row_and_folds_only_like_steps(real_logs: dict[str, Path]) -> None:
    path = real_logs["loads"]
    ids = {r for f in open_log(path).frames() for e in f.events if (r := e.req_id)}
    folds = 0
    for rid in sorted(ids):
        rows = list(replay.show(path, rid))
        entries = collapse(rows)
        assert _flatten(entries) == rows  # nothing lost, nothing reordered
        for e in entries:
            if not isinstance(e, Fold):
                continue
            folds += 1
            assert e.steps >= 2 and len({r.step for r in e.rows}) == e.steps
            if e.kind == "decode":
                assert {r.event for r in e.rows} == {"StepDecoded"}
                assert len(e.rows) == e.steps
                assert [r.num_tokens for r in e.rows] == list(
                    range(e.first.num_tokens, e.last.num_tokens + 1)
                )
            else:
                assert {r.event for r in e.rows} == {"LookupAsked", "LookupAnswered"}
                assert len({(r.event, r.detail) for r in e.rows}) == 2  # the same each step
        assert len(entries) <= len(rows)
    assert folds > 0


def test_a_preempted_request_waiting_reads_as_one_row(real_logs: dict[str, Path], capsys) -> None:
    path = real_logs["loads"]
    rid = _waiting_request(path)
    rows = list(replay.show(path, rid))
    lookups = [e for e in collapse(rows) if isinstance(e, Fold) and e.kind == "lookup"]
    assert lookups, "the wait after the preemption folds"
    wait = max(lookups, key=lambda f: f.steps)
    asked = [r for r in rows if r.event == "LookupAsked" and wait.first.step <= r.step]
    assert wait.steps == len([r for r in asked if r.step <= wait.last.step]) >= 3
    assert re.fullmatch(
        rf"LookupAsked x{wait.steps} \(steps {wait.first.step}-{wait.last.step}\): \d+ hit, "
        r"each step \(hit=\d+ external=\d+\)",
        wait.describe(),
    )
    assert cli.main(["show", str(path), "-r", rid]) == 0
    folded = capsys.readouterr().out
    assert f"LookupAsked x{wait.steps}" in folded
    assert f"{wait.first.step}-{wait.last.step}" in folded
    assert cli.main(["show", str(path), "-r", rid, "--no-collapse"]) == 0
    full = capsys.readouterr().out
    assert " x" not in full.split("\n", 2)[2]  # no folded row
    assert len(full.splitlines()) - len(folded.splitlines()) >= wait.steps


def test_steady_decode_steps_fold_with_their_count(synthetic_log: Path, capsys) -> None:
    rows = list(replay.show(synthetic_log, "req-b"))
    entries = collapse(rows)
    decode = [e for e in entries if isinstance(e, Fold) and e.kind == "decode"]
    assert len(decode) == 1
    d = decode[0]
    assert (d.first.step, d.last.step, d.steps) == (7, 9, 3)
    assert d.describe() == (
        f"StepDecoded x3 (steps 7-9): +3 tokens steady decode, "
        f"num_tokens {d.first.num_tokens} -> {d.first.num_tokens + 2}"
    )
    # Step 6 decoded too, but its load finished there: not steady, it keeps its own rows.
    assert [r.event for r in entries if isinstance(r, Row) and r.step == 6] == [
        "LoadDone",
        "StepDecoded",
    ]
    assert cli.main(["show", str(synthetic_log), "-r", "req-b"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*7-9\s+46-49\s+StepDecoded x3\s+\+3 tokens steady decode", out, re.M)


def test_json_gives_every_row_unless_asked_to_fold(synthetic_log: Path, capsys) -> None:
    assert cli.main(["show", str(synthetic_log), "-r", "req-b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["event"] for r in doc["rows"]] == [
        r.event for r in replay.show(synthetic_log, "req-b")
    ]
    assert cli.main(["show", str(synthetic_log), "-r", "req-b", "--json", "--collapse"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    folded = [r for r in rows if r.get("folded")]
    assert [(r["folded"], r["count"], r["first_step"], r["last_step"]) for r in folded] == [
        ("decode", 3, 7, 9)
    ]
    assert len(rows) == len(doc["rows"]) - 2


# --- --type and --steps ---------------------------------------------------------------------


def test_type_selects_event_types(synthetic_log: Path, capsys) -> None:
    argv = ["show", str(synthetic_log), "-r", "req-b", "--type", "lookupasked,LookupAnswered"]
    assert cli.main([*argv, "--type", "Preempted", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    every = list(replay.show(synthetic_log, "req-b"))
    wanted = {"LookupAsked", "LookupAnswered", "Preempted"}
    assert [r["index"] for r in rows] == [r.index for r in every if r.event in wanted]
    assert {r["event"] for r in rows} == wanted
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"req-b: {len(every)} events ({len(rows) - 1} shown) in ")


def test_steps_select_a_range(synthetic_log: Path, capsys) -> None:
    every = list(replay.show(synthetic_log, "req-b"))
    for text, lo, hi in (("3:5", 3, 5), ("4", 4, 4), ("8:", 8, 99), (":1", 0, 1)):
        assert cli.main(["show", str(synthetic_log), "-r", "req-b", "--steps", text, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert [r["index"] for r in rows] == [r.index for r in every if lo <= r.step <= hi]
        assert rows
    assert select(every, frozenset({"Preempted"}), (4, None)) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--type", "Lookup"], r"unknown event type 'Lookup'; valid: .*LookupAsked"),
        (["--type", "Preempted,nope"], r"unknown event type 'nope'; valid: .*StepDecoded"),
        (["--steps", "a:b"], r"--steps 'a:b': expected A:B"),
        (["--steps", "9:5"], r"the first step 9 is after the last 5"),
        (["--steps", ":"], None),  # every step: allowed
    ],
)
def test_bad_selections_exit_2_naming_what_is_valid(
    synthetic_log: Path, argv: list[str], message: str | None, capsys
) -> None:
    code = cli.main(["show", str(synthetic_log), "-r", "req-b", *argv])
    captured = capsys.readouterr()
    if message is None:
        assert code == 0
        return
    assert code == 2 and captured.out == ""
    assert re.search(message, captured.err) and "Traceback" not in captured.err


def test_parsers() -> None:
    assert parse_types(["stepdecoded", " Preempted ,"]) == {"StepDecoded", "Preempted"}
    assert parse_steps("2:7") == (2, 7) and parse_steps("3") == (3, 3)
    assert parse_steps(":") == (None, None) and parse_steps("5:") == (5, None)
    with pytest.raises(ValueError):
        parse_steps("")
