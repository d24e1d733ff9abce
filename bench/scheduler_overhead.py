#!/usr/bin/env python3
"""Scheduler-side overhead of KVLedgerConnector: vLLM's real scheduler, with and without it.

Run by hand; it prints numbers and never passes or fails on them (the exit status is non-zero
only if the run itself went wrong: a preemption, an adapter error, a violation). Three (four with
``--log``) ``SchedulerHarness`` instances share one ``HarnessConfig`` except ``kv_connector``:

  base   no connector
  null   a connector that does nothing (defined here), under the same worker loop as conn
         (below): vLLM's own cost of having a connector, and of the worker loop running in
         between, i.e. the floor for any connector; conn's target is against it (skip with
         --no-null)
  null2  (--twin) null again, identical but for its name: what two identical variants read
         apart in this run, its noise floor (printed after the target line)
  spin   (--calibrate US) null spending US microseconds busy a step: a known cost
  facts  (--facts) null reading each step's counts, scheduled counts and new blocks from vLLM
         as the connector's steady check does, and doing nothing with them
  conn   KVLedgerConnector, kv_connector_extra_config {"chunk_size": 256}, no event log
  log    the same, writing the event log to a temp dir, on the log's own thread (only with --log)
  logsync  the same, writing the log on the scheduler thread (log_background off; with --log)
  baseev   no connector, vLLM's KV cache events on (its null publisher; with --kv-events)
  events   conn with vLLM's KV cache events on: the pool's KV events too (connector/pool_events.py;
           with --kv-events). events / baseev is the pool events' own cost; conn runs with
           them off, as every variant above.

Each gets ``--requests`` prompts of ``--prompt-len`` distinct random tokens, enough GPU blocks and
batch budget for all of them to run at once without preemption, and prefix caching on.

Phase 1 (not timed): add the requests, step until every one is running past its prefill, then
``--warmup-steps`` more decode steps (the prefill's chunk saves complete and are reported).

Phase 2 (timed): ``--steps`` decode steps per variant, split into ``--rounds`` rounds; within a
round the variants take turns of ``--block`` steps, in a new random order every turn (seeded
by ``--seed``), so drift on a shared machine and the order itself hit all alike. The cyclic GC's heap is frozen first, as vLLM's EngineCore does.
Only the scheduler's own work is timed: ``scheduler.schedule()`` plus
``scheduler.update_from_output()`` (where vLLM calls the connector's scheduler-side methods),
measured by ``perf_counter_ns`` wrappers installed on the scheduler instance. The worker and
the harness's fake sampler are not timed. For the connector variants the worker is a second
KVLedgerConnector in the worker role over small CPU KV tensors, driven by the rigs' model
runner (connector/testing/driver.py: vLLM's call order, no KV computed), so the scheduler gets
the worker metadata a real worker would send; ``null`` runs under the same model runner (its
worker role does nothing), so that vLLM's ``update_from_output`` meets the same process state in
both: without it, null's caches stayed warm across the step and conn's did not, and 170 to 250
us a step of conn's showed outside its methods (docs/performance.md). "connector" time is the time spent inside the
scheduler-role connector's methods, measured by wrappers on that instance (outermost call
only).

Figures: median per-step time per variant; "ratio" is median(variant) / median(base) over all
timed steps; the per-round ratios (median of the variant's steps / median of base's steps in
the same round) give min / median / max; per connector method, calls and mean time per step.
The target line reads the paired figure (``paired_ratios``): each turn of a variant over the
reference's same turn, the median of those per round, the median of the rounds. The two ran
the same steps of the workload a few milliseconds apart, so what the machine and the
workload did to both cancels; the unpaired figures follow it. ``--calibrate US`` adds a
do-nothing connector that spends US microseconds busy in each ``build_connector_meta``,
a known cost for the figures to recover; ``--facts`` one that reads what checking (and, in the
recorder bench, recording) a steady step must read from vLLM and does nothing with it: the
floor of any connector that checks its steps. The default of 1,000 timed steps is what
brings two identical variants within about a point of each other on these machines (with 200
they read up to 5 points apart: docs/performance.md).
``--profile`` then runs extra (untimed) connector steps under cProfile and prints the top
functions of tracker/ and connector/ by cumulative time.

  python bench/scheduler_overhead.py
  python bench/scheduler_overhead.py --requests 128 --steps 1000 --rounds 5 --prompt-len 512 --log
  python bench/scheduler_overhead.py --log --twin --calibrate 20 --facts
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import inspect
import io
import logging
import operator
import os
import platform
import pstats
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/scheduler_overhead.py` from anywhere
    sys.path.insert(0, str(ROOT))

from kvledger.connector.testing.driver import ModelRunner  # noqa: E402
from kvledger.connector.testing.harness import HarnessConfig, SchedulerHarness, skip_reason  # noqa: E402

# Issue 25's goal: a connector against the do-nothing one, median of the rounds (1.02 is the
# noise floor, where identical variants read apart).
TARGET = 1.03


# --------------------------------------------------------------------------------------------
# A connector that does nothing: the floor, i.e. vLLM's own cost of having a connector
# --------------------------------------------------------------------------------------------


@functools.cache
def _null_connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class NullConnector(KVConnectorBase_V1):
        """Answers every scheduler-side call with "nothing" (no hit, no plan, free now)."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            spin = self._spin_ns
            if spin:  # --calibrate: a known cost, spent where ours is
                end = time.perf_counter_ns() + spin
                while time.perf_counter_ns() < end:
                    pass
            return KVConnectorMetadata()

        @functools.cached_property
        def _spin_ns(self) -> int:
            return int(float(self._extra.get("spin_us", 0)) * 1000)

        @functools.cached_property
        def _extra(self) -> dict[str, Any]:
            """The bench's settings of this variant (``spin_connector``, ``facts_connector``)."""
            return getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any
        ) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

    return NullConnector


