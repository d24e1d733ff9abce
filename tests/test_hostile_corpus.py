"""Every ``kvledger`` command over a corpus of hostile files: no traceback, a documented exit
status, a message on stderr, bounded memory and bounded output. Seeded: the same corpus every
run.

The corpus starts from a real log (vLLM's scheduler with the connector) and breaks it the ways
files break: random bytes, single-bit flips, garbage overwrites, truncations, a frame claiming
gigabytes, msgpack bombs behind valid checksums, hostile header values, an empty file, a
directory that holds no log, a missing path. Then logs whose every frame is sound but whose
events are not: fields that contradict each other (a connector's log and a recorder's), 5 MB
values in every text field, integers at and past the 64-bit edges. ``pytest -s`` prints the
figures docs/reliability.md reports.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from _memory import peak_memory
from test_bounded_output import _wide_log
from test_check_malformed import CONNECTOR, RECORDER
from test_check_malformed import _write as _write_steps
from test_replay_fuzz import _BOMBS, BYTES, FRAMES, frame

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig

EXITS = {0, 1, 2, 3}


def _corpus(tmp: Path) -> dict[str, Path]:
    rng = random.Random(1124)
    files: dict[str, bytes] = {
        "empty": b"",
        "random bytes": rng.randbytes(3000),
        "preamble only": BYTES[:12],
        "a frame claiming 3 GiB": BYTES[: FRAMES[3][0]]
        + struct.pack("<I", 3 << 30)
        + struct.pack("<I", 0),
    }
    for i in range(6):
        data = bytearray(BYTES)
        bit = rng.randrange(12 * 8, len(BYTES) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        files[f"bit flip {i}"] = bytes(data)
        pos = rng.randrange(12, len(BYTES))
        data = bytearray(BYTES)
        data[pos : pos + 40] = rng.randbytes(40)
        files[f"garbage {i}"] = bytes(data[: len(BYTES)])
        files[f"truncated {i}"] = BYTES[: rng.randrange(len(BYTES))]
    offset = FRAMES[len(FRAMES) // 3][0]
    for name, bomb in _BOMBS.items():
        files[f"bomb: {name}"] = BYTES[:offset] + frame(bomb)
    out = {}
    for name, data in files.items():
        path = tmp / (name.replace(" ", "_").replace(":", "") + ".kvlog")
        path.write_bytes(data)
        out[name] = path
    for name, config in (
        ("header num_slots 2**64-1", {"num_slots": 2**64 - 1}),
        ("header flag 'no'", {"discard_partial_chunks": "no"}),
        ("header salt 5", {"salt": 5}),
        ("header config not a map", None),
    ):
        path = tmp / (name.replace(" ", "_").replace("'", "") + ".kvlog")
        header = {**TrackerConfig().to_dict(), **config} if config is not None else {}
        with LogWriter(path, header, fsync="never") as w:
            w.end_step(0)
        if config is None:  # a header whose config is a list: rewrite it by hand
            data = path.read_bytes()
            path.write_bytes(
                data.replace(msgpack.packb("config") + b"\x80", msgpack.packb("config") + b"\x90")
            )
        out[name] = path
    (tmp / "no-log-here").mkdir()
    out["a directory without a log"] = tmp / "no-log-here"
    out["a missing path"] = tmp / "missing.kvlog"
    # Sound frames, impossible events.
    out["malformed events"] = _write_steps(tmp / "malformed.kvlog", CONNECTOR)
    out["malformed recorder events"] = _write_steps(
        tmp / "malformed-recorder.kvlog", RECORDER, recorder=True
    )
    out["5 MB values"] = _wide_log(tmp / "wide.kvlog")
    out["64-bit edges"] = _write_steps(tmp / "edges.kvlog", _EDGES)
    return out


_TOP = (1 << 64) - 1  # the largest integer msgpack carries
_EDGES = [
    [ev.RequestAdded(0, "req-1", tuple(range(40)))],
    [ev.LookupAsked(1, "req-1", 1 << 63, _TOP), ev.LookupAnswered(1, "req-1", _TOP, 1 << 63)],
    [ev.Allocated(2, "req-1", (_TOP, -(1 << 63)), _TOP)],
    [ev.Scheduled(3, "req-1", _TOP, _TOP, _TOP, (), (_TOP,), ev.Admission.NEW)],
    [ev.SavePlanned(4, "req-1", _TOP, -(1 << 63), (b"k" * 16,), (_TOP,), (), _TOP)],
    [ev.BlockDigested(5, "req-1", _TOP, (b"k" * 16,), (_TOP,), _TOP)],
    [ev.StepDecoded(6, "", (_TOP, 0), (_TOP, _TOP))],
    [ev.ChunkStored(7, "", b"k" * 16, _TOP, _TOP), ev.Finished(7, "req-1")],
]


COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "check": lambda log, tmp: ["check", str(log)],
    "check --json": lambda log, tmp: ["check", "--json", str(log)],
    "show": lambda log, tmp: ["show", str(log), "-r", "req-1"],
    "stats": lambda log, tmp: ["stats", str(log)],
    "stats --json": lambda log, tmp: ["stats", "--json", str(log)],
    "diff": lambda log, tmp: ["diff", str(log), str(log)],
    "timeline": lambda log, tmp: ["timeline", str(log), "-o", str(tmp / "t.html")],
    "export": lambda log, tmp: ["export", str(log), "-o", str(tmp / "tables"), "--format", "jsonl"],
    "export perfetto": lambda log, tmp: ["export", str(log), "-o", str(tmp / "trace.json")],
    "sql": lambda log, tmp: ["sql", str(log), "SELECT count(*) FROM steps"],
    "tail --once": lambda log, tmp: ["tail", str(log), "--once"],
    "whatif": lambda log, tmp: ["whatif", str(log), "--with", "num_slots=2"],
    "whatif --sweep": lambda log, tmp: ["whatif", str(log), "--sweep", "num_slots=1,4", "--json"],
}


# What a command may print for any file of the corpus (the largest prints a few KiB).
OUTPUT_BOUND = 256 << 10


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_survives_the_hostile_corpus(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path)
    failures = []
    printed = 0
    peak = 0  # the most memory any one file took (tests/_memory.py)
    for name, path in corpus.items():
        with peak_memory() as memory:
            try:
                code = main(COMMANDS[command](path, tmp_path))
            except SystemExit as e:  # argparse errors only
                code = e.code if isinstance(e.code, int) else 2
            except Exception as e:  # the defect this test exists for
                failures.append(f"{name}: raised {type(e).__name__}: {e}")
                code = None
        peak = max(peak, memory.bytes)
        if code is None:
            continue
        out, err = capsys.readouterr()
        printed = max(printed, len(out) + len(err))
        if "--json" not in COMMANDS[command](path, tmp_path) and printed > OUTPUT_BOUND:
            failures.append(f"{name}: printed {len(out) + len(err):,} characters")
        if code not in EXITS:
            failures.append(f"{name}: exit {code}")
        elif code == 2 and not (
            err.strip() or '"error"' in out or "ERROR" in out or "DAMAGED" in out or "error" in out
        ):
            failures.append(f"{name}: exit 2 with nothing said")
        if "Traceback" in out + err:
            failures.append(f"{name}: a traceback")
    with capsys.disabled():  # the figures of docs/reliability.md (pytest -s)
        print(
            f"\n{command}: {len(corpus)} files, peak {peak / (1 << 20):.1f} MiB ({memory.how}), "
            f"at most {printed:,} characters printed"
        )
    assert failures == [], f"{len(failures)} of {len(corpus)}: {failures[:6]}"
    assert peak < 256 << 20, f"peak {peak >> 20} MiB"
