"""Property tests for connector/transfer.py: over shapes, dtypes, layouts and slot mappings, a
save writes into the host slot, and a load into the caches, exactly what a simple reference
writes, bit for bit, and nothing else.

The reference moves one token at a time, by plain indexing for the 5-D layouts and, for
``cpu_attn``, by the element offsets vLLM's CPU kernels use, written here from their
headers' index arithmetic (``csrc/cpu/cpu_attn_vec.hpp``, ``cpu_attn_amx.hpp``) and not from
the backend's views. The host slot is in the layout's pool format: token-major rows for the
5-D layouts; for ``cpu_attn`` its blocks in the kernel's order, so a token at chunk position
``p`` sits where a cache of the chunk's blocks keeps the token of slot ``p``.
tests/engine/test_cpu_layout.py checks the same order against vLLM's kernel itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector import kv_layout, transfer
from kvledger.connector.kv_layout import slot_mapping_for
from kvledger.connector.transfer import TransferBackend

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# 5-D layouts as vLLM allocates them, plus two stride orders that are not plain rows:
# HND (heads before tokens: no token rows) and padded blocks (token rows, but a block's
# rows are not a multiple of block_size apart: no whole-block rows).
LAYOUTS_5D = ["flash_attn", "flashinfer", "flash_attn_hnd", "flash_attn_padded"]
LAYOUTS = [*LAYOUTS_5D, "cpu_vec", "cpu_amx"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers, so that comparisons are bitwise (NaN patterns included)."""
    return t.view(_BITS[t.element_size()])


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    bits(t).copy_(torch.randint(-(2**15), 2**15, shape, generator=gen).to(bits(t).dtype))
    return t


@dataclass(frozen=True)
class Shape:
    layout: str
    dtype: torch.dtype
    layers: int
    blocks: int
    block_size: int
    heads: int
    head_size: int
    chunk_tokens: int

    @property
    def native(self) -> bool:
        """The host slot holds blocks in the kernel's order (the cpu_attn pool format)."""
        return self.layout.startswith("cpu")


