"""Inner connectors with a load fault, for the digests' tests of ``KVLedgerRecorder``
(loaded as ``module:Class``; this directory is on ``sys.path`` under pytest).

Each is vLLM's own ExampleConnector with one fault added by subclassing: it claims the same
tokens and reports nothing wrong, but ``SkippingExample`` never writes them and
``CorruptingExample`` writes them, then changes every value it wrote. Only the KV-content
digests (or the harness's oracle) can tell. ``FailingExample`` loads nothing either, but
reports it: vLLM recomputes.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class SkippingExample(ExampleConnector):
    """Loads nothing (a connector that forgets its load)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None


class CorruptingExample(ExampleConnector):
    """Loads, then adds 1 to every value it loaded (a connector that loads the wrong bytes)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        metadata = self._get_connector_metadata()
        for request in metadata.requests:
            if request.is_store:
                continue
            slots = torch.as_tensor(request.slot_mapping)
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if kv is None:
                    continue
                blocks, offsets = slots // self._block_size, slots % self._block_size
                kv[blocks, :, offsets] += 1


class FailingExample(ExampleConnector):
    """Loads nothing, and says so: every block it was to load is a load error
    (``get_block_ids_with_load_errors``), and vLLM recomputes them. ``load_error_blocks``
    tells the rig's fake forward, before it runs, which blocks are missing: the requests
    holding them compute over a prefix that is not there, and their KV is written poisoned
    (connector/testing/recorded.py)."""

    _failing: frozenset[int] = frozenset()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        self._failing = frozenset(
            int(b)
            for request in metadata.requests
            if not request.is_store
            for b in (torch.as_tensor(request.slot_mapping) // self._block_size).tolist()
        )

    def load_error_blocks(self) -> set[int]:
        return set(self._failing)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failing, self._failing = self.load_error_blocks(), frozenset()
        return failing
