"""What kvledger takes from vLLM, in one place: the base classes of the two connector classes
vLLM loads, and the differences between vLLM releases, probed once at import.

``KVLedgerConnector`` (connector/vllm.py) and ``KVLedgerRecorder`` (connector/recorder.py) get
vLLM through this module: it is the only product module that imports vLLM (a contract in
pyproject.toml). Everything else reads vLLM's objects by duck typing. What the two classes
share besides (the settings and their validation, the event log's opening and naming) is in
connector/config.py and connector/logfile.py.

The differences between the releases kvledger supports (0.11.0 to 0.33.0), the one list of
them: a comment elsewhere that depends on a release points here.

| vLLM | what differs | handled by |
|---|---|---|
| 0.11.0 | ``KVConnectorBase_V1.__init__`` takes no ``kv_cache_config`` | :data:`BASE_TAKES_KV_CACHE_CONFIG`, :func:`base_args`, :func:`build_connector` |
| 0.11.0 | ``KVConnectorOutput`` has no ``invalid_block_ids``: a worker cannot report a failed load | the tests skip load failures there (docs/using-with-vllm.md) |
| before 0.11.1 | no per-connector Prometheus metrics (``build_prom_metrics``) | :data:`PROM_METRICS` |
| before 0.12 | no ``preempted_req_ids``: a preemption shows at the re-admission | ``tracker/state.py`` infers it |
| before 0.12 | ``ExampleConnector`` is called ``SharedStorageConnector`` | the test rigs |
| before 0.14 | no ``handle_preemptions`` | ``connector/worker.py`` waits for saves at the next step |
| 0.14 to 0.18 | ``handle_preemptions`` gets the preempted ids, not the metadata | ``KVLedgerConnector.handle_preemptions`` |
| before 0.17 | no ``SupportsHMA`` (``request_finished_all_groups``) | :data:`SupportsHMA` is None |
| 0.11 to 0.17 | no worker metadata: the worker's results ride in the connector stats | :data:`WORKER_META_CHANNEL`; ``connector/scheduler.py``, ``connector/metrics.py`` |
| before 0.22 | no ``on_new_request``: a request is first seen at its lookup | ``connector/scheduler.py``, ``connector/recording.py`` |
| before 0.30 | no ``requires_kv_delivery``, no ``failed_recving`` | read with a default: the first by ``connector/recorder.py``, the second by ``connector/recording.py`` |
| any | ``BlockStored`` / ``BlockRemoved`` gain fields release by release (``medium``, ``lora_name``, ``group_idx``, ``locality``...) | :func:`kv_cache_events` passes each only where this vLLM's class has it |
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # the read-only view vLLM gives of a request's token ids
    from vllm.v1.utils import ConstantList
except ImportError:  # pragma: no cover - a vLLM without it: every view is read as it is
    ConstantList = None  # type: ignore[assignment,misc]
try:  # vLLM >= 0.18: the worker -> scheduler channel
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM (the table above)
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]
try:  # vLLM >= 0.17: HMA connectors get request_finished_all_groups
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM (the table above)
    SupportsHMA = None  # type: ignore[assignment,misc]
try:  # connector stats travel worker -> scheduler in every KVConnectorOutput
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - older vLLM (the table above)
    KVConnectorStats = object  # type: ignore[assignment,misc]
try:  # vLLM >= 0.11.1: per-connector Prometheus metrics (build_prom_metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    PROM_METRICS = True
except ImportError:  # pragma: no cover - older vLLM (the table above)
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]
    PROM_METRICS = False

__all__ = [
    "BASE_TAKES_KV_CACHE_CONFIG",
    "PROM_METRICS",
    "VLLM_VERSION",
    "WORKER_META_CHANNEL",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "base_args",
    "build_connector",
    "connector_registry",
    "cpu_attention_isa",
    "is_scheduler",
    "kv_cache_events",
    "kv_events_enabled",
    "on_cpu_platform",
    "token_list",
]

VLLM_VERSION: str = str(getattr(vllm, "__version__", "?"))

# Where the worker's reports travel: the worker metadata where vLLM has it, else the
# connector stats, which vLLM also hands to update_connector_output.
WORKER_META_CHANNEL: bool = hasattr(KVConnectorBase_V1, "build_connector_worker_meta")

BASE_TAKES_KV_CACHE_CONFIG: bool = (
    "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
)


def base_args(vllm_config: Any, role: Any, kv_cache_config: Any) -> tuple[Any, ...]:
    """The arguments this vLLM's ``KVConnectorBase_V1.__init__`` takes."""
    if BASE_TAKES_KV_CACHE_CONFIG:
        return vllm_config, role, kv_cache_config
    return vllm_config, role  # pragma: no cover - vLLM 0.11.0


