"""The bug-shape zoo: connector bugs reported in the field, rebuilt as faulty connectors under
vLLM's real scheduler, recorded by ``KVLedgerRecorder``, and judged by ``kvledger check`` of the
log alone (docs/bug-zoo.md has the table; tests/test_zoo.py and tests/engine/test_engine_zoo.py
run it).

Each faulty connector is the repo's ``KVLedgerConnector`` with one fault added by subclassing,
in the scheduler role (what it answers vLLM) or in the worker role (``make_worker_side``: how it
moves bytes). Each names the upstream report it reproduces. Its clean twin is the same workload
with the fault taken out: ``KVLedgerConnector`` itself, or the fixed variant named in the
``Shape``. The faults of LMCache's own adapter are reproduced with LMCache's real releases
instead (``lmcache_shapes``, run by ``connector.testing.lmcache``). A fault of vLLM's own
connectors runs vLLM's real connector (OffloadingConnector with the rig's copies,
``connector.testing.offloading``), the upstream fix taken out for the faulty run by a patch of
the one vLLM method (``VLLM_PATCHES``, ``Shape.vllm_patch``); its twin runs vLLM unpatched.

A shape is a scripted workload (``ZooRequest``: which request arrives when, with which prompt)
on a small pool, chosen so that the fault's moment happens: a preemption in the step after a
store was issued, a request id that comes back, a prompt sent twice. ``run_shape`` runs it with
the faulty connector or its twin: the scheduler role is loaded by vLLM (the recorder, by module
path, wrapping the inner ``module:Class``), the worker role is driven by the rigs' model runner
over the KV-content oracle's caches (``connector.testing.driver``, built by
``connector.testing.recorded``), and the oracle checks every computed token
after every step. A vLLM assertion the fault trips (vLLM's engine core would die there) ends
the run; the log is closed and still judged.

Nothing here is imported by what vLLM loads in production.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.kv_layout import slot_mapping_for
from kvledger.connector.messages import ChunkTransfer, StepPlan, TransferPlan
from kvledger.connector.scheduler import first_group
from kvledger.connector.testing.faults import FaultyWorkerSide
from kvledger.connector.testing.harness import named_prompts
from kvledger.connector.testing.offloading import offloading_extra_config
from kvledger.connector.testing.oracle import Mismatch, TokenMismatch
from kvledger.connector.vllm import KVLedgerConnector
from kvledger.connector.worker import WorkerSide

__all__ = [
    "SHAPES",
    "VLLM_PATCHES",
    "AsyncStoreWorker",
    "CompletionRepeated",
    "EngineLoadFault",
    "FailedLoadMarkedDone",
    "FinalStoreBeforeForget",
    "FullPromptMatch",
    "HandoffAfterPreemption",
    "HandoffDelivered",
    "HitCappedAtCapacity",
    "KVSwappedOnLoad",
    "LoadFaultWorker",
    "LoadIntoLastBlocks",
    "LoserStillLoads",
    "ManagerForgetsBeforeFinalStore",
    "RepeatedCompletionWorker",
    "SampledTokenStored",
    "Shape",
    "ShortenedHit",
    "StaleCompletionAfterReuse",
    "StoreFlushedAtPreemption",
    "StoreReadsFreedBlocks",
    "ZooReport",
    "ZooRequest",
    "lmcache_shapes",
    "offloading_allocations_untracked",
    "offloading_chunks_unallocated",
    "run_shape",
    "set_engine_fault",
]

# --------------------------------------------------------------------------------------------
# Worker-side faults: how the bytes move
# --------------------------------------------------------------------------------------------


class LoadFaultWorker(FaultyWorkerSide):
    """``WorkerSide`` whose loads go wrong in one of these ways, each reported as a success
    (nothing reaches the scheduler: only the bytes are wrong):

    - ``"skip"``: nothing is written (Dynamo #15079);
    - ``"swap_kv"``: K is written where V belongs and V where K belongs (LMCache #4463);
    - ``"short"``: only the first chunk of each load is written, the rest silently dropped
      (SGLang #40193).
    ``fault`` is read at each load (None: loads are right), so an engine runs with and without.
    """

    def __init__(self, config: ConnectorConfig, *, fault: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.fault = fault  # a kind above, or a callable returning one (None: no fault)

    def _kind(self) -> str | None:
        kind: str | None = self.fault() if callable(self.fault) else self.fault
        return kind

    def load_chunk(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        kind = self._kind()
        if kind == "skip":
            return
        if kind == "short" and chunk is not load.chunks[0]:
            return
        super().load_chunk(load, chunk)
        if kind == "swap_kv":
            self._swap_kv(load, chunk)

    def _swap_kv(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        """Exchange K and V of the tokens the chunk just filled, in every layer."""
        assert self.backend is not None
        spec = self.backend.spec
        slots = torch.tensor(
            slot_mapping_for(load.block_ids, spec.block_size, chunk.token_start, chunk.token_end),
            dtype=torch.int64,
            device=spec.device,
        )
        blocks, offsets = slots // spec.block_size, slots % spec.block_size
        for cache in self._caches:
            # [blocks, 2, block_size, ...] whatever the layout ("flash_attn" is K/V first)
            view = cache.transpose(0, 1) if spec.layout == "flash_attn" else cache
            k = view[blocks, 0, offsets].clone()
            view[blocks, 0, offsets] = view[blocks, 1, offsets]
            view[blocks, 1, offsets] = k


class AsyncStoreWorker(FaultyWorkerSide):
    """``WorkerSide`` whose saves are asynchronous store jobs, as a store's sending thread runs
    them (MooncakeStoreConnector's ``KVCacheStoreSendingThread``): a job issued in one step
    copies its blocks ``latency`` steps later, after that step's forward pass. The request's
    blocks stay held for a finished request until its jobs ran (``request_finished`` delays
    the free; ``finished_sending`` follows). A preemption frees a running request's blocks at
    once, so before the forward pass can reuse them every job of a preempted request is run
    (``handle_preemptions``: the fix of vLLM PR #52470); ``flush_on_preemption=False`` is the
    bug (vLLM #52360)."""

    latency: ClassVar[int] = 1

    def __init__(
        self, config: ConnectorConfig, *, flush_on_preemption: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(config, **kwargs)
        self.flush_on_preemption = flush_on_preemption
        self._queued: list[tuple[int, TransferPlan]] = []  # (due at step count, save)
        self._steps = 0
        self.jobs_run: list[str] = []  # req ids of the jobs run since the last get_finished

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        if self.flush_on_preemption and plan is not None and plan.preempted:
            preempted = set(plan.preempted)
            self._run_now([s for _, s in self._queued if s.req_id in preempted])
            self._queued = [(d, s) for d, s in self._queued if s.req_id not in preempted]
        super().handle_preemptions(plan)

    def wait_for_save(self) -> None:
        # This step's saves become jobs; the jobs due now run, after this step's forward pass.
        new, self._to_save = self._to_save, ()
        self._steps += 1
        due = [s for d, s in self._queued if d <= self._steps]
        self._queued = [(d, s) for d, s in self._queued if d > self._steps]
        self._queued += [(self._steps + self.latency, s) for s in new]
        self._to_save = tuple(due)
        self.jobs_run += [s.req_id for s in due]
        super().wait_for_save()  # issues the due jobs (and takes the step's digests)

    def _run_now(self, saves: Sequence[TransferPlan]) -> None:
        if not saves:
            return
        keep, self._to_save = self._to_save, tuple(saves)
        self.jobs_run += [s.req_id for s in saves]
        WorkerSide.wait_for_save(self)
        self._to_save = keep

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        # A queued job still reads its request's blocks: count it as a save not yet issued.
        keep = self._to_save
        self._to_save = keep + tuple(s for _, s in self._queued)
        try:
            sending, recving = super().get_finished(finished_req_ids)
        finally:
            self._to_save = keep
        self.jobs_run = []
        return sending, recving

    def shutdown(self) -> None:
        self._run_now([s for _, s in self._queued])
        self._queued = []
        super().shutdown()


class AbaCompletionWorker(AsyncStoreWorker):
    """``AsyncStoreWorker`` that keeps what it owes vLLM by request id alone (vLLM #51637,
    "Request-ID ABA"): an id it owed a ``finished_sending`` stays owed, so when the id comes
    back as a new request, the first store job of the new request that runs makes the worker
    report ``finished_sending`` for it again: a completion of the earlier life, delivered to
    the new one, which is still running."""

    def __init__(self, config: ConnectorConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._owed_by_id: set[str] = set()

    def bind(self, plan: StepPlan) -> None:
        super().bind(plan)
        self._owed_by_id.update(plan.delayed_free)

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        ran = set(self.jobs_run)
        busy = {s.req_id for _, s in self._queued}
        sending, recving = super().get_finished(finished_req_ids)
        stale = (ran & self._owed_by_id) - busy - (sending or set())
        return (set(sending or ()) | stale) or None, recving


class RepeatedCompletionWorker(AsyncStoreWorker):
    """``AsyncStoreWorker`` that reports each ``finished_sending`` twice: once when the request's
    jobs ran, and again at the next report, when vLLM has freed the request (the completions of
    vLLM #46240, #43226 and #51786: a second notification for one transfer, from a connector
    that aggregates its sub-connectors' completions, or one whose abort path and send path both
    report). vLLM 0.33's scheduler asserts ``req_id in self.requests`` on the second one."""

    def __init__(self, config: ConnectorConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._reported: set[str] = set()

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        again, self._reported = self._reported, set(sending or ())
        return (set(sending or ()) | again) or None, recving


# --------------------------------------------------------------------------------------------
# The connectors vLLM loads (as the recorder's inner, ``kvledger.connector.testing.zoo:Class``)
# --------------------------------------------------------------------------------------------


class _ZooKVLedger(KVLedgerConnector):
    """``KVLedgerConnector`` whose worker role carries a fault, chosen by class attributes (a
    shape is a class: vLLM builds a connector from its class alone, with no arguments)."""

    load_fault: ClassVar[str | None] = None
    async_store: ClassVar[bool] = False
    flush_on_preemption: ClassVar[bool] = True
    aba: ClassVar[bool] = False
    repeat_completions: ClassVar[bool] = False

    def make_worker_side(self, config: ConnectorConfig, *, num_slots: int, rank: int) -> WorkerSide:
        if self.aba:
            return AbaCompletionWorker(config, num_slots=num_slots, rank=rank)
        if self.repeat_completions:
            return RepeatedCompletionWorker(config, num_slots=num_slots, rank=rank)
        if self.async_store:
            return AsyncStoreWorker(
                config,
                num_slots=num_slots,
                rank=rank,
                flush_on_preemption=self.flush_on_preemption,
            )
        return LoadFaultWorker(config, num_slots=num_slots, rank=rank, fault=self._fault())

    def _fault(self) -> Any:
        return self.load_fault


class LoadIntoLastBlocks(_ZooKVLedger):
    """Dynamo #8419 (https://github.com/ai-dynamo/dynamo/issues/8419): onboarding from the host
    tier writes the loaded chunks into the last N blocks of the request's block table instead of
    the prefix blocks they belong to; the load reports success. The outputs diverge only after an
    eviction and an onboarding. Here the scheduler role hands its worker the tail of the table."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        tables = {
            new.req_id: tuple(first_group(new.block_ids))
            for new in scheduler_output.scheduled_new_reqs
        }
        bs = self.scheduler_side.tracker_config.block_size
        loads = tuple(
            _to_last_blocks(load, tables.get(load.req_id), bs) for load in meta.plan.loads
        )
        meta.plan = meta.plan._replace(loads=loads)
        return meta


def _to_last_blocks(load: TransferPlan, table: Sequence[int] | None, bs: int) -> TransferPlan:
    """The load as Dynamo #8419 executed it: the blocks its chunks cover replaced by as many
    blocks from the end of the request's whole table."""
    if not load.chunks or not table:
        return load
    first = load.chunks[0].token_start // bs
    last = (load.chunks[-1].token_end - 1) // bs + 1
    blocks = list(load.block_ids) + list(table[len(load.block_ids) :])
    blocks[first:last] = table[len(table) - (last - first) :]
    return attrs.evolve(load, block_ids=tuple(blocks))


class FailedLoadMarkedDone(_ZooKVLedger):
    """Dynamo #15079 (https://github.com/ai-dynamo/dynamo/issues/15079): a disk-to-GPU transfer
    that failed is marked complete; nothing is written, no load error is reported
    (``get_block_ids_with_load_errors`` stays empty), and vLLM computes over whatever the blocks
    held."""

    load_fault = "skip"


class KVSwappedOnLoad(_ZooKVLedger):
    """LMCache #4463 (https://github.com/LMCache/LMCache/issues/4463, fixed by PR #4467): vLLM
    0.26's packed K/V layout read with the old layout; with 2 KV heads both layouts have the
    same shape, so the load "works" and K and V land exchanged."""

    load_fault = "swap_kv"


class ShortenedHit(_ZooKVLedger):
    """SGLang #40193 (https://github.com/sgl-project/sglang/issues/40193): the lower tier
    reports every page present, but the hit is silently shortened to the host's capacity (here:
    one chunk per load); the rest of what was offered and accepted is never written and no
    error is reported."""

    load_fault = "short"


class StoreReadsFreedBlocks(_ZooKVLedger):
    """vLLM #52360 (https://github.com/vllm-project/vllm/issues/52360, fixed by PR #52372): an
    asynchronous store job still reads a request's GPU blocks after a preemption freed them and
    another request's forward pass wrote them: the other request's KV is stored under the
    preempted request's keys, and every later hit of those keys loads it."""

    async_store = True
    flush_on_preemption = False


class StoreFlushedAtPreemption(_ZooKVLedger):
    """The clean twin of ``StoreReadsFreedBlocks`` and ``StaleCompletionAfterReuse``: the same
    asynchronous store jobs, every job of a preempted request run before the forward pass can
    reuse its blocks (vLLM PR #52470), ``finished_sending`` owed per request life."""

    async_store = True


class StaleCompletionAfterReuse(_ZooKVLedger):
    """vLLM #51637 (https://github.com/vllm-project/vllm/issues/51637, fixed by PR #51662):
    store-job accounting keyed by the reusable request id. Here the worker keeps the
    ``finished_sending`` it owed an id after reporting it; when the id comes back as a new
    request, that request's first store job "completes" the earlier life: ``finished_sending``
    for a request that is running (vLLM 0.33's scheduler asserts on it)."""

    aba = True


class CompletionRepeated(_ZooKVLedger):
    """vLLM #46240 (https://github.com/vllm-project/vllm/issues/46240), with #43226 and #51786:
    a transfer's completion reported a second time, after the first one let vLLM free the
    request (``RepeatedCompletionWorker``). vLLM's scheduler asserts the id is still a request
    of its own, and the engine core dies."""

    repeat_completions = True


class SampledTokenStored(_ZooKVLedger):
    """vLLM #54193 (https://github.com/vllm-project/vllm/issues/54193, fixed by PR #54288): a
    finished request's store watermark is ``num_tokens``, which counts the last sampled token,
    whose KV slot no forward pass ever wrote. When the generation ends on a chunk boundary,
    that chunk is stored as complete under the hash of tokens that are all legitimate, and a
    later request replaying them (the next turn of the chat) loads the unwritten slot. Here the
    scheduler role, at ``request_finished``, counts that token as computed; the save it plans
    then runs in the next step, the request's blocks kept until it completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._final_saves: list[TransferPlan] = []

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self.scheduler_side
        tokens = list(request.all_token_ids)
        computed = int(request.num_computed_tokens)
        if len(tokens) == computed + 1 and len(tokens) % self.kv_config.chunk_size == 0:
            decisions = side.tracker.scheduled(
                str(request.request_id),
                num_computed=computed,
                num_scheduled=1,
                all_token_ids=tokens,
            )
            plan = side._plan(side.tracker.step, decisions, ())
            self._final_saves += plan.saves
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._final_saves:
            saves, self._final_saves = tuple(self._final_saves), []
            meta.plan = meta.plan._replace(saves=saves + meta.plan.saves)
        return meta


class HitCappedAtCapacity(_ZooKVLedger):
    """SGLang #40193 (https://github.com/sgl-project/sglang/issues/40193), at the offer: the
    store holds every chunk of the prefix, but the hit is silently cut to what the host tier
    has room to stage (here one chunk). Nothing is wrong with the bytes, and no rule of the
    connector API is broken: vLLM recomputes what it was not offered. Only the connector's own
    KV events, which say it held more, show the hit it owed."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # The lookup sees the prefix only as far as one chunk past vLLM's own hit (and the
        # token after it): its answer, which the scheduler role's tracker keeps, is capped.
        capped = _Capped(request, num_computed_tokens + self.kv_config.chunk_size + 1)
        try:
            return super().get_num_new_matched_tokens(capped, num_computed_tokens)
        finally:
            capped.limit = None  # whoever kept it reads the request whole from now on


class _Capped:
    """A vLLM request whose ``all_token_ids`` end at ``limit`` (None: the whole list)."""

    def __init__(self, request: Any, limit: int) -> None:
        self._request = request
        self.limit: int | None = limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    @property
    def all_token_ids(self) -> Any:
        tokens = self._request.all_token_ids
        return tokens if self.limit is None else tokens[: self.limit]


class ManagerForgetsBeforeFinalStore(_ZooKVLedger):
    """vLLM #49635 (https://github.com/vllm-project/vllm/issues/49635, fixed by PR #49671): the
    offloading connector's ``request_finished`` tells its manager the request finished before
    the scheduler prepared the request's deferred final store; the manager deletes the
    request's state, and the next step's ``prepare_store`` for it raises ``KeyError``. Here
    the manager is a set of the request ids it tracks, and a finished request's final store is
    prepared at the next ``build_connector_meta``."""

    notify_first: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._managed: set[str] = set()  # the manager's requests
        self._final: list[str] = []  # finished requests whose final store is deferred

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._managed.add(str(request.request_id))
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        answer = super().request_finished(request, block_ids)
        req_id = str(request.request_id)
        if self.notify_first:
            self._managed.discard(req_id)  # manager.on_request_finished, too early
        self._final.append(req_id)
        return answer

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        final, self._final = self._final, []
        for req_id in final:
            self._prepare_store(req_id)
            self._managed.discard(req_id)  # the fix: the manager hears of it after the store
        return super().build_connector_meta(scheduler_output)

    def _prepare_store(self, req_id: str) -> None:
        if req_id not in self._managed:
            raise KeyError(req_id)  # TieringOffloadingManager.prepare_store's request state


class FinalStoreBeforeForget(ManagerForgetsBeforeFinalStore):
    """The clean twin of ``ManagerForgetsBeforeFinalStore`` (PR #49671): every final store is
    prepared before the manager hears that the request finished."""

    notify_first = False


class LoserStillLoads(_ZooKVLedger):
    """LMCache #4762 (https://github.com/LMCache/LMCache/pull/4762), with vLLM #51786: under
    vLLM's MultiConnector the first sub-connector with a hit is chosen, and the others are
    told ``update_state_after_alloc(request, blocks, 0)``. LMCache's MP connector ignores the
    0: its own lookup hit, so it retrieves anyway, and reports the request in
    ``finished_recving``, a second completion for a request the chosen connector already
    loaded (vLLM's scheduler asserts on it). Here the scheduler role notes each request it
    offered tokens and was accepted none, and its worker reports each in ``finished_recving``
    at its next report."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offered: dict[str, int] = {}
        self._rogue: list[str] = []  # scheduler: lost, loading anyway
        self._recving: set[str] = set()  # worker: to report

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._offered[str(request.request_id)] = n or 0
        return n, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        req_id = str(request.request_id)
        if num_external_tokens == 0 and self._offered.pop(req_id, 0) > 0:
            self._rogue.append(req_id)  # needs_retrieve(): its own lookup hit

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # The worker learns them with the step's metadata (an attribute of this class's).
        setattr(meta, "rogue", tuple(self._rogue))  # noqa: B010
        self._rogue = []
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._recving.update(getattr(connector_metadata, "rogue", ()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        rogue, self._recving = self._recving, set()
        return sending, (set(recving or ()) | rogue) or None


class FullPromptMatch(_ZooKVLedger):
    """vLLM #55113 (https://github.com/vllm-project/vllm/issues/55113): a store lookup that
    matches the whole prompt offers every token of it, leaving none for vLLM to compute; with a
    synchronous load, vLLM's scheduler asserts ``num_new_tokens > 0``."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        total = len(request.all_token_ids)
        chunk = self.kv_config.chunk_size
        # kvledger leaves the last token to compute: an answer one short of the whole prompt,
        # on a prompt of whole chunks, means the pool holds every chunk of it.
        if n and num_computed_tokens + n == total - 1 and total % chunk == 0:
            n += 1
        return n, load_async


class HandoffAfterPreemption(_ZooKVLedger):
    """vLLM #50297 (https://github.com/vllm-project/vllm/pull/50297): a connector that hands a
    finished request's KV off (P/D prefill side: ``kv_transfer_params`` naming the blocks the
    decode side reads) but tells vLLM it does not need the KV delivered. Under async scheduling
    a prefill preempted in its last step still completes, and ``request_finished`` gets an
    empty block list: the hand-off names no block."""

    kv_delivery: ClassVar[bool] = False

    @property
    def requires_kv_delivery(self) -> bool:
        return self.kv_delivery

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, _ = super().request_finished(request, block_ids)
        params = {
            "do_remote_decode": True,
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_num_tokens": int(request.num_computed_tokens),
        }
        return delay, params


class HandoffDelivered(HandoffAfterPreemption):
    """The clean twin of ``HandoffAfterPreemption``: ``requires_kv_delivery`` is True (vLLM's
    fix: a request preempted with its hand-off pending drops its stale output and is
    recomputed)."""

    kv_delivery = True


# The engine suite (tests/engine) runs every byte fault through one connector class: vLLM
# builds it from the class alone, so the fault is read from here at each load.
_ENGINE_FAULT: list[str | None] = [None]


def set_engine_fault(kind: str | None) -> None:
    """The load fault ``EngineLoadFault`` applies from now on (a ``LoadFaultWorker`` kind, or
    None: loads are right)."""
    _ENGINE_FAULT[0] = kind


class EngineLoadFault(_ZooKVLedger):
    """For vLLM's real engine (tests/engine/test_engine_zoo.py): the load faults above, the
    current one chosen by ``set_engine_fault``."""

    def _fault(self) -> Any:
        return lambda: _ENGINE_FAULT[0]


# --------------------------------------------------------------------------------------------
# Faults of vLLM's own connectors: an upstream fix taken out again, for the faulty run only
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def offloading_allocations_untracked() -> Iterator[None]:
    """vLLM #46951 (https://github.com/vllm-project/vllm/issues/46951), the fix proposed in
    PR #47046 (https://github.com/vllm-project/vllm/pull/47046; also #46960): before it,
    ``OffloadingConnectorScheduler.update_state_after_alloc`` returned before it recorded the
    blocks vLLM had just allocated when it was to load none of them (``num_external_tokens == 0``). Under MultiConnector the
    blocks of a request another connector loads asynchronously (a request not scheduled in
    that step, so absent from the SchedulerOutput) were then never checked against the blocks
    the connector's pending store jobs still read: no job was flushed, and a store read what
    the other connector's load had written there ("possibly offloading stale KV data").

    vLLM 0.33 carries the fix (the blocks are recorded first, "regardless of
    num_external_tokens", the form asked for in PR #47046's review); this puts the early return
    back in front of it, as before the fix, while the faulty run lasts. Nothing else of vLLM's
    code changes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    fixed = OffloadingConnectorScheduler.update_state_after_alloc
    source = inspect.getsource(fixed)
    if source.find("_current_batch_allocated_block_ids") > source.find("num_external_tokens == 0"):
        raise RuntimeError("this vLLM's OffloadingConnector does not carry the fix of #46951")

    def before_the_fix(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return  # the blocks go unrecorded: a fence on them is never raised
        fixed(self, request, blocks, num_external_tokens)

    setattr(OffloadingConnectorScheduler, "update_state_after_alloc", before_the_fix)  # noqa: B010
    try:
        yield
    finally:
        setattr(OffloadingConnectorScheduler, "update_state_after_alloc", fixed)  # noqa: B010


@contextlib.contextmanager
def offloading_chunks_unallocated() -> Iterator[None]:
    """vLLM #52170 (https://github.com/vllm-project/vllm/issues/52170): ``assert
    len(offload_keys) == len(offload_block_ids)`` in ``OffloadingConnectorScheduler.
    _build_store_jobs`` kills the engine (vLLM 0.26, NIXL and OffloadingConnector under
    MultiConnector). The store path takes its chunk count from
    ``RequestOffloadState.storable_chunks`` and slices that many keys and that many chunks of
    the request's block ids; vLLM 0.33 bounds the count by the tokens, by the blocks the
    connector was told of (``num_allocated_chunks``) and by the keys (``num_keyed_chunks``,
    PR #52923, https://github.com/vllm-project/vllm/pull/52923, which closed #52170; its
    description says the blocks bound was there before it).

    Under vLLM 0.33 the keys bound never binds with a connector (the keys come from
    ``Request.block_hashes``, which cover every whole chunk of ``num_tokens``: the lookahead
    hashes that lag behind them are off when a KV connector is configured), so taking it out
    alone changes nothing. This takes the blocks bound out (the keys bound stays): a request
    that finishes before the connector heard of any of its blocks (one vLLM aborted while
    another connector's asynchronous load into them was in flight: its
    ``update_state_after_alloc`` records none, its block ids are only learnt from a step that
    schedules the request) is counted by its computed tokens, and the block slice comes up
    short. Nothing else of vLLM's code changes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )

    fixed = RequestOffloadState.storable_chunks
    if "num_allocated_chunks" not in inspect.getsource(fixed):
        raise RuntimeError("this vLLM's storable_chunks has no bound by the allocated blocks")

    def without_the_blocks_bound(
        self: Any, group_config: Any, group_state: Any, num_offloadable_tokens: int
    ) -> int:
        # vLLM 0.33's body, ``num_allocated_chunks`` left out of the min().
        num_chunks = num_offloadable_tokens // int(group_config.tokens_per_chunk)
        is_decoding = num_offloadable_tokens > self.req.num_prompt_tokens
        if group_config.is_eagle_group and is_decoding and not self.req.is_finished():
            num_chunks = max(0, num_chunks - 1)
        return min(num_chunks, len(group_state.offload_keys))

    setattr(RequestOffloadState, "storable_chunks", without_the_blocks_bound)  # noqa: B010
    try:
        yield
    finally:
        setattr(RequestOffloadState, "storable_chunks", fixed)  # noqa: B010


# name -> the patch a faulty run applies to vLLM (Shape.vllm_patch); its twin runs without it.
VLLM_PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "offloading_allocations_untracked": offloading_allocations_untracked,
    "offloading_chunks_unallocated": offloading_chunks_unallocated,
}


# --------------------------------------------------------------------------------------------
# Shapes: workloads that make the fault happen
# --------------------------------------------------------------------------------------------

_THIS = __name__


@dataclasses.dataclass(frozen=True)
class ZooRequest:
    """One request of a shape's workload. It arrives before step ``at``, or (``after``) once
    that request finished and vLLM freed its blocks. Its prompt is the first ``prompt_len``
    tokens of the shape's token stream ``prompt``: requests naming the same stream share a
    prefix (the same tokens, when their lengths are equal)."""

    req_id: str
    prompt: str
    prompt_len: int
    max_tokens: int
    at: int = 0
    after: str | None = None
    # The next turn of a chat: the prompt starts with that request's prompt and output, and
    # the shape's token stream ``prompt`` fills the rest up to ``prompt_len``.
    continues: str | None = None
    # Aborted (as a client that goes away) between two steps, as soon as vLLM has it waiting
    # for an asynchronous load (WAITING_FOR_REMOTE_KVS).
    abort_while_loading: bool = False


@dataclasses.dataclass(frozen=True)
class Shape:
    """A field report rebuilt: the faulty connector, its clean twin, the workload."""

    name: str
    report: str
    url: str
    faulty: str  # "module:Class" the recorder wraps
    fixed: str
    requests: tuple[ZooRequest, ...]
    # HarnessConfig fields for vLLM's scheduler (block size, pool, batch, async...).
    engine: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"chunk_size": 32})
    digests: str = "off"
    kv_role: str = "kv_both"
    seed: int = 0
    # A connector ("module:Class") placed before the recorded one under vLLM's MultiConnector
    # (None: the recorder is the connector).
    multi_first: str | None = None
    # A name in VLLM_PATCHES: an upstream fix of vLLM's own code taken out while the faulty
    # run lasts (the faulty and the fixed connector are then the same, vLLM's own).
    vllm_patch: str | None = None

    def prompts(self) -> dict[str, list[int]]:
        """The token stream of each prompt name (``harness.named_prompts``)."""
        return named_prompts(self.name, self.seed, self.requests)


def _inner(cls: type) -> str:
    return f"{_THIS}:{cls.__name__}"


_KVLEDGER = "kvledger.connector.vllm:KVLedgerConnector"
_NO_PREFIX_CACHE = {"enable_prefix_caching": False}


def _offloading(offloaded_block_size: int, cpu_chunks: int | None = None) -> dict[str, Any]:
    """A MultiConnector child: vLLM's OffloadingConnector, its CPU tier in chunks of
    ``offloaded_block_size`` tokens (``cpu_chunks`` of them, else the rig's default size), its
    copies the rig's (connector/testing/offloading.py)."""
    size: dict[str, Any] = {}
    if cpu_chunks is not None:
        size["cpu_bytes"] = cpu_chunks * offloaded_block_size * _KV_BYTES_PER_TOKEN
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": offloading_extra_config(
            offloaded_block_size=offloaded_block_size, **size
        ),
    }


# KV bytes of one token in the rig's model (harness.py: 2 layers, K and V, 2 KV heads of 16
# float32 values): what a CPU tier holds per token.
_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


# A prompt computed and stored, then sent again with a suffix (no prefix cache): the second
# request loads the first one's chunks. Block 16, chunk 32: 4 blocks, 2 chunks loaded.
_RELOAD = (
    ZooRequest("first", "p", 64, 4),
    ZooRequest("again", "p", 80, 4, after="first"),
)

SHAPES: dict[str, Shape] = {
    # Dynamo's reproduction: 65 tokens, block size 32, 2 external blocks, temperature 0.
    "dynamo_8419": Shape(
        "dynamo_8419",
        "Dynamo #8419",
        "https://github.com/ai-dynamo/dynamo/issues/8419",
        _inner(LoadIntoLastBlocks),
        _KVLEDGER,
        (ZooRequest("first", "p", 65, 4), ZooRequest("again", "p", 65, 4, after="first")),
        engine={**_NO_PREFIX_CACHE, "block_size": 32, "num_gpu_blocks": 12},
        digests="sampled",
    ),
    "dynamo_15079": Shape(
        "dynamo_15079",
        "Dynamo #15079",
        "https://github.com/ai-dynamo/dynamo/issues/15079",
        _inner(FailedLoadMarkedDone),
        _KVLEDGER,
        _RELOAD,
        engine=_NO_PREFIX_CACHE,
        digests="sampled",
    ),
    "lmcache_4463": Shape(
        "lmcache_4463",
        "LMCache #4463",
        "https://github.com/LMCache/LMCache/issues/4463",
        _inner(KVSwappedOnLoad),
        _KVLEDGER,
        _RELOAD,
        engine=_NO_PREFIX_CACHE,
        digests="sampled",
    ),
    "sglang_40193": Shape(
        "sglang_40193",
        "SGLang #40193",
        "https://github.com/sgl-project/sglang/issues/40193",
        _inner(ShortenedHit),
        _KVLEDGER,
        _RELOAD,
        engine=_NO_PREFIX_CACHE,
        digests="sampled",
    ),
    # "b" (admitted after "a") is preempted in the step after its prefill, while its store job
    # is queued: "a" needs a block for its first decode token and gets b's last block, whose
    # slot it writes in that step's forward; the job then copies it. When the pool has room
    # again "b" comes back and reloads its chunks.
    "vllm_52360": Shape(
        "vllm_52360",
        "vLLM #52360",
        "https://github.com/vllm-project/vllm/issues/52360",
        _inner(StoreReadsFreedBlocks),
        _inner(StoreFlushedAtPreemption),
        (ZooRequest("a", "pa", 64, 6), ZooRequest("b", "pb", 64, 6)),
        engine={**_NO_PREFIX_CACHE, "num_gpu_blocks": 9},
        digests="sampled",
    ),
    # "x" finishes with a store job queued (its free is delayed until finished_sending); the
    # client then sends another request with the same id, which stores chunks of its own.
    "vllm_51637": Shape(
        "vllm_51637",
        "vLLM #51637",
        "https://github.com/vllm-project/vllm/issues/51637",
        _inner(StaleCompletionAfterReuse),
        _inner(StoreFlushedAtPreemption),
        (ZooRequest("x", "p1", 64, 1), ZooRequest("x", "p2", 64, 6, after="x")),
        engine=_NO_PREFIX_CACHE,
    ),
    # "x" finishes with a store job queued (its free is delayed until finished_sending), while
    # "y" still runs: the worker reports x's finished_sending, vLLM frees x, and the worker
    # reports it again at its next report.
    "vllm_46240": Shape(
        "vllm_46240",
        "vLLM #46240",
        "https://github.com/vllm-project/vllm/issues/46240",
        _inner(CompletionRepeated),
        _inner(StoreFlushedAtPreemption),
        (ZooRequest("x", "p1", 64, 1), ZooRequest("y", "p2", 48, 8)),
        engine=_NO_PREFIX_CACHE,
    ),
    # The P/D prefill side (kv_producer: vLLM frees a request's blocks even while a step of it
    # is in flight), async scheduling: "b" (one output token, a prefill) is scheduled with
    # "a"; in the next step, scheduled before b's output is known, "a" needs a block and the
    # pool is full: "b", the last admitted, is preempted, and its output, already computed,
    # finishes it.
    "vllm_50297": Shape(
        "vllm_50297",
        "vLLM #50297",
        "https://github.com/vllm-project/vllm/pull/50297",
        _inner(HandoffAfterPreemption),
        _inner(HandoffDelivered),
        (ZooRequest("a", "pa", 32, 10), ZooRequest("b", "pb", 32, 1)),
        engine={"async_scheduling": True, "num_gpu_blocks": 5},
        kv_role="kv_producer",
    ),
    # A 63-token prompt and one output token: the sampled token closes the second chunk. The
    # next turn sends both back with 16 tokens more; decode saving on (vLLM's
    # offload_prompt_only=False), no prefix cache.
    "vllm_54193": Shape(
        "vllm_54193",
        "vLLM #54193",
        "https://github.com/vllm-project/vllm/issues/54193",
        _inner(SampledTokenStored),
        _KVLEDGER,
        (
            ZooRequest("first", "p", 63, 1),
            ZooRequest("again", "p", 80, 4, after="first", continues="first"),
        ),
        engine=_NO_PREFIX_CACHE,
        extra_config={"chunk_size": 32, "save_decode_cache": True},
        digests="sampled",
    ),
    # KV events on: the connector publishes what its pool stores and evicts. A pool of three
    # chunks: "b"'s two chunks evict one of "a"'s (a removal published); "again", b's prompt
    # and 32 tokens more, finds both of b's chunks held and is offered one.
    "sglang_40193_offer": Shape(
        "sglang_40193_offer",
        "SGLang #40193 (the offer)",
        "https://github.com/sgl-project/sglang/issues/40193",
        _inner(HitCappedAtCapacity),
        _KVLEDGER,
        (
            ZooRequest("a", "pa", 64, 2),
            ZooRequest("b", "pb", 64, 2, after="a"),
            ZooRequest("again", "pb", 96, 2, after="b"),
        ),
        engine={**_NO_PREFIX_CACHE, "kv_events": True},
        extra_config={"chunk_size": 32, "host_pool_bytes": 3 * 16384},
    ),
    # "first" finishes while "second" still runs: the step after, the final store of "first"
    # is prepared for a request the manager already forgot.
    "vllm_49635": Shape(
        "vllm_49635",
        "vLLM #49635",
        "https://github.com/vllm-project/vllm/issues/49635",
        _inner(ManagerForgetsBeforeFinalStore),
        _inner(FinalStoreBeforeForget),
        (ZooRequest("first", "pa", 48, 2), ZooRequest("second", "pb", 48, 8)),
        engine=_NO_PREFIX_CACHE,
    ),
    # Under MultiConnector, kvledger's connector first, the faulty one second: both store
    # "first"'s chunks; "again" is offered them by both, the first is chosen, and the second
    # is told 0 and "loads" anyway.
    "lmcache_4762": Shape(
        "lmcache_4762",
        "LMCache #4762",
        "https://github.com/LMCache/LMCache/pull/4762",
        _inner(LoserStillLoads),
        _KVLEDGER,
        _RELOAD,
        engine=_NO_PREFIX_CACHE,
        multi_first=_KVLEDGER,
    ),
    # vLLM's MultiConnector over two of vLLM's own OffloadingConnectors, the first with chunks of
    # 32 tokens, the second of 16; the recorder wraps the MultiConnector. "p" (24 tokens) is
    # stored by the second only and keeps decoding in its two blocks, so "r" (32 tokens: one
    # chunk of the first) takes the pool's other two; r finishes in its prefill step, its store
    # job deferred to the next step. "q", p's prompt again, is then a hit of the second alone,
    # which loads it asynchronously into a block r freed, in the step r's store runs. "again"
    # (r's prompt and 16 tokens more) loads the first's chunk of r.
    "vllm_46951": Shape(
        "vllm_46951",
        "vLLM #46951",
        "https://github.com/vllm-project/vllm/issues/46951",
        "MultiConnector",
        "MultiConnector",
        (
            ZooRequest("p", "pp", 24, 8),
            ZooRequest("r", "pr", 32, 1, at=1),
            ZooRequest("q", "pp", 24, 2, after="r"),
            ZooRequest("again", "pr", 48, 4, after="q"),
        ),
        engine={**_NO_PREFIX_CACHE, "num_gpu_blocks": 5},
        extra_config={"connectors": [_offloading(32), _offloading(16)]},
        digests="sampled",
        vllm_patch="offloading_allocations_untracked",
    ),
    # vLLM's MultiConnector over two of vLLM's own OffloadingConnectors with chunks of 16
    # tokens, the first with a CPU tier of four chunks; the recorder wraps the MultiConnector.
    # "first" (64 tokens) is stored by both; "filler" (64 other tokens) evicts it from the
    # first. "again" (first's prompt and 16 tokens more) is then a hit of the second alone
    # (64 tokens), loaded asynchronously; vLLM aborts it while it waits for that load. The
    # first connector never heard of its blocks and counts its 64 computed tokens.
    "vllm_52170": Shape(
        "vllm_52170",
        "vLLM #52170",
        "https://github.com/vllm-project/vllm/issues/52170",
        "MultiConnector",
        "MultiConnector",
        (
            ZooRequest("first", "p", 64, 2),
            ZooRequest("filler", "f", 64, 2, after="first"),
            ZooRequest("again", "p", 80, 4, after="filler", abort_while_loading=True),
        ),
        engine=_NO_PREFIX_CACHE,
        extra_config={"connectors": [_offloading(16, cpu_chunks=4), _offloading(16)]},
        vllm_patch="offloading_chunks_unallocated",
    ),
    # The same prompt twice, synchronous loads, no prefix cache: the second is a full hit.
    "vllm_55113": Shape(
        "vllm_55113",
        "vLLM #55113",
        "https://github.com/vllm-project/vllm/issues/55113",
        _inner(FullPromptMatch),
        _KVLEDGER,
        (ZooRequest("first", "p", 64, 4), ZooRequest("again", "p", 64, 4, after="first")),
        engine=_NO_PREFIX_CACHE,
    ),
}


# --------------------------------------------------------------------------------------------
# Running a shape
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ZooReport:
    """What one run of a shape did."""

    shape: str
    fixed: bool
    log_path: str | None
    steps: int
    preemptions: int
    finished: tuple[str, ...]
    # (req id, step): the step whose call to the scheduler saw the request finish. The
    # recorder stamps what vLLM reports after a step's forward pass with the next step.
    finished_at: tuple[tuple[str, int], ...]
    # (step, first wrong token of a running request), as the oracle found them.
    mismatches: tuple[tuple[int, Mismatch | TokenMismatch], ...]
    # A vLLM (or connector) exception that ended the run: "Type: message (file:line)".
    error: str | None
    error_step: int | None
    leaks: tuple[str, ...]
    seconds: float
    # The worker-role connector the run drove (a test may look inside it).
    worker: Any = attrs.field(default=None, eq=False, repr=False)

    def first_mismatch(
        self, req_id: str | None = None
    ) -> tuple[int, Mismatch | TokenMismatch] | None:
        for step, m in self.mismatches:
            if req_id is None or m.req_id == req_id:
                return step, m
        return None


def run_shape(
    shape: Shape, *, fixed: bool = False, log_dir: str, max_steps: int = 400
) -> ZooReport:
    """Run ``shape`` with its faulty connector (or, ``fixed``, its twin) wrapped in
    ``KVLedgerRecorder``, its log in ``log_dir``; see the module docstring. The faulty run of a
    shape with a ``vllm_patch`` runs under that patch of vLLM's code, its twin without it."""
    patch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if shape.vllm_patch is not None and not fixed:
        patch = VLLM_PATCHES[shape.vllm_patch]()
    with patch:
        return _run_shape(shape, fixed=fixed, log_dir=log_dir, max_steps=max_steps)


def _run_shape(shape: Shape, *, fixed: bool, log_dir: str, max_steps: int) -> ZooReport:
    from kvledger.connector.testing.recorded import WrappedSpec, runner

    started = time.perf_counter()
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    spec = WrappedSpec(
        inner=shape.fixed if fixed else shape.faulty,
        digests=shape.digests,
        kv_role=shape.kv_role,
        extra_config=dict(shape.extra_config),
        seed=shape.seed,
        **dict(shape.engine),
    )
    if shape.multi_first is None:
        driver = runner(spec, log_dir)
    else:
        driver = _multi_runner(spec, shape.multi_first, log_dir)
    harness = driver.harness
    prompts = shape.prompts()
    waiting = list(shape.requests)
    mismatches: list[tuple[int, Mismatch | TokenMismatch]] = []
    finished_at: list[tuple[str, int]] = []
    error: str | None = None
    error_step: int | None = None
    steps = 0

    def arrive() -> None:
        for r in list(waiting):
            gone = r.after is not None and (
                r.after in harness.finished and r.after not in harness.scheduler.requests
            )
            if (r.after is None and r.at <= steps) or gone:
                waiting.remove(r)
                driver.forget(r.req_id)  # a request id that comes back is a new request
                harness.finished.pop(r.req_id, None)
                tokens = prompts[r.prompt]
                if r.continues is not None:
                    turn = [*harness.prompts[r.continues], *harness.output_tokens[r.continues]]
                    tokens = turn + tokens[len(turn) :]
                harness.add_request(r.req_id, tokens[: r.prompt_len], r.max_tokens)

    def abort() -> None:
        from vllm.v1.request import RequestStatus

        for r in shape.requests:
            request = harness.scheduler.requests.get(r.req_id)
            if r.abort_while_loading and request is not None:
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    harness.abort_request(r.req_id)

    try:
        while steps < max_steps:
            arrive()
            abort()
            result = harness.step()
            if result is None:
                if not waiting:
                    break
                steps += 1  # idle until the next arrival
                continue
            steps += 1
            finished_at += [(r, result.step) for r in result.finished]
            mismatches += [(result.step, m) for m in driver.verify()]
    except Exception as exc:  # vLLM's engine core would die here: say where, keep the log
        where = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        error = f"{message} ({Path(where.filename).name}:{where.lineno})"
        error_step = steps
    leaks: list[str] = []
    if error is None and not harness.is_done():
        leaks.append(f"not done after {steps} steps: {harness.describe()}")
    connector = harness.connector
    try:
        connector.shutdown()  # closes the recorder's log
    finally:
        try:
            driver.worker.shutdown()
            harness.close()
        except Exception:  # a scheduler that asserted may not shut down cleanly
            pass
    return ZooReport(
        shape=shape.name,
        fixed=fixed,
        log_path=_log_path(connector),
        steps=steps,
        preemptions=harness.stats.preemptions,
        finished=tuple(sorted(harness.finished)),
        finished_at=tuple(finished_at),
        mismatches=tuple(mismatches),
        error=error,
        error_step=error_step,
        leaks=tuple(leaks),
        seconds=time.perf_counter() - started,
        worker=driver.worker,
    )


def _multi_runner(spec: Any, first: str, log_dir: str) -> Any:
    """The rigs' model runner of ``spec`` under vLLM's MultiConnector: ``first``, then the
    recorder wrapping ``spec.inner`` (each with the shape's extra config)."""
    from kvledger.connector.testing.driver import ModelRunner, engine_config
    from kvledger.connector.testing.recorded import kv_transfer_config

    def config(inner: str, record: bool) -> dict[str, Any]:
        return kv_transfer_config(
            inner,
            spec.extra_config,
            record=record,
            log_dir=log_dir,
            digests=spec.digests,
            kv_role=spec.kv_role,
        )

    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": spec.kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [config(first, False), config(spec.inner, True)]
        },
    }
    return ModelRunner(engine_config(spec, multi), layout=spec.layout)


def _log_path(connector: Any) -> str | None:
    """The recorder's log: the connector's, or under a MultiConnector its recorded child's."""
    for c in [connector, *getattr(connector, "_connectors", ())]:
        path = getattr(c, "log_path", None)
        if path is not None:
            return str(path)
    return None


# --------------------------------------------------------------------------------------------
# LMCache's own bugs: LMCache's real adapter, pinned releases (connector/testing/lmcache.py)
# --------------------------------------------------------------------------------------------


def lmcache_shapes() -> dict[str, Any]:
    """The zoo's LMCache shapes: ``LMCacheRun`` workloads, each run on the release with the bug
    and the release with its fix (tests/test_zoo.py names them)."""
    from kvledger.connector.testing.lmcache import WORKLOADS, LMCacheRun
    from kvledger.connector.testing.lmcache_mp import LMCacheMPRun, MPRequest

    shapes = {
        # LMCache #1969: the rig's own workload (0.3.9.post2 faulty, 0.3.10 fixed).
        "lmcache_1969": WORKLOADS["issue1969"],
        # The "Mismatch in tokens to load" assertion (the seed's #2158): chunks of 64 over
        # blocks of 16, so vLLM's prefix cache holds more of a shared prefix (80 tokens) than
        # LMCache (64). The second request cannot be allocated while the first decodes, so its
        # lookup is asked again every step; 0.3.10's lookup cache then returns the raw hit,
        # vLLM accepts it on top of its own 80, and update_state_after_alloc asserts.
        "lmcache_mismatch": LMCacheRun(
            "lmcache_mismatch",
            num_requests=2,
            prompt_len=200,
            max_tokens=10,
            num_gpu_blocks=17,
            chunk_size=64,
            shared_prefix=90,
        ),
        # LMCache #2821 (the decode-save bug, fixed by PR #2929): under async scheduling the
        # cached request's new tokens are sliced from num_computed_tokens, which vLLM already
        # advanced: the tracker never grows and decode KV is never saved. #1969's workload with
        # decode saving on, and a pool of 8 blocks: both requests decode past two chunk
        # boundaries (48, 64) before req-1 is preempted, then resumes with a lookup over its
        # prompt and outputs.
        "lmcache_2821": LMCacheRun(
            "lmcache_2821",
            max_tokens=40,
            num_gpu_blocks=9,
            enable_prefix_caching=False,
            async_scheduling=True,
            lmcache={"save_decode_cache": True},
        ),
        # LMCache #4133: an eviction between the scheduler's lookup and the worker's retrieve.
        # A 64-token prompt sent again: the lookup promises 63 tokens, and the last chunk it
        # found is gone when the worker retrieves (the non-layerwise path: the crash of the
        # issue is the layerwise blender's, which needs a GPU model).
        "lmcache_4133": LMCacheRun(
            "lmcache_4133",
            num_requests=1,
            prompt_len=64,
            max_tokens=4,
            num_gpu_blocks=12,
            enable_prefix_caching=False,
            repeat_prompts=1,
            evict_before_retrieve=("again-req-0",),
        ),
    }
    # Its clean twin: the same workload, nothing evicted (the issue is open: no release fixes
    # it; the twin is the run without the eviction).
    shapes["lmcache_4133_twin"] = dataclasses.replace(
        shapes["lmcache_4133"], name="lmcache_4133_twin", evict_before_retrieve=()
    )
    # LMCache #4955 (an in-flight MP store reads blocks a preemption freed; vLLM #52360's shape
    # in LMCache's own MP mode): LMCache's MP connector and its MP server, LMCache-driven
    # transfer over CPU shared memory (connector/testing/lmcache_mp.py). "a" and "b" (64
    # tokens each) fill the pool of 8 blocks in one prefill step; in the next, "a" needs a
    # block for its first decode token, vLLM preempts "b" and hands a b's last block, which
    # a's forward writes while the server's STORE of b's 4 chunks is still in flight. 0.5.5's
    # preemption flush (LMCacheDrivenTransferContext.flush_inflight_stores) is a no-op: the
    # store reads a's KV into b's last chunk. "again" (b's prompt and 16 tokens more) loads
    # it. 0.5.6 waits for the store before the forward (the same workload: clean).
    mp = {
        "lmcache_4955": LMCacheMPRun(
            "lmcache_4955",
            (
                MPRequest("a", "pa", 64, 6),
                MPRequest("b", "pb", 64, 6),
                MPRequest("again", "pb", 80, 4, after="b"),
            ),
            num_gpu_blocks=9,
        )
    }
    return {**shapes, **mp}
