"""Instructions, not seconds: ``kvledger check`` and decoding of the replay bench's log, counted
by valgrind.

The machines this project is measured on are shared: in one sitting the same ``check`` took
1.6 to 2.3 s, and the ratio of checking to decoding read 3.3 to 8.2 from round to round
(docs/performance.md). A change of a tenth cannot be seen in that. The number of instructions
a run executes does not depend on the neighbours: valgrind counts it exactly, and a second
sitting reads the same count. It is not time (a cache miss costs more than an instruction,
and the fold misses more than the decoder does), so it judges a change to the code, and
``bench/replay_bench.py`` stays the measure of speed.

Each figure is one process under ``valgrind --tool=callgrind``, less a process that only
imports the same modules. With ``--against DIR`` (another tree, e.g. from ``git archive``)
every figure is counted in both trees, on the same log::

    apt-get install valgrind
    git archive HEAD~3 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python bench/instructions.py --against /tmp/before

``--simulate`` runs cachegrind instead, with its cache and branch models, and prints what
the work missed and mispredicted besides: where the instructions' time goes beyond their
count (a model of a CPU, not this one's counters, which these machines do not expose).

Counting runs about 50 times slower than the program (``--simulate`` slower still): the
default log is the replay bench's workload at 250,000 events (``--events``); the runs share
``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

# What one counted process runs: import the reader and the check from ``root``, then the work.
_RUN = """
import sys
root, what, log = sys.argv[1:4]
sys.path.insert(0, root)
from pathlib import Path
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import check
if what == "check":
    result = check(Path(log))
    assert result.exit_code == 0, result.problems[:3]
elif what == "decode":
    for frame in LogReader(Path(log)):
        pass
"""

_COLLECTED = re.compile(r"Collected : (\d+)")
# cachegrind's summary (``--simulate``): the figure of each line, as printed.
_SIMULATED = {
    "instructions": re.compile(r"I\s+refs:\s+([\d,]+)"),
    "I1 misses": re.compile(r"I1\s+misses:\s+([\d,]+)"),
    "D1 misses": re.compile(r"D1\s+misses:\s+([\d,]+)"),
    "LL misses": re.compile(r"LL misses:\s+([\d,]+)"),
    "branches": re.compile(r"Branches:\s+([\d,]+)"),
    "mispredicted": re.compile(r"Mispredicts:\s+([\d,]+)"),
    "indirect mispredicted": re.compile(
        r"Mispredicts:\s+[\d,]+\s+\(\s*[\d,]+ cond \+\s+([\d,]+) ind"
    ),
}


def count(root: Path, what: str, log: Path, simulate: bool = False) -> dict[str, int]:
    """What a process that imports from ``root`` and runs ``what`` executed: its instructions,
    and with ``simulate`` its cache misses and mispredicted branches (valgrind's simple
    models of them, not this CPU's)."""
    tool = "cachegrind" if simulate else "callgrind"
    models = ["--cache-sim=yes", "--branch-sim=yes"] if simulate else []
    out = subprocess.run(
        [
            "valgrind",
            f"--tool={tool}",
            *models,
            f"--{tool}-out-file=/dev/null",
            sys.executable,
            "-c",
            _RUN,
            str(root),
            what,
            str(log),
        ],
        capture_output=True,
        text=True,
        check=False,
        # String hashes decide how dicts and sets probe: a fixed seed, the same count.
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    patterns = _SIMULATED if simulate else {"instructions": _COLLECTED}
    found = {name: pattern.search(out.stderr) for name, pattern in patterns.items()}
    if out.returncode != 0 or not all(found.values()):
        raise SystemExit(f"valgrind failed on {what} in {root}:\n{out.stderr[-2000:]}")
    return {name: int(m.group(1).replace(",", "")) for name, m in found.items() if m}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=250_000, help="events in the log")
    ap.add_argument("--live", type=int, default=256, help="requests running at a time")
    ap.add_argument("--slots", type=int, default=256, help="host pool chunk slots")
    ap.add_argument("--against", type=Path, help="another tree to count the same runs in")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="also the cache misses and mispredicted branches (cachegrind's models; slower)",
    )
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")

    from replay_bench import write_log  # the workload bench/replay_bench.py times

    trees = {"this": HERE.parent}
    if args.against is not None:
        if not (args.against / "kvledger").is_dir():
            raise SystemExit(f"--against {args.against}: no kvledger/ there (a source tree?)")
        trees["other"] = args.against.resolve()
    with tempfile.TemporaryDirectory(prefix="kvledger-instructions-") as tmp:
        log = Path(tmp) / "bench.kvlog"
        steps = write_log(log, args.events, args.live, args.slots)
        print(f"log: about {args.events:,} events, {steps:,} steps, {log.stat().st_size:,} bytes")
        runs = [(name, what) for name in trees for what in ("import", "decode", "check")]
        print(f"counting {len(runs)} runs under valgrind, {args.jobs} at a time ...", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            counted = dict(
                zip(
                    runs,
                    pool.map(lambda r: count(trees[r[0]], r[1], log, args.simulate), runs),
                    strict=True,
                )
            )

    # Each run's figures less those of the run in the same tree that only imported.
    work = {
        (t, w): {f: n - counted[(t, "import")][f] for f, n in counted[(t, w)].items()}
        for t in trees
        for w in ("decode", "check")
    }
    print()
    print(f"{'M instructions':<16}{'decode':>10}{'check':>10}{'check/decode':>14}")
    for t in trees:
        decode, check = work[(t, "decode")]["instructions"], work[(t, "check")]["instructions"]
        print(f"{t:<16}{decode / 1e6:>10.1f}{check / 1e6:>10.1f}{check / decode:>14.2f}")
    if "other" in trees:
        ratios = [
            work[("this", w)]["instructions"] / work[("other", w)]["instructions"]
            for w in ("decode", "check")
        ]
        print(f"{'this / other':<16}" + "".join(f"{r:>10.3f}" for r in ratios))
    if args.simulate:
        columns = [(t, w) for t in trees for w in ("decode", "check")]
        print(f"\n{'M, work only':<24}" + "".join(f"{t + ' ' + w:>16}" for t, w in columns))
        for figure in _SIMULATED:
            print(f"{figure:<24}" + "".join(f"{work[c][figure] / 1e6:>16.2f}" for c in columns))
    if "other" in trees:
        print(f"\nother: {trees['other']}")
    print(
        f"command: python bench/instructions.py --events {args.events} --live {args.live} "
        f"--slots {args.slots}"
        + (f" --against {args.against}" if args.against else "")
        + (" --simulate" if args.simulate else "")
    )


if __name__ == "__main__":
    main()
