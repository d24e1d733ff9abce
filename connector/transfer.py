"""Move KV bytes between vLLM's paged KV caches and contiguous host chunk slots.

Rule of this module: it knows torch and tensor layouts, nothing else. It never imports vLLM or
`tracker/`; which tokens go to which slot is decided elsewhere and arrives here as flat cache slot
ids (vLLM's ``slot_mapping`` convention: ``block_id * block_size + offset_in_block``).

A host chunk slot is one contiguous tensor ``[num_layers, 2, chunk_tokens, num_kv_heads *
head_size]``: per layer K then V, token-major inside, so a whole chunk is one DMA.

How bytes move: each layer is viewed as rows of ``num_kv_heads * head_size`` elements, one row
per (K or V, token), and one ``index_select`` (save) or ``index_copy_`` (load) per layer moves
every token of the call at once. On CUDA this runs on a side stream through a device staging
buffer, so the host side is one large DMA; on CPU it runs synchronously, straight into or out of
the host slot. vLLM's CPU attention backend keeps each layer as ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` with K and V of a (block, head) in an order of its own kernels
(``cpu_attn``, below): there every element is moved by its own flat index. This is, in plain PyTorch, the gather-then-one-DMA scheme of LMCache's
``VLLMPagedMemGPUConnectorV2`` (``lmcache/v1/gpu_connector/gpu_connectors.py``), and the side
stream ordered after the compute stream is what vLLM's CPU offloading worker does
(``vllm/v1/kv_offload/``); docs/performance.md has the measurements.

Ordering on CUDA is explicit, against streams the caller names (``after``): a transfer starts
only after the work issued so far on each of them (an event recorded there, waited on by the
side stream), and ``TransferHandle.wait(stream)`` makes a named stream wait for the transfer
(an event recorded on the side stream). ``compute_stream()`` is the stream current on the
calling thread; the worker reads it when vLLM calls it for a step, which is the stream vLLM
runs that step's forward pass on (see ``connector.worker``). Named nothing, a transfer orders
against the current stream. On CPU every transfer is synchronous and there is no stream.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

__all__ = [
    "CPU_ISAS",
    "KVCacheLayoutError",
    "PagedKVSpec",
    "TransferBackend",
    "TransferHandle",
    "cpu_attn_isa",
    "cpu_attn_offsets",
    "describe_kv_caches",
    "slot_mapping_for",
]

Layout = Literal["flash_attn", "flashinfer", "cpu_attn"]
LAYOUTS: tuple[Layout, ...] = ("flash_attn", "flashinfer", "cpu_attn")
_ACCEPTED = (
    "flash_attn [2, num_blocks, block_size, num_kv_heads, head_size] or "
    "flashinfer [num_blocks, 2, block_size, num_kv_heads, head_size] or, on CPU, "
    "cpu_attn [num_blocks, num_kv_heads, block_size, 2 * head_size]"
)
# Position of the K/V dim and of the block dim in each 5-D layout; dims 2..4 are always
# (block_size, num_kv_heads, head_size).
_KV_DIM = {"flash_attn": 0, "flashinfer": 1}
_BLOCK_DIM = {"flash_attn": 1, "flashinfer": 0}


class KVCacheLayoutError(ValueError):
    """The KV caches handed to us are not a layout this module can move."""


@dataclass(frozen=True)
class PagedKVSpec:
    """Shape of vLLM's per-layer paged KV caches, as seen by the transfer backend."""

    layout: Layout
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    layer_names: tuple[str, ...] = ()
    # cpu_attn only: which of vLLM's CPU kernels wrote the cache ("vec" or "amx"), which fixes
    # the order of K and V inside a (block, head); see cpu_attn_offsets.
    cpu_isa: str | None = None

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_cache_slots(self) -> int:
        """Number of token slots in each layer's cache (valid slot ids are below this)."""
        return self.num_blocks * self.block_size

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V over all layers for one token."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.element_size

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, int, int, int]:
        """Shape of one host chunk slot holding ``chunk_tokens`` tokens."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        return (self.num_layers, 2, chunk_tokens, self.num_kv_heads * self.head_size)

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return math.prod(self.chunk_shape(chunk_tokens)) * self.element_size


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], layout: str | None = None
) -> PagedKVSpec:
    """Check that ``kv_caches`` (layer name -> cache, in layer order) share one paged layout.

    Both vLLM layouts are 5-D; when ``layout`` is None it is inferred from which of the first two
    dims has size 2, and a cache where both do (``num_blocks == 2``) must name its layout.
    """
    if layout is not None and layout not in LAYOUTS:
        raise KVCacheLayoutError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if not kv_caches:
        raise KVCacheLayoutError(f"no KV cache layers given; expected per-layer {_ACCEPTED}")
    items = list(kv_caches.items())
    first_name, first = items[0]
    # The CPU backend's caches are 4-D; every other layout we move is 5-D.
    cpu = layout == "cpu_attn" or (layout is None and first.dim() == 4)
    for name, cache in items:
        if not isinstance(cache, torch.Tensor):
            raise KVCacheLayoutError(
                f"layer {name!r}: expected a torch.Tensor, got {type(cache).__name__}"
            )
        if cache.dim() != (4 if cpu else 5):
            raise KVCacheLayoutError(
                f"layer {name!r}: got shape {tuple(cache.shape)}, expected {_ACCEPTED}"
            )
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise KVCacheLayoutError(
                f"layer {name!r}: got shape {tuple(cache.shape)} {cache.dtype}, but layer "
                f"{first_name!r} has {tuple(first.shape)} {first.dtype}; all layers must match"
            )
        if cache.device != first.device:
            raise KVCacheLayoutError(
                f"layer {name!r} is on {cache.device}, but layer {first_name!r} is on "
                f"{first.device}; all layers must be on one device"
            )

    shape = tuple(first.shape)
    if cpu:
        return _describe_cpu_attn(items, shape, first)
    resolved: Layout
    if layout is None:
        if shape[0] == 2 and shape[1] != 2:
            resolved = "flash_attn"
        elif shape[1] == 2 and shape[0] != 2:
            resolved = "flashinfer"
        elif shape[0] == 2 and shape[1] == 2:
            raise KVCacheLayoutError(
                f"layer {first_name!r}: shape {shape} fits both {_ACCEPTED}; "
                "pass layout='flash_attn' or layout='flashinfer' explicitly"
            )
        else:
            raise KVCacheLayoutError(
                f"layer {first_name!r}: got shape {shape}, expected {_ACCEPTED} "
                "(a K/V dim of size 2 first or second)"
            )
    else:
        resolved = layout  # narrowed to a Layout by the checks above
        if shape[_KV_DIM[resolved]] != 2:
            raise KVCacheLayoutError(
                f"layer {first_name!r}: got shape {shape}, which is not layout {resolved!r}; "
                f"expected {_ACCEPTED}"
            )
    return PagedKVSpec(
        layout=resolved,
        num_layers=len(items),
        num_blocks=shape[_BLOCK_DIM[resolved]],
        block_size=shape[2],
        num_kv_heads=shape[3],
        head_size=shape[4],
        dtype=first.dtype,
        device=first.device,
        layer_names=tuple(name for name, _ in items),
    )


def cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU attention kernel vLLM picks for these caches, as vLLM 0.32's
    ``vllm/v1/attention/backends/cpu_attn.py`` (``_get_attn_isa``) picks it on x86: ``amx``
    for bfloat16 where the CPU has AMX tiles, ``vec16`` for head sizes that are a multiple of
    16 but not of 32, else ``vec``; other CPUs (ARM ``neon``, POWER, s390x, RISC-V) have kernels
    of their own, named by the architecture."""
    machine = platform.machine().lower()
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return f"cpu-{machine}"
    if dtype == torch.bfloat16 and block_size % 32 == 0 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


