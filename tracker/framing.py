"""The kvledger log file format, without I/O: bytes in, verified frames out, and back.

File layout (all integers little-endian; ``docs/log-format.md`` is the full description)::

    b"KVLEDGER"  u16 major (1)  u16 minor (1)      12-byte preamble, not checksummed
    frame: header (a msgpack map)
    frame: [seq, step, wall_ns, [record, ...]]     one per scheduler step
    ...
    frame: {"end": "closed" | "rotated", ...}      the end record

    frame = u32 len | u32 masked_crc(the 4 length bytes) | payload (len bytes)
            | u32 masked_crc(payload)

``masked_crc(b)`` is LevelDB/TFRecord's mask over CRC-32 (``zlib.crc32``, the IEEE polynomial):
``((c >> 15) | (c << 17)) + 0xA282EAD8`` modulo 2**32. The separate length checksum tells a
damaged length from a torn tail. Records inside a frame are described in :mod:`tracker.codec`.

This module is the format's one home: the writer (``connector/logwriter.py``) builds its bytes
with the encoders here, and every reader (``replay/logreader.py``: a finished log, and one
followed while it is written) judges them with one :class:`FrameValidator`, so that what one
reader refuses, every reader refuses. It opens no file and reads no clock: the callers do.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Literal, NoReturn

import attrs
import msgpack

from kvledger.tracker import codec
from kvledger.tracker.events import Event

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "ENDINGS",
    "FORMAT",
    "MAGIC",
    "MAJOR",
    "MAX_FRAME_RECORDS",
    "MAX_HEADER_BYTES",
    "MINOR",
    "PREAMBLE_SIZE",
    "Ending",
    "Frame",
    "FrameValidator",
    "LogCorruptError",
    "LogError",
    "LogFormatError",
    "RawFrame",
    "StepFrame",
    "StopInfo",
    "end_record",
    "frame_bytes",
    "lost_record",
    "masked_crc",
    "next_segment_name",
    "parse_segment_name",
    "segment_header",
    "segment_name",
    "segment_start",
    "step_payloads",
]

MAGIC: Final = b"KVLEDGER"
MAJOR: Final = 1
# 1: every segment ends with an end record (closed, or rotated into the next), and a header
# names the seq of its segment's first frame. Logs of minor 0 have neither.
MINOR: Final = 1
FORMAT: Final = "kvledger-log"
PREAMBLE_SIZE: Final = 12
DEFAULT_MAX_FRAME_BYTES: Final = 16 << 20
# Records one frame may hold: the writer splits a step with more into several frames, and a
# reader refuses a frame announcing more before decoding any of it. With the byte bound, this
# bounds what reading one frame costs in memory (docs/log-format.md, "What reading costs").
MAX_FRAME_RECORDS: Final = 1 << 16
# The header frame is small (schemas, config): readers refuse a bigger one.
MAX_HEADER_BYTES: Final = 1 << 20

# How a log read without damage ended, and what that means for the reader (kvledger check
# says the last three aloud: the log is incomplete).
Ending = Literal["closed", "open", "rotated", "unknown"]
ENDINGS: Final[dict[str, str]] = {
    "closed": "complete: the writer closed the log",
    "open": "no end record: the engine is still writing it, or died after step {last_step}",
    "rotated": "its last segment here was rotated into a next one that is missing (deleted, "
    "or the engine died starting it) after step {last_step}",
    "unknown": "written before end records existed (format 1.0): whether it is complete "
    "cannot be told",
}

_U32 = struct.Struct("<I")
_U32x2 = struct.Struct("<II")
_PREAMBLE = struct.Struct("<8sHH")
_MASK_DELTA: Final = 0xA282EAD8
# A segment's number is 000001 to 999999 (the first segment has none).
_SEGMENT_RE = re.compile(r"^(?P<stem>.*?)(?:\.(?P<n>(?!000000)\d{6}))?\.kvlog$")


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 (``zlib.crc32``) of ``data``, masked the LevelDB way (rotate right 15, add a
    constant): ``((c >> 15) | (c << 17)) + 0xA282EAD8`` modulo 2**32."""
    c = zlib.crc32(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_bytes(payload: bytes) -> bytes:
    """One frame around ``payload``: ``len | masked_crc(len) | payload | masked_crc(payload)``."""
    head = _U32.pack(len(payload))
    return b"".join((head, _U32.pack(masked_crc(head)), payload, _U32.pack(masked_crc(payload))))


# --- segment names --------------------------------------------------------------------------


def segment_name(first: str, number: int) -> str:
    """The file name of segment ``number`` of the log whose first segment is named ``first``:
    ``run.kvlog``, ``run.000001.kvlog``, ``run.000002.kvlog``, ..."""
    if number == 0:
        return first
    if first.endswith(".kvlog"):
        stem = first[: -len(".kvlog")]
    else:  # another suffix is replaced, as pathlib's stem does
        dot = first.rfind(".")
        stem = first[:dot] if 0 < dot < len(first) - 1 else first
    return f"{stem}.{number:06d}.kvlog"


def next_segment_name(name: str) -> str:
    """The file name of the segment after the one named ``name``."""
    parsed = parse_segment_name(name)
    if parsed is None:  # a first segment named by the user (not *.kvlog)
        return segment_name(name, 1)
    stem, number = parsed
    return segment_name(f"{stem}.kvlog", number + 1)


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """``(stem, number)`` of a segment's file name (``run.000002.kvlog``: ``("run", 2)``;
    ``run.kvlog``: ``("run", 0)``), or None for a name no writer gives a segment."""
    m = _SEGMENT_RE.match(name)
    return None if m is None else (m["stem"], int(m["n"] or 0))


# --- errors and results ---------------------------------------------------------------------


class LogError(Exception):
    """Base of the log's errors."""


class LogFormatError(LogError, ValueError):
    """Not a kvledger log, or a major format version this library cannot read."""


@attrs.frozen(slots=True)
class StopInfo:
    """Where and why a reader stopped before the end of the data.

    ``kind``: ``"torn_tail"`` (the data ends inside a frame, or in zeros: a writer died
    mid-write, or the machine lost power; normal after a crash), ``"corrupt"`` (a checksum,
    length, payload, record, sequence number or step is wrong), ``"bad_header"`` (a segment
    header is damaged or does not chain to the previous segment). ``offset`` is the byte offset
    in ``path`` of the frame that could not be read.
    """

    path: str
    offset: int
    reason: str
    kind: Literal["torn_tail", "corrupt", "bad_header"]

    def describe(self) -> str:
        return f"{self.path}: offset {self.offset}: {self.kind}: {self.reason}"


class LogCorruptError(LogError):
    """Raised by a ``strict`` reader where a lenient one would stop; carries the StopInfo."""

    def __init__(self, stop: StopInfo) -> None:
        super().__init__(stop.describe())
        self.stop = stop


@attrs.frozen(slots=True)
class Frame:
    """One scheduler step's events, with where they were read from."""

    seq: int
    step: int
    wall_ns: int
    events: tuple[Event, ...]
    offset: int
    path: str


@attrs.frozen(slots=True)
class RawFrame:
    """A frame's records as written: ``[tag, req_id, *fields]`` lists with ``req_id`` resolved
    from its intern ref, fields at the writer's schema version, trailing defaults absent."""

    seq: int
    step: int
    wall_ns: int
    records: list[list[Any]]
    offset: int
    path: str


# A verified step frame as the validator yields it: (seq, step, wall_ns, records, offset);
# the records are still raw (see FrameValidator.events and FrameValidator.resolve).
StepFrame = tuple[int, int, int, list[Any], int]


# --- writing: the bytes of a log ------------------------------------------------------------


def segment_start(header: dict[str, Any]) -> bytes:
    """A segment's first bytes: the preamble and the header frame. Raises ``TypeError`` for a
    header msgpack cannot hold, ``ValueError`` for one over :data:`MAX_HEADER_BYTES`."""
    try:
        payload = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"log config must be msgpack-serialisable: {e}") from e
    if len(payload) > MAX_HEADER_BYTES:
        raise ValueError(f"log header is {len(payload)} bytes, over {MAX_HEADER_BYTES}")
    return _PREAMBLE.pack(MAGIC, MAJOR, MINOR) + frame_bytes(payload)


