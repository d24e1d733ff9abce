"""The connector's counters in vLLM's own Prometheus metrics, on vLLM's real engine: the
``vllm:kvledger_*`` counters and pool gauges that ``build_prom_metrics`` registers appear in
``LLM.get_metrics()`` (the registry a server's ``/metrics`` serves) beside vLLM's, with the
values the run's log gives."""

from __future__ import annotations

from pathlib import Path

from _metrics_truth import counted_from_log

from kvledger.connector import metrics
from kvledger.connector.testing.engine import Engine, EngineSpec
from kvledger.replay.source import open_log

from .conftest import prompts


def test_kvledger_counters_in_vllms_metrics(tiny_model: str, tmp_path: Path) -> None:
    spec = EngineSpec(model=tiny_model, num_blocks=8, log_stats=True)
    batch = prompts(tiny_model, seed=71, lengths=[70, 90, 60], shared_prefix=32)
    with Engine(spec, log_dir=str(tmp_path)) as engine:
        first = engine.generate(batch, 16)
        second = engine.generate(batch, 16)  # the same prompts: loads from the pool
        snapshot = engine.llm.get_metrics()
        log_path = engine.log_path
    assert second.outputs == first.outputs
    assert log_path is not None
    ours = {
        m.name: m.value  # type: ignore[attr-defined]
        for m in snapshot
        if m.name.startswith("vllm:kvledger_")
    }
    names = {m.name for m in snapshot}
    assert {"vllm:num_requests_running", "vllm:prompt_tokens"} <= names  # vLLM's own, beside
    truth = counted_from_log(log_path)
    assert truth["load_tokens"] > 0 and truth["save_tokens"] > 0
    assert {name: int(ours[f"vllm:kvledger_{name}"]) for name in metrics.COUNTERS} == truth
    assert ours["vllm:kvledger_pool_slots"] == int(open_log(log_path).header["config"]["num_slots"])
    assert 0 < ours["vllm:kvledger_pool_used_slots"] <= ours["vllm:kvledger_pool_slots"]
