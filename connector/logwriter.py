"""LogWriter: writes the kvledger log file, the connector's record of every step.

The format (framing, header, end and loss records, segment names) is :mod:`tracker.framing`'s,
built there without I/O; this module is the I/O around it: files, the clock, fsync, rotation,
and the background thread that keeps a slow disk off vLLM's scheduler thread. Readers live in
``replay/logreader.py``; both sides share nothing but the format (docs/design-notes.md, 13).

Segments: with ``rotate_bytes`` set, the writer starts a new file once the current one reached
that size: ``<stem>.kvlog``, ``<stem>.000001.kvlog``, ``<stem>.000002.kvlog``, ... Each segment is
self-contained (its own header, its own ``req_id`` interning) and names the BLAKE2b-128 digest of
every byte of the previous segment in ``prev_segment_digest``; frame ``seq`` numbers run on across
segments, so a reader notices a missing, reordered or foreign segment.

Durability: every ``end_step`` writes its frame and flushes it to the OS (a process crash loses
at most the step being written, seen as a torn tail), or, with ``background``, hands it to the
log's thread, which writes what was handed over in one call every 50 ms (``_WAKE_S``; at once
past 1 MiB, or for an fsync, a rotation, the seal): a group commit, whose crash loses what
was still handed over, the last 50 ms of steps (at most ``max_queue_bytes`` when the disk, or
the thread, is behind). ``fsync`` runs on rotation and on close (``fsync="step"`` also after
every step, ``"never"`` never). An ``fsync`` error is logged and
never retried (after a failed fsync the kernel may have dropped the dirty pages and a retry can
falsely succeed, "fsyncgate"): the writer marks itself failed and the next write, or ``close``,
raises :class:`LogWriteError`. Open a new log to continue. A failed ``write`` does the same.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Literal, Protocol

import msgpack

from kvledger.tracker import codec
from kvledger.tracker.events import Event, RecordLost, StepDecoded, int_tuple
from kvledger.tracker.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_FRAME_RECORDS,
    LogError,
    end_record,
    frame_bytes,
    lost_record,
    segment_header,
    segment_name,
    segment_start,
    step_payloads,
)

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEFAULT_MAX_QUEUE_BYTES",
    "DEFAULT_ROTATE_BYTES",
    "SEAL_TIMEOUT_S",
    "LogWriteError",
    "LogWriter",
]

DEFAULT_ROTATE_BYTES: Final = 256 << 20
# What the background writer may hold before the disk catches up; past it, steps are dropped
# (and the loss recorded), never the engine stalled.
DEFAULT_MAX_QUEUE_BYTES: Final = 64 << 20
# How long close() waits for the background writer to drain before it gives up and says so.
CLOSE_TIMEOUT_S: Final = 30.0
# How long seal() waits for the background writer to drain: a stopping engine is killed soon
# after it is asked to stop (at once by default), and must never wait long on a hung disk.
SEAL_TIMEOUT_S: Final = 2.0
# Room kept in the queue for the loss record itself.
_LOST_RECORD_BYTES: Final = 128
# What a step's frame adds to its records, at most: the payload's array headers, seq, step and
# wall clock (9 bytes each at most), and the frame's length, checksums.
_FRAME_OVERHEAD: Final = 48
# A segment's header names the previous segment's digest: 32 hex digits (BLAKE2b-128).
_DIGEST_HEX: Final = "0" * 32
# The segment digest is fed in pieces shorter than CPython's HASHLIB_GIL_MINSIZE (2048): a hash
# object that once took that much in one call releases the GIL around every later update. On
# vLLM's scheduler thread such a release is not free: it wakes the log's thread when that one
# waits for the GIL (about 15 us a step on a 2-vCPU VM), and releases this frequent and short
# starve it (3.11's GIL asks its holder to hand over only after 5 ms without a switch), so
# the queue grows while the disk idles. Measured in docs/performance.md ("the GIL").
_HASH_PIECE: Final = 2047

_logger = logging.getLogger("kvledger.log")


def _library_version() -> str:
    try:
        return importlib.metadata.version("kvledger")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class LogWriteError(LogError, RuntimeError):
    """The writer is closed, or failed (a write or fsync error) and cannot go on."""


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
        # The step's records, each packed, or a StepDecoded to pack with its frame (_Later),
        # and the bytes they take at most.
        self._pending: list[bytes | _Later] = []
        self._pending_size = 0
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
        # The bytes of the segment being written, as handed to the output (a step's frame
        # counted at its bound when the output frames it): for rotation. The output keeps
        # the exact count, and the segment's digest (_DirectOutput).
        self._size = 0
        self._rotate_due = False
        # Once sealed (seal()): where the end record starts, and how the engine was stopped.
        self._sealed_at: int | None = None
        self.stop: str | None = None
        try:
            self._open_segment(0)
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
        if type(event) is StepDecoded:
            self.append_decoded(event.step, event.nums, event.blocks, event.tokens, event.req_id)
            return
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
            record = self._packer.pack(fn(event, self._refs))
        except (TypeError, ValueError, OverflowError) as e:
            self._packer.reset()
            self._encoder.rollback(mark)
            raise codec.EncodeError(
                f"cannot encode a {type(event).__name__} of step {event.step}: {e}"
            ) from None
        self._pending.append(record)
        self._pending_size += len(record)

    def append_decoded(
        self,
        step: int,
        nums: Sequence[int],
        blocks: Sequence[int] = (),
        tokens: Sequence[int] = (),
        req_id: str = "",
    ) -> None:
        """``append(StepDecoded(step, req_id, nums, blocks, tokens))``, the event built where
        its frame is packed: the decode step's one record, which the connector writes every
        step. Packed with its frame (on the log's thread when there is one) once its req_id is
        interned; its fields are copied into tuples now, so a later change of the caller's
        lists cannot alter the log. Each int takes at most 9 bytes; one that is not an int
        costs this record (``_packed``)."""
        if not self._pending:
            self._begin_frame(step)
        elif step != self._frame_step:
            self._write_pending()
            self._begin_frame(step)
        later = (step, req_id, _tuple(nums), _tuple(blocks), _tuple(tokens), self._refs)
        if req_id in self._refs and self._sealed_at is None:
            self._pending.append(later)
            self._pending_size += 24 + 9 * (len(nums) + len(blocks) + len(tokens))
            return
        record = _packed(self._packer, later)
        self._pending.append(record)
        self._pending_size += len(record)

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

    def seal(self, stop: str, timeout: float = SEAL_TIMEOUT_S) -> bool:
        """Make the file a complete log now, and keep it complete: for an engine that was
        asked to stop (``stop`` says how, e.g. ``"SIGINT"``) and may be killed before it
        closes the log. What is pending is written as a frame of its step (a step may span
        frames), then an end record ``{"end": "closed", ..., "stop": stop}``. From then on
        the writer works on the caller's thread, and every frame is written in one call over
        the end record, together with a new one, so the file ends complete between any two
        writes; the segment is not rotated any more. Call it again to write what is pending;
        :meth:`close` still closes the log as usual.

        Returns False, changing nothing, when the writer is closed or failed; and when its
        background thread did not drain the queue within ``timeout`` (the writer is then
        failed: a hung disk)."""
        if self.closed or self._failure is not None or not self._open:
            return False
        if self._sealed_at is None:
            out = self._out.handover(timeout)
            if out is None:
                self._fail(self._out.failure or f"the log thread did not drain in {timeout} s")
                return False
            self._out = out
            self.stop = stop
            self._sealed_at = out.size
        try:
            if self._pending:
                self._write_pending()
            if self._lost:
                self._write_lost()
            self._write(b"")  # the end record, once more: it is already there after a write
        except (LogWriteError, codec.EncodeError):
            return False
        return True

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
        if self._rotate_due and self._sealed_at is None:
            self._rotate()
        self._frame_step = step
        self._mark = self._encoder.mark()

    def _open_segment(self, number: int) -> None:
        path = self._first.with_name(segment_name(self._first.name, number))
        # The header names the previous segment's digest, which the output holds (on the
        # log's thread, the bytes may not be written yet): it fills it in. Built here once to
        # check the config and to count its bytes (a digest is always 32 hex digits).
        start = functools.partial(
            _segment_start,
            library_version=_library_version(),
            created_wall_ns=time.time_ns(),
            run_id=self.run_id,
            segment=number,
            first_seq=self.seq,
            config=self.config,
        )
        size = len(start(_DIGEST_HEX if number else ""))
        try:
            self._out.open(path, start, sync_dir=self.fsync != "never")
        except LogWriteError as e:  # the header could not be written
            self._fail(str(e))
            self._failure_raised = True
            raise
        self._open = True
        self._size = size
        self._rotate_due = False
        self.paths.append(path)
        self._encoder = codec.Encoder()
        self._refs = self._encoder.refs

    def _write_end(self, how: Literal["closed", "rotated"]) -> None:
        """The segment's end record (:func:`tracker.framing.end_record`). A sealed log
        already ends with it."""
        self._write(b"" if self._sealed_at is not None else self._end_record(how))

    def _end_record(self, how: Literal["closed", "rotated"]) -> bytes:
        return end_record(how, self.seq, self._last_step, self.stop)

    def _rotate(self) -> None:
        number = len(self.paths)
        self._write_end("rotated")
        if self.fsync != "never":
            self._fsync("rotation")
            self._check_usable()
        try:
            self._open = False
            self._out.close()
            self._open_segment(number)
        except OSError as e:
            self._fail(f"rotation to segment {number} failed: {e}")
            self._failure_raised = True
            raise LogWriteError(self._failure) from e

    def _write_pending(self) -> bool:
        """Write the pending frame; False when it was dropped (the background queue full)."""
        records = self._pending
        size = self._pending_size + _FRAME_OVERHEAD
        self._pending = []
        self._pending_size = 0
        seq = self.seq
        if (
            size <= self.max_frame_bytes
            and len(records) <= MAX_FRAME_RECORDS
            and self._sealed_at is None
        ):
            # One frame: the output builds it (the payload, the checksums, the digest), on the
            # log's thread when there is one.
            if not self._out.room(size + _LOST_RECORD_BYTES):
                self._drop(seq, 1, len(records))
                return False
            if self._lost:
                self._write_lost()
            self._last_step = self._frame_step
            self.seq = seq + 1
            try:
                self._out.write_step(seq, self._frame_step, time.time_ns(), records, size)
            except OSError as e:
                self._failed_write(e)
            self._wrote(size)
            return True
        try:
            payloads = self._pack([_packed(self._packer, r) for r in records])
        except codec.EncodeError:
            # Nothing of this step is written: forget its ids and seq numbers, so the log
            # stays consistent (the caller hears about the bad event).
            self._encoder.rollback(self._mark)
            self.seq = seq
            raise
        data = b"".join(map(frame_bytes, payloads))
        if not self._out.room(len(data) + _LOST_RECORD_BYTES):
            self._drop(seq, len(payloads), len(records))
            return False
        if self._lost:
            self._write_lost()
        self._last_step = self._frame_step  # before the write: a sealed write ends with it
        self._write(data)
        self._mark = self._encoder.mark()
        self._wrote(0)
        return True

    def _drop(self, seq: int, frames: int, records: int) -> None:
        """The disk is behind by max_queue_bytes: drop this step rather than block the
        engine. Its ids and seq numbers are forgotten, so the log stays consistent, and the
        loss is written in its place once the queue has room."""
        self._encoder.rollback(self._mark)
        self.seq = seq
        self._lose(frames, records)

    def _wrote(self, size: int) -> None:
        """A step's frames went to the output (``size``: their bytes, when not counted yet)."""
        self._size += size
        self._mark = self._encoder.mark()
        if self.rotate_bytes is not None and self._size >= self.rotate_bytes:
            self._rotate_due = True

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
        """The loss record (:func:`tracker.framing.lost_record`): the steps dropped."""
        self._write(lost_record(self._lost))
        self._lost = {}

    def _pack(self, records: list[bytes]) -> list[bytes]:
        """Payloads for the pending records, stamped now, with the next seq numbers: one
        frame, or several of the same step (:func:`tracker.framing.step_payloads`)."""
        payloads = step_payloads(
            self._packer.pack,
            self._packer.pack_array_header,
            self.seq,
            self._frame_step,
            time.time_ns(),
            records,
            self.max_frame_bytes,
        )
        self.seq += len(payloads)
        return payloads

    def _write(self, data: bytes) -> None:
        try:
            if self._sealed_at is None:
                self._out.write(data)
            else:
                assert isinstance(self._out, _DirectOutput)
                self._out.overwrite(self._sealed_at, data + self._end_record("closed"))
                self._sealed_at += len(data)
        except OSError as e:
            self._failed_write(e)
        self._size += len(data)

    def _failed_write(self, e: OSError) -> None:
        self._fail(f"write to {self.path} failed: {e}")
        self._failure_raised = True
        raise LogWriteError(self._failure) from e

    def _fsync(self, when: str) -> None:
        try:
            self._out.fsync()
        except OSError as e:
            self._fail(f"fsync of {self.path} failed ({when}): {e}; not retried")

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        _logger.error("kvledger log writer failed: %s", reason)


def _segment_start(prev_segment_digest: str, **fields: Any) -> bytes:
    """A segment's first bytes (:func:`tracker.framing.segment_start`), naming the previous
    segment's digest."""
    return segment_start(segment_header(prev_segment_digest=prev_segment_digest, **fields))


# A StepDecoded appended (step, req_id, nums, blocks, tokens), built and packed when its frame
# is, with its segment's intern table.
_Later = tuple[int, str, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], dict[str, int]]