# The kv_transfer_config that loads it (both scheduler benches time it as ``null``).
NULL_CONNECTOR = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "bench.scheduler_overhead",
    "kv_role": "kv_both",
}


@functools.cache
def _facts_connector_class() -> type:
    from kvledger.connector.edge import token_list

    class FactsConnector(_null_connector_class()):  # type: ignore[misc]
        """``null`` that reads, each step, what checking and recording a steady decode step
        cannot do without, the way our connectors read it, and decides and writes nothing:
        vLLM's counts against the step before's (one C pass), its scheduled counts and new
        blocks (the same), and with ``tokens`` each request's new token from the list vLLM
        appends it to (the recorder's facts; the connector records none in a steady step).
        What is left of our cost above it is ours to cut; it is the floor below that."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.read_tokens = bool(self._extra.get("tokens"))
            self.lists_of: dict[str, Any] = {}  # req_id -> the list vLLM appends tokens to
            self.req_ids: list[str] = []
            self.lists: list[Any] = []
            self.last: list[int] = []
            self.tokens: tuple[int, ...] = ()
            self.steady = False
            self.grown = 0  # requests whose table grew a block this step

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            self.lists_of[request.request_id] = token_list(request)
            return 0, False

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            cached = scheduler_output.scheduled_cached_reqs
            counts, n = cached.num_computed_tokens, len(cached.req_ids)
            steady = (
                len(self.last) == n
                and [*map(operator.sub, counts, self.last)].count(1) == n
                and [*scheduler_output.num_scheduled_tokens.values()].count(1) == n
            )
            self.grown = n - cached.new_block_ids.count(None)
            if self.read_tokens:
                if cached.req_ids != self.req_ids:
                    self.req_ids = list(cached.req_ids)
                    self.lists = [self.lists_of[r] for r in self.req_ids]
                self.tokens = tuple(map(operator.getitem, self.lists, counts))
            self.last = list(counts)
            self.steady = steady
            return super().build_connector_meta(scheduler_output)

    return FactsConnector


def facts_connector(tokens: bool) -> dict[str, Any]:
    """``--facts``: the kv_transfer_config of ``FactsConnector`` (``tokens``: the recorder's
    facts too)."""
    return {
        "kv_connector": "FactsConnector",
        "kv_connector_module_path": "bench.scheduler_overhead",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tokens": tokens},
    }


def spin_connector(us: float) -> dict[str, Any]:
    """``null`` that spends ``us`` microseconds in each ``build_connector_meta``, busy: a known
    cost, which ``--calibrate`` checks the figures recover."""
    return {**NULL_CONNECTOR, "kv_connector_extra_config": {"spin_us": us}}


def __getattr__(name: str) -> Any:
    """vLLM loads ``NullConnector`` from this module by name; built on first access so that
    importing this file does not import vLLM."""
    if name == "NullConnector":
        return _null_connector_class()
    if name == "FactsConnector":
        return _facts_connector_class()
    raise AttributeError(name)


# --------------------------------------------------------------------------------------------
# Timing wrappers (installed on instances; no project file is changed)
# --------------------------------------------------------------------------------------------


class StepTimer:
    """Accumulates nanoseconds spent in the scheduler's methods and in the connector's."""

    def __init__(self) -> None:
        self.sched_ns = 0
        self.conn_ns = 0
        self.conn_depth = 0
        self.per_method: dict[str, list[int]] = {}  # name -> [calls, ns]
        self.profiler: cProfile.Profile | None = None

    def take(self) -> tuple[int, int]:
        out = (self.sched_ns, self.conn_ns)
        self.sched_ns = self.conn_ns = 0
        return out


def wrap_scheduler(scheduler: Any, timer: StepTimer) -> None:
    for name in ("schedule", "update_from_output"):
        original = getattr(scheduler, name)

        def timed(*args: Any, _fn: Callable[..., Any] = original, **kwargs: Any) -> Any:
            prof = timer.profiler
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                timer.sched_ns += time.perf_counter_ns() - t0
                if prof is not None:
                    prof.disable()

        setattr(scheduler, name, timed)


def wrap_connector(connector: Any, timer: StepTimer) -> list[str]:
    """Wrap every public method of the scheduler-role connector (its own and the base class's
    defaults that vLLM calls, e.g. has_pending_block_frees); nested calls count once."""
    names = []
    for name in dir(type(connector)):
        if name.startswith("_"):
            continue
        static = inspect.getattr_static(connector, name)
        if not inspect.isfunction(static):  # properties, class attributes, static methods
            continue
        original = getattr(connector, name)
        stat = timer.per_method.setdefault(name, [0, 0])

        def timed(
            *args: Any, _fn: Callable[..., Any] = original, _stat: list[int] = stat, **kwargs: Any
        ) -> Any:
            if timer.conn_depth:
                return _fn(*args, **kwargs)
            timer.conn_depth = 1
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                timer.conn_depth = 0
                timer.conn_ns += dt
                _stat[0] += 1
                _stat[1] += dt

        setattr(connector, name, timed)
        names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------


class Variant:
    def __init__(self, name: str, config: HarnessConfig, *, driven: bool | None = None) -> None:
        """``driven``: the scheduler's steps run the rigs' model runner in between (a worker
        role for the connector); default: only for KVLedgerConnector, whose scheduler side
        needs its worker's reports."""
        self.name = name
        self.runner: ModelRunner | None = None
        extra = (config.kv_connector or {}).get("kv_connector_extra_config") or {}
        self.spin_us = float(extra.get("spin_us", 0))  # --calibrate's known cost
        ours = config.kv_connector is not None and config.kv_connector["kv_connector"] == (
            "KVLedgerConnector"
        )
        if driven if driven is not None else ours:
            # The rigs' model runner (connector/testing/driver.py) drives the worker role in
            # vLLM's call order: the scheduler gets the output a real worker would send. No KV
            # is computed: the oracle's writes, between schedule() and update_from_output(),
            # would slow the timed scheduler down (they cost no real scheduler anything).
            self.runner = ModelRunner(config, compute=False)
            self.harness = self.runner.harness
        else:  # no worker: the harness reports an empty KVConnectorOutput
            self.harness = SchedulerHarness(config)
        self.connector = self.harness.connector
        self.timer = StepTimer()
        wrap_scheduler(self.harness.scheduler, self.timer)
        self.wrapped = wrap_connector(self.connector, self.timer) if self.connector else []
        self.sched_us: list[float] = []  # per timed step
        self.conn_us: list[float] = []
        self.rounds: list[list[float]] = []  # per round, per step scheduler us
        # Per round, per turn: the us of the turn's steps. Every variant runs once a turn, at
        # the same step of the workload, so turn t of two variants is a pair (paired_ratios).
        self.turns: list[list[float]] = []

    def step(self) -> Any:
        result = self.harness.step()
        if result is None:
            raise RuntimeError(f"{self.name}: nothing left to schedule")
        return result

    def run_block(self, steps: int, num_requests: int) -> None:
        """``steps`` timed decode steps; checks each one decoded every request."""
        preemptions = self.harness.stats.preemptions
        self.timer.take()
        for _ in range(steps):
            result = self.step()
            sched_ns, conn_ns = self.timer.take()
            n = len(result.num_scheduled_tokens)
            if n != num_requests or any(v != 1 for v in result.num_scheduled_tokens.values()):
                raise RuntimeError(f"{self.name}: a timed step scheduled {n} requests, not decode")
            us = sched_ns / 1e3
            self.sched_us.append(us)
            self.conn_us.append(conn_ns / 1e3)
            self.rounds[-1].append(us)
        self.turns[-1].append(sum(self.rounds[-1][-steps:]))  # this turn: the steps just run
        if self.harness.stats.preemptions != preemptions or self.harness.finished:
            raise RuntimeError(f"{self.name}: preemption or finish during the timed phase")

    def problems(self) -> list[str]:
        if self.runner is None or not hasattr(self.connector, "scheduler_side"):
            return []
        side = self.connector.scheduler_side
        out = []
        if side.adapter_errors:
            out.append(f"{self.name}: {side.adapter_errors} adapter errors")
        if side.tracker.violations:
            out.append(f"{self.name}: violations {[v.describe() for v in side.tracker.violations]}")
        return out

    def close(self) -> None:
        if self.runner is not None:
            self.runner.worker.shutdown()
        self.harness.close()