def segment_header(
    *,
    library_version: str,
    created_wall_ns: int,
    run_id: str,
    segment: int,
    first_seq: int,
    prev_segment_digest: str,
    config: dict[str, Any],
) -> dict[str, Any]:
    """A segment's header map (docs/log-format.md, "Header frame"): who wrote it, its place in
    the log, the run's configuration, and the codec's schema table, so the file describes
    itself."""
    return {
        "format": FORMAT,
        "library_version": library_version,
        "created_wall_ns": created_wall_ns,
        "run_id": run_id,
        "segment": segment,
        "first_seq": first_seq,
        "prev_segment_digest": prev_segment_digest,
        "config": config,
        "schemas": codec.schemas(),
        "transforms": codec.transforms(),
        "defaults": codec.defaults(),
    }


def step_payloads(
    pack: Callable[[Any], bytes],
    array_header: Callable[[int], bytes],
    seq: int,
    step: int,
    wall_ns: int,
    records: Sequence[bytes],
    max_frame_bytes: int,
) -> list[bytes]:
    """The payloads of one step's frames, from ``seq`` on: one, or several of the same step
    when one would exceed ``max_frame_bytes`` or :data:`MAX_FRAME_RECORDS`. Each is the bytes
    of ``packb([seq, step, wall_ns, records])``, built from the records packed already (``pack``
    and ``array_header`` are a ``msgpack.Packer``'s). Raises :class:`tracker.codec.EncodeError`
    for one record too big for a frame of its own."""
    head = (array_header(4), pack(seq), pack(step), pack(wall_ns), array_header(len(records)))
    payload = b"".join((*head, *records))
    if len(payload) <= max_frame_bytes and len(records) <= MAX_FRAME_RECORDS:
        return [payload]
    if len(records) == 1:
        raise codec.EncodeError(
            f"one record of step {step} takes {len(payload)} bytes, over "
            f"max_frame_bytes={max_frame_bytes}"
        )
    half = len(records) // 2
    first = step_payloads(pack, array_header, seq, step, wall_ns, records[:half], max_frame_bytes)
    return first + step_payloads(
        pack, array_header, seq + len(first), step, wall_ns, records[half:], max_frame_bytes
    )