def _tuple(values: Sequence[Any]) -> tuple[Any, ...]:
    return values if type(values) is tuple else tuple(values)


_ENCODE_STEP: Final = codec.encoder_table()[StepDecoded]
_ENCODE_LOST: Final = codec.encoder_table()[RecordLost]


def _packed(packer: msgpack.Packer, record: bytes | _Later) -> bytes:
    """A pending record, packed. A StepDecoded's numbers are ints here (numpy's and torch's
    become ints: ``tracker.events.int_tuple``, as every id from vLLM is taken); one that is
    no integer, or one msgpack cannot hold (2**64), makes the record the ``RecordLost`` that
    says so, in its place: found where the frame is built, after the writer took it (values
    no tokenizer and no block pool give)."""
    if isinstance(record, bytes):
        return record
    step, req_id, nums, blocks, tokens, refs = record
    try:
        event = StepDecoded(step, req_id, int_tuple(nums), int_tuple(blocks), int_tuple(tokens))
        return packer.pack(_ENCODE_STEP(event, refs))  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as e:
        packer.reset()
        error = f"cannot encode a StepDecoded of step {step}: {e}"
        lost = RecordLost(step, req_id, "StepDecoded", error)
        return packer.pack(_ENCODE_LOST(lost, refs))  # type: ignore[no-any-return]


