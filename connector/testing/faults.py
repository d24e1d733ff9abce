"""Fault injection for the rigs: a ``WorkerSide`` whose chosen chunk loads fail.

The production worker has no test hooks; ``FaultyWorkerSide`` overrides its public per-chunk
load (``WorkerSide.load_chunk``) and keeps what a rig's fake forward pass needs to know: which
requests' loads failed in this step (their forward pass runs over a wrong prefix). Tests build
it directly; the end-to-end runner gets it on the worker role through
``connector.testing.vllm.FaultyKVLedgerConnector``.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.messages import ChunkTransfer, TransferPlan, WorkerReport
from kvledger.connector.worker import WorkerSide
from kvledger.tracker.plans import blocks_covering

__all__ = ["FaultyWorkerSide", "LoadFault"]

# (req id, chunk) -> True to make this chunk's load fail, as a lost or corrupt remote chunk would;
# or a silent fault, reported as a successful load: "skip" (nothing is written, as a connector
# that forgets a load) or "corrupt" (the bytes are loaded, then changed, as a connector that
# loads the wrong bytes). Only KV-content digests (or the oracle) see a silent fault.
LoadFault = Callable[[str, ChunkTransfer], "bool | str"]


class FaultyWorkerSide(WorkerSide):
    """A ``WorkerSide`` that fails the chunk loads ``load_fault`` picks, and tells which
    requests' loads failed since the last report."""

    def __init__(
        self, config: ConnectorConfig, *, load_fault: LoadFault | None = None, **kwargs: Any
    ) -> None:
        super().__init__(config, **kwargs)
        self.load_fault = load_fault
        self._failed_loads: set[str] = set()
        self._caches: list[Any] = []

    def register_kv_caches(
        self, kv_caches: Mapping[str, Any], *, cpu_isa: str | None = None
    ) -> None:
        super().register_kv_caches(kv_caches, cpu_isa=cpu_isa)
        self._caches = list(kv_caches.values())

    def load_chunk(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        try:
            fault = self.load_fault(load.req_id, chunk) if self.load_fault is not None else False
            if fault == "skip":
                return
            if fault is True:
                raise OSError("injected load fault")
            super().load_chunk(load, chunk)
            if fault == "corrupt":
                self._corrupt(load, chunk)
        except Exception:
            self._failed_loads.add(load.req_id)
            raise

    def _corrupt(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        """Change every value of the blocks the chunk filled (all layers)."""
        assert self.backend is not None
        spec = self.backend.spec
        blocks = blocks_covering(
            load.block_ids, spec.block_size, chunk.token_start, chunk.token_end
        )
        ids = torch.tensor(blocks, dtype=torch.int64, device=spec.device)
        for cache in self._caches:
            view = cache.transpose(0, 1) if spec.layout == "flash_attn" else cache
            view[ids] = view[ids] + 1

    def failed_load_requests(self) -> set[str]:
        """Requests whose load failed in this step (their forward ran over a wrong prefix): the
        ``loads_failed`` of the report this step will send."""
        return set(self._failed_loads)

    def load_error_blocks(self) -> set[int]:
        """Blocks this step failed to load so far: a request whose block table holds one runs
        its forward over a wrong prefix too (a block vLLM shares through its prefix cache with
        the request whose load failed), and vLLM reschedules it."""
        return set(self._load_errors)

    @property
    def saves_in_flight(self) -> int:
        """Saves issued and not yet known to be complete (a finished run leaves none)."""
        return len(self._saves_in_flight)

    def build_report(self) -> WorkerReport:
        self._failed_loads.clear()
        return super().build_report()
