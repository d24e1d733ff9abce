"""Run any vLLM v1 connector, wrapped in ``KVLedgerRecorder`` or not, under vLLM's real
scheduler on CPU, with the KV-content oracle checking every computed token.

The scheduler role is loaded by vLLM itself from the ``kv_transfer_config`` (the recorder by
``kv_connector_module_path``, or the bare inner); the worker role is a second instance of the
same class, driven by hand in the order vLLM 0.33's model runner (MRV1) calls it: preemptions,
bind, ``start_load_kv`` (a synchronous load lands before the forward), the fake forward pass
(the oracle writes the scheduled tokens), per layer ``wait_for_layer_load`` and
``save_kv_layer`` with a standardised ``[blocks, 2, block_size, heads * head]`` view of the
layer (what ExampleConnector expects), ``wait_for_save``, ``get_finished``, load errors, stats,
worker metadata, clear. The forward context carries a per-layer attention metadata and the
layers' ``kv_cache`` views, enough for a connector that reads them (ExampleConnector).

A request whose blocks a load reported bad this step is not verified (vLLM recomputes it).
Used by tests/test_recorder.py; the LMCache rigs have their own driver.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Mapping
from typing import Any

import attrs

from connector.testing.harness import HarnessConfig, SchedulerHarness, make_kv_connector_output
from connector.testing.oracle import KVOracle, Mismatch
from connector.testing.run import RunSpec, _workload

__all__ = [
    "WrappedReport",
    "WrappedSpec",
    "example_connector",
    "example_connector_cpu_problem",
    "example_connector_layout",
    "kv_transfer_config",
    "run_wrapped",
]


def example_connector() -> str:
    """vLLM's toy file connector by its registry name in the installed vLLM: ExampleConnector,
    called SharedStorageConnector before vLLM 0.12."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    return "ExampleConnector" if "ExampleConnector" in registry else "SharedStorageConnector"


def example_connector_cpu_problem() -> str | None:
    """Why the installed vLLM's toy connector cannot load on a CPU-only machine (its loads
    call ``.cuda()`` before vLLM 0.12), else None."""
    import inspect

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory._registry[example_connector()]()
    if ".cuda()" in inspect.getsource(cls.start_load_kv):
        return (
            f"vLLM {vllm.__version__}'s {cls.__name__}.start_load_kv calls .cuda(): "
            "it cannot load on a CPU-only machine"
        )
    return None


def example_connector_layout() -> str:
    """The cache layout the installed vLLM's toy connector reads in ``save_kv_layer``: a
    standardised per-layer ``[blocks, H, N, C]`` view in recent vLLM ("flashinfer" here: the
    blocks first), the raw ``[2, blocks, block_size, ...]`` FlashAttention tensor before."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory._registry[example_connector()]()
    source = inspect.getsource(cls.save_kv_layer)
    return "flashinfer" if "[B, H, N, C]" in source else "flash_attn"


@dataclasses.dataclass(frozen=True)
class WrappedSpec(RunSpec):
    """A workload (``RunSpec``'s fields; ``extra_config`` is the inner's own extra config)
    and the connector: ``inner`` (a vLLM registry name or ``module:Class``), recorded or not."""

    inner: str = "ExampleConnector"
    record: bool = True
    digests: str = "off"
    # The recorder's steady_decode (False: every step of every request a Scheduled record).
    steady_decode: bool = True
    # The oracle's cache layout: "flashinfer" ([blocks, 2, ...]) gives the per-layer
    # [B, H, N, C] view connectors such as ExampleConnector read and write.
    layout: str = "flashinfer"
    # The connector's kv_role ("kv_producer": a P/D prefill side, whose requests vLLM frees
    # as soon as a step is done with them, in flight or not).
    kv_role: str = "kv_both"


@attrs.frozen
class WrappedReport:
    requests: int
    steps: int
    preemptions: int
    resumptions: int
    mismatches: tuple[Mismatch, ...]
    finished: int
    log_path: str | None
    # Per step: (num_scheduled_tokens, finished ids): what vLLM did, to compare two runs.
    trace: tuple[tuple[tuple[tuple[str, int], ...], tuple[str, ...]], ...]
    load_errors: int
    seconds: float
    leaks: tuple[str, ...]
    scheduler_connector: Any = attrs.field(eq=False, repr=False)
    worker_connector: Any = attrs.field(eq=False, repr=False)


def kv_transfer_config(
    inner: str,
    inner_extra: Mapping[str, Any],
    *,
    record: bool,
    log_dir: str | None = None,
    digests: str = "off",
    kv_role: str = "kv_both",
    steady_decode: bool = True,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a run: the recorder wrapping ``inner``, or ``inner``."""
    base = {"kv_role": kv_role, "kv_load_failure_policy": "recompute"}
    if record:
        extra: dict[str, Any] = {
            "inner": inner,
            "inner_extra_config": dict(inner_extra),
            "digests": digests,
            "log_background": False,
            "steady_decode": steady_decode,
        }
        if log_dir is not None:
            extra["log_dir"] = log_dir
        return {
            **base,
            "kv_connector": "KVLedgerRecorder",
            "kv_connector_module_path": "connector.vllm",
            "kv_connector_extra_config": extra,
        }
    module, _, cls = inner.partition(":")
    if cls:
        return {
            **base,
            "kv_connector": cls,
            "kv_connector_module_path": module,
            "kv_connector_extra_config": dict(inner_extra),
        }
    return {**base, "kv_connector": inner, "kv_connector_extra_config": dict(inner_extra)}