def make_config(args: argparse.Namespace, decode_tokens: int) -> HarnessConfig:
    per_request = -(-(args.prompt_len + decode_tokens) // args.block_size)
    return HarnessConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.requests * per_request + 1,  # + vLLM's null block
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(args.requests * args.prompt_len, 2048),
        max_model_len=args.prompt_len + decode_tokens + args.block_size,
        enable_prefix_caching=True,
        seed=args.seed,
    )


def timing_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and timing options of the scheduler benches (this one, recorder_bench)."""
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--steps", type=int, default=1000, help="timed decode steps per variant")
    p.add_argument("--rounds", type=int, default=5, help="rounds the timed steps split in")
    p.add_argument(
        "--block", type=int, default=2, help="steps a variant runs before the next one's turn"
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed decode steps")
    p.add_argument("--profile", action="store_true", help="cProfile the connector's steps")
    p.add_argument("--profile-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--twin",
        action="store_true",
        help="also time a second, identical do-nothing connector (null2): this run's own "
        "noise floor, printed beside the target line",
    )
    p.add_argument(
        "--calibrate",
        type=float,
        default=0.0,
        metavar="US",
        help="also time null spending US microseconds busy in each build_connector_meta: a "
        "known cost, to see what the figures read for it",
    )
    p.add_argument(
        "--facts",
        action="store_true",
        help="also time null reading what a steady step's check (and, in the recorder bench, "
        "its record) must read from vLLM, deciding and writing nothing: the floor of any "
        "such connector",
    )
    p.add_argument(
        "--no-gc",
        dest="gc",
        action="store_false",
        help="disable the cyclic GC over the timed phase (a diagnosis: what part of a "
        "variant's cost is the collections its allocations set off, in anyone's code)",
    )


def parse_timing(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed by ``p`` (``timing_arguments``'s options among its own), the timing
    options checked."""
    args = p.parse_args(argv)
    if args.steps < args.rounds or args.rounds < 1 or args.block < 1:
        p.error("--steps must be at least --rounds >= 1, and --block >= 1")
    if not args.profile:
        args.profile_steps = 0
    return args


