"""Regenerate the log fixtures in this directory: ``python tests/data/make_fixtures.py``.

Each fixture is built by hand here (struct, zlib, msgpack), not by ``connector.logwriter.LogWriter``:
a fixture stands for a file an older kvledger wrote, so it must not follow the current schema.
The bytes are deterministic; ``tests/test_log.py`` checks that this script still produces the
committed files.

- ``finished_v1.kvlog``: format 1.0, whose header declares ``Finished`` at version 1 (fields
  ``req_id, aborted``; ``aborted: bool = False``). Read today, it goes through the upcaster
  to ``Finished`` v2 (``reason``). Two frames:
  step 3: Preempted("req-a"), Finished("req-a", aborted=True)
  step 4: Finished("req-b", aborted=False), Finished("req-c")  (trailing default dropped)
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import msgpack

HERE = Path(__file__).resolve().parent


def masked_crc(data: bytes) -> int:
    c = zlib.crc32(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    head = struct.pack("<I", len(payload))
    return (
        head
        + struct.pack("<I", masked_crc(head))
        + payload
        + struct.pack("<I", masked_crc(payload))
    )


def finished_v1() -> bytes:
    header = {
        "format": "kvledger-log",
        "library_version": "0.0.1",
        "created_wall_ns": 1_700_000_000_000_000_000,
        "run_id": "0" * 32,
        "segment": 0,
        "prev_segment_digest": "",
        "config": {"block_size": 16, "chunk_size": 256},
        "schemas": {
            5: ["Preempted", 1, ["req_id"]],
            6: ["Finished", 1, ["req_id", "aborted"]],
        },
    }
    frames = [
        [0, 3, 1_700_000_000_000_000_100, [[5, "req-a"], [6, 0, True]]],
        [1, 4, 1_700_000_000_000_000_200, [[6, "req-b", False], [6, "req-c"]]],
    ]
    out = b"KVLEDGER" + struct.pack("<HH", 1, 0)
    out += frame(msgpack.packb(header, use_bin_type=True))
    for f in frames:
        out += frame(msgpack.packb(f, use_bin_type=True))
    return out


FIXTURES = {"finished_v1.kvlog": finished_v1}


def main() -> int:
    for name, build in FIXTURES.items():
        (HERE / name).write_bytes(build())
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