# The kernels whose order inside a (block, head) we know (cpu_attn_offsets).
CPU_ISAS = ("vec", "amx")


def cpu_attn_offsets(
    isa: str, block_size: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where K[t, d] and V[t, d] of token ``t`` (in its block) and dim ``d`` sit inside one
    (block, head) of a ``cpu_attn`` cache: two int64 ``[block_size, head_size]`` tensors of
    element offsets from the start of that (block, head), whose ``2 * block_size * head_size``
    elements hold all of K, then all of V (vLLM views it as ``[2 * block_size, head_size]``
    and splits it in two).

    The order is the one each kernel's ``reshape_and_cache`` writes and its attention reads
    (vLLM 0.32, ``csrc/cpu/cpu_attn_vec.hpp`` and ``cpu_attn_amx.hpp``); the engine tests
    check both against ``torch.ops._C.cpu_attn_reshape_and_cache`` itself:

    - ``vec``: K is dim-major, ``[head_size, block_size]`` (a query's dot products with a
      block's keys read one dim of every key at once); V is token-major ``[block_size,
      head_size]``.
    - ``amx`` (bfloat16 tiles of 16 x 32 bytes, pairs of elements packed VNNI-style): K is
      ``[block_size/16, head_size/16, 8, 16, 2]`` over (t//16, d//16, (d%16)//2, t%16, d%2);
      V is ``[head_size/16, block_size/2, 16, 2]`` over (d//16, t//2, d%16, t%2).
    """
    t = torch.arange(block_size, dtype=torch.int64).view(-1, 1)
    d = torch.arange(head_size, dtype=torch.int64).view(1, -1)
    region = block_size * head_size
    if isa == "vec":
        k = d * block_size + t
        v = t * head_size + d
    elif isa == "amx":
        if block_size % 16 or head_size % 16:
            raise KVCacheLayoutError(
                f"cpu_attn amx: block_size {block_size} and head_size {head_size} must be "
                "multiples of 16"
            )
        k = (t // 16) * (16 * head_size) + (d // 16) * 256 + ((d % 16) // 2) * 32
        k = k + (t % 16) * 2 + d % 2
        v = (d // 16) * (16 * block_size) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        raise KVCacheLayoutError(f"no known cpu_attn element order for kernel {isa!r}")
    return k.expand(block_size, head_size).contiguous(), (v + region).expand(
        block_size, head_size
    ).contiguous()


def _describe_cpu_attn(
    items: list[tuple[str, torch.Tensor]], shape: tuple[int, ...], first: torch.Tensor
) -> PagedKVSpec:
    """vLLM's CPU attention layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
    contiguous, on the CPU, written by a kernel whose element order we know."""
    name = items[0][0]
    if len(shape) != 4 or shape[3] % 2:
        raise KVCacheLayoutError(f"layer {name!r}: got shape {shape}, expected {_ACCEPTED}")
    num_blocks, heads, block_size, two_d = shape
    head_size = two_d // 2
    if first.device.type != "cpu":
        raise KVCacheLayoutError(
            f"layer {name!r}: got shape {shape} on {first.device}; the cpu_attn layout "
            f"[num_blocks, num_kv_heads, block_size, 2 * head_size] is vLLM's CPU backend's, "
            f"expected it on the CPU, or {_ACCEPTED}"
        )
    for layer, cache in items:
        if not cache.is_contiguous():
            raise KVCacheLayoutError(
                f"layer {layer!r}: cpu_attn cache of shape {shape} is not contiguous "
                f"(strides {cache.stride()})"
            )
    isa = cpu_attn_isa(first.dtype, block_size, head_size)
    if isa not in CPU_ISAS:
        raise KVCacheLayoutError(
            f"layer {name!r}: got cpu_attn shape {shape} {first.dtype}, which vLLM's CPU "
            f"backend fills with its {isa!r} kernel; only {CPU_ISAS} are supported"
        )
    return PagedKVSpec(
        layout="cpu_attn",
        num_layers=len(items),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=first.dtype,
        device=first.device,
        layer_names=tuple(n for n, _ in items),
        cpu_isa=isa,
    )


def slot_mapping_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slot ids of token positions ``[start, end)`` of a request with ``block_ids``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    capacity = len(block_ids) * block_size
    if not 0 <= start <= end <= capacity:
        raise ValueError(
            f"token range [{start}, {end}) does not fit {len(block_ids)} blocks of "
            f"{block_size} tokens (capacity {capacity})"
        )
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


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


class TransferBackend:
    """Gather tokens of the paged caches into host chunk slots (save) and scatter them back (load)."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], chunk_tokens: int, layout: str | None = None
    ) -> None:
        self.spec = describe_kv_caches(kv_caches, layout)
        self.chunk_tokens = chunk_tokens
        self.chunk_shape = self.spec.chunk_shape(chunk_tokens)
        self.slot_bytes = self.spec.chunk_bytes(chunk_tokens)
        self._caches = list(kv_caches.values())
        self._row = self.spec.num_kv_heads * self.spec.head_size
        self._esize = self.spec.element_size
        self._cpu_offsets: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.spec.layout == "cpu_attn":
            assert self.spec.cpu_isa is not None
            self._cpu_offsets = cpu_attn_offsets(
                self.spec.cpu_isa, self.spec.block_size, self.spec.head_size
            )
        self._row_strides = None if self._cpu_offsets else self._find_row_strides()
        # Row views are reinterpreted as a wider dtype; it must divide the row size and where
        # every layer starts in its storage.
        self._cache_align = math.gcd(
            self._row * self._esize, *(c.storage_offset() * self._esize for c in self._caches)
        )
        self._rows: dict[torch.dtype, list[torch.Tensor]] = {}
        self._is_cuda = self.spec.device.type == "cuda"
        if self._is_cuda:
            # One side stream for saves and loads alike: transfers then run in issue order, so a
            # load can never overtake a save of the same blocks or slot (vLLM's offloading worker
            # chains its jobs the same way). The staging buffer is only touched on this stream.
            # torch.cuda.Stream and torch.cuda.Event are untyped in torch's own annotations.
            self._stream = torch.cuda.Stream(device=self.spec.device)  # type: ignore[no-untyped-call]
            self._staging = torch.empty(
                self.chunk_shape, dtype=self.spec.dtype, device=self.spec.device
            )

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
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_mapping of a load names the same cache slot twice")
        return self._transfer(src_slot, slots, src_offset, save=False, after=after)

    def _transfer(
        self,
        host: torch.Tensor,
        slots: torch.Tensor,
        offset: int,
        *,
        save: bool,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        n = slots.numel()
        if n == 0:
            return TransferHandle()
        index = self._index(slots)
        if not self._is_cuda:
            self._move(host, offset, n, index, save=save)
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
            index_dev = index.to(self.spec.device, non_blocking=True)
            staging = self._staging_for(n)
            if not save:
                self._copy_region(host, staging, offset, n, to_host=False)
            self._move(staging, 0, n, index_dev, save=save)
            if save:
                self._copy_region(host, staging, offset, n, to_host=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return TransferHandle(event, self.spec.device, (host, index_dev))

    # -- validation ---------------------------------------------------------------------------

    def _check(
        self,
        slot: torch.Tensor,
        slot_mapping: torch.Tensor | Sequence[int],
        offset: int,
        slot_name: str,
        offset_name: str,
    ) -> torch.Tensor:
        """Validate a call; return the slot ids as a 1-D int64 CPU tensor."""
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
            slots = slot_mapping.detach().to("cpu", torch.int64).reshape(-1)
        else:
            slots = torch.tensor(list(slot_mapping), dtype=torch.int64).reshape(-1)
        n = slots.numel()
        if offset < 0 or offset + n > self.chunk_tokens:
            raise ValueError(
                f"{n} tokens at {offset_name}={offset} do not fit a chunk of "
                f"{self.chunk_tokens} tokens"
            )
        if n:
            lo, hi = int(slots.min()), int(slots.max())
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
        dims = (_KV_DIM[spec.layout], _BLOCK_DIM[spec.layout], 2)
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

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        """What the per-layer moves index with, the same for every layer: row ids of K then V
        (``[2 * n]``); for ``cpu_attn``, flat element ids ``[2, n * H * D]`` of K and of V in
        the host slot's order (token, head, dim); on the advanced-indexing path the slot ids
        themselves."""
        if self._cpu_offsets is not None:
            spec = self.spec
            k_off, v_off = self._cpu_offsets
            bs, heads, d = spec.block_size, spec.num_kv_heads, spec.head_size
            per_head = 2 * bs * d
            blk, pos = slots // bs, slots % bs
            # [n, H, 1]: where each token's (block, head) region starts.
            start = (blk.view(-1, 1) * heads + torch.arange(heads).view(1, -1)) * per_head
            start = start.unsqueeze(-1)
            k = (start + k_off[pos].unsqueeze(1)).reshape(-1)
            v = (start + v_off[pos].unsqueeze(1)).reshape(-1)
            return torch.stack([k, v])
        if self._row_strides is None:
            return slots
        s_kv, s_blk, s_off = self._row_strides
        bs = self.spec.block_size
        base = (slots // bs) * s_blk + (slots % bs) * s_off
        return torch.cat([base, base + s_kv])

    def _rows_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each layer as a 2-D ``[rows, H*D]`` view, reinterpreted as ``dtype``."""
        views = self._rows.get(dtype)
        if views is None:
            assert self._row_strides is not None
            s_kv, s_blk, s_off = self._row_strides
            spec = self.spec
            n_rows = 1 + s_kv + (spec.num_blocks - 1) * s_blk + (spec.block_size - 1) * s_off
            views = [
                torch.as_strided(c, (n_rows, self._row), (self._row, 1), c.storage_offset()).view(
                    dtype
                )
                for c in self._caches
            ]
            self._rows[dtype] = views
        return views

    # -- gather / scatter -----------------------------------------------------------------------

    def _move(
        self, chunk: torch.Tensor, offset: int, n: int, index: torch.Tensor, *, save: bool
    ) -> None:
        """Save: ``chunk[:, :, offset:offset+n]`` <- the caches at ``index``; load: the reverse.

        ``chunk`` is ``[L, 2, T, H*D]`` and contiguous (a host slot, or the staging buffer).
        Views are made in bulk (``unbind``) because per-layer Python indexing costs more than
        the copy itself for short ranges.
        """
        num_layers = self.spec.num_layers
        if self._cpu_offsets is not None:
            # Each (K or V) piece of the host slot is contiguous over its tokens: one
            # element-wise gather or scatter per layer and K/V half.
            for layer, cache in enumerate(self._caches):
                flat = cache.view(-1)
                for kv in range(2):
                    piece = chunk[layer, kv].narrow(0, offset, n).view(-1)
                    if save:
                        torch.index_select(flat, 0, index[kv], out=piece)
                    else:
                        flat.index_copy_(0, index[kv], piece)
            return
        if self._row_strides is None:
            region = chunk.narrow(2, offset, n)
            for layer in range(num_layers):
                self._move_indexed(layer, index, region[layer], save=save)
            return
        wide = _wide_dtype(self._cache_align, int(chunk.storage_offset()) * self._esize)
        rows = self._rows_as(wide)
        t = chunk.view(wide)
        if offset == 0 and n == chunk.shape[2]:
            # K rows and V rows of a layer are adjacent: one index op per layer.
            pieces = t.view(num_layers, 2 * n, -1).unbind(0)
            indices = [index] * num_layers
        else:
            pieces = t.view(2 * num_layers, chunk.shape[2], -1).narrow(1, offset, n).unbind(0)
            rows = [r for r in rows for _ in range(2)]
            indices = [index[:n], index[n:]] * num_layers
        if save:
            for src, idx, out in zip(rows, indices, pieces, strict=True):
                torch.index_select(src, 0, idx, out=out)
        else:
            for dst, idx, src in zip(rows, indices, pieces, strict=True):
                dst.index_copy_(0, idx, src)

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
        kv_dim = _KV_DIM[self.spec.layout]
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
