"""Fault-injected inner connectors for tests/test_recorder.py, loaded by ``KVLedgerRecorder``
as ``module:Class`` (this directory is on ``sys.path`` under pytest).

Each is a real connector (vLLM's ExampleConnector or our KVLedgerConnector) with one fault
added by subclassing, so the recorder's checks are tried on misbehaviour they did not write.
"""

from __future__ import annotations

from typing import Any, ClassVar

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
except ImportError:  # vLLM < 0.12 called it SharedStorageConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import (
        SharedStorageConnector as ExampleConnector,
    )

from kvledger.connector.vllm import KVLedgerConnector


class InnerBoom(RuntimeError):
    """Raised by ``RaisingExample``: a test checks that this very object reaches vLLM."""


class RaisingExample(ExampleConnector):
    """Raises ``InnerBoom`` from ``get_num_new_matched_tokens`` for a request whose id
    contains ``boom``, from ``on_new_request`` for one whose id contains ``early``, and from
    the scheduler's ``get_kv_connector_stats`` while ``stats_boom`` is set."""

    raised: ClassVar[list[InnerBoom]] = []
    stats_boom: ClassVar[bool] = False

    @staticmethod
    def _boom(text: str) -> InnerBoom:
        exc = InnerBoom(text)
        RaisingExample.raised.append(exc)
        return exc

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if "boom" in request.request_id:
            raise self._boom(f"inner refuses {request.request_id}")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        if "early" in request.request_id:
            raise self._boom(f"inner refuses {request.request_id}")
        super().on_new_request(request)

    def get_kv_connector_stats(self) -> Any:
        if RaisingExample.stats_boom:
            raise self._boom("inner has no stats")
        return super().get_kv_connector_stats()


class OverclaimingKVLedger(KVLedgerConnector):
    """KVLedgerConnector that claims one block more than its pool holds for a request that
    has any hit: it says it will load tokens it does not have (the worker loads only what
    the tracker planned, so those tokens' KV is garbage)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        room = len(request.all_token_ids) - 1 - num_computed_tokens - n
        if n and room >= 16:
            n += 16
        return n, load_async
