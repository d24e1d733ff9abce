"""Open a captured log for replay: one file, a list of segment files, or a directory.

A log split by rotation (``run.kvlog``, ``run.000001.kvlog``, ...) reads as one log; so does a
directory holding the segments of one log (``tracker.log.segment_paths``). Iterating a
:class:`LogSource` yields ``(event, frame)`` pairs in log order: the frame says where the event
was read from (``frame.step``, ``frame.seq``, ``frame.offset`` in ``frame.path``).

Reading stops at the first damage, after every complete frame before it: :attr:`LogSource.stop`
then says where (file, byte offset) and why (a torn tail after a crash, a checksum mismatch, a
frame that claims more bytes than a frame may have, ...). A file that is not a kvledger log, or
has a major format version this library cannot read, raises :class:`tracker.log.LogFormatError`
when opened.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from tracker.config import TrackerConfig
from tracker.events import Event
from tracker.log import Frame, LogFormatError, LogReader, RawFrame, StopInfo

__all__ = ["LogFormatError", "LogSource", "StopInfo", "open_log", "split_config"]

PathArg = str | os.PathLike[str]

_TRACKER_FIELDS = frozenset(f.name for f in attrs.fields(TrackerConfig))


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


class LogSource:
    """One log opened for reading. Build it with :func:`open_log`.

    - :attr:`paths`: the segment files, in order.
    - :attr:`header`: the first segment's header (``None`` when it is damaged; :attr:`stop`
      then says why).
    - :attr:`tracker_config` / :attr:`run_info`: the header's ``config`` split into the
      ``TrackerConfig`` fields and the rest (``vllm_version``, ``slot_bytes``, ...).
    - :attr:`stop`: where and why the last read stopped early (``None`` after a clean end).
    - :attr:`total_bytes`: the size of all segments, for progress reports.
    """

    def __init__(self, reader: LogReader) -> None:
        self._reader = reader
        self.paths: list[Path] = list(reader.paths)
        self.header: dict[str, Any] | None = reader.header
        cfg = self.header.get("config") if self.header is not None else None
        self.tracker_config, self.run_info = split_config(cfg)
        self.total_bytes = sum(p.stat().st_size for p in self.paths if p.is_file())

    @property
    def stop(self) -> StopInfo | None:
        return self._reader.stop

    def frames(self) -> Iterator[Frame]:
        """Decoded frames, in order, until the end or the first damage."""
        return iter(self._reader)

    def raw_frames(self) -> Iterator[RawFrame]:
        """Verified frames with their raw records (no event objects): the fast path."""
        return self._reader.iter_raw()

    def __iter__(self) -> Iterator[tuple[Event, Frame]]:
        for frame in self._reader:
            for event in frame.events:
                yield event, frame

    def describe(self) -> str:
        return ", ".join(str(p) for p in self.paths) or "(no files)"


def open_log(
    source: PathArg | Sequence[PathArg],
    *,
    max_frame_bytes: int | None = None,
) -> LogSource:
    """Open a log: a file, a list of segment files (in order), or a directory holding the
    segments of one log. Reads the header now.

    Raises ``FileNotFoundError`` for a missing path, ``ValueError`` for a directory holding no
    log or the segments of several logs, :class:`tracker.log.LogFormatError` for a file that is
    not a kvledger log or whose major format version this library cannot read.
    """
    if isinstance(source, (str, os.PathLike)):
        paths: list[PathArg] = [source]
    else:
        paths = list(source)
        if not paths:
            raise ValueError("no log file given")
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"{os.fspath(p)}: no such file or directory")
    if len(paths) > 1 and any(os.path.isdir(p) for p in paths):
        raise ValueError("pass one directory, or the segment files of one log")
    arg: Any = paths[0] if len(paths) == 1 else paths
    kw = {} if max_frame_bytes is None else {"max_frame_bytes": max_frame_bytes}
    reader = LogReader(arg, **kw)
    if not reader.paths:
        raise ValueError(f"{os.fspath(paths[0])}: no *.kvlog segment in this directory")
    return LogSource(reader)
