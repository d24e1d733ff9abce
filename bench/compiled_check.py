"""What compiling the core would buy ``kvledger check``: the fold's and the plans' modules
compiled with mypyc (the compiler of typed Python that builds mypy and black), against the
same tree as Python, over the replay bench's log (``replay_bench.write_log``).

Issue 26 asks ``check`` for at most 3 times the time to decode the log. In Python the fold's
time is spread over some ten kinds of work per record (docs/performance.md), so no one change
to the Python gets there; this measures the other road, a compiled fold, before anyone
builds it into the package. Nothing the project ships is compiled by it.

It copies the three packages into a temporary directory (as ``kvledger/...``, the layout of a
wheel), compiles ``MODULES`` there with mypyc (gcc and Python's headers needed; under a
minute), and writes the log once. Then each round runs one process per tree, the two in a
random order; each process decodes the log and checks it ``--reps`` times, alternately, and
reports the medians. It prints every run, then the medians over the rounds: ``check``
seconds, decode seconds, M events/s and times decoding, and compiled against Python.

Both trees must reach the same verdict (problems and counts): a run that does not is an
error, not a figure.

    python bench/compiled_check.py                       # 1M events, 3 rounds
    python bench/compiled_check.py --events 250000 --rounds 1   # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The modules a replay spends its time in that mypyc takes as they are. Left out:
# tracker/seq.py (mypyc 2.4 fails on its Sequence subclass's __new__), replay/logreader.py
# (a break inside try/finally), the codec and wellformed's generated checks (built by exec at
# import: the compiled module only holds the builder), events (attrs classes decode builds).
MODULES = (
    "tracker/state.py",
    "tracker/plans.py",
    "tracker/invariants.py",
    "tracker/tracker.py",
    "tracker/index_fold.py",
    "tracker/chunks.py",
    "tracker/decoded.py",
    "tracker/digests.py",
    "tracker/numbering.py",
    "tracker/remote.py",
    "tracker/wellformed.py",
    "replay/replayer.py",
)

# Run in each tree's own process: its kvledger imported first, then the replay bench's own
# timer, decoder and count (the bench puts the checkout on the path as it loads, after the
# tree's package is in place: every module of kvledger still comes from the tree, checked).
_TIMER = """
import json, statistics, sys
tree, log, reps, bench = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tree)
import kvledger.replay.replayer
import kvledger.tracker.tracker as t
sys.path.append(bench)
from pathlib import Path
from replay_bench import decode, events_of, timed

dec, chk = [], []
for _ in range(reps):
    dec.append(timed(lambda: decode(Path(log)))[0])
    seconds, result = timed(lambda: kvledger.replay.replayer.check(log))
    chk.append(seconds)
print(json.dumps({
    "compiled": not t.__file__.endswith(".py"),
    "from_tree": all(
        m.__file__.startswith(tree)
        for name, m in sys.modules.items()
        if name.startswith("kvledger") and getattr(m, "__file__", None)
    ),
    "decode": statistics.median(dec),
    "check": statistics.median(chk),
    "events": events_of(result.counts),
    "verdict": [[p.rule, p.step, p.req_id] for p in result.problems],
    "counts": result.counts,
}))
"""


def can_compile() -> str | None:
    """Why mypyc cannot build here, or None: it needs a C compiler and Python's headers."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "mypyc needs a C compiler: none on PATH (Debian: apt-get install gcc)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        return f"mypyc needs Python's headers: no {headers} (Debian: apt-get install python3-dev)"
    return None