def end_record(
    how: Literal["closed", "rotated"], frames: int, last_step: int, stop: str | None = None
) -> bytes:
    """The segment's end record, framed: a frame whose payload is a map (a step's frame never
    is), so a reader tells a log that was closed, or rotated into a next segment, from one
    whose writer is still running or died (no end record). ``frames``: step frames in the
    whole log; ``last_step``: the step of the last one (-1: none); ``stop``: for a log sealed
    when the engine was asked to stop, how it was asked (``"SIGINT"``, ``"SIGTERM"``)."""
    end: dict[str, Any] = {"end": how, "frames": frames, "last_step": last_step}
    if stop is not None:
        end["stop"] = stop
    return frame_bytes(msgpack.packb(end, use_bin_type=True))


def lost_record(lost: dict[str, int]) -> bytes:
    """The loss record, framed: which steps the writer dropped (``first_step``, ``last_step``)
    and how much of them (``frames``, ``records``). A map like the end record, so a reader
    knows the gap is a recorded fact, not damage."""
    return frame_bytes(msgpack.packb({"lost": lost}, use_bin_type=True))


# --- reading: one validator for every reader ------------------------------------------------


class _Stop(Exception):
    """Internal: the validator met damage (carries the StopInfo)."""

    def __init__(self, info: StopInfo) -> None:
        super().__init__(info.reason)
        self.info = info


# A step's frame is an array; an end or loss record is a map (fixmap, map 16, map 32).
_MAP_FIRST_BYTES: Final = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
_LOST_KEYS: Final = frozenset({"frames", "records", "first_step", "last_step"})
_HEADER_TYPES: Final[dict[str, type | tuple[type, ...]]] = {
    "format": str,
    "library_version": str,
    "created_wall_ns": int,
    "run_id": str,
    "segment": int,
    "prev_segment_digest": str,
    "config": dict,
    "schemas": dict,
}