def build_connector(cls: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> Any:
    """A connector of class ``cls``, built as this vLLM builds one."""
    return cls(*base_args(vllm_config, role, kv_cache_config))


def token_list(request: Any) -> list[int] | None:
    """The list a request's ``all_token_ids`` view reads, where it is vLLM's ``ConstantList``
    over a plain list: the list vLLM appends each sampled token to, for the life of the
    request object. Indexing it is a C call where the view's ``__getitem__`` is a Python one,
    a third of the recorder's hot path. None for any other view (a test's stand-in, a future
    vLLM): then the view is read as it is."""
    ids = getattr(request, "all_token_ids", None)
    if ConstantList is None or type(ids) is not ConstantList:
        return None
    raw = getattr(ids, "_x", None)
    return raw if type(raw) is list else None


def is_scheduler(role: Any) -> bool:
    return bool(role == KVConnectorRole.SCHEDULER)


def connector_registry() -> Mapping[str, Callable[[], type]]:
    """vLLM's connector registry: name -> a loader of the class."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return getattr(KVConnectorFactory, "_registry", {})


def on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (every attention layer then runs its CPU
    attention backend); False where no platform resolves (vLLM without a device)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:
        return False


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: Any) -> str | None:
    """The kernel vLLM's CPU attention backend picks (``vllm/v1/attention/backends/cpu_attn.py``,
    ``_get_attn_isa``: a private function, probed), or None on a vLLM without it."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception:
        return None


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config``'s
    ``enable_kv_cache_events``): only then is the pool described (connector/pool_events.py)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


def kv_cache_events(records: Any) -> list[Any]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` of the pool's plain records
    (``connector.pool_events.PoolEvent``), block hashes as this vLLM publishes its own
    (``maybe_convert_block_hash``: bytes, or 64-bit ints under
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Fields this vLLM's classes lack are left out."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    convert: Callable[[Any], Any] | None
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert
    except ImportError:  # pragma: no cover - a vLLM whose hashes are published as they are
        convert = None
    stored_fields = set(getattr(BlockStored, "__struct_fields__", ()))
    removed_fields = set(getattr(BlockRemoved, "__struct_fields__", ()))

    def published(h: Any) -> Any:
        return h if convert is None or h is None else convert(h)

    out: list[Any] = []
    for r in records:
        hashes = [published(h) for h in r.block_hashes]
        extra = {"medium": r.medium, "group_idx": 0}
        if r.medium != "CPU":
            extra["locality"] = "REMOTE"  # a shared tier, not this engine's memory
        if r.stored:
            fields = {
                "block_hashes": hashes,
                "parent_block_hash": published(r.parent),
                "token_ids": list(r.token_ids),
                "block_size": r.block_size,
                "lora_id": None,
                "lora_name": None,
                # The one KV-cache group the connector serves, as vLLM's own events name it.
                "kv_cache_spec_kind": "full_attention",
                **extra,
            }
            out.append(BlockStored(**{k: v for k, v in fields.items() if k in stored_fields}))
        else:
            fields = {"block_hashes": hashes, **extra}
            out.append(BlockRemoved(**{k: v for k, v in fields.items() if k in removed_fields}))
    return out
