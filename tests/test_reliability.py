"""The reliability figures, kept as tests so they cannot regress (docs/log-format.md, "What is
guaranteed"): every single-bit flip and every garbage overwrite of a real log is detected at
the frame it hit; no truncation of a closed log reads as complete; reading stays bounded.

Inputs are seeded: the same 400 flips and 400 overwrites every run. The log is a real one
(``tests/data/replay-clean.kvlog``, vLLM's scheduler with the connector) re-written by this
version's writer in three segments, so end records and the segment chain are covered too.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from _replay_logs import copy_log

from kvledger.replay.logreader import LogReader
from kvledger.tracker import framing as log
from kvledger.tracker.framing import LogFormatError

SEED = Path(__file__).resolve().parent / "data" / "replay-clean.kvlog"
FLIPS = 400
OVERWRITES = 400


@pytest.fixture(scope="module")
def segments(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The seed log's events, written anew in three segments."""
    out = tmp_path_factory.mktemp("rel") / "run.kvlog"
    w = copy_log(SEED, out, rotate_bytes=SEED.stat().st_size * 2 // 5)
    assert len(w.paths) >= 3
    return [p.read_bytes() for p in w.paths]


def _spans(data: bytes) -> list[tuple[int, int]]:
    """[start, end) of each frame (the header's first), parsed on their own."""
    pos, spans = log.PREAMBLE_SIZE, []
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        spans.append((pos, pos + 12 + n))
        pos += 12 + n
    return spans


def _read(tmp: Path, segs: list[bytes]) -> tuple[int, LogReader]:
    paths = []
    for i, data in enumerate(segs):
        p = tmp / ("run.kvlog" if i == 0 else f"run.{i:06d}.kvlog")
        p.write_bytes(data)
        paths.append(p)
    reader = LogReader(paths)
    return sum(1 for _ in reader), reader


def _damage_at(tmp: Path, segs: list[bytes], which: int, pos: int) -> str:
    """Read the damaged log; say how the damage at byte ``pos`` of segment ``which`` was
    caught ("" when it was caught at the frame holding it, with every frame before read)."""
    try:
        frames, reader = _read(tmp, segs)
    except LogFormatError:
        return "" if which == 0 and pos < log.PREAMBLE_SIZE else "format error elsewhere"
    stop = reader.stop
    if stop is None:
        return "not detected"
    if stop.path != str(tmp / ("run.kvlog" if which == 0 else f"run.{which:06d}.kvlog")):
        return f"caught in {stop.path}"
    spans = _spans(_ORIGINAL[which])
    start = log.PREAMBLE_SIZE if pos < log.PREAMBLE_SIZE else max(s for s, _ in spans if s <= pos)
    if which > 0 and pos < log.PREAMBLE_SIZE:
        start = 0  # a later segment that is no log any more: caught at its start
    elif which > 0 and pos < spans[0][1]:
        start = log.PREAMBLE_SIZE  # a later segment's header: its chain breaks
    if stop.offset != start:
        return f"caught at {stop.offset}, not {start}"
    before = sum(len(_spans(s)) - 2 for s in _ORIGINAL[:which])  # header and end record
    expected = before + sum(1 for s, _ in spans[1:-1] if s < start)
    return "" if frames == expected else f"{frames} frames read, {expected} expected"


_ORIGINAL: list[bytes] = []


def _positions(rng: random.Random, segs: list[bytes], n: int) -> list[tuple[int, int]]:
    out = []
    while len(out) < n:
        which = rng.randrange(len(segs))
        pos = rng.randrange(len(segs[which]))
        if pos in (10, 11):
            continue  # the minor version: not checksummed, by design (any 1.x reads)
        out.append((which, pos))
    return out


def test_every_single_bit_flip_is_detected_where_it_is(
    segments: list[bytes], tmp_path: Path
) -> None:
    _ORIGINAL[:] = segments
    rng = random.Random(20261124)
    missed = []
    for which, pos in _positions(rng, segments, FLIPS):
        damaged = list(segments)
        data = bytearray(damaged[which])
        data[pos] ^= 1 << rng.randrange(8)
        damaged[which] = bytes(data)
        how = _damage_at(tmp_path, damaged, which, pos)
        if how:
            missed.append((which, pos, how))
    assert missed == [], f"{FLIPS - len(missed)} of {FLIPS} detected: {missed[:5]}"


def test_every_garbage_overwrite_is_detected_where_it_starts(
    segments: list[bytes], tmp_path: Path
) -> None:
    _ORIGINAL[:] = segments
    rng = random.Random(11242026)
    missed = []
    for which, pos in _positions(rng, segments, OVERWRITES):
        damaged = list(segments)
        data = bytearray(damaged[which])
        garbage = rng.randbytes(rng.randint(1, 64))
        data[pos : pos + len(garbage)] = garbage
        data = data[: len(damaged[which])]
        first = next((i for i in range(pos, len(data)) if data[i] != segments[which][i]), None)
        if first is None or first in (10, 11):
            continue  # the garbage happened to equal what was there
        damaged[which] = bytes(data)
        how = _damage_at(tmp_path, damaged, which, first)
        if how:
            missed.append((which, first, how))
    assert missed == [], f"{OVERWRITES - len(missed)} of {OVERWRITES} detected: {missed[:5]}"


def test_no_truncation_reads_as_a_complete_log(segments: list[bytes], tmp_path: Path) -> None:
    last = segments[-1]
    spans = _spans(last)
    complete = 0
    path = tmp_path / "cut.kvlog"
    for n in range(len(last)):  # the last segment, read alone (it knows it lacks its start)
        path.write_bytes(last[:n])
        try:
            reader = LogReader(path)
            frames = sum(1 for _ in reader)
        except LogFormatError:
            assert n < 8  # shorter than the magic
            continue
        if reader.stop is None and reader.ending == "closed":
            complete += 1
        # every frame wholly before the cut is read
        assert n < spans[0][1] or frames == sum(1 for _, e in spans[1:-1] if e <= n)
    assert complete == 0
    assert _read(tmp_path, segments)[1].ending == "closed"
