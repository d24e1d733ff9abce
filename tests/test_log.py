"""The log file (tracker/framing.py, connector/logwriter.py, replay/logreader.py): framing, header, rotation, torn tails, corruption, hostile input, crashes."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
from _memory import traced_peak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import any_event

from kvledger.connector import logwriter
from kvledger.connector.logwriter import LogWriteError, LogWriter
from kvledger.replay.logreader import LogReader, segment_paths
from kvledger.tracker import codec, framing
from kvledger.tracker import events as ev
from kvledger.tracker.framing import Frame, LogCorruptError, LogFormatError, StopInfo

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
FUNCTION_TMP = [HealthCheck.function_scoped_fixture]


# --- helpers ----------------------------------------------------------------------------------


def sample_steps() -> list[tuple[int, tuple[ev.Event, ...]]]:
    """A small run: every event type, interning, defaults, several frames."""
    a, b = "req-a", "req-b"
    return [
        (
            0,
            (
                ev.RequestAdded(0, a, (1, 2, 3, 4, 5), "salt"),
                ev.LookupAsked(0, a, 0, 5, 0, (1, 2, 3, 4, 5)),
                ev.LookupAnswered(0, a, 0, 0),
                ev.Allocated(0, a, (7, 8), 0),
            ),
        ),
        (
            1,
            (
                ev.Scheduled(1, a, 0, 5, 0, (1, 2, 3, 4, 5), (7, 8), ev.Admission.NEW),
                ev.SavePlanned(1, a, 0, 4, (b"k" * 16,), (3,)),
                ev.RequestAdded(1, b, (9,) * 40),
            ),
        ),
        (2, (ev.Scheduled(2, a, 5, 1, 5, (6,)), ev.SaveDone(2, a, (b"k" * 16,)))),
        (3, (ev.Preempted(3, a), ev.ChunkStored(3, "", b"x" * 16, 4, 256))),
        (
            4,
            (
                ev.LookupAsked(4, a, 0, 6, 6, (), True),
                ev.LoadPlanned(4, a, 0, 4, (b"k" * 16,), (3,)),
                ev.LoadFailed(4, a, (7,)),
            ),
        ),
        (5, (ev.LoadDone(5, a), ev.ChunkEvicted(5, "", b"x" * 16), ev.SaveFailed(5, b, ()))),
        (6, (ev.ViolationRecorded(6, a, "rule", "Scheduled", "x=1"), ev.Finished(6, a, "abort"))),
        (7, (ev.Finished(7, b),)),
    ]


def write_log(
    path: Path, steps: list[tuple[int, tuple[ev.Event, ...]]], **kwargs: Any
) -> LogWriter:
    with LogWriter(path, {"block_size": 16, "chunk_size": 256}, **kwargs) as w:
        for step, events in steps:
            for e in events:
                w.append(e)
            w.end_step(step)
    return w


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """[start, end) of the header frame and every frame, parsed independently of the reader."""
    spans = []
    offset = framing.PREAMBLE_SIZE
    while offset < len(data):
        (n,) = struct.unpack_from("<I", data, offset)
        spans.append((offset, offset + 12 + n))
        offset += 12 + n
    assert offset == len(data)
    return spans


def read_all(source: Any, **kwargs: Any) -> tuple[list[Frame], LogReader]:
    reader = LogReader(source, **kwargs)
    return list(reader), reader


def as_steps(frames: list[Frame]) -> list[tuple[int, tuple[ev.Event, ...]]]:
    return [(f.step, f.events) for f in frames]


@pytest.fixture
def sample(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "sample.kvlog"
    write_log(path, sample_steps())
    return path, path.read_bytes()


def frame_with(payload: bytes) -> bytes:
    return framing.frame_bytes(payload)


def header_bytes(**changes: Any) -> bytes:
    header = {
        "format": "kvledger-log",
        "library_version": "test",
        "created_wall_ns": 0,
        "run_id": "r" * 32,
        "segment": 0,
        "prev_segment_digest": "",
        "config": {},
        "schemas": codec.schemas(),
        "transforms": codec.transforms(),
        **changes,
    }
    return b"KVLEDGER\x01\x00\x00\x00" + frame_with(msgpack.packb(header, use_bin_type=True))


# --- writing and reading --------------------------------------------------------------------


def test_round_trip_frames_header_offsets(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    frames, reader = read_all(path)
    assert reader.stop is None
    assert as_steps(frames) == sample_steps()
    assert [f.seq for f in frames] == list(range(len(frames)))
    spans = frame_spans(data)
    # header, the steps' frames, and the end record the writer's close adds
    assert [f.offset for f in frames] == [s for s, _ in spans[1:-1]]
    end = msgpack.unpackb(data[spans[-1][0] + 8 : spans[-1][1] - 4])
    assert end == {"end": "closed", "frames": len(frames), "last_step": frames[-1].step}
    assert reader.ending == "closed" and reader.last_step == frames[-1].step
    assert {f.path for f in frames} == {str(path)}
    assert data[:12] == b"KVLEDGER\x01\x00\x01\x00"  # format 1.1
    header = reader.header
    assert header is not None
    assert header["format"] == "kvledger-log"
    assert header["config"] == {"block_size": 16, "chunk_size": 256}
    assert header["schemas"] == codec.schemas()
    assert header["transforms"] == codec.transforms()
    assert header["defaults"] == codec.defaults()
    assert header["defaults"][ev.Scheduled.TAG]["admission"] == 0
    assert header["segment"] == 0 and header["prev_segment_digest"] == ""
    assert len(header["run_id"]) == 32 and int(header["run_id"], 16) >= 0
    assert header["library_version"]
    assert (header["major"], header["minor"]) == (1, 1)


def test_iter_raw_resolves_refs_and_keeps_wire_fields(sample: tuple[Path, bytes]) -> None:
    path, _ = sample
    reader = LogReader(path)
    raw = list(reader.iter_raw())
    assert reader.stop is None
    assert [len(f.records) for f in raw] == [len(e) for _, e in sample_steps()]
    assert raw[2].records[0] == [4, "req-a", 5, 1, 0, [6]]  # token_start as a delta
    assert raw[7].records == [[6, "req-b"]]  # trailing default dropped


@settings(max_examples=40, deadline=None, suppress_health_check=FUNCTION_TMP)
@given(data=st.data())
def test_random_runs_round_trip_across_segments(tmp_path_factory: Any, data: Any) -> None:
    steps = []
    for step in range(data.draw(st.integers(1, 12))):
        ids = st.sampled_from([f"r{i}" for i in range(6)] + [""])
        events = data.draw(st.lists(any_event(ids, step=step), max_size=6))
        steps.append((step, tuple(events)))
    rotate = data.draw(st.sampled_from([None, 200, 1000]))
    d = tmp_path_factory.mktemp("log")
    write_log(d / "run.kvlog", steps, rotate_bytes=rotate)
    frames, reader = read_all(d)
    assert reader.stop is None
    assert as_steps(frames) == [(s, e) for s, e in steps if e]


def test_end_step_writes_nothing_without_events_and_checks_the_step(tmp_path: Path) -> None:
    path = tmp_path / "x.kvlog"
    w = LogWriter(path, {})
    size = path.stat().st_size
    w.end_step(0)
    assert path.stat().st_size == size
    w.append(ev.Preempted(3, "a"))
    with pytest.raises(ValueError, match=r"end_step\(2\) but the pending events belong to step 3"):
        w.end_step(2)
    w.append(ev.Preempted(4, "a"))  # another step: the pending frame of step 3 goes first
    w.append(ev.Preempted(4, "b"))
    w.end_step(4)
    w.close()
    frames, reader = read_all(path)
    assert reader.stop is None
    assert as_steps(frames) == [
        (3, (ev.Preempted(3, "a"),)),
        (4, (ev.Preempted(4, "a"), ev.Preempted(4, "b"))),
    ]


def test_close_writes_pending_and_writing_after_close_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.kvlog"
    with LogWriter(path, {}) as w:
        w.append(ev.Preempted(1, "a"))
    assert w.closed
    w.close()  # idempotent
    with pytest.raises(LogWriteError, match="is closed"):
        w.append(ev.Preempted(2, "a"))
    with pytest.raises(LogWriteError, match="is closed"):
        w.end_step(2)
    frames, _ = read_all(path)
    assert as_steps(frames) == [(1, (ev.Preempted(1, "a"),))]


def test_writer_refuses_to_overwrite_and_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "x.kvlog"
    LogWriter(path, {}).close()
    with pytest.raises(FileExistsError, match="never overwritten"):
        LogWriter(path, {})
    with pytest.raises(TypeError, match="msgpack-serialisable"):
        LogWriter(tmp_path / "y.kvlog", {"f": object()})
    with pytest.raises(ValueError, match="fsync"):
        LogWriter(tmp_path / "z.kvlog", {}, fsync="sometimes")  # type: ignore[arg-type]


def test_unencodable_event_loses_only_its_record_and_keeps_the_log_consistent(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.kvlog"
    w = LogWriter(path, {})
    w.append(ev.Preempted(0, "a"))
    w.end_step(0)
    w.append(ev.Preempted(1, "a"))
    # beyond msgpack's integers, and the first sight of "new": its interning is undone
    with pytest.raises(codec.EncodeError, match="cannot encode a Scheduled of step 1"):
        w.append(ev.Scheduled(1, "new", 0, 1, 0, (2**70,)))
    w.append(ev.Preempted(1, "b"))
    w.end_step(1)
    w.append(ev.Preempted(2, "new"))
    w.append(ev.Preempted(2, "a"))
    w.end_step(2)
    w.close()
    frames, _ = read_all(path, strict=True)
    assert as_steps(frames) == [
        (0, (ev.Preempted(0, "a"),)),
        (1, (ev.Preempted(1, "a"), ev.Preempted(1, "b"))),
        (2, (ev.Preempted(2, "new"), ev.Preempted(2, "a"))),
    ]
    assert [f.seq for f in frames] == [0, 1, 2]

    class NotAnEvent:
        step = 3

    with pytest.raises(codec.EncodeError, match="not an event type"):
        LogWriter(tmp_path / "y.kvlog", {}).append(NotAnEvent())  # type: ignore[arg-type]


def test_a_step_bigger_than_max_frame_bytes_is_split(tmp_path: Path) -> None:
    path = tmp_path / "x.kvlog"
    events = tuple(ev.Scheduled(5, f"r{i}", 100, 1, 100, (i,)) for i in range(50))
    write_log(path, [(5, events)], max_frame_bytes=200)
    frames, reader = read_all(path, max_frame_bytes=200)
    assert reader.stop is None
    assert len(frames) > 1 and {f.step for f in frames} == {5}
    assert tuple(e for f in frames for e in f.events) == events
    w = LogWriter(tmp_path / "y.kvlog", {}, max_frame_bytes=200)
    w.append(ev.RequestAdded(1, "big", tuple(range(1000))))
    with pytest.raises(codec.EncodeError, match="over max_frame_bytes=200"):
        w.end_step(1)


# --- rotation -------------------------------------------------------------------------------


def many_steps(n: int, reqs: int = 4) -> list[tuple[int, tuple[ev.Event, ...]]]:
    return [
        (s, tuple(ev.Scheduled(s, f"r{r}", s, 1, s, (s * 7 + r,)) for r in range(reqs)))
        for s in range(n)
    ]


def test_rotation_segments_chain_and_read_back_in_order(tmp_path: Path) -> None:
    steps = many_steps(120)
    w = write_log(tmp_path / "run.kvlog", steps, rotate_bytes=1500)
    names = [p.name for p in w.paths]
    assert len(names) >= 4
    assert names[:3] == ["run.kvlog", "run.000001.kvlog", "run.000002.kvlog"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    frames, reader = read_all(tmp_path)
    assert reader.stop is None
    assert as_steps(frames) == steps
    assert [f.seq for f in frames] == list(range(len(steps)))
    assert list(LogReader(w.paths)) == frames
    prev_digest, run_ids = "", set()
    for i, p in enumerate(w.paths):
        header = LogReader(p).header
        assert header is not None
        assert header["segment"] == i
        assert header["prev_segment_digest"] == prev_digest
        run_ids.add(header["run_id"])
        prev_digest = hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
        # self-contained: every segment reads alone, interning restarted, and knows its place:
        # a later one lacks the log's start, an earlier one its continuation
        alone, r = read_all(p)
        assert alone and r.missing_start == (i or None)
        assert r.stop is None
        assert r.ending == ("closed" if p == w.paths[-1] else "rotated")
        first = next(LogReader(p).iter_raw())
        assert all(type(rec[1]) is str for rec in first.records)
    assert len(run_ids) == 1
    assert [f.path for f in frames][-1] == str(w.paths[-1])


def test_broken_segment_chain_stops(tmp_path: Path) -> None:
    w = write_log(tmp_path / "run.kvlog", many_steps(60), rotate_bytes=1500)
    p0, p1, p2 = w.paths[:3]
    # out of order
    frames, reader = read_all([p0, p2])
    assert reader.stop is not None and reader.stop.kind == "bad_header"
    assert "segment chain broken: segment 2 follows segment 0" in reader.stop.reason
    assert reader.stop.path == str(p2)
    assert frames == list(LogReader(p0))
    # a shortened previous segment (still valid on its own): its digest no longer matches
    data = p0.read_bytes()
    cut = frame_spans(data)[-2][1]
    short = tmp_path / "short.kvlog"
    short.write_bytes(data[:cut])
    frames, reader = read_all([short, p1])
    assert (
        reader.stop is not None
        and "segment 0 has no end record, yet more follow" in reader.stop.reason
    )
    # ... and one cut after its end record still fails the chain's digest
    spliced = tmp_path / "spliced.kvlog"
    spans = frame_spans(data)
    spliced.write_bytes(data[: spans[-2][0]] + data[spans[-1][0] :])  # a frame dropped
    frames, reader = read_all([spliced, p1])
    assert reader.stop is not None
    assert any(w in reader.stop.reason for w in ("prev_segment_digest", "frame seq"))
    # a foreign segment
    (tmp_path / "other").mkdir()
    other = write_log(tmp_path / "other" / "o.kvlog", many_steps(60), rotate_bytes=1500)
    _, reader = read_all([p0, other.paths[1]])
    assert reader.stop is not None and "run_id" in reader.stop.reason
    # a torn tail in a segment that is not the last is corruption
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(data[:-3])
    _, reader = read_all([torn, p1])
    assert reader.stop is not None and reader.stop.kind == "corrupt"
    assert "not the last" in reader.stop.reason


def test_directory_with_two_logs_is_refused(tmp_path: Path) -> None:
    write_log(tmp_path / "a.kvlog", many_steps(2))
    write_log(tmp_path / "b.kvlog", many_steps(2))
    with pytest.raises(ValueError, match="several logs"):
        LogReader(tmp_path)


# --- torn tails and corruption --------------------------------------------------------------


def check_prefix(
    data: bytes, reader_data: bytes, path: Path, damage_at: int | None, **kwargs: Any
) -> LogReader:
    """Read ``reader_data``: the frames yielded must be exactly the original frames that lie
    wholly before ``damage_at`` (None: all of them)."""
    path.write_bytes(reader_data)
    spans = frame_spans(data)
    expected = sample_steps()
    frames, reader = read_all(path, **kwargs)
    if damage_at is None:
        assert as_steps(frames) == expected
        return reader
    keep = sum(1 for _, end in spans[1:] if end <= damage_at)
    assert as_steps(frames) == expected[:keep]
    return reader


def test_truncation_at_every_offset(sample: tuple[Path, bytes], tmp_path: Path) -> None:
    _, data = sample
    spans = frame_spans(data)
    ends = {end for _, end in spans}
    header_end = spans[0][1]
    target = tmp_path / "cut.kvlog"
    for cut in range(len(data) + 1):
        reader = check_prefix(data, data[:cut], target, cut)
        stop = reader.stop
        if cut in ends:
            assert stop is None, cut
            continue
        assert stop is not None, cut
        assert stop.kind == "torn_tail", (cut, stop)
        assert stop.path == str(target)
        if cut < framing.PREAMBLE_SIZE:
            assert stop.offset == 0
        elif cut < header_end:
            assert stop.offset == framing.PREAMBLE_SIZE
        else:
            assert stop.offset == max(s for s, _ in spans if s <= cut), (cut, stop)
        with pytest.raises(LogCorruptError) as info:
            list(LogReader(target, strict=True))
        assert info.value.stop == stop


@settings(max_examples=300, deadline=None, suppress_health_check=FUNCTION_TMP)
@given(data=st.data())
def test_random_bit_flips_never_yield_a_damaged_frame(
    sample: tuple[Path, bytes], tmp_path: Path, data: Any
) -> None:
    _, original = sample
    nbits = len(original) * 8
    flips = data.draw(
        st.lists(st.integers(0, nbits - 1), min_size=1, max_size=4, unique=True), label="bits"
    )
    damaged = bytearray(original)
    for bit in flips:
        damaged[bit // 8] ^= 1 << (bit % 8)
    target = tmp_path / "flipped.kvlog"
    positions = sorted(bit // 8 for bit in flips)
    if positions[0] < 10:  # magic or major: not a (readable) kvledger log
        target.write_bytes(bytes(damaged))
        with pytest.raises(LogFormatError):
            list(LogReader(target))
        return
    relevant = [p for p in positions if p >= 12]  # the minor version is not checked
    first = relevant[0] if relevant else None
    reader = check_prefix(original, bytes(damaged), target, first)
    if first is None:
        assert reader.stop is None
        return
    spans = frame_spans(original)
    stop = reader.stop
    assert stop is not None  # CRC-32 catches every error of up to 3 bits in a frame
    assert stop.offset == max(s for s, _ in spans if s <= first)
    assert stop.kind == ("bad_header" if first < spans[0][1] else "corrupt")


@settings(max_examples=200, deadline=None, suppress_health_check=FUNCTION_TMP)
@given(blob=st.binary(max_size=300), prefix=st.sampled_from(["none", "preamble", "log"]))
def test_random_bytes_never_raise_anything_but_format_errors(
    sample: tuple[Path, bytes], tmp_path: Path, blob: bytes, prefix: str
) -> None:
    _, original = sample
    head = {"none": b"", "preamble": original[:12], "log": original}[prefix]
    target = tmp_path / "random.kvlog"
    target.write_bytes(head + blob)
    reader = LogReader(target)
    try:
        frames = list(reader)
        list(LogReader(target).iter_raw())
        _ = LogReader(target).header
    except LogFormatError:
        assert prefix == "none"
        return
    if prefix == "log":
        assert as_steps(frames)[: len(sample_steps())] == sample_steps()
    if blob and prefix != "log":
        assert reader.stop is not None


def test_a_length_claiming_gigabytes_stops_without_allocating(tmp_path: Path) -> None:
    target = tmp_path / "huge.kvlog"
    head = struct.pack("<I", 3 << 30)
    target.write_bytes(
        header_bytes() + head + struct.pack("<I", framing.masked_crc(head)) + b"\x00" * 100
    )
    with traced_peak() as traced:
        frames, reader = read_all(target)
    peak = traced.bytes
    assert frames == []
    assert reader.stop is not None and reader.stop.kind == "corrupt"
    assert f"frame length {3 << 30} exceeds max_frame_bytes" in reader.stop.reason
    assert peak < 8 << 20
    # under the limit but past the end of the file: a torn tail, still nothing allocated
    head = struct.pack("<I", 15 << 20)
    target.write_bytes(
        header_bytes() + head + struct.pack("<I", framing.masked_crc(head)) + b"\x00" * 100
    )
    with traced_peak() as traced:
        frames, reader = read_all(target)
    peak = traced.bytes
    assert reader.stop is not None and reader.stop.kind == "torn_tail"
    assert peak < 8 << 20


def _bomb_nested(n: int) -> bytes:
    # array32 headers, each claiming as many elements as the payload has bytes
    return (b"\xdd" + struct.pack(">I", n * 5)) * n


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x91" * 200_000 + b"\x00", "is not [seq, step, wall_ns, [records]]"),  # deep nesting
        (b"\xdd\xff\xff\xff\xff", "is not [seq, step, wall_ns, [records]]"),  # 4G-element array
        (_bomb_nested(100_000), "is not [seq, step, wall_ns, [records]]"),
        (b"\xdb\xff\xff\xff\xff", "undecodable frame payload"),  # 4 GB string header
        (b"\xc6\xff\xff\xff\xff", "undecodable frame payload"),  # 4 GB bin header
        (b"\x81\x00\x00", "undecodable end record"),  # a map: an end record
        (b"\xd4\x01\x00", "undecodable frame payload"),  # an ext type
        (b"\xd6\xff\x00\x00\x00\x00", "undecodable frame payload"),  # a timestamp ext
        (b"\x94\x00\x00\x00\x90\x00", "undecodable frame payload"),  # trailing bytes
        (msgpack.packb([1, 1]), "is not [seq, step, wall_ns, [records]]"),
        (msgpack.packb([1, 1, 2, [[99, "a"]]]), "tag 99 is not in the header's schema table"),
        (msgpack.packb([1, 1, 2, [[4, "a", "x", 1]]]), "Scheduled.num_computed: expected int"),
        (msgpack.packb([1, 1, 2, [[5, 3]]]), "req ref 3 not declared"),
        (msgpack.packb([1, 1, 2, [[5, "\udcff"]]], unicode_errors="surrogateescape"), "undecod"),
    ],
)
def test_hostile_payloads_with_valid_checksums_stop_cleanly(
    tmp_path: Path, payload: bytes, reason: str
) -> None:
    target = tmp_path / "bomb.kvlog"
    good = msgpack.packb([0, 0, 0, [[5, "ok"]]])
    target.write_bytes(header_bytes() + frame_with(good) + frame_with(payload))
    offset = len(header_bytes()) + len(frame_with(good))
    for raw in (False, True):
        with traced_peak() as traced:
            reader = LogReader(target)
            frames = list(reader.iter_raw() if raw else reader)
        peak = traced.bytes
        if raw and "Scheduled.num_computed" in reason:  # raw frames do not check field types
            assert len(frames) == 2 and reader.stop is None
            continue
        assert len(frames) == 1
        stop = reader.stop
        assert stop is not None and stop.kind == "corrupt"
        assert stop.offset == offset
        assert reason in stop.reason, stop
        # O(payload) plus, for deep nesting, msgpack's stack depth (1024) times its array
        # preallocation cap (about 80 KB): about 80 MB at most, whatever the frame size
        assert peak < 128 << 20, peak


def test_seq_gap_and_bad_headers(tmp_path: Path) -> None:
    target = tmp_path / "x.kvlog"
    frames_ = [msgpack.packb([s, s, 0, [[5, f"r{s}"]]]) for s in (0, 1, 3)]
    target.write_bytes(header_bytes() + b"".join(frame_with(p) for p in frames_))
    frames, reader = read_all(target)
    assert [f.seq for f in frames] == [0, 1]
    assert reader.stop is not None and "frame seq 3 where 2 was due" in reader.stop.reason
    for changes, message in [
        ({"format": "other"}, "header format is 'other'"),
        ({"schemas": []}, "header 'schemas' has type list"),
        ({"segment": True}, "header 'segment' has type bool"),
        ({"transforms": 3}, "'transforms' is not a map"),
        ({"schemas": {"4": ["Scheduled", 1, ["req_id"]]}}, "bad schema table"),
    ]:
        target.write_bytes(header_bytes(**changes) + frame_with(frames_[0]))
        frames, reader = read_all(target)
        assert frames == []
        assert reader.stop is not None and reader.stop.kind == "bad_header"
        assert message in reader.stop.reason, reader.stop
    target.write_bytes(header_bytes()[:12] + frame_with(b"\x93\x01\x02\x03"))
    reader = LogReader(target)
    assert reader.header is None
    assert reader.stop is not None and reader.stop.reason == "header is not a map"
    with pytest.raises(LogCorruptError, match="header is not a map"):
        _ = LogReader(target, strict=True).header
    header = {"library_version": "x"}
    target.write_bytes(b"KVLEDGER\x01\x00\x00\x00" + frame_with(msgpack.packb(header)))
    assert "header lacks 'format'" in read_all(target)[1].stop.reason  # type: ignore[union-attr]


def test_magic_and_versions(sample: tuple[Path, bytes], tmp_path: Path) -> None:
    _, data = sample
    target = tmp_path / "v.kvlog"
    target.write_bytes(data[:8] + struct.pack("<HH", 3, 1) + data[12:])
    with pytest.raises(LogFormatError) as info:
        list(LogReader(target))
    assert str(info.value) == (
        f"{target}: offset 8: written by a newer kvledger (format 3.x); this version reads 1.x"
    )
    with pytest.raises(LogFormatError, match="newer kvledger"):
        _ = LogReader(target).header
    target.write_bytes(data[:8] + struct.pack("<HH", 1, 7) + data[12:])  # a newer minor: read
    frames, reader = read_all(target)
    assert reader.stop is None and as_steps(frames) == sample_steps()
    assert reader.header is not None and reader.header["minor"] == 7
    target.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(LogFormatError, match=r"offset 0: not a kvledger log: expected magic"):
        list(LogReader(target, strict=True))
    target.write_bytes(b"")
    frames, reader = read_all(target)
    assert frames == [] and reader.stop == StopInfo(str(target), 0, "empty file", "torn_tail")


def test_strict_mode_raises_after_yielding_the_good_frames(
    sample: tuple[Path, bytes], tmp_path: Path
) -> None:
    _, data = sample
    spans = frame_spans(data)
    damaged = bytearray(data)
    damaged[spans[3][0] + 20] ^= 0x10
    target = tmp_path / "s.kvlog"
    target.write_bytes(bytes(damaged))
    seen = []
    with pytest.raises(LogCorruptError) as info:
        for frame in LogReader(target, strict=True):
            seen.append(frame)
    assert as_steps(seen) == sample_steps()[:2]
    assert info.value.stop.kind == "corrupt"
    assert info.value.stop.offset == spans[3][0]
    assert info.value.stop.reason == "frame payload checksum mismatch"


# --- durability -----------------------------------------------------------------------------


def test_fsync_error_is_logged_not_retried_and_fails_the_next_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(5, "Input/output error")

    w = LogWriter(tmp_path / "x.kvlog", {}, fsync="step")
    monkeypatch.setattr(logwriter.os, "fsync", failing_fsync)
    w.append(ev.Preempted(1, "a"))
    with caplog.at_level(logging.ERROR, logger="kvledger.log"):
        w.end_step(1)  # the frame is written and flushed; the fsync fails
    assert len(calls) == 1
    assert "fsync of" in caplog.text and "not retried" in caplog.text
    assert w.failed is not None
    with pytest.raises(LogWriteError, match=r"failed earlier: fsync of .* not retried"):
        w.append(ev.Preempted(2, "a"))
    w.close()  # already reported: no second error, no second fsync
    assert len(calls) == 1
    monkeypatch.undo()
    frames, reader = read_all(tmp_path / "x.kvlog")
    assert reader.stop is None and as_steps(frames) == [(1, (ev.Preempted(1, "a"),))]

    # on close: close reports it
    w = LogWriter(tmp_path / "y.kvlog", {})
    monkeypatch.setattr(logwriter.os, "fsync", failing_fsync)
    w.append(ev.Preempted(1, "a"))
    with pytest.raises(LogWriteError, match=r"fsync of .*y\.kvlog failed \(close\)"):
        w.close()
    monkeypatch.undo()

    # on rotation: the write that would open the next segment fails
    w = LogWriter(tmp_path / "z.kvlog", {}, rotate_bytes=10)
    monkeypatch.setattr(logwriter.os, "fsync", failing_fsync)
    w.append(ev.Preempted(1, "a"))
    w.end_step(1)
    with pytest.raises(LogWriteError, match=r"failed \(rotation\)"):
        w.append(ev.Preempted(2, "a"))
    assert len(w.paths) == 1
    w.close()


@pytest.mark.parametrize("background", [False, True])
def test_write_error_fails_the_writer(tmp_path: Path, background: bool) -> None:
    class Full:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    w = LogWriter(tmp_path / "x.kvlog", {}, background=background)
    out = w._out  # the file under the writer's output (direct, or its background thread's)
    out._file = Full(out._file)  # type: ignore[attr-defined]
    w.append(ev.Preempted(1, "a"))
    if background:  # the thread fails; the next step hears of it
        w.end_step(1)
        deadline = time.monotonic() + 10
        while out.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        with pytest.raises(LogWriteError, match="No space left"):
            w.end_step(1)
    with pytest.raises(LogWriteError, match="No space left" if background else "failed earlier"):
        w.append(ev.Preempted(2, "a"))
    w.close()


_CHILD = textwrap.dedent(
    """
    import sys
    from kvledger.tracker.events import ChunkStored, Scheduled
    from kvledger.connector.logwriter import LogWriter

    path, rotate, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w = LogWriter(path, {"block_size": 16}, rotate_bytes=rotate or None, fsync="never")
    key = b"k" * big
    step = 0
    while True:
        if big:  # a few MB per frame: the kill often lands inside the write
            w.append(ChunkStored(step, "", key, step))
        for r in range(300):
            w.append(Scheduled(step, f"req-{r}", step, 1, step, (step % 32000,)))
        w.end_step(step)
        print(step, flush=True)
        step += 1
    """
)


@pytest.mark.parametrize(
    ("rotate", "big"),
    [(0, 0), (20_000, 0), (0, 4 << 20)],
    ids=["one-file", "rotating", "big-frames"],
)
def test_sigkill_mid_run_loses_at_most_the_step_being_written(
    tmp_path: Path, rotate: int, big: int
) -> None:
    path = tmp_path / "run.kvlog"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(rotate), str(big)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    reported = -1
    for line in proc.stdout:
        reported = int(line)
        if reported >= (3 if big else 40):
            break
    time.sleep(random.random() * 0.05)
    os.kill(proc.pid, signal.SIGKILL)
    rest, _ = proc.communicate(timeout=30)
    for line in rest.splitlines():
        if line.strip().isdigit():
            reported = max(reported, int(line))  # complete lines only: printed after end_step
    assert proc.returncode == -signal.SIGKILL
    frames, reader = read_all(tmp_path)
    steps = [f.step for f in frames]
    assert steps == list(range(len(steps)))
    assert reported <= steps[-1] <= reported + 1
    assert all(len(f.events) == 300 + (1 if big else 0) for f in frames)
    assert reader.stop is None or reader.stop.kind == "torn_tail", reader.stop


# --- old versions ---------------------------------------------------------------------------


def _fixture_script() -> Any:
    spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finished_v1_fixture_is_upcast() -> None:
    path = DATA / "finished_v1.kvlog"
    frames, reader = read_all(path, strict=True)
    assert reader.stop is None
    assert reader.header is not None
    assert reader.header["schemas"][6] == ["Finished", 1, ["req_id", "aborted"]]
    assert as_steps(frames) == [
        (3, (ev.Preempted(3, "req-a"), ev.Finished(3, "req-a", "aborted"))),
        (4, (ev.Finished(4, "req-b", "stopped"), ev.Finished(4, "req-c", "stopped"))),
    ]
    raw = list(LogReader(path).iter_raw())
    assert raw[0].records[1] == [6, "req-a", True]  # raw: as written, v1


def test_fixtures_match_their_script() -> None:
    script = _fixture_script()
    for name, build in script.FIXTURES.items():
        assert (DATA / name).read_bytes() == build(), f"regenerate {name}: make_fixtures.py"


# --- checksum -----------------------------------------------------------------


def test_masked_crc_matches_the_documented_definition() -> None:
    def reference(data: bytes) -> int:
        import zlib

        c = zlib.crc32(data)
        return ((c >> 15 | c << 17) + 0xA282EAD8) % 2**32

    for data in (b"", b"a", b"\x00" * 4, bytes(range(256))):
        assert framing.masked_crc(data) == reference(data)
    assert framing.masked_crc(b"") == 0xA282EAD8


# --- the reader in docs/log-format.md -------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, ev.Admission):
        return int(value)
    return value


def test_the_documented_reader_agrees_with_log_reader(sample: tuple[Path, bytes]) -> None:
    path, _ = sample
    text = (ROOT / "docs" / "log-format.md").read_text()
    blocks = text.split("```python\n")
    (code,) = [b.split("```")[0] for b in blocks if "def read_kvlog" in b]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/log-format.md", "exec"), namespace)
    documented = list(namespace["read_kvlog"](path))
    expected = [
        (
            frame.step,
            type(e).__name__,
            e.req_id,
            {f.name: _plain(getattr(e, f.name)) for f in attrs.fields(type(e))[2:]},
        )
        for frame in LogReader(path)
        for e in frame.events
    ]
    assert documented == expected


def test_a_later_segment_that_is_no_log_stops_the_reader_after_the_frames_before_it(
    tmp_path: Path,
) -> None:
    """A segment zero-filled after a crash is damage like any other: every frame of the
    segments before it is read, then the reader stops at offset 0 of that segment."""
    writer = LogWriter(tmp_path / "run.kvlog", {"block_size": 16}, rotate_bytes=200)
    for step in range(40):
        writer.append(ev.Preempted(step, f"r{step}"))
        writer.end_step(step)
    writer.close()
    segments = segment_paths(tmp_path)
    assert len(segments) >= 3
    whole = [f.step for f in LogReader(tmp_path)]
    segments[-1].write_bytes(b"\0" * 64)
    reader = LogReader(tmp_path)
    steps = [f.step for f in reader]
    assert steps and steps == whole[: len(steps)] and len(steps) < len(whole)
    assert reader.stop is not None
    assert (reader.stop.kind, reader.stop.offset) == ("bad_header", 0)
    assert reader.stop.path == str(segments[-1])
