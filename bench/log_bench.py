"""The log file's speed, this tree against another: read, decode, follow, check, write.

One log is written here (``replay_bench``'s decode-heavy workload, ``--events`` of it, rotated
into segments of ``--rotate`` bytes), then each operation runs in a fresh process of each tree,
alternating trees round by round, and the medians are compared:

- ``read+verify``: ``LogReader.iter_raw`` (checksums, frames, seq and steps, record shape);
- ``decode``: ``LogReader`` iteration (event objects);
- ``follow``: ``LogFollower.poll`` over the finished log (what ``kvledger tail --once`` reads);
- ``check``: ``replay.check`` (read, re-fold, re-derive, compare);
- ``write``: the log's frames written again by ``LogWriter`` (``fsync="never"``).

    python bench/log_bench.py --against /path/to/other/tree        # ratios: this / other
    python bench/log_bench.py --against /tmp/base --events 200000 --rounds 5

``--against`` is a source tree of kvledger (a checkout, or ``git archive`` of a commit); one
from before ``tracker/log.py`` was split (the log's classes in ``tracker.log``) is read too.
A ratio under 1 means this tree is faster. Times are CPU seconds of the process
(``time.process_time``, every thread), medians of ``--rounds``: on a shared machine, wall time
mostly measures the other tenants. The log is in the page cache, so reading waits for no disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OPS = ("read+verify", "decode", "follow", "check", "write")


def _classes() -> tuple[Any, Any, Any]:
    """LogReader, LogFollower, LogWriter of the tree on sys.path (before or after the split)."""
    try:
        from kvledger.connector.logwriter import LogWriter
        from kvledger.replay.logreader import LogFollower, LogReader
    except ImportError:  # a tree from before the split: all three in tracker.log
        from kvledger.tracker.log import LogFollower, LogReader, LogWriter  # type: ignore[no-redef]
    return LogReader, LogFollower, LogWriter


def _op(what: str, paths: list[str], scratch: str) -> tuple[float, int]:
    """Run one operation once, in this process; (seconds, a count that proves it ran)."""
    reader_cls, follower_cls, writer_cls = _classes()
    gc.collect()
    start = time.process_time()
    if what == "read+verify":
        n = sum(len(f.records) for f in reader_cls(paths).iter_raw())
    elif what == "decode":
        n = sum(len(f.events) for f in reader_cls(paths))
    elif what == "follow":
        follower = follower_cls(paths[0])
        n = sum(len(f.events) for f in follower.poll())
        follower.close()
        assert follower.ending == "closed", follower.stop
    elif what == "check":
        from kvledger.replay.replayer import check

        result = check(paths)
        n = result.counts["events"]
    elif what == "write":
        frames = list(reader_cls(paths))
        start = time.process_time()  # the read is not the writer's cost
        w = writer_cls(os.path.join(scratch, "copy.kvlog"), {}, fsync="never", rotate_bytes=None)
        for f in frames:
            for e in f.events:
                w.append(e)
            w.end_step(f.step)
        w.close()
        n = len(frames)
    else:
        raise ValueError(what)
    return time.process_time() - start, n


def _child(tree: str, what: str, paths: list[str]) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONPATH": tree}
        cmd = [sys.executable, __file__, "--child", what, "--scratch", scratch, *paths]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    seconds, n = json.loads(out.splitlines()[-1])
    return seconds, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="the other source tree (its root directory)")
    ap.add_argument("--events", type=int, default=300_000, help="logical events in the log")
    ap.add_argument("--rotate", type=int, default=4 << 20, help="segment size, bytes")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each (median)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"some of {','.join(OPS)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_op(args.child, args.paths, args.scratch)))
        return
    if not args.against:
        ap.error("--against TREE is required")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from replay_bench import write_log

    trees = {"this": str(ROOT), "other": str(Path(args.against).resolve())}
    ops = [o for o in args.ops.split(",") if o]
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "bench.kvlog"
        write_log(first, args.events, 256, 256, rotate_bytes=args.rotate)
        paths = sorted(map(str, Path(tmp).glob("bench*.kvlog")), key=lambda p: (len(p), p))
        size = sum(os.path.getsize(p) for p in paths)
        print(f"log: {len(paths)} segments, {size:,} bytes ({args.events:,} logical events)")
        print(f"this tree: {trees['this']}\nother tree: {trees['other']}")
        times: dict[tuple[str, str], list[float]] = {}
        counts: dict[tuple[str, str], int] = {}
        for _ in range(args.rounds):
            for what in ops:
                for name, tree in trees.items():  # alternating: the same load on both
                    seconds, n = _child(tree, what, paths)
                    times.setdefault((what, name), []).append(seconds)
                    counts[(what, name)] = n
    print(
        f"\n{'CPU seconds':<14}{'this':>10}{'other':>11}{'this/other':>12}   (median of {args.rounds})"
    )
    for what in ops:
        this = statistics.median(times[(what, "this")])
        other = statistics.median(times[(what, "other")])
        same = "" if counts[(what, "this")] == counts[(what, "other")] else "  COUNTS DIFFER"
        print(f"{what:<14}{this:>10.3f}{other:>11.3f}{this / other:>12.2f}{same}")


if __name__ == "__main__":
    main()
