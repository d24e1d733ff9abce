"""``kvledger show LOG`` lists the requests (a new user's first question: which ids are in
here?), with the same figures as the tables, ``explain`` and ``check``; and every command names
a request the same way (``replay.naming``), suggesting the nearest ids for a typo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvledger.replay import lives
from kvledger.replay.cli import main
from kvledger.replay.explain import explain
from kvledger.replay.naming import RequestNotFound, resolve
from kvledger.replay.replayer import check
from kvledger.replay.tables import collect

DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "replay-clean.kvlog"
SHORT = DATA / "replay-short-load.kvlog"
ZOO = DATA / "zoo" / "vllm_55113.kvlog"


@pytest.mark.parametrize("log", [CLEAN, SHORT, ZOO], ids=["clean", "short-load", "recorded"])
def test_the_list_agrees_with_the_tables_explain_and_check(log: Path) -> None:
    lines, damage = lives.request_lines(log)
    assert damage is None
    rows, _ = collect(log, ["requests"])
    assert [r.request for r in lines] == [
        r["request"]
        for r in sorted(rows["requests"], key=lambda r: (r["added_step"], r["request"]))
    ]
    x = explain(log)
    missed = {r.request: sum(m.tokens for a in r.admissions for m in a.misses) for r in x.requests}
    assert {r.request: r.missed for r in lines} == {
        r.request: missed.get(r.request, 0) for r in lines
    }
    problems = check(log, max_problems=1 << 30).problems
    assert sum(r.problems for r in lines) == sum(1 for p in problems if p.req_id)
    assert sum(r.preemptions for r in lines) == sum(r["preemptions"] for r in rows["requests"])


def test_show_without_a_request_lists_them(capsys: Any) -> None:
    assert main(["show", str(SHORT)]) == 0
    out = capsys.readouterr().out
    lines, _ = lives.request_lines(SHORT)
    assert out.startswith(f"{len(lines)} requests in ")
    for r in lines:
        assert r.request in out
    assert f"--request {lines[0].request}" in out  # how to see one
    assert main(["show", str(SHORT), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["request"] for r in doc["requests"]] == [r.request for r in lines]
    assert set(doc["requests"][0]) == {
        "request", "req_id", "admissions", "preemptions", "prompt", "asked", "local", "loaded",
        "missed", "problems", "end",
    }  # fmt: skip


def test_a_typo_gets_the_nearest_ids(capsys: Any) -> None:
    lines, _ = lives.request_lines(CLEAN)
    name = lines[0].req_id
    typo = name[:2] + name[2] + name[2:]  # a key struck twice: the id itself is the nearest
    for argv in (["show", str(CLEAN), "-r", typo], ["explain", str(CLEAN), "--request", typo]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"no request {typo!r} in the log; nearest: {name}," in err


def test_one_rule_names_a_request() -> None:
    lives_ = {"a-1": "a-1", "a-1#2": "a-1", "b-22": "b-22", "b-23": "b-23"}
    assert resolve("a-1", lives_) == ["a-1"]  # a life label first
    assert resolve("a-1#2", lives_) == ["a-1#2"]
    assert resolve("-22", lives_) == ["b-22"]  # a part of exactly one id: its lives
    with pytest.raises(RequestNotFound) as ambiguous:
        resolve("b-2", lives_)
    assert ambiguous.value.candidates == ("b-22", "b-23") and "ambiguous" in str(ambiguous.value)
    with pytest.raises(RequestNotFound) as typo:
        resolve("b-24", lives_)
    assert set(typo.value.nearest[:2]) == {"b-22", "b-23"} and "nearest" in str(typo.value)
    with pytest.raises(RequestNotFound) as nothing:
        resolve("zzzzzz", lives_)
    assert nothing.value.nearest == () and str(nothing.value) == "no request 'zzzzzz' in the log"


def test_a_request_past_where_the_log_was_cut_is_not_called_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log read only in part may hold the request past the damage: show and explain say
    that it is not in what could be read, and why, rather than that it is not in the log."""
    data = (DATA / "replay-clean.kvlog").read_bytes()
    assert len(lives.show(DATA / "replay-clean.kvlog", "again-req-2"))  # the whole log has it
    cut = tmp_path / "cut.kvlog"
    cut.write_bytes(data[: len(data) // 3])
    for argv in (
        ["show", str(cut), "-r", "again-req-2"],
        ["explain", str(cut), "-r", "again-req-2"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "no request 'again-req-2' in what could be read of the log (" in err, err
        assert "torn_tail" in err
    with pytest.raises(RequestNotFound, match="no request 'req-99' in the log"):
        lives.show(DATA / "replay-clean.kvlog", "req-99")
