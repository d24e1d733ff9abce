"""Where a steady decode step's time goes inside the connector (or the recorder), measured in
place: vLLM's real scheduler stepping ``--requests`` decoding requests, each part of ours
timed by a wrapper around it, median over ``--steps`` steps.

Why in place: between two of our calls vLLM's ``schedule()`` runs over its own data, so every
object and function of ours is touched on cold caches, and costs two to ten times what it
costs under ``timeit`` (docs/design-notes.md, note 25). The parts nest (a method's figure
includes those it calls); each wrapper adds well under a microsecond.

    python bench/step_parts.py                  # KVLedgerConnector, no log
    python bench/step_parts.py --log            # with its event log (on the log's thread)
    python bench/step_parts.py --recorder       # KVLedgerRecorder (log on) over a do-nothing connector

With a log, the log's own thread is timed too, in its CPU time (``time.thread_time_ns``): what
it spends framing each step (``_BackgroundOutput._frame``), and writing (``_do``: each round's
one write of the frames it built), spread over the frames it framed. That thread holds the GIL
while it frames, so its time is taken from the scheduler's thread on any number of cores.

It prints numbers and never passes or fails on them. For ratios against a baseline, use
``scheduler_overhead.py`` and ``recorder_bench.py``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import recorder_bench  # noqa: E402
from bench import scheduler_overhead as so  # noqa: E402


def parts(recorder: bool) -> list[tuple[Any, str]]:
    """(class, method) of each part timed, outermost first."""
    from kvledger.connector import logwriter, recording, scheduler, vllm
    from kvledger.connector import recorder as rr
    from kvledger.tracker import tracker

    writer = [
        (logwriter.LogWriter, "append_decoded"),
        (logwriter.LogWriter, "end_step"),
    ]
    if recorder:
        return [
            (rr.KVLedgerRecorder, "build_connector_meta"),
            (recording.SchedulerRecorder, "scheduled"),
            (recording._Batch, "step"),
            (recording.SchedulerRecorder, "_decoded"),
            (recording.SchedulerRecorder, "end_step"),
            (rr.KVLedgerRecorder, "update_connector_output"),
            (rr.KVLedgerRecorder, "get_kv_connector_stats"),
            (rr.KVLedgerRecorder, "take_events"),
            *writer,
        ]
    return [
        (vllm.KVLedgerConnector, "build_connector_meta"),
        (scheduler.SchedulerSide, "build_connector_meta"),
        (scheduler.SchedulerSide, "_steady_batch"),
        (tracker.Tracker, "decode_batch"),
        (tracker._Decoding, "take"),
        (tracker.Tracker, "record_decoded"),
        (scheduler.SchedulerSide, "_plan"),
        (tracker.Tracker, "end_step"),
        (vllm.KVLedgerConnector, "update_connector_output"),
        (vllm.KVLedgerConnector, "get_kv_connector_stats"),
        (scheduler.SchedulerSide, "metrics"),
        *writer,
    ]


def wrap(cls: Any, name: str, clock: Any = time.perf_counter_ns) -> list[int]:
    """Time each call of ``cls.name`` by ``clock`` into the returned list (nanoseconds);
    ``time.thread_time_ns`` counts the calling thread's CPU time alone."""
    original = getattr(cls, name)
    calls: list[int] = []

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return original(*args, **kwargs)
        finally:
            calls.append(clock() - t0)

    setattr(cls, name, timed)
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    so.timing_arguments(p)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--log", action="store_true", help="the connector with its event log")
    p.add_argument("--recorder", action="store_true", help="KVLedgerRecorder, log on")
    p.set_defaults(steps=300, rounds=1)
    args = so.parse_timing(p, argv)
    cfg = so.decode_config(args)
    if cfg is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="kvledger-parts-") as tmp:
        timers = [(f"{cls.__name__}.{name}", wrap(cls, name)) for cls, name in parts(args.recorder)]
        from kvledger.connector.logwriter import _BackgroundOutput

        framed = wrap(_BackgroundOutput, "_frame", time.thread_time_ns)
        wrote = wrap(_BackgroundOutput, "_do", time.thread_time_ns)
        if args.recorder:
            spec = recorder_bench.recorder_spec(tmp)
        else:
            base = so.Variant("base", cfg)
            token_bytes = so.token_bytes(base.harness)
            base.close()
            spec = so.connector_spec(args, token_bytes, tmp if args.log else None)
        v = so.Variant("parts", cfg.with_(kv_connector=spec))
        try:
            so.warm_up(v, args)
            gc.collect()
            gc.freeze()  # as vLLM's EngineCore does
            per: dict[str, list[int]] = collections.defaultdict(list)
            steps: list[int] = []
            framed.clear()
            wrote.clear()
            for _ in range(args.steps):
                for _, calls in timers:
                    calls.clear()
                t0 = time.perf_counter_ns()
                v.step()
                steps.append(time.perf_counter_ns() - t0)
                for label, calls in timers:
                    per[label].append(sum(calls))
            # The thread's work of the timed steps (a round under way when they ended, whose
            # frames are not counted yet, is left out on both sides of the division).
            thread = list(framed), list(wrote)
        finally:
            v.close()
    what = "KVLedgerRecorder, log on" if args.recorder else "KVLedgerConnector"
    if not args.recorder:
        what += ", log on" if args.log else ", no log"
    print(f"{what}: {args.requests} requests decoding, {args.steps} steps")
    print(f"a whole step (schedule, worker, update): {statistics.median(steps) / 1e3:.1f} us")
    print(f"{'part':<45} {'median us':>10} {'mean us':>9}")
    for label, _ in timers:
        xs = per[label]
        print(f"{label:<45} {statistics.median(xs) / 1e3:>10.1f} {statistics.mean(xs) / 1e3:>9.1f}")
    frames, writes = thread
    if frames:
        print(f"the log's thread, CPU time: {len(frames)} frames in {len(writes)} rounds")
        print(
            f"{'  framing a step':<45} {statistics.median(frames) / 1e3:>10.1f}"
            f" {statistics.mean(frames) / 1e3:>9.1f}"
        )
        print(
            f"{'  writing, per step framed':<45} {'':>10} {sum(writes) / len(frames) / 1e3:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
