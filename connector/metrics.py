"""The connector's counters, for vLLM's own connector-metrics path (no vLLM import here).

vLLM (0.33) asks the scheduler's connector, after each ``update_from_output``, for
``get_kv_connector_stats()``; the stats object travels as ``to_dict()`` in
``SchedulerStats.kv_connector_stats`` to the front end, where

- the logging stat logger rebuilds it with the connector class's
  ``build_kv_connector_stats(data)``, ``aggregate``s the steps of an interval and logs
  ``reduce()`` ("KV Transfer metrics: lookups=..., ...");
- the Prometheus stat logger hands the dict to the ``KVConnectorPromMetrics`` that the
  connector class's ``build_prom_metrics`` built, whose ``observe`` updates Prometheus
  metrics registered beside vLLM's own: they appear in the server's ``/metrics``.

So the scheduler side counts (:class:`Counters`, bumped where each thing happens), and each
call to ``get_kv_connector_stats`` sends what changed since the previous one
(:meth:`Counters.since`): counters as increments, the pool as a reading. ``connector/vllm.py``
holds the two thin vLLM classes (``KVLedgerStats``, ``KVLedgerPromMetrics``) over what is here.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

__all__ = ["COUNTERS", "GAUGES", "KEY", "Counters", "PromExporter", "merge", "reduce"]

# Where the connector's numbers sit in the stats dict (beside "kvledger_reports", the worker's
# reports on the releases without worker metadata: connector/edge.py).
KEY = "kvledger"

# name -> help. Each is exported as the Prometheus counter ``vllm:kvledger_<name>`` (the
# exposition adds ``_total``), labelled like vLLM's own metrics (model_name, engine).
COUNTERS: dict[str, str] = {
    "lookups": "Lookups answered by the kvledger connector (get_num_new_matched_tokens calls; "
    "a waiting request asks again every step).",
    "hit_tokens": "Tokens the kvledger connector offered vLLM from its host pool, over all "
    "lookups.",
    "loads": "Loads from the kvledger host pool sent to the workers.",
    "load_tokens": "Tokens of the loads sent to the workers.",
    "loads_done": "Loads every worker rank confirmed.",
    "load_failures": "Loads that failed on a worker (vLLM recomputes those tokens).",
    "saves": "Saves to the kvledger host pool sent to the workers.",
    "save_tokens": "Tokens of the saves sent to the workers.",
    "chunks_saved": "Chunks every worker rank confirmed saved.",
    "save_failures": "Chunk saves that failed on a worker.",
    "violations": "Invariant violations the kvledger tracker recorded (kvledger check, "
    "docs/debugging.md).",
    "adapter_errors": "vLLM callbacks whose input the kvledger connector could not read.",
}
# name -> help: readings, exported as Prometheus gauges ``vllm:kvledger_<name>``.
GAUGES: dict[str, str] = {
    "pool_used_slots": "Host pool chunk slots in use (stored, being written or pinned).",
    "pool_slots": "Host pool chunk slots in all.",
}


_read_all = operator.attrgetter(*COUNTERS)


class Counters:
    """The scheduler side's running totals (plain ints; bumped on the engine-core thread),
    one attribute per name of :data:`COUNTERS`."""

    __slots__ = ("_last", *COUNTERS)

    def __init__(self) -> None:
        self.lookups = self.hit_tokens = 0
        self.loads = self.load_tokens = self.loads_done = self.load_failures = 0
        self.saves = self.save_tokens = self.chunks_saved = self.save_failures = 0
        self.violations = self.adapter_errors = 0
        # What since() last sent, as one tuple (the counters, then the readings' items): vLLM
        # asks every step, and in a steady decode step nothing moved, which one tuple
        # comparison tells (no dicts built).
        self._last: tuple[Any, ...] = ()

    def totals(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in COUNTERS}

    def since(self, readings: Mapping[str, int]) -> dict[str, int] | None:
        """What changed since the previous call: the counters' increments (those that grew)
        and the ``readings`` (gauges), all of them when any value moved; None when nothing
        changed (vLLM then sends nothing)."""
        counts = _read_all(self)
        seen = (counts, *readings.items())
        if seen == self._last:
            return None
        before = self._last[0] if self._last else (0,) * len(COUNTERS)
        self._last = seen
        out = {k: int(c - b) for k, c, b in zip(COUNTERS, counts, before, strict=True) if c != b}
        out.update({k: int(v) for k, v in readings.items()})
        return out


def merge(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Two payloads of one interval as one: counters add up; a gauge keeps the later reading
    (``theirs``)."""
    out: dict[str, Any] = dict(mine)
    for k, v in theirs.items():
        out[k] = out.get(k, 0) + v if k in COUNTERS else v
    return out


def reduce(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """An interval's payload for vLLM's log line: every counter, then the pool's use."""
    out: dict[str, int | float] = {k: int(payload.get(k, 0)) for k in COUNTERS}
    for k in GAUGES:
        if k in payload:
            out[k] = int(payload[k])
    return out


def _per_engine(metric: Any, per_engine_labelvalues: Mapping[int, list[object]]) -> dict[int, Any]:
    """The metric's child for each engine (what vLLM's ``create_metric_per_engine`` does)."""
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}


class PromExporter:
    """Registers ``vllm:kvledger_*`` with the metric classes vLLM hands
    ``build_prom_metrics`` (prometheus_client's, or Ray's wrappers) and records each payload
    into them."""

    def __init__(
        self,
        counter_cls: Any,
        gauge_cls: Any,
        labelnames: list[str],
        per_engine_labelvalues: Mapping[int, list[object]],
    ) -> None:
        self.counters = {
            name: _per_engine(
                counter_cls(name=f"vllm:kvledger_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self.gauges = {
            name: _per_engine(
                gauge_cls(
                    name=f"vllm:kvledger_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        payload = data.get(KEY)
        if not payload:
            return  # the worker's reports alone (no worker metadata): nothing to export
        for name, per_engine in self.counters.items():
            value = payload.get(name, 0)
            if value > 0:
                per_engine[engine_idx].inc(value)
        for name, per_engine in self.gauges.items():
            if name in payload:
                per_engine[engine_idx].set(payload[name])