class FrameValidator:
    """Judges a log's bytes, segment by segment, as they come: the one definition of a valid
    log that every reader uses (a finished log, or one followed while it is written).

    Per segment: :meth:`begin` (a file starts), :meth:`feed` with its bytes in order, in
    pieces of any size (each call yields the step frames completed by the bytes so far, as
    :data:`StepFrame` tuples), then :meth:`end_segment` once the file has no more bytes.
    Checked, in order: the preamble (magic, major version), the header frame (shape, size,
    schema table) and its chain to the previous segment (``run_id``, segment number,
    ``prev_segment_digest`` over every byte before), each frame's length checksum, bound and
    payload checksum, the frame's shape, its ``seq`` (dense over the whole log), its ``step``
    (never negative, never decreasing: a frame from the past is a spliced or forged log), end
    and loss records (nothing after an end record), and at a segment's end, whether it ended
    as a segment must (torn or zero-filled tails only in the last; an end record ``rotated``
    in every segment but the last).

    At the first damage :attr:`problem` says where and why, and nothing more is yielded: every
    frame before it is good data, nothing after it is trusted. A file that is not a kvledger
    log, or has a major version this library cannot read, raises :class:`LogFormatError` when
    it is the first segment (the caller's error), and is damage in a later one.

    What a reader learns on the way: :attr:`first_header`, :attr:`missing_start` (the first
    segment's number, when it is not 0), :attr:`last_step`, :attr:`gaps` (the loss records),
    and once the last segment ended cleanly, :attr:`ending` (:data:`ENDINGS`). The segment
    being read: :attr:`path`, :attr:`header`, :attr:`decoder`, :attr:`end` (its end record).
    """

    def __init__(
        self,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        gaps: list[dict[str, int]] | None = None,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.first_header: dict[str, Any] | None = None
        self.missing_start: int | None = None
        self.last_step: int | None = None
        # Steps the writer dropped (its loss records): {"first_step", "last_step", "frames",
        # "records"} each. A caller may pass its own list (emptied here) to hold on to it.
        self.gaps: list[dict[str, int]] = gaps if gaps is not None else []
        self.gaps.clear()
        self.ending: Ending | None = None
        self.problem: StopInfo | None = None
        self.segments = 0  # segments begun
        self.path = ""
        self.header: dict[str, Any] | None = None
        self.decoder: codec.Decoder | None = None
        self.end: dict[str, Any] | None = None
        self._open = False
        self._prev: tuple[dict[str, Any], str, str] | None = None  # header, digest, path
        self._expect_seq: int | None = None
        self._buf = b""  # bytes fed and not consumed, from self._base on
        self._base = 0  # the file offset of self._buf[0]
        self._hasher = hashlib.blake2b(digest_size=16)
        self._wanted = 0
        # A run of zeros from this offset may be a zero-filled tail (blocks a file system
        # allocated and never wrote): what it is unless the file ends in zeros.
        self._zeros: StopInfo | None = None

    @property
    def wanted(self) -> int:
        """How many more bytes the validator needs before it can go on (the rest of the frame
        in progress, or of its head): a reader reads at least this much next, so a large frame
        is not gathered piece by piece."""
        return self._wanted

    def begin(self, path: str) -> None:
        """A segment file starts (the first, or the one after the segment just ended)."""
        if self._open:
            raise RuntimeError(f"begin({path!r}) before the end of segment {self.path!r}")
        self._open = True
        self.segments += 1
        self.path = path
        self.header = None
        self.decoder = None
        self.end = None
        self._buf = b""
        self._base = 0
        self._hasher = hashlib.blake2b(digest_size=16)
        self._wanted = PREAMBLE_SIZE
        self._zeros = None

    def feed(self, data: bytes) -> Iterator[StepFrame]:
        """Take the segment's next bytes; yield each step frame they complete, verified (its
        records are decoded later by :meth:`events` or :meth:`resolve`)."""
        if self.problem is not None:
            return
        self._hasher.update(data)
        if self._zeros is not None:
            if data.count(0) != len(data):
                self._fail(self._zeros)
            self._base += len(data)
            return
        buf = self._buf + data if self._buf else data
        del data  # the caller's piece is in buf now: hold it once
        try:
            if self.header is None:
                start = self._read_header(buf)
                if start is None:
                    if self._zeros is None:
                        self._buf = buf
                    return
            else:
                start = 0
            yield from self._frames(buf, start)
        except _Stop as s:
            self._fail(s.info)

    def end_segment(self, *, last: bool) -> None:
        """The segment's file has no more bytes: judge what is left of it (a torn tail, normal
        only in the ``last`` segment) and how it ended (an end record ``rotated`` before a
        next segment; :attr:`ending` after the last)."""
        if not self._open:
            raise RuntimeError("end_segment() without begin()")
        self._open = False
        if self.problem is not None:
            return
        try:
            self._judge_end(last)
        except _Stop as s:
            self._fail(s.info)

    def events(self, frame: StepFrame) -> tuple[Event, ...] | None:
        """The events of a frame :meth:`feed` yielded; None, with :attr:`problem` set, when a
        record cannot be decoded (an unknown tag, a bad field, an undeclared request ref)."""
        seq, step, _, records, offset = frame
        assert self.decoder is not None
        try:
            return self.decoder.decode(step, records)
        except codec.DecodeError as e:
            self._fail(StopInfo(self.path, offset, f"frame seq {seq}: {e}", "corrupt"))
            return None

    def resolve(self, frame: StepFrame) -> bool:
        """Check a frame's records without building events (shape, tags, interning; request
        refs resolved in place); False, with :attr:`problem` set, when one is bad."""
        seq, _, _, records, offset = frame
        assert self.decoder is not None
        try:
            self.decoder.resolve(records)
        except codec.DecodeError as e:
            self._fail(StopInfo(self.path, offset, f"frame seq {seq}: {e}", "corrupt"))
            return False
        return True

    # --- internals --------------------------------------------------------------------

    def _fail(self, info: StopInfo) -> None:
        if self.problem is None:
            self.problem = info
        self._buf = b""
        self._wanted = 0

    def _read_header(self, buf: bytes) -> int | None:
        """Parse the preamble and the header frame from the segment's first bytes; the offset
        after them, or None when more bytes are needed."""
        path = self.path
        pre = buf[:PREAMBLE_SIZE]
        if pre[:8] != MAGIC[: len(pre[:8])]:
            self._format_error(
                f"{path}: offset 0: not a kvledger log: expected magic {MAGIC!r}, "
                f"found {bytes(pre[:8])!r}"
            )
        if len(pre) < PREAMBLE_SIZE:
            self._wanted = PREAMBLE_SIZE - len(pre)
            return None
        _, major, minor = _PREAMBLE.unpack(pre)
        if major != MAJOR:
            newer = "written by a newer kvledger" if major > MAJOR else "an unknown format"
            self._format_error(
                f"{path}: offset 8: {newer} (format {major}.x); this version reads {MAJOR}.x"
            )
        try:
            stop = self._frame_at(buf, PREAMBLE_SIZE, MAX_HEADER_BYTES)
        except _Stop as s:  # a damaged header frame is a bad header
            raise _Stop(_in_header(s.info)) from None
        if stop is None:
            if self._zeros is not None:
                self._zeros = _in_header(self._zeros)
            return None
        offset = PREAMBLE_SIZE
        header = _unpack_header(memoryview(buf)[offset + 8 : stop], path, offset)
        header["major"], header["minor"] = major, minor
        if self._prev is not None:
            _check_chain(self._prev, header, path)
        else:
            self.first_header = header
            if header["segment"] != 0:
                # Old segments deleted: what is here is read, and said to lack its start (a
                # replay cannot rebuild the states before it).
                self.missing_start = header["segment"]
            self._expect_seq = header.get("first_seq", 0 if header["segment"] == 0 else None)
        try:
            self.decoder = codec.Decoder(header["schemas"], header.get("transforms"))
        except codec.DecodeError as e:
            raise _Stop(StopInfo(path, offset, f"bad schema table: {e}", "bad_header")) from None
        self.header = header
        return stop + 4

    def _format_error(self, message: str) -> NoReturn:
        if self.segments == 1:
            raise LogFormatError(message)  # not a kvledger log at all: the caller's error
        # A later segment that is no log (zero-filled after a crash, say): damage like any
        # other, after every frame before it was read.
        raise _Stop(StopInfo(self.path, 0, message, "bad_header"))

    def _frame_at(self, buf: bytes, pos: int, bound: int) -> int | None:
        """Verify the frame at ``pos`` (its length checksum and bound, and once it is all
        there, its payload checksum); the offset of its payload checksum, or None when the
        frame is not all there yet (or is the start of a run of zeros)."""
        end = len(buf)
        if end - pos < 8:
            self._wanted = 8 - (end - pos)
            return None
        n: int
        n, lcrc = _U32x2.unpack_from(buf, pos)
        at = self._base + pos
        if masked_crc(buf[pos : pos + 4]) != lcrc:
            self._maybe_zeros(
                buf, pos, StopInfo(self.path, at, "frame length checksum mismatch", "corrupt")
            )
            return None
        if n > bound:
            raise _Stop(
                StopInfo(
                    self.path, at, f"frame length {n} exceeds max_frame_bytes={bound}", "corrupt"
                )
            )
        stop = pos + 8 + n
        if stop + 4 > end:
            self._wanted = stop + 4 - end
            return None
        if masked_crc(memoryview(buf)[pos + 8 : stop]) != _U32.unpack_from(buf, stop)[0]:
            # The length reached the disk, the payload did not (a power loss)?
            self._maybe_zeros(
                buf, pos + 8, StopInfo(self.path, at, "frame payload checksum mismatch", "corrupt")
            )
            return None
        return stop

    def _maybe_zeros(self, buf: bytes, pos: int, otherwise: StopInfo) -> None:
        """Damage at ``otherwise.offset``, unless the file is zeros from ``pos`` to its end:
        then a zero-filled tail (decided at the segment's end; more bytes may come)."""
        if buf.count(0, pos) != len(buf) - pos:
            raise _Stop(otherwise)
        self._zeros = otherwise
        self._base += len(buf)
        self._buf = b""
        self._wanted = 0

    def _frames(self, buf: bytes, pos: int) -> Iterator[StepFrame]:
        """The step frames in ``buf`` from ``pos``; keeps an unfinished frame for the next
        feed. Raises ``_Stop`` at damage."""
        view = memoryview(buf)
        path = self.path
        max_frame = self.max_frame_bytes
        frame_at = self._frame_at
        map_first = _MAP_FIRST_BYTES
        while True:
            stop = frame_at(buf, pos, max_frame)
            if stop is None:
                if self._zeros is None:
                    self._base += pos
                    self._buf = buf[pos:]
                return
            offset = self._base + pos
            payload = view[pos + 8 : stop]
            pos = stop + 4
            if self.end is not None:
                raise _Stop(StopInfo(path, offset, "a frame after the end record", "corrupt"))
            if payload and payload[0] in map_first:
                marker = _unpack_marker(payload, path, offset)
                if "lost" in marker:
                    self.gaps.append(marker["lost"])
                else:
                    self.end = marker
                continue
            seq, step, wall_ns, records = _unpack_frame(payload, path, offset)
            expect = self._expect_seq
            if expect is not None and seq != expect:
                raise _Stop(
                    StopInfo(path, offset, f"frame seq {seq} where {expect} was due", "corrupt")
                )
            self._expect_seq = seq + 1
            last_step = self.last_step
            if step < 0 or (last_step is not None and step < last_step):
                # Steps only grow (a step may span several frames): a frame from the past is
                # a spliced or forged log, not a record of this run.
                after = "" if last_step is None else f" after step {last_step}"
                raise _Stop(StopInfo(path, offset, f"frame step {step}{after}", "corrupt"))
            self.last_step = step
            yield seq, step, wall_ns, records, offset
            if self.problem is not None:  # a record the caller could not decode
                return

    def _judge_end(self, last: bool) -> None:
        path = self.path
        size = self._base + len(self._buf)
        header = self.header
        if self._zeros is not None:
            # The header is read as if its segment were the last: a torn header is a torn
            # tail wherever it is.
            if not last and header is not None:
                raise _Stop(self._zeros)
            offset = self._zeros.offset
            reason = (
                f"zero-filled tail ({size - offset} bytes of zeros after the last complete "
                "frame: never written, as after a power loss)"
            )
            raise _Stop(
                StopInfo(path, offset, reason if header else f"header: {reason}", "torn_tail")
            )
        if header is None:
            self._torn_header()
            return
        assert header is not None
        if self._buf:
            self._torn_frame(last)
        how = None if self.end is None else self.end.get("end")
        if header["minor"] < 1:  # written before end records existed
            if last:
                self.ending = "unknown"
        elif not last and how != "rotated":
            what = "was closed" if how == "closed" else "has no end record"
            raise _Stop(
                StopInfo(
                    path, size, f"segment {header['segment']} {what}, yet more follow", "corrupt"
                )
            )
        elif last:
            self.ending = "open" if how is None else how
        self._prev = (header, self._hasher.hexdigest(), path)

    def _torn_header(self) -> None:
        """The file ended before its header was whole: an empty file is what a writer leaves
        if it died before its first byte (a torn tail, wherever the segment is)."""
        buf, path = self._buf, self.path
        if not buf:
            raise _Stop(StopInfo(path, 0, "empty file", "torn_tail"))
        if len(buf) < PREAMBLE_SIZE:
            reason = f"the data ends inside the preamble ({len(buf)} bytes)"
            raise _Stop(StopInfo(path, 0, reason, "torn_tail"))
        if len(buf) == PREAMBLE_SIZE:
            raise _Stop(StopInfo(path, PREAMBLE_SIZE, "no header frame", "torn_tail"))
        self._base = PREAMBLE_SIZE
        self._buf = buf[PREAMBLE_SIZE:]
        try:
            self._torn_frame(True)
        except _Stop as s:
            raise _Stop(attrs.evolve(s.info, reason=f"header: {s.info.reason}")) from None

    def _torn_frame(self, last: bool) -> None:
        """The file ends inside the frame left in the buffer."""
        buf, offset = self._buf, self._base
        tail = "" if last else " of a segment that is not the last"
        torn: Literal["torn_tail", "corrupt"] = "torn_tail" if last else "corrupt"
        if len(buf) < 8:
            reason = f"the data ends inside a frame header{tail}"
        else:
            n = _U32.unpack_from(buf)[0]
            reason = (
                f"the data ends inside a frame ({n + 4} bytes announced after its header, "
                f"{len(buf) - 8} present){tail}"
            )
        raise _Stop(StopInfo(self.path, offset, reason, torn))


def _in_header(info: StopInfo) -> StopInfo:
    """Damage met reading a header frame: a bad header."""
    return attrs.evolve(info, reason=f"header: {info.reason}", kind="bad_header")


def _unpack_header(body: memoryview, path: str, offset: int) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,  # the schema table is keyed by int tags
            max_str_len=len(body),
            max_bin_len=len(body),
            max_array_len=len(body),
            max_map_len=len(body),
            max_ext_len=0,
        )
    except Exception as e:
        raise _Stop(
            StopInfo(
                path, offset, f"undecodable header: {codec.describe_exception(e)}", "bad_header"
            )
        ) from None
    problem = _header_problem(header)
    if problem is not None:
        raise _Stop(StopInfo(path, offset, problem, "bad_header"))
    assert isinstance(header, dict)
    return header


