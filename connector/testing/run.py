"""Run vLLM's real scheduler with KVLedgerConnector end to end, on CPU, and prove the KV right.

The scheduler role of the connector is loaded by vLLM itself through
``kv_connector_module_path``; the worker role is a second ``KVLedgerConnector`` instance (a
``FaultyKVLedgerConnector``, which can fail chosen chunk loads), driven by hand in the order
vLLM's model runner calls it, over CPU paged caches owned by the KV-content oracle. A fake
forward pass writes every scheduled token's oracle value; after every step every computed token
of every running request is checked.

Used by the integration tests, the replay tests' real logs and ``kvledger demo``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from connector.testing.faults import LoadFault
from connector.testing.harness import (
    HarnessConfig,
    SchedulerHarness,
    fake_token,
    make_kv_connector_output,
)
from connector.testing.oracle import KVOracle, Mismatch

__all__ = ["RunReport", "RunSpec", "run", "summarize"]


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
    # The run.
    verify: bool = True
    max_steps: int = 5000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_connector is not None:
            raise ValueError("RunSpec.kv_connector is set by the runner; use extra_config")


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
    mismatches: tuple[Mismatch, ...]
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


class _Driver:
    """The fake worker process: connector worker role, oracle forward pass, results."""

    def __init__(self, spec: RunSpec, load_fault: LoadFault | None, log_dir: str | None) -> None:
        from connector.testing.vllm import FaultyKVLedgerConnector  # imports vLLM

        extra = dict(spec.extra_config)
        if log_dir is not None:
            extra["log_dir"] = log_dir
        extra.setdefault("strict", False)
        kv_connector = {
            "kv_connector": "KVLedgerConnector",
            "kv_connector_module_path": "connector.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        # The spec's HarnessConfig part, with the connector the runner loads.
        engine = {f.name: getattr(spec, f.name) for f in dataclasses.fields(HarnessConfig)}
        config = HarnessConfig(**{**engine, "kv_connector": kv_connector})
        self.spec = spec
        self.harness = SchedulerHarness(config, on_scheduled=self._on_scheduled)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        group = self.harness.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.oracle = KVOracle(
            self.harness.layer_names,
            num_blocks=spec.num_gpu_blocks,
            block_size=spec.block_size,
            num_kv_heads=min(int(group.num_kv_heads), 4),
            head_size=min(int(group.head_size), 16),
            layout=spec.layout,
        )
        self.worker = FaultyKVLedgerConnector(
            self.harness.vllm_config,
            KVConnectorRole.WORKER,
            self.harness.kv_cache_config,
            layout=spec.layout,
            load_fault=load_fault,
        )
        self.worker.register_kv_caches(self.oracle.caches)
        self.tokens: dict[str, list[int]] = {}
        self.load_errors = 0
        self.skip_verify: set[str] = set()

    @property
    def scheduler_side(self) -> Any:
        return self.harness.connector.scheduler_side

    def tokens_of(self, req_id: str, upto: int) -> list[int]:
        tokens = self.tokens.setdefault(req_id, list(self.harness.prompts[req_id]))
        cfg = self.harness.config
        while len(tokens) < upto:
            tokens.append(fake_token(req_id, len(tokens), cfg.seed, cfg.vocab_size))
        return tokens

    def _scheduled_counts(self, out: Any) -> dict[str, int]:
        """num_computed_tokens before this step, per scheduled request, from the output."""
        counts = {new.req_id: int(new.num_computed_tokens) for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            counts[req_id] = int(cached.num_computed_tokens[i])
        return counts

    def _on_scheduled(self, out: Any) -> Any:
        """What a model runner does with one SchedulerOutput, in vLLM's order."""
        worker = self.worker
        meta = out.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # must not need the forward context
        side = worker.worker_side
        bad = side.failed_load_requests()
        refused = set(meta.plan.refused_blocks) | side.load_error_blocks()
        computed = self._scheduled_counts(out)
        for req_id, n in out.num_scheduled_tokens.items():
            start = computed[req_id]
            blocks = self.harness.request_view(req_id).block_ids[0]
            if refused and refused & set(blocks):
                bad.add(req_id)
            tokens = self.tokens_of(req_id, start + n)
            self.oracle.write(req_id, tokens, blocks, start, start + n, poisoned=req_id in bad)
        worker.wait_for_save()
        sending, recving = worker.get_finished(set(out.finished_req_ids))
        errors = worker.get_block_ids_with_load_errors()
        self.load_errors += len(errors)
        self.skip_verify = bad
        from connector.edge import WORKER_META_CHANNEL

        extra: dict[str, Any]
        if WORKER_META_CHANNEL:
            extra = {"kv_connector_worker_meta": worker.build_connector_worker_meta()}
        else:  # no worker metadata (connector/edge.py): the connector stats carry it
            extra = {"kv_connector_stats": worker.get_kv_connector_stats()}
        worker.clear_connector_metadata()
        return make_kv_connector_output(sending or (), recving or (), errors, **extra)

    def verify(self) -> list[Mismatch]:
        out: list[Mismatch] = []
        for req_id, view in self.harness.running_views().items():
            if req_id in self.skip_verify or not view.block_ids:
                continue
            upto = view.num_computed_tokens
            mismatch = self.oracle.verify(
                req_id, self.tokens_of(req_id, upto), view.block_ids[0], upto
            )
            if mismatch is not None:
                out.append(mismatch)
        return out


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
    driver = _Driver(spec, load_fault, log_dir)
    harness = driver.harness
    work = _workload(spec)
    total = len(work) + min(spec.repeat_prompts, len(work))
    pending: list[tuple[str, list[int], int]] = list(work)
    repeats = [(f"again-{rid}", prompt, 4) for rid, prompt, _ in work[: spec.repeat_prompts]]
    for rid, prompt, max_tokens in pending:
        harness.add_request(rid, prompt, max_tokens)
    mismatches: list[Mismatch] = []
    steps = 0
    while steps < spec.max_steps:
        result = harness.step()
        if result is None:
            if repeats:
                for rid, prompt, max_tokens in repeats:
                    harness.add_request(rid, prompt, max_tokens)
                repeats = []
                continue
            break
        steps += 1
        if spec.verify:
            mismatches.extend(driver.verify())
        if progress is not None:
            progress(steps, len(harness.finished), total)
    side = driver.scheduler_side
    side.shutdown()
    worker_stats = driver.worker.worker_side.stats
    leaks: list[str] = []
    usable = spec.num_gpu_blocks - 1  # block 0 is vLLM's null block
    if harness.num_free_blocks != usable:
        leaks.append(f"gpu blocks: {harness.num_free_blocks} free of {usable}")
    pool = side.tracker.index.stats()
    if pool["writing"] or pool["pinned"]:
        leaks.append(f"pool slots: {pool}")
    if side.tracker.states:
        leaks.append(f"tracker still holds {sorted(side.tracker.states)}")
    if driver.worker.worker_side.saves_in_flight:
        leaks.append("saves still in flight")
    if not harness.is_done():
        leaks.append(f"not done after {steps} steps: {harness.describe()}")
    harness.close()
    return RunReport(
        requests=total,
        steps=steps,
        preemptions=harness.stats.preemptions,
        resumptions=harness.stats.resumptions,
        tokens_loaded=worker_stats["tokens_loaded"],
        tokens_loaded_on_resume=side.load_stats["tokens_loaded_on_resume"],
        full_hits=side.load_stats["full_hits"],
        tokens_saved=worker_stats["tokens_saved"],
        chunks_saved=worker_stats["chunks_saved"],
        load_errors=driver.load_errors,
        violations=tuple(v.describe() for v in side.tracker.violations),
        mismatches=tuple(mismatches),
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
