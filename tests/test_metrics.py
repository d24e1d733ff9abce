"""The connector's counters through vLLM's own connector-metrics path: the scheduler's
``get_kv_connector_stats`` after each ``update_from_output``, ``SchedulerStats`` with the
payload, vLLM's ``PrometheusStatLogger`` (which builds ``KVLedgerPromMetrics`` through
``build_prom_metrics``) and its ``KVConnectorLogging`` (``build_kv_connector_stats``,
``aggregate``, ``reduce``). The numbers are checked against the log of the same run and the
worker's own counts."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from _metrics_truth import counted_from_log

from kvledger.connector import metrics
from kvledger.replay.source import open_log

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --- the pure part --------------------------------------------------------------------------


def test_counters_send_what_changed_since_the_last_stats() -> None:
    c = metrics.Counters()
    pool = {"pool_used_slots": 0, "pool_slots": 8}
    first = c.since(pool)
    assert first == {"pool_used_slots": 0, "pool_slots": 8}
    assert c.since(pool) is None  # nothing moved: vLLM sends nothing
    c.lookups += 3
    c.hit_tokens += 64
    assert c.since(pool) == {"lookups": 3, "hit_tokens": 64, **pool}
    c.lookups += 1
    assert c.since({**pool, "pool_used_slots": 2}) == {
        "lookups": 1,
        "pool_used_slots": 2,
        "pool_slots": 8,
    }
    assert c.since({**pool, "pool_used_slots": 1}) == {"pool_used_slots": 1, "pool_slots": 8}
    merged = metrics.merge(
        {"lookups": 1, "pool_used_slots": 2}, {"lookups": 2, "pool_used_slots": 1}
    )
    assert merged == {"lookups": 3, "pool_used_slots": 1}  # counters add, a gauge is the later
    assert metrics.reduce(merged)["lookups"] == 3 and metrics.reduce(merged)["loads"] == 0


# --- vLLM's real scheduler and stat loggers -------------------------------------------------


def _prom_samples(text: str, prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^({re.escape(prefix)}\w*)\{{[^}}]*engine=\"0\"[^}}]*\}} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_metrics_reach_vllms_prometheus_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    from kvledger.connector.testing.harness import skip_reason

    if (reason := skip_reason()) is not None:
        pytest.skip(f"vLLM's scheduler is not usable: {reason}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from kvledger.connector.testing.run import RunSpec, run
    from kvledger.connector.vllm import KVLedgerPromMetrics

    loggers: dict[str, Any] = {}
    payloads: list[dict[str, Any]] = []
    lines: list[str] = []
    update = Scheduler.update_from_output

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = update(self, *args, **kwargs)
        if not loggers:  # vLLM's front-end loggers, for this engine's config
            loggers["prom"] = PrometheusStatLogger(self.vllm_config, [0])
            loggers["log"] = KVConnectorLogging(self.vllm_config.kv_transfer_config)
        for out in outputs.values():
            stats = out.scheduler_stats
            if stats is None:
                continue
            loggers["prom"].record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
            if stats.kv_connector_stats:
                payloads.append(stats.kv_connector_stats)
                loggers["log"].observe(stats.kv_connector_stats)
        return outputs

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    spec = RunSpec(
        num_requests=4,
        num_gpu_blocks=12,
        prompt_len=(20, 50),
        max_tokens=(20, 40),
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    report = run(spec, log_dir=str(tmp_path / "log"))
    assert report.ok, report
    assert isinstance(loggers["prom"].kv_connector_prom.prom_metrics, KVLedgerPromMetrics)
    assert payloads and all(set(p) == {metrics.KEY} for p in payloads)

    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    ours = _prom_samples(text, "vllm:kvledger_")
    truth = counted_from_log(tmp_path / "log")
    for name in metrics.COUNTERS:
        assert ours[f"vllm:kvledger_{name}_total"] == truth[name], name
    # The worker's own counts agree, and the run did load, save and wait.
    assert truth["load_tokens"] == report.tokens_loaded > 0
    assert truth["save_tokens"] == report.tokens_saved > 0
    assert truth["chunks_saved"] == report.chunks_saved > 0
    assert truth["lookups"] > report.requests  # waiting requests ask again every step
    num_slots = int(open_log(tmp_path / "log").header["config"]["num_slots"])
    assert ours["vllm:kvledger_pool_slots"] == num_slots
    assert 0 < ours["vllm:kvledger_pool_used_slots"] <= num_slots
    # Beside vLLM's own metrics, in the same registry, with the same labels.
    vllm_own = _prom_samples(text, "vllm:num_requests_")
    assert "vllm:num_requests_running" in vllm_own and "vllm:num_requests_waiting" in vllm_own
    assert re.search(r'^vllm:kvledger_lookups_total\{engine="0",model_name="[^"]+"\}', text, re.M)

    # vLLM's log line: the interval's stats rebuilt, aggregated and reduced.
    loggers["log"].log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: lookups=")
    logged = dict(kv.split("=") for kv in lines[0].split(": ", 1)[1].split(", "))
    assert {k: int(logged[k]) for k in metrics.COUNTERS} == truth
