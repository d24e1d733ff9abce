"""``kvledger demo``: vLLM's real scheduler with KVLedgerConnector, proven by the oracle.

Runs a workload that preempts on a tiny block pool, with the connector loaded the way vLLM
loads it, checks the KV-content oracle after every step, writes the event log, re-checks the
log offline, and prints a summary. Exit status 0 means: every request finished, every token
held its oracle value at every step, no violation, nothing leaked, and the log replays clean.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

from replay.extras import progress_bar

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=12, help="number of requests (default 12)")
    parser.add_argument(
        "--blocks", type=int, default=16, help="GPU blocks in the pool (small: preemption)"
    )
    parser.add_argument("--chunk-size", type=int, default=32, help="tokens per saved chunk")
    parser.add_argument("--prefix-caching", action="store_true", help="keep vLLM's prefix cache on")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduling")
    parser.add_argument("--mrv1", action="store_true", help="Model Runner V1 output shape")
    parser.add_argument(
        "--log-dir", default=None, help="where the event log goes (default: a temp dir)"
    )
    parser.add_argument("--seed", type=int, default=0)


def _progress(enabled: bool) -> Any:
    """A rich progress bar on a terminal; None (silent) when piped or rich is missing."""
    return progress_bar(sys.stdout, "demo", unit="requests") if enabled else None


def main(args: argparse.Namespace) -> int:
    # vLLM's own startup warnings (hybrid KV cache manager, experimental API) are noise here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        print(f"kvledger demo needs vLLM's scheduler: {reason}", file=sys.stderr)
        print("install it with: make setup-vllm", file=sys.stderr)
        return 2
    from connector.testing.run import RunSpec, run, summarize

    # The demo is an application: it may quiet vLLM's own logger (a library never would).
    logging.getLogger("vllm").setLevel(logging.ERROR)

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvledger-demo-")
    spec = RunSpec(
        num_requests=args.requests,
        num_gpu_blocks=args.blocks,
        prompt_len=(20, 90),
        max_tokens=(30, 90),
        shared_prefix=16,
        repeat_prompts=3,
        enable_prefix_caching=args.prefix_caching,
        async_scheduling=args.async_scheduling,
        model_runner_v2=not args.mrv1,
        extra_config={"chunk_size": args.chunk_size, "discard_partial_chunks": False},
        seed=args.seed,
    )
    print(
        f"vLLM scheduler: {args.blocks} blocks of 16 tokens, {args.requests} requests (+3 repeated "
        f"prompts), chunk {args.chunk_size}, prefix caching {'on' if args.prefix_caching else 'off'}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, {'MRV1' if args.mrv1 else 'MRV2'}",
        flush=True,
    )
    bar = _progress(sys.stdout.isatty())
    if bar is None:
        report = run(spec, log_dir=log_dir)
    else:
        with bar:
            task = bar.add_task("demo", total=spec.num_requests + spec.repeat_prompts, step=0)

            def tick(step: int, finished: int, total: int) -> None:
                bar.update(task, completed=finished, total=total, step=step)

            report = run(spec, log_dir=log_dir, progress=tick)
    rows = list(summarize(report))
    log_problems = _check_log(report.log_path)
    rows.append(("log", report.log_path or "-"))
    rows.append(("log replay problems", "unchecked" if log_problems is None else log_problems))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    for line in [
        *report.violations[:5],
        *(m.describe() for m in report.mismatches[:5]),
        *report.leaks,
    ]:
        print(f"  ! {line}")
    ok = report.ok and report.preemptions > 0 and not log_problems
    print("OK: every token matched its oracle value at every step" if ok else "FAILED")
    if ok and report.log_path:
        print(f"next: kvledger check {report.log_path}")
    return 0 if ok else 1


def _check_log(path: str | None) -> int | None:
    """Problems found re-checking the written log offline (None: no log was written)."""
    if path is None or not os.path.exists(path):
        return None
    from replay.replayer import check

    result = check(path)
    return len(result.problems)
