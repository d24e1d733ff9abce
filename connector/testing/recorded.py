"""Run any vLLM v1 connector, wrapped in ``KVLedgerRecorder`` or not, under vLLM's real
scheduler on CPU, with the KV-content oracle checking every computed token.

The scheduler role is loaded by vLLM itself from the ``kv_transfer_config`` (the recorder by
``kv_connector_module_path``, or the bare inner); the worker role is a second instance of the
same class, built by vLLM's factory and driven by the rigs' model runner
(``connector.testing.driver``: vLLM 0.33's call order, the per-layer ``wait_for_layer_load``
and ``save_kv_layer`` included, with the standardised ``[blocks, 2, block_size, heads * head]``
view of each layer under the "flashinfer" layout, what ExampleConnector expects). The forward
context carries a per-layer attention metadata and the layers' ``kv_cache`` views, enough for a
connector that reads them (ExampleConnector).

A request whose blocks a load reported bad this step is not verified (vLLM recomputes it).
Used by tests/test_recorder.py and the bug-shape zoo (zoo.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import attrs

from kvledger.connector.testing.driver import ModelRunner, engine_config
from kvledger.connector.testing.oracle import Mismatch, TokenMismatch
from kvledger.connector.testing.run import RunSpec, run_workload

__all__ = [
    "WrappedReport",
    "WrappedSpec",
    "example_connector",
    "example_connector_cpu_problem",
    "example_connector_layout",
    "kv_transfer_config",
    "run_wrapped",
    "runner",
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
    mismatches: tuple[Mismatch | TokenMismatch, ...]
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
            "kv_connector_module_path": "kvledger.connector.vllm",
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


def runner(spec: WrappedSpec, log_dir: str | None) -> ModelRunner:
    """The model runner of ``spec``: its connector loaded by vLLM, the worker role built by
    vLLM's factory from the same config."""
    kv = kv_transfer_config(
        spec.inner,
        spec.extra_config,
        record=spec.record,
        log_dir=log_dir,
        digests=spec.digests,
        kv_role=spec.kv_role,
        steady_decode=spec.steady_decode,
    )
    return _WrappedRunner(
        engine_config(spec, kv), layout=spec.layout, drafter_layers=spec.drafter_layers
    )


class _WrappedRunner(ModelRunner):
    """The rigs' model runner, told by an inner that knows, before the forward, which blocks
    its loads left missing (``load_error_blocks``, a test inner's: tests/_digest_inners.py):
    the requests holding them compute over a prefix that is not there, and their KV is
    written poisoned, as a real forward's would be wrong."""

    def failed_loads(self, out: Any) -> set[str]:
        told = getattr(self.worker, "load_error_blocks", None)  # the recorder's: the inner's
        return self.holders(out, told() if callable(told) else set())


def run_wrapped(spec: WrappedSpec, *, log_dir: str | None = None) -> WrappedReport:
    """Run the workload to completion (or ``spec.max_steps``); see the module docstring."""
    started = time.perf_counter()
    driver = runner(spec, log_dir)
    harness = driver.harness
    trace: list[tuple[tuple[tuple[str, int], ...], tuple[str, ...]]] = []

    def after_step(result: Any) -> None:
        trace.append((tuple(sorted(result.num_scheduled_tokens.items())), result.finished))

    steps = run_workload(driver, spec, after_step)
    leaks = driver.leaks()
    connector = harness.connector
    connector.shutdown()
    report = WrappedReport(
        requests=spec.requests,
        steps=steps,
        preemptions=harness.stats.preemptions,
        resumptions=harness.stats.resumptions,
        mismatches=tuple(m for _, m in driver.mismatches),
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
