"""A log never lies about being whole: an end record tells a closed log from one that ended
early; segments know their place; a zero-filled tail is a torn tail; one frame's decoding
cost is bounded before it is decoded."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from _memory import peak_memory, traced_peak
from test_log import frame_spans, frame_with, header_bytes, many_steps, write_log

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker import framing


def _read(source: object) -> tuple[list[framing.Frame], LogReader]:
    reader = LogReader(source)  # type: ignore[arg-type]
    return list(reader), reader


def test_no_truncation_of_a_closed_log_reads_as_complete(tmp_path: Path) -> None:
    full = write_log(tmp_path / "run.kvlog", many_steps(12)).paths[0].read_bytes()
    frames, reader = _read(tmp_path / "run.kvlog")
    assert reader.stop is None and reader.ending == "closed" and len(frames) == 12
    cut = tmp_path / "cut.kvlog"
    boundaries = {end for _, end in frame_spans(full)}
    complete = []
    for n in range(framing.PREAMBLE_SIZE, len(full)):
        cut.write_bytes(full[:n])
        got, r = _read(cut)
        if r.stop is None and r.ending == "closed":
            complete.append(n)
        if n in boundaries and n > frame_spans(full)[0][1]:
            # a cut at a frame boundary reads cleanly, as a log whose writer is still going
            assert r.stop is None and r.ending == "open" and r.last_step == got[-1].step
    assert complete == []


def test_a_log_still_being_written_reads_to_its_last_step(tmp_path: Path) -> None:
    w = LogWriter(tmp_path / "live.kvlog", {}, fsync="never")
    for step in range(3):
        w.append(ev.Preempted(step, "a"))
        w.end_step(step)
    frames, reader = _read(tmp_path / "live.kvlog")  # not closed yet
    assert [f.step for f in frames] == [0, 1, 2]
    assert reader.stop is None and reader.ending == "open" and reader.last_step == 2
    w.close()
    _, reader = _read(tmp_path / "live.kvlog")
    assert reader.ending == "closed"
    assert "died after step 2" in framing.ENDINGS["open"].format(last_step=2)


def test_a_log_without_its_first_segments_says_so(tmp_path: Path) -> None:
    w = write_log(tmp_path / "run.kvlog", many_steps(60), rotate_bytes=1500)
    assert len(w.paths) >= 4
    w.paths[0].unlink()
    frames, reader = _read(tmp_path)
    assert reader.missing_start == 1 and reader.stop is None and reader.ending == "closed"
    assert frames and frames[0].seq > 0  # read from where the log now starts
    # a later segment deleted: the chain breaks where it was
    w.paths[2].unlink()
    _, reader = _read(tmp_path)
    assert reader.stop is not None and "segment 3 follows segment 1" in reader.stop.reason


def test_the_first_frame_of_a_log_is_seq_0(tmp_path: Path) -> None:
    for first in (5, -1):
        path = tmp_path / f"x{first}.kvlog"
        path.write_bytes(header_bytes() + frame_with(msgpack.packb([first, 0, 0, [[5, "a"]]])))
        frames, reader = _read(path)
        assert frames == [] and reader.stop is not None
        assert f"frame seq {first} where 0 was due" in reader.stop.reason


@pytest.mark.parametrize("zeros", [1, 8, 4096, 100_000])
def test_a_zero_filled_tail_is_a_torn_tail(tmp_path: Path, zeros: int) -> None:
    # What a file system leaves after a power loss: blocks allocated, never written.
    data = write_log(tmp_path / "run.kvlog", many_steps(5)).paths[0].read_bytes()
    spans = frame_spans(data)
    for keep in (spans[-2][1], spans[-2][1] + 8):  # after a frame; after a length that landed
        path = tmp_path / f"zeros{keep}.kvlog"
        path.write_bytes(data[:keep] + b"\0" * zeros)
        frames, reader = _read(path)
        assert len(frames) == 5 or keep != spans[-2][1]
        stop = reader.stop
        assert stop is not None and stop.kind == "torn_tail", stop
        assert stop.offset == spans[-2][1]
        assert "zero-filled tail" in stop.reason or zeros < 4096  # (too short to tell)
    # zeros with anything else after them are corruption, not a torn tail
    path = tmp_path / "zeros-then-data.kvlog"
    path.write_bytes(data[: spans[-2][1]] + b"\0" * 8 + b"x")
    _, reader = _read(path)
    assert reader.stop is not None and reader.stop.kind == "corrupt"


def test_a_frame_announcing_too_many_records_is_refused_before_decoding(tmp_path: Path) -> None:
    n = framing.MAX_FRAME_RECORDS + 1
    payload = msgpack.packb([0, 0, 0, [[5, 0]] * n])
    path = tmp_path / "many.kvlog"
    path.write_bytes(header_bytes() + frame_with(payload))
    with traced_peak() as traced:
        frames, reader = _read(path)
    peak = traced.bytes
    assert frames == [] and reader.stop is not None and reader.stop.kind == "corrupt"
    assert f"frame announces {n} records, over {framing.MAX_FRAME_RECORDS}" in reader.stop.reason
    assert peak < 4 * len(payload) + (1 << 20), peak  # the bytes read, nothing decoded


def test_the_writer_splits_a_step_over_the_record_bound(tmp_path: Path) -> None:
    events = tuple(ev.Preempted(3, f"r{i % 7}") for i in range(framing.MAX_FRAME_RECORDS + 5))
    write_log(tmp_path / "big.kvlog", [(3, events)])
    frames, reader = _read(tmp_path / "big.kvlog")
    assert reader.stop is None and [len(f.events) for f in frames] == [
        framing.MAX_FRAME_RECORDS // 2 + 2,
        framing.MAX_FRAME_RECORDS // 2 + 3,
    ]
    assert tuple(e for f in frames for e in f.events) == events


@pytest.mark.parametrize("kind", ["tiny records", "one big array"])
def test_what_reading_the_largest_frame_costs(tmp_path: Path, kind: str) -> None:
    """The bound docs/log-format.md states ("What reading costs"), measured on the worst
    shapes a frame of the largest size may take."""
    limit = framing.DEFAULT_MAX_FRAME_BYTES
    if kind == "tiny records":  # as many records as a frame may hold, each a new request
        records = [[5, f"{i:x}"] for i in range(framing.MAX_FRAME_RECORDS)]
    else:  # one prompt of 3-byte ids filling the frame (every id a separate int object)
        records = [[1, "r", [300 + i % 65000 for i in range((limit - 64) // 3)]]]
    payload = msgpack.packb([0, 0, 0, records])
    assert len(payload) <= limit
    path = tmp_path / "big.kvlog"
    path.write_bytes(header_bytes() + frame_with(payload))
    del records
    with peak_memory() as memory:  # the resident set's high-water mark (tests/_memory.py)
        reader = LogReader(path, max_frame_bytes=limit)
        count = sum(len(f.events) for f in reader)
    assert reader.stop is None and count >= 1
    assert memory.bytes <= 21 * limit, f"{memory.bytes / len(payload):.1f}x the payload"


def test_steps_never_go_backwards_or_below_zero(tmp_path: Path) -> None:
    for steps, reason in (([0, 2, 1], "frame step 1 after step 2"), ([-3], "frame step -3")):
        payloads = [msgpack.packb([i, s, 0, [[5, f"r{i}"]]]) for i, s in enumerate(steps)]
        path = tmp_path / f"steps{len(steps)}.kvlog"
        path.write_bytes(header_bytes() + b"".join(frame_with(p) for p in payloads))
        frames, reader = _read(path)
        assert len(frames) == len(steps) - 1
        assert reader.stop is not None and reader.stop.kind == "corrupt"
        assert reason in reader.stop.reason
    # a step spread over several frames is fine
    path = tmp_path / "same.kvlog"
    path.write_bytes(
        header_bytes()
        + b"".join(frame_with(msgpack.packb([i, 4, 0, [[5, f"r{i}"]]])) for i in range(3))
    )
    frames, reader = _read(path)
    assert reader.stop is None and [f.step for f in frames] == [4, 4, 4]
