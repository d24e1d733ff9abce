#!/usr/bin/env python3
"""What KV-content digests cost per step: off vs sampled vs full, in the same run.

Run by hand; it prints numbers and never passes or fails on them. Two parts:

``worker`` (default): the worker's digests of one step on Llama-3.1-8B shapes (32 layers, 8 KV
heads, head size 128, bf16, block size 16: 2 MiB per block over all layers) in a paged cache of
``--num-blocks`` blocks, for two kinds of step: ``decode`` (``--batch`` requests decoding, one in
16 fills a block: batch/16 blocks) and ``prefill`` (``--prefill`` tokens: that many / 16 blocks,
plus the same number of loaded blocks digested before and after their load). The time is
``WorkerDigests.before_load`` + ``after_forward`` + ``report`` (the step's one host wait
included). The baseline, in the same run, is saving the same blocks to a host chunk slot with
the connector's own transfer backend (what a save of that step costs): "vs save" is digest time
/ save time, per round, median.

``harness``: whole steps under vLLM's real scheduler on CPU (``connector.testing.run``, the
runner of the tests: scheduler, the worker, the oracle's fake forward, the log not written),
digests off, sampled and full, from the first step's end to the last's (setup excluded); "vs
off" is the median per-round ratio of the per-step time to ``off``'s.

Rounds interleave the variants so that drift on a shared machine hits all alike; figures are
medians over ``--repeats`` rounds after ``--warmup``.

  python bench/digest_bench.py --device cpu
  python bench/digest_bench.py --device cuda --repeats 50
  python bench/digest_bench.py --part harness --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvledger.connector.digests import WorkerDigests
from kvledger.connector.kv_layout import slot_mapping_for
from kvledger.connector.store import HostChunkPool
from kvledger.connector.transfer import TransferBackend
from kvledger.tracker.digests import DigestBlock, DigestPlan, block_keys


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _plan(kind: str, args: argparse.Namespace, block_ids: list[int]) -> DigestPlan:
    bs = args.block_size
    if kind == "decode":
        n_full, n_loaded = max(1, args.batch // bs), 0
    else:
        n_full = n_loaded = args.prefill // bs
    keys = block_keys(list(range((n_full + n_loaded) * bs)), bs)
    blocks = [DigestBlock("r", i, block_ids[i], keys[i]) for i in range(n_full + n_loaded)]
    loaded, full = tuple(blocks[:n_loaded]), tuple(blocks[n_loaded:])
    return DigestPlan(0, full=full, before=loaded, verify=loaded)


def worker_part(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    sync = _sync(device)
    shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
    caches = {}
    for i in range(args.layers):
        c = torch.empty(shape, dtype=torch.bfloat16, device=device)
        c.view(torch.int16).random_()
        caches[f"model.layers.{i}.self_attn.attn"] = c
    g = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(args.num_blocks - 1, generator=g)[:4096].add(1).tolist()
    digesters = {}
    for mode in ("sampled", "full"):
        w = WorkerDigests(mode, layout="flash_attn")
        w.register_kv_caches(caches)
        digesters[mode] = w
    print(
        f"# worker: {args.layers} layers, {args.kv_heads}x{args.head_size} bf16, block "
        f"{args.block_size}, flash_attn, {args.num_blocks} blocks; device {device}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'step':<8} {'blocks':>7} {'mode':<8} {'med ms':>9} {'p90 ms':>9} "
        f"{'save ms':>9} {'vs save':>8} {'MB/s':>9}"
    )
    block_bytes = 2 * args.block_size * args.kv_heads * args.head_size * 2 * args.layers
    for kind in ("decode", "prefill"):
        plan = _plan(kind, args, block_ids)
        n = len(plan.full) + len(plan.verify)
        digested = len(plan.full) + 2 * len(plan.verify)  # loaded blocks: before and after
        # The baseline: saving the step's new blocks to host slots (tokens of whole blocks).
        chunk_tokens = args.block_size * max(1, n)
        backend = TransferBackend(caches, chunk_tokens, "flash_attn")
        pool = HostChunkPool(backend.spec, chunk_tokens, 1)
        ids = [b.block_id for b in (*plan.verify, *plan.full)]
        mapping = slot_mapping_for(ids, args.block_size, 0, chunk_tokens)

        def save() -> None:
            pool.save(backend, 0, mapping, 0).synchronize()  # noqa: B023

        def digest(mode: str) -> None:
            w = digesters[mode]
            w.before_load(plan)  # noqa: B023
            w.after_forward(plan)  # noqa: B023
            assert w.report() is not None

        times: dict[str, list[float]] = {"save": [], "sampled": [], "full": []}
        ratios: dict[str, list[float]] = {"sampled": [], "full": []}
        for r in range(args.warmup + args.repeats):
            row = {}
            for name, fn in (
                ("save", save),
                ("sampled", lambda: digest("sampled")),
                ("full", lambda: digest("full")),
            ):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                row[name] = time.perf_counter() - t0
            if r >= args.warmup:
                for name, t in row.items():
                    times[name].append(t)
                for mode in ratios:
                    ratios[mode].append(row[mode] / row["save"])
        save_ms = statistics.median(times["save"]) * 1e3
        for mode in ("sampled", "full"):
            t = sorted(times[mode])
            med = statistics.median(t)
            p90 = t[int(0.9 * (len(t) - 1))]
            read = digested * block_bytes / (args.layers if mode == "sampled" else 1)
            print(
                f"{kind:<8} {digested:>7} {mode:<8} {med * 1e3:>9.3f} {p90 * 1e3:>9.3f} "
                f"{save_ms:>9.3f} {statistics.median(ratios[mode]):>7.1%} "
                f"{read / med / 1e6:>9.0f}"
            )


def harness_part(args: argparse.Namespace) -> None:
    from kvledger.connector.testing.run import RunSpec, run

    modes = ("off", "sampled", "full")
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    steps = 0
    for r in range(args.warmup + args.repeats):
        row = {}
        for mode in modes:
            spec = RunSpec(
                extra_config={"chunk_size": 32, "digests": mode},
                num_requests=16,
                verify=False,
                seed=r,
            )
            stamps: list[float] = []
            # Steps only (the progress callback runs after each): not the setup (the host
            # pool's allocation, the same in every mode).
            report = run(spec, progress=lambda *_: stamps.append(time.perf_counter()))  # noqa: B023
            assert report.ok, report.violations
            steps = report.steps
            row[mode] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        if r >= args.warmup:
            for mode in modes:
                per_step[mode].append(row[mode])
                ratios[mode].append(row[mode] / row["off"])
    print(f"# harness: vLLM's scheduler, CPU, 16 requests (+2 repeated), {steps} steps a run")
    print(f"{'digests':<8} {'ms/step':>9} {'vs off':>8}")
    for mode in modes:
        print(
            f"{mode:<8} {statistics.median(per_step[mode]) * 1e3:>9.3f} "
            f"{statistics.median(ratios[mode]):>7.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("worker", "harness"), default="worker")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="decode step: requests decoding")
    p.add_argument("--prefill", type=int, default=512, help="prefill step: tokens computed")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("digest_bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.part == "worker":
        worker_part(args)
    else:
        harness_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
