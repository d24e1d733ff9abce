"""The worker side: executes the scheduler's plans with the transfer backend.

The worker decides nothing. It receives a ``StepPlan`` (loads, saves, refused blocks) in the
connector metadata, moves bytes between the paged KV caches and the host pool slots the plan
names, and reports back what happened in a ``WorkerReport``. It does not import vLLM.

Order within one step, as vLLM calls it: ``handle_preemptions`` (flush saves before preempted
blocks are reused) -> ``bind`` -> ``start_load_kv`` -> forward -> ``wait_for_save`` ->
``get_finished`` -> ``get_block_ids_with_load_errors`` -> ``build_report``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
import torch

from connector.config import ConnectorConfig
from connector.messages import ChunkTransfer, StepPlan, TransferPlan, WorkerReport
from connector.store import HostChunkPool
from connector.transfer import TransferBackend, TransferHandle, slot_mapping_for
from tracker.plans import blocks_covering

__all__ = ["WorkerSide"]

_log = structlog.get_logger("kvledger.connector")


class WorkerSide:
    """One per worker process; owns the host pool bytes and the transfer backend.

    ``num_slots`` sizes the host pool (default: as many slots as ``host_pool_bytes`` holds);
    ``layout`` names the KV-cache layout when the shapes cannot tell (default: inferred)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        num_slots: int | None = None,
        layout: str | None = None,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        self._num_slots = num_slots
        self._layout = layout
        self.backend: TransferBackend | None = None
        self.pool: HostChunkPool | None = None
        self._plan: StepPlan | None = None
        # (req_id, key, handle) of saves not yet known to be complete.
        self._saves_in_flight: list[tuple[str, bytes, TransferHandle]] = []
        self._awaiting_free: set[str] = set()
        self._load_errors: set[int] = set()
        self._report = WorkerReport(rank=rank)
        self.stats = {"tokens_loaded": 0, "tokens_saved": 0, "chunks_loaded": 0, "chunks_saved": 0}

    # --- setup ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Accepts vLLM's FlashAttention ``[2, nb, bs, h, d]`` or FlashInfer
        ``[nb, 2, bs, h, d]`` per-layer caches, on CPU or CUDA; anything else is an error
        naming the shape it got."""
        backend = TransferBackend(kv_caches, self.config.chunk_size, self._layout)
        self.backend = backend
        if self._num_slots is not None:
            self.pool = HostChunkPool(backend.spec, self.config.chunk_size, self._num_slots)
        else:
            self.pool = HostChunkPool.from_bytes_budget(
                self.config.host_pool_bytes, backend.spec, self.config.chunk_size
            )

    def _ready(self) -> tuple[TransferBackend, HostChunkPool]:
        if self.backend is None or self.pool is None:
            raise RuntimeError("register_kv_caches must be called before any transfer")
        return self.backend, self.pool

    # --- per step -------------------------------------------------------------------------

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        """Before the forward pass reuses preempted blocks, every save reading them must be
        finished: vLLM frees a preempted request's blocks without telling the connector."""
        if plan is not None and plan.preempted:
            self._drain_saves(block=True)

    def bind(self, plan: StepPlan) -> None:
        # Order this step's forward pass after every save still reading blocks: a block freed
        # by a preemption may be reused right now, and vLLM before 0.14 never calls
        # handle_preemptions. The compute stream waits; the host does not block.
        for _, _, handle in self._saves_in_flight:
            handle.wait()
        self._plan = plan
        self._awaiting_free.update(plan.delayed_free)
        self._load_errors.update(plan.refused_blocks)

    def start_load_kv(self) -> None:
        plan = self._plan
        if plan is None or not plan.loads:
            return
        backend, _ = self._ready()
        block_size = backend.spec.block_size
        failed: list[tuple[str, tuple[int, ...]]] = []
        done: list[str] = []
        for load in plan.loads:
            bad = self._load_one(load, block_size)
            if bad:
                failed.append((load.req_id, bad))
                self._load_errors.update(bad)
            else:
                done.append(load.req_id)
        self._report = self._report.merged(
            WorkerReport(loads_done=tuple(done), loads_failed=tuple(failed), rank=self.rank)
        )

    def _load_one(self, load: TransferPlan, block_size: int) -> tuple[int, ...]:
        """Load every chunk; returns the blocks that could not be filled (empty: success)."""
        for chunk in load.chunks:
            try:
                self.load_chunk(load, chunk)
            except Exception as exc:
                _log.warning(
                    "kvledger.load_failed", req_id=load.req_id, slot=chunk.slot, error=repr(exc)
                )
                # vLLM recomputes from the first failed block on; report the rest of the range.
                start = chunk.token_start
                end = load.chunks[-1].token_end
                return tuple(blocks_covering(load.block_ids, block_size, start, end))
        return ()

    def load_chunk(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        """Fill one chunk of ``load`` from its host slot into the paged caches, ordered before
        the forward pass. Raising fails the request's load from this chunk on: the blocks from
        here to the end of the load are reported as load errors and vLLM recomputes them.

        Subclasses may override it, calling this one to move the bytes; the test rigs make
        chosen chunks fail this way (as a lost or corrupt remote chunk would)."""
        backend, pool = self._ready()
        mapping = slot_mapping_for(
            load.block_ids, backend.spec.block_size, chunk.token_start, chunk.token_end
        )
        pool.wait_slot(chunk.slot)  # a save into this slot may still be running
        handle = pool.load(backend, chunk.slot, mapping, chunk.slot_offset)
        handle.wait()  # the forward pass (compute stream) reads these blocks next
        self.stats["tokens_loaded"] += chunk.token_end - chunk.token_start
        self.stats["chunks_loaded"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are issued for all layers at once in ``start_load_kv``; nothing per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves gather all layers at once in ``wait_for_save``; nothing per layer."""

    def wait_for_save(self) -> None:
        plan = self._plan
        if plan is None or not plan.saves:
            return
        backend, pool = self._ready()
        block_size = backend.spec.block_size
        failed_loads = {req for req, _ in self._report.loads_failed}
        refused: list[tuple[str, tuple[bytes, ...]]] = []
        for save in plan.saves:
            if save.req_id in failed_loads:
                # This step computed over a prefix that failed to load: its KV is wrong.
                refused.append((save.req_id, tuple(ch.key for ch in save.chunks)))
                continue
            for chunk in save.chunks:
                try:
                    mapping = slot_mapping_for(
                        save.block_ids, block_size, chunk.token_start, chunk.token_end
                    )
                    pool.wait_slot(chunk.slot)  # the slot's previous chunk may still be read
                    handle = pool.save(backend, chunk.slot, mapping, chunk.slot_offset)
                    self._saves_in_flight.append((save.req_id, chunk.key, handle))
                    self.stats["tokens_saved"] += chunk.token_end - chunk.token_start
                    self.stats["chunks_saved"] += 1
                except Exception as exc:
                    _log.warning("kvledger.save_failed", req_id=save.req_id, error=repr(exc))
                    refused.append((save.req_id, (chunk.key,)))
        if refused:
            self._report = self._report.merged(
                WorkerReport(saves_failed=tuple(refused), rank=self.rank)
            )

    def _drain_saves(self, *, block: bool) -> None:
        """Move finished saves into the report; with ``block``, wait for all of them."""
        still: list[tuple[str, bytes, TransferHandle]] = []
        done: dict[str, list[bytes]] = {}
        for req_id, key, handle in self._saves_in_flight:
            if block:
                handle.synchronize()
            if handle.done():
                done.setdefault(req_id, []).append(key)
            else:
                still.append((req_id, key, handle))
        self._saves_in_flight = still
        if done:
            self._report = self._report.merged(
                WorkerReport(
                    saves_done=tuple((r, tuple(k)) for r, k in done.items()), rank=self.rank
                )
            )

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving). A request whose freeing was delayed is
        reported once no save of it is in flight; loads are synchronous, so none are pending."""
        self._drain_saves(block=False)
        busy = {req for req, _, _ in self._saves_in_flight}
        ready = {req for req in self._awaiting_free if req not in busy}
        self._awaiting_free -= ready
        return (ready or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_report(self) -> WorkerReport:
        self._drain_saves(block=False)
        report, self._report = self._report, WorkerReport(rank=self.rank)
        return report

    def clear(self) -> None:
        self._plan = None

    def shutdown(self) -> None:
        self._drain_saves(block=True)
