"""``KVLedgerConnector``: the class vLLM loads. Thin: every method forwards to one side.

``KVLedgerRecorder`` (connector/recorder.py), the wrapper that records any other connector,
is loaded from this module the same way. Load ``KVLedgerConnector`` with::

    --kv-transfer-config '{"kv_connector": "KVLedgerConnector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"chunk_size": 256}}'

vLLM builds it twice, once per role, in different processes. The scheduler role owns a
``SchedulerSide`` (the tracker, the chunk index, the log); the worker role owns a
``WorkerSide`` (the host pool bytes, the transfer backend). A method called in the wrong
role fails loudly, naming the role. Only plain values cross between them: a ``StepPlan`` in the
connector metadata, a ``WorkerReport`` in the worker metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvledger.connector import edge, metrics
from kvledger.connector.config import ConnectorConfig
from kvledger.connector.edge import (
    PROM_METRICS,
    VLLM_VERSION,
    WORKER_META_CHANNEL,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    base_args,
    is_scheduler,
)
from kvledger.connector.messages import StepPlan, WorkerReport
from kvledger.connector.recorder import KVLedgerRecorder  # loaded by vLLM from this module too
from kvledger.connector.scheduler import SchedulerSide, carries_reports
from kvledger.connector.stopping import NO_HOOK, StopHook

if TYPE_CHECKING:  # imported at run time only in the worker role: torch only where bytes move
    from kvledger.connector.worker import WorkerSide

__all__ = ["KVLedgerConnector", "KVLedgerMetadata", "KVLedgerRecorder", "KVLedgerWorkerMetadata"]

# vLLM itself comes through connector/edge.py, which also lists what differs between releases.
# The `type: ignore[misc, unused-ignore]` on the classes below: where vLLM is not installed
# (mypy without the vllm extra) their bases are Any, and subclassing Any is an error.


class KVLedgerMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler -> worker, once per step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVLedgerWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """Worker -> scheduler, once per step. ``aggregate`` (vLLM merging the workers of a
    tensor/pipeline-parallel group) keeps each rank's report apart: the scheduler confirms a
    transfer only once every rank reported it."""

    def __init__(self, *reports: WorkerReport) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLedgerWorkerMetadata:
        """vLLM aggregates the metadata of one connector class: ``other`` is ours too."""
        if not isinstance(other, KVLedgerWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with KVLedgerWorkerMetadata")
        return KVLedgerWorkerMetadata(*self.reports, *other.reports)

    @property
    def report(self) -> WorkerReport:
        """This worker's report (the first, when several ranks were aggregated)."""
        return self.reports[0]


class KVLedgerStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """The connector stats, plain data (serialised between processes): the scheduler side's
    counters and pool reading under ``"kvledger"`` (what changed since its previous stats;
    connector/metrics.py), and on the releases without worker metadata (connector/edge.py)
    the worker's reports under
    ``"kvledger_reports"``. ``aggregate`` keeps each rank's reports apart and adds counters."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = data if data is not None else {"kvledger_reports": []}

    def reset(self) -> None:
        self.data = {"kvledger_reports": []}

    def aggregate(self, other: Any) -> KVLedgerStats:
        theirs = getattr(other, "data", None) or {}
        mine_reports = list(self.data.get("kvledger_reports", []))
        data: dict[str, Any] = {
            "kvledger_reports": mine_reports + list(theirs.get("kvledger_reports", []))
        }
        payload = metrics.merge(self.data.get(metrics.KEY) or {}, theirs.get(metrics.KEY) or {})
        if payload:
            data[metrics.KEY] = payload
        return KVLedgerStats(data)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        if self.data.get(metrics.KEY):
            out.update(metrics.reduce(self.data[metrics.KEY]))
        if self.data.get("kvledger_reports"):
            out["kvledger_reports"] = len(self.data["kvledger_reports"])
        return out

    def is_empty(self) -> bool:
        return not self.data.get("kvledger_reports") and not self.data.get(metrics.KEY)


class KVLedgerPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """``vllm:kvledger_*`` in vLLM's Prometheus registry, beside vLLM's own metrics: built by
    ``KVLedgerConnector.build_prom_metrics`` in the front end, fed each step's stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.exporter = metrics.PromExporter(
            self._counter_cls, self._gauge_cls, labelnames, per_engine_labelvalues
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.exporter.observe(transfer_stats_data, engine_idx)


def _max_async_lag(vllm_config: Any) -> int:
    """Scheduled tokens whose ids may not be in ``all_token_ids`` yet at build_connector_meta:
    the sampled token under async scheduling, plus the draft tokens of speculative decoding."""
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    async_scheduling = bool(getattr(scheduler_config, "async_scheduling", False))
    return max(1, int(async_scheduling) + drafts)


