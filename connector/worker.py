"""The worker side: executes the scheduler's plans with the transfer backend.

The worker decides nothing. It receives a ``StepPlan`` (loads, saves, refused blocks) in the
connector metadata, moves bytes between the paged KV caches and the host pool slots the plan
names, and reports back what happened in a ``WorkerReport``. It does not import vLLM.

Order within one step, as vLLM calls it: ``handle_preemptions`` (flush saves before preempted
blocks are reused) -> ``bind`` -> ``start_load_kv`` -> forward -> ``wait_for_save`` ->
``get_finished`` -> ``get_block_ids_with_load_errors`` -> ``build_report`` -> ``clear``.

With speculative decoding vLLM defers ``wait_for_save`` (``defer_finalize``): the connector
output is collected right after the target forward, and ``wait_for_save`` and ``clear`` run
after the draft forward (vLLM 0.33: ``KVConnectorModelRunnerMixin._get_kv_connector_output``
and ``finalize_kv_connector``, called from ``GPUModelRunner.sample_tokens``; MRV2:
``ActiveKVConnector.post_forward`` and ``finalize_step``). So the order is ... forward ->
``get_finished`` -> ``get_block_ids_with_load_errors`` -> ``build_report`` -> draft forward ->
``wait_for_save`` -> ``clear``. The worker therefore keeps what ``wait_for_save`` needs apart
from the report (which loads failed in this step), counts a request with saves in the bound
plan not yet issued as busy in ``get_finished``, and reports the step's saves in the next
report. Should ``wait_for_save`` not come at all before the next step (vLLM 0.33 skips
``finalize_kv_connector`` on a pipeline stage that is not the last), the saves are issued when
the next step starts, before its loads and forward can overwrite their blocks.

Streams (CUDA). Transfers run on the backend's side stream, ordered explicitly against the
stream vLLM runs the step's forward pass on, which the worker records when vLLM binds the step
and calls ``start_load_kv``: the stream current then. That this is the forward's stream is
vLLM's code, not an assumption (vLLM 0.33):

- ``vllm/v1/worker/kv_connector_model_runner_mixin.py``,
  ``KVConnectorModelRunnerMixin._get_kv_connector_output``: ``bind_connector_metadata``, then
  ``start_load_kv`` (a step with synchronous loads, which every step with ours is), then
  ``yield``, then ``wait_for_save`` in its ``finally`` (or, deferred, ``finalize_kv_connector``);
  no stream is switched in between.
- ``vllm/v1/worker/gpu_model_runner.py``, ``GPUModelRunner.execute_model``: the forward
  (``self._model_forward``) runs inside ``with ... self.maybe_get_kv_connector_output(...)``
  on the calling thread's current stream; ``GPUModelRunner.sample_tokens`` runs the drafter
  and then ``finalize_kv_connector`` on that same thread and stream.
- ``vllm/utils/torch_utils.py``, ``current_stream``: a vLLM worker replaces the default stream
  by a dedicated one (``torch.cuda.set_stream``), on which ``vllm/compilation/cuda_graph.py``
  (``CUDAGraphWrapper.__call__``) captures and replays CUDA graphs. So the forward does run
  on a non-default stream, the one current at those calls. Model Runner V2 does the same:
  ``vllm/v1/worker/gpu/kv_connector.py`` (``ActiveKVConnector.pre_forward``,
  ``post_forward``, ``finalize_step``) around the forward on ``GPUModelRunner.main_stream``
  (``torch.cuda.current_stream()``); dual-batch overlap (``vllm/v1/worker/gpu_ubatch_wrapper.py``,
  ``UBatchWrapper.__call__``) runs its micro-batches' compute on the stream current at the call.

The order, with that stream named ``compute``: a load starts after the work issued on
``compute`` so far (the blocks' previous users), and ``compute`` waits on the load's event
before the forward is issued; the step's forward waits likewise for every save still reading
blocks (``bind``); a save starts after an event recorded on ``compute`` once the forward (and
the drafter) was issued, and also after the stream current at ``wait_for_save`` should that be
another. On CPU there is no stream and every transfer is synchronous.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.digests import WorkerDigests
from kvledger.connector.logsafe import safe_logger
from kvledger.connector.messages import ChunkTransfer, StepPlan, TransferPlan, WorkerReport
from kvledger.connector.store import HostChunkPool
from kvledger.connector.tiers import (
    REFUSED,
    UNAVAILABLE,
    Tier,
    TierUnavailable,
    down_reason,
    open_tier,
    serving,
)
from kvledger.connector.transfer import (
    KVCacheLayoutError,
    TransferBackend,
    TransferHandle,
    slot_mapping_for,
)
from kvledger.connector.values import ValueSeal, layout_fingerprint, read_secret
from kvledger.tracker.plans import blocks_covering
from kvledger.tracker.remote import foreign
from kvledger.tracker.tiers import POOL, REMOTE, tier_of_slot

__all__ = ["WorkerSide"]

# How many keys read from the remote tier the worker remembers until their local save.
_READ_REMOTE_KEYS = 1 << 16

_log = safe_logger("kvledger.connector")


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
        # The pool format the chunk keys' salt names (connector.vllm sets it): caches of
        # another format are refused when registered. None: whatever the caches are.
        self.pool_format: str | None = None
        self._num_slots = num_slots
        self._layout = layout
        self.backend: TransferBackend | None = None
        self.pool: HostChunkPool | None = None
        self._plan: StepPlan | None = None
        # Saves of the bound plan not issued yet (wait_for_save issues them), and the requests
        # whose load failed in that plan's step (their saves are refused).
        self._to_save: tuple[TransferPlan, ...] = ()
        self._step_failed_loads: set[str] = set()
        self._failed_before: set[str] = set()  # the step before's
        # The stream the bound step's forward runs on (None on CPU); see the module docstring.
        self._compute: Any = None
        # (req_id, key, handle) of saves not yet known to be complete.
        self._saves_in_flight: list[tuple[str, bytes, TransferHandle]] = []
        self._awaiting_free: set[str] = set()
        self._load_errors: set[int] = set()
        self._report = WorkerReport(rank=rank)
        self.stats = {"tokens_loaded": 0, "tokens_saved": 0, "chunks_loaded": 0, "chunks_saved": 0}
        # The remote tier (connector/tiers.py: Redis, or any registered Tier): chunks fetched
        # for this step's loads (payload, or why not), and saves done locally whose bytes go
        # to the tier at the report.
        self._fetched: dict[bytes, memoryview | str] = {}
        # Keys read from the remote tier and not saved locally yet (oldest first, bounded): their
        # local saves, a step or more later (a prefill spans steps), are not written back.
        self._read_remote: dict[bytes, None] = {}
        # (request, key) -> (slot, the chunk's first block) of saves to upload.
        self._upload_slot: dict[tuple[str, bytes], tuple[int, int]] = {}
        self._to_upload: list[tuple[str, bytes, int, int]] = []
        # The digests each fetched value carried (connector/values.py), by key.
        self._carried: dict[bytes, tuple[tuple[bytes, int], ...]] = {}
        # The chunk keys' salt (connector.vllm sets it): part of what binds a value to its KV
        # layout. The seal is made once the caches are registered (the layout is known then).
        self.salt = ""
        self.values: ValueSeal | None = None
        self.remote: Tier | None = open_tier(config, rank=rank, scheduler=False)
        self._secret = read_secret(config) if self.remote is not None else None
        if self.remote is not None:
            # A tier that refuses the configuration raises; one down is served around (the
            # scheduler records the outage).
            down = self.remote.check(startup=True)
            if down is not None:
                _log.warning("kvledger.remote_unavailable", rank=rank, error=down)
        self.stats.update(remote_chunks_loaded=0, remote_chunks_saved=0)
        # KV-content digests (connector/digests.py): None when off. The bound plan's digests
        # are taken once, after the forward (wait_for_save may be called twice).
        self.digests: WorkerDigests | None = None
        if config.digests != "off":
            self.digests = WorkerDigests(config.digests, layout=layout, rank=rank)
        self._digest_plan: Any = None
        self._step_load_errors: set[int] = set()
        # The step before's load errors (refused and failed blocks): under async scheduling
        # the step after a failed load was scheduled before vLLM heard of it.
        self._missing_before: set[int] = set()

    # --- setup ----------------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], *, cpu_isa: str | None = None
    ) -> None:
        """Accepts vLLM's FlashAttention ``[2, nb, bs, h, d]`` or FlashInfer
        ``[nb, 2, bs, h, d]`` per-layer caches, on CPU or CUDA, and its CPU attention's
        ``[nb, h, bs, 2 * d]`` in the order of kernel ``cpu_isa`` (default: the one vLLM would
        pick here); anything else is an error naming the shape it got. So are caches whose
        pool format is not ``pool_format``, the one the chunk keys name: their chunks would be
        read as bytes of another order."""
        backend = TransferBackend(kv_caches, self.config.chunk_size, self._layout, cpu_isa=cpu_isa)
        got = backend.spec.pool_format
        if self.pool_format is not None and got != self.pool_format:
            raise KVCacheLayoutError(
                f"the KV caches vLLM registered ({backend.spec.layout}, "
                f"{backend.spec.num_layers} layers of {tuple(next(iter(kv_caches.values())).shape)}"
                f"{', kernel ' + str(backend.spec.cpu_isa) if backend.spec.cpu_isa else ''}) "
                f"go to the host pool as {got!r}, but this connector's chunk keys name the pool "
                f"format {self.pool_format!r}: a chunk must never be read in another format. "
                "The scheduler side decides the format from vLLM's platform and attention "
                "backend (connector.vllm._pool_format); please report this mismatch"
            )
        self.backend = backend
        if self.digests is not None:
            self.digests.register_kv_caches(kv_caches)
        if self._num_slots is not None:
            self.pool = HostChunkPool(backend.spec, self.config.chunk_size, self._num_slots)
        else:
            self.pool = HostChunkPool.from_bytes_budget(
                self.config.host_pool_bytes, backend.spec, self.config.chunk_size
            )
        if self.remote is not None:
            self.remote.check_chunk_bytes(self.pool.slot_bytes)  # ConnectorConfigError if not
            spec = self.pool.spec
            layout = layout_fingerprint(
                self.salt, spec.pool_format, spec.dtype, self.pool.chunk_shape
            )
            self.values = ValueSeal(
                rank=self.rank, layout=layout, secret=self._secret, digests=self.config.digests
            )

    def _ready(self) -> tuple[TransferBackend, HostChunkPool]:
        if self.backend is None or self.pool is None:
            raise RuntimeError("register_kv_caches must be called before any transfer")
        return self.backend, self.pool

    # --- per step -------------------------------------------------------------------------

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        """Before the forward pass reuses preempted blocks, every save reading them must be
        finished: vLLM frees a preempted request's blocks without telling the connector."""
        self._issue_late_saves()
        if plan is not None and plan.preempted:
            self._drain_saves(block=True)

    def bind(self, plan: StepPlan) -> None:
        self._issue_late_saves()
        self._compute = self._current_stream()
        # Order this step's forward pass after every save still reading blocks: a block freed
        # by a preemption may be reused right now, and older vLLM never calls
        # handle_preemptions (connector/edge.py). The compute stream waits; the host does
        # not block. A save that cannot be waited for (its event raised: the device's error)
        # may read blocks the forward overwrites: it fails, and its chunk is never stored.
        lost: list[tuple[str, bytes]] = []
        for req_id, key, handle in self._saves_in_flight:
            try:
                handle.wait(self._compute)
            except Exception as exc:
                lost.append((req_id, key))
                _log.warning("kvledger.save_failed", req_id=req_id, error=repr(exc))
        if lost:
            self._saves_lost(lost)
        self._plan = plan
        self._to_save = plan.saves
        self._digest_plan = plan.digests
        self._missing_before = self._step_load_errors
        self._step_load_errors = set(plan.refused_blocks)  # and the loads failing below
        # Under async scheduling the step after a failed load was scheduled before vLLM
        # heard of it, and runs over the same unloaded blocks: its digests are not its keys'.
        self._failed_before = self._step_failed_loads
        self._step_failed_loads = set()
        self._awaiting_free.update(plan.delayed_free)
        self._load_errors.update(plan.refused_blocks)

    def _issue_late_saves(self) -> None:
        """The previous step's saves, if vLLM never called ``wait_for_save`` for them: issued
        now, while their blocks still hold that step's KV (this step's loads and forward come
        later)."""
        if not self._to_save:
            return
        _log.warning(
            "kvledger.saves_issued_late",
            step=self._plan.step if self._plan is not None else None,
            saves=len(self._to_save),
        )
        if self.backend is None or self.pool is None:  # nothing to save with: they failed
            saves, self._to_save = self._to_save, ()
            failed = tuple((s.req_id, tuple(c.key for c in s.chunks)) for s in saves)
            self._report = self._report.merged(WorkerReport(saves_failed=failed, rank=self.rank))
            return
        self.wait_for_save()

    def _current_stream(self) -> Any:
        """The stream current on this thread now (None on CPU, or before register_kv_caches)."""
        return self.backend.compute_stream() if self.backend is not None else None

    def _save_after(self) -> tuple[Any, ...]:
        """What a save must follow: the step's forward stream, and the stream current now if
        it is another one (empty on CPU)."""
        streams: list[Any] = []
        for stream in (self._compute, self._current_stream()):
            if stream is not None and stream not in streams:
                streams.append(stream)
        return tuple(streams)

    def start_load_kv(self) -> None:
        plan = self._plan
        if self.digests is not None and plan is not None:
            self.digests.before_load(plan.digests)  # before any load of this step is issued
        if plan is None or not plan.loads:
            return
        backend, _ = self._ready()
        # vLLM calls this on the stream its forward will run on (module docstring).
        self._compute = self._current_stream()
        block_size = backend.spec.block_size
        failed: list[tuple[str, tuple[int, ...]]] = []
        done: list[str] = []
        self._fetch_remote(plan.loads)
        for load in plan.loads:
            bad = self._load_one(load, block_size)
            if bad:
                failed.append((load.req_id, bad))
                self._step_failed_loads.add(load.req_id)
                self._load_errors.update(bad)
                self._step_load_errors.update(bad)
            else:
                done.append(load.req_id)
        self._report_unusable(plan.loads)
        self._read_remote.update(
            (k, None) for k, got in self._fetched.items() if type(got) is not str
        )
        while len(self._read_remote) > _READ_REMOTE_KEYS:
            del self._read_remote[next(iter(self._read_remote))]
        self._fetched = {}
        self._carried = {}
        self._report = self._report.merged(
            WorkerReport(loads_done=tuple(done), loads_failed=tuple(failed), rank=self.rank)
        )

    def _fetch_remote(self, loads: tuple[TransferPlan, ...]) -> None:
        """Read every chunk this step loads from the remote store, in one round trip. Whatever
        the read raises fails every chunk of it, ``unavailable: <error>``: a load failure
        vLLM recomputes, and an outage the scheduler records; never a raise into vLLM."""
        keys = list(
            dict.fromkeys(
                ch.key for load in loads for ch in load.chunks if tier_of_slot(ch.slot) == REMOTE
            )
        )
        if not keys:
            return
        _, pool = self._ready()
        if self.remote is None or self.values is None or not serving(self.remote):
            self._fetched = dict.fromkeys(keys, UNAVAILABLE)
            return
        got: list[bytes | memoryview | str]
        try:
            got = self.remote.get(keys)
            if len(got) != len(keys):
                raise TierUnavailable(f"TierError: {len(got)} values for {len(keys)} keys")
        except Exception as exc:  # the tier's boundary: TierUnavailable, or unforeseen
            why = f"{UNAVAILABLE}: {self._remote_error(exc)}"
            _log.warning("kvledger.remote_unavailable", rank=self.rank, error=why)
            got = [why] * len(keys)
        fetched: dict[bytes, memoryview | str] = {}
        for key, value in zip(keys, got, strict=True):
            fetched[key] = self._open(key, value, pool.slot_bytes)
        self._fetched = fetched

    def _open(self, key: bytes, value: bytes | memoryview | str, size: int) -> memoryview | str:
        """A fetched value's chunk bytes, if it is this chunk's (connector/values.py), else
        why not; a foreign value is logged, loudly: someone wrote it to the tier."""
        if isinstance(value, str):
            return value
        assert self.values is not None
        try:
            opened = self.values.open(key, value, size)
        except Exception as exc:  # a value no check foresaw: refused, never loaded
            opened = f"format: unreadable value ({type(exc).__name__}: {exc})"
        if isinstance(opened, str):
            if foreign(opened):
                _log.warning(
                    "kvledger.remote_foreign_value", rank=self.rank, key=key.hex(), why=opened
                )
            return opened
        if opened.digests:
            self._carried[key] = opened.digests
        return opened.payload

    def _remote_error(self, exc: Exception) -> str:
        assert self.remote is not None
        return down_reason(self.remote, exc)

    def _report_unusable(self, loads: tuple[TransferPlan, ...]) -> None:
        """Every chunk this step read from the remote store and could not use (a key gone, a
        short, corrupt or refused value, the tier down), each once, under the first load
        that needed it: the tracker forgets them all, not only the first of each load (a
        failed load stops at its first bad chunk)."""
        seen: set[bytes] = set()
        unusable: dict[tuple[str, str], list[bytes]] = {}  # (request, why) -> keys
        for load in loads:
            for chunk in load.chunks:
                why = self._fetched.get(chunk.key)
                remote = tier_of_slot(chunk.slot) == REMOTE
                if remote and isinstance(why, str) and chunk.key not in seen:
                    seen.add(chunk.key)
                    unusable.setdefault((load.req_id, why), []).append(chunk.key)
        if unusable:
            entries = tuple(
                ("load_failed", req_id, tuple(keys), why)
                for (req_id, why), keys in unusable.items()
            )
            self._report = self._report.merged(WorkerReport(rank=self.rank, remote=entries))

    def _load_remote(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        """Fill one chunk from the bytes fetched from the remote store; a key gone, a short,
        corrupt or refused value fails the load (``_report_unusable`` reports it)."""
        backend, pool = self._ready()
        payload = self._fetched.get(chunk.key, UNAVAILABLE)
        if isinstance(payload, str):
            raise OSError(f"remote chunk {chunk.key.hex()}: {payload}")
        with warnings.catch_warnings():  # read-only bytes from the client: only read here
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        src = raw.view(pool.spec.dtype).view(pool.chunk_shape)
        if pool.pinned:  # a copy to the device reads pinned memory only; the value is pageable
            src = pool.staging().copy_(src)
        mapping = slot_mapping_for(
            load.block_ids, backend.spec.block_size, chunk.token_start, chunk.token_end
        )
        compute = self._compute
        after = (compute,) if compute is not None else ()
        handle = backend.load(src, mapping, chunk.slot_offset, after=after)
        handle.synchronize()  # src goes away with this call, or is the staging reused next
        self.stats["tokens_loaded"] += chunk.token_end - chunk.token_start
        self.stats["chunks_loaded"] += 1
        self.stats["remote_chunks_loaded"] += 1
        carried = self._carried.get(chunk.key)
        if carried and self.digests is not None:
            # The saver's digests of the blocks this load filled whole: the log judges the
            # load by them (tracker/digests.py), without the saver's log.
            bs = backend.spec.block_size
            first = chunk.chunk_start // bs
            lo, hi = -(-chunk.token_start // bs), chunk.token_end // bs
            rows = carried[max(0, lo - first) : max(0, hi - first)]
            self.digests.carried(load.req_id, max(lo, first), rows)

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
        chosen chunks fail this way (as a lost or corrupt remote chunk would).

        The plan's slot names the tier the chunk is read from (``tracker/tiers.py``): a host
        slot, or the remote tier's bytes fetched at the step's start (``_fetch_remote``)."""
        tier = tier_of_slot(chunk.slot)
        if tier == REMOTE:
            self._load_remote(load, chunk)
        elif tier == POOL:
            self._load_pooled(load, chunk)
        else:  # a code no tier has: a load failure vLLM recomputes
            raise ValueError(f"slot {chunk.slot} names no tier")

    def _load_pooled(self, load: TransferPlan, chunk: ChunkTransfer) -> None:
        """Fill one chunk from its host slot."""
        backend, pool = self._ready()
        mapping = slot_mapping_for(
            load.block_ids, backend.spec.block_size, chunk.token_start, chunk.token_end
        )
        pool.wait_slot(chunk.slot)  # a save into this slot may still be running
        compute = self._compute
        after = (compute,) if compute is not None else ()
        handle = pool.load(backend, chunk.slot, mapping, chunk.slot_offset, after=after)
        handle.wait(compute)  # the forward pass (compute stream) reads these blocks next
        self.stats["tokens_loaded"] += chunk.token_end - chunk.token_start
        self.stats["chunks_loaded"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are issued for all layers at once in ``start_load_kv``; nothing per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves gather all layers at once in ``wait_for_save``; nothing per layer."""

    def wait_for_save(self) -> None:
        """Issue the bound plan's saves (once: a second call finds none left). With
        ``defer_finalize`` this runs after the step's report was built: the results go in the
        next report."""
        if self.digests is not None and self._digest_plan is not None:
            plan, self._digest_plan = self._digest_plan, None
            failed = self._step_failed_loads | self._failed_before
            self.digests.after_forward(plan, self._step_load_errors, failed)
        saves, self._to_save = self._to_save, ()
        if not saves:
            return
        backend, pool = self._ready()
        block_size = backend.spec.block_size
        after = self._save_after()  # everything the forward and the drafter wrote
        refused: list[tuple[str, tuple[bytes, ...]]] = []
        for save in saves:
            if self._computed_over_missing(save):
                refused.append((save.req_id, tuple(ch.key for ch in save.chunks)))
                continue
            for chunk in save.chunks:
                try:
                    mapping = slot_mapping_for(
                        save.block_ids, block_size, chunk.token_start, chunk.token_end
                    )
                    pool.wait_slot(chunk.slot)  # the slot's previous chunk may still be read
                    handle = pool.save(backend, chunk.slot, mapping, chunk.slot_offset, after=after)
                    self._saves_in_flight.append((save.req_id, chunk.key, handle))
                    if self.remote is not None and chunk.key not in self._read_remote:
                        first = chunk.chunk_start // block_size
                        self._upload_slot[(save.req_id, chunk.key)] = (chunk.slot, first)
                    self._read_remote.pop(chunk.key, None)
                    self.stats["tokens_saved"] += chunk.token_end - chunk.token_start
                    self.stats["chunks_saved"] += 1
                except Exception as exc:
                    _log.warning("kvledger.save_failed", req_id=save.req_id, error=repr(exc))
                    refused.append((save.req_id, (chunk.key,)))
        if refused:
            self._report = self._report.merged(
                WorkerReport(saves_failed=tuple(refused), rank=self.rank)
            )

    def _computed_over_missing(self, save: TransferPlan) -> bool:
        """Whether the step computed this save's KV over blocks never loaded: its own load
        failed in the step; or its table holds a block that failed to load, or that the
        scheduler refused, in the step (vLLM's prefix cache shares a block from its
        allocation on, so a request admitted in the same step as the load computes over it;
        vLLM reschedules every request that holds it), or in the step before (under async
        scheduling this step was scheduled before vLLM heard of it). The request whose own
        load failed the step before is the tracker's: its ``LoadFailed`` cancels the saves
        planned over the failed blocks."""
        if save.req_id in self._step_failed_loads:
            return True
        table = save.block_ids
        if self._step_load_errors and not self._step_load_errors.isdisjoint(table):
            return True
        return (
            bool(self._missing_before)
            and save.req_id not in self._failed_before
            and not self._missing_before.isdisjoint(table)
        )

    def _drain_saves(self, *, block: bool) -> None:
        """Move finished saves into the report; with ``block``, wait for all of them."""
        still: list[tuple[str, bytes, TransferHandle]] = []
        done: dict[str, list[bytes]] = {}
        lost: list[tuple[str, bytes]] = []
        for req_id, key, handle in self._saves_in_flight:
            try:
                if block:
                    handle.synchronize()
                finished = handle.done()
            except Exception as exc:  # the copy's event raised (the device's error)
                lost.append((req_id, key))
                _log.warning("kvledger.save_failed", req_id=req_id, error=repr(exc))
                continue
            if finished:
                done.setdefault(req_id, []).append(key)
                where = self._upload_slot.pop((req_id, key), None)
                if where is not None:
                    self._to_upload.append((req_id, key, *where))
            else:
                still.append((req_id, key, handle))
        self._saves_in_flight = still
        if lost:
            self._saves_lost(lost)
        if done:
            self._report = self._report.merged(
                WorkerReport(
                    saves_done=tuple((r, tuple(k)) for r, k in done.items()), rank=self.rank
                )
            )

    def _saves_lost(self, lost: list[tuple[str, bytes]]) -> None:
        """Saves whose copy failed after it was issued: reported failed (their chunks are never
        stored, so no load reads them), out of the saves in flight and of the uploads."""
        gone = set(lost)
        self._saves_in_flight = [s for s in self._saves_in_flight if s[:2] not in gone]
        for req_key in gone:
            self._upload_slot.pop(req_key, None)
        by_request: dict[str, list[bytes]] = {}
        for req_id, key in lost:
            by_request.setdefault(req_id, []).append(key)
        failed = tuple((r, tuple(keys)) for r, keys in by_request.items())
        self._report = self._report.merged(WorkerReport(saves_failed=failed, rank=self.rank))

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving). A request whose freeing was delayed is
        reported once no save of it is in flight or still to be issued (with
        ``defer_finalize``, vLLM asks before ``wait_for_save``); loads are synchronous, so none
        are pending."""
        self._drain_saves(block=False)
        busy = {req for req, _, _ in self._saves_in_flight}
        busy.update(save.req_id for save in self._to_save)
        ready = {req for req in self._awaiting_free if req not in busy}
        self._awaiting_free -= ready
        return (ready or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _upload(self) -> None:
        """Write the chunks saved locally since the last report to the remote store, from
        their host slots (which no plan reuses before the next step), in one round trip;
        report what the tier confirmed and what it did not."""
        items, self._to_upload = self._to_upload, []
        if not items or self.remote is None or self.pool is None or self.values is None:
            return
        pool, seal, digests = self.pool, self.values, self.digests
        n = self.config.chunk_size // pool.spec.block_size  # a chunk's blocks
        results: list[str | None]
        if not serving(self.remote):
            results = [UNAVAILABLE] * len(items)
        else:
            try:
                values = [
                    (
                        key,
                        seal.seal(
                            key,
                            _bytes_of(pool.slot(slot)),
                            () if digests is None else digests.of_blocks(req_id, first, first + n),
                        ),
                    )
                    for req_id, key, slot, first in items
                ]
                results = list(self.remote.put(values))
                if len(results) != len(items):
                    raise TierUnavailable(f"TierError: {len(results)} results for {len(items)}")
                if not all(why is None or isinstance(why, str) for why in results):
                    raise TierUnavailable(
                        "TierError: put gave a result that is neither None nor a reason"
                    )
            except Exception as exc:  # the tier's boundary: TierUnavailable, or unforeseen
                down = f"{UNAVAILABLE}: {self._remote_error(exc)}"
                _log.warning("kvledger.remote_unavailable", rank=self.rank, error=down)
                results = [down] * len(items)
        # (what, request, why) -> keys: a write the tier refused fails alone.
        outcomes: dict[tuple[str, str, str], list[bytes]] = {}
        for (req_id, key, *_), why in zip(items, results, strict=True):
            what = "saved" if why is None else "save_failed"
            outcomes.setdefault((what, req_id, why or ""), []).append(key)
        self.stats["remote_chunks_saved"] += results.count(None)
        for why in {w for w in results if w is not None and w.startswith(REFUSED)}:
            _log.warning("kvledger.remote_save_failed", rank=self.rank, error=why)
        self._report = self._report.merged(
            WorkerReport(
                rank=self.rank,
                remote=tuple(
                    (what, r, tuple(keys), why) for (what, r, why), keys in outcomes.items()
                ),
            )
        )

    def build_report(self) -> WorkerReport:
        self._drain_saves(block=False)
        self._upload()
        report, self._report = self._report, WorkerReport(rank=self.rank)
        if self.digests is not None:
            digests = self.digests.report()
            if digests is not None:
                report = attrs.evolve(report, digests=digests)
        return report

    def clear(self) -> None:
        self._plan = None

    def shutdown(self) -> None:
        self._issue_late_saves()
        self._drain_saves(block=True)
        self._upload()
        if self.remote is not None:
            self.remote.close()


def _bytes_of(slot: torch.Tensor) -> memoryview:
    """A host slot's bytes, without a copy."""
    return slot.reshape(-1).view(torch.uint8).numpy().data
