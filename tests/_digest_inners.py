"""Inner connectors with a silent load fault, for the digests' tests of ``KVLedgerRecorder``
(loaded as ``module:Class``; this directory is on ``sys.path`` under pytest).

Each is vLLM's own ExampleConnector with one fault added by subclassing: it claims the same
tokens and reports nothing wrong, but ``SkippingExample`` never writes them and
``CorruptingExample`` writes them, then changes every value it wrote. Only the KV-content
digests (or the harness's oracle) can tell.
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
