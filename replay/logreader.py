"""Reading the kvledger log file: :class:`LogReader` (a log as it is on disk) and
:class:`LogFollower` (a log while another process writes it).

Both are file I/O around one :class:`tracker.framing.FrameValidator`: they open the segment
files in order, hand it their bytes, and build :class:`tracker.framing.Frame` objects from the
frames it verified. What is valid is decided there, once, so ``kvledger tail`` refuses exactly
what ``kvledger check`` refuses. The writer is ``connector/logwriter.py``. Commands open logs
through ``replay/source.py``, which decides which files make up a log named by a path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Final, TypeVar

from kvledger.tracker.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    Ending,
    Frame,
    FrameValidator,
    LogCorruptError,
    RawFrame,
    StepFrame,
    StopInfo,
    next_segment_name,
    parse_segment_name,
)

__all__ = ["LogFollower", "LogReader", "newest_log", "segment_paths"]

# How much is read at a time: large enough that the per-read cost vanishes, small enough that
# reading a log costs the same memory whatever its length (plus one frame, when larger).
_CHUNK: Final = 1 << 20
# The header is read on its own (LogReader.header) in a smaller piece: most of a file is frames.
_HEADER_CHUNK: Final = 1 << 16

_F = TypeVar("_F", Frame, RawFrame)


def _read(f: IO[bytes], wanted: int, chunk: int = _CHUNK) -> bytes:
    """The next piece of ``f``: a chunk, or more when the frame in progress needs more, but
    never more than the file holds (a hostile length allocates nothing)."""
    n = chunk
    if wanted > n:
        n = max(n, min(wanted, os.fstat(f.fileno()).st_size - f.tell()))
    return f.read(n)


def _feed_all(v: FrameValidator, f: IO[bytes]) -> Iterator[StepFrame]:
    """Feed ``v`` what ``f`` holds from where it is to its end (or to damage)."""
    while v.problem is None:
        at = f.tell()
        # No name here holds the piece read: the validator drops it once it is in its own
        # buffer, so a frame as large as the bound is held once, not twice, while decoded.
        yield from v.feed(_read(f, v.wanted))
        if f.tell() == at:
            return


def _event_frame(v: FrameValidator, frame: StepFrame) -> Frame | None:
    """A verified frame with its events (None: a record could not be decoded)."""
    events = v.events(frame)
    if events is None:
        return None
    seq, step, wall_ns, _, offset = frame
    return Frame(seq, step, wall_ns, events, offset, v.path)


def _raw_frame(v: FrameValidator, frame: StepFrame) -> RawFrame | None:
    """A verified frame with its raw records (None: a record is malformed)."""
    if not v.resolve(frame):
        return None
    seq, step, wall_ns, records, offset = frame
    return RawFrame(seq, step, wall_ns, records, offset, v.path)


def _segments_in(directory: Path) -> dict[str, list[tuple[int, Path]]]:
    """The ``*.kvlog`` segment files in ``directory``, by log (stem), with their numbers."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for p in directory.iterdir():
        parsed = parse_segment_name(p.name)
        if parsed is not None and p.is_file():
            found.setdefault(parsed[0], []).append((parsed[1], p))
    return found


def segment_paths(directory: str | os.PathLike[str], stem: str | None = None) -> list[Path]:
    """The ``*.kvlog`` segments of one log in ``directory``, in order: of the log named
    ``stem`` (``run`` for ``run.kvlog``, ``run.000001.kvlog``, ...), or of the only log there
    (a directory holding the segments of several logs is then an error: pass the files)."""
    found = _segments_in(Path(directory))
    if stem is not None:
        return [p for _, p in sorted(found.get(stem, []))]
    if len(found) > 1:
        raise ValueError(
            f"{directory} holds segments of several logs {sorted(found)}; pass one log's files"
        )
    return [p for _, p in sorted(next(iter(found.values()), []))]


def newest_log(directory: str | os.PathLike[str]) -> Path | None:
    """The first segment there of the newest log in ``directory`` (by that segment's
    modification time; a log directory collects one log per engine start), or None when it
    holds none. A log whose first segments were deleted (retention) is still a log: its first
    segment there is returned, and its header says that the log's start is missing
    (``LogFollower.missing_start``), as ``check`` and ``stats`` say."""
    firsts: list[tuple[float, str, Path]] = []
    for segments in _segments_in(Path(directory)).values():
        for _, p in sorted(segments):  # the lowest number there: 0, unless it was deleted
            with contextlib.suppress(OSError):
                firsts.append((p.stat().st_mtime, p.name, p))
                break
    return max(firsts)[2] if firsts else None