def _header_problem(header: Any) -> str | None:
    if not isinstance(header, dict):
        return "header is not a map"
    for key, t in _HEADER_TYPES.items():
        if key not in header:
            return f"header lacks {key!r}"
        if not isinstance(header[key], t) or isinstance(header[key], bool):
            return f"header {key!r} has type {type(header[key]).__name__}"
    if "first_seq" in header and (type(header["first_seq"]) is not int or header["first_seq"] < 0):
        return f"header 'first_seq' is not a non-negative integer: {header['first_seq']!r}"
    if header["segment"] < 0:
        return f"header 'segment' is negative: {header['segment']}"
    if header["format"] != FORMAT:
        return f"header format is {header['format']!r}, expected {FORMAT!r}"
    if not isinstance(header.get("transforms", {}), dict):
        return "header 'transforms' is not a map"
    return None


def _check_chain(prev: tuple[dict[str, Any], str, str], header: dict[str, Any], path: str) -> None:
    prev_header, digest, prev_path = prev
    problem = None
    if header["run_id"] != prev_header["run_id"]:
        problem = f"run_id {header['run_id']} differs from {prev_path}'s {prev_header['run_id']}"
    elif header["segment"] != prev_header["segment"] + 1:
        problem = f"segment {header['segment']} follows segment {prev_header['segment']}"
    elif header["prev_segment_digest"] != digest:
        problem = (
            f"prev_segment_digest {header['prev_segment_digest']!r} does not match "
            f"{prev_path} (digest {digest})"
        )
    if problem is not None:
        raise _Stop(StopInfo(path, PREAMBLE_SIZE, f"segment chain broken: {problem}", "bad_header"))


