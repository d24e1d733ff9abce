"""A sealed log is complete on disk at every moment between two writes: an engine asked to stop
may be killed at once, and what it recorded until then reads as a whole, closed log
(connector/stopping.py seals it when a stop signal arrives)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev


def snapshot(path: Path, tmp: Path) -> tuple[list[list[ev.Event]], LogReader]:
    """What a reader finds if the process were killed now: a copy of the file's bytes."""
    copy = tmp / "killed-now.kvlog"
    copy.write_bytes(path.read_bytes())
    reader = LogReader(copy)
    frames = [list(f.events) for f in reader]
    copy.unlink()
    return frames, reader


def events_of(frames: list[list[ev.Event]]) -> list[ev.Event]:
    return [e for events in frames for e in events]


def test_sealing_writes_what_is_pending_and_ends_the_file(tmp_path: Path) -> None:
    """The step in progress (events not ended yet) is written too, and the file reads as
    closed, naming the stop; the writer is not closed."""
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never")
    w.append(ev.Preempted(0, "a"))
    w.end_step(0)
    w.append(ev.Preempted(1, "b"))  # step 1 is still being recorded
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.ending == "open" and len(frames) == 1
    assert w.seal("SIGINT")
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.stop is None and reader.ending == "closed"
    assert [e.req_id for e in events_of(frames)] == ["a", "b"]
    assert not w.closed and w.stop == "SIGINT"


def test_a_sealed_log_stays_complete_while_the_engine_drains(tmp_path: Path) -> None:
    """Events after the seal (the steps a draining engine still runs, the aborts) are written
    over the end record with a new one: after each write the file is whole, and a step may
    span the frame written at the seal and the next."""
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never")
    w.append(ev.Preempted(0, "a"))
    w.seal("SIGTERM")
    expected = ["a"]
    for step, rid in [(0, "b"), (1, "c"), (1, "d"), (2, "e")]:
        w.append(ev.Preempted(step, rid))
        w.end_step(step)
        expected.append(rid)
        frames, reader = snapshot(w.path, tmp_path)
        assert reader.stop is None and reader.ending == "closed", reader.stop
        assert [e.req_id for e in events_of(frames)] == expected
    w.close()
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.ending == "closed" and [e.req_id for e in events_of(frames)] == expected


def test_the_background_writers_queue_is_on_disk_before_the_end_record(tmp_path: Path) -> None:
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never", background=True)
    for step in range(200):
        w.append(ev.Preempted(step, f"r{step}"))
        w.end_step(step)
    assert w.seal("SIGINT")  # at once after the last step: the queue still holds frames
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.ending == "closed" and len(frames) == 200
    w.append(ev.Preempted(200, "late"))
    w.end_step(200)
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.ending == "closed" and len(frames) == 201
    w.close()


def test_the_end_record_names_the_stop(tmp_path: Path) -> None:
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never")
    w.append(ev.Preempted(0, "a"))
    w.seal("SIGINT")
    w.close()
    reader = LogReader(w.path)
    list(reader)
    assert reader.end is not None and reader.end["stop"] == "SIGINT"
    assert reader.end["frames"] == 1 and reader.end["last_step"] == 0


def test_a_closed_writer_cannot_be_sealed(tmp_path: Path) -> None:
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never")
    w.close()
    size = w.path.stat().st_size
    assert not w.seal("SIGINT")
    assert w.path.stat().st_size == size


def test_a_sealed_log_is_not_rotated(tmp_path: Path) -> None:
    """Rotation would leave the sealed segment behind: a sealed log keeps one file."""
    w = LogWriter(tmp_path / "run.kvlog", {}, fsync="never", rotate_bytes=300)
    w.seal("SIGINT")
    for step in range(30):
        w.append(ev.Preempted(step, f"r{step}"))
        w.end_step(step)
    w.close()
    assert len(w.paths) == 1
    frames, reader = snapshot(w.path, tmp_path)
    assert reader.ending == "closed" and len(frames) == 30


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    seal_at=st.integers(0, 12),
    background=st.booleans(),
)
def test_after_a_seal_every_write_leaves_a_complete_log_of_everything_written(
    tmp_path_factory: object, steps: list[int], seal_at: int, background: bool
) -> None:
    """For any history of events and step ends with a seal somewhere in it, the file read
    after every later operation is a closed log holding exactly the events appended so far."""
    tmp = tmp_path_factory.mktemp("seal")  # type: ignore[attr-defined]
    w = LogWriter(tmp / "run.kvlog", {}, fsync="never", background=background)
    appended: list[str] = []
    sealed = False
    for step, grow in enumerate(steps):
        if step == seal_at:
            assert w.seal("SIGINT")
            sealed = True
        for _ in range(grow):
            rid = f"r{len(appended)}"
            w.append(ev.Preempted(step, rid))
            appended.append(rid)
        w.end_step(step)
        if sealed:
            w.seal("SIGINT")  # what the hook does when a callback returns
            frames, reader = snapshot(w.path, tmp)
            assert reader.stop is None and reader.ending == "closed"
            assert [e.req_id for e in events_of(frames)] == appended
    w.close()
    frames, reader = snapshot(w.path, tmp)
    assert reader.ending == "closed" and [e.req_id for e in events_of(frames)] == appended


def test_check_says_how_a_sealed_log_ended(tmp_path: Path, capsys: object) -> None:
    """``kvledger check`` of a sealed log exits 0 and names the stop; of a log whose engine
    was killed before its first step, it says so in words."""
    from kvledger.replay.cli import main
    from kvledger.replay.replayer import check

    w = LogWriter(tmp_path / "run.kvlog", {"block_size": 16, "chunk_size": 32}, fsync="never")
    w.append(ev.RequestAdded(0, "a", (1, 2, 3)))
    w.seal("SIGTERM")
    result = check(w.path)
    assert result.exit_code == 0 and result.stopped_by == "SIGTERM"
    assert result.to_dict()["stopped_by"] == "SIGTERM"
    assert main(["check", str(w.path)]) == 0
    assert "ended     on SIGTERM: the log was sealed" in capsys.readouterr().out  # type: ignore[attr-defined]
    empty = LogWriter(tmp_path / "empty.kvlog", {"block_size": 16, "chunk_size": 32})
    result = check(empty.path)
    assert result.exit_code == 3 and result.stopped_by is None
    assert result.incomplete is not None and "before its first step" in result.incomplete
    empty.close()