def _successor(path: Path) -> Path | None:
    """The segment file after ``path`` in its directory: the next one, or when it is not there,
    the first later one of the same log (a writer starts segments in order, so a later one
    there means the next is missing); None when there is none yet."""
    following = path.with_name(next_segment_name(path.name))
    if following.exists():
        return following
    parsed = parse_segment_name(following.name)
    assert parsed is not None
    stem, number = parsed
    with contextlib.suppress(OSError):
        for p in segment_paths(path.parent, stem=stem):
            if (parse_segment_name(p.name) or (stem, 0))[1] > number:
                return p
    return None


class LogReader:
    """Reads a log: a file, a list of segment files, or a directory of one log's segments.

    Iterating yields :class:`Frame` objects; :meth:`iter_raw` yields :class:`RawFrame` objects
    (faster: no event objects, no field validation beyond record shape). Both stop at the
    first damage (:class:`tracker.framing.FrameValidator` says what that is), after yielding
    every complete valid frame before it, and record why in :attr:`stop` (None after a clean
    end). With ``strict=True`` they raise :class:`LogCorruptError` instead. A file that is not
    a kvledger log, or has a major version this library cannot read, raises
    :class:`tracker.framing.LogFormatError` in either mode.

    A file is read as it is named: ``replay.source.open_log`` is the opener that reads a path
    naming one segment of a rotated log as the whole log.
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
        # Steps the writer dropped because the disk fell behind (its loss records):
        # {"first_step", "last_step", "frames", "records"} each. One list for every pass,
        # refilled in place: a caller may hold it while it reads.
        self.gaps: list[dict[str, int]] = []
        self._validator: FrameValidator | None = None  # the last pass's
        self._header: dict[str, Any] | None = None
        self._header_read = False

    @property
    def ending(self) -> Ending | None:
        """How the last read ended, when it ended without damage: ``"closed"`` (the writer
        closed the log), ``"open"`` (no end record: a writer still running, or one that died
        after its last complete step), ``"rotated"`` (the last segment here was rotated into
        a next one that is not here: deleted, or the writer died starting it), ``"unknown"``
        (written before end records existed, format 1.0). See ``ENDINGS``."""
        return None if self._validator is None else self._validator.ending

    @property
    def end(self) -> dict[str, Any] | None:
        """The last segment's end record as read, e.g. ``{"end": "closed", "frames": N,
        "last_step": S}``, with ``"stop"`` (the signal) for a log sealed when the engine was
        asked to stop; None without one."""
        return None if self._validator is None else self._validator.end

    @property
    def missing_start(self) -> int | None:
        """The first segment's number when it is not 0: the log's beginning is missing."""
        return None if self._validator is None else self._validator.missing_start

    @property
    def last_step(self) -> int | None:
        """The step of the last frame read."""
        return None if self._validator is None else self._validator.last_step

    @property
    def header(self) -> dict[str, Any] | None:
        """The first segment's header (None when it cannot be read; :attr:`stop` says why)."""
        if not self._header_read:
            self._header_read = True
            if self.paths:
                v = FrameValidator(max_frame_bytes=self.max_frame_bytes)
                v.begin(str(self.paths[0]))
                with open(self.paths[0], "rb", buffering=0) as f:
                    while v.header is None and v.problem is None:
                        data = _read(f, v.wanted, _HEADER_CHUNK)
                        if not data:
                            v.end_segment(last=True)  # the file ends before its header
                            break
                        for _ in v.feed(data):
                            break  # the header is read before any frame
                if v.problem is not None:
                    if self.strict:
                        raise LogCorruptError(v.problem)
                    self.stop = v.problem
                self._header = v.header
        return self._header

    def __iter__(self) -> Iterator[Frame]:
        return self._pass(_event_frame)

    def iter_raw(self) -> Iterator[RawFrame]:
        """Frames with their raw records (see :class:`RawFrame`), verified: checksums, frame
        shape, sequence, steps, record shape, tags and interning."""
        return self._pass(_raw_frame)

    # --- internals --------------------------------------------------------------------

    def _pass(self, make: Callable[[FrameValidator, StepFrame], _F | None]) -> Iterator[_F]:
        """One read of the whole log: ``make`` builds each frame the validator verified (None:
        a record it could not decode, which ends the pass as damage)."""
        self.stop = None
        v = self._validator = FrameValidator(max_frame_bytes=self.max_frame_bytes, gaps=self.gaps)
        frames = self._verified(v)
        try:
            for frame in frames:
                built = make(v, frame)
                if built is None:
                    break
                yield built
        finally:
            frames.close()
        self.stop = v.problem
        if self.stop is not None and self.strict:
            raise LogCorruptError(self.stop)

    def _verified(self, v: FrameValidator) -> Generator[StepFrame, None, None]:
        """Every segment's bytes through the validator, each segment begun and ended on it;
        the step frames it verified. Stops at damage."""
        for index, p in enumerate(self.paths):
            v.begin(str(p))
            with open(p, "rb", buffering=0) as f:
                yield from _feed_all(v, f)
            v.end_segment(last=index == len(self.paths) - 1)
            if v.problem is not None:
                return


