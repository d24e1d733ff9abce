"""``replay.check`` on hostile input: it never raises, says where it stopped, and stays small.

The contract (docs/debugging.md, "Damaged logs"): a log that cannot be read to its end gives
exit code 2, after every complete frame before the damage was checked and reported; a file
that is not a log (or has an unknown major version, or a damaged header) gives exit code 2
with an error naming the byte offset. A log cut exactly at a frame boundary cannot be told
from a shorter log (frames carry no end marker): it checks clean. The preamble's minor
version is not checksummed (minor versions are readable by design), so flipping it goes
unnoticed; every other single-bit flip is caught (CRC-32 catches every one-bit error).

Mutations start from a real log (``tests/data/replay-clean.kvlog``, vLLM's real scheduler).
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import msgpack
import pytest
from _memory import traced_peak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_event_fuzz import EVENTS as EVERY_TAG

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import CheckResult, check
from kvledger.tracker import events as ev
from kvledger.tracker.codec import EncodeError
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.framing import DEFAULT_MAX_FRAME_BYTES, masked_crc

SEED = Path(__file__).resolve().parent / "data" / "replay-clean.kvlog"
BYTES = SEED.read_bytes()
FRAMES = [(f.offset, len(f.records)) for f in LogReader(SEED).iter_raw()]
HEADER_END = FRAMES[0][0]  # preamble + header frame
BOUNDARIES = {off for off, _ in FRAMES} | {len(BYTES)}
EVENTS = sum(n for _, n in FRAMES)

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_TMP = Path(tempfile.mkdtemp(prefix="kvledger-fuzz-"))


def run(data: bytes, name: str = "fuzz.kvlog") -> CheckResult:
    path = _TMP / name
    path.write_bytes(data)
    result = check(path)  # must not raise, whatever the bytes
    assert isinstance(result, CheckResult)
    assert result.exit_code in (0, 1, 2, 3)
    assert not [p for p in result.problems if p.kind == "error"], "the tracker raised"
    return result


def events_before(offset: int) -> int:
    return sum(n for off, n in FRAMES if off < offset)


def frame_at(offset: int) -> int:
    """Offset of the frame holding byte ``offset``."""
    return max(off for off, _ in FRAMES if off <= offset)


def frame(payload: bytes, length: int | None = None) -> bytes:
    head = struct.pack("<I", len(payload) if length is None else length)
    return (
        head
        + struct.pack("<I", masked_crc(head))
        + payload
        + struct.pack("<I", masked_crc(payload))
    )


def test_the_seed_log_is_clean() -> None:
    result = run(BYTES)
    assert result.exit_code == 0 and result.counts["events"] == EVENTS


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    result = run(data)
    assert result.exit_code == 2
    assert result.error is not None
    assert "offset" in result.error or (result.stop is not None and result.stop.offset >= 0)


@FUZZ
@given(st.binary(min_size=1, max_size=2048))
def test_random_bytes_after_a_valid_header(data: bytes) -> None:
    result = run(BYTES[:HEADER_END] + data)
    assert result.exit_code == 2 and result.error is None
    assert result.stop is not None and result.stop.offset == HEADER_END
    assert result.counts["events"] == 0


@FUZZ
@given(st.integers(0, len(BYTES) * 8 - 1))
def test_every_bit_flip_is_noticed_where_it_is(bit: int) -> None:
    data = bytearray(BYTES)
    data[bit // 8] ^= 1 << (bit % 8)
    result = run(bytes(data))
    pos = bit // 8
    if pos in (10, 11):  # the minor version: not checksummed, any minor of 1.x reads
        # (a 1.0 log read as 1.1 or later lacks the end record 1.1 writes: incomplete)
        assert result.exit_code in (0, 3) and result.run_info["minor"] != 0
        return
    assert result.exit_code == 2
    if pos < HEADER_END:
        assert result.error is not None  # magic, major version or header
        return
    assert result.error is None and result.stop is not None
    start = frame_at(pos)
    assert result.stop.offset == start
    assert result.counts["events"] == events_before(start)


@FUZZ
@given(st.integers(0, len(BYTES)))
def test_truncation_anywhere(cut: int) -> None:
    result = run(BYTES[:cut])
    if cut < HEADER_END:
        assert result.exit_code == 2 and result.error is not None
    elif cut in BOUNDARIES:
        # Cut between frames: indistinguishable from a shorter log.
        assert result.exit_code == 0 and result.counts["events"] == events_before(cut)
    else:
        assert result.exit_code == 2 and result.stop is not None
        assert result.stop.kind == "torn_tail"
        assert result.stop.offset == frame_at(cut)
        assert result.counts["events"] == events_before(frame_at(cut))
        assert result.problems == []


@FUZZ
@given(
    st.sampled_from(FRAMES[1:]),
    st.integers(DEFAULT_MAX_FRAME_BYTES + 1, 2**32 - 1),
)
def test_a_frame_length_claiming_gigabytes(target: tuple[int, int], length: int) -> None:
    offset, _ = target
    head = struct.pack("<I", length)
    data = BYTES[:offset] + head + struct.pack("<I", masked_crc(head)) + BYTES[offset + 8 :]
    result = run(data)
    assert result.exit_code == 2 and result.stop is not None
    assert result.stop.offset == offset and result.stop.kind == "corrupt"
    assert result.counts["events"] == events_before(offset)


@pytest.mark.parametrize("length", [2**32 - 1, 3 << 30, DEFAULT_MAX_FRAME_BYTES - 16])
def test_memory_stays_small_whatever_a_frame_claims(length: int) -> None:
    """A frame claiming 4 GB is refused before any allocation; one claiming just under the
    frame limit in a file that is much shorter is a torn tail, read in bounded pieces."""
    offset = FRAMES[len(FRAMES) // 2][0]
    head = struct.pack("<I", length)
    data = BYTES[:offset] + head + struct.pack("<I", masked_crc(head)) + BYTES[offset + 8 :]
    with traced_peak() as traced:
        result = run(data)
    peak = traced.bytes
    assert result.exit_code == 2 and result.stop is not None and result.stop.offset == offset
    assert peak < 4 << 20, f"peak {peak} bytes"


def test_a_header_with_an_unknown_major_version() -> None:
    for major in (0, 2, 65535):
        data = BYTES[:8] + struct.pack("<H", major) + BYTES[10:]
        result = run(data)
        assert result.exit_code == 2 and result.error is not None
        assert f"format {major}.x" in result.error and "offset 8" in result.error


_BOMBS = {
    "deep nesting": b"\x94\x00\x00\x00" + b"\x91" * 200_000 + b"\xc0",
    "huge array header": b"\x94\x00\x00\x00\xdd\xff\xff\xff\xff",
    "huge map header": b"\x94\x00\x00\x00\xdf\xff\xff\xff\xff",
    "huge str header": b"\x94\x00\x00\x00\xdb\xff\xff\xff\xff",
    "huge bin header": b"\x94\x00\x00\x00\xc6\xff\xff\xff\xff",
    "ext": b"\x94\x00\x00\x00\xc7\x05\x01hello",
    "huge record list": b"\x94\x00\x00\x00\x91\xdd\xff\xff\xff\xff",
    "nested arrays in a record": msgpack.packb([0, 0, 0, [[2, "r", [[[[[1]]]]]]]]),
    "a float where an int goes": msgpack.packb([0, 0.5, 0, []]),
}


@pytest.mark.parametrize("name", list(_BOMBS))
def test_a_msgpack_bomb_with_a_valid_checksum(name: str) -> None:
    offset, _ = FRAMES[len(FRAMES) // 3]
    data = BYTES[:offset] + frame(_BOMBS[name])
    with traced_peak() as traced:
        result = run(data)
    peak = traced.bytes
    assert result.exit_code == 2 and result.stop is not None
    assert result.stop.offset == offset and result.stop.kind == "corrupt"
    assert result.counts["events"] == events_before(offset)
    assert peak < 8 << 20, f"peak {peak} bytes"


# --- valid frames with hostile values: the fold must be total ----------------------------------

# Events of every tag, fields shaped by the codec's kinds (tests/test_event_fuzz.py).
_EVENTS = EVERY_TAG


@FUZZ
@given(st.lists(st.lists(_EVENTS, max_size=8), max_size=12))
def test_valid_frames_with_hostile_values(steps: list[list[ev.Event]]) -> None:
    path = _TMP / "hostile.kvlog"
    path.unlink(missing_ok=True)
    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=8)
    writer = LogWriter(path, config.to_dict(), fsync="never")
    written = 0
    for step, events in enumerate(steps):
        for e in events:
            try:
                writer.append(ev.__dict__[type(e).__name__](step, *_fields(e)))
                written += 1
            except EncodeError:  # a value msgpack cannot carry (a delta past 64 bits)
                pass
        writer.end_step(step)
    writer.close()
    result = check(path)
    assert result.error is None and result.stop is None
    assert result.exit_code in (0, 1)
    assert not [p.describe() for p in result.problems if p.kind == "error"], "the tracker raised"
    assert result.counts["events"] == written
    # A handler that raises is caught by the fold as ``fold_error``: a gap in its totality.
    fold_errors = [p.describe() for p in result.problems if p.name == "fold_error"]
    assert not fold_errors
    # The what-if replay rewrites and synthesises events: the same guarantees.
    what_if = check(path, chunk_size=64, save_decode_cache=True)
    assert what_if.error is None and what_if.exit_code in (0, 1)
    assert not [p.describe() for p in what_if.problems if p.kind == "error"]


def test_a_negative_token_start_is_a_named_violation(tmp_path: Path) -> None:
    path = tmp_path / "negative.kvlog"
    writer = LogWriter(path, TrackerConfig().to_dict(), fsync="never")
    writer.append(ev.RequestAdded(0, "a", ()))
    writer.append(ev.LookupAsked(0, "a", 0, 0, -1, (0,)))
    writer.end_step(0)
    writer.close()
    result = check(path)
    assert [p.name for p in result.problems if p.kind == "violation"] != ["fold_error"]


def _fields(e: ev.Event) -> list[object]:
    import attrs

    return [getattr(e, f.name) for f in attrs.fields(type(e))][1:]
