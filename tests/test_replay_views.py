"""``replay.show``, ``stats``, ``timeline`` and ``export`` and their commands, on synthetic logs written
by a real Tracker and LogWriter, on damaged and split logs, and on logs of vLLM's real
scheduler."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import attrs
import pytest
from _logfiles import torn_copy
from _replay_logs import copy_log, write_log

from kvledger import replay
from kvledger.replay import cli
from kvledger.replay.extras import MissingExtra, Output
from kvledger.replay.lives import RequestNotFound, Row
from kvledger.replay.logreader import LogReader, segment_paths
from kvledger.replay.source import LogUnreadable
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker


def all_events(path: Path) -> list[tuple[int, ev.Event]]:
    reader = LogReader(path)
    out = [(f.step, e) for f in reader for e in f.events]
    assert reader.stop is None
    return out


def truncated_copy(src: Path, dst: Path, cut: int) -> Path:
    return torn_copy(src, dst, cut)


# --- show ---------------------------------------------------------------------------------


def _row_view(row: Row) -> tuple:
    return (row.tokens_known, row.num_tokens, row.num_computed, row.block_ids, row.saved)


def _state_view(state) -> tuple:
    return (
        len(state.token_ids),
        state.num_tokens,
        state.num_computed,
        tuple(state.block_ids),
        state.saved,
    )


def assert_rows_match_a_tracker_replay(path: Path) -> int:
    """Feed the log's input events to a Tracker (which re-derives the decisions) and compare,
    at the end of every step, each live request's state with the last row ``show`` gives for
    it in that step. Returns the number of comparisons."""
    reader = LogReader(path)
    header = reader.header
    fields = {f.name for f in attrs.fields(TrackerConfig)}
    config = TrackerConfig.from_header({k: v for k, v in header["config"].items() if k in fields})
    ids = sorted({e.req_id for f in reader for e in f.events if e.req_id})
    rows = {rid: replay.show(path, rid) for rid in ids}
    tracker = Tracker(config)
    compared = 0
    for frame in reader:
        for e in frame.events:
            if e.KIND == "input":
                tracker.apply(e)
        for rid in ids:
            state = tracker.state(rid)
            mine = [r for r in rows[rid] if r.step == frame.step]
            if state is None or not mine:
                continue
            assert _row_view(mine[-1]) == _state_view(state), (rid, frame.step)
            assert mine[-1].recompute_only == state.recompute_only
            assert mine[-1].preempted == state.preempted
            compared += 1
        tracker.end_step()
    return compared


@pytest.mark.parametrize("fast", [True, False], ids=["StepDecoded", "Scheduled-only"])
def test_show_rows_follow_the_tracker(tmp_path: Path, fast: bool) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, fast=fast)
    assert assert_rows_match_a_tracker_replay(path) > 20


def test_show_counts_steady_decode_steps(synthetic_log: Path) -> None:
    """A StepDecoded names requests by number; show gives the request its own row, one more
    token each, and numbers freed by a retired request go to the next one added."""
    c = replay.show(synthetic_log, "req-c")
    decoded = [r for r in c if r.event == "StepDecoded"]
    assert [r.step for r in decoded] == [8, 9]
    assert [r.num_tokens for r in decoded] == [41, 42]
    assert decoded[0].tokens_known == 40  # the ids come in bulk, with the next Scheduled
    nums = [e.nums for s, e in all_events(synthetic_log) if isinstance(e, ev.StepDecoded)]
    assert nums[-1] == (1, 0, 2)  # b kept 1; c took a's 0 after a retired; d took 2


def test_show_blocks_are_replaced_on_resumption_and_preempted_is_set(synthetic_log: Path) -> None:
    life = replay.show(synthetic_log, "req-b")
    preempted = [r for r in life if r.event == "Preempted"]
    assert len(preempted) == 1 and preempted[0].step == 3
    assert preempted[0].preempted and preempted[0].blocks == 0 and preempted[0].num_tokens == 0
    resumed = next(r for r in life if r.event == "Scheduled" and "RESUMED" in r.detail)
    # From the preemption to the re-admission the request stays preempted, holding no tokens.
    waiting = life[life.index(preempted[0]) : life.index(resumed)]
    assert [r.event for r in waiting] == ["Preempted"] + ["LookupAsked", "LookupAnswered"] * 2 + [
        "Allocated"
    ]
    assert all(r.preempted and r.num_tokens == 0 for r in waiting)
    assert resumed.step == 5
    assert resumed.block_ids == (9, 10, 11, 12, 13)  # replaced, not appended to 4..8
    assert not resumed.preempted and resumed.phase == "running"
    assert resumed.preemptions == 1
    load = next(r for r in life if r.event == "LoadPlanned")
    assert load.load == (0, 64) and not load.load_done
    done = next(r for r in life if r.event == "LoadDone")
    assert done.load == (0, 64) and done.load_done


def test_show_marks_violations_and_recompute_only(synthetic_log: Path) -> None:
    life = replay.show(synthetic_log, "req-d")
    v = [r for r in life if r.violation]
    assert [(r.step, r.violation) for r in v] == [(7, "accepted_equals_answer")]
    after = life[life.index(v[0]) :]
    assert all(r.recompute_only for r in after)


def test_show_finds_a_request_by_part_of_its_id(tmp_path: Path) -> None:
    path = tmp_path / "x.kvlog"
    write_log(path, rename=lambda rid: f"cmpl-{rid}-0a1b2c3d" if rid else rid)
    life = replay.show(path, "req-b")
    assert life.request == "cmpl-req-b-0a1b2c3d"
    with pytest.raises(RequestNotFound) as info:
        replay.show(path, "req-")
    assert len(info.value.candidates) == 4
    with pytest.raises(RequestNotFound, match="no request 'nope'"):
        replay.show(path, "nope")


def test_show_numbers_the_lives_of_a_reused_id(tmp_path: Path) -> None:
    """vLLM may reuse an id once the request finished: rows say which life they belong to."""
    src, dst = tmp_path / "a.kvlog", tmp_path / "b.kvlog"
    write_log(src)
    copy_log(src, dst, lambda e: attrs.evolve(e, req_id="req-a") if e.req_id == "req-c" else e)
    life = replay.show(dst, "req-a")
    assert {r.life for r in life} == {"req-a", "req-a#2"}
    second = [r for r in life if r.life == "req-a#2"]
    assert second[0].event == "RequestAdded" and second[0].step == 7
    assert second[0].phase == "waiting" and second[0].num_tokens == 0


# --- stats --------------------------------------------------------------------------------


def test_stats_counts_match_the_events(synthetic_log: Path) -> None:
    events = all_events(synthetic_log)
    st = replay.stats(synthetic_log)
    assert st.events == len(events)
    assert st.events_by_type == dict(Counter(type(e).__name__ for _, e in events))
    assert st.decision_events == sum(isinstance(e, ev.DecisionEvent) for _, e in events)
    decoded = [e for _, e in events if isinstance(e, ev.StepDecoded)]
    assert decoded and st.logical_events == len(events) - len(decoded) + sum(
        len(e.nums) for e in decoded
    )
    assert st.bytes_per_logical_event == pytest.approx(
        synthetic_log.stat().st_size / st.logical_events
    )
    assert st.steps == len({s for s, _ in events}) == 11
    assert (st.first_step, st.last_step) == (0, 10)
    assert st.requests == 4 and st.finished == 4
    assert st.finish_reasons == {"length": 4}
    assert st.preemptions == 1 and st.readmissions == 1
    assert st.violations == {"accepted_equals_answer": 1}
    assert st.tokens_loaded == 64 + 32 and st.loads == 2 and st.loads_refused == 1
    assert st.tokens_saved == 64 and st.chunks_saved == 2 and st.chunks_confirmed == 2
    # First admissions: a 40 (no hit), b 70 (no hit), c 40 (32 hit), d 20 (no hit).
    fl = st.first_lookup
    assert (fl.admissions, fl.tokens, fl.hit, fl.external) == (4, 170, 32, 32 + 16)
    assert fl.hit_rate == pytest.approx(32 / 170)
    # Every admission adds b's resumption: 72 tokens asked, 64 hit and loaded.
    al = st.all_lookups
    assert (al.admissions, al.tokens, al.hit) == (5, 242, 96)
    assert st.file_bytes == synthetic_log.stat().st_size
    assert st.bytes_per_event == pytest.approx(synthetic_log.stat().st_size / len(events))
    assert st.config["chunk_size"] == 32 and st.config["block_size"] == 16
    assert st.format_version == "1.1" and st.damage is None


def test_stats_over_a_split_log_equal_the_single_file(tmp_path: Path) -> None:
    single, split = tmp_path / "one" / "run.kvlog", tmp_path / "split" / "run.kvlog"
    single.parent.mkdir()
    split.parent.mkdir()
    write_log(single)
    write_log(split, rotate_bytes=400)
    segments = segment_paths(split.parent)
    assert len(segments) > 2
    a, b = replay.stats(single), replay.stats(split.parent)
    assert b.files == [str(p) for p in segments]
    for field in ("events", "events_by_type", "requests", "preemptions", "tokens_loaded"):
        assert getattr(a, field) == getattr(b, field)
    assert replay.stats([str(p) for p in segments]).events == a.events
    assert [r.event for r in replay.show(split.parent, "req-b")] == [
        r.event for r in replay.show(single, "req-b")
    ]


# --- damage and unreadable logs ------------------------------------------------------------


def test_views_read_up_to_a_torn_tail_and_report_it(synthetic_log: Path, tmp_path: Path) -> None:
    torn = truncated_copy(synthetic_log, tmp_path / "torn.kvlog", 5)
    full = replay.stats(synthetic_log)
    st = replay.stats(torn)
    assert st.damage is not None and st.damage.kind == "torn_tail"
    assert st.damage.path == str(torn) and 0 < st.damage.offset < torn.stat().st_size
    assert 0 < st.events < full.events
    assert st.events_by_type["Finished"] < full.events_by_type["Finished"]
    life = replay.show(torn, "req-b")
    assert life.damage == st.damage and 0 < len(life) < len(replay.show(synthetic_log, "req-b"))
    out = replay.export(torn, tmp_path / "torn", "jsonl", problems=False)
    assert out.rows["events"] == st.events and out.damage == [st.damage]
    res = replay.timeline(torn, tmp_path / "torn.html")
    assert res.damage == st.damage
    assert "Read stopped early" in (tmp_path / "torn.html").read_text()


def test_views_report_a_corrupt_frame(synthetic_log: Path, tmp_path: Path) -> None:
    data = bytearray(synthetic_log.read_bytes())
    data[len(data) - 60] ^= 0xFF  # inside one of the last frames
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes(bytes(data))
    st = replay.stats(bad)
    assert st.damage is not None and st.damage.kind == "corrupt"
    assert "checksum" in st.damage.reason


def test_a_later_segment_that_is_not_a_log_is_damage_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "split" / "run.kvlog"
    path.parent.mkdir()
    write_log(path, rotate_bytes=400)
    last = segment_paths(path.parent)[-1]
    last.write_bytes(b"\0" * 64)  # zero-filled after a crash
    st = replay.stats(path.parent)
    assert st.damage is not None and st.damage.kind == "bad_header"
    assert str(last) in st.damage.path and st.events > 0


@pytest.mark.parametrize("what", ["not-a-log", "empty-dir", "missing"])
def test_unreadable_logs_raise_and_exit_2(tmp_path: Path, what: str, capsys) -> None:
    if what == "not-a-log":
        path = tmp_path / "x.kvlog"
        path.write_bytes(b"hello, world\n")
    elif what == "empty-dir":
        path = tmp_path / "empty"
        path.mkdir()
    else:
        path = tmp_path / "nothing.kvlog"
    with pytest.raises(LogUnreadable):
        replay.stats(path)
    for cmd in (["stats", str(path)], ["show", str(path), "-r", "x"]):
        assert cli.main(cmd) == 2
    assert cli.main(["export", str(path), "-o", str(tmp_path / "o"), "--format", "jsonl"]) == 2
    assert "cannot read the log" in capsys.readouterr().err


# --- export: tests/test_replay_tables.py (the tidy tables and every output form) -------------


def test_missing_extras_say_what_to_install(
    synthetic_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=re.escape("pip install kvledger[parquet]")):
        replay.export(synthetic_log, tmp_path / "x.parquet", table="steps")
    with pytest.raises(MissingExtra, match=re.escape("pip install kvledger[timeline]")):
        replay.timeline(synthetic_log, tmp_path / "x.png")
    assert cli.main(["timeline", str(synthetic_log), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install kvledger[timeline]" in capsys.readouterr().err
    # The html timeline needs nothing extra.
    replay.timeline(synthetic_log, tmp_path / "x.html")


# --- timeline -------------------------------------------------------------------------------


def page_data(html_text: str) -> dict:
    """The data a timeline page draws (its script draws nothing else)."""
    m = re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', html_text)
    assert m is not None
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_timeline_html_has_one_lane_per_top_request(synthetic_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.html"
    result = replay.timeline(synthetic_log, out, top=3)
    text = out.read_text()
    # Self-contained: inline script and data, nothing fetched.
    assert "src=" not in text and "href=" not in text
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")
    lanes = page_data(text)["lanes"]
    # Ranked: the violation first (d), then the preempted request (b), then by tokens.
    assert [lane["label"] for lane in lanes] == [s.label for s in result.series]
    assert [s.label for s in result.series] == ["req-d", "req-b", "req-a"]
    d, b = lanes[0], lanes[1]
    # Admitted in the step it was added (no wait), preempted at 3, re-admitted at 5.
    assert b["preemptions"] == [3]
    assert b["phases"] == [[0, 3, "running"], [3, 5, "preempted"], [5, 10, "running"]]
    resumed = b["admissions"][-1]
    assert resumed["step"] == 5 and resumed["loaded"] == 64 and resumed["short"] == 0
    assert any(m["name"] == "accepted_equals_answer" for m in d["problems"])
    assert result.requests == 4


def test_timeline_series_follow_the_fold(synthetic_log: Path, tmp_path: Path) -> None:
    result = replay.timeline(synthetic_log, tmp_path / "t.html", top=8)
    b = next(s for s in result.series if s.label == "req-b")
    assert b.steps == list(range(11))
    assert b.computed[:3] == [70, 71, 72] and b.computed[3:5] == [0, 0]
    assert b.computed[5] == 72  # resumed: 64 loaded + 8 computed
    assert b.preemptions == [3] and b.loads == [(5, 0, 64)]
    assert b.saved[2] == 64  # confirmed at step 2
    assert b.finished == 10


def test_timeline_png(synthetic_log: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    replay.timeline(synthetic_log, out, top=4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_rejects_an_unknown_suffix(synthetic_log: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.html, \.png, \.svg or \.pdf"):
        replay.timeline(synthetic_log, tmp_path / "t.txt")
    assert cli.main(["timeline", str(synthetic_log), "-o", str(tmp_path / "t.txt")]) == 2


# --- the commands ---------------------------------------------------------------------------


def test_show_command_plain_and_json(synthetic_log: Path, capsys) -> None:
    assert cli.main(["show", str(synthetic_log), "--request", "req-b"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("req-b: ")
    assert "\x1b[" not in out  # piped: no terminal codes
    header = out.splitlines()[1].split()
    assert header[:4] == ["step", "#", "event", "detail"]
    assert any(
        line.split()[:3] == ["3", line.split()[1], "Preempted"] for line in out.splitlines()[2:]
    )
    assert cli.main(["show", str(synthetic_log), "-r", "req-b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["request"] == "req-b" and doc["damage"] is None
    assert [r["event"] for r in doc["rows"]] == [
        r.event for r in replay.show(synthetic_log, "req-b")
    ]
    assert cli.main(["show", str(synthetic_log), "-r", "nope"]) == 2
    assert "no request 'nope'" in capsys.readouterr().err


def test_stats_command(synthetic_log: Path, capsys) -> None:
    assert cli.main(["stats", str(synthetic_log)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^events\s+\d+ \(", out, re.M)
    assert "accepted_equals_answer" in out
    assert cli.main(["stats", str(synthetic_log), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["events"] == replay.stats(synthetic_log).events
    assert doc["violations"] == {"accepted_equals_answer": 1}
    assert doc["first_lookup"]["hit_rate"] == pytest.approx(32 / 170)


def test_commands_warn_about_damage_on_stderr(synthetic_log: Path, tmp_path: Path, capsys) -> None:
    torn = truncated_copy(synthetic_log, tmp_path / "torn.kvlog", 5)
    assert cli.main(["stats", str(torn)]) == 2  # shown, but not read to its end
    captured = capsys.readouterr()
    assert "read stopped early" in captured.err and "torn_tail" in captured.err
    assert str(torn) in captured.err
    assert re.search(r"^damage\s+.*torn_tail", captured.out, re.M)
    assert cli.main(["show", str(torn), "-r", "req-b", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["damage"]["kind"] == "torn_tail"


def test_rich_tables_on_a_terminal(synthetic_log: Path) -> None:
    pytest.importorskip("rich")
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    out = Output(stream)
    assert out.console is not None
    out.table(["a", "b"], [[1, 2]], title="t")
    assert "┃" in stream.getvalue() or "│" in stream.getvalue()


# --- vLLM's real scheduler -------------------------------------------------------------------


@pytest.mark.vllm
def test_real_log_stats_and_show(real_logs: dict[str, Path]) -> None:
    st = replay.stats(real_logs["base"])
    events = [e for f in LogReader(real_logs["base"]) for e in f.events]
    assert st.events == len(events) and st.damage is None
    assert st.requests == 6 and st.finished == 6  # 4 requests + 2 repeated prompts
    assert st.preemptions >= 1
    assert st.config["chunk_size"] == 32
    preempted = next(e.req_id for e in events if isinstance(e, ev.Preempted))
    life = replay.show(real_logs["base"], preempted)
    assert any(r.preempted for r in life)
    readmit = [
        r for r in life if r.event == "Scheduled" and r.detail.split()[0] in ("NEW", "RESUMED")
    ]
    assert len(readmit) == 2
    allocated = [r for r in life if r.event == "Allocated"][-1]
    assert readmit[1].block_ids == allocated.block_ids  # replaced on re-admission


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["base", "loads"])
def test_real_log_rows_follow_the_tracker(real_logs: dict[str, Path], name: str) -> None:
    log = segment_paths(real_logs[name])[0]
    assert any(isinstance(e, ev.StepDecoded) for f in LogReader(log) for e in f.events)
    assert assert_rows_match_a_tracker_replay(log) > 100


@pytest.mark.vllm
def test_real_log_with_loads_exports_and_draws(real_logs: dict[str, Path], tmp_path: Path) -> None:
    st = replay.stats(real_logs["loads"])
    assert st.tokens_loaded > 0
    out = replay.export(real_logs["loads"], tmp_path / "e.jsonl", table="events")
    assert out.rows == {"events": st.events}
    types = Counter(json.loads(line)["type"] for line in (tmp_path / "e.jsonl").open())
    assert types == Counter(st.events_by_type)
    result = replay.timeline(real_logs["loads"], tmp_path / "t.html", top=8)
    lanes = page_data((tmp_path / "t.html").read_text())["lanes"]
    assert len(lanes) == len(result.series) == min(8, st.requests)
    assert any(a["loaded"] for lane in lanes for a in lane["admissions"])
