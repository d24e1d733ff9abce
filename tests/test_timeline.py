"""``kvledger timeline`` on the logs of vLLM's real scheduler in tests/data: the short-load log's
injected fault (a load one block short of what vLLM accepted) is drawn short and marked where
``check`` finds it, the clean log shows neither; waiting and preempted are told apart; the
run-wide panels give ``stats``' numbers; ``--request`` and ``--steps`` select; bad input is a
clear error, exit 2 (JSON with ``--json``). The page in a browser: test_timeline_browser.py."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvledger import replay
from kvledger.connector.logwriter import LogWriter
from kvledger.replay.charts import COLORS
from kvledger.replay.cli import main
from kvledger.replay.steps import parse_steps
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

DATA = Path(__file__).resolve().parent / "data"
SHORT = DATA / "replay-short-load.kvlog"
CLEAN = DATA / "replay-clean.kvlog"
TRUTH = json.loads((DATA / "replay-short-load.json").read_text())


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_the_short_loads_are_drawn_short_and_marked(tmp_path: Path) -> None:
    result = replay.timeline(SHORT, tmp_path / "t.html", top=20)
    shorts = {label: a for label, a in result.short_loads()}
    assert sorted(shorts) == TRUTH["requests_changed"]
    first = shorts[TRUTH["first_bad"]["req_id"]]
    assert first.step == TRUTH["first_bad"]["step"]
    # what vLLM accepted (the correct load) beside what the faulty plan loaded
    assert (first.load_start, first.load_end) == tuple(TRUTH["first_bad"]["recorded"])
    assert first.accepted == TRUTH["first_bad"]["correct"][1] and first.short == 16
    assert sum(a.loaded for a in shorts.values()) == TRUTH["run"]["tokens_loaded"]
    # check's problems, each at its request and step, named by the decision that differs
    marks = {(s.label, m.step, m.name) for s in result.series for m in s.problems}
    assert marks == {(label, a.step, "LoadPlanned") for label, a in shorts.items()}
    assert result.problems_drawn == result.problems_total == TRUTH["loads_changed"]
    # the requests with problems come first
    assert {s.label for s in result.series[: len(shorts)]} == set(shorts)


def test_the_clean_log_has_no_short_load_and_no_mark(tmp_path: Path) -> None:
    result = replay.timeline(CLEAN, tmp_path / "t.html", top=20)
    assert result.short_loads() == [] and result.problems_total == 0
    loads = [a for s in result.series for a in s.admissions if a.loaded]
    assert loads and all(a.loaded == a.accepted for a in loads)


def test_waiting_and_preempted_are_told_apart(tmp_path: Path) -> None:
    result = replay.timeline(SHORT, tmp_path / "t.html", top=20)
    assert len(result.series) == result.requests == TRUTH["run"]["requests"]
    preempted_spans = 0
    for s in result.series:
        kinds = [p for _, _, p in s.phases]
        assert "waiting" not in kinds[1:], s.label  # only before the first admission
        for (_, b, _), (a2, _, _) in zip(s.phases, s.phases[1:], strict=False):
            assert b == a2, s.label  # one after the other, no gap
        # every preemption the fold saw starts a preempted span, and only those do
        starts = [a for a, _, p in s.phases if p == "preempted"]
        assert starts == s.preemptions, s.label
        preempted_spans += len(starts)
        # every span before a re-admission is preempted; before the first, waiting (if any)
        for adm in s.admissions:
            before = [p for a, b, p in s.phases if b == adm.step and a < b]
            assert before == (["preempted"] if adm.preempted_before else before[:1]), s.label
            assert all(p == "waiting" for p in before) or adm.preempted_before
    assert preempted_spans == TRUTH["run"]["preemptions"]


def test_the_run_panels_give_stats_numbers(tmp_path: Path) -> None:
    result = replay.timeline(SHORT, tmp_path / "t.html")
    st = replay.stats(SHORT)
    run = result.run
    assert run.steps == list(range(st.steps)) and result.steps == (0, st.steps - 1)
    assert run.pool_slots == 24 and max(run.pool_used) <= run.pool_slots
    # hit rate per step: over the admissions of the step; summed, the whole run's
    asked = sum(a for _, a, _ in run.hits)
    hit = sum(h for _, _, h in run.hits)
    assert (asked, hit) == (1293, 256)  # stats: "1293 tokens asked: pool hit 256"
    assert (31, 71, 32) in run.hits  # docs/sql.md's hit rate per step
    # running + waiting + preempted: every request added and not finished
    assert run.waiting[0] + run.running[0] == 10 and run.running[-1] + run.waiting[-1] == 0


def test_request_and_steps_select(capsys: Any, tmp_path: Path) -> None:
    out = tmp_path / "t.html"
    result = replay.timeline(SHORT, out, requests=["req-5", "req-2"], steps=(25, 40))
    assert [s.label for s in result.series] == ["req-5", "req-2"]
    assert result.steps == (25, 40) and result.run.steps == list(range(25, 41))
    assert [(m.step, m.name) for s in result.series for m in s.problems] == [(31, "LoadPlanned")]
    for s in result.series:
        assert all(25 <= a <= b <= 40 for a, b, _ in s.phases)
        assert all(25 <= st <= 40 for st in s.steps[1:])  # the first: the value held into it
    # without --request: the top requests among those alive in the range
    result = replay.timeline(SHORT, out, steps=(290, None))
    assert result.steps == (290, 301)
    assert {s.label for s in result.series} == {
        "req-9",
        "again-req-0",
        "again-req-1",
        "again-req-2",
    }
    code, text, _ = _run(
        capsys, "timeline", str(SHORT), "-o", str(out), "-r", "req-2,req-3", "-r", "req-4"
    )
    assert code == 0 and "3 of 13 requests (req-2, req-3, req-4)" in text
    assert "short load: req-2 at step 31: loaded 16 of 32 accepted" in text
    assert "problems: 3 marked (LoadPlanned x3) of 6 check found" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-r", "nosuch"], "no request 'nosuch' in the log"),
        (["-r", "req-2,nosuch"], "no request 'nosuch' in the log"),
        (["-r", ","], "--request takes request ids"),
        (["--steps", "40:25"], "--steps '40:25': the first step 40 is after the last 25"),
        (["--steps", "500:"], "no step of the log is in it (the log has steps 0..301)"),
        (["--steps", "x:y"], "--steps 'x:y': expected A:B, A:, :B or N"),
        (["--top", "0"], "top must be at least 1"),
    ],
)
def test_bad_selections_are_errors(
    capsys: Any, tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "t.html"
    code, text, err = _run(capsys, "timeline", str(SHORT), "-o", str(out), *args)
    assert code == 2 and message in err and text == "" and not out.exists()
    code, text, err = _run(capsys, "timeline", str(SHORT), "-o", str(out), *args, "--json")
    assert code == 2 and json.loads(text) == {
        "error": err.removeprefix("kvledger: ").strip(),
        "exit_code": 2,
    }


def test_outputs_that_cannot_be_written(capsys: Any, tmp_path: Path) -> None:
    for out, message in [
        (tmp_path / "x.jpg", ".html, .png, .svg or .pdf"),
        (tmp_path, "is a directory"),
        (tmp_path / "no" / "t.html", f"no directory {tmp_path / 'no'}"),
    ]:
        code, text, err = _run(capsys, "timeline", str(SHORT), "-o", str(out), "--json")
        assert code == 2 and message in err and message in json.loads(text)["error"]


def test_json_says_what_was_drawn(capsys: Any, tmp_path: Path) -> None:
    code, text, err = _run(
        capsys, "timeline", str(SHORT), "-o", str(tmp_path / "t.html"), "--json", "-r", "req-2"
    )
    doc = json.loads(text)
    assert code == 0 and err == "" and doc["exit_code"] == 0
    assert doc["steps"] == [0, 301] and doc["requests_in_log"] == 13
    (req,) = doc["requests"]
    assert req["request"] == "req-2" and req["problems"] == [{"step": 31, "name": "LoadPlanned"}]
    assert req["phases"] == [[0, 15, "running"], [15, 31, "preempted"], [31, 86, "running"]]
    assert doc["short_loads"] == [{"request": "req-2", "step": 31, "accepted": 32, "loaded": 16}]
    assert doc["problems_drawn"] == 1 and doc["problems_total"] == 6


def test_steps_text() -> None:
    assert parse_steps("3:9") == (3, 9) and parse_steps(":9") == (None, 9)
    assert parse_steps("3:") == (3, None) and parse_steps(":") == (None, None)


@pytest.mark.parametrize("fmt", ["svg", "pdf", "png"])
def test_matplotlib_draws_the_same_marks(tmp_path: Path, fmt: str) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"t.{fmt}"
    result = replay.timeline(SHORT, out, top=3)
    data = out.read_bytes()
    magic = {"svg": b"<?xml", "pdf": b"%PDF", "png": b"\x89PNG"}[fmt]
    assert data.startswith(magic) and len(result.series) == 3
    if fmt == "svg":  # the problem colour is there for the short-load log, not the clean one
        assert COLORS["problem"].encode() in data
        replay.timeline(CLEAN, out, top=3)
        assert COLORS["problem"].encode() not in out.read_bytes()


def test_a_problem_about_a_request_never_added_is_marked_on_the_run(tmp_path: Path) -> None:
    # finished_v1: a 1.0 log about a request it never added; check's problem has no lane
    result = replay.timeline(DATA / "finished_v1.kvlog", tmp_path / "t.html")
    assert result.series == () and result.problems_total == 1
    assert [(m.step, m.name) for m in result.run.problems] == [(3, "unknown_request")]
    assert result.problems_drawn == 1


def test_a_violation_only_the_run_recorded_is_drawn_too(tmp_path: Path) -> None:
    # adapter_error: the connector could not read vLLM's object; check applies it as a fact
    # (no problem), the timeline still marks it, as recorded.
    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=64)
    path = tmp_path / "adapter.kvlog"
    t = Tracker(config, log=LogWriter(path, config.to_dict(), fsync="never"))
    ids = list(range(100, 180))
    t.add_request("a", ids)
    t.lookup("a", 0, ids)
    t.allocated("a", [1, 2, 3, 4, 5, 6], 0)
    t.mark_violation("a", "adapter_error", "Scheduled", error="AttributeError('x')")
    t.scheduled(
        "a",
        num_computed=0,
        num_scheduled=80,
        all_token_ids=ids,
        block_ids=[1, 2, 3, 4, 5, 6],
        admission=ev.Admission.NEW,
    )
    t.end_step()
    t.close()
    out = tmp_path / "t.html"
    result = replay.timeline(path, out)
    assert result.problems_total == 0
    (s,) = result.series
    assert s.violations == [(0, "adapter_error")] and s.problems == []
    assert result.to_dict()["requests"][0]["recorded_violations"] == [
        {"step": 0, "rule": "adapter_error"}
    ]
    assert '"recorded":[[0,"adapter_error"]]' in out.read_text()


@pytest.mark.parametrize("fmt", ["html", "svg", "png", "pdf"])
def test_a_log_whose_name_is_not_utf8_is_drawn(capsys: Any, tmp_path: Path, fmt: str) -> None:
    # A file name's undecodable bytes (lone surrogates in the str) reached matplotlib's text
    # (a pybind11 traceback, a .tmp left behind) and the page's UTF-8 ("surrogates not
    # allowed"): they are drawn escaped, r\xff\xfe.kvlog.
    if fmt != "html":
        pytest.importorskip("matplotlib")
    log = tmp_path / os.fsdecode(b"r\xff\xfe.kvlog")
    torn = tmp_path / os.fsdecode(b"t\xff.kvlog")  # damaged: the page names it too
    log.write_bytes(CLEAN.read_bytes())
    torn.write_bytes(CLEAN.read_bytes()[:-40])
    for named, shown in ((log, "r\\xff\\xfe.kvlog"), (torn, "t\\xff.kvlog")):
        out = tmp_path / f"t.{fmt}"
        code, _, err = _run(capsys, "timeline", str(named), "-o", str(out))
        assert code == (0 if named == log else 2), err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([log.name, torn.name, out.name])
        if fmt in ("html", "svg"):  # the title (in svg, beside the drawn text)
            assert f"{tmp_path}/{shown}: " in out.read_text(encoding="utf-8")
        if fmt == "html" and named == torn:
            assert f"Read stopped early: {tmp_path}/{shown}: offset " in out.read_text()


@pytest.mark.parametrize("fmt", ["html", "svg"])
def test_a_timeline_that_cannot_be_written_leaves_nothing_behind(
    capsys: Any, tmp_path: Path, monkeypatch: Any, fmt: str
) -> None:
    # The picture is drawn aside (out + ".tmp") and renamed: a failure left the .tmp there.
    if fmt != "html":
        pytest.importorskip("matplotlib")
    out = tmp_path / f"t.{fmt}"
    rename = os.replace

    def disk_full(src: Any, dst: Any) -> None:
        if os.fspath(dst) != str(out):
            return rename(src, dst)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(src))

    monkeypatch.setattr(os, "replace", disk_full)
    code, _, err = _run(capsys, "timeline", str(CLEAN), "-o", str(out))
    assert code == 2 and err.startswith(f"kvledger: cannot write {out}") and "No space" in err
    assert list(tmp_path.iterdir()) == []
