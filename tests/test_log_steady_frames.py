"""The writer's decode-step path (connector/logwriter.py): a ``StepDecoded`` is packed with its
frame, on the log's thread when there is one, and the frame, its checksums and the segment's
digest are built there too. The log must read back exactly as appended, in either mode, across
rotations and seals; a value msgpack cannot hold costs its record, said in its place."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_log import FUNCTION_TMP, as_steps, read_all

from kvledger.connector import logwriter
from kvledger.connector.logwriter import LogWriter
from kvledger.tracker import events as ev

_IDS = st.integers(0, 2**31)


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[int, tuple[ev.Event, ...]]]:
    """Steps of running requests: some add a request or schedule one in full, most are one
    StepDecoded (the first one of a segment interns its empty req_id: packed at once)."""
    steps: list[tuple[int, tuple[ev.Event, ...]]] = []
    for step in range(draw(st.integers(1, 40))):
        events: list[ev.Event] = []
        if draw(st.booleans()):
            rid = f"r{draw(st.integers(0, 5))}"
            events.append(ev.Scheduled(step, rid, step, 1, step, (draw(_IDS),)))
        for _ in range(draw(st.integers(0, 2))):
            n = draw(st.integers(0, 12))
            nums = tuple(draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)))
            tokens = tuple(draw(st.lists(_IDS, min_size=n, max_size=n)))
            blocks = tuple(draw(st.lists(_IDS, max_size=4)))
            events.append(ev.StepDecoded(step, "", nums, blocks, tokens))
        if events:
            steps.append((step, tuple(events)))
    return steps


def _write(path: Path, steps: list[tuple[int, tuple[ev.Event, ...]]], **kw: object) -> LogWriter:
    with LogWriter(path, {"block_size": 16}, **kw) as w:  # type: ignore[arg-type]
        for step, events in steps:
            for e in events:
                w.append(e)
            w.end_step(step)
    return w


@settings(max_examples=40, deadline=None, suppress_health_check=FUNCTION_TMP)
@given(steps=_steps(), rotate=st.sampled_from([None, 300, 900]), background=st.booleans())
def test_decode_steps_read_back_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[int, tuple[ev.Event, ...]]],
    rotate: int | None,
    background: bool,
) -> None:
    d = tmp_path_factory.mktemp("log")
    w = _write(d / "run.kvlog", steps, rotate_bytes=rotate, background=background)
    frames, reader = read_all(d)
    assert reader.stop is None and reader.ending == "closed" and w.lost_frames == 0
    assert as_steps(frames) == steps
    assert [f.seq for f in frames] == list(range(len(steps)))
    # each segment names the digest of every byte of the one before
    prev = ""
    for p in w.paths:
        header = read_all(p)[1].header
        assert header is not None and header["prev_segment_digest"] == prev
        prev = hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()


@pytest.mark.parametrize("background", [False, True])
def test_an_unencodable_decode_step_is_recorded_lost_in_its_place(
    tmp_path: Path, background: bool
) -> None:
    good = ev.StepDecoded(0, "", (0, 1), (), (5, 6))
    bad = ev.StepDecoded(1, "", (0, 1), (), (7, 2**64))  # beyond any msgpack integer
    after = ev.StepDecoded(2, "", (0, 1), (), (8, 9))
    w = _write(
        tmp_path / "run.kvlog", [(0, (good,)), (1, (bad,)), (2, (after,))], background=background
    )
    frames, reader = read_all(tmp_path)
    assert reader.stop is None and w.lost_frames == 0
    assert [f.step for f in frames] == [0, 1, 2]
    assert frames[0].events == (good,) and frames[2].events == (after,)
    (lost,) = frames[1].events
    assert isinstance(lost, ev.RecordLost)
    assert (lost.step, lost.callback) == (1, "StepDecoded")
    assert "cannot encode a StepDecoded of step 1" in lost.error


def test_a_sealed_log_writes_the_pending_decode_step(tmp_path: Path) -> None:
    first = ev.StepDecoded(0, "", (0,), (), (5,))
    pending = ev.StepDecoded(1, "", (0, 1), (3, 9), (6, 7))
    w = LogWriter(tmp_path / "run.kvlog", {}, background=True)
    w.append(first)
    w.end_step(0)
    w.append(pending)  # its step is not ended when the engine is told to stop
    assert w.seal("SIGINT")
    frames, reader = read_all(tmp_path)  # complete now, before close
    assert reader.stop is None and reader.ending == "closed"
    assert as_steps(frames) == [(0, (first,)), (1, (pending,))]
    w.close()
    assert as_steps(read_all(tmp_path)[0]) == [(0, (first,)), (1, (pending,))]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3 * logwriter._HASH_PIECE + 5), split=st.integers(0, 7000))
def test_the_digest_fed_in_pieces_is_the_digest(size: int, split: int) -> None:
    data = random.Random(size).randbytes(size)
    h = hashlib.blake2b(digest_size=16)
    logwriter._hash(h, data[:split])
    logwriter._hash(h, data[split:])
    assert h.hexdigest() == hashlib.blake2b(data, digest_size=16).hexdigest()


@pytest.mark.parametrize("background", [False, True])
def test_decode_step_numbers_are_ints_or_the_record_is_lost(
    tmp_path: Path, background: bool
) -> None:
    """The writer takes a decode step's ids as every id from vLLM is taken (int_tuple):
    numpy's and torch's integers are ints in the log; a float costs the record, said in its
    place. The first StepDecoded of a segment is packed at once, the rest with the frame."""
    np = pytest.importorskip("numpy")
    first = ev.StepDecoded(0, "", (0,), (), (np.int64(5),))
    numpy_ids = ev.StepDecoded(1, "", (0, 1), (np.int32(4), 9), (np.int64(6), 7))
    a_float = ev.StepDecoded(2, "", (0, 1), (), (8, 1.5))  # type: ignore[arg-type]
    steps = [(0, (first,)), (1, (numpy_ids,)), (2, (a_float,))]
    w = _write(tmp_path / "run.kvlog", steps, background=background)
    frames, reader = read_all(tmp_path)
    assert reader.stop is None and w.lost_frames == 0
    assert frames[0].events == (ev.StepDecoded(0, "", (0,), (), (5,)),)
    (read,) = frames[1].events
    assert read == ev.StepDecoded(1, "", (0, 1), (4, 9), (6, 7))
    assert all(type(x) is int for x in (*read.nums, *read.blocks, *read.tokens))
    (lost,) = frames[2].events
    assert isinstance(lost, ev.RecordLost) and lost.step == 2
    assert "expected integers, got float 1.5" in lost.error
