"""Move KV bytes between vLLM's paged KV caches and contiguous host chunk slots: the copy engine.

Rule of this module: it knows torch and tensor layouts, nothing else. It never imports vLLM or
`tracker/`; which tokens go to which slot is decided elsewhere and arrives here as flat cache slot
ids (vLLM's ``slot_mapping`` convention: ``block_id * block_size + offset_in_block``). What the
caches and the host slots look like (the layouts, the pool formats, the CPU kernels' element
order) is ``connector.kv_layout``'s; this module turns those facts into copies.

How bytes move: a call's tokens are split into whole cache blocks, back to back (a request's
range is at most a partial block, whole blocks, a partial block), and the loose tokens around
them. Whole blocks move a block at a time: one ``index_select`` (save) or ``index_copy_``
(load) per layer moves every block of the call. Loose tokens: in the ``tokens`` format as rows
of ``num_kv_heads * head_size`` elements, one row per (K or V, token); in a ``cpu_attn``
format, a partial block keeps its place in its block (the worker's ranges start where the
chunk starts, and chunks are whole blocks), so it moves as strided views of those tokens'
elements in the kernel's order (``kv_layout.token_pieces``), a few per layer; only tokens that
change place inside a block (a slot mapping the worker never makes) move element by element.
On CUDA this runs on a side stream through a device staging buffer, so the host side is one
large DMA; on CPU it runs synchronously, straight into or out of the host slot. This is, in
plain PyTorch, the gather-then-one-DMA scheme of LMCache's ``VLLMPagedMemGPUConnectorV2``
(``lmcache/v1/gpu_connector/gpu_connectors.py``), and the side stream ordered after the
compute stream is what vLLM's CPU offloading worker does (``vllm/v1/kv_offload/``);
docs/performance.md has the measurements.

Ordering on CUDA is explicit, against streams the caller names (``after``): a transfer starts
only after the work issued so far on each of them (an event recorded there, waited on by the
side stream), and ``TransferHandle.wait(stream)`` makes a named stream wait for the transfer
(an event recorded on the side stream). ``compute_stream()`` is the stream current on the
calling thread; the worker reads it when vLLM calls it for a step, which is the stream vLLM
runs that step's forward pass on (see ``connector.worker``). Named nothing, a transfer orders
against the current stream. On CPU every transfer is synchronous and there is no stream.
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from kvledger.connector.kv_layout import (
    BLOCK_DIM,
    CPU_ISAS,
    KV_DIM,
    TOKENS,
    KVCacheLayoutError,
    PagedKVSpec,
    cpu_attn_isa,
    cpu_attn_offsets,
    cpu_attn_views,
    describe_kv_caches,
    pool_format,
    slot_mapping_for,
    slot_tokens,
    token_pieces,
)

# TransferBackend and TransferHandle are this module's; the other names are connector.kv_layout's,
# re-exported because users (and the benches, run against older trees too) import them from here,
# where they lived before the layout facts had a module of their own.
__all__ = [
    "CPU_ISAS",
    "TOKENS",
    "KVCacheLayoutError",
    "PagedKVSpec",
    "TransferBackend",
    "TransferHandle",
    "cpu_attn_isa",
    "cpu_attn_offsets",
    "cpu_attn_views",
    "describe_kv_caches",
    "pool_format",
    "slot_mapping_for",
    "slot_tokens",
]


class _Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...


class TransferHandle:
    """One save or load in flight. CPU transfers are finished when their handle is returned."""

    __slots__ = ("_device", "_event", "_keepalive")

    def __init__(
        self,
        event: _Event | None = None,
        device: torch.device | None = None,
        keepalive: tuple[object, ...] = (),
    ) -> None:
        self._event = event
        self._device = device
        # Tensors the transfer reads or writes stay referenced until it is known to be done.
        self._keepalive = keepalive

    def done(self) -> bool:
        """True once the bytes have fully arrived (never blocks)."""
        if self._event is not None and self._event.query():
            self._event = None
            self._keepalive = ()
        return self._event is None

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (the compute stream; default: the current one) wait for the transfer:
        work issued there afterwards sees its bytes. Does not block the host."""
        if self._event is None:
            return
        if self._device is not None and self._device.type == "cuda":
            self._event.wait(
                stream if stream is not None else torch.cuda.current_stream(self._device)
            )
        else:  # not a CUDA transfer: the event orders itself
            self._event.wait()

    def synchronize(self) -> None:
        """Block the host until the transfer has finished."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._keepalive = ()

    def __repr__(self) -> str:
        return f"TransferHandle(done={self.done()})"


# An empty index (a plan part with no tokens).
_NONE = torch.zeros(0, dtype=torch.int64)

# Widest element types we reinterpret rows as: CPU index_copy_ copies element by element, so 16-byte
# elements make a bf16 load about 2x faster (measured on this repo's CPU box); bits are unchanged.
_WIDE_DTYPES = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def _wide_dtype(*byte_counts: int) -> torch.dtype:
    """The widest of ``_WIDE_DTYPES`` whose size divides every one of ``byte_counts``."""
    g = math.gcd(*byte_counts)
    return next(dtype for size, dtype in _WIDE_DTYPES if g % size == 0)


def _whole_blocks(slots: list[int], block_size: int) -> tuple[int, int]:
    """``(first, count)``: positions ``[first, first + count * block_size)`` of ``slots`` are
    ``count`` whole cache blocks back to back, each block's slots in order; ``(0, 0)`` when the
    slots hold no whole block. The worker's calls (``slot_mapping_for`` over a token range)
    are at most a partial block, whole blocks, a partial block, and pass the first test, on
    the list itself (a few list comparisons: small tensor operations cost more, each one,
    than a block's copy takes); any other mapping is scanned, vectorised, for its first run of
    whole blocks."""
    n, bs = len(slots), block_size
    if n < bs:
        return 0, 0
    first = -slots[0] % bs
    count = (n - first) // bs
    end = first + count * bs
    if count and all(
        slots[a] % bs == 0 and slots[a : a + bs] == list(range(slots[a], slots[a] + bs))
        for a in range(first, end, bs)
    ):
        return first, count
    # A whole block at i: slots[i] starts a block and the next block_size - 1 follow it.
    ids = torch.tensor(slots, dtype=torch.int64)
    breaks = torch.ones(n, dtype=torch.int64)
    breaks[1:] = (ids[1:] - ids[:-1]) != 1
    run_id = breaks.cumsum(0)
    m = n - bs + 1
    starts = torch.nonzero((ids[:m] % bs == 0) & (run_id[bs - 1 :] == run_id[:m])).view(-1)
    if starts.numel() == 0:
        return 0, 0
    # Two whole blocks never overlap; keep those back to back with the first.
    first = int(starts[0])
    back_to_back = starts == first + bs * torch.arange(starts.numel())
    return first, int(back_to_back.cumprod(0).sum())


class _Plan(NamedTuple):
    """How the ``n`` tokens of one call move: positions ``[first, first + blocks * block_size)``
    of the call are whole blocks, moved a block at a time; the positions before (``head``) and
    after (``tail``) token by token. ``span``, ``head`` and ``tail`` are what the layout's moves
    index with (see ``TransferBackend._plan``)."""

    n: int
    first: int
    blocks: int
    span: torch.Tensor
    head: torch.Tensor
    tail: torch.Tensor

    def to(self, device: torch.device) -> _Plan:
        """The same plan with its indices on ``device``, in one host-to-device copy."""
        parts = (self.span, self.head, self.tail)
        flat = torch.cat([p.reshape(-1) for p in parts]).to(device, non_blocking=True)
        out, start = [], 0
        for p in parts:
            out.append(flat.narrow(0, start, p.numel()).view(p.shape))
            start += p.numel()
        return self._replace(span=out[0], head=out[1], tail=out[2])


class TransferBackend:
    """Gather tokens of the paged caches into host chunk slots (save) and scatter them back (load)."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        chunk_tokens: int,
        layout: str | None = None,
        *,
        cpu_isa: str | None = None,
    ) -> None:
        self.spec = describe_kv_caches(kv_caches, layout, cpu_isa=cpu_isa)
        self.chunk_tokens = chunk_tokens
        self.chunk_shape = self.spec.chunk_shape(chunk_tokens)
        self.slot_bytes = self.spec.chunk_bytes(chunk_tokens)
        self._caches = list(kv_caches.values())
        spec = self.spec
        self._row = spec.num_kv_heads * spec.head_size
        self._esize = spec.element_size
        self._cpu_offsets: tuple[torch.Tensor, torch.Tensor] | None = None
        self._row_strides: tuple[int, int, int] | None = None
        # Whole-block moves of a 5-D layout: strides of its block rows (one block's K or V,
        # contiguous); None where a block's tokens are not consecutive rows.
        self._block_strides: tuple[int, int] | None = None
        self._native = spec.layout == "cpu_attn"
        if self._native:
            assert spec.cpu_isa is not None
            # Loose tokens that change place inside a block move element by element.
            self._cpu_offsets = cpu_attn_offsets(spec.cpu_isa, spec.block_size, spec.head_size)
            # One block of one layer, as the kernel orders it: H regions of K then V. Each
            # layer's cache as rows of such images, and the same images read as wider element
            # types (``_images_as``), which a load's element-wise index_copy_ needs.
            self._image = spec.num_kv_heads * 2 * spec.block_size * spec.head_size
            self._images = [c.view(spec.num_blocks, self._image) for c in self._caches]
            self._image_align = math.gcd(
                self._image * self._esize, *(c.storage_offset() * self._esize for c in self._caches)
            )
            self._wide_images: dict[torch.dtype, list[torch.Tensor]] = {}
        else:
            self._row_strides = self._find_row_strides()
            self._block_strides = self._find_block_strides()
            # Block rows are reinterpreted as a wider dtype too (see _cache_align).
            self._block_align = math.gcd(
                spec.block_size * self._row * self._esize,
                *(c.storage_offset() * self._esize for c in self._caches),
            )
        # Row views are reinterpreted as a wider dtype; it must divide the row size and where
        # every layer starts in its storage.
        self._cache_align = math.gcd(
            self._row * self._esize, *(c.storage_offset() * self._esize for c in self._caches)
        )
        self._rows: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
        self._is_cuda = spec.device.type == "cuda"
        if self._is_cuda:
            # One side stream for saves and loads alike: transfers then run in issue order, so a
            # load can never overtake a save of the same blocks or slot (vLLM's offloading worker
            # chains its jobs the same way). The staging buffer is only touched on this stream.
            # torch.cuda.Stream and torch.cuda.Event are untyped in torch's own annotations.
            self._stream = torch.cuda.Stream(device=spec.device)  # type: ignore[no-untyped-call]
            self._staging = torch.empty(self.chunk_shape, dtype=spec.dtype, device=spec.device)

    # -- public API ---------------------------------------------------------------------------

    def compute_stream(self) -> Any:
        """The CUDA stream current on the calling thread (where the caller's compute is
        issued now); None on CPU, where transfers are synchronous."""
        if not self._is_cuda:
            return None
        return torch.cuda.current_stream(self.spec.device)

    def save(
        self,
        dst_slot: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[int],
        dst_offset: int = 0,
        *,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        """Copy K and V of every layer at ``slot_mapping`` into ``dst_slot[:, :, dst_offset:+n]``.

        On CUDA the copy reads the caches only after the work issued so far on each stream in
        ``after`` (the forward pass that wrote these tokens; default: the current stream)."""
        slots = self._check(dst_slot, slot_mapping, dst_offset, "dst_slot", "dst_offset")
        return self._transfer(dst_slot, slots, dst_offset, save=True, after=after)

    def load(
        self,
        src_slot: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[int],
        src_offset: int = 0,
        *,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        """Copy ``src_slot[:, :, src_offset:+n]`` into every layer's cache at ``slot_mapping``.

        On CUDA the copy writes the caches only after the work issued so far on each stream in
        ``after`` (compute that may still read the blocks' previous contents; default: the
        current stream). The forward pass must then wait for it: ``handle.wait(stream)``."""
        slots = self._check(src_slot, slot_mapping, src_offset, "src_slot", "src_offset")
        if len(set(slots)) != len(slots):
            raise ValueError("slot_mapping of a load names the same cache slot twice")
        return self._transfer(src_slot, slots, src_offset, save=False, after=after)

    def _transfer(
        self,
        host: torch.Tensor,
        slots: list[int],
        offset: int,
        *,
        save: bool,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        n = len(slots)
        if n == 0:
            return TransferHandle()
        if self._native:  # a cpu_attn layout: on the CPU, synchronous
            self._move_native(host, offset, slots, save=save)
            return TransferHandle()
        plan = self._plan(slots)
        if not self._is_cuda:
            self._move(host, offset, plan, save=save)
            return TransferHandle()

        stream = self._stream
        # Save: the forward pass that wrote these tokens was issued on the compute stream.
        # Load: compute issued earlier may still use these blocks (their previous owner).
        # Either way the side stream waits for an event recorded on each stream named.
        for compute in after or (torch.cuda.current_stream(self.spec.device),):
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(compute)
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            # Allocated on the side stream, so the caching allocator recycles it in its order.
            plan_dev = plan.to(self.spec.device)
            staging = self._staging_for(n)
            if not save:
                self._copy_region(host, staging, offset, n, to_host=False)
            # On the device the gather or scatter runs at device-memory speed into or out of
            # the staging buffer; the host side is the DMA of _copy_region.
            self._move(staging, 0, plan_dev, save=save)
            if save:
                self._copy_region(host, staging, offset, n, to_host=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return TransferHandle(event, self.spec.device, (host, plan_dev))

    # -- validation ---------------------------------------------------------------------------

    def _check(
        self,
        slot: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[int],
        offset: int,
        slot_name: str,
        offset_name: str,
    ) -> list[int]:
        """Validate a call; return the slot ids as a list of ints (planning a call is a few
        list operations: each small tensor operation costs microseconds, more on the caches
        a forward pass left cold)."""
        if not isinstance(slot, torch.Tensor):
            raise TypeError(f"{slot_name} must be a torch.Tensor, got {type(slot).__name__}")
        if tuple(slot.shape) != self.chunk_shape:
            raise ValueError(
                f"{slot_name} has shape {tuple(slot.shape)}, expected chunk shape {self.chunk_shape}"
            )
        if slot.dtype != self.spec.dtype:
            raise ValueError(
                f"{slot_name} has dtype {slot.dtype}, but the caches are {self.spec.dtype}"
            )
        if slot.device.type != "cpu" or not slot.is_contiguous():
            raise ValueError(
                f"{slot_name} must be a contiguous CPU tensor "
                f"(device {slot.device}, contiguous={slot.is_contiguous()})"
            )
        if self._is_cuda and not slot.is_pinned():
            # A non_blocking copy with pageable memory silently becomes synchronous.
            raise ValueError(f"{slot_name} must be pinned host memory when the caches are on CUDA")

        if isinstance(slot_mapping, torch.Tensor):
            if slot_mapping.dtype.is_floating_point or slot_mapping.dtype in (
                torch.bool,
                torch.complex64,
                torch.complex128,
            ):
                raise TypeError(f"slot_mapping must hold integers, got {slot_mapping.dtype}")
            # A device tensor costs a sync here; the worker should pass host lists or tensors.
            slots = slot_mapping.detach().to("cpu", torch.int64).reshape(-1).tolist()
        else:
            try:  # array checks, in C, that every id is an integer of 64 bits
                slots = array.array("q", slot_mapping).tolist()
            except TypeError as exc:
                raise TypeError(f"slot_mapping must hold integers: {exc}") from None
        n = len(slots)
        if offset < 0 or offset + n > self.chunk_tokens:
            raise ValueError(
                f"{n} tokens at {offset_name}={offset} do not fit a chunk of "
                f"{self.chunk_tokens} tokens"
            )
        if n:
            lo, hi = min(slots), max(slots)
            limit = self.spec.num_cache_slots
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"slot id {bad} out of range [0, {limit}) "
                    f"({self.spec.num_blocks} blocks of {self.spec.block_size} tokens)"
                )
        return slots

    # -- row addressing -----------------------------------------------------------------------

    def _find_row_strides(self) -> tuple[int, int, int] | None:
        """Strides, in rows of ``H*D`` elements, of the (K/V, block, offset) dims; None unless
        every layer keeps a token's heads as one contiguous row with the same strides (an HND
        stride order, for one, does not, and takes the slower advanced-indexing path)."""
        spec = self.spec
        dims = (KV_DIM[spec.layout], BLOCK_DIM[spec.layout], 2)
        found: tuple[int, int, int] | None = None
        for cache in self._caches:
            st = cache.stride()
            heads_ok = spec.num_kv_heads == 1 or st[3] == spec.head_size
            dim_ok = spec.head_size == 1 or st[4] == 1
            if not (heads_ok and dim_ok):
                return None
            # A dim of size 1 is never stepped along, whatever stride it claims.
            rs = [st[d] // self._row if cache.shape[d] > 1 else 0 for d in dims]
            if any(cache.shape[d] > 1 and (st[d] <= 0 or st[d] % self._row) for d in dims):
                return None
            strides = (rs[0], rs[1], rs[2])
            if found is not None and strides != found:
                return None
            found = strides
        return found

    def _find_block_strides(self) -> tuple[int, int] | None:
        """Strides, in block rows of ``block_size * H*D`` elements, of the (K/V, block) dims;
        None unless a block's tokens are consecutive token rows, so that one block's K (or V)
        is one contiguous block row and whole blocks move as rows tens of KiB long."""
        if self._row_strides is None:
            return None
        s_kv, s_blk, s_off = self._row_strides
        bs = self.spec.block_size
        if (bs > 1 and s_off != 1) or s_kv % bs or s_blk % bs:
            return None
        return s_kv // bs, s_blk // bs

    def _plan(self, slots: list[int]) -> _Plan:
        """Split a call into whole blocks and loose tokens (``_whole_blocks``), with what each
        part indexes with, the same for every layer of a 5-D layout: ``span`` holds the block
        rows of K then V (``[2 * blocks]``), ``head`` and ``tail`` the token rows of K then V
        (``[2 * tokens]``); on the advanced-indexing path (no token rows) every token is in
        ``tail``, as slot ids."""
        n = len(slots)
        if self._row_strides is None:
            return _Plan(n, 0, 0, _NONE, _NONE, torch.tensor(slots, dtype=torch.int64))
        bs = self.spec.block_size
        first, blocks = _whole_blocks(slots, bs) if self._block_strides is not None else (0, 0)
        end = first + blocks * bs
        span = _NONE
        if blocks:
            assert self._block_strides is not None
            b_kv, b_blk = self._block_strides
            rows = [s // bs * b_blk for s in slots[first:end:bs]]
            span = torch.tensor(rows + [r + b_kv for r in rows], dtype=torch.int64)
        return _Plan(
            n, first, blocks, span, self._token_rows(slots[:first]), self._token_rows(slots[end:])
        )

    def _token_rows(self, slots: list[int]) -> torch.Tensor:
        """Token rows of K then V (``[2 * n]``) of the tokens at ``slots``."""
        assert self._row_strides is not None
        if not slots:
            return _NONE
        s_kv, s_blk, s_off = self._row_strides
        bs = self.spec.block_size
        ids = torch.tensor(slots, dtype=torch.int64)
        base = (ids // bs) * s_blk + (ids % bs) * s_off
        return torch.cat([base, base + s_kv])

    def _cpu_elements(self, slots: torch.Tensor) -> torch.Tensor:
        """``cpu_attn``: flat element ids ``[2, n * H * D]`` of K and of V of the tokens at
        ``slots``, each in (token, head, dim) order, in a layer's cache; and, ``slots`` taken
        as chunk positions, in a layer of a host slot, whose blocks are laid out the same."""
        assert self._cpu_offsets is not None
        if slots.numel() == 0:
            return slots.view(2, 0)
        spec = self.spec
        k_off, v_off = self._cpu_offsets
        bs, heads, d = spec.block_size, spec.num_kv_heads, spec.head_size
        blk, pos = slots // bs, slots % bs
        # [n, H, 1]: where each token's (block, head) region starts.
        start = (blk.view(-1, 1) * heads + torch.arange(heads).view(1, -1)) * (2 * bs * d)
        start = start.unsqueeze(-1)
        k = (start + k_off[pos].unsqueeze(1)).reshape(-1)
        v = (start + v_off[pos].unsqueeze(1)).reshape(-1)
        return torch.stack([k, v])

    def _rows_as(self, dtype: torch.dtype, *, blocks: bool = False) -> list[torch.Tensor]:
        """Each layer of a 5-D layout as a 2-D view, reinterpreted as ``dtype``: of token rows
        ``[rows, H*D]`` or, with ``blocks``, of block rows ``[rows, block_size * H*D]``."""
        key = (blocks, dtype)
        views = self._rows.get(key)
        if views is None:
            spec = self.spec
            assert self._row_strides is not None
            s_kv, s_blk, s_off = self._row_strides
            width, n_rows = self._row, 1 + s_kv + (spec.num_blocks - 1) * s_blk
            if blocks:
                assert self._block_strides is not None
                b_kv, b_blk = self._block_strides
                width *= spec.block_size
                n_rows = 1 + b_kv + (spec.num_blocks - 1) * b_blk
            else:
                n_rows += (spec.block_size - 1) * s_off
            views = [
                torch.as_strided(c, (n_rows, width), (width, 1), c.storage_offset()).view(dtype)
                for c in self._caches
            ]
            self._rows[key] = views
        return views

    # -- gather / scatter -----------------------------------------------------------------------

    def _move(self, chunk: torch.Tensor, offset: int, plan: _Plan, *, save: bool) -> None:
        """Save: ``chunk[:, :, offset:offset+n]`` <- the caches as ``plan`` says; load: the
        reverse. ``chunk`` is ``[L, 2, T, H*D]`` and contiguous (a host slot, or the staging
        buffer). Whole blocks move a block at a time, loose tokens a token at a time."""
        bs = self.spec.block_size
        end = plan.first + plan.blocks * bs
        if self._row_strides is None:
            region = chunk.narrow(2, offset, plan.n)
            for layer in range(self.spec.num_layers):
                self._move_indexed(layer, plan.tail, region[layer], save=save)
            return
        parts = (
            (plan.first, plan.first, plan.head, False),
            (plan.blocks * bs, plan.blocks, plan.span, True),
            (plan.n - end, plan.n - end, plan.tail, False),
        )
        start = offset
        for tokens, rows, index, blocks in parts:
            if tokens:
                self._move_rows(chunk, start, tokens, rows, index, blocks=blocks, save=save)
            start += tokens

    def _move_rows(
        self,
        chunk: torch.Tensor,
        start: int,
        tokens: int,
        rows: int,
        index: torch.Tensor,
        *,
        blocks: bool,
        save: bool,
    ) -> None:
        """Move ``tokens`` tokens at ``chunk[:, :, start:]`` as ``rows`` token rows, or block
        rows with ``blocks``, of each of K and V (``index``: K's rows then V's): one
        ``index_select`` or ``index_copy_`` per layer and K/V half, or per layer when the call
        is the whole chunk (a layer's K rows and V rows are then adjacent in the slot). Views
        are made in bulk (``unbind``): per-layer Python indexing costs more than a short copy."""
        num_layers, width = self.spec.num_layers, self._row
        align = math.gcd(self._block_align if blocks else self._cache_align, width * self._esize)
        if start == 0 and tokens == chunk.shape[2]:
            wide = _wide_dtype(align, int(chunk.storage_offset()) * self._esize)
            pieces = chunk.view(wide).view(num_layers, 2 * rows, -1).unbind(0)
            views = self._rows_as(wide, blocks=blocks)
            indices = [index] * num_layers
        else:
            host = chunk.view(2 * num_layers, chunk.shape[2], width).narrow(1, start, tokens)
            wide = _wide_dtype(align, int(host.storage_offset()) * self._esize)
            pieces = host.view(wide).view(2 * num_layers, rows, -1).unbind(0)
            views = [v for v in self._rows_as(wide, blocks=blocks) for _ in range(2)]
            indices = [index[:rows], index[rows:]] * num_layers
        if save:
            for src, idx, out in zip(views, indices, pieces, strict=True):
                torch.index_select(src, 0, idx, out=out)
        else:
            for dst, idx, src in zip(views, indices, pieces, strict=True):
                dst.index_copy_(0, idx, src)

    def _move_native(
        self, chunk: torch.Tensor, offset: int, slots: list[int], *, save: bool
    ) -> None:
        """``cpu_attn``, in its native pool format: save, chunk positions ``[offset, offset +
        n)`` <- the tokens at ``slots``; load, the reverse. Whole cache blocks that land on
        whole chunk blocks move as block images (``_move_native_blocks``); the tokens around
        them, a partial block at either end, as views of their elements
        (``_move_native_loose``). A worker's call is always aligned so: its range starts as
        far into its chunk as into its block, since chunks are whole blocks."""
        bs = self.spec.block_size
        first, count = _whole_blocks(slots, bs)
        if (offset + first) % bs:
            first, count = 0, 0  # cache blocks across two chunk blocks: token by token
        end = first + count * bs
        if count:
            ids = torch.tensor([s // bs for s in slots[first:end:bs]], dtype=torch.int64)
            self._move_native_blocks(chunk, (offset + first) // bs, ids, save=save)
        for lo, hi in ((0, first), (end, len(slots))):
            if hi > lo:
                self._move_native_loose(chunk, offset + lo, slots[lo:hi], save=save)

    def _move_native_blocks(
        self, chunk: torch.Tensor, first: int, ids: torch.Tensor, *, save: bool
    ) -> None:
        """Cache blocks ``ids`` <-> chunk blocks ``first, first + 1, ...``: each a contiguous
        image on both sides, so one ``index_select`` (save) or ``index_copy_`` (load) per
        layer. ``index_select`` copies a row at a time; ``index_copy_`` element by element,
        so a load reads the images as the widest element type they allow."""
        layers, count = self.spec.num_layers, ids.numel()
        rows = chunk.view(layers, -1, self._image)
        if save:
            for src, out in zip(self._images, rows.narrow(1, first, count).unbind(0), strict=True):
                torch.index_select(src, 0, ids, out=out)
            return
        wide = _wide_dtype(self._image_align, int(chunk.storage_offset()) * self._esize)
        srcs = rows.view(wide).narrow(1, first, count).unbind(0)
        for dst, src in zip(self._images_as(wide), srcs, strict=True):
            dst.index_copy_(0, ids, src)

    def _images_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every layer's block images (``[num_blocks, image]``) read as ``dtype``."""
        views = self._wide_images.get(dtype)
        if views is None:
            views = [v.view(dtype) for v in self._images]
            self._wide_images[dtype] = views
        return views

    def _move_native_loose(
        self, chunk: torch.Tensor, pos: int, slots: list[int], *, save: bool
    ) -> None:
        """Tokens at ``slots`` <-> chunk positions from ``pos`` on, not whole blocks. A run of
        one block's tokens that keeps its place in the block (a partial block of a worker's
        call) moves as views of those tokens' elements (``_move_native_run``); anything else
        element by element."""
        bs, n = self.spec.block_size, len(slots)
        first = slots[0]
        t0 = first % bs
        if t0 == pos % bs and t0 + n <= bs and slots == list(range(first, first + n)):
            self._move_native_run(chunk, pos // bs, first // bs, t0, t0 + n, save=save)
        else:
            ids = torch.tensor(slots, dtype=torch.int64)
            self._move_native_elements(chunk, pos, ids, save=save)

    def _move_native_run(
        self, chunk: torch.Tensor, chunk_block: int, block: int, t0: int, t1: int, *, save: bool
    ) -> None:
        """Tokens ``[t0, t1)`` of cache block ``block`` <-> the same tokens of chunk block
        ``chunk_block``, and no other element: K and V of those tokens in the kernel's order
        are a few strided rectangles of a block's image (``token_pieces``), at the same
        places in both images. Each is found once, over every layer of the chunk, and taken at
        the same offset in each layer's cache block (``as_strided``); then one ``copy_`` per
        layer and rectangle."""
        spec = self.spec
        images = chunk.select(1, chunk_block).view(spec.num_layers, spec.num_kv_heads, -1)
        assert spec.cpu_isa is not None
        views = cpu_attn_views(images, spec.cpu_isa, spec.block_size, spec.head_size)
        pieces = [p for v in views for p in token_pieces(v, 2, spec.cpu_isa, t0, t1)]
        base = images.storage_offset()
        for piece in pieces:
            shape, strides = piece.shape[1:], piece.stride()[1:]
            where = block * self._image + int(piece.storage_offset()) - base
            for host, cache in zip(piece.unbind(0), self._caches, strict=True):
                kv = cache.as_strided(shape, strides, cache.storage_offset() + where)
                if save:
                    host.copy_(kv)
                else:
                    kv.copy_(host)

    def _move_native_elements(
        self, chunk: torch.Tensor, pos: int, slots: torch.Tensor, *, save: bool
    ) -> None:
        """Tokens at ``slots`` <-> chunk positions ``pos...``, each element by its own flat
        index on both sides (``_cpu_elements``): one gather and one scatter per layer."""
        cache_ids = self._cpu_elements(slots).view(-1)
        chunk_ids = self._cpu_elements(pos + torch.arange(slots.numel())).view(-1)
        host = chunk.view(self.spec.num_layers, -1).unbind(0)
        for flat, cache in zip(host, self._caches, strict=True):
            if save:
                flat.index_copy_(0, chunk_ids, cache.view(-1).index_select(0, cache_ids))
            else:
                cache.view(-1).index_copy_(0, cache_ids, flat.index_select(0, chunk_ids))

    def _move_indexed(
        self, layer: int, slots: torch.Tensor, piece: torch.Tensor, *, save: bool
    ) -> None:
        """The advanced-indexing path, for caches whose tokens are not rows: ``piece`` is
        ``[2, n, H*D]`` and each K/V half is contiguous."""
        n = piece.shape[1]
        blk, off = slots // self.spec.block_size, slots % self.spec.block_size
        for kv, view in enumerate(self._kv_views(layer)):
            tokens = piece[kv].view(n, *view.shape[2:])
            if save:
                tokens.copy_(view[blk, off])
            else:
                view[blk, off] = tokens

    def _kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks, block_size, H, D]`` views (any strides)."""
        cache = self._caches[layer]
        kv_dim = KV_DIM[self.spec.layout]
        return cache.select(kv_dim, 0), cache.select(kv_dim, 1)

    # -- CUDA staging -------------------------------------------------------------------------

    def _staging_for(self, n: int) -> torch.Tensor:
        """A contiguous ``[L, 2, n, H*D]`` prefix of the staging buffer."""
        numel = self.spec.num_layers * 2 * n * self._row
        return self._staging.view(-1)[:numel].view(self.spec.num_layers, 2, n, self._row)

    def _copy_region(
        self, host: torch.Tensor, staging: torch.Tensor, offset: int, n: int, *, to_host: bool
    ) -> None:
        """Copy ``staging`` <-> ``host[:, :, offset:offset+n]`` with DMAs of contiguous pieces."""
        if offset == 0 and n == self.chunk_tokens:
            pairs = [(host, staging)]  # the whole chunk: one DMA
        else:
            # A strided cross-device copy_ would go through a pageable temporary and block, so
            # a partial range moves as one DMA per layer and K/V half instead.
            pieces = 2 * self.spec.num_layers
            host_pieces = host.view(pieces, self.chunk_tokens, -1).narrow(1, offset, n).unbind(0)
            pairs = list(zip(host_pieces, staging.view(pieces, n, -1).unbind(0), strict=True))
        for h, d in pairs:
            if to_host:
                h.copy_(d, non_blocking=True)
            else:
                d.copy_(h, non_blocking=True)