def _output_fields() -> frozenset[str]:
    """The fields of this vLLM's KVConnectorOutput (worker metadata only from 0.18)."""
    from vllm.v1.outputs import KVConnectorOutput

    return frozenset(f.name for f in dataclasses.fields(KVConnectorOutput))


class _Driver:
    def __init__(self, spec: WrappedSpec, log_dir: str | None) -> None:
        kv = kv_transfer_config(
            spec.inner,
            spec.extra_config,
            record=spec.record,
            log_dir=log_dir,
            digests=spec.digests,
            kv_role=spec.kv_role,
            steady_decode=spec.steady_decode,
        )
        engine = {f.name: getattr(spec, f.name) for f in dataclasses.fields(HarnessConfig)}
        self.harness = SchedulerHarness(
            HarnessConfig(**{**engine, "kv_connector": kv}), on_scheduled=self._on_scheduled
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
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
        vllm_config = self.harness.vllm_config
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
        self.worker: Any = cls(vllm_config, KVConnectorRole.WORKER, self.harness.kv_cache_config)
        self.worker.register_kv_caches(self.oracle.caches)
        # What save_kv_layer gets: under "flashinfer" the per-layer [blocks, 2, block_size,
        # heads * head] views (recent vLLM's standardised [B, H, N, C]); else the raw tensors.
        self.views = (
            {
                name: cache.view(cache.shape[0], cache.shape[1], cache.shape[2], -1)
                for name, cache in self.oracle.caches.items()
            }
            if spec.layout == "flashinfer"
            else dict(self.oracle.caches)
        )
        self.forward_context = types.SimpleNamespace(
            attn_metadata={name: types.SimpleNamespace(layer=name) for name in self.views},
            no_compile_layers={
                name: types.SimpleNamespace(kv_cache=view) for name, view in self.views.items()
            },
            virtual_engine=0,
        )
        self.tokens: dict[str, list[int]] = {}
        self.load_errors = 0
        self.skip_verify: set[str] = set()

    def tokens_of(self, req_id: str, upto: int) -> list[int]:
        from connector.testing.harness import fake_token

        tokens = self.tokens.setdefault(req_id, list(self.harness.prompts[req_id]))
        cfg = self.harness.config
        while len(tokens) < upto:
            tokens.append(fake_token(req_id, len(tokens), cfg.seed, cfg.vocab_size))
        return tokens

    def _on_scheduled(self, out: Any) -> Any:
        worker = self.worker
        meta = out.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(self.forward_context)
        computed = {new.req_id: int(new.num_computed_tokens) for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = int(cached.num_computed_tokens[i])
        for req_id, n in out.num_scheduled_tokens.items():
            start = computed[req_id]
            blocks = self.harness.request_view(req_id).block_ids[0]
            tokens = self.tokens_of(req_id, start + n)
            self.oracle.write(req_id, tokens, blocks, start, start + n)
        for name, view in self.views.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, view, self.forward_context.attn_metadata[name])
        worker.wait_for_save()
        sending, recving = worker.get_finished(set(out.finished_req_ids))
        # vLLM >= 0.11.1 asks for load errors; a connector of an older vLLM has no such method.
        load_errors = getattr(worker, "get_block_ids_with_load_errors", None)
        errors = set((load_errors() if load_errors is not None else None) or ())
        self.load_errors += len(errors)
        self.skip_verify = {
            r
            for r in out.num_scheduled_tokens
            if errors & set(self.harness.request_view(r).block_ids[0])
        }
        stats = worker.get_kv_connector_stats()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        extra = {"kv_connector_worker_meta": worker_meta, "kv_connector_stats": stats}
        return make_kv_connector_output(
            sending or (),
            recving or (),
            errors,
            **{k: v for k, v in extra.items() if k in _output_fields()},
        )

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


def run_wrapped(spec: WrappedSpec, *, log_dir: str | None = None) -> WrappedReport:
    """Run the workload to completion (or ``spec.max_steps``); see the module docstring."""
    started = time.perf_counter()
    driver = _Driver(spec, log_dir)
    harness = driver.harness
    work = _workload(spec)
    repeats = [(f"again-{rid}", prompt, 4) for rid, prompt, _ in work[: spec.repeat_prompts]]
    for rid, prompt, max_tokens in work:
        harness.add_request(rid, prompt, max_tokens)
    mismatches: list[Mismatch] = []
    trace: list[tuple[tuple[tuple[str, int], ...], tuple[str, ...]]] = []
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
        trace.append((tuple(sorted(result.num_scheduled_tokens.items())), result.finished))
        if spec.verify:
            mismatches.extend(driver.verify())
    leaks: list[str] = []
    if harness.num_free_blocks != spec.num_gpu_blocks - 1:
        leaks.append(f"gpu blocks: {harness.num_free_blocks} free of {spec.num_gpu_blocks - 1}")
    if not harness.is_done():
        leaks.append(f"not done after {steps} steps: {harness.describe()}")
    connector = harness.connector
    connector.shutdown()
    report = WrappedReport(
        requests=len(work) + len(repeats if repeats else work[: spec.repeat_prompts]),
        steps=steps,
        preemptions=harness.stats.preemptions,
        resumptions=harness.stats.resumptions,
        mismatches=tuple(mismatches),
        finished=len(harness.finished),
        log_path=getattr(connector, "log_path", None),
        trace=tuple(trace),
        load_errors=driver.load_errors,
        seconds=time.perf_counter() - started,
        leaks=tuple(leaks),
        scheduler_connector=connector,
        worker_connector=driver.worker,
    )
    harness.close()
    return report
