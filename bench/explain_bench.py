"""What explaining every miss costs: ``kvledger explain`` and ``stats`` (which counts misses
through the same ``Explainer``) against the walk they both read, on the synthetic serving log
of ``bench/replay_bench.py`` (a decode-heavy workload: 256 live requests, shared 256-token
prefixes loaded from the pool, preemptions every 97 steps).

- ``walk``: ``tracker.history.walk`` over the log's frames (every request's state, as the
  recording Tracker held it): the floor of every reader here;
- ``walk+Explainer``: the walk, each item fed to ``replay.explain.Explainer``;
- ``stats``: ``replay.stats`` (its own counting and the Explainer);
- ``explain``: ``replay.explain.explain`` (the walk, the Explainer, the per-request result).

Each is printed with its ratio to ``walk`` measured in the same run.

    python bench/explain_bench.py                       # 200k events
    python bench/explain_bench.py --events 1000000 --rounds 3

Timings are medians of ``--rounds`` runs; the machine is shared, expect noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from replay_bench import median_time, write_log

from kvledger.replay.explain import Explainer, explain
from kvledger.replay.source import open_log
from kvledger.replay.summary import stats
from kvledger.tracker.history import walk


def _walk(path: Path) -> int:
    src = open_log(path)
    config = src.config()
    n = 0
    for _ in walk(src.frames(), config):
        n += 1
    return n


def _walk_explained(path: Path) -> int:
    src = open_log(path)
    config = src.config()
    seen = [0]

    def count(a: Any) -> None:
        seen[0] += 1

    explainer = Explainer(config, count)
    for item in walk(src.frames(), config):
        explainer.feed(item)
    explainer.finish()
    return seen[0]


def median(fn: Callable[[], Any], rounds: int) -> float:
    return median_time(fn, rounds)[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=200_000, help="events in the log (200,000)")
    ap.add_argument("--live", type=int, default=256, help="requests running at a time")
    ap.add_argument("--slots", type=int, default=256, help="host pool chunk slots")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each (median)")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="kvledger-explain-bench-")) / "bench.kvlog"
    steps = write_log(path, args.events, args.live, args.slots)
    print(f"log: {path.stat().st_size:,} bytes, {steps:,} steps, about {args.events:,} events")
    x = explain(path)
    t = x.totals()
    print(
        f"explained: {t['admissions']:,} admissions, {t['tokens_asked']:,} tokens asked, "
        f"{t['missed_tokens']:,} missed: {t['reasons']}"
    )
    base = median(lambda: _walk(path), args.rounds)
    rows = [("walk", base)]
    rows.append(("walk+Explainer", median(lambda: _walk_explained(path), args.rounds)))
    rows.append(("stats", median(lambda: stats(path), args.rounds)))
    rows.append(("explain", median(lambda: explain(path), args.rounds)))
    print(f"{'':16} {'seconds':>8} {'x walk':>7}")
    for name, seconds in rows:
        print(f"{name:16} {seconds:8.2f} {seconds / base:7.2f}")


if __name__ == "__main__":
    main()
