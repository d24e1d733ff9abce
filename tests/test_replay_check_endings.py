"""``kvledger check`` never calls an incomplete log clean: a log that ended without closing,
a log with steps its writer dropped, and a log missing its start are each named for what they
are, with their own exit status (docs/debugging.md, "Exit status")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from _logfiles import step_frames_end
from test_log_background import _HungDisk
from test_replay_check import CONFIG, drive, write_log

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import check
from kvledger.tracker.tracker import Tracker


def test_a_closed_log_is_clean_and_complete(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path)
    result = check(path)
    assert result.exit_code == 0 and result.ending == "closed" and result.incomplete is None


def test_a_log_cut_at_a_frame_boundary_is_incomplete(tmp_path: Path, capsys: Any) -> None:
    full = tmp_path / "run.kvlog"
    write_log(full)
    data = full.read_bytes()
    cut = tmp_path / "cut.kvlog"
    cut.write_bytes(data[: step_frames_end(data)])  # every step, no end record
    result = check(cut)
    assert result.exit_code == 3 and result.problems == [] and result.stop is None
    assert result.ending == "open" and result.incomplete is not None
    assert "still writing it, or died after step" in result.incomplete
    assert result.counts["events"] == check(full).counts["events"]
    assert main(["check", str(cut)]) == 3
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "(exit 3)" in out


def test_a_log_of_a_running_engine_reads_to_its_last_step(tmp_path: Path) -> None:
    path = tmp_path / "live.kvlog"
    t = Tracker(CONFIG, log=LogWriter(path, {**CONFIG.to_dict()}, fsync="never"))
    drive(t, 3)
    result = check(path)  # the writer is still open
    assert result.exit_code == 3 and result.problems == []
    assert f"died after step {t.step - 1}" in (result.incomplete or "")
    t.close()
    assert check(path).exit_code == 0


def _behind(path: Path, disk: _HungDisk) -> tuple[LogWriter, Tracker]:
    """Eight steps driven while the disk hangs (steps dropped), then the disk comes back."""
    writer = LogWriter(path, CONFIG.to_dict(), background=True, max_queue_bytes=3000)
    t = Tracker(CONFIG, log=writer)
    drive(t, 8)
    assert writer.lost_frames > 0
    disk.release.set()
    return writer, t


def test_steps_the_writer_dropped_end_the_check_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.kvlog"
    writer, t = _behind(path, _HungDisk(monkeypatch))
    _drained(writer)  # the disk caught up: what follows is written after the gap
    drive(t, 2, start=8)
    t.close()
    result = check(path)
    assert result.exit_code == 3 and result.problems == []
    assert result.incomplete is not None and "were not recorded (the disk fell behind" in (
        result.incomplete
    )


def _drained(writer: LogWriter, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not writer._out.room(writer._out.max_bytes):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the log thread never caught up"
        time.sleep(0.005)


def test_steps_dropped_at_the_very_end_are_said_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss record is the log's last word (the disk came back only for the close): the
    run's last steps are missing, and the check says so."""
    path = tmp_path / "run.kvlog"
    _, t = _behind(path, _HungDisk(monkeypatch))
    t.close()
    reader = LogReader(path)
    last = [f.step for f in reader][-1]
    assert reader.gaps and reader.gaps[-1]["first_step"] > last  # nothing after the loss
    result = check(path)
    assert result.exit_code == 3 and result.problems == []
    assert result.incomplete is not None and "were not recorded (the disk fell behind" in (
        result.incomplete
    )


def test_a_log_missing_its_start_says_so_and_invents_no_problem(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    writer = LogWriter(path, {**CONFIG.to_dict()}, rotate_bytes=2000, fsync="never")
    t = Tracker(CONFIG, log=writer)
    drive(t, 8)
    t.close()
    assert len(writer.paths) >= 3
    writer.paths[0].unlink()
    result = check(tmp_path)
    assert result.exit_code == 2 and result.problems == []
    assert result.error is not None and "the log starts at segment 1" in result.error
    assert main(["check", str(tmp_path)]) == 2
