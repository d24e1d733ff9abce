"""``kvledger tail``: follow a log while another writer appends to it (rotation included), a
line per step that did something; stop when the writer closes the log, or cleanly on Ctrl-C.
The command runs as its own process, as a user runs it; the writer is a thread here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from _replay_logs import copy_log

from kvledger.connector.logwriter import LogWriter
from kvledger.replay import cli
from kvledger.replay.logreader import LogReader
from kvledger.replay.tail import news
from kvledger.tracker import events as ev

ROOT = Path(__file__).resolve().parent.parent


def _truth(path: Path) -> dict[str, object]:
    """What the whole log says, counted from its events directly."""
    c: Counter[str] = Counter()
    violations = []
    for frame in LogReader(path):
        for e in frame.events:
            if isinstance(e, ev.LookupAnswered):
                c["lookups"] += 1
                c["hit_tokens"] += e.external
            elif isinstance(e, (ev.LoadPlanned, ev.SavePlanned)) and e.keys and e.end > e.start:
                c["loads" if isinstance(e, ev.LoadPlanned) else "saves"] += 1
            elif isinstance(e, ev.LoadDone):
                c["loads_done"] += 1
            elif isinstance(e, ev.SaveDone):
                c["chunks_saved"] += len(e.keys)
            elif isinstance(e, ev.ViolationRecorded):
                violations.append({"rule": e.rule, "request": e.req_id, "step": frame.step})
    return {**c, "violations": violations}


def _totals(lines: list[dict]) -> dict[str, object]:
    c: Counter[str] = Counter()
    violations = []
    for d in lines:
        for k in ("lookups", "hit_tokens", "loads", "saves", "loads_done", "chunks_saved"):
            c[k] += d[k]
        violations += [{**v, "step": d["step"]} for v in d["violations"]]
    return {**{k: v for k, v in c.items() if v}, "violations": violations}


def _as_a_terminals_job() -> None:
    # A command typed at a terminal has Ctrl-C at its default. pytest started in the background
    # (`make test &`, a CI runner's job) has SIGINT ignored, and an ignored signal stays ignored
    # across exec: Python then installs no KeyboardInterrupt handler, and the Ctrl-C below
    # never arrives (tail waited out the test's 30 s).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kvledger(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "replay", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_as_a_terminals_job,
        **kw,
    )


def test_once_reads_what_is_there(synthetic_log: Path, capsys) -> None:
    assert cli.main(["tail", str(synthetic_log), "--once", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    *steps, end = lines
    assert end == {
        "end": "closed",
        "steps": len(list(news(LogReader(synthetic_log)))),
        "log": str(synthetic_log),
    }
    assert _totals(steps) == _truth(synthetic_log)
    assert [v["rule"] for s in steps for v in s["violations"]] == ["accepted_equals_answer"]
    assert all(not _quiet(s) for s in steps)  # quiet steps only with --all
    assert cli.main(["tail", str(synthetic_log), "--once", "--all", "--json"]) == 0
    every = capsys.readouterr().out.splitlines()
    assert len(every) - 1 == end["steps"] > len(steps)
    assert cli.main(["tail", str(synthetic_log), "--once"]) == 0
    text = capsys.readouterr().out
    assert "step 7: lookups 2 (32 tokens offered), loads 1 (32 tokens), violations +1: " in text
    assert "accepted_equals_answer req-d" in text and text.endswith("steps\n")


def _quiet(d: dict) -> bool:
    return not any(d[k] for k in d if k != "step")


def test_follows_a_log_being_written_across_segments(synthetic_log: Path, tmp_path: Path) -> None:
    """tail starts before the log exists, reads each step as it is written, follows rotation,
    and stops by itself when the writer closes the log."""
    live = tmp_path / "live"
    live.mkdir()
    proc = _kvledger("tail", str(live), "--json", "--interval", "0.02")
    writer = threading.Thread(
        target=copy_log,
        args=(synthetic_log, live / "kvledger-run.kvlog"),
        kwargs={"rotate_bytes": 500, "pause": 0.05},
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith(f"kvledger: waiting for a log in {live}")
    writer.start()
    writer.join()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "following" in err
    segments = sorted(live.iterdir())
    assert len(segments) > 2  # rotated while tail read it
    *steps, end = [json.loads(x) for x in out.splitlines()]
    assert end["end"] == "closed" and end["log"] == str(live / "kvledger-run.kvlog")
    assert _totals(steps) == _truth(synthetic_log)
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})  # each step once


def test_ctrl_c_stops_cleanly(synthetic_log: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    copy_log(synthetic_log, live / "kvledger-run.kvlog", rotate_bytes=500, close=False)
    proc = _kvledger("tail", str(live), "--interval", "0.05")
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline()]  # it is reading
    while not lines[-1].startswith("step 8: "):  # the last step with news
        assert lines[-1], f"tail stopped early: {lines} {proc.stderr.read()}"
        lines.append(proc.stdout.readline())
    time.sleep(0.3)  # idle: the writer is alive and silent
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    out, err = proc.stdout.read(), proc.stderr.read()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert lines[0].startswith("step 0: ")
    assert out == "end: interrupted after 11 steps\n"


def test_damage_and_missing_logs_are_exit_2(synthetic_log: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["tail", str(tmp_path / "nope"), "--once"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["tail", str(empty), "--once", "--json"]) == 2
    captured = capsys.readouterr()
    assert "no kvledger log" in captured.err
    assert json.loads(captured.out.splitlines()[-1])["end"] == "no_log"
    # A frame damaged in the middle: what comes before it is shown, then exit 2.
    data = bytearray(synthetic_log.read_bytes())
    frames = list(LogReader(synthetic_log))
    middle = frames[len(frames) // 2]
    data[middle.offset + 14] ^= 0xFF  # inside its payload
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes(bytes(data))
    assert cli.main(["tail", str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    *steps, end = [json.loads(x) for x in captured.out.splitlines()]
    assert end["end"] == "damage" and steps and steps[-1]["step"] < middle.step
    assert "checksum mismatch" in captured.err


# --- tail refuses what check refuses ----------------------------------------------------------


def _steps_log(path: Path, steps: list[int]) -> None:
    """A log whose frames are at ``steps``, in that order (seq stays dense: what a splice of
    two runs, or a forger, writes); one lookup answer per step."""
    with LogWriter(path, {"block_size": 16}, fsync="never", rotate_bytes=None) as w:
        for step in steps:
            w.append(ev.LookupAnswered(step, f"req-{step}", 16, 16))
            w.end_step(step)


def _bytes_swapped(path: Path) -> None:
    """A clean log with the bytes of two neighbouring frames swapped (each frame intact)."""
    _steps_log(path, list(range(12)))
    frames = list(LogReader(path))
    a, b, c = frames[5].offset, frames[6].offset, frames[7].offset
    data = path.read_bytes()
    path.write_bytes(data[:a] + data[b:c] + data[a:b] + data[c:])


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: _steps_log(p, [*range(21), *range(10, 21)]), id="0-20 then 10-20"),
        pytest.param(lambda p: _steps_log(p, [0, 1, 2, 3, 4, 6, 5, 7, 8]), id="two frames swapped"),
        pytest.param(_bytes_swapped, id="two frames' bytes swapped"),
    ],
)
def test_tail_refuses_a_spliced_log_where_check_does(tmp_path: Path, make, capsys) -> None:
    """The follower judges frames with the reader's validator: the same steps before the
    damage, and the same damage (file, offset, reason), whatever the splice."""
    path = tmp_path / "spliced.kvlog"
    make(path)
    reader = LogReader(path)
    good = list(reader)
    assert reader.stop is not None and reader.stop.kind == "corrupt"
    assert cli.main(["check", str(path), "--json"]) == 2
    stop = json.loads(capsys.readouterr().out)["stop"]
    assert (stop["offset"], stop["reason"]) == (reader.stop.offset, reader.stop.reason)
    assert cli.main(["tail", str(path), "--once", "--all", "--json"]) == 2
    captured = capsys.readouterr()
    *lines, end = [json.loads(x) for x in captured.out.splitlines()]
    assert end["end"] == "damage"
    assert [d["step"] for d in lines] == [f.step for f in good]  # nothing after the splice
    assert f"offset {stop['offset']}: corrupt: {stop['reason']}" in captured.err