def build(tmp: Path, modules: tuple[str, ...] = MODULES) -> tuple[Path, Path]:
    """The Python tree and the compiled tree (``modules`` compiled), each a copy of this
    checkout's packages."""
    trees = []
    for name in ("python", "compiled"):
        tree = tmp / name
        pkg = tree / "kvledger"
        pkg.mkdir(parents=True)
        shutil.copy(ROOT / "kvledger" / "__init__.py", pkg)
        for sub in ("tracker", "replay", "connector"):
            shutil.copytree(ROOT / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__"))
        trees.append(tree)
    compiled = trees[1]
    shutil.copy(ROOT / "pyproject.toml", compiled)  # mypy's configuration
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "mypyc", *(f"kvledger/{m}" for m in modules)],
        cwd=compiled,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        sys.exit(f"mypyc failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    built = sorted(p.name for p in compiled.glob("kvledger/*/*.so"))
    if len(built) != len(modules):
        sys.exit(f"mypyc built {len(built)} of {len(modules)} modules: {built}")
    print(f"compiled {len(modules)} modules with mypyc in {time.perf_counter() - start:.0f} s")
    return trees[0], compiled


def measure(tree: Path, log: Path, reps: int) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _TIMER, str(tree), str(log), str(reps), str(ROOT / "bench")],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        sys.exit(f"the run in {tree.name} failed:\n{run.stderr[-3000:]}")
    out: dict = json.loads(run.stdout.splitlines()[-1])
    if out["compiled"] != (tree.name == "compiled") or not out["from_tree"]:
        sys.exit(f"{tree.name}: its run imported kvledger from outside the {tree.name} tree")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=1_000_000, help="events in the log")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each tree once a round")
    ap.add_argument("--reps", type=int, default=3, help="decodes and checks a run (median)")
    ap.add_argument("--seed", type=int, default=None, help="the order's seed")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the two trees and the log (prints where): PYTHONPATH=<dir>/compiled runs "
        "anything, the tests too, on the compiled modules",
    )
    args = ap.parse_args()
    missing = can_compile()
    if missing:
        sys.exit(missing)

    from bench.replay_bench import write_log

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-compiled-check-"))
    try:
        python, compiled = build(tmp)
        log = tmp / "bench.kvlog"
        write_log(log, args.events, 256, 256)
        runs: dict[str, list[dict]] = {"python": [], "compiled": []}
        print(
            f"{'round':<7}{'tree':<10}{'check s':>9}{'decode s':>10}{'M ev/s':>8}{'x decode':>10}"
        )
        for r in range(1, args.rounds + 1):
            order = [python, compiled]
            rng.shuffle(order)
            for tree in order:
                out = measure(tree, log, args.reps)
                runs[tree.name].append(out)
                print(
                    f"{r:<7}{tree.name:<10}{out['check']:>9.3f}{out['decode']:>10.3f}"
                    f"{out['events'] / out['check'] / 1e6:>8.2f}"
                    f"{out['check'] / out['decode']:>10.1f}",
                    flush=True,
                )
        first = runs["python"][0]
        for out in runs["python"] + runs["compiled"]:
            if out["verdict"] != first["verdict"] or out["counts"] != first["counts"]:
                sys.exit("the compiled tree's verdict differs from Python's: no figure")
        med = {
            name: {k: statistics.median(o[k] for o in outs) for k in ("check", "decode")}
            for name, outs in runs.items()
        }
        ratio = statistics.median(
            c["check"] / p["check"] for p, c in zip(runs["python"], runs["compiled"], strict=True)
        )
        for name, m in med.items():
            times = statistics.median(o["check"] / o["decode"] for o in runs[name])
            print(
                f"{name:<9} check {m['check']:.3f} s, decode {m['decode']:.3f} s: "
                f"{first['events'] / m['check'] / 1e6:.2f} M events/s, {times:.1f}x decoding"
            )
        print(f"compiled/python, check: {ratio:.3f} (median of the rounds' ratios)")
        print(f"verdict: the same in every run ({len(first['verdict'])} problems)")
        print(
            f"command: python bench/compiled_check.py --events {args.events} "
            f"--rounds {args.rounds} --reps {args.reps}"
        )
    finally:
        if args.keep:
            print(f"kept: {tmp} (python/, compiled/, bench.kvlog)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
