"""The most memory a piece of work takes, for the tests that bound it.

On Linux: the resident set's high-water mark (``VmHWM``), reset to the resident set just
before the work (``/proc/self/clear_refs``, Linux 4.0 and later) and read after it, less the
resident set before. That is every page the process touched for the work, C libraries'
included (DuckDB's, msgpack's buffers), at no cost to the work. ``tracemalloc`` counts
Python's own allocations only, and made the work it watched 4 to 25 times slower (the
hostile corpus took three minutes of the suite under it). Where the reset is not allowed,
tracemalloc's peak, as before.

A page the process freed to its allocator but kept (a half-used arena) is reused without
raising the mark, so a figure can read low by what earlier work left behind; the bounds the
tests assert are tens of megabytes wide, and what they guard against (a bomb, a frame taken
whole) is gigabytes.
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class Peak:
    """What :func:`peak_memory` measured, in bytes (set when its block ends)."""

    def __init__(self, how: str) -> None:
        self.how = how  # "rss" or "tracemalloc"
        self.bytes = 0


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"{field} is not in {_STATUS}")


def _reset_mark() -> bool:
    """Reset the high-water mark to the resident set now (False: not allowed here)."""
    try:
        _CLEAR_REFS.write_text("5")
        _status_kib("VmHWM")
    except (OSError, LookupError):
        return False
    return True


@contextlib.contextmanager
def traced_peak() -> Iterator[Peak]:
    """``tracemalloc``'s peak over the block: Python's allocations only, and exact to the
    byte, for the bounds of a few MiB that the resident set's noise would swamp."""
    peak = Peak("tracemalloc")
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


@contextlib.contextmanager
def peak_memory() -> Iterator[Peak]:
    """``with peak_memory() as peak: work()``, then ``peak.bytes``."""
    try:
        before = _status_kib("VmRSS")
    except (OSError, LookupError):
        before = None
    if before is None or not _reset_mark():
        with traced_peak() as peak:
            yield peak
        return
    peak = Peak("rss")
    try:
        yield peak
    finally:
        peak.bytes = max(0, _status_kib("VmHWM") - before) << 10