def make_caches(s: Shape, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    nb, bs, h, d = s.blocks, s.block_size, s.heads, s.head_size
    base, view = {
        "flash_attn": ((2, nb, bs, h, d), lambda c: c),
        "flashinfer": ((nb, 2, bs, h, d), lambda c: c),
        "flash_attn_hnd": ((2, nb, h, bs, d), lambda c: c.transpose(2, 3)),
        "flash_attn_padded": ((2, nb, bs + 1, h, d), lambda c: c[:, :, :bs]),
    }.get(s.layout, ((nb, h, bs, 2 * d), lambda c: c))
    return {
        f"model.layers.{i}.self_attn.attn": view(random_bits(base, s.dtype, seed + i).to(device))
        for i in range(s.layers)
    }


def cpu_offsets(isa: str, bs: int, d: int, t: int) -> tuple[list[int], list[int]]:
    """Element offsets of K[t, 0..d) and V[t, 0..d) inside one (block, head) region."""
    k, v = [], []
    for j in range(d):
        if isa == "vec":  # K [d, bs]; V [bs, d]
            k.append(j * bs + t)
            v.append(bs * d + t * d + j)
        else:  # amx: K (t/16, d/16, (d%16)/2, t%16, d%2); V (d/16, t/2, d%16, t%2)
            k.append(
                (t // 16) * 16 * d + (j // 16) * 256 + (j % 16) // 2 * 32 + (t % 16) * 2 + j % 2
            )
            v.append(bs * d + (j // 16) * 16 * bs + (t // 2) * 32 + (j % 16) * 2 + t % 2)
    return k, v


def token_refs(s: Shape, cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the token at ``slot``, each ``[H*D]``, as views (reads and writes) into
    ``cache`` where possible, else as an index into the flat cache."""
    block, t = divmod(slot, s.block_size)
    if s.layout in ("flash_attn", "flash_attn_hnd", "flash_attn_padded"):
        return cache[0, block, t], cache[1, block, t]
    if s.layout == "flashinfer":
        return cache[block, 0, t], cache[block, 1, t]
    raise AssertionError(s.layout)


def cpu_token_index(s: Shape, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat element ids of K and V (``[H*D]`` each, head-major) of the token at ``slot``."""
    block, t = divmod(slot, s.block_size)
    k_off, v_off = cpu_offsets(s.layout[4:], s.block_size, s.head_size, t)
    region = 2 * s.block_size * s.head_size
    k, v = [], []
    for h in range(s.heads):
        base = (block * s.heads + h) * region
        k.extend(base + o for o in k_off)
        v.extend(base + o for o in v_off)
    return torch.tensor(k), torch.tensor(v)


def host_token_index(s: Shape, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_attn: flat element ids, in one layer of a host slot, of K and V of the token at
    chunk position ``pos``: the slot's layer is ``[chunk blocks, H, block_size, 2 * D]``, laid
    out as a cache of that many blocks."""
    return cpu_token_index(s, pos)


def host_token(s: Shape, slot: torch.Tensor, layer: int, pos: int) -> torch.Tensor:
    """K and V of the token at chunk position ``pos`` of ``slot``'s ``layer``, ``[2, H*D]``."""
    if not s.native:
        return slot[layer, :, pos]
    k, v = host_token_index(s, pos)
    flat = slot[layer].reshape(-1)
    return torch.stack([flat[k], flat[v]])


def reference_save(
    s: Shape, caches: list[torch.Tensor], slot: torch.Tensor, slots: list[int], offset: int
) -> torch.Tensor:
    want = slot.clone()
    for layer, cache in enumerate(caches):
        for i, sl in enumerate(slots):
            if s.native:
                k, v = cpu_token_index(s, sl)
                hk, hv = host_token_index(s, offset + i)
                flat = cache.reshape(-1)
                host = want[layer].view(-1)
                host[hk] = flat[k]
                host[hv] = flat[v]
            else:
                k, v = token_refs(s, cache, sl)
                want[layer, 0, offset + i] = k.reshape(-1)
                want[layer, 1, offset + i] = v.reshape(-1)
    return want


def reference_load(
    s: Shape, caches: list[torch.Tensor], slot: torch.Tensor, slots: list[int], offset: int
) -> list[torch.Tensor]:
    out = [c.clone() for c in caches]
    for layer, cache in enumerate(out):
        for i, sl in enumerate(slots):
            k_row, v_row = host_token(s, slot, layer, offset + i)
            if s.native:
                k, v = cpu_token_index(s, sl)
                flat = cache.view(-1)  # cpu_attn caches are contiguous
                flat[k] = k_row
                flat[v] = v_row
            else:
                k_view, v_view = token_refs(s, cache, sl)
                k_view.copy_(k_row.view(k_view.shape))
                v_view.copy_(v_row.view(v_view.shape))
    return out


@st.composite
def shapes(draw: st.DrawFn, layouts: list[str] = LAYOUTS) -> Shape:
    layout = draw(st.sampled_from(layouts))
    if layout == "cpu_amx":
        block_size = draw(st.sampled_from([16, 32]))
        head_size = draw(st.sampled_from([16, 32]))
    elif layout == "cpu_vec":
        block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
        head_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    else:
        block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
        head_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    blocks = draw(st.integers(2, 8))
    if layout.startswith("cpu"):  # its pool format keeps a chunk as whole blocks
        chunk_tokens = block_size * draw(st.integers(1, 4))
    else:  # a chunk of up to 4 blocks, not always a whole number of them
        chunk_tokens = draw(st.integers(1, 4 * block_size))
    return Shape(
        layout=layout,
        dtype=draw(st.sampled_from(DTYPES)),
        layers=draw(st.integers(1, 3)),
        blocks=blocks,
        block_size=block_size,
        heads=draw(st.integers(1, 3)),
        head_size=head_size,
        chunk_tokens=chunk_tokens,
    )


@st.composite
def mappings(draw: st.DrawFn, s: Shape) -> tuple[list[int], int]:
    """(slot ids, offset in the chunk): a request's token range over permuted block ids, as
    the worker moves it (inside one chunk of the request, at its place in the chunk: whole
    blocks and a partial block at either end); the same range at any offset; or any distinct
    slots."""
    bs = s.block_size
    kind = draw(st.sampled_from(["worker", "range", "any"]))
    if kind == "worker":
        ids = draw(st.permutations(range(s.blocks)))
        chunk_start = s.chunk_tokens * draw(st.integers(0, (len(ids) * bs - 1) // s.chunk_tokens))
        chunk_end = min(len(ids) * bs, chunk_start + s.chunk_tokens)
        start = draw(st.integers(chunk_start, chunk_end - 1))
        end = draw(st.integers(start + 1, chunk_end))
        return slot_mapping_for(ids, bs, start, end), start - chunk_start
    if kind == "range":
        ids = draw(st.permutations(range(s.blocks)))
        start = draw(st.integers(0, len(ids) * bs - 1))
        end = draw(st.integers(start + 1, min(len(ids) * bs, start + s.chunk_tokens)))
        slots = slot_mapping_for(ids, bs, start, end)
    else:
        n = draw(st.integers(1, min(s.chunk_tokens, s.blocks * bs)))
        slots = draw(
            st.lists(st.integers(0, s.blocks * bs - 1), min_size=n, max_size=n, unique=True)
        )
    offset = draw(st.integers(0, s.chunk_tokens - len(slots)))
    return slots, offset


def backend_for(s: Shape, caches: dict[str, torch.Tensor]) -> TransferBackend:
    if s.layout.startswith("cpu"):
        # The caches as this kernel writes them, whichever vLLM would pick on this machine.
        backend = TransferBackend(caches, s.chunk_tokens, cpu_isa=s.layout[4:])
        assert backend.spec.layout == "cpu_attn"
        return backend
    layout = "flashinfer" if s.layout == "flashinfer" else "flash_attn"
    return TransferBackend(caches, s.chunk_tokens, layout)


def check_against_reference(data: st.DataObject, s: Shape, device: str) -> None:
    caches = make_caches(s, seed=1, device=device)
    backend = backend_for(s, caches)
    if s.native:
        assert backend.spec.pool_format == f"cpu_attn-{s.layout[4:]}-block{s.block_size}"
    else:
        assert backend.spec.pool_format == kv_layout.TOKENS
    moves_against_reference(data, s, device, caches, backend)


def moves_against_reference(
    data: st.DataObject,
    s: Shape,
    device: str,
    caches: dict[str, torch.Tensor],
    backend: TransferBackend,
) -> None:
    layers = [c.cpu() for c in caches.values()]
    slots, offset = data.draw(mappings(s), "save mapping")

    slot = random_bits(backend.chunk_shape, s.dtype, seed=2)
    if device == "cuda":
        slot = slot.pin_memory()
    want = reference_save(s, layers, slot, slots, offset)
    backend.save(slot, slots, offset).synchronize()
    assert torch.equal(bits(slot), bits(want))

    targets, src_offset = data.draw(mappings(s), "load mapping")
    want_caches = reference_load(s, layers, slot, targets, src_offset)
    backend.load(slot, torch.tensor(targets), src_offset).synchronize()
    for got, exp in zip(caches.values(), want_caches, strict=True):
        assert torch.equal(bits(got.cpu()), bits(exp))

    # Round trip: the loaded tokens, saved again, are the slot's rows.
    again = random_bits(backend.chunk_shape, s.dtype, seed=3)
    if device == "cuda":
        again = again.pin_memory()
    backend.save(again, targets, src_offset).synchronize()
    for layer in range(s.layers):
        for pos in range(src_offset, src_offset + len(targets)):
            got, want = host_token(s, again, layer, pos), host_token(s, slot, layer, pos)
            assert torch.equal(bits(got), bits(want)), (layer, pos)


@settings(max_examples=300)
@given(data=st.data(), s=shapes())
def test_save_and_load_match_the_reference(data: st.DataObject, s: Shape) -> None:
    """A save fills exactly the slot's rows for its tokens with the reference's bytes; a load
    of a slot writes exactly the reference's bytes at its slots and nothing else; a save then
    a load into other blocks round-trips bit for bit."""
    check_against_reference(data, s, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=100)
@given(data=st.data(), s=shapes(LAYOUTS_5D))
def test_cuda_save_and_load_match_the_reference(data: st.DataObject, s: Shape) -> None:
    """The same on CUDA (the gather or scatter on the device, through the staging buffer)."""
    check_against_reference(data, s, "cuda")


@settings(max_examples=100)
@given(
    slots=st.lists(st.integers(0, 63), min_size=0, max_size=40, unique=True),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_whole_blocks_finds_back_to_back_blocks(slots: list[int], block_size: int) -> None:
    """The span ``_whole_blocks`` reports is whole blocks back to back, each in order."""
    first, count = transfer._whole_blocks(slots, block_size)
    span = slots[first : first + count * block_size]
    assert len(span) == count * block_size
    for i in range(count):
        block = span[i * block_size : (i + 1) * block_size]
        assert block[0] % block_size == 0
        assert block == list(range(block[0], block[0] + block_size))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_whole_blocks_of_a_request_range(block_size: int) -> None:
    """A request's token range is a partial block, whole blocks, a partial block: the whole
    ones are found, however the range starts and ends."""
    ids = [5, 2, 7, 0, 3]
    for start in range(0, 2 * block_size + 1):
        for end in range(start, len(ids) * block_size + 1):
            slots = slot_mapping_for(ids, block_size, start, end)
            first = -start % block_size
            count = max(0, (end - start - first) // block_size)
            got = transfer._whole_blocks(slots, block_size)
            assert got == ((first, count) if count else (0, 0)), (start, end)