def _unpack_marker(payload: memoryview, path: str, offset: int) -> dict[str, Any]:
    """An end record ``{"end": "closed" | "rotated", ...}`` or a loss record
    ``{"lost": {"frames", "records", "first_step", "last_step"}}``; anything else is damage."""
    try:
        marker = msgpack.unpackb(payload, raw=False, max_str_len=64, max_bin_len=0,
                                 max_array_len=0, max_map_len=16, max_ext_len=0)  # fmt: skip
    except Exception as e:
        raise _Stop(
            StopInfo(
                path, offset, f"undecodable end record: {codec.describe_exception(e)}", "corrupt"
            )
        ) from None
    ok = isinstance(marker, dict) and (
        marker.get("end") in ("closed", "rotated")
        or (
            set(marker) == {"lost"}
            and isinstance(marker["lost"], dict)
            and set(marker["lost"]) == _LOST_KEYS
            and all(type(v) is int and v >= 0 for v in marker["lost"].values())
        )
    )
    if not ok:
        raise _Stop(StopInfo(path, offset, f"not an end record: {marker!r}"[:200], "corrupt"))
    return dict(marker)


def _unpack_frame(payload: memoryview, path: str, offset: int) -> tuple[int, int, int, list[Any]]:
    """``[seq, step, wall_ns, records]`` from a verified payload. The frame's head is read
    first, and a frame announcing more than :data:`MAX_FRAME_RECORDS` records is refused
    before any record is decoded. The limits bound what a hostile payload can make the
    decoder allocate: no string, binary or array longer than the payload, no maps at all
    (frames have none), no extension types; deep nesting is bounded by msgpack itself (1024
    levels). docs/log-format.md gives the measured cost."""
    n = len(payload)
    limits = {
        "raw": False,
        "strict_map_key": True,
        "max_str_len": n,
        "max_bin_len": n,
        "max_array_len": n,
        "max_map_len": 0,
        "max_ext_len": 0,
    }
    try:
        head = msgpack.Unpacker(None, max_buffer_size=n, **limits)
        head.feed(payload)
        shape = head.read_array_header()
        seq, step, wall_ns = (head.unpack() for _ in range(3)) if shape == 4 else (None,) * 3
        start = head.tell()  # where the records array begins
        count = head.read_array_header() if shape == 4 else -1
    except Exception as e:  # hostile bytes raise many kinds; all mean "undecodable"
        raise _Stop(
            StopInfo(
                path, offset, f"undecodable frame payload: {codec.describe_exception(e)}", "corrupt"
            )
        ) from None
    if shape != 4 or type(seq) is not int or type(step) is not int or type(wall_ns) is not int:
        raise _Stop(
            StopInfo(
                path, offset, "frame payload is not [seq, step, wall_ns, [records]]", "corrupt"
            )
        )
    if count > MAX_FRAME_RECORDS:
        raise _Stop(
            StopInfo(
                path,
                offset,
                f"frame announces {count} records, over {MAX_FRAME_RECORDS} a frame may hold",
                "corrupt",
            )
        )
    try:
        # The records array again, whole, in one call (decoded in C).
        records = msgpack.unpackb(payload[start:], use_list=True, **limits)
    except Exception as e:  # hostile bytes raise many kinds; all mean "undecodable"
        raise _Stop(
            StopInfo(
                path, offset, f"undecodable frame payload: {codec.describe_exception(e)}", "corrupt"
            )
        ) from None
    if type(records) is not list:
        raise _Stop(
            StopInfo(
                path, offset, "frame payload is not [seq, step, wall_ns, [records]]", "corrupt"
            )
        )
    return seq, step, wall_ns, records
