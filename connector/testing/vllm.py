"""The runner's worker role: ``KVLedgerConnector`` building a ``FaultyWorkerSide``.

vLLM builds the scheduler role itself, from ``kv_connector_module_path`` (``connector.vllm``);
the runner builds the worker role by hand, as this subclass, through the connector's public
factory ``KVLedgerConnector.make_worker_side``. It imports vLLM (as ``connector.vllm`` does), so
the runner imports it only when it runs.
"""

from __future__ import annotations

from typing import Any

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.testing.faults import FaultyWorkerSide, LoadFault
from kvledger.connector.vllm import KVLedgerConnector

__all__ = ["FaultyKVLedgerConnector"]


class FaultyKVLedgerConnector(KVLedgerConnector):
    """``KVLedgerConnector`` whose worker role names its KV-cache ``layout`` and fails the
    chunk loads ``load_fault`` picks (see ``FaultyWorkerSide``)."""

    def __init__(
        self,
        vllm_config: Any,
        role: Any,
        kv_cache_config: Any = None,
        *,
        layout: str | None = None,
        load_fault: LoadFault | None = None,
    ) -> None:
        # Set before the base __init__, which builds the worker side through make_worker_side.
        self.kv_layout = layout
        self.load_fault = load_fault
        super().__init__(vllm_config, role, kv_cache_config)

    def make_worker_side(
        self, config: ConnectorConfig, *, num_slots: int, rank: int
    ) -> FaultyWorkerSide:
        return FaultyWorkerSide(
            config,
            num_slots=num_slots,
            rank=rank,
            layout=self.kv_layout,
            load_fault=self.load_fault,
        )

    @property
    def worker_side(self) -> FaultyWorkerSide:
        side = super().worker_side
        assert isinstance(side, FaultyWorkerSide)  # built by make_worker_side
        return side
