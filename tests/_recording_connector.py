"""A KV connector that only records what vLLM's scheduler tells it, for harness tests.

vLLM loads it by name through ``kv_connector_module_path`` (the third-party loading path), so
it is a plain module next to the tests. Every scheduler-side callback appends a ``Call`` holding
copies of its arguments (vLLM's ``Request`` is mutable; nothing keeps a live view of it in the
record). Worker-side methods exist because they are abstract; no worker runs here.

kv_connector_extra_config:
    hit_tokens  external tokens to claim for every request (block-aligned, default 0)
    async_load  report those hits as async loads (WAITING_FOR_REMOTE_KVS path)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


def _use_v2_model_runner(vllm_config: Any) -> bool:
    """The mode as vLLM's scheduler reads it: the VllmConfig property (0.22 on), the
    environment variable (0.14 - 0.21), none at all (0.11, Model Runner V1 only)."""
    if hasattr(vllm_config, "use_v2_model_runner"):
        return bool(vllm_config.use_v2_model_runner)
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False))


def _len_or_none(tokens: Any) -> int | None:
    return None if tokens is None else len(tokens)


def _resumed(cached: Any) -> frozenset[str]:
    """The resumed request ids: a set from vLLM 0.11.1 on, a list of flags in 0.11.0."""
    ids = getattr(cached, "resumed_req_ids", None)
    if ids is not None:
        return frozenset(ids)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return frozenset(r for r, flag in zip(cached.req_ids, flags, strict=True) if flag)


@dataclass(frozen=True)
class Call:
    step: int  # index of the schedule() call in progress (= build_connector_meta calls so far)
    name: str
    args: dict[str, Any]


@dataclass
class RecordingMeta(KVConnectorMetadata):
    step: int
    loads: list[str] = field(default_factory=list)  # async loads to "complete" on the worker


class RecordingConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        if "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # vLLM 0.11.0 builds connectors with (vllm_config, role) only
            super().__init__(vllm_config, role)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.hit_tokens = int(extra.get("hit_tokens", 0))
        self.async_load = bool(extra.get("async_load", False))
        self.block_size = vllm_config.cache_config.block_size
        self.use_v2_model_runner = _use_v2_model_runner(vllm_config)
        self.calls: list[Call] = []
        self.step = 0
        # Live requests, only to read num_computed_tokens at build_connector_meta time.
        self._requests: dict[str, Any] = {}
        self._loads: list[str] = []

    def _record(self, name: str, **args: Any) -> None:
        self.calls.append(Call(self.step, name, args))

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # ---- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        self._record(
            "on_new_request",
            req_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids or ()),
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM < 0.22 has no on_new_request: the first lookup is the first sight of a request.
        self._requests.setdefault(request.request_id, request)
        # Claim at most hit_tokens, block-aligned, always leaving the last token to compute.
        avail = min(self.hit_tokens, request.num_tokens - 1)
        avail -= avail % self.block_size
        n = max(0, avail - num_computed_tokens)
        answer = (n, self.async_load and n > 0)
        self._record(
            "get_num_new_matched_tokens",
            req_id=request.request_id,
            num_computed_tokens=num_computed_tokens,
            status=request.status.name,
            num_tokens=request.num_tokens,
            num_preemptions=getattr(request, "num_preemptions", None),  # vLLM >= 0.14
            answer=answer,
        )
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._record(
            "update_state_after_alloc",
            req_id=request.request_id,
            block_ids=tuple(tuple(g) for g in blocks.get_block_ids()),
            num_external_tokens=num_external_tokens,
            status=request.status.name,
        )
        if num_external_tokens > 0 and self.async_load:
            self._loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        self._record(
            "build_connector_meta",
            new=[
                (r.req_id, r.num_computed_tokens, tuple(tuple(g) for g in r.block_ids))
                for r in scheduler_output.scheduled_new_reqs
            ],
            cached=[
                (rid, n, None if b is None else tuple(tuple(g) for g in b))
                for rid, n, b in zip(
                    cached.req_ids,
                    cached.num_computed_tokens,
                    cached.new_block_ids,
                    strict=True,
                )
            ],
            # MRV2 only: all tokens so far; None under MRV1.
            prefill_len={
                r.req_id: _len_or_none(getattr(r, "prefill_token_ids", None))
                for r in scheduler_output.scheduled_new_reqs
            },
            resumed=_resumed(cached),
            preempted=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            finished=frozenset(scheduler_output.finished_req_ids),
            num_scheduled_tokens=dict(scheduled),
            # What the live Request says while this callback runs.
            live_num_computed={rid: self._requests[rid].num_computed_tokens for rid in scheduled},
            live_num_tokens={rid: self._requests[rid].num_tokens for rid in scheduled},
        )
        meta = RecordingMeta(step=self.step, loads=self._loads)
        self._loads = []
        self.step += 1
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._record(
            "update_connector_output",
            finished_sending=frozenset(connector_output.finished_sending or ()),
            finished_recving=frozenset(connector_output.finished_recving or ()),
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self._record(
            "request_finished",
            req_id=request.request_id,
            status=request.status.name,
            block_ids=tuple(block_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=request.num_output_tokens,
        )
        self._requests.pop(request.request_id, None)
        return False, None

    def take_events(self) -> tuple[()]:
        return ()

    # ---- worker side (abstract in the base; never called here) ---------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