class LogFollower:
    """Reads a log while another process writes it: each :meth:`poll` returns the frames
    completed since the previous one, following rotation into the next segment.

    The bytes go through the same :class:`tracker.framing.FrameValidator` as
    :class:`LogReader`'s, as they arrive: a frame still being written (what a reader of a
    finished log calls a torn tail) waits for its last bytes. A segment is over at its end
    record, or once the next segment exists (the writer starts one only after ending the
    last): then it is judged as the reader judges a segment that is not the last. ``ending``
    becomes ``"closed"`` at the writer's end record (nothing more will come); ``stop`` holds
    real damage (nothing more is read). ``source``: the first segment's file, or a log
    directory (its newest log, once one is there)."""

    def __init__(
        self, source: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self.source = Path(source)
        self.max_frame_bytes = max_frame_bytes
        self.first: Path | None = None  # the first segment, once found
        self.ending: Ending | None = None
        self.stop: StopInfo | None = None
        self.gaps: list[dict[str, int]] = []
        self._validator = FrameValidator(max_frame_bytes=max_frame_bytes, gaps=self.gaps)
        self._f: IO[bytes] | None = None
        self._next: Path | None = None  # the segment to open next
        self._done: Path | None = None  # the last segment read to its end

    @property
    def header(self) -> dict[str, Any] | None:
        """The first segment's header, once read."""
        return self._validator.first_header

    @property
    def missing_start(self) -> int | None:
        """The first segment's number when it is not 0: the log's beginning is missing."""
        return self._validator.missing_start

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
        while not self.done and (self._f is not None or self._open_segment()):
            if not self._read(out):
                break  # caught up with the writer
        if self._validator.problem is not None and self.stop is None:
            self.stop = self._validator.problem
            self.close()
        return out

    def _open_segment(self) -> bool:
        if self._next is None:
            first = newest_log(self.source) if self.source.is_dir() else self.source
            if first is None:
                return False
            self.first = self._next = first
        elif self._done is not None and not self._next.exists():
            # The next segment is missing while a later one is there: read the later one, whose
            # header then says that the chain is broken, as a reader of the files says.
            self._next = _successor(self._done) or self._next
        try:
            self._f = open(self._next, "rb", buffering=0)  # noqa: SIM115 - held across polls
        except FileNotFoundError:
            return False
        self._validator.begin(str(self._next))
        return True

    def _read(self, out: list[Frame]) -> bool:
        """Read the open segment up to what is written; True when it is over and the next one
        is due (read on), False when caught up with the writer, closed or damaged."""
        v = self._validator
        assert self._next is not None
        current = self._next
        self._drain(out)
        over = v.end is not None
        if not over and v.problem is None and _successor(current) is not None:
            # A later segment exists, so this one was finished before it started: what is
            # written now is all of it.
            self._drain(out)
            over = True
        if v.problem is not None or not over:
            if v.problem is None:
                self.ending = "open"
            return False
        closed = v.end is not None and v.end.get("end") == "closed"
        v.end_segment(last=closed and _successor(current) is None)
        self.close()
        if v.problem is not None:
            return False
        if closed:
            self.ending = "closed"
            return False
        self._done = current
        self._next = current.with_name(next_segment_name(current.name))
        return True

    def _drain(self, out: list[Frame]) -> None:
        """Hand the validator what the open segment holds now; the frames it completes go to
        ``out``."""
        v = self._validator
        assert self._f is not None
        for frame in _feed_all(v, self._f):
            built = _event_frame(v, frame)
            if built is None:
                return
            out.append(built)
