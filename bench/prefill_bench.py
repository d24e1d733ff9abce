#!/usr/bin/env python3
"""A long prompt's prefill on the scheduler thread: ``Tracker.scheduled`` of one request
scheduled whole (its save plan, and the index's fold of it), by prompt length, with block
hits on and off.

Run by hand; it prints numbers and never passes or fails on them. Each sample is a new
Tracker, a new request of random tokens (``--seed``), its lookup and allocation, then one
timed ``scheduled`` of the whole prompt. The variants (length x block hits) take turns in a
new random order every round; the figures are medians over ``--rounds``. ``block_hits`` off is
the baseline of its length: the same plan without the aliases (design note 14), so the ratio
is what block hits cost a prefill.

  python bench/prefill_bench.py
  python bench/prefill_bench.py --lengths 2048 32768 --rounds 50
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker


def prefill(config: TrackerConfig, prompt: list[int]) -> float:
    """Seconds of one ``scheduled`` of the whole prompt, admitted with nothing to load."""
    t = Tracker(config)
    t.add_request("r", prompt)
    t.lookup("r", 0, prompt)
    table = list(range(-(-len(prompt) // config.block_size)))
    t.allocated("r", table, 0)
    start = time.perf_counter()
    t.scheduled("r", num_computed=0, num_scheduled=len(prompt), all_token_ids=prompt,
                block_ids=table, admission=ev.Admission.NEW)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    configs = {
        hits: TrackerConfig(
            block_size=args.block_size,
            chunk_size=args.chunk_size,
            num_slots=1 << 20,
            block_hits=hits,
        )
        for hits in (True, False)
    }
    variants = [(n, hits) for n in args.lengths for hits in (True, False)]
    times: dict[tuple[int, bool], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for n, hits in rng.sample(variants, len(variants)):
            prompt = [rng.randrange(3, 50_000) for _ in range(n)]
            times[(n, hits)].append(prefill(configs[hits], prompt))
    print(f"{'prompt tokens':>13}{'block hits on':>15}{'off':>10}{'on / off':>10}   (ms, median)")
    for n in args.lengths:
        on, off = (statistics.median(times[(n, h)]) for h in (True, False))
        print(f"{n:>13,}{on * 1e3:>15.3f}{off * 1e3:>10.3f}{on / off:>10.2f}")
    print(
        f"\ncommand: python bench/prefill_bench.py --lengths {' '.join(map(str, args.lengths))} "
        f"--rounds {args.rounds} --block-size {args.block_size} --chunk-size {args.chunk_size}"
    )


if __name__ == "__main__":
    main()