def _hash(digest: Any, data: bytes) -> None:
    """``digest.update(data)`` in pieces of at most ``_HASH_PIECE`` bytes: without ever
    releasing the GIL (see ``_HASH_PIECE``)."""
    if len(data) <= _HASH_PIECE:
        digest.update(data)
        return
    view = memoryview(data)
    for i in range(0, len(data), _HASH_PIECE):
        digest.update(view[i : i + _HASH_PIECE])


class _Output(Protocol):
    """Where a writer's bytes go. The writer decides what goes into the log (the records,
    their seq numbers, the frames' boundaries, rotation, the end); an output writes it: it
    opens, writes, syncs and closes the files, builds a step's frame from its records, and
    keeps each segment's byte count and digest (the next segment's header names it)."""

    size: int

    @property
    def failure(self) -> str | None: ...

    def open(self, path: Path, start: Callable[[str], bytes], *, sync_dir: bool) -> None: ...

    def write(self, data: bytes) -> None: ...

    def write_step(
        self, seq: int, step: int, wall_ns: int, records: list[bytes | _Later], size: int
    ) -> None: ...

    def fsync(self) -> None: ...

    def close(self) -> None: ...

    def room(self, size: int) -> bool: ...

    def finish(self, timeout: float) -> str | None: ...

    def handover(self, timeout: float) -> _DirectOutput | None: ...


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
        self._packer = msgpack.Packer(use_bin_type=True)
        self._digest: Any = None  # the segment's BLAKE2b-128 (None before the first)
        self.size = 0  # the segment's bytes

    def open(self, path: Path, start: Callable[[str], bytes], *, sync_dir: bool) -> None:
        """Start a segment at ``path`` with ``start(digest of the previous segment)``."""
        prev = "" if self._digest is None else self._digest.hexdigest()
        self._file = _create(path)
        try:
            if sync_dir:
                _fsync_dir(path.parent)
            self._digest = hashlib.blake2b(digest_size=16)
            self.size = 0
            _DirectOutput.write(self, start(prev))
        except BaseException as e:
            # A segment without its header would read as damage: none is left (a first
            # segment that cannot start, a full disk at rotation: the log says the rotated
            # segment is missing).
            with contextlib.suppress(OSError):
                _DirectOutput.close(self)
                path.unlink()
            if isinstance(e, OSError):
                raise LogWriteError(f"write to {path} failed: {e}") from e
            raise

    def write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._file.flush()
        _hash(self._digest, data)
        self.size += len(data)

    def write_step(
        self, seq: int, step: int, wall_ns: int, records: list[bytes | _Later], size: int
    ) -> None:
        """One frame of a step (``seq``; its ``records`` packed; ``size`` bounds its bytes)."""
        self.write(self._frame(seq, step, wall_ns, records))

    def _frame(self, seq: int, step: int, wall_ns: int, records: list[bytes | _Later]) -> bytes:
        packer = self._packer
        (payload,) = step_payloads(
            packer.pack,
            packer.pack_array_header,
            seq,
            step,
            wall_ns,
            [_packed(packer, r) for r in records],
            1 << 62,  # one frame: the writer checked its bound against max_frame_bytes
        )
        return frame_bytes(payload)

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

    def handover(self, timeout: float) -> _DirectOutput | None:
        """This output, written on the caller's thread from now on (None: it cannot be)."""
        return self

    def overwrite(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` in one call and end the file there: the sealed log's
        way to replace its end record with a frame and a new end record. A process killed
        around the call leaves the old end record or the new one, never a file without one
        (short of a power loss, or a write over a page that a kill cuts short: a torn tail)."""
        assert self._file is not None
        fd = self._file.fileno()
        os.pwrite(fd, data, offset)
        os.ftruncate(fd, offset + len(data))


class _BackgroundOutput(_DirectOutput):
    """Writes on a thread of its own, through a queue bounded in bytes, so a slow or hung
    disk never stalls the caller (vLLM's scheduler): the caller asks :meth:`room` before each
    frame and drops the frame when there is none. The first segment is created, and its
    header written, on the caller's thread (a log that cannot start says so at once); after
    that an error is kept in :attr:`failure`, which the writer checks before each step, and
    what is queued after it is discarded.

    The caller's side costs a deque append per step: the thread builds the step's frame (its
    payload, checksums, and the segment's digest) and writes it. In vLLM that is Python work
    done while the scheduler thread waits for the model, off the step's path. The thread
    wakes on its own every ``_WAKE_S``, or at once for anything but a step (an ``fsync``, a
    rotation, the stop) and when ``_WAKE_BYTES`` are waiting, and writes what it finds then in
    one call; what comes while it frames waits for the next round. Each counter is written by
    one thread only (``_enqueued`` by the caller, ``_written`` by the thread), so neither needs
    a lock; a step counts at the bound the writer gave it on both sides."""

    _WAKE_S = 0.05
    _WAKE_BYTES = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.failure: str | None = None
        self._enqueued = 0  # bytes handed over (the caller's thread only)
        self._written = 0  # bytes taken off the queue (the writer thread only)
        self._ops: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._path: Path | None = None
        self._thread: threading.Thread | None = None
        # Between rounds, holding no op (the thread's, read by handover): an empty queue alone
        # does not say it, as an op taken off it may still be running (an open, a close).
        self._idle = True

    def open(self, path: Path, start: Callable[[str], bytes], *, sync_dir: bool) -> None:
        if self._thread is None:
            # The first segment and its header, on the caller's thread: a log that cannot
            # start says so at once. The thread takes over from here.
            super().open(path, start, sync_dir=sync_dir)
            self._path = path
            self._thread = threading.Thread(target=self._run, name="kvledger-log", daemon=True)
            self._thread.start()
        else:
            self._put("open", (path, start, sync_dir))

    def write(self, data: bytes) -> None:
        self._queue(("write", data), len(data))

    def write_step(
        self, seq: int, step: int, wall_ns: int, records: list[bytes | _Later], size: int
    ) -> None:
        self._queue(("step", (seq, step, wall_ns, records, size)), size)

    def _queue(self, op: tuple[str, Any], size: int) -> None:
        self._ops.append(op)
        self._enqueued += size
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

    def handover(self, timeout: float) -> _DirectOutput | None:
        """Drain the queue and stop the thread; the file goes on as a direct output. When the
        thread has written every byte handed to it and holds nothing else to do (the usual case
        between steps), it is told to stop and not waited for: a stopping engine may be killed
        within a millisecond, and the thread touches the file no more. A thread in a round
        (opening the next segment, say) is waited for."""
        if (
            self._thread is not None
            and self._idle
            and not self._ops
            and self._enqueued == self._written
        ):
            self._put("stop", None)
        elif self.finish(timeout) is not None:
            return None
        direct = _DirectOutput()
        direct._file, self._file = self._file, None
        direct._digest, direct.size = self._digest, self.size
        return direct

    def _put(self, op: str, arg: Any) -> None:
        self._ops.append((op, arg))
        self._wake.set()

    def _run(self) -> None:
        ops, wake = self._ops, self._wake
        began = time.monotonic()
        while True:
            # A round every _WAKE_S from the start of the last: a thread that is behind goes
            # on at once.
            wake.wait(max(0.0, began + self._WAKE_S - time.monotonic()))
            wake.clear()
            began = time.monotonic()
            self._idle = False
            # What was handed over by now, and no more: the steps queued while these are framed
            # wait for the next round. Taking them too, a thread that frames no faster than the
            # scheduler steps (the two share the CPU and the GIL) frames on and writes nothing
            # until the scheduler pauses, and a crash loses all of it.
            due = len(ops)
            while due:
                op, arg = ops.popleft()
                due -= 1
                if op == "stop":
                    return
                size = 0
                try:
                    if op in _DATA:  # with every write due behind it: one call
                        parts = []
                        while True:
                            size += len(arg) if op == "write" else arg[-1]
                            if self.failure is None:
                                parts.append(arg if op == "write" else self._frame(*arg[:-1]))
                            if not due or ops[0][0] not in _DATA:
                                break
                            op, arg = ops.popleft()
                            due -= 1
                        op = "write"
                        if self.failure is None:
                            self._do(op, b"".join(parts))
                    elif self.failure is None:
                        self._do(op, arg)
                except Exception as e:  # an OSError; anything else is a bug, but the same loss
                    self.failure = f"{op} of {self._path} failed: {e}"
                finally:
                    self._written += size
            self._idle = True

    def _do(self, op: str, arg: Any) -> None:
        """One queued operation, done as the direct output does it."""
        if op == "write":
            _DirectOutput.write(self, arg)
        elif op == "fsync":
            _DirectOutput.fsync(self)
        elif op == "close":
            _DirectOutput.close(self)
        elif op == "open":
            path, start, sync_dir = arg
            _DirectOutput.open(self, path, start, sync_dir=sync_dir)
            self._path = path


# The queued operations that carry bytes (written together, in one call).
_DATA: Final = frozenset({"write", "step"})


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
