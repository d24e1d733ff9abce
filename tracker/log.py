"""LogWriter / LogReader: the kvledger log file. The only module of ``tracker`` that does I/O.

File layout (all integers little-endian; see ``docs/log-format.md``)::

    b"KVLEDGER"  u16 major (1)  u16 minor (0)      12-byte preamble, not checksummed
    frame: header (a msgpack map)
    frame: [seq, step, wall_ns, [record, ...]]     one per scheduler step
    ...

    frame = u32 len | u32 masked_crc(the 4 length bytes) | payload (len bytes)
            | u32 masked_crc(payload)

``masked_crc(b)`` is LevelDB/TFRecord's mask over CRC-32 (``zlib.crc32``, the IEEE polynomial):
``((c >> 15) | (c << 17)) + 0xA282EAD8`` modulo 2**32. The mask makes the checksum of bytes that
embed checksums well behaved; the separate length checksum tells a damaged length from a torn
tail. Records inside a frame are described in :mod:`tracker.codec`.

Segments: with ``rotate_bytes`` set, the writer starts a new file once the current one reached
that size: ``<stem>.kvlog``, ``<stem>.000001.kvlog``, ``<stem>.000002.kvlog``, ... Each segment is
self-contained (its own header, its own ``req_id`` interning) and names the BLAKE2b-128 digest of
every byte of the previous segment in ``prev_segment_digest``; frame ``seq`` numbers run on across
segments, so a reader notices a missing, reordered or foreign segment.

Durability: every ``end_step`` writes its frame and flushes it to the OS (a process crash loses
at most the step being written, seen as a torn tail); ``fsync`` runs on rotation and on close
(``fsync="step"`` also after every step, ``"never"`` never). An ``fsync`` error is logged and
never retried (after a failed fsync the kernel may have dropped the dirty pages and a retry can
falsely succeed, "fsyncgate"): the writer marks itself failed and the next write, or ``close``,
raises :class:`LogWriteError`. Open a new log to continue. A failed ``write`` does the same.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib.metadata
import logging
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Literal, Protocol

import attrs
import msgpack

from tracker import codec
from tracker.events import Event

__all__ = [
    "ENDINGS",
    "FORMAT",
    "MAGIC",
    "MAJOR",
    "MINOR",
    "Frame",
    "LogCorruptError",
    "LogError",
    "LogFollower",
    "LogFormatError",
    "LogReader",
    "LogWriteError",
    "LogWriter",
    "RawFrame",
    "StopInfo",
    "frame_bytes",
    "masked_crc",
    "newest_log",
    "segment_paths",
]

MAGIC: Final = b"KVLEDGER"
MAJOR: Final = 1
# 1: every segment ends with an end record (closed, or rotated into the next), and a header
# names the seq of its segment's first frame. Logs of minor 0 have neither.
MINOR: Final = 1
FORMAT: Final = "kvledger-log"
PREAMBLE_SIZE: Final = 12
DEFAULT_MAX_FRAME_BYTES: Final = 16 << 20
# What the background writer may hold before the disk catches up; past it, steps are dropped
# (and the loss recorded), never the engine stalled.
DEFAULT_MAX_QUEUE_BYTES: Final = 64 << 20
# How long close() waits for the background writer to drain before it gives up and says so.
CLOSE_TIMEOUT_S: Final = 30.0
# Room kept in the queue for the loss record itself.
_LOST_RECORD_BYTES: Final = 128
# Records one frame may hold: the writer splits a step with more into several frames, and a
# reader refuses a frame announcing more before decoding any of it. With the byte bound, this
# bounds what reading one frame costs in memory (docs/log-format.md, "What reading costs").
MAX_FRAME_RECORDS: Final = 1 << 16
DEFAULT_ROTATE_BYTES: Final = 256 << 20
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
_SEGMENT_RE = re.compile(r"^(?P<stem>.*?)(?:\.(?P<n>\d{6}))?\.kvlog$")

_logger = logging.getLogger("kvledger.log")


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 (``zlib.crc32``) of ``data``, masked the LevelDB way (rotate right 15, add a
    constant): ``((c >> 15) | (c << 17)) + 0xA282EAD8`` modulo 2**32."""
    c = zlib.crc32(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_bytes(payload: bytes) -> bytes:
    """One frame around ``payload``: ``len | masked_crc(len) | payload | masked_crc(payload)``."""
    head = _U32.pack(len(payload))
    return b"".join((head, _U32.pack(masked_crc(head)), payload, _U32.pack(masked_crc(payload))))


def _library_version() -> str:
    try:
        return importlib.metadata.version("kvledger")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class LogError(Exception):
    """Base of the log's errors."""


class LogFormatError(LogError, ValueError):
    """Not a kvledger log, or a major format version this library cannot read."""


class LogWriteError(LogError, RuntimeError):
    """The writer is closed, or failed (a write or fsync error) and cannot go on."""


@attrs.frozen(slots=True)
class StopInfo:
    """Where and why a reader stopped before the end of the data.

    ``kind``: ``"torn_tail"`` (the data ends inside a frame, or in zeros: a writer died
    mid-write, or the machine lost power; normal after a crash), ``"corrupt"`` (a checksum,
    length, payload, record or sequence number is wrong), ``"bad_header"`` (a segment header
    is damaged or does not chain to the previous segment). ``offset`` is the byte offset in
    ``path`` of the frame that could not be read.
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


# --- writer -------------------------------------------------------------------------------


def _segment_path(first: Path, number: int) -> Path:
    if number == 0:
        return first
    stem = first.name[: -len(".kvlog")] if first.name.endswith(".kvlog") else first.stem
    return first.with_name(f"{stem}.{number:06d}.kvlog")


class LogWriter:
    """Append-only writer: ``append(event)`` per event, ``end_step(step)`` per scheduler step.

    ``path`` is the first segment; it must not exist (a log is never overwritten). ``config``
    (msgpack-serialisable, string keys) goes into every segment header. ``rotate_bytes``: start
    a new segment once a segment reached this size (``None``: never). ``fsync``: ``"close"``
    (on rotation and close), ``"step"`` (also after every step) or ``"never"``.

    A step's events form one frame, written at ``end_step``; an event of another step than the
    pending ones first writes the pending frame (nothing is lost, steps stay exact). A step
    whose frame would exceed ``max_frame_bytes`` is written as several frames of that step.

    Not thread-safe: one writer belongs to one thread (the scheduler's).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: dict[str, Any] | None = None,
        *,
        rotate_bytes: int | None = DEFAULT_ROTATE_BYTES,
        fsync: Literal["close", "step", "never"] = "close",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        background: bool = False,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
    ) -> None:
        if fsync not in ("close", "step", "never"):
            raise ValueError(f"fsync must be 'close', 'step' or 'never', got {fsync!r}")
        if rotate_bytes is not None and rotate_bytes <= 0:
            raise ValueError(f"rotate_bytes must be positive or None, got {rotate_bytes!r}")
        if max_queue_bytes <= 0:
            raise ValueError(f"max_queue_bytes must be positive, got {max_queue_bytes!r}")
        self.config: dict[str, Any] = dict(config or {})
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self.max_frame_bytes = max_frame_bytes
        self.run_id = uuid.uuid4().hex
        self.paths: list[Path] = []
        self.seq = 0  # the next frame's seq
        self.closed = False
        self._first = Path(path)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._encoders = codec.encoder_table()
        self._encoder = codec.Encoder()
        self._refs = self._encoder.refs
        self._pending: list[bytes] = []  # the step's records, each packed
        self._frame_step = 0
        self._last_step = -1  # the step of the last frame written (-1: none yet)
        self._mark = 0
        self._failure: str | None = None
        self._failure_raised = False
        self._out: _Output = _BackgroundOutput(max_queue_bytes) if background else _DirectOutput()
        self._open = False  # a segment is open for writing
        # Steps dropped since the last frame written, because the background queue was full:
        # written as one loss record before the next frame ({} when none).
        self._lost: dict[str, int] = {}
        self.lost_frames = 0  # over the whole log
        self._digest = hashlib.blake2b(digest_size=16)
        self._size = 0
        self._rotate_due = False
        try:
            self._open_segment(0, "")
        except BaseException:
            # A log that cannot start (a full disk, a read-only directory) leaves no file
            # behind: an empty or header-less file would read as damage later.
            self._discard_first_segment()
            raise

    # --- public API -------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The segment being written."""
        return self.paths[-1]

    @property
    def failed(self) -> str | None:
        """Why the writer failed (a write or fsync error), or None."""
        return self._failure

    def append(self, event: Event) -> None:
        """Buffer ``event`` for its step's frame (encoded now: a later change of anything the
        event refers to cannot alter the log). Raises :class:`tracker.codec.EncodeError` for
        an object that is not an event the codec knows."""
        if not self._pending:
            self._begin_frame(event.step)
        elif event.step != self._frame_step:
            self._write_pending()
            self._begin_frame(event.step)
        fn = self._encoders.get(event.__class__)
        if fn is None:
            raise codec.EncodeError(f"not an event type the codec knows: {type(event)!r}")
        # Packed now, record by record, so that a value msgpack cannot hold (an int of 2**64,
        # an object) costs this record alone: the interning it did is undone, the rest of the
        # step's frame is untouched, and the caller can record the loss in its place.
        mark = len(self._refs)
        try:
            self._pending.append(self._packer.pack(fn(event, self._refs)))
        except (TypeError, ValueError, OverflowError) as e:
            self._packer.reset()
            self._encoder.rollback(mark)
            raise codec.EncodeError(
                f"cannot encode a {type(event).__name__} of step {event.step}: {e}"
            ) from None

    def end_step(self, step: int) -> None:
        """Write the frame of ``step`` (nothing if it has no events) and flush it to the OS."""
        self._check_usable()
        if not self._pending:
            return
        if step != self._frame_step:
            raise ValueError(
                f"end_step({step}) but the pending events belong to step {self._frame_step}"
            )
        if self._write_pending() and self.fsync == "step":
            self._fsync("step")

    def close(self) -> None:
        """Write pending events, fsync (unless ``fsync="never"``) and close. Idempotent.
        Raises :class:`LogWriteError` if the writer failed and that was not reported yet."""
        if self.closed:
            return
        unencodable: codec.EncodeError | None = None
        try:
            if self._failure is None and self._pending:
                try:
                    self._write_pending()
                except codec.EncodeError as e:  # the earlier steps still get their fsync
                    unencodable = e
            if self._failure is None and self._open:
                with contextlib.suppress(LogWriteError):  # recorded, and raised below
                    if self._lost:
                        self._write_lost()
                    self._write_end("closed")
            if self._failure is None and self.fsync != "never":
                self._fsync("close")
        finally:
            self.closed = True
            if self._open:
                self._open = False
                try:
                    self._out.close()
                except OSError as e:  # the data was flushed; report, do not retry
                    _logger.error("kvledger log close failed: %s: %s", self.path, e)
            failure = self._out.finish(CLOSE_TIMEOUT_S)
            if failure is not None:
                self._fail(failure)
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise LogWriteError(self._failure)
        if unencodable is not None:
            raise unencodable

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------

    def _discard_first_segment(self) -> None:
        self.closed = True
        if self._open:
            self._open = False
            with contextlib.suppress(OSError):
                self._out.close()
        self._out.finish(CLOSE_TIMEOUT_S)
        if self.paths:
            with contextlib.suppress(OSError):
                self.paths[0].unlink()

    def _check_usable(self) -> None:
        if self.closed:
            raise LogWriteError(f"LogWriter for {self._first} is closed")
        if self._failure is None and self._out.failure is not None:
            self._fail(self._out.failure)  # the background thread's write failed
        if self._failure is not None:
            self._failure_raised = True
            raise LogWriteError(f"LogWriter for {self._first} failed earlier: {self._failure}")

    def _begin_frame(self, step: int) -> None:
        self._check_usable()
        if self._rotate_due:
            self._rotate()
        self._frame_step = step
        self._mark = self._encoder.mark()

    def _open_segment(self, number: int, prev_digest: str) -> None:
        path = _segment_path(self._first, number)
        header = {
            "format": FORMAT,
            "library_version": _library_version(),
            "created_wall_ns": time.time_ns(),
            "run_id": self.run_id,
            "segment": number,
            "first_seq": self.seq,
            "prev_segment_digest": prev_digest,
            "config": self.config,
            "schemas": codec.schemas(),
            "transforms": codec.transforms(),
            "defaults": codec.defaults(),
        }
        try:
            payload = msgpack.packb(header, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"log config must be msgpack-serialisable: {e}") from e
        if len(payload) > MAX_HEADER_BYTES:
            raise ValueError(f"log header is {len(payload)} bytes, over {MAX_HEADER_BYTES}")
        self._out.open(path, sync_dir=self.fsync != "never")
        self._open = True
        self._digest = hashlib.blake2b(digest_size=16)
        self._size = 0
        self._rotate_due = False
        self.paths.append(path)
        self._encoder = codec.Encoder()
        self._refs = self._encoder.refs
        self._write(_PREAMBLE.pack(MAGIC, MAJOR, MINOR) + frame_bytes(payload))

    def _write_end(self, how: Literal["closed", "rotated"]) -> None:
        """The segment's end record: a frame whose payload is a map (a step's frame never
        is), so a reader tells a log that was closed, or rotated into a next segment, from
        one whose writer is still running or died (no end record)."""
        end = {"end": how, "frames": self.seq, "last_step": self._last_step}
        self._write(frame_bytes(msgpack.packb(end, use_bin_type=True)))

    def _rotate(self) -> None:
        number = len(self.paths)
        self._write_end("rotated")
        if self.fsync != "never":
            self._fsync("rotation")
            self._check_usable()
        try:
            self._open = False
            self._out.close()
            self._open_segment(number, self._digest.hexdigest())
        except OSError as e:
            self._fail(f"rotation to segment {number} failed: {e}")
            self._failure_raised = True
            raise LogWriteError(self._failure) from e

    def _write_pending(self) -> bool:
        """Write the pending frame; False when it was dropped (the background queue full)."""
        records = self._pending
        self._pending = []
        seq = self.seq
        try:
            payloads = self._pack(records)
        except codec.EncodeError:
            # Nothing of this step is written: forget its ids and seq numbers, so the log
            # stays consistent (the caller hears about the bad event).
            self._encoder.rollback(self._mark)
            self.seq = seq
            raise
        data = b"".join(frame_bytes(p) for p in payloads)
        if not self._out.room(len(data) + _LOST_RECORD_BYTES):
            # The disk is behind by max_queue_bytes: drop this step rather than block the
            # engine. Its ids and seq numbers are forgotten, so the log stays consistent, and
            # the loss is written in its place once the queue has room.
            self._encoder.rollback(self._mark)
            self.seq = seq
            self._lose(len(payloads), len(records))
            return False
        if self._lost:
            self._write_lost()
        self._write(data)
        self._last_step = self._frame_step
        self._mark = self._encoder.mark()
        if self.rotate_bytes is not None and self._size >= self.rotate_bytes:
            self._rotate_due = True
        return True

    def _lose(self, frames: int, records: int) -> None:
        lost = self._lost
        if not lost:
            _logger.warning(
                "kvledger log: the disk is behind by the queue's bound; dropping steps from %d "
                "until it catches up (the loss is recorded in the log)",
                self._frame_step,
            )
            lost.update(frames=0, records=0, first_step=self._frame_step)
        lost["frames"] += frames
        lost["records"] += records
        lost["last_step"] = self._frame_step
        self.lost_frames += frames

    def _write_lost(self) -> None:
        """The loss record: which steps were dropped, and how much of them. A map like the end
        record, so a reader knows the gap is a recorded fact, not damage."""
        self._write(frame_bytes(msgpack.packb({"lost": self._lost}, use_bin_type=True)))
        self._lost = {}

    def _pack(self, records: list[bytes]) -> list[bytes]:
        """Payloads for the pending records: one frame, or several of the same step when one
        would exceed ``max_frame_bytes``. The bytes are those of
        ``packb([seq, step, wall_ns, records])``, built from the records packed already."""
        pack, header = self._packer.pack, self._packer.pack_array_header
        payload = b"".join(
            (
                header(4),
                pack(self.seq),
                pack(self._frame_step),
                pack(time.time_ns()),
                header(len(records)),
                *records,
            )
        )
        if len(payload) <= self.max_frame_bytes and len(records) <= MAX_FRAME_RECORDS:
            self.seq += 1
            return [payload]
        if len(records) == 1:
            raise codec.EncodeError(
                f"one record of step {self._frame_step} takes {len(payload)} bytes, over "
                f"max_frame_bytes={self.max_frame_bytes}"
            )
        half = len(records) // 2
        return self._pack(records[:half]) + self._pack(records[half:])

    def _write(self, data: bytes) -> None:
        try:
            self._out.write(data)
        except OSError as e:
            self._fail(f"write to {self.path} failed: {e}")
            self._failure_raised = True
            raise LogWriteError(self._failure) from e
        self._digest.update(data)
        self._size += len(data)

    def _fsync(self, when: str) -> None:
        try:
            self._out.fsync()
        except OSError as e:
            self._fail(f"fsync of {self.path} failed ({when}): {e}; not retried")

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        _logger.error("kvledger log writer failed: %s", reason)


class _Output(Protocol):
    """Where a writer's bytes go. The writer decides every byte (frames, digests, rotation)
    on its own thread; an output only opens, writes, syncs and closes files."""

    @property
    def failure(self) -> str | None: ...

    def open(self, path: Path, *, sync_dir: bool) -> None: ...

    def write(self, data: bytes) -> None: ...

    def fsync(self) -> None: ...

    def close(self) -> None: ...

    def room(self, size: int) -> bool: ...

    def finish(self, timeout: float) -> str | None: ...


def _create(path: Path) -> IO[bytes]:
    try:
        return open(path, "xb")
    except FileExistsError:
        raise FileExistsError(f"{path} exists: a kvledger log is never overwritten") from None


class _DirectOutput:
    """Writes on the caller's thread: an error raises at once (``OSError``)."""

    failure: str | None = None

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None

    def open(self, path: Path, *, sync_dir: bool) -> None:
        self._file = _create(path)
        if sync_dir:
            _fsync_dir(path.parent)

    def write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._file.flush()

    def fsync(self) -> None:
        assert self._file is not None
        os.fsync(self._file.fileno())

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def room(self, size: int) -> bool:
        return True

    def finish(self, timeout: float) -> str | None:
        return None


class _BackgroundOutput(_DirectOutput):
    """Writes on a thread of its own, through a queue bounded in bytes, so a slow or hung
    disk never stalls the caller (vLLM's scheduler): the caller asks :meth:`room` before each
    frame and drops the frame when there is none. The first file is created, and its header
    written, on the caller's thread (a log that cannot start says so at once); after that an
    error is kept in :attr:`failure`, which the writer checks before each step, and what is
    queued after it is discarded.

    The caller's side costs a deque append per write: the thread wakes on its own every
    ``_WAKE_S``, or at once for anything but a write (an ``fsync``, a rotation, the stop) and
    when ``_WAKE_BYTES`` are waiting, and writes what it finds in one call. Each counter is
    written by one thread only (``_enqueued`` by the caller, ``_written`` by the thread), so
    neither needs a lock."""

    _WAKE_S = 0.05
    _WAKE_BYTES = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.failure: str | None = None
        self._enqueued = 0  # bytes handed over (the caller's thread only)
        self._written = 0  # bytes taken off the queue (the writer thread only)
        self._ops: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._thread: threading.Thread | None = None

    def open(self, path: Path, *, sync_dir: bool) -> None:
        if self._path is None:  # the first segment: on the caller's thread
            super().open(path, sync_dir=sync_dir)
            self._path = path
        else:
            self._put("open", (path, sync_dir))

    def write(self, data: bytes) -> None:
        if self._thread is None:
            # The first segment's header, on the caller's thread too: a log that cannot
            # start says so at once. The thread takes over from here.
            self._do("write", data)
            self._thread = threading.Thread(target=self._run, name="kvledger-log", daemon=True)
            self._thread.start()
            return
        self._ops.append(("write", data))
        self._enqueued += len(data)
        if self._enqueued - self._written >= self._WAKE_BYTES:
            self._wake.set()

    def fsync(self) -> None:
        self._put("fsync", None)

    def close(self) -> None:
        self._put("close", None)

    def room(self, size: int) -> bool:
        return self._enqueued - self._written + size <= self.max_bytes

    def finish(self, timeout: float) -> str | None:
        """Stop the thread once the queue is written; the failure, if any."""
        if self._thread is None:
            return self.failure
        self._put("stop", None)
        self._thread.join(timeout)
        if self._thread.is_alive() and self.failure is None:
            self.failure = (
                f"the log thread did not finish writing {self._path} within {timeout:.0f} s "
                f"({self._enqueued - self._written} bytes still queued): is the disk hung?"
            )
        return self.failure

    def _put(self, op: str, arg: Any) -> None:
        self._ops.append((op, arg))
        self._wake.set()

    def _run(self) -> None:
        ops, wake = self._ops, self._wake
        while True:
            wake.wait(self._WAKE_S)
            wake.clear()
            while ops:
                op, arg = ops.popleft()
                if op == "stop":
                    return
                if op == "write":  # with every write queued behind it: one call
                    parts = [arg]
                    while ops and ops[0][0] == "write":
                        parts.append(ops.popleft()[1])
                    arg = b"".join(parts)
                try:
                    if self.failure is None:
                        self._do(op, arg)
                except OSError as e:
                    self.failure = f"{op} of {self._path} failed: {e}"
                finally:
                    if op == "write":
                        self._written += len(arg)

    def _do(self, op: str, arg: Any) -> None:
        """One queued operation, done as the direct output does it."""
        if op == "write":
            _DirectOutput.write(self, arg)
        elif op == "fsync":
            _DirectOutput.fsync(self)
        elif op == "close":
            _DirectOutput.close(self)
        elif op == "open":
            path, sync_dir = arg
            _DirectOutput.open(self, path, sync_dir=sync_dir)
            self._path = path


def _fsync_dir(path: Path) -> None:
    # Make the new file's directory entry durable; best effort (not all systems allow it).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- reader -------------------------------------------------------------------------------


def segment_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``*.kvlog`` segments of one log in ``directory``, in order. A directory holding the
    segments of several logs (several stems) is an error: pass the files instead."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for p in Path(directory).iterdir():
        m = _SEGMENT_RE.match(p.name)
        if m is None or not p.is_file():
            continue
        found.setdefault(m["stem"], []).append((int(m["n"] or 0), p))
    if len(found) > 1:
        raise ValueError(
            f"{directory} holds segments of several logs {sorted(found)}; pass one log's files"
        )
    return [p for _, p in sorted(next(iter(found.values()), []))]


class _Stop(Exception):
    """Internal: the reader met damage (carries the StopInfo)."""

    def __init__(self, info: StopInfo) -> None:
        super().__init__(info.reason)
        self.info = info


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


class LogReader:
    """Reads a log: a file, a list of segment files, or a directory of one log's segments.

    Iterating yields :class:`Frame` objects; :meth:`iter_raw` yields :class:`RawFrame` objects
    (faster: no event objects, no field validation beyond record shape). Both stop at the
    first damage (torn tail, checksum mismatch, oversized length, undecodable payload, unknown
    tag, broken segment chain), after yielding every complete valid frame before it, and
    record why in :attr:`stop` (None after a clean end). With ``strict=True`` they raise
    :class:`LogCorruptError` instead. A file that is not a kvledger log, or has a major
    version this library cannot read, raises :class:`LogFormatError` in either mode.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        strict: bool = False,
    ) -> None:
        if isinstance(source, (str, os.PathLike)):
            p = Path(source)
            self.paths = segment_paths(p) if p.is_dir() else [p]
        else:
            self.paths = [Path(s) for s in source]
        self.max_frame_bytes = max_frame_bytes
        self.strict = strict
        self.stop: StopInfo | None = None
        # How the last read ended, when it ended without damage: "closed" (the writer closed
        # the log), "open" (no end record: a writer still running, or one that died after its
        # last complete step), "rotated" (the last segment here was rotated into a next one
        # that is not here: deleted, or the writer died starting it), "unknown" (written
        # before end records existed, format 1.0). See ENDINGS.
        self.ending: Ending | None = None
        # The first segment's number when it is not 0: the log's beginning is missing.
        self.missing_start: int | None = None
        self.last_step: int | None = None  # the step of the last frame read
        # Steps the writer dropped because the disk fell behind (its loss records):
        # {"first_step", "last_step", "frames", "records"} each.
        self.gaps: list[dict[str, int]] = []
        self._header: dict[str, Any] | None = None
        self._header_read = False

    @property
    def header(self) -> dict[str, Any] | None:
        """The first segment's header (None when it cannot be read; :attr:`stop` says why)."""
        if not self._header_read:
            self._header_read = True
            if self.paths:
                try:
                    with open(self.paths[0], "rb") as f:
                        self._header = self._read_header(f, str(self.paths[0]), _Hasher())
                except _Stop as s:
                    if self.strict:
                        raise LogCorruptError(s.info) from None
                    self.stop = s.info
        return self._header

    def __iter__(self) -> Iterator[Frame]:
        for seq, step, wall_ns, records, offset, path, decoder in self._frames():
            try:
                events = decoder.decode(step, records)
            except codec.DecodeError as e:
                self._damage(path, offset, f"frame seq {seq}: {e}", "corrupt")
                return
            yield Frame(seq, step, wall_ns, events, offset, path)

    def iter_raw(self) -> Iterator[RawFrame]:
        """Frames with their raw records (see :class:`RawFrame`), verified: checksums, frame
        shape, sequence, record shape, tags and interning."""
        for seq, step, wall_ns, records, offset, path, decoder in self._frames():
            try:
                decoder.resolve(records)
            except codec.DecodeError as e:
                self._damage(path, offset, f"frame seq {seq}: {e}", "corrupt")
                return
            yield RawFrame(seq, step, wall_ns, records, offset, path)

    # --- internals --------------------------------------------------------------------

    def _damage(self, path: str, offset: int, reason: str, kind: Any) -> None:
        info = StopInfo(path, offset, reason, kind)
        self.stop = info
        if self.strict:
            raise LogCorruptError(info)

    def _frames(
        self,
    ) -> Iterator[tuple[int, int, int, list[Any], int, str, codec.Decoder]]:
        """``(seq, step, wall_ns, records, offset, path, decoder)`` per verified frame, over
        all segments; stops (or raises when strict) at the first damage."""
        self.stop = None
        self.ending = None
        self.missing_start = None
        self.last_step = None
        self.gaps.clear()  # in place: a caller may hold the list while it reads
        prev: tuple[dict[str, Any], str, str] | None = None  # header, digest, path
        expect_seq: int | None = None
        try:
            for index, p in enumerate(self.paths):
                path = str(p)
                hasher = _Hasher()
                with open(p, "rb", buffering=1 << 20) as f:
                    try:
                        header = self._read_header(f, path, hasher)
                    except LogFormatError as e:
                        if index == 0:
                            raise  # not a kvledger log at all: the caller's error
                        # A later segment that is no log (zero-filled after a crash, say):
                        # damage like any other, after every frame before it was read.
                        raise _Stop(StopInfo(path, 0, str(e), "bad_header")) from None
                    if prev is not None:
                        _check_chain(prev, header, path)
                    else:
                        if header["segment"] != 0:
                            # Old segments deleted: what is here is read, and said to lack
                            # its start (a replay cannot rebuild the states before it).
                            self.missing_start = header["segment"]
                        expect_seq = header.get("first_seq", 0 if header["segment"] == 0 else None)
                    decoder = _decoder_for(header, path)
                    last = index == len(self.paths) - 1
                    end: dict[str, Any] | None = None
                    for offset, payload in _scan(f, path, self.max_frame_bytes, hasher, last):
                        if end is not None:
                            raise _Stop(
                                StopInfo(path, offset, "a frame after the end record", "corrupt")
                            )
                        if payload[:1] in _MAP_FIRST_BYTES:
                            marker = _unpack_marker(payload, path, offset)
                            if "lost" in marker:
                                self.gaps.append(marker["lost"])
                            else:
                                end = marker
                            continue
                        seq, step, wall_ns, records = _unpack_frame(payload, path, offset)
                        if expect_seq is not None and seq != expect_seq:
                            raise _Stop(
                                StopInfo(
                                    path,
                                    offset,
                                    f"frame seq {seq} where {expect_seq} was due",
                                    "corrupt",
                                )
                            )
                        expect_seq = seq + 1
                        if step < 0 or (self.last_step is not None and step < self.last_step):
                            # Steps only grow (a step may span several frames): a frame from
                            # the past is a spliced or forged log, not a record of this run.
                            after = (
                                "" if self.last_step is None else f" after step {self.last_step}"
                            )
                            raise _Stop(
                                StopInfo(path, offset, f"frame step {step}{after}", "corrupt")
                            )
                        self.last_step = step
                        yield seq, step, wall_ns, records, offset, path, decoder
                    size = f.tell()
                self._segment_end(header, end, path, size, last)
                prev = (header, hasher.hexdigest(), path)
        except _Stop as s:
            self.stop = s.info
            if self.strict:
                raise LogCorruptError(s.info) from None

    def _segment_end(
        self, header: dict[str, Any], end: dict[str, Any] | None, path: str, size: int, last: bool
    ) -> None:
        """Judge how a segment read to its end finished: the log's end, or a link on."""
        how = None if end is None else end.get("end")
        if header["minor"] < 1:  # written before end records existed
            if last:
                self.ending = "unknown"
            return
        if not last and how != "rotated":
            what = "was closed" if how == "closed" else "has no end record"
            raise _Stop(
                StopInfo(
                    path, size, f"segment {header['segment']} {what}, yet more follow", "corrupt"
                )
            )
        if last:
            self.ending = "open" if how is None else how

    def _read_header(self, f: IO[bytes], path: str, hasher: _Hasher) -> dict[str, Any]:
        pre = f.read(PREAMBLE_SIZE)
        if pre[:8] != MAGIC[: len(pre[:8])]:
            raise LogFormatError(
                f"{path}: offset 0: not a kvledger log: expected magic {MAGIC!r}, "
                f"found {bytes(pre[:8])!r}"
            )
        if len(pre) < PREAMBLE_SIZE:
            # An empty file is what a writer leaves if it died before its first byte.
            why = (
                "empty file" if not pre else f"the data ends inside the preamble ({len(pre)} bytes)"
            )
            raise _Stop(StopInfo(path, 0, why, "torn_tail"))
        _, major, minor = _PREAMBLE.unpack(pre)
        if major != MAJOR:
            newer = "written by a newer kvledger" if major > MAJOR else "an unknown format"
            raise LogFormatError(
                f"{path}: offset 8: {newer} (format {major}.x); this version reads {MAJOR}.x"
            )
        hasher.update(pre)
        try:
            offset, body = next(_scan(f, path, MAX_HEADER_BYTES, hasher, True))
        except StopIteration:
            raise _Stop(StopInfo(path, PREAMBLE_SIZE, "no header frame", "torn_tail")) from None
        except _Stop as s:  # a damaged header frame is a bad header, a torn one a torn tail
            kind = s.info.kind if s.info.kind == "torn_tail" else "bad_header"
            raise _Stop(
                attrs.evolve(s.info, reason=f"header: {s.info.reason}", kind=kind)
            ) from None
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
        header["major"], header["minor"] = major, minor
        return header


def _scan(
    f: IO[bytes], path: str, max_frame: int, hasher: _Hasher, last: bool
) -> Iterator[tuple[int, memoryview]]:
    """``(offset, payload)`` for each frame from the current position to a clean end of file;
    raises ``_Stop`` at a torn tail or a damaged frame. The length is checked (its own
    checksum, ``max_frame``, the file's size) before anything is read for the payload."""
    offset = f.tell()
    size = os.fstat(f.fileno()).st_size
    read = f.read
    update = hasher.update
    unpack_u32 = _U32.unpack_from
    tail = "" if last else " of a segment that is not the last"
    torn: Literal["torn_tail", "corrupt"] = "torn_tail" if last else "corrupt"
    while True:
        head = read(8)
        if len(head) < 8:
            if not head:
                return
            raise _Stop(StopInfo(path, offset, f"the data ends inside a frame header{tail}", torn))
        n, lcrc = _U32x2.unpack(head)
        if masked_crc(head[:4]) != lcrc:
            if last and _zeros_to_end(f, head):
                raise _Stop(_zero_tail(path, offset, size))
            raise _Stop(StopInfo(path, offset, "frame length checksum mismatch", "corrupt"))
        if n > max_frame:
            raise _Stop(
                StopInfo(
                    path,
                    offset,
                    f"frame length {n} exceeds max_frame_bytes={max_frame}",
                    "corrupt",
                )
            )
        body = read(n + 4) if offset + 12 + n <= size else b""
        if len(body) < n + 4:
            raise _Stop(
                StopInfo(
                    path,
                    offset,
                    f"the data ends inside a frame ({n + 4} bytes announced after its header, "
                    f"{max(0, size - offset - 8)} present){tail}",
                    torn,
                )
            )
        payload = memoryview(body)[:n]
        if masked_crc(payload) != unpack_u32(body, n)[0]:
            if last and _zeros_to_end(f, body):
                # The length reached the disk, the payload did not (a power loss).
                raise _Stop(_zero_tail(path, offset, size))
            raise _Stop(StopInfo(path, offset, "frame payload checksum mismatch", "corrupt"))
        update(head)
        update(body)
        yield offset, payload
        offset += 12 + n


def _zeros_to_end(f: IO[bytes], first: bytes) -> bool:
    """Whether ``first`` and everything after it in ``f`` are zero bytes: what a file system
    leaves after a power loss (blocks allocated, never written). Reads on to the end."""
    if any(first):
        return False
    while chunk := f.read(1 << 20):
        if any(chunk):
            return False
    return True


def _zero_tail(path: str, offset: int, size: int) -> StopInfo:
    return StopInfo(
        path,
        offset,
        f"zero-filled tail ({size - offset} bytes of zeros after the last complete frame: "
        "never written, as after a power loss)",
        "torn_tail",
    )


# A step's frame is an array; an end record is a map (fixmap, map 16, map 32).
_MAP_FIRST_BYTES: Final = frozenset(bytes([b]) for b in (*range(0x80, 0x90), 0xDE, 0xDF))


_LOST_KEYS: Final = frozenset({"frames", "records", "first_step", "last_step"})


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
        body = payload[start:]
        records = msgpack.unpackb(body, use_list=True, **limits)
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


class _Hasher:
    """BLAKE2b-128 over a segment's bytes, for the ``prev_segment_digest`` chain."""

    __slots__ = ("_h", "update")

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.update = self._h.update

    def hexdigest(self) -> str:
        return self._h.hexdigest()


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


def _decoder_for(header: dict[str, Any], path: str) -> codec.Decoder:
    try:
        return codec.Decoder(header["schemas"], header.get("transforms"))
    except codec.DecodeError as e:
        raise _Stop(StopInfo(path, PREAMBLE_SIZE, f"bad schema table: {e}", "bad_header")) from None


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


# --- following a log that is being written --------------------------------------------------


def newest_log(directory: str | os.PathLike[str]) -> Path | None:
    """The first segment of the newest log in ``directory`` (by the first segment's modification
    time; a log directory collects one log per engine start), or None when it holds none."""
    firsts: list[tuple[float, str, Path]] = []
    for p in Path(directory).iterdir():
        m = _SEGMENT_RE.match(p.name)
        if m is not None and m["n"] is None and p.is_file():
            with contextlib.suppress(OSError):
                firsts.append((p.stat().st_mtime, p.name, p))
    return max(firsts)[2] if firsts else None


class LogFollower:
    """Reads a log while another process writes it: each :meth:`poll` returns the frames
    completed since the previous one, following rotation into the next segment.

    A frame still being written (what a reader of a finished log calls a torn tail) is read
    again at the next poll, from its start; the segment chain and the frame sequence are
    checked as :class:`LogReader` checks them. ``ending`` becomes ``"closed"`` at the writer's
    end record (nothing more will come); ``stop`` holds real damage (nothing more is read).
    ``source``: the first segment's file, or a log directory (its newest log, once one is
    there)."""

    def __init__(
        self, source: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self.source = Path(source)
        self.max_frame_bytes = max_frame_bytes
        self.first: Path | None = None  # the first segment, once found
        self.header: dict[str, Any] | None = None  # the first segment's header, once read
        self.ending: Ending | None = None
        self.stop: StopInfo | None = None
        self.gaps: list[dict[str, int]] = []
        self._segment = 0
        self._f: IO[bytes] | None = None
        self._path = ""
        self._hasher = _Hasher()
        self._decoder: codec.Decoder | None = None
        self._seg_header: dict[str, Any] | None = None
        self._prev: tuple[dict[str, Any], str, str] | None = None
        self._expect_seq: int | None = None

    @property
    def done(self) -> bool:
        """Nothing more will come: the log was closed, or is damaged."""
        return self.ending == "closed" or self.stop is not None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def poll(self) -> list[Frame]:
        """The frames completed since the previous poll (none while the writer is idle)."""
        out: list[Frame] = []
        try:
            while not self.done and (self._f is not None or self._open_segment()):
                if not self._read(out):
                    break  # caught up with the writer
        except _Stop as s:
            self.stop = s.info
            self.close()
        return out

    def _open_segment(self) -> bool:
        if self.first is None:
            self.first = newest_log(self.source) if self.source.is_dir() else self.source
            if self.first is None:
                return False
        path = _segment_path(self.first, self._segment)
        try:
            f = open(path, "rb")  # noqa: SIM115 - held open across polls, closed at its end
        except FileNotFoundError:
            return False
        hasher = _Hasher()
        try:
            header = LogReader([path])._read_header(f, str(path), hasher)
        except _Stop as s:
            f.close()
            if s.info.kind == "torn_tail":
                return False  # the writer is still writing the header
            raise
        if self._prev is not None:
            _check_chain(self._prev, header, str(path))
        else:
            self.header = header
            self._expect_seq = header.get("first_seq", 0 if header["segment"] == 0 else None)
        self._f, self._path, self._hasher, self._seg_header = f, str(path), hasher, header
        self._decoder = _decoder_for(header, str(path))
        return True

    def _read(self, out: list[Frame]) -> bool:
        """Frames of the open segment up to what is written; True when it moved on to the
        next segment (read on), False when it caught up with the writer."""
        f, path, decoder = self._f, self._path, self._decoder
        assert f is not None and decoder is not None and self._seg_header is not None
        start = f.tell()
        try:
            for offset, payload in _scan(f, path, self.max_frame_bytes, self._hasher, True):
                start = offset
                if payload[:1] in _MAP_FIRST_BYTES:
                    marker = _unpack_marker(payload, path, offset)
                    if "lost" in marker:
                        self.gaps.append(marker["lost"])
                        start = f.tell()
                        continue
                    self._prev = (self._seg_header, self._hasher.hexdigest(), path)
                    self.close()
                    if marker["end"] == "closed":
                        self.ending = "closed"
                        return False
                    self._segment += 1
                    return True
                seq, step, wall_ns, records = _unpack_frame(payload, path, offset)
                if self._expect_seq is not None and seq != self._expect_seq:
                    raise _Stop(
                        StopInfo(
                            path,
                            offset,
                            f"frame seq {seq} where {self._expect_seq} was due",
                            "corrupt",
                        )
                    )
                self._expect_seq = seq + 1
                try:
                    events = decoder.decode(step, records)
                except codec.DecodeError as e:
                    raise _Stop(
                        StopInfo(path, offset, f"frame seq {seq}: {e}", "corrupt")
                    ) from None
                out.append(Frame(seq, step, wall_ns, events, offset, path))
                start = f.tell()
        except _Stop as s:
            if s.info.kind != "torn_tail":
                raise
            f.seek(s.info.offset)  # a frame being written: read it again, whole, next time
            return False
        f.seek(start)
        self.ending = "open"
        return False