def decode_config(args: argparse.Namespace) -> HarnessConfig | None:
    """The engine of a decode-steps run of ``args`` (``args.max_tokens`` set: no request
    finishes during it); None, said on stderr, where vLLM's scheduler cannot run here."""
    # vLLM's start-up warnings (no vllm._C, HMA off for this connector) are expected here.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    reason = skip_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return None
    per_round = args.steps // args.rounds
    decode = args.warmup_steps + 4 + per_round * args.rounds + args.profile_steps + 16
    args.max_tokens = decode
    return make_config(args, decode)


def token_bytes(harness: SchedulerHarness) -> int:
    """K and V bytes of one token over all layers, as the connector sizes its slots."""
    group = harness.kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    return int(spec.page_size_bytes) // int(spec.block_size) * len(group.layer_names)


def connector_spec(
    args: argparse.Namespace, token_bytes: int, log_dir: str | None, background: bool = True
) -> dict[str, Any]:
    extra: dict[str, Any] = {"chunk_size": args.chunk_size}
    # Slots for every full chunk of every prompt, twice over: nothing is evicted.
    slots = 2 * args.requests * (args.prompt_len // args.chunk_size + 1)
    extra["host_pool_bytes"] = slots * token_bytes * args.chunk_size
    if log_dir is not None:
        extra["log_dir"] = log_dir
        extra["log_background"] = background
    return {
        "kv_connector": "KVLedgerConnector",
        "kv_connector_module_path": "kvledger.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def run_timed(variants: list[Variant], args: argparse.Namespace) -> float:
    """The timed phase, the one loop of every scheduler bench (this one and
    bench/recorder_bench.py): ``args.steps`` decode steps per variant in ``args.rounds``
    rounds, the variants taking turns of ``args.block`` steps in a new order every turn
    (``turn_orders``) so that drift on a shared machine, and the order itself, hit all alike, after the cyclic GC's heap is frozen as vLLM's
    EngineCore does. Returns the wall seconds; the per-method figures are frozen after it."""
    per_round = args.steps // args.rounds
    for v in variants:  # count the timed phase only
        for stat in v.timer.per_method.values():
            stat[:] = [0, 0]
    # As EngineCore does after start-up: the long-lived heap leaves the cyclic GC's scans.
    gc.collect()
    gc.freeze()
    if not args.gc:
        gc.disable()
    t1 = time.perf_counter()
    order = turn_orders(len(variants), args.seed)
    for _ in range(args.rounds):
        for v in variants:
            v.rounds.append([])
            v.turns.append([])
        done = 0
        while done < per_round:
            n = min(args.block, per_round - done)
            for i in next(order):
                variants[i].run_block(n, args.requests)
            done += n
    wall = time.perf_counter() - t1
    gc.enable()
    for v in variants:  # freeze the per-method figures before --profile steps more
        v.timer.per_method = {k: list(s) for k, s in v.timer.per_method.items()}
    return wall


def turn_orders(n: int, seed: int) -> Iterator[list[int]]:
    """The order of the variants in each turn: a new random one every turn (seeded), never
    starting with the variant the last turn ended with. A fixed pattern biases the figures by
    position: with ``A B C`` then ``C B A`` the two ends ran twice in a row, on caches their
    first turn had just warmed, and read up to 4% faster than the identical variants between
    them (docs/performance.md, "position bias")."""
    rng = random.Random(seed)
    last = -1
    while True:
        order = list(range(n))
        rng.shuffle(order)
        if n > 1 and order[0] == last:
            order.append(order.pop(0))
        last = order[-1]
        yield order


def warm_up(v: Variant, args: argparse.Namespace) -> int:
    """Add the requests, step past every prefill, then ``warmup_steps`` decode steps."""
    rng = random.Random(args.seed)
    for i in range(args.requests):
        prompt = [rng.randrange(3, 1024) for _ in range(args.prompt_len)]
        v.harness.add_request(f"req-{i}", prompt, max_tokens=args.max_tokens)
    steps = 0
    while True:
        v.step()
        steps += 1
        sched = v.harness.scheduler
        running = len(sched.running) == args.requests and not sched.waiting
        if running and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running):
            break
        if steps > 100:
            raise RuntimeError(f"{v.name}: prefill not done after 100 steps")
    for _ in range(args.warmup_steps):
        v.step()
    if v.harness.stats.preemptions:
        raise RuntimeError(f"{v.name}: preempted during warm-up; more blocks needed")
    return steps


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def environment() -> list[str]:
    import torch
    import vllm

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    git = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "tracker", "connector"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        changed = [x for x in dirty if "/" in x]
        git = head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    return [
        f"kvledger {git}",
        f"python {platform.python_version()}  vllm {vllm.__version__}  torch {torch.__version__}",
        f"cpu {cpu}  x{os.cpu_count()}  loadavg {load}",
    ]


def round_ratios(v: Variant, ref: Variant) -> list[float]:
    """Per round: the median of ``v``'s steps over the median of ``ref``'s."""
    return [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(v.rounds, ref.rounds, strict=True)
    ]


def paired_ratios(v: Variant, ref: Variant) -> list[float]:
    """Per round: the median, over the round's turns, of ``v``'s turn over ``ref``'s same turn.

    The two ran the same steps of the workload (every variant's requests are at the same
    count in a turn; a block boundary is every request's at once), one turn of all the
    variants apart at most, so the machine's speed, which drifts from one tenth of a second
    to the next on these shared machines, is nearly the same for both. An unpaired median
    over the round compares two samples of a step time that spreads twofold (p10 to p90)
    and reads identical variants several points apart; pairs cancel what the two turns
    share. A round-off burst (a GC, the log thread's round, a stolen CPU) lands in one turn
    of one variant: an outlier pair, which the median leaves out, as the unpaired one does."""
    return [
        statistics.median(a / b for a, b in zip(x, y, strict=True))
        for x, y in zip(v.turns, ref.turns, strict=True)
    ]


def paired_ratio(v: Variant, ref: Variant) -> float:
    """The median of ``paired_ratios``: the figure a target is read on."""
    return statistics.median(paired_ratios(v, ref))


def report(variants: list[Variant], args: argparse.Namespace, reference: str = "base") -> None:
    """The table of every variant against the first (no connector), then the target line:
    each variant after ``reference`` against ``reference``."""
    base = variants[0]
    base_med = statistics.median(base.sched_us)
    null = next((v for v in variants if v.name == "null"), None)
    n = args.requests
    print()
    print(
        f"{'variant':<7} {'median us/step':>14} {'p10':>8} {'p90':>8} {'ratio':>6} "
        f"{'round ratio min/med/max':>24} {'connector us/step':>17} {'us/req/step':>11}"
    )
    for v in variants:
        med = statistics.median(v.sched_us)
        ratio = rr = conn = per_req = "-"
        if v is not base:
            rounds = round_ratios(v, base)
            ratio = f"{med / base_med:.3f}"
            rr = "/".join(f"{x:.3f}" for x in (min(rounds), statistics.median(rounds), max(rounds)))
            c = statistics.median(v.conn_us)
            conn = f"{c:.1f}"
            per_req = f"{c / n:.3f}"
        print(
            f"{v.name:<7} {med:>14.1f} {pct(v.sched_us, 0.1):>8.1f} {pct(v.sched_us, 0.9):>8.1f} "
            f"{ratio:>6} {rr:>24} {conn:>17} {per_req:>11}"
        )
    print(
        "(us = microseconds of schedule() + update_from_output(); ratio = median / base median; "
        "connector = inside the connector's methods, median per step)"
    )
    for v in variants[1:]:
        steps = len(v.sched_us)
        med = statistics.median(v.sched_us)
        c = statistics.median(v.conn_us)
        rest = statistics.median(a - b for a, b in zip(v.sched_us, v.conn_us, strict=True))
        print()
        line = (
            f"{v.name}: +{med - base_med:.1f} us/step over base; in the connector's methods "
            f"{c:.1f}; the rest of the step {rest:.1f} (base {base_med:.1f})"
        )
        if null is not None and v is not null:
            line += f"; +{med - statistics.median(null.sched_us):.1f} us/step over null"
        print(line)
        rows = sorted(
            ((k, st) for k, st in v.timer.per_method.items() if st[0]), key=lambda kv: -kv[1][1]
        )
        print(f"  {'method':<30} {'calls/step':>10} {'us/step':>8} {'us/call':>8}  (means)")
        for name, (calls, ns) in rows:
            print(
                f"  {name:<30} {calls / steps:>10.2f} {ns / 1e3 / steps:>8.1f} "
                f"{ns / 1e3 / calls:>8.2f}"
            )
    names = [v.name for v in variants]
    ref = variants[names.index(reference)]
    ref_med = statistics.median(ref.sched_us)
    verdict, unpaired = [], []
    after = variants[names.index(reference) + 1 :]
    twin = next((v for v in after if v.name == TWIN), None)
    ours = [v for v in after if v.name not in (TWIN, SPIN, FACTS)]  # the targets' variants
    for v in ours:
        rounds = paired_ratios(v, ref)
        r = statistics.median(rounds)
        verdict.append(
            f"{v.name} {r:.3f} {'<=' if r <= TARGET else '>'} {TARGET} "
            f"(rounds {min(rounds):.3f} to {max(rounds):.3f})"
        )
        unpaired.append(
            f"{v.name} {statistics.median(v.sched_us) / ref_med:.3f} "
            f"(per round {statistics.median(round_ratios(v, ref)):.3f})"
        )
    print()
    print(
        f"target: paired ratio to {reference}, median of the rounds, <= {TARGET}: "
        + ", ".join(verdict)
    )
    if twin is not None:
        print(floor_line(twin, ref))
    print("unpaired, the median step over the reference's: " + ", ".join(unpaired))
    facts = next((v for v in variants if v.name == FACTS), None)
    if facts is not None:
        above = [f"{v.name} {paired_ratio(v, facts):.3f}" for v in ours]
        print(
            f"facts: reading a steady step's facts alone reads {paired_ratio(facts, ref):.3f} "
            f"paired ({statistics.median(facts.conn_us):.1f} us a step in its methods); "
            "against it: " + ", ".join(above)
        )
    for v in variants:
        if v.spin_us:
            # A known cost, as a share of the reference's median step: what a faithful
            # figure reads for it.
            want = 1 + v.spin_us / ref_med
            print(
                f"calibration: {v.name} spends {v.spin_us:g} us busy a step, {want:.3f} of "
                f"{reference}'s median step; it reads {paired_ratio(v, ref):.3f} paired, "
                f"{statistics.median(v.sched_us) / ref_med:.3f} unpaired"
            )


# --twin's variant: a second do-nothing connector, identical to ``null`` but for its name.
TWIN = "null2"
# --calibrate's: null with a known cost.
SPIN = "spin"
# --facts': null reading what a steady step must read.
FACTS = "facts"


def floor_line(twin: Variant, ref: Variant) -> str:
    """What two identical variants read apart in this run (``--twin``), on both figures: a
    ratio nearer 1.000 than this is not told from the noise in it."""
    rounds = paired_ratios(twin, ref)
    r = statistics.median(rounds)
    floor = max(abs(x - 1) for x in (r, *rounds))
    unpaired = statistics.median(twin.sched_us) / statistics.median(ref.sched_us)
    urounds = round_ratios(twin, ref)
    return (
        f"noise floor: {twin.name}, identical to {ref.name}, reads {r:.3f} paired (rounds "
        f"{min(rounds):.3f} to {max(rounds):.3f}; unpaired {unpaired:.3f}, rounds "
        f"{min(urounds):.3f} to {max(urounds):.3f}): a paired ratio within {floor:.3f} of 1 "
        "is within this run's noise"
    )


def profile(v: Variant, args: argparse.Namespace) -> None:
    """cProfile over ``args.profile_steps`` more (untimed) steps of ``v``, restricted to the
    scheduler's two methods, filtered to this repository's tracker/ and connector/."""
    prof = cProfile.Profile()
    v.timer.profiler = prof
    for _ in range(args.profile_steps):
        v.step()
    v.timer.profiler = None
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats(os.environ.get("KVLEDGER_PROFILE_SORT", "cumulative"))
    pattern = r"kvledger/(tracker|connector)/"
    stats.print_stats(pattern, 15)
    text = re.sub(r"\S*/kvledger/", "kvledger/", buf.getvalue())
    print()
    print(f"cProfile, {v.name}, {args.profile_steps} steps (schedule + update_from_output only):")
    # Drop pstats' preamble lines up to the column header.
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    total = next((line for line in lines if "function calls" in line), "")
    print(total.strip())
    print("\n".join(lines[start:]).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    timing_arguments(p)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--log", action="store_true", help="also time the variant writing the log")
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="also time the connector and the base with vLLM's KV cache events on",
    )
    p.add_argument(
        "--no-null",
        dest="null",
        action="store_false",
        help="skip the do-nothing connector (vLLM's own cost of having a connector)",
    )
    p.add_argument(
        "--bare-null",
        action="store_true",
        help="run null without the worker loop, as this bench did before 2026-11-28 (its "
        "caches stay warm across the step; docs/performance.md)",
    )
    args = parse_timing(p, argv)
    if args.twin and not args.null:
        p.error("--twin times a second do-nothing connector: it needs the first (drop --no-null)")
    base_cfg = decode_config(args)
    if base_cfg is None:
        return 2
    per_round = args.steps // args.rounds
    tmp = tempfile.TemporaryDirectory(prefix="kvledger-bench-") if args.log else None

    print("scheduler overhead: vLLM's real Scheduler, decode steps, CPU")
    for line in environment():
        print(line)
    print(
        f"requests {args.requests}  prompt {args.prompt_len}  block {args.block_size}  "
        f"chunk {args.chunk_size}  gpu blocks {base_cfg.num_gpu_blocks}  "
        f"max_num_batched_tokens {base_cfg.max_num_batched_tokens}  prefix caching on  "
        f"sync scheduling  MRV2 {base_cfg.model_runner_v2}"
    )
    print(
        f"timed: {per_round * args.rounds} steps per variant in {args.rounds} rounds of "
        f"{per_round}, interleaved {args.block} steps at a time; warm-up: prefill + "
        f"{args.warmup_steps} decode steps"
    )

    variants: list[Variant] = []
    t0 = time.perf_counter()
    try:
        base = Variant("base", base_cfg)
        variants.append(base)
        tb = token_bytes(base.harness)
        if args.null:
            null_cfg = base_cfg.with_(kv_connector=NULL_CONNECTOR)
            variants.append(Variant("null", null_cfg, driven=not args.bare_null))
            if args.twin:
                variants.append(Variant(TWIN, null_cfg, driven=not args.bare_null))
            if args.calibrate:
                spin_cfg = base_cfg.with_(kv_connector=spin_connector(args.calibrate))
                variants.append(Variant(SPIN, spin_cfg, driven=not args.bare_null))
            if args.facts:
                facts_cfg = base_cfg.with_(kv_connector=facts_connector(tokens=False))
                variants.append(Variant(FACTS, facts_cfg, driven=not args.bare_null))
        conn = Variant("conn", base_cfg.with_(kv_connector=connector_spec(args, tb, None)))
        variants.append(conn)
        if args.kv_events:
            variants.append(Variant("baseev", base_cfg.with_(kv_events=True)))
            spec = connector_spec(args, tb, None)
            variants.append(Variant("events", base_cfg.with_(kv_events=True, kv_connector=spec)))
        if tmp is not None:
            cfg = base_cfg.with_(kv_connector=connector_spec(args, tb, tmp.name))
            variants.append(Variant("log", cfg))
            sync_dir = os.path.join(tmp.name, "sync")
            spec = connector_spec(args, tb, sync_dir, background=False)
            variants.append(Variant("logsync", base_cfg.with_(kv_connector=spec)))
        for v in variants:
            prefill_steps = warm_up(v, args)
        print(
            f"built + warmed in {time.perf_counter() - t0:.1f}s (prefill took {prefill_steps} "
            f"step(s)); connector methods wrapped: {len(conn.wrapped)}"
        )
        if tmp is not None:
            print(f"log variant writes {variants[-2].connector.scheduler_side.log_path}")

        wall = run_timed(variants, args)
        print(f"timed phase took {wall:.1f}s wall (all variants, hooks too)")
        if tmp is not None:
            size = os.path.getsize(variants[-1].connector.scheduler_side.log_path)
            print(f"log size after the run: {size} bytes")

        report(variants, args, reference="null" if args.null else "base")
        if args.profile:
            profile(conn, args)
        problems = [msg for v in variants for msg in v.problems()]
        for msg in problems:
            print("PROBLEM:", msg)
        return 1 if problems else 0
    finally:
        for v in variants:
            v.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
