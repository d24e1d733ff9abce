#!/usr/bin/env python3
"""Scheduler-side overhead of KVLedgerRecorder: vLLM's real scheduler, a do-nothing connector
bare and wrapped.

Run by hand; it prints numbers and never passes or fails on them. The method and the timed
loop are bench/scheduler_overhead.py's (``run_timed``; its harness variants, timers, warm-up
and report are reused): decode steps of ``--requests`` running requests, the variants
interleaved a few steps at a time, only ``schedule()`` + ``update_from_output()`` timed.
Variants:

  base    no connector
  null    NullConnector (bench/scheduler_overhead.py): vLLM's own cost of having a connector
  null2   (--twin) null again: this run's noise floor (two identical variants, read apart)
  rec     KVLedgerRecorder wrapping NullConnector, no log_dir: the forwarding alone
  reclog  the same, recording to a log in a temp dir (written on the log's own thread)
  recsync the same, the log written on the scheduler thread (log_background false)
  recfull (--full) the log on its own thread, steady decode steps not batched
          (steady_decode false: one Scheduled per request per step, the format before)
  recdig  (--digests) reclog with digests sampled: the scheduler side's part of them (which
          blocks to digest each step; the digests themselves are the worker's)
  spin    (--calibrate US) null spending US microseconds busy a step: a known cost
  facts   (--facts) null reading each step's counts and new tokens from vLLM as the
          recorder does, and doing nothing with them: the floor of any recorder
  recfree (--free-thread) reclog whose log thread frames and writes nothing: all that
          recording costs the scheduler's thread, and the bound of any writer off the
          process (issue 25: a writer process fed through a ring would still pay its handover)

The target line compares each recorder variant with ``null``, the wrapped connector alone:
what recording costs a connector (its own work comes on top in both). The worker side is not
timed here (no worker runs: the harness reports empty connector outputs). Digests are off
(their cost is bench/digest_bench.py's and bench/engine_bench.py's). ``--profile`` runs
``--profile-steps`` more (untimed) steps of ``reclog`` under cProfile.

  python bench/recorder_bench.py
  python bench/recorder_bench.py --requests 128 --steps 1000 --rounds 5 --prompt-len 512
  python bench/recorder_bench.py --twin --calibrate 20 --facts
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import scheduler_overhead as so  # noqa: E402


def recorder_spec(
    log_dir: str | None, background: bool = True, steady: bool = True, digests: str = "off"
) -> dict[str, Any]:
    extra: dict[str, Any] = {"inner": "bench.scheduler_overhead:NullConnector"}
    if log_dir is not None:
        extra["log_dir"] = log_dir
        extra["log_background"] = background
    if not steady:
        extra["steady_decode"] = False
    if digests != "off":
        extra["digests"] = digests
    return {
        "kv_connector": "KVLedgerRecorder",
        "kv_connector_module_path": "kvledger.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def free_log_thread(connector: Any) -> None:
    """Make the recorder's log thread take each round and do nothing with it: no frame built,
    nothing written. The scheduler's thread hands its records over as always."""
    out = connector.recording.log._out
    do = out._do

    def no_write(op: str, arg: Any) -> None:
        if op != "write":  # fsync, close: as always
            do(op, arg)

    out._frame = lambda *_: b""
    out._do = no_write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    so.timing_arguments(p)
    p.add_argument("--full", action="store_true", help="also time steady_decode false")
    p.add_argument(
        "--digests", action="store_true", help="also time digests sampled (the planner's part)"
    )
    p.add_argument(
        "--free-thread",
        action="store_true",
        help="also time reclog with a log thread that frames and writes nothing",
    )
    args = so.parse_timing(p, argv)
    cfg = so.decode_config(args)
    if cfg is None:
        return 2
    per_round = args.steps // args.rounds
    print("recorder overhead: vLLM's real Scheduler, decode steps, CPU")
    for line in so.environment():
        print(line)
    print(
        f"requests {args.requests}  prompt {args.prompt_len}  block {args.block_size}  "
        f"timed: {per_round * args.rounds} steps per variant in {args.rounds} rounds, "
        f"interleaved {args.block} steps at a time"
    )
    variants: list[so.Variant] = []
    with tempfile.TemporaryDirectory(prefix="kvledger-recbench-") as tmp:
        try:
            specs: list[tuple[str, dict[str, Any] | None]] = [
                ("base", None),
                ("null", so.NULL_CONNECTOR),
                *([(so.TWIN, so.NULL_CONNECTOR)] if args.twin else []),
                *([(so.SPIN, so.spin_connector(args.calibrate))] if args.calibrate else []),
                *([(so.FACTS, so.facts_connector(tokens=True))] if args.facts else []),
                ("rec", recorder_spec(None)),
                ("reclog", recorder_spec(os.path.join(tmp, "bg"))),
                ("recsync", recorder_spec(os.path.join(tmp, "sync"), background=False)),
            ]
            if args.full:
                specs.append(("recfull", recorder_spec(os.path.join(tmp, "full"), steady=False)))
            if args.digests:
                spec = recorder_spec(os.path.join(tmp, "dig"), digests="sampled")
                specs.append(("recdig", spec))
            if args.free_thread:
                specs.append(("recfree", recorder_spec(os.path.join(tmp, "free"))))
            for name, spec in specs:
                variants.append(so.Variant(name, cfg.with_(kv_connector=spec)))
                if name == "recfree":
                    free_log_thread(variants[-1].connector)
            for v in variants:
                so.warm_up(v, args)
            wall = so.run_timed(variants, args)
            print(f"timed phase took {wall:.1f}s wall")
            so.report(variants, args, reference="null")
            for v in variants:
                path = getattr(v.connector, "log_path", None)
                if path:
                    print(f"{v.name}: log {os.path.getsize(path)} bytes so far")
            if args.profile:
                so.profile(next(v for v in variants if v.name == "reclog"), args)
        finally:
            for v in variants:
                v.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
