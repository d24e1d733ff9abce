"""Run vLLM's real scheduler with KVLedgerConnector end to end, on CPU, and prove the KV right.

The scheduler role of the connector is loaded by vLLM itself through
``kv_connector_module_path``; the worker role is a second ``KVLedgerConnector`` instance (a
``FaultyKVLedgerConnector``, which can fail chosen chunk loads), driven by the rigs' model
runner (``connector.testing.driver``: vLLM 0.33's call order) over CPU paged caches owned by
the KV-content oracle. The fake forward pass writes every scheduled token's oracle value; after
every step every computed token of every running request is checked.

Used by the integration tests, the replay tests' real logs and ``kvledger demo``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvledger.connector.testing.driver import ModelRunner, engine_config
from kvledger.connector.testing.faults import FaultyWorkerSide, LoadFault
from kvledger.connector.testing.harness import HarnessConfig, SchedulerHarness
from kvledger.connector.testing.oracle import Mismatch, TokenMismatch

__all__ = ["RunReport", "RunSpec", "run", "run_workload", "runner", "summarize"]


@dataclasses.dataclass(frozen=True)
class RunSpec(HarnessConfig):
    """A workload, and the engine (the ``HarnessConfig`` fields, with a smaller pool and batch
    by default) and connector settings to run it under. ``kv_connector`` is the runner's: it
    loads KVLedgerConnector with ``extra_config``."""

    # The engine: HarnessConfig's fields, three with other defaults.
    num_gpu_blocks: int = 24
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    # The workload.
    num_requests: int = 8
    prompt_len: tuple[int, int] = (48, 160)
    max_tokens: tuple[int, int] = (8, 48)
    # Requests share a prompt prefix of this many tokens (prefix hits across requests).
    shared_prefix: int = 32
    # Prompts of the first requests come again as new requests once those finished: full
    # prompt hits in the pool.
    repeat_prompts: int = 2
    # The connector: its kv_connector_extra_config, and the layout of the worker's caches.
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"chunk_size": 32})
    layout: str = "flash_attn"
    # The last layers stand for a drafter's (speculative decoding): vLLM then defers
    # wait_for_save past the draft forward (connector/testing/driver.py).
    drafter_layers: int = 0
    # The run.
    verify: bool = True
    max_steps: int = 5000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_connector is not None:
            raise ValueError("RunSpec.kv_connector is set by the runner; use extra_config")

    @property
    def requests(self) -> int:
        """The requests the workload sends: its own, then the repeated prompts."""
        return self.num_requests + min(self.repeat_prompts, self.num_requests)


@attrs.frozen
class RunReport:
    requests: int
    steps: int
    preemptions: int
    resumptions: int
    tokens_loaded: int
    tokens_loaded_on_resume: int
    full_hits: int
    tokens_saved: int
    chunks_saved: int
    load_errors: int
    violations: tuple[str, ...]
    mismatches: tuple[Mismatch | TokenMismatch, ...]
    leaks: tuple[str, ...]
    adapter_errors: int
    log_path: str | None
    seconds: float
    finished: int

    @property
    def ok(self) -> bool:
        return not (self.violations or self.mismatches or self.leaks or self.adapter_errors)


def _workload(spec: RunSpec) -> list[tuple[str, list[int], int]]:
    rng = random.Random(spec.seed)
    prefix = [rng.randrange(10, 1000) for _ in range(spec.shared_prefix)]
    out: list[tuple[str, list[int], int]] = []
    for i in range(spec.num_requests):
        n = rng.randint(*spec.prompt_len)
        prompt = (prefix + [rng.randrange(10, 1000) for _ in range(n)])[: max(n, 1)]
        out.append((f"req-{i}", prompt, rng.randint(*spec.max_tokens)))
    return out


def run_workload(
    runner: ModelRunner, spec: RunSpec, after_step: Callable[[Any], None] | None = None
) -> int:
    """Run ``spec``'s workload on ``runner`` (its requests, then its prompts sent again):
    the steps run."""
    return runner.run(
        _workload(spec),
        repeat_prompts=spec.repeat_prompts,
        max_steps=spec.max_steps,
        verify=spec.verify,
        after_step=after_step,
    )


class _Runner(ModelRunner):
    """The model runner with ``FaultyKVLedgerConnector`` as the worker role: it knows which
    requests' loads failed before the forward (theirs, or a block that another request's load
    failed or the scheduler refused), so their KV is written over a wrong prefix."""

    def __init__(self, spec: RunSpec, load_fault: LoadFault | None, log_dir: str | None) -> None:
        extra = dict(spec.extra_config)
        if log_dir is not None:
            extra["log_dir"] = log_dir
        extra.setdefault("strict", False)
        kv_connector = {
            "kv_connector": "KVLedgerConnector",
            "kv_connector_module_path": "kvledger.connector.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

        def make_worker(harness: SchedulerHarness) -> Any:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            from kvledger.connector.testing.vllm import FaultyKVLedgerConnector  # imports vLLM

            return FaultyKVLedgerConnector(
                harness.vllm_config,
                KVConnectorRole.WORKER,
                harness.kv_cache_config,
                layout=spec.layout,
                load_fault=load_fault,
            )

        config = engine_config(spec, kv_connector)
        super().__init__(
            config,
            layout=spec.layout,
            make_worker=make_worker,
            drafter_layers=spec.drafter_layers,
        )

    def failed_loads(self, out: Any) -> set[str]:
        side: FaultyWorkerSide = self.worker.worker_side
        bad = side.failed_load_requests()
        refused = set(out.kv_connector_metadata.plan.refused_blocks) | side.load_error_blocks()
        return bad | self.holders(out, refused)


def runner(
    spec: RunSpec | None = None,
    *,
    load_fault: LoadFault | None = None,
    log_dir: str | None = None,
) -> ModelRunner:
    """The model runner of ``spec`` (KVLedgerConnector; ``FaultyKVLedgerConnector`` as the
    worker role), for a test that sends its own requests, phase by phase
    (``ModelRunner.run``: the oracle checks every step)."""
    return _Runner(spec or RunSpec(), load_fault, log_dir)


def run(
    spec: RunSpec | None = None,
    *,
    load_fault: LoadFault | None = None,
    log_dir: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> RunReport:
    """Run the workload to completion; ``progress(step, finished, total)`` after each step."""
    spec = spec or RunSpec()
    started = time.perf_counter()
    runner = _Runner(spec, load_fault, log_dir)
    harness = runner.harness
    total = spec.requests

    def after_step(result: Any) -> None:
        if progress is not None:
            progress(runner.step + 1, len(harness.finished), total)

    steps = run_workload(runner, spec, after_step)
    side = harness.connector.scheduler_side
    side.shutdown()
    worker_side = runner.worker.worker_side
    pool = side.tracker.index.stats()
    leaks = runner.leaks(
        *([f"pool slots: {pool}"] if pool["writing"] or pool["pinned"] else []),
        *([f"tracker still holds {sorted(side.tracker.states)}"] if side.tracker.states else []),
        *(["saves still in flight"] if worker_side.saves_in_flight else []),
    )
    harness.close()
    return RunReport(
        requests=total,
        steps=steps,
        preemptions=harness.stats.preemptions,
        resumptions=harness.stats.resumptions,
        tokens_loaded=worker_side.stats["tokens_loaded"],
        tokens_loaded_on_resume=side.load_stats["tokens_loaded_on_resume"],
        full_hits=side.load_stats["full_hits"],
        tokens_saved=worker_side.stats["tokens_saved"],
        chunks_saved=worker_side.stats["chunks_saved"],
        load_errors=runner.load_errors,
        violations=tuple(v.describe() for v in side.tracker.violations),
        mismatches=tuple(m for _, m in runner.mismatches),
        leaks=tuple(leaks),
        adapter_errors=side.adapter_errors,
        log_path=side.log_path,
        seconds=time.perf_counter() - started,
        finished=len(harness.finished),
    )


def summarize(report: RunReport) -> Sequence[tuple[str, object]]:
    return [
        ("requests", report.requests),
        ("steps", report.steps),
        ("preemptions", report.preemptions),
        ("resumptions", report.resumptions),
        ("tokens loaded", report.tokens_loaded),
        ("  of which on resume", report.tokens_loaded_on_resume),
        ("full-prompt hits", report.full_hits),
        ("tokens saved", report.tokens_saved),
        ("load errors (recomputed)", report.load_errors),
        ("violations", len(report.violations)),
        ("oracle mismatches", len(report.mismatches)),
        ("leaks", len(report.leaks)),
        ("seconds", round(report.seconds, 2)),
    ]
