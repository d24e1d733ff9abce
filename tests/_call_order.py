"""``CallOrder``: a vLLM v1 connector that does nothing but note, on its worker role, each call a
model runner makes (tests/test_driver.py; vLLM loads it as ``_call_order:CallOrder``, this
directory being on ``sys.path`` under pytest).

Its scheduler role offers a prompt sent before, once that request finished, as a synchronous
load of its whole blocks (but the last token), so that runs have steps with a synchronous load
and steps without one. Nothing is moved: only the order of the calls is of interest.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class CallOrder(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[Any, ...]] = []
        self._seen: set[tuple[int, ...]] = set()
        self._block_size = int(self._vllm_config.cache_config.block_size)

    # -- scheduler role ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if tuple(request.prompt_token_ids) not in self._seen:
            return 0, False
        whole = (len(request.prompt_token_ids) - 1) // self._block_size * self._block_size
        return max(whole - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self._seen.add(tuple(request.prompt_token_ids))
        return False, None

    # -- worker role: every call noted ------------------------------------------------------

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.calls.append(("handle_preemptions",))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append(("bind_connector_metadata",))
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Whether the load starts inside a forward pass (attention metadata) or without one.
        self.calls.append(("start_load_kv", forward_context.attn_metadata is not None))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        self.calls.append(("get_finished", tuple(sorted(finished_req_ids))))
        return None, None

    if hasattr(KVConnectorBase_V1, "get_transfer_results"):  # vLLM 0.33: it calls get_finished

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            self.calls.append(("get_transfer_results",))
            return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append(("get_block_ids_with_load_errors",))
        return set()

    def get_kv_connector_stats(self) -> None:
        self.calls.append(("get_kv_connector_stats",))

    def get_kv_connector_kv_cache_events(self) -> None:
        self.calls.append(("get_kv_connector_kv_cache_events",))

    def build_connector_worker_meta(self) -> None:
        self.calls.append(("build_connector_worker_meta",))

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata",))
        super().clear_connector_metadata()
