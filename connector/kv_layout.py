"""What vLLM's paged KV caches look like, and the formats a host chunk slot holds them in.

Rule of this module: it knows torch and tensor layouts, nothing else. It never imports vLLM or
`tracker/`. It says what a cache is (``describe_kv_caches`` checks the caches vLLM registers
and names their layout in a ``PagedKVSpec``), where each element of a token sits in it (the
5-D layouts' dims; the element order of vLLM's CPU attention kernels, ``cpu_attn_views``),
and what a host slot holds (the pool format); moving the bytes is ``connector.transfer``'s job,
which reads these facts and adds none. Kept apart from the copy engine because the facts have
readers of their own: the digests read a block's bytes in the cache's own order
(``connector.digests``), ``connector.vllm`` names the pool format in the salt, and tests and
tools read a slot token by token (``slot_tokens``).

A host chunk slot is one contiguous tensor holding a chunk's tokens, all layers, K and V, in
one of two **pool formats** (``PagedKVSpec.pool_format``), whichever makes a whole cache block
one contiguous run of bytes on both sides:

- ``tokens`` (FlashAttention's and FlashInfer's layouts): ``[num_layers, 2, chunk_tokens,
  num_kv_heads * head_size]``, per layer K then V, token-major inside. In those layouts a
  block's K (or V) is already ``block_size`` consecutive token rows, so this *is* their block
  order: a block moves as one row of ``block_size * num_kv_heads * head_size`` elements.
- the native format of vLLM's CPU attention layout (``cpu_attn``, below), named after its
  kernel and block size (``cpu_attn-vec-block32``): ``[num_layers, chunk_tokens / block_size,
  num_kv_heads, block_size, 2 * head_size]``, each block of each layer exactly as the cache
  holds it, in the kernel's own element order. Token-major, every element of a block would
  change place between the two (``vec``'s K is dim-major, ``amx`` interleaves pairs), and
  torch's CPU copy moves a transposed element at a time (a third of a ``memcpy`` at best);
  in the kernel's order a block is one contiguous image of ``num_kv_heads * 2 * block_size *
  head_size`` elements on both sides.

The bytes of a chunk mean something only to a backend of the same pool format, so the format
is part of what a chunk key names (``connector.vllm`` puts it in the salt; the worker refuses
caches of another format), and a chunk is shared, through the remote tier too, only between
engines of one format.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "BLOCK_DIM",
    "CPU_ISAS",
    "KV_DIM",
    "LAYOUTS",
    "TOKENS",
    "KVCacheLayoutError",
    "Layout",
    "PagedKVSpec",
    "cpu_attn_isa",
    "cpu_attn_offsets",
    "cpu_attn_views",
    "describe_kv_caches",
    "pool_format",
    "slot_mapping_for",
    "slot_tokens",
    "token_pieces",
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
KV_DIM = {"flash_attn": 0, "flashinfer": 1}
BLOCK_DIM = {"flash_attn": 1, "flashinfer": 0}


# The pool format of the 5-D layouts (and of every chunk kvledger saved before pool formats
# had names): token-major.
TOKENS = "tokens"


class KVCacheLayoutError(ValueError):
    """The KV caches handed to us are not a layout this module can move."""


def pool_format(layout: str, block_size: int, cpu_isa: str | None = None) -> str:
    """The name of the format in which a host chunk slot holds the tokens of caches of
    ``layout`` (the module docstring): ``TOKENS`` for FlashAttention's and FlashInfer's
    layouts; for ``cpu_attn``, the kernel whose element order the blocks keep and the block
    size (``"cpu_attn-vec-block32"``): both fix where each byte of a chunk is."""
    if layout != "cpu_attn":
        return TOKENS
    if cpu_isa is None:
        raise KVCacheLayoutError("the cpu_attn pool format needs the kernel (cpu_isa) named")
    return f"cpu_attn-{cpu_isa}-block{block_size}"


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

    @property
    def pool_format(self) -> str:
        """The format host chunk slots hold these caches' tokens in (``pool_format``)."""
        return pool_format(self.layout, self.block_size, self.cpu_isa)

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, ...]:
        """Shape of one host chunk slot holding ``chunk_tokens`` tokens, in this spec's pool
        format: ``[L, 2, T, H*D]`` (``tokens``), or for ``cpu_attn`` ``[L, T / block_size, H,
        block_size, 2 * D]``, each block as a layer's cache holds it."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        if self.layout != "cpu_attn":
            return (self.num_layers, 2, chunk_tokens, self.num_kv_heads * self.head_size)
        if chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens={chunk_tokens}: the pool format {self.pool_format} keeps a chunk "
                f"as whole cache blocks, so it must be a multiple of block_size "
                f"{self.block_size}"
            )
        return (
            self.num_layers,
            chunk_tokens // self.block_size,
            self.num_kv_heads,
            self.block_size,
            2 * self.head_size,
        )

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return math.prod(self.chunk_shape(chunk_tokens)) * self.element_size


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    layout: str | None = None,
    *,
    cpu_isa: str | None = None,
) -> PagedKVSpec:
    """Check that ``kv_caches`` (layer name -> cache, in layer order) share one paged layout.

    Both vLLM layouts are 5-D; when ``layout`` is None it is inferred from which of the first two
    dims has size 2, and a cache where both do (``num_blocks == 2``) must name its layout.
    ``cpu_isa``: for ``cpu_attn``, the kernel whose order the caches are in (one of
    ``CPU_ISAS``); by default the one vLLM picks on this machine (``cpu_attn_isa``).
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
        return _describe_cpu_attn(items, shape, first, cpu_isa)
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
        if shape[KV_DIM[resolved]] != 2:
            raise KVCacheLayoutError(
                f"layer {first_name!r}: got shape {shape}, which is not layout {resolved!r}; "
                f"expected {_ACCEPTED}"
            )
    return PagedKVSpec(
        layout=resolved,
        num_layers=len(items),
        num_blocks=shape[BLOCK_DIM[resolved]],
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
    and splits it in two). Read off ``cpu_attn_views``, the one statement of the order."""
    regions = torch.arange(2 * block_size * head_size, dtype=torch.int64)
    k, v = cpu_attn_views(regions, isa, block_size, head_size)
    return k.reshape(block_size, head_size).contiguous(), v.reshape(
        block_size, head_size
    ).contiguous()


def _split_last(t: torch.Tensor, *sizes: int) -> torch.Tensor:
    """``t`` with its last dim split into ``sizes`` (a view)."""
    return t.view(*t.shape[:-1], *sizes)


def cpu_attn_views(
    regions: torch.Tensor, isa: str, block_size: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V inside each (block, head) region of a ``cpu_attn`` cache, as views in token-major
    order: ``regions`` is ``[..., 2 * block_size * head_size]`` (K then V of one (block, head),
    contiguous along the last dim); K and V come back as views ``[..., *t_dims, *d_dims]``
    whose trailing dims split the token in its block (``t_dims``, multiplying to
    ``block_size``), then the head dim (``d_dims``), so that reading one in dim order reads
    ``X[t, d]`` row by row. Views, not copies: a ``copy_`` to or from one moves whole blocks
    at once.

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
    bs, d = block_size, head_size
    k_reg = regions[..., : bs * d]
    v_reg = regions[..., bs * d : 2 * bs * d]
    lead = tuple(range(regions.dim() - 1))
    if isa == "vec":
        return _split_last(k_reg, d, bs).transpose(-1, -2), _split_last(v_reg, bs, d)
    if isa == "amx":
        if bs % 16 or d % 16:
            raise KVCacheLayoutError(
                f"cpu_attn amx: block_size {bs} and head_size {d} must be multiples of 16"
            )
        n = len(lead)
        # (t//16, d//16, (d%16)//2, t%16, d%2) -> (t//16, t%16, d//16, (d%16)//2, d%2)
        k = _split_last(k_reg, bs // 16, d // 16, 8, 16, 2)
        k = k.permute(*lead, n, n + 3, n + 1, n + 2, n + 4)
        # (d//16, t//2, d%16, t%2) -> (t//2, t%2, d//16, d%16)
        v = _split_last(v_reg, d // 16, bs // 2, 16, 2)
        v = v.permute(*lead, n + 1, n + 3, n, n + 2)
        return k, v
    raise KVCacheLayoutError(f"no known cpu_attn element order for kernel {isa!r}")


# How many leading dims of a K or V view from cpu_attn_views split the token in its block.
_TOKEN_DIMS = {"vec": 1, "amx": 2}


def token_pieces(view: torch.Tensor, dim: int, isa: str, t0: int, t1: int) -> list[torch.Tensor]:
    """Views of ``view`` (K or V from ``cpu_attn_views``, its token dims starting at ``dim``)
    that together cover exactly the elements of tokens ``[t0, t1)`` of each block: one narrow
    where the token is one dim (``vec``); where it is two, ``(t // r, t % r)`` (``amx``: 16
    tokens of K, 2 of V), the part of a first group, the whole groups, the part of a last
    group (at most three rectangles, each with contiguous runs of elements inside)."""
    if _TOKEN_DIMS[isa] == 1:
        return [view.narrow(dim, t0, t1 - t0)]
    r = view.shape[dim + 1]
    g0, g1 = -(-t0 // r), t1 // r  # the whole groups [g0, g1)
    if g1 < g0:  # inside one group
        return [view.narrow(dim, t0 // r, 1).narrow(dim + 1, t0 % r, t1 - t0)]
    pieces = []
    if t0 % r:
        pieces.append(view.narrow(dim, t0 // r, 1).narrow(dim + 1, t0 % r, r - t0 % r))
    if g1 > g0:
        pieces.append(view.narrow(dim, g0, g1 - g0))
    if t1 % r:
        pieces.append(view.narrow(dim, g1, 1).narrow(dim + 1, 0, t1 % r))
    return pieces


def slot_tokens(spec: PagedKVSpec, slot: torch.Tensor) -> torch.Tensor:
    """The tokens of a host chunk slot of ``spec``'s pool format as ``[L, 2, T, H*D]``, K then
    V, token-major: the slot itself in the ``tokens`` format, a reordered copy of a
    ``cpu_attn`` one. For tests and tools that read a chunk's K and V token by token; the
    transfers never reorder."""
    if spec.pool_format == TOKENS:
        return slot
    assert spec.cpu_isa is not None
    layers, blocks, heads, bs, _ = slot.shape
    d = spec.head_size
    k, v = cpu_attn_views(slot.reshape(layers, blocks, heads, -1), spec.cpu_isa, bs, d)
    rows = [
        x.reshape(layers, blocks, heads, bs, d)
        .permute(0, 1, 3, 2, 4)
        .reshape(layers, -1, heads * d)
        for x in (k, v)
    ]
    return torch.stack(rows, dim=1)


def _describe_cpu_attn(
    items: list[tuple[str, torch.Tensor]],
    shape: tuple[int, ...],
    first: torch.Tensor,
    cpu_isa: str | None,
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
    if cpu_isa is not None and cpu_isa not in CPU_ISAS:
        raise KVCacheLayoutError(f"cpu_isa={cpu_isa!r}: expected one of {CPU_ISAS}")
    isa = cpu_isa or cpu_attn_isa(first.dtype, block_size, head_size)
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
