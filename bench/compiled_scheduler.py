"""What compiling the scheduler's hot path would buy issue 25: the modules a steady decode step
runs in, on vLLM's scheduler thread, compiled with mypyc, against the same tree as Python,
each timed by the scheduler benches as they are.

Issue 25 asks the connector and the recorder, each with its log on, for at most 1.03 times the
do-nothing connector's step. In Python their steady step is a few passes in C over vLLM's
lists; what is left is the interpreter between them, and what our step's touches cost vLLM's
code after it. Issue 25 names "a steady step in one C call" as a road; this measures the
nearest one that needs no hand-written C, a compiler, before anyone builds it into the
package. Nothing the project ships is compiled by it.

It builds the two trees as ``bench/compiled_check.py`` does (a copy of the packages, gcc and
Python's headers needed, under a minute), then each round runs ``bench/scheduler_overhead.py
--log --twin`` and ``bench/recorder_bench.py --twin`` once in each tree, the trees in a random
order, each run its own process. It prints every run's paired ratios against ``null`` (the
target line) and the median µs per step in our methods, then the medians over the rounds.

    python bench/compiled_scheduler.py                # 3 rounds, both benches
    python bench/compiled_scheduler.py --rounds 1 --bench scheduler
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compiled_check import MODULES as CHECK_MODULES  # noqa: E402
from bench.compiled_check import build, can_compile  # noqa: E402

# The modules of a steady step: the core's that compiled_check.py compiles, less those only a
# replay runs in, and the connector's and the recorder's scheduler sides with the log's steps
# the recorder follows. Left out: the classes vLLM loads (connector/vllm.py,
# connector/recorder.py: subclasses of vLLM's base class, which mypyc does not compile
# natively) and the log writer (its work is on the log's own thread; msgpack's packer is C).
_REPLAY_ONLY = frozenset(
    {
        "tracker/index_fold.py",
        "tracker/decoded.py",
        "tracker/digests.py",
        "tracker/remote.py",
        "tracker/wellformed.py",
        "replay/replayer.py",
    }
)
MODULES = (
    *(m for m in CHECK_MODULES if m not in _REPLAY_ONLY),
    "tracker/recorded_steps.py",
    "connector/scheduler.py",
    "connector/recording.py",
)

BENCHES = {
    "scheduler": ("scheduler_overhead.py", ["--log", "--twin"], ("conn", "log")),
    "recorder": ("recorder_bench.py", ["--twin"], ("rec", "reclog")),
}

# Run in each tree's own process: its kvledger imported first, so the bench (which puts the
# checkout on the path as it loads) finds the tree's package already imported.
_RUNNER = """
import runpy, sys
tree, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import kvledger.tracker.tracker, kvledger.connector.scheduler, kvledger.connector.recording
mods = [m for n, m in sys.modules.items() if n.startswith("kvledger") and getattr(m, "__file__", None)]
outside = [m.__file__ for m in mods if not m.__file__.startswith(tree)]
compiled = [m.__name__ for m in mods if not m.__file__.endswith(".py")]
print("tree-check", len(outside), len(compiled), flush=True)
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""

_TARGET = re.compile(r"(\w+) (\d+\.\d+) (?:<=|>) ")
_METHODS = re.compile(r"^(\w+): \+[-\d.]+ us/step over base; in the connector's methods ([\d.]+)")
_FLOOR = re.compile(r"^noise floor: \w+, identical to \w+, reads (\d+\.\d+) paired")


def run(tree: Path, bench: str, seed: int) -> dict[str, float]:
    """One bench run in ``tree``: each variant's paired ratio, its µs in our methods
    (``<name> us``), and the twin's ratio (``floor``)."""
    script, extra, _ = BENCHES[bench]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUNNER,
            str(tree),
            str(ROOT / "bench" / script),
            *extra,
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{bench} in {tree.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out: dict[str, float] = {}
    checked = False
    for line in proc.stdout.splitlines():
        if line.startswith("tree-check"):
            _, outside, compiled = line.split()
            if int(outside) or (int(compiled) > 0) != (tree.name == "compiled"):
                sys.exit(f"{tree.name}: kvledger came from outside the tree, or compiled wrongly")
            checked = True
        elif line.startswith("target:"):
            out.update((name, float(r)) for name, r in _TARGET.findall(line.split(":", 2)[2]))
        elif m := _METHODS.match(line):
            out[f"{m[1]} us"] = float(m[2])
        elif m := _FLOOR.match(line):
            out["floor"] = float(m[1])
    if not checked:  # a run whose tree was never checked is no figure of that tree
        sys.exit(f"{bench} in {tree.name}: the runner did not report where kvledger came from")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each tree once a round")
    ap.add_argument("--bench", choices=[*BENCHES, "both"], default="both")
    ap.add_argument("--seed", type=int, default=None, help="the order's seed")
    args = ap.parse_args()
    missing = can_compile()
    if missing:
        sys.exit(missing)
    benches = list(BENCHES) if args.bench == "both" else [args.bench]
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-compiled-scheduler-"))
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        trees = build(tmp, MODULES)
        for r in range(1, args.rounds + 1):
            for bench in benches:
                order = list(trees)
                rng.shuffle(order)
                for tree in order:
                    out = run(tree, bench, seed=r)
                    runs.setdefault((bench, tree.name), []).append(out)
                    _, _, names = BENCHES[bench]
                    cells = "  ".join(f"{n} {out[n]:.3f} ({out[n + ' us']:.1f} us)" for n in names)
                    print(
                        f"round {r}  {bench:<9} {tree.name:<8} {cells}  floor {out['floor']:.3f}",
                        flush=True,
                    )
        print()
        print("medians over the rounds (paired ratio to null; median us a step in our methods):")
        for bench in benches:
            _, _, names = BENCHES[bench]
            for n in names:
                med = {
                    t: (
                        statistics.median(o[n] for o in runs[(bench, t)]),
                        statistics.median(o[n + " us"] for o in runs[(bench, t)]),
                    )
                    for t in ("python", "compiled")
                }
                (rp, up), (rc, uc) = med["python"], med["compiled"]
                print(
                    f"  {n:<7} python {rp:.3f} ({up:.1f} us)  compiled {rc:.3f} ({uc:.1f} us)"
                    f"  in our methods: {uc / up:.2f} of python's"
                )
        print(
            f"command: python bench/compiled_scheduler.py --rounds {args.rounds} --bench {args.bench}"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
