"""Test helpers that cut log files the way crashes do."""

from __future__ import annotations

import struct
from pathlib import Path

_MAP_FIRST = {*range(0x80, 0x90), 0xDE, 0xDF}  # msgpack maps: the end record's payload


def step_frames_end(data: bytes) -> int:
    """The offset just past the last step frame (before the end record, if there is one)."""
    pos, spans = 12, []
    while pos + 8 <= len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        spans.append((pos, pos + 12 + n))
        pos += 12 + n
    if spans and spans[-1][1] <= len(data) and data[spans[-1][0] + 8] in _MAP_FIRST:
        spans.pop()
    return spans[-1][1]


def torn_copy(src: Path, dst: Path, cut: int) -> Path:
    """``src`` with its last step frame torn ``cut`` bytes before its end (and no end record),
    as a writer killed mid-write leaves it."""
    data = src.read_bytes()
    dst.write_bytes(data[: step_frames_end(data) - cut])
    return dst