def _pool_format(vllm_config: Any, block_size: int, head_size: int) -> str:
    """The format this engine's host pool keeps chunks in (``connector.kv_layout.pool_format``),
    decided as vLLM decides the KV-cache layout, before any cache exists: on the CPU platform
    every attention layer runs vLLM's CPU attention backend (``CpuPlatform.get_attn_backend_cls``;
    MLA aside, whose caches the transfer refuses), with the kernel that vLLM's own
    ``_get_attn_isa`` (``vllm/v1/attention/backends/cpu_attn.py``) picks from the model's dtype,
    the block size and the head size; on every other platform the backends keep a block's
    tokens as rows (``tokens``). A wrong guess cannot go unnoticed: the worker refuses caches
    of another format when vLLM registers them (``WorkerSide.register_kv_caches``), reading
    the kernel from the layers vLLM set it on (``_attention_isa``)."""
    from kvledger.connector.kv_layout import TOKENS, cpu_attn_isa, pool_format

    if not edge.on_cpu_platform():
        return TOKENS
    dtype = vllm_config.model_config.dtype
    isa = edge.cpu_attention_isa(dtype, block_size, head_size, vllm_config.cache_config.cache_dtype)
    if isa is None:  # another vLLM: the same rule, as connector.kv_layout states it
        isa = cpu_attn_isa(dtype, block_size, head_size)
    return pool_format("cpu_attn", block_size, isa)


def _attention_isa(vllm_config: Any, layer_names: Any) -> str | None:
    """The kernel vLLM's CPU attention backend runs for these layers: its metadata builders
    set ``isa`` on every attention layer they serve (vLLM 0.32,
    ``CPUAttentionMetadataBuilder._set_isa_to_layers``), before the model runner registers the
    caches with the connector. None where no layer has one (another backend)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    context = getattr(compilation, "static_forward_context", None) or {}
    isas = {str(isa) for name in layer_names if (isa := getattr(context.get(name), "isa", None))}
    if len(isas) > 1:
        from kvledger.connector.kv_layout import KVCacheLayoutError

        raise KVCacheLayoutError(
            f"vLLM's CPU attention runs the kernels {sorted(isas)} on different layers; "
            "KVLedgerConnector keeps one element order per engine"
        )
    return isas.pop() if isas else None


def _slot_geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int, str, str]:
    """(bytes of one token's K and V over all layers, number of layers, a salt naming the
    model and the pool format, the pool format), from the KV cache config when vLLM gives it,
    else the model config. The salt names the pool format unless it is ``tokens``, the one
    format every earlier version wrote: their chunks keep their keys, and a chunk of one
    format is never found under a key of another, in the host pool or on the remote tier."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    model = str(getattr(model_config, "model", ""))
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(
            f"KVLedgerConnector supports one KV-cache group, got {len(groups)}; "
            "start vLLM with --disable-hybrid-kv-cache-manager"
        )
    if groups:
        spec = groups[0].kv_cache_spec
        num_layers = len(groups[0].layer_names)
        per_block = int(spec.page_size_bytes)
        token_bytes = per_block // int(spec.block_size) * num_layers
        desc = f"{spec.num_kv_heads}x{spec.head_size}:{spec.dtype}"
        block_size, head_size = int(spec.block_size), int(spec.head_size)
    else:
        num_layers = int(model_config.get_num_layers(parallel))
        heads = int(model_config.get_num_kv_heads(parallel))
        head = int(model_config.get_head_size())
        import torch

        dtype = model_config.dtype
        token_bytes = 2 * heads * head * torch.empty((), dtype=dtype).element_size() * num_layers
        desc = f"{heads}x{head}:{dtype}"
        block_size, head_size = int(vllm_config.cache_config.block_size), head
    rank = getattr(parallel, "rank", 0)
    salt = f"{model}|{num_layers}L|{desc}|tp{parallel.tensor_parallel_size}r{rank}"
    fmt = _pool_format(vllm_config, block_size, head_size)
    from kvledger.connector.kv_layout import TOKENS

    if fmt != TOKENS:
        salt += f"|pool={fmt}"
    return token_bytes, num_layers, salt, fmt


class KVLedgerConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """vLLM's entry point; see the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(*base_args(vllm_config, role, kv_cache_config))
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.kv_config = ConnectorConfig.from_extra_config(extra)
        block_size = int(vllm_config.cache_config.block_size)
        self.kv_config.check_block_size(block_size)
        parallel = vllm_config.parallel_config
        world_size = int(getattr(parallel, "world_size", 0) or 1)
        rank = int(getattr(parallel, "rank", 0) or 0)
        token_bytes, _, salt, pool_format = _slot_geometry(vllm_config, kv_cache_config)
        slot_bytes = token_bytes * self.kv_config.chunk_size
        num_slots = self.kv_config.host_pool_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"host_pool_bytes={self.kv_config.host_pool_bytes} holds no chunk: one chunk of "
                f"{self.kv_config.chunk_size} tokens takes {slot_bytes} bytes"
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Wraps every scheduler callback that writes to the log (connector/stopping.py).
        self._stop: StopHook | Any = NO_HOOK
        if is_scheduler(role):
            self._scheduler = SchedulerSide(
                self.kv_config,
                block_size=block_size,
                num_slots=num_slots,
                salt=salt,
                world_size=world_size,
                max_async_lag=_max_async_lag(vllm_config),
                log_header={
                    "vllm_version": VLLM_VERSION,
                    "slot_bytes": slot_bytes,
                },
                kv_events=edge.kv_events_enabled(vllm_config),
            )
            if self._scheduler.log_path is not None:
                # vLLM's engine core is often killed before it calls shutdown(): the log is
                # sealed when a stop signal arrives, and closed at interpreter exit.
                self._stop = StopHook(self._scheduler.seal, self._scheduler.shutdown)
                self._stop.install()
        else:
            self._worker = self.make_worker_side(self.kv_config, num_slots=num_slots, rank=rank)
            self._worker.pool_format = pool_format  # what the salt names: caches must match
            self._worker.salt = salt  # a remote value is bound to it (connector/values.py)

    def make_worker_side(self, config: ConnectorConfig, *, num_slots: int, rank: int) -> WorkerSide:
        """Build the worker role's ``WorkerSide`` (called once, from ``__init__``): a host pool
        of ``num_slots`` chunk slots for worker ``rank``. A subclass may return a subclass of
        ``WorkerSide``; the test rigs inject load faults this way."""
        from kvledger.connector.worker import WorkerSide  # torch only where bytes move

        return WorkerSide(config, num_slots=num_slots, rank=rank)

    # --- role guards ----------------------------------------------------------------------

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("KVLedgerConnector: scheduler method called on the worker role")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KVLedgerConnector: worker method called on the scheduler role")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a preempted hand-off is simply recomputed

    # --- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        with self._stop:
            self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self._stop:
            return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        with self._stop:
            self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVLedgerMetadata:
        # Every step: the role's guard (a property call) only when there is no scheduler side.
        side = self._scheduler or self.scheduler_side
        with self._stop:
            return KVLedgerMetadata(side.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        side = self._scheduler or self.scheduler_side  # the role's guard, as above
        if not carries_reports(connector_output):
            return  # most steps: no worker reported anything, and nothing is recorded
        with self._stop:
            side.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._stop:
            return self.scheduler_side.request_finished(request, block_ids)

    def take_events(self) -> Sequence[Any]:
        """The host pool's and the remote tier's KV events since the last call
        (connector/pool_events.py): nothing unless vLLM publishes KV cache events."""
        side = self._scheduler
        if side is None or side.pool_events is None:
            return ()  # vLLM asks every step: with its KV events off, nothing more than this
        return side.take_events(edge.kv_cache_events)

    def get_kv_connector_stats(self) -> KVLedgerStats | None:
        """On the scheduler, what its counters and the pool did since the previous call (vLLM
        asks after each ``update_from_output``; connector/metrics.py); on the worker of a vLLM
        without worker metadata, this step's report; else None."""
        if self._scheduler is not None:
            try:
                payload = self._scheduler.metrics()
            except Exception:  # the engine never fails for our bookkeeping
                return None
            return None if payload is None else KVLedgerStats({metrics.KEY: payload})
        if self._worker is None or WORKER_META_CHANNEL:
            return None
        report = self._worker.build_report()
        return KVLedgerStats({"kvledger_reports": [report.to_plain()]}) if report else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVLedgerStats | None:
        return KVLedgerStats(data) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVLedgerPromMetrics | None:
        """The ``vllm:kvledger_*`` metrics (vLLM calls this in its Prometheus stat logger;
        None on a vLLM without per-connector metrics: connector/edge.py)."""
        if not PROM_METRICS:  # pragma: no cover - older vLLM
            return None
        return KVLedgerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        isa = _attention_isa(self._vllm_config, kv_caches)
        self.worker_side.register_kv_caches(kv_caches, cpu_isa=isa)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        plan = getattr(kv_connector_metadata, "plan", None)
        if plan is None and kv_connector_metadata:  # the id set (connector/edge.py)
            plan = StepPlan(step=-1, preempted=tuple(kv_connector_metadata))
        self.worker_side.handle_preemptions(plan)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVLedgerMetadata):
            self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker_side.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVLedgerWorkerMetadata | None:
        report = self.worker_side.build_report()
        return KVLedgerWorkerMetadata(report) if report else None

    def shutdown(self) -> None:
        if isinstance(self._stop, StopHook):
            self._stop.close()  # closes the log, gives the signals back
        elif self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
