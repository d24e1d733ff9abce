"""The background writer: the scheduler thread never waits for the disk. A slow or hung disk
costs dropped steps, each gap recorded in the log as a fact, never a stalled engine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_log import many_steps, write_log

from kvledger.connector import logwriter
from kvledger.connector.logwriter import LogWriteError, LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.framing import Frame


def _frames(path: Path) -> tuple[list[Frame], LogReader]:
    reader = LogReader(path)
    return list(reader), reader


def test_the_background_writer_writes_the_same_log(tmp_path: Path) -> None:
    steps = many_steps(200)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    direct = write_log(tmp_path / "a" / "run.kvlog", steps, rotate_bytes=3000)
    queued = write_log(tmp_path / "b" / "run.kvlog", steps, rotate_bytes=3000, background=True)
    assert len(direct.paths) == len(queued.paths) > 3
    a, ra = _frames(tmp_path / "a")
    b, rb = _frames(tmp_path / "b")
    assert [(f.seq, f.step, f.events) for f in a] == [(f.seq, f.step, f.events) for f in b]
    assert ra.stop is rb.stop is None and ra.ending == rb.ending == "closed"
    assert queued.lost_frames == 0 and rb.gaps == []


class _HungDisk:
    """Makes the background thread's writes wait until released: a disk that hangs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.writes_started = threading.Event()
        real = logwriter._BackgroundOutput._do

        def slow(out: Any, op: str, arg: Any) -> None:
            # (the first header is written at startup, on the caller's thread)
            if op == "write" and threading.current_thread().name == "kvledger-log":
                self.writes_started.set()
                self.release.wait(60)
            real(out, op, arg)

        monkeypatch.setattr(logwriter._BackgroundOutput, "_do", slow)


def _run_steps(w: LogWriter, steps: range, per_step: int = 20) -> None:
    for step in steps:
        for i in range(per_step):
            w.append(ev.Scheduled(step, f"r{i}", step, 1, step, (step * 31 + i,)))
        w.end_step(step)


def test_a_hung_disk_drops_steps_and_records_the_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _HungDisk(monkeypatch)
    path = tmp_path / "run.kvlog"
    w = LogWriter(path, {}, background=True, max_queue_bytes=20_000, fsync="never")
    done = threading.Event()

    def engine() -> None:  # the scheduler thread: it must get through every step
        _run_steps(w, range(0, 300))
        done.set()

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "the scheduler thread blocked on the log"
    assert disk.writes_started.wait(5)  # (the thread wakes on its own within 50 ms)
    assert w.lost_frames > 0
    disk.release.set()  # the disk comes back: later steps are written again
    _run_steps(w, range(300, 310))
    w.close()
    frames, reader = _frames(path)
    assert reader.stop is None and reader.ending == "closed"
    assert [f.seq for f in frames] == list(range(len(frames)))  # no seq hole
    (gap,) = reader.gaps
    assert gap["frames"] == w.lost_frames and gap["records"] == 20 * gap["frames"]
    written = {f.step for f in frames}
    lost = set(range(gap["first_step"], gap["last_step"] + 1))
    assert written.isdisjoint(lost) and written | lost == set(range(310))
    assert {e.req_id for f in frames for e in f.events} == {f"r{i}" for i in range(20)}


def test_close_on_a_hung_disk_gives_up_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _HungDisk(monkeypatch)
    monkeypatch.setattr(logwriter, "CLOSE_TIMEOUT_S", 0.2)
    w = LogWriter(tmp_path / "run.kvlog", {}, background=True, fsync="never")
    _run_steps(w, range(3))
    with pytest.raises(LogWriteError, match=r"did not finish writing .* is the disk hung"):
        w.close()
    disk.release.set()


def test_steps_handed_over_while_the_thread_frames_wait_for_its_next_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread writes what was handed over when it woke. Here the scheduler hands over a
    step each time the thread frames one, as where the two share the CPU and the GIL and the
    thread frames no faster than the scheduler steps: a thread that went on framing what kept
    coming would write nothing until the scheduler paused, and a crash would lose all of it,
    and ``tail`` would show none of it."""
    framed, handed = threading.Semaphore(0), threading.Semaphore(0)
    lockstep = threading.Event()
    lockstep.set()
    since_write: list[int] = [0]
    writes: list[int] = []  # frames per write
    real_frame, real_do = logwriter._BackgroundOutput._frame, logwriter._BackgroundOutput._do

    def frame(out: Any, *args: Any) -> Any:
        if lockstep.is_set():
            framed.release()
            handed.acquire(timeout=10)
        since_write[0] += 1
        return real_frame(out, *args)

    def do(out: Any, op: str, arg: Any) -> None:
        if op == "write" and threading.current_thread().name == "kvledger-log":
            writes.append(since_write[0])
            since_write[0] = 0
        real_do(out, op, arg)

    monkeypatch.setattr(logwriter._BackgroundOutput, "_frame", frame)
    monkeypatch.setattr(logwriter._BackgroundOutput, "_do", do)
    path = tmp_path / "run.kvlog"
    w = LogWriter(path, {}, background=True, fsync="never")
    _run_steps(w, range(5), per_step=2)  # handed over before the thread's first round
    for step in range(5, 200):
        assert framed.acquire(timeout=10), "the thread stopped framing"
        _run_steps(w, range(step, step + 1), per_step=2)
        handed.release()
    lockstep.clear()
    handed.release()
    w.close()
    # Every write held at most the 5 steps there were when its round began.
    assert sum(writes) == 200 and max(writes) <= 5, writes
    frames, reader = _frames(path)
    assert [f.step for f in frames] == list(range(200)) and reader.ending == "closed"


def test_a_seal_while_the_thread_opens_the_next_segment_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal's seal that comes while the log's thread opens a new segment waits for
    the open, then seals the new segment. The rotation's operations are off the queue by
    then and every byte handed over is written, so the thread looked idle: the seal went on
    with the file the thread was replacing, and failed (an AssertionError out of ``seal``;
    found by a review, 2026-12-04)."""
    opening, release = threading.Event(), threading.Event()
    real_do = logwriter._BackgroundOutput._do

    def do(out: Any, op: str, arg: Any) -> None:
        if op == "open" and threading.current_thread().name == "kvledger-log":
            opening.set()
            release.wait(10)
        real_do(out, op, arg)

    monkeypatch.setattr(logwriter._BackgroundOutput, "_do", do)
    w = LogWriter(tmp_path / "run.kvlog", {}, background=True, rotate_bytes=2000, fsync="never")
    step = 0
    while not w._rotate_due:  # the segment is full: the next frame rotates first
        _run_steps(w, range(step, step + 1), per_step=4)
        step += 1
    w.append(ev.Scheduled(step, "r0", step, 1, step, (step,)))  # the next frame begins
    assert opening.wait(10), "no rotation"
    sealed: list[bool] = []
    sealing = threading.Thread(target=lambda: sealed.append(w.seal("SIGINT")))
    sealing.start()
    sealing.join(0.3)  # the seal waits for the open, however long the disk takes
    release.set()
    sealing.join(10)
    assert sealed == [True]
    w.close()
    frames, reader = _frames(tmp_path)
    assert len(w.paths) == 2 and reader.stop is None and reader.ending == "closed"
    assert [f.step for f in frames] == list(range(step + 1)) and reader.gaps == []
    assert frames[-1].path == str(w.paths[1])  # the sealed step, in the new segment
