"""Open a captured log for reading: the one way every command reads a log.

A log is one file, a list of segment files (in order), or a directory holding the segments of
one log; a log split by rotation (``run.kvlog``, ``run.000001.kvlog``, ...) reads as one. A path
naming one segment of a rotated log names the whole log: every segment of it in the segment's
directory is read (:func:`log_files`); a list of files is read as it is.

One error model, for ``check``, ``diff``, ``show``, ``stats``, ``timeline`` and ``export``:

- a log that cannot be read at all (a missing path, a file that is not a kvledger log, a newer
  major format, a damaged first header, a directory with no log or with several) raises
  :class:`LogUnreadable`, whose message names the file and why (and :attr:`LogUnreadable.stop`
  says where, when damage was the cause); a missing path raises its subclass
  :class:`LogNotFound`;
- damage part-way is data, not an exception: each pass (:meth:`LogSource.frames`) yields every
  complete frame before it, and then :attr:`LogSource.damage` says where (file, byte offset)
  and why (a torn tail after a crash, a checksum mismatch, a broken segment chain, ...);
- how a log read without damage ended is data too (:attr:`LogSource.ending`: closed, still
  open, cut at a rotation, or too old to tell), as are steps its writer dropped
  (:attr:`LogSource.gaps`) and a missing beginning (:attr:`LogSource.missing_start`);
- segment files of the log that were not there to read (its first ones, or the one its last
  segment was rotated into) are :meth:`LogSource.missing_segments`; the command line says so
  after every command, and exits as ``check`` would (:func:`watch_opened`);
- a header whose tracker config cannot be used raises :class:`ConfigUnusable` from
  :meth:`LogSource.config`, for every command that needs the config (all but ``tail``): the
  same refusal as ``check``'s, never the defaults in its place.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvledger.replay.logreader import LogReader, segment_paths
from kvledger.tracker.config import ConfigError, TrackerConfig
from kvledger.tracker.events import Event
from kvledger.tracker.framing import (
    ENDINGS,
    Frame,
    LogFormatError,
    RawFrame,
    StopInfo,
    next_segment_name,
    parse_segment_name,
)

__all__ = [
    "ConfigUnusable",
    "LogNotFound",
    "LogPath",
    "LogSource",
    "LogUnreadable",
    "MissingSegments",
    "PathArg",
    "damage_dict",
    "log_files",
    "not_a_file",
    "open_log",
    "split_config",
    "take_opened",
    "watch_opened",
]

PathArg = str | os.PathLike[str]
LogPath = PathArg | Sequence[PathArg]

_TRACKER_FIELDS = frozenset(f.name for f in attrs.fields(TrackerConfig))


class LogUnreadable(ValueError):
    """Nothing at all could be read from the log: the message says which file and why;
    :attr:`stop` says where, when the first header was damaged. (A ``ValueError``, as the
    opener's errors always were; a missing file is also a ``FileNotFoundError``.)"""

    def __init__(self, message: str, stop: StopInfo | None = None) -> None:
        super().__init__(message)
        self.stop = stop


class LogNotFound(LogUnreadable, FileNotFoundError):
    """The log's path does not exist."""


class ConfigUnusable(ValueError):
    """The log's header holds a tracker config that cannot be used (:meth:`LogSource.config`).
    :attr:`problem` is what ``check`` reports; the message names the log too. (A
    ``ValueError``: every command's guard turns it into the message and exit 2.)"""

    def __init__(self, log: str, reason: str) -> None:
        self.log = log
        self.problem = f"the log header's tracker config cannot be used: {reason}"
        super().__init__(f"{log}: {self.problem}")


def split_config(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a header's ``config`` map into (tracker config fields, everything else).

    The connector writes one flat map: the ``TrackerConfig`` fields and run information
    (``vllm_version``, ``slot_bytes``, ...). A nested ``{"tracker": {...}}`` map is read too.
    """
    if not isinstance(config, dict):
        return {}, {}
    nested = config.get("tracker")
    if isinstance(nested, dict):
        extra = {k: v for k, v in config.items() if k != "tracker"}
        extra.update((k, v) for k, v in nested.items() if k not in _TRACKER_FIELDS)
        return {k: v for k, v in nested.items() if k in _TRACKER_FIELDS}, extra
    tracker = {k: v for k, v in config.items() if k in _TRACKER_FIELDS}
    extra = {k: v for k, v in config.items() if k not in _TRACKER_FIELDS}
    return tracker, extra


@attrs.frozen
class MissingSegments:
    """Segment files of a log that were not there to read: its first ones (``before``: the
    number of the first segment read, when it is not 0), or the one its last segment read was
    rotated into (``after``: that file's path)."""

    log: str
    read: int  # segment files read
    before: int | None = None
    after: str | None = None

    def why(self) -> str:
        """What is not there, in words."""
        why = []
        if self.before is not None:
            first = "segment 0" if self.before == 1 else f"segments 0 to {self.before - 1}"
            why.append(f"{first} (the log's start) not there")
        if self.after is not None:
            why.append(f"the last one was rotated into {self.after}, which is not there")
        return "; ".join(why)

    def describe(self) -> str:
        files = "1 segment" if self.read == 1 else f"{self.read} segments"
        return f"read {files} of this log, not all of it: {self.why()}"


class LogSource:
    """One log opened for reading. Build it with :func:`open_log`.

    - :attr:`name`: how to name the log in a message; :attr:`paths`: its segment files.
    - :attr:`header`: the first segment's header.
    - :attr:`tracker_config` / :attr:`run_info`: the header's ``config`` split into the
      ``TrackerConfig`` fields and the rest (``vllm_version``, ``slot_bytes``, ...).
    - :attr:`recorded`: whether a ``KVLedgerRecorder`` wrote it (connector/recorder.py).
    - :meth:`config`: the ``TrackerConfig`` the run used.
    - after a pass: :attr:`damage`, :attr:`ending`, :attr:`last_step`, :attr:`gaps`,
      :attr:`missing_start` (see the module docstring).
    """

    def __init__(self, reader: LogReader, name: str, header: dict[str, Any]) -> None:
        self._reader = reader
        self.name = name
        self.paths: list[Path] = list(reader.paths)
        self.header = header
        self.tracker_config, self.run_info = split_config(header.get("config"))
        self.damage: StopInfo | None = None

    @property
    def recorded(self) -> bool:
        """Whether a ``KVLedgerRecorder`` wrote the log (its header names the wrapped
        connector): what it holds is another connector's decisions, as facts."""
        return isinstance(self.run_info.get("recorder"), dict)

    @property
    def stop(self) -> StopInfo | None:
        """The damage of the last pass (the reader's name for it)."""
        return self.damage

    @property
    def ending(self) -> str | None:
        """How the last pass ended without damage: ``closed``, ``open``, ``rotated`` or
        ``unknown`` (``tracker.framing.ENDINGS`` says what each means); None after damage."""
        return self._reader.ending

    @property
    def stopped_by(self) -> str | None:
        """For a log sealed when the engine was asked to stop (connector/stopping.py), how it
        was asked: the end record's ``stop`` (``"SIGINT"``, ``"SIGTERM"``); else None."""
        end = self._reader.end
        stop = None if end is None else end.get("stop")
        return stop if isinstance(stop, str) else None

    @property
    def last_step(self) -> int | None:
        return self._reader.last_step

    @property
    def gaps(self) -> list[dict[str, int]]:
        return self._reader.gaps

    @property
    def missing_start(self) -> int | None:
        return self._reader.missing_start

    def missing_segments(self) -> MissingSegments | None:
        """Segment files of this log that were not there to read (see :class:`MissingSegments`;
        ``after`` is known once a pass has read to the end), or None."""
        before = self.header.get("segment")
        before = before if type(before) is int and before > 0 else None
        after = None
        if self.ending == "rotated" and self.paths:
            last = self.paths[-1]
            after = str(last.with_name(next_segment_name(last.name)))
        if before is None and after is None:
            return None
        return MissingSegments(self.name, len(self.paths), before, after)

    def describe_ending(self) -> str:
        """The ending in words, for a report (empty before a pass or after damage)."""
        ending = self.ending
        if ending is None:
            return ""
        text = ENDINGS[ending].format(last_step=self.last_step)
        if self.last_step is None:  # killed before its first step was written
            text = text.replace("after step None", "before its first step")
        return text

    def config(self) -> TrackerConfig:
        """The run's ``TrackerConfig``, from the header: the one place every command reads it.
        A value that cannot be used (``chunk_size`` 0, 17 or ``"32"``, ``num_slots`` 0, a
        ``salt`` of 5, ...) raises :class:`ConfigUnusable`, naming it: no command replaces it
        with a default, since every state, plan and miss reason derived under another
        configuration than the run's would be wrong."""
        try:
            return TrackerConfig.from_header({**self.tracker_config, "strict": False})
        except (ConfigError, TypeError) as e:
            raise ConfigUnusable(self.name, str(e)) from None

    def file_bytes(self) -> int:
        total = 0
        for p in self.paths:
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def frames(self) -> Iterator[Frame]:
        """Every readable frame, in order; sets :attr:`damage` when the pass ends."""
        self.damage = None
        try:
            yield from self._reader
        except LogFormatError as e:
            # A later segment that is not a kvledger log at all (zero-filled after a crash,
            # say): LogReader raises instead of stopping; it is damage like any other.
            self.damage = self._format_damage(e)
            return
        self.damage = self._reader.stop

    def raw_frames(self) -> Iterator[RawFrame]:
        """Like :meth:`frames`, as raw records (``LogReader.iter_raw``: no event objects)."""
        self.damage = None
        try:
            yield from self._reader.iter_raw()
        except LogFormatError as e:
            self.damage = self._format_damage(e)
            return
        self.damage = self._reader.stop

    def __iter__(self) -> Iterator[tuple[Event, Frame]]:
        for frame in self.frames():
            for event in frame.events:
                yield event, frame

    def _format_damage(self, e: LogFormatError) -> StopInfo:
        text = str(e)
        path = text.split(": offset", 1)[0] if ": offset" in text else self.name
        return StopInfo(path, 0, text, "bad_header")


def open_log(source: LogPath | LogSource) -> LogSource:
    """Open a log (a file, a list of segment files in order, or a directory holding one
    log's segments) and read its header. A :class:`LogSource` is returned as it is.

    Raises :class:`LogUnreadable`, naming the file and why, when nothing can be read."""
    if isinstance(source, LogSource):
        return source
    named = False  # one path: the log it names, whole
    if isinstance(source, (str, os.PathLike)):
        paths: list[PathArg] = [source]
        named = True
    else:
        paths = list(source)
        if not paths:
            raise LogUnreadable("no log file given")
    name = _name_of(paths)
    for p in paths:
        if not os.path.exists(p):
            raise LogNotFound(f"{os.fspath(p)}: no such file or directory")
        why = not_a_file(p)
        if why is not None:  # a pipe: read as an output error ("Illegal seek"); a FIFO: hung
            raise LogUnreadable(why)
    if len(paths) > 1 and any(os.path.isdir(p) for p in paths):
        raise LogUnreadable("pass one directory, or the segment files of one log")
    if named and not os.path.isdir(paths[0]):
        paths = list(log_files(paths[0]))
    try:
        reader = LogReader(paths[0] if len(paths) == 1 else paths)
        header = reader.header
    except LogFormatError as e:
        raise LogUnreadable(str(e)) from None
    except (OSError, ValueError) as e:
        raise LogUnreadable(f"{name}: {e}") from None
    if not reader.paths:
        raise LogUnreadable(f"{name}: no *.kvlog segment in this directory")
    if header is None:
        stop = reader.stop
        if stop is not None and stop.offset == 0 and stop.reason == "empty file":
            # Not damage to look into: nothing was ever written (a writer that died before
            # its first byte, or a file created by hand). Say so plainly.
            raise LogUnreadable(f"{stop.path}: empty file (0 bytes): not a log yet", stop)
        why = stop.describe() if stop is not None else "no header"
        raise LogUnreadable(f"unreadable header: {why}", stop)
    src = LogSource(reader, name, header)
    opened = _OPENED.get()
    if opened is not None:
        opened.append(src)
    return src


_NOT_FILES = (
    (stat.S_ISFIFO, "a pipe or FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: PathArg) -> str | None:
    """Why ``path`` cannot be read as a log, when it is neither a regular file nor a directory
    (a pipe, ``<(cat run.kvlog)``, a FIFO, a device), else None. A log is read from a regular
    file: a reader reads it more than once and seeks in it, and a FIFO with no writer would
    block it for ever."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing, or unreadable: opening it says why
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = next((what for test, what in _NOT_FILES if test(mode)), "not a file")
    return (
        f"{os.fspath(path)}: not a regular file ({kind}): a log must be a regular file "
        "(kvledger seeks in it); save it to a file first"
    )


def log_files(path: PathArg) -> list[Path]:
    """The files of the log that the file ``path`` belongs to, in order: when its name is a
    segment's (``run.kvlog``, ``run.000003.kvlog``), every segment of that log in its
    directory, so that a path naming one segment reads as the whole log (a missing start
    shows in the first header, a missing end in the last segment's end record); any other
    file alone."""
    p = Path(path)
    parsed = parse_segment_name(p.name)
    if parsed is None:
        return [p]
    found = segment_paths(p.parent, stem=parsed[0])
    return found if p.name in {f.name for f in found} else [p]


# The logs open_log opened, while a command runs under watch_opened (None: not watched).
_OPENED: contextvars.ContextVar[list[LogSource] | None] = contextvars.ContextVar(
    "kvledger_opened_logs", default=None
)


@contextlib.contextmanager
def watch_opened() -> Iterator[None]:
    """Collect every log :func:`open_log` opens in this context, so that the command line
    can ask, once a command has read them, whether each was whole
    (:meth:`LogSource.missing_segments`), wherever in the library it was opened."""
    token = _OPENED.set([])
    try:
        yield
    finally:
        _OPENED.reset(token)


def take_opened() -> list[LogSource]:
    """The logs opened under :func:`watch_opened` since the last call (none outside it)."""
    opened = _OPENED.get()
    if not opened:
        return []
    taken = list(opened)
    opened.clear()
    return taken


def _name_of(paths: Sequence[PathArg]) -> str:
    items = [os.fspath(p) for p in paths]
    return items[0] if len(items) == 1 else f"{items[0]} (+{len(items) - 1} segments)"


def damage_dict(d: StopInfo | None) -> dict[str, Any] | None:
    """A stop as plain values (for ``--json``)."""
    if d is None:
        return None
    return {"file": d.path, "offset": d.offset, "kind": d.kind, "reason": d.reason}
