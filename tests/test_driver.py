"""The rigs' model runner (connector/testing/driver.py) calls a connector in vLLM's own order: at
every step of a run under vLLM's real scheduler, the calls it makes on a connector are those
that vLLM's model-runner code (``KVConnectorModelRunnerMixin``, with the calls
``GPUModelRunner.execute_model`` makes around it) makes on a twin of that connector for the same
``SchedulerOutput``: with and without a synchronous load, with no forward pass, with a drafter
(``defer_finalize``), under sync and async scheduling."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvledger.connector.testing.harness import skip_reason

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]


def vllm_runner(twin: Any, out: Any, vllm_config: Any, layers: list[str], drafter: int) -> None:
    """One step as ``GPUModelRunner.execute_model`` (vllm/v1/worker/gpu_model_runner.py) drives
    the connector: ``handle_preemptions``; then, with no token to compute,
    ``kv_connector_no_forward``; else the forward inside the mixin's connector-output context,
    each attention layer as ``maybe_transfer_kv_layer`` wraps it (wait_for_layer_load, the
    layer, save_kv_layer), and with a drafter its layers, then ``finalize_kv_connector``."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import (
        KVConnectorModelRunnerMixin as Mixin,
    )

    def attention(names: list[str]) -> None:
        for name in names:
            twin.wait_for_layer_load(name)
            twin.save_kv_layer(name, None, None)

    kv_transfer_state._KV_CONNECTOR_AGENT = twin
    try:
        twin.handle_preemptions(out.kv_connector_metadata)
        if not out.total_num_scheduled_tokens:
            Mixin.kv_connector_no_forward(out, vllm_config)
            return
        target = len(layers) - drafter
        defer = {"defer_finalize": True} if drafter else {}
        with (
            set_forward_context({name: object() for name in layers}, vllm_config),
            Mixin.maybe_get_kv_connector_output(out, **defer),
        ):
            attention(layers[:target])
        if drafter:
            attention(layers[target:])
            Mixin.finalize_kv_connector()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drafter", [0, 1], ids=["no-drafter", "drafter"])
def test_the_runner_calls_a_connector_in_vllms_order(async_scheduling: bool, drafter: int) -> None:
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from kvledger.connector.testing.driver import ModelRunner, built_by_vllm
    from kvledger.connector.testing.harness import HarnessConfig, shared_prefix_prompts

    takes = inspect.signature(KVConnectorModelRunnerMixin.maybe_get_kv_connector_output)
    if drafter and "defer_finalize" not in takes.parameters:
        pytest.skip("this vLLM never defers the connector's finalize (no defer_finalize)")
    steps: list[tuple[Any, list[Any], list[Any]]] = []

    class Compared(ModelRunner):
        def execute_model(self, out: Any) -> Any:
            self.worker.calls.clear()
            twin.calls.clear()
            output = super().execute_model(out)
            vllm_runner(twin, out, self.harness.vllm_config, list(self.views), drafter)
            steps.append((out, list(self.worker.calls), list(twin.calls)))
            return output

    config = HarnessConfig(
        num_gpu_blocks=16,
        enable_prefix_caching=False,  # a prompt sent again is the connector's hit
        async_scheduling=async_scheduling,
        kv_connector={
            "kv_connector": "CallOrder",
            "kv_connector_module_path": "_call_order",
            "kv_role": "kv_both",
        },
    )
    runner = Compared(config, drafter_layers=drafter)
    twin = built_by_vllm(runner.harness)
    prompts = shared_prefix_prompts(3, 16, 30, seed=3)
    work = [(f"r{i}", p, 3) for i, p in enumerate(prompts)]
    # The prompts again once everything finished: synchronous loads of their whole blocks.
    runner.run(work, repeat_prompts=2, max_steps=200, verify=False)
    runner.harness.close()

    assert runner.harness.is_done() and len(runner.harness.finished) == 5
    for i, (_, ours, vllms) in enumerate(steps):
        assert ours == vllms, f"step {i}"
    # The runs had each kind of step: a synchronous load, a forward without one (this vLLM
    # starting its load after the forward, where it says so), no forward pass at all.
    kinds = {
        (out.total_num_scheduled_tokens > 0, bool(getattr(out, "has_sync_kv_loads", True)))
        for out, _, _ in steps
    }
    assert (True, True) in kinds
    assert any(not forward for forward, _ in kinds)
    if hasattr(steps[0][0], "has_sync_kv_loads"):
        assert (True, False) in kinds
    if drafter:  # the connector output is built before the draft layer is written
        _, ours, _ = next(s for s in steps if s[0].total_num_scheduled_tokens > 0)
        names = [c[0] for c in ours]
        assert names.index("get_finished") < names.index("wait_for_save")


def test_a_runner_that_computes_nothing_makes_the_same_calls() -> None:
    """``compute=False`` (the scheduler bench's runner) drives the connector exactly as the
    oracle's runner does, step by step, and writes no KV: the caches stay unwritten (NaN) and
    there is nothing to verify."""
    import torch

    from kvledger.connector.testing.driver import ModelRunner
    from kvledger.connector.testing.harness import HarnessConfig, shared_prefix_prompts

    config = HarnessConfig(
        num_gpu_blocks=16,
        enable_prefix_caching=False,
        kv_connector={
            "kv_connector": "CallOrder",
            "kv_connector_module_path": "_call_order",
            "kv_role": "kv_both",
        },
    )
    prompts = shared_prefix_prompts(3, 16, 30, seed=3)
    work = [(f"r{i}", p, 3) for i, p in enumerate(prompts)]
    calls: dict[bool, list[Any]] = {}
    for compute in (True, False):
        runner = ModelRunner(config, compute=compute)
        steps: list[Any] = []

        def after_step(_: Any, runner: ModelRunner = runner, steps: list[Any] = steps) -> None:
            steps.append(list(runner.worker.calls))
            runner.worker.calls.clear()
            if not runner.compute:
                assert runner.verify() == []

        runner.run(work, repeat_prompts=2, max_steps=200, verify=False, after_step=after_step)
        written = any(not bool(torch.isnan(c).all()) for c in runner.oracle.caches.values())
        runner.harness.close()
        assert written == compute
        calls[compute] = steps
    assert len(calls[True]) > 5 and calls[False] == calls[True]
