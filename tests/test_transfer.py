"""Tests for connector/kv_layout.py (layout detection, pool formats, the CPU kernels' order) and
connector/transfer.py (bitwise save/load round trips)."""

from __future__ import annotations

import re

import pytest
import torch

from kvledger.connector.kv_layout import (
    KVCacheLayoutError,
    PagedKVSpec,
    describe_kv_caches,
    slot_mapping_for,
)
from kvledger.connector.transfer import TransferBackend, TransferHandle

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
LAYOUTS = ["flash_attn", "flashinfer"]
DTYPES = [torch.float16, torch.bfloat16]

# Small shapes: 3 layers, 12 blocks of 4 tokens, 2 KV heads of size 8; chunks of 16 tokens.
L, NB, BS, H, D, C = 3, 12, 4, 2, 8, 16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers, so that comparisons are bitwise (NaN patterns included)."""
    return t.view(_BITS[t.element_size()])


def fill_random(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    src = torch.randint(-(2**15), 2**15, t.shape, generator=gen, dtype=torch.int32)
    bits(t).copy_(src.to(bits(t).dtype))


def make_caches(
    layout: str,
    device: str,
    dtype: torch.dtype = torch.bfloat16,
    num_blocks: int = NB,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, BS, H, D) if layout == "flash_attn" else (num_blocks, 2, BS, H, D)
    caches = {}
    for i in range(L):
        cache = torch.empty(shape, dtype=dtype, device=device)
        fill_random(cache, seed + i)
        caches[f"model.layers.{i}.self_attn"] = cache
    return caches


def host_slot(backend: TransferBackend, fill: int = 0) -> torch.Tensor:
    pin = backend.spec.device.type == "cuda"
    slot = torch.empty(backend.chunk_shape, dtype=backend.spec.dtype, pin_memory=pin)
    bits(slot).fill_(fill)
    return slot


def token(cache: torch.Tensor, layout: str, kv: int, slot_id: int) -> torch.Tensor:
    """K or V of one token at a flat slot id, as ``[H*D]``."""
    block, off = divmod(slot_id, BS)
    t = cache[kv, block, off] if layout == "flash_attn" else cache[block, kv, off]
    return t.reshape(-1)


def block_of(cache: torch.Tensor, layout: str, block: int) -> torch.Tensor:
    return cache[:, block] if layout == "flash_attn" else cache[block]


def snapshot(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [c.clone() for c in caches.values()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ["random", "sequential"])
def test_round_trip_into_other_blocks(device: str, dtype: torch.dtype, layout: str, order: str):
    """A chunk saved from some blocks and loaded into others is bitwise the same, and nothing
    else in the caches changes."""
    caches = make_caches(layout, device, dtype, seed=10)
    backend = TransferBackend(caches, C)
    if order == "random":
        src_blocks, dst_blocks = [9, 2, 7, 0], [5, 11, 1, 8]
    else:
        src_blocks, dst_blocks = [0, 1, 2, 3], [4, 5, 6, 7]
    src_map = slot_mapping_for(src_blocks, BS, 0, C)
    dst_map = slot_mapping_for(dst_blocks, BS, 0, C)

    slot = host_slot(backend)
    backend.save(slot, src_map).synchronize()
    # The slot holds [layer, K/V, token, H*D] in token order.
    for layer, cache in enumerate(caches.values()):
        for kv in range(2):
            for t, s in enumerate(src_map):
                assert torch.equal(
                    bits(slot[layer, kv, t]), bits(token(cache, layout, kv, s).cpu())
                )

    for cache in caches.values():
        for b in dst_blocks:
            block_of(cache, layout, b).zero_()
    before = snapshot(caches)
    handle = backend.load(slot, torch.tensor(dst_map))
    handle.wait()
    for cache, old in zip(caches.values(), before, strict=True):
        for s_blk, d_blk in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(
                bits(block_of(cache, layout, d_blk)), bits(block_of(cache, layout, s_blk))
            )
        for b in set(range(NB)) - set(dst_blocks):
            assert torch.equal(bits(block_of(cache, layout, b)), bits(block_of(old, layout, b)))
    assert handle.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_last_chunk(device: str, layout: str):
    """A chunk of fewer tokens than chunk_tokens fills only its rows of the slot and loads back
    only its tokens."""
    caches = make_caches(layout, device, seed=20)
    backend = TransferBackend(caches, C)
    n = 10  # two full blocks and half of a third
    src_map = slot_mapping_for([6, 3, 10], BS, 0, n)
    dst_map = slot_mapping_for([1, 8, 4], BS, 0, n)
    slot = host_slot(backend, fill=0x5A5A)
    backend.save(slot, src_map).synchronize()
    assert (bits(slot[:, :, n:]) == 0x5A5A).all()
    assert not (bits(slot[:, :, :n]) == 0x5A5A).all()

    before = snapshot(caches)
    backend.load(slot, dst_map).synchronize()
    for cache, old in zip(caches.values(), before, strict=True):
        for kv in range(2):
            for s, d in zip(src_map, dst_map, strict=True):
                assert torch.equal(
                    bits(token(cache, layout, kv, d)), bits(token(old, layout, kv, s))
                )
            # The rest of the third destination block is untouched.
            for d in slot_mapping_for([1, 8, 4], BS, n, 3 * BS):
                assert torch.equal(
                    bits(token(cache, layout, kv, d)), bits(token(old, layout, kv, d))
                )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mid_block_load_range(device: str, layout: str):
    """Loading tokens [5, 15) of a chunk writes exactly those tokens, starting and ending
    mid-block, and leaves their neighbours alone."""
    caches = make_caches(layout, device, seed=30)
    backend = TransferBackend(caches, C)
    src_blocks, dst_blocks = [4, 9, 0, 6], [2, 11, 7, 5]
    slot = host_slot(backend)
    backend.save(slot, slot_mapping_for(src_blocks, BS, 0, C)).synchronize()

    start, end = 5, 15  # block 1 offset 1 .. block 3 offset 3 (exclusive)
    before = snapshot(caches)
    backend.load(slot, slot_mapping_for(dst_blocks, BS, start, end), src_offset=start).wait()
    src_all = slot_mapping_for(src_blocks, BS, 0, C)
    dst_all = slot_mapping_for(dst_blocks, BS, 0, C)
    for cache, old in zip(caches.values(), before, strict=True):
        for kv in range(2):
            for pos in range(C):
                got = bits(token(cache, layout, kv, dst_all[pos]))
                if start <= pos < end:
                    want = bits(token(old, layout, kv, src_all[pos]))
                else:
                    want = bits(token(old, layout, kv, dst_all[pos]))
                assert torch.equal(got, want), (kv, pos)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_at_offset_keeps_other_rows(device: str, layout: str):
    """A save at dst_offset writes rows [dst_offset, dst_offset + n) of the slot only."""
    caches = make_caches(layout, device, seed=40)
    backend = TransferBackend(caches, C)
    slot = host_slot(backend, fill=0x1234)
    slots = slot_mapping_for([3, 8], BS, 2, 7)  # 5 tokens, mid-block
    backend.save(slot, slots, dst_offset=6).synchronize()
    assert (bits(slot[:, :, :6]) == 0x1234).all()
    assert (bits(slot[:, :, 11:]) == 0x1234).all()
    for layer, cache in enumerate(caches.values()):
        for kv in range(2):
            for i, s in enumerate(slots):
                assert torch.equal(
                    bits(slot[layer, kv, 6 + i]), bits(token(cache, layout, kv, s).cpu())
                )


@pytest.mark.parametrize("device", DEVICES)
def test_strided_caches_round_trip(device: str):
    """Caches that are views with other strides (heads-before-tokens storage, and per-layer views
    of one cross-layer buffer) still round-trip bitwise."""
    # HND storage: [2, NB, H, BS, D] seen as [2, NB, BS, H, D]; a token's heads are not one row.
    hnd = {}
    for i in range(L):
        store = torch.empty((2, NB, H, BS, D), dtype=torch.float16, device=device)
        fill_random(store, 50 + i)
        hnd[f"l{i}"] = store.permute(0, 1, 3, 2, 4)
    # Cross-layer storage: [NB, L, 2, BS, H, D], each layer a flashinfer-shaped view.
    cross = torch.empty((NB, L, 2, BS, H, D), dtype=torch.float16, device=device)
    fill_random(cross, 60)
    crossed = {f"l{i}": cross[:, i] for i in range(L)}

    for caches, layout in ((hnd, "flash_attn"), (crossed, "flashinfer")):
        backend = TransferBackend(caches, C)
        src_map = slot_mapping_for([7, 1, 10], BS, 0, 11)
        dst_map = slot_mapping_for([2, 9, 4], BS, 0, 11)
        slot = host_slot(backend)
        backend.save(slot, src_map).synchronize()
        before = snapshot(caches)
        backend.load(slot, dst_map).synchronize()
        for cache, old in zip(caches.values(), before, strict=True):
            for kv in range(2):
                for s, d in zip(src_map, dst_map, strict=True):
                    assert torch.equal(
                        bits(token(cache, layout, kv, d)), bits(token(old, layout, kv, s))
                    )
                assert torch.equal(
                    bits(token(cache, layout, kv, 0)), bits(token(old, layout, kv, 0))
                )


def test_odd_row_size_round_trip():
    """Rows whose byte size is not a multiple of 16 (H*D*2 = 6 bytes) round-trip too."""
    caches = {f"l{i}": torch.empty((2, NB, BS, 1, 3), dtype=torch.float16) for i in range(L)}
    for i, cache in enumerate(caches.values()):
        fill_random(cache, 70 + i)
    backend = TransferBackend(caches, C)
    src_map, dst_map = slot_mapping_for([3, 6], BS, 1, 7), slot_mapping_for([0, 11], BS, 1, 7)
    slot = host_slot(backend)
    backend.save(slot, src_map)
    before = snapshot(caches)
    backend.load(slot, dst_map)
    for cache, old in zip(caches.values(), before, strict=True):
        for kv in range(2):
            for s, d in zip(src_map, dst_map, strict=True):
                assert torch.equal(
                    bits(token(cache, "flash_attn", kv, d)), bits(token(old, "flash_attn", kv, s))
                )


def test_empty_slot_mapping_is_a_finished_no_op():
    caches = make_caches("flash_attn", "cpu")
    backend = TransferBackend(caches, C)
    slot = host_slot(backend, fill=7)
    before = snapshot(caches)
    assert backend.save(slot, []).done()
    assert backend.load(slot, []).done()
    assert (bits(slot) == 7).all()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(caches.values(), before, strict=True))


# -- layout detection ---------------------------------------------------------------------------


def test_describe_infers_both_layouts():
    spec = describe_kv_caches(make_caches("flash_attn", "cpu"))
    assert spec == PagedKVSpec(
        layout="flash_attn",
        num_layers=L,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=H,
        head_size=D,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(L)),
    )
    assert spec.token_bytes == L * 2 * H * D * 2
    assert spec.chunk_shape(256) == (L, 2, 256, H * D)
    assert spec.chunk_bytes(256) == 256 * spec.token_bytes
    fi = describe_kv_caches(make_caches("flashinfer", "cpu", num_blocks=5))
    assert (fi.layout, fi.num_blocks, fi.block_size) == ("flashinfer", 5, BS)


def test_describe_ambiguous_needs_explicit_layout():
    """With num_blocks == 2 both layouts fit; inference refuses, an explicit layout decides."""
    caches = make_caches("flash_attn", "cpu", num_blocks=2)
    with pytest.raises(KVCacheLayoutError, match="explicitly") as err:
        describe_kv_caches(caches)
    assert "(2, 2, 4, 2, 8)" in str(err.value)
    assert describe_kv_caches(caches, "flash_attn").layout == "flash_attn"
    assert describe_kv_caches(caches, "flashinfer").layout == "flashinfer"


ACCEPTED = "[2, num_blocks, block_size, num_kv_heads, head_size]"


@pytest.mark.parametrize(
    ("caches", "layout", "needles"),
    [
        ({"attn.0": torch.empty(12, 4, 16)}, None, ["'attn.0': got shape (12, 4, 16)", ACCEPTED]),
        ({"attn.0": torch.empty(3, 12, 4, 2, 8)}, None, ["got shape (3, 12, 4, 2, 8)", ACCEPTED]),
        (
            {"attn.0": torch.empty(2, 12, 4, 2, 8)},
            "flashinfer",
            ["(2, 12, 4, 2, 8), which is not layout 'flashinfer'", ACCEPTED],
        ),
        ({"attn.0": torch.empty(2, 12, 4, 2, 8)}, "paged", ["unknown layout 'paged'"]),
        ({}, None, ["no KV cache layers", ACCEPTED]),
        (
            {"a": torch.empty(2, 12, 4, 2, 8), "b": torch.empty(2, 10, 4, 2, 8)},
            None,
            ["layer 'b': got shape (2, 10, 4, 2, 8)", "'a' has (2, 12, 4, 2, 8)"],
        ),
        (
            {"a": torch.empty(2, 12, 4, 2, 8), "b": torch.empty(2, 12, 4, 2, 8).half()},
            None,
            ["layer 'b'", "torch.float16", "torch.float32"],
        ),
        ({"a": torch.empty(2, 12, 4, 2, 8), "b": [1, 2]}, None, ["layer 'b'", "list"]),
    ],
)
def test_describe_rejects(caches, layout, needles):
    """Every rejection names the layer, the shape it got, and what is accepted."""
    with pytest.raises(KVCacheLayoutError) as err:
        describe_kv_caches(caches, layout)
    for needle in needles:
        assert needle in str(err.value)


def test_layout_error_is_a_value_error():
    assert issubclass(KVCacheLayoutError, ValueError)


# -- validation ---------------------------------------------------------------------------------


@pytest.fixture
def cpu_backend() -> TransferBackend:
    return TransferBackend(make_caches("flash_attn", "cpu"), C)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(slot_mapping=[0, NB * BS]), f"slot id {NB * BS} out of range [0, {NB * BS})"),
        (dict(slot_mapping=[-1, 3]), "slot id -1 out of range"),
        (dict(slot_mapping=list(range(C + 1))), f"{C + 1} tokens at"),
        (dict(slot_mapping=[1, 2, 3], offset=C - 2), f"offset={C - 2} do not fit"),
        (dict(slot_mapping=[1], offset=-1), "offset=-1"),
    ],
)
@pytest.mark.parametrize("direction", ["save", "load"])
def test_bad_slot_mapping(cpu_backend: TransferBackend, direction: str, kwargs, needle):
    slot = host_slot(cpu_backend)
    call = getattr(cpu_backend, direction)
    with pytest.raises(ValueError) as err:
        call(slot, kwargs["slot_mapping"], kwargs.get("offset", 0))
    assert needle in str(err.value)


def test_bad_slot_tensor(cpu_backend: TransferBackend):
    with pytest.raises(
        ValueError, match=r"dtype torch\.float16, but the caches are torch\.bfloat16"
    ):
        cpu_backend.save(torch.empty(cpu_backend.chunk_shape, dtype=torch.float16), [0])
    with pytest.raises(ValueError, match="expected chunk shape"):
        cpu_backend.load(torch.empty(L, 2, C + 1, H * D, dtype=torch.bfloat16), [0])
    strided = torch.empty(L, 2, 2 * C, H * D, dtype=torch.bfloat16)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        cpu_backend.save(strided, [0])
    with pytest.raises(TypeError, match="integers"):
        cpu_backend.save(host_slot(cpu_backend), torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="integers"):
        cpu_backend.load(host_slot(cpu_backend), [0, 1.5])


def test_load_rejects_duplicate_slots(cpu_backend: TransferBackend):
    with pytest.raises(ValueError, match="twice"):
        cpu_backend.load(host_slot(cpu_backend), [5, 6, 5])


@pytest.mark.cuda
@CUDA
def test_cuda_requires_pinned_slot():
    backend = TransferBackend(make_caches("flash_attn", "cuda"), C)
    with pytest.raises(ValueError, match="pinned"):
        backend.save(torch.empty(backend.chunk_shape, dtype=torch.bfloat16), [0])


# -- helpers ------------------------------------------------------------------------------------


def test_slot_mapping_for():
    assert slot_mapping_for([7, 2], 4, 0, 8) == [28, 29, 30, 31, 8, 9, 10, 11]
    assert slot_mapping_for([7, 2, 5], 4, 3, 9) == [31, 8, 9, 10, 11, 20]
    assert slot_mapping_for([7], 4, 2, 2) == []
    with pytest.raises(ValueError, match="capacity 8"):
        slot_mapping_for([7, 2], 4, 0, 9)
    with pytest.raises(ValueError, match="does not fit"):
        slot_mapping_for([7, 2], 4, 5, 3)


class FakeEvent:
    """Stands in for a torch.cuda.Event: finished when the test says so."""

    def __init__(self) -> None:
        self.finished = False
        self.waited_on: list[object] = []

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = True

    def wait(self, stream: object = None) -> None:
        self.waited_on.append(stream)


def test_handle_tracks_its_event():
    assert TransferHandle().done()
    event = FakeEvent()
    handle = TransferHandle(event)
    assert not handle.done()
    event.finished = True
    assert handle.done()
    handle.wait()  # finished: nothing to wait for
    assert event.waited_on == []
    other = FakeEvent()
    handle = TransferHandle(other)
    handle.synchronize()
    assert handle.done()


# -- ordering against the forward pass's stream (CUDA) ---------------------------------------

# GPU cycles a stream is kept busy for (about 0.1 s): long enough that an unordered transfer or
# read would run first.
_SPIN = 200_000_000


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_load_lands_before_a_forward_on_another_stream(layout: str):
    """vLLM runs the forward pass on a non-default stream. A load ordered against that stream
    (``after``, then ``handle.wait(stream)``) is visible to the work issued there next, even
    while the transfer stream is held back."""
    caches = make_caches(layout, "cuda")
    backend = TransferBackend(caches, C)
    slot = host_slot(backend)
    fill_random(slot, 99)
    mapping = slot_mapping_for([3, 8], BS, 0, 8)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        compute = backend.compute_stream()
        assert compute == forward
        with torch.cuda.stream(backend._stream):
            torch.cuda._sleep(_SPIN)  # the transfer stream is busy for a while
        handle = backend.load(slot, mapping, after=(compute,))
        handle.wait(compute)
        seen = snapshot(caches)  # the forward pass reads the blocks
    torch.cuda.synchronize()
    for layer, cache in enumerate(seen):
        for kv in range(2):
            for i, s in enumerate(mapping):
                assert torch.equal(
                    bits(token(cache, layout, kv, s).cpu()), bits(slot[layer, kv, i])
                )


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_save_reads_what_a_forward_on_another_stream_wrote(layout: str):
    """A save ordered after the forward's stream reads the KV the forward wrote, though it is
    issued from another stream (the default one, which knows nothing of the forward) and the
    forward is still running when it is issued."""
    caches = make_caches(layout, "cuda")
    backend = TransferBackend(caches, C)
    slot = host_slot(backend, fill=0)
    mapping = slot_mapping_for([5, 9], BS, 0, 2 * BS)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        compute = backend.compute_stream()
        torch.cuda._sleep(_SPIN)  # a long forward pass...
        for cache in caches.values():  # ...that writes the KV of blocks 5 and 9
            block_of(cache, layout, 5).fill_(1.5)
            block_of(cache, layout, 9).fill_(-2.5)
    handle = backend.save(slot, mapping, after=(compute,))
    handle.synchronize()
    assert (slot[:, :, :BS] == 1.5).all()
    assert (slot[:, :, BS : 2 * BS] == -2.5).all()


# --- vLLM's CPU attention layout (cpu_attn) ------------------------------------------------
# [num_blocks, num_kv_heads, block_size, 2 * head_size]; inside a (block, head) the kernel's own
# order. The host slot is in the layout's native pool format, [L, chunk blocks, H, block_size,
# 2 * head_size]: each block as the cache holds it, so a token at chunk position p is where a
# cache of the chunk's blocks keeps slot p. The reference below reads and writes tokens with
# views (transposes and reshapes), not with the offset tables the backend uses;
# tests/engine/test_cpu_layout.py checks both against vLLM's real kernel and against
# transformers' K/V.
CB, CD = 32, 16  # cpu_attn block size (a multiple of 32, as the backend requires) and head size
CC = 3 * CB  # cpu_attn chunk: whole blocks


def cpu_token_views(cache: torch.Tensor, isa: str, block: int, head: int, t: int):
    """K and V of token ``t`` in ``(block, head)``, as views into cache whose flattening
    (``reshape(-1)``) is in dim order."""
    region = cache[block, head].view(-1)
    n = CB * CD
    k_reg, v_reg = region[:n], region[n:]
    if isa == "vec":
        return k_reg.view(CD, CB)[:, t], v_reg.view(CB, CD)[t]
    # amx: K [bs/16, D/16, 8, 16, 2] over (t//16, d//16, (d%16)//2, t%16, d%2);
    #      V [D/16, bs/2, 16, 2] over (d//16, t//2, d%16, t%2).
    k = k_reg.view(CB // 16, CD // 16, 8, 16, 2)[t // 16, :, :, t % 16, :]
    v = v_reg.view(CD // 16, CB // 2, 16, 2)[:, t // 2, :, t % 2]
    return k, v


def cpu_token(cache: torch.Tensor, isa: str, slot_id: int) -> torch.Tensor:
    """K and V of the token at ``slot_id`` of a cpu_attn cache (or of a host slot's layer,
    ``slot_id`` then a chunk position), ``[2, H, D]``."""
    block, t = divmod(slot_id, CB)
    pairs = [cpu_token_views(cache, isa, block, head, t) for head in range(H)]
    return torch.stack([torch.stack([k.reshape(-1), v.reshape(-1)]) for k, v in pairs], dim=1)


def make_cpu_caches(isa: str, num_blocks: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    dtype = torch.float32 if isa == "vec" else torch.bfloat16
    caches = {}
    for i in range(L):
        cache = torch.empty(num_blocks, H, CB, 2 * CD, dtype=dtype)
        fill_random(cache, seed + i)
        caches[f"model.layers.{i}.self_attn.attn"] = cache
    return caches


def cpu_backend_for(isa: str, caches: dict[str, torch.Tensor], monkeypatch) -> TransferBackend:
    """A backend on ``caches`` that takes them as written by kernel ``isa`` (on this machine
    vLLM's pick depends on the CPU: AMX tiles or not)."""
    import kvledger.connector.kv_layout as kv_layout

    monkeypatch.setattr(kv_layout, "cpu_attn_isa", lambda dtype, bs, d: isa)
    backend = TransferBackend(caches, CC)
    assert backend.spec.layout == "cpu_attn" and backend.spec.cpu_isa == isa
    assert (backend.spec.block_size, backend.spec.head_size) == (CB, CD)
    return backend


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attn_pool_format_is_the_kernels_blocks(isa: str, monkeypatch):
    """The pool format names the kernel and the block size; a slot is the chunk's blocks as
    the cache holds them, with the bytes of a token-major slot; a chunk that is not whole
    blocks is refused, naming the format."""
    backend = cpu_backend_for(isa, make_cpu_caches(isa), monkeypatch)
    spec = backend.spec
    assert spec.pool_format == f"cpu_attn-{isa}-block{CB}"
    assert backend.chunk_shape == (L, CC // CB, H, CB, 2 * CD)
    assert backend.slot_bytes == CC * spec.token_bytes
    with pytest.raises(ValueError, match=f"pool format cpu_attn-{isa}-block{CB}.*multiple"):
        spec.chunk_shape(CB + 1)
    flash = describe_kv_caches(make_caches("flash_attn", "cpu"))
    assert (
        flash.pool_format
        == "tokens"
        == describe_kv_caches(make_caches("flashinfer", "cpu")).pool_format
    )


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attn_whole_blocks_are_the_caches_bytes(isa: str, monkeypatch):
    """A whole-chunk save copies each block's bytes as they are; a load of them into other
    blocks makes those blocks equal to the first, and touches nothing else."""
    caches = make_cpu_caches(isa, num_blocks=7, seed=4)
    backend = cpu_backend_for(isa, caches, monkeypatch)
    src, dst = [5, 0, 3], [2, 6, 4]
    slot = host_slot(backend)
    backend.save(slot, slot_mapping_for(src, CB, 0, CC)).synchronize()
    for layer, cache in enumerate(caches.values()):
        assert torch.equal(bits(slot[layer]), bits(cache[src]))
    before = snapshot(caches)
    backend.load(slot, slot_mapping_for(dst, CB, 0, CC)).synchronize()
    for cache, old in zip(caches.values(), before, strict=True):
        assert torch.equal(bits(cache[dst]), bits(old[src]))
        keep = [b for b in range(7) if b not in dst]
        assert torch.equal(bits(cache[keep]), bits(old[keep]))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attn_partial_blocks_at_both_ends(isa: str, monkeypatch):
    """A worker's range that starts and ends inside a block (tokens 13 to 83: the last 19
    tokens of a block, a whole block, the first 19 of another; odd and even ends, inside
    and across amx's 16-token and 2-token groups) saves exactly its tokens, at their chunk
    positions, and loads exactly them back into other blocks, nothing else."""
    caches = make_cpu_caches(isa, num_blocks=7, seed=6)
    backend = cpu_backend_for(isa, caches, monkeypatch)
    start, end = 13, 83
    src = slot_mapping_for([4, 1, 5], CB, start, end)
    slot = host_slot(backend, fill=0x3C3C)
    backend.save(slot, src, dst_offset=start).synchronize()
    for layer, cache in enumerate(caches.values()):
        for pos in range(CC):
            got = bits(cpu_token(slot[layer], isa, pos))
            if start <= pos < end:
                assert torch.equal(got, bits(cpu_token(cache, isa, src[pos - start]))), pos
            else:
                assert bool((got == 0x3C3C).all()), pos
    dst = slot_mapping_for([6, 0, 2], CB, start, end)
    before = snapshot(caches)
    backend.load(slot, dst, src_offset=start).synchronize()
    for layer, (cache, old) in enumerate(zip(caches.values(), before, strict=True)):
        expect = old.clone()
        for i, s in enumerate(dst):
            block, t = divmod(s, CB)
            for head in range(H):
                k, v = cpu_token_views(expect, isa, block, head, t)
                k.copy_(cpu_token(old, isa, src[i])[0, head].view(k.shape))
                v.copy_(cpu_token(old, isa, src[i])[1, head].view(v.shape))
        assert torch.equal(bits(cache), bits(expect)), layer


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attn_save_reads_each_token_where_the_kernel_put_it(isa: str, monkeypatch):
    """A save of scattered tokens (each at another place in its chunk block than in its cache
    block: element by element) holds, per layer, token and head, exactly the K and V the
    kernel's order keeps for that token, at the chunk position's place."""
    caches = make_cpu_caches(isa, seed=3)
    backend = cpu_backend_for(isa, caches, monkeypatch)
    scattered = [4 * CB + 30, 4 * CB + 31, 1 * CB + 0, 1 * CB + 1, 1 * CB + 17]
    shifted = [2 * CB + 5, 2 * CB + 6, 2 * CB + 7]  # one block's run, 2 places further on
    for slots in (scattered, shifted):
        slot = host_slot(backend, fill=7)
        backend.save(slot, slots, dst_offset=3).synchronize()
        for layer, cache in enumerate(caches.values()):
            for pos in range(CC):
                got = bits(cpu_token(slot[layer], isa, pos))
                if 3 <= pos < 3 + len(slots):
                    want = bits(cpu_token(cache, isa, slots[pos - 3]))
                    assert torch.equal(got, want), (layer, pos)
                else:  # positions outside the call's kept what they held
                    assert bool((got == 7).all()), (layer, pos)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_attn_partial_reload_writes_only_its_tokens(isa: str, monkeypatch):
    """A partial chunk loaded mid-block lands token by token where the kernel reads it, and
    every other element of every cache (the block's other tokens included) is unchanged."""
    caches = make_cpu_caches(isa, seed=5)
    backend = cpu_backend_for(isa, caches, monkeypatch)
    src = host_slot(backend)
    fill_random(src, 99)
    dst = [2 * CB + 9, 2 * CB + 10, 2 * CB + 11, 5 * CB + 31]
    before = snapshot(caches)
    backend.load(src, dst, src_offset=6).synchronize()
    for layer, (cache, old) in enumerate(zip(caches.values(), before, strict=True)):
        expect = old.clone()
        for i, s in enumerate(dst):
            block, t = divmod(s, CB)
            row = cpu_token(src[layer], isa, 6 + i)
            for head in range(H):
                k, v = cpu_token_views(expect, isa, block, head, t)
                k.copy_(row[0, head].view(k.shape))
                v.copy_(row[1, head].view(v.shape))
        assert torch.equal(bits(cache), bits(expect)), layer


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_slot_tokens_reads_a_native_slot_token_by_token(isa: str, monkeypatch):
    """``slot_tokens`` shows a cpu_attn slot as [L, 2, T, H*D], K and V of each token."""
    from kvledger.connector.kv_layout import slot_tokens

    caches = make_cpu_caches(isa, seed=9)
    backend = cpu_backend_for(isa, caches, monkeypatch)
    src = slot_mapping_for([3, 0, 5], CB, 0, CC)
    slot = host_slot(backend)
    backend.save(slot, src).synchronize()
    rows = slot_tokens(backend.spec, slot)
    assert rows.shape == (L, 2, CC, H * CD)
    for layer, cache in enumerate(caches.values()):
        for pos, s in enumerate(src):
            assert torch.equal(bits(rows[layer, :, pos]), bits(cpu_token(cache, isa, s).flatten(1)))
    flash = TransferBackend(make_caches("flash_attn", "cpu"), C)
    token_slot = host_slot(flash)
    assert slot_tokens(flash.spec, token_slot) is token_slot


@pytest.mark.parametrize(
    ("caches", "needles"),
    [
        ({"a": torch.empty(4, 2, 32, 33)}, ["(4, 2, 32, 33)", "cpu_attn"]),
        (
            {"a": torch.empty(4, 2, 32, 64).transpose(0, 1)},
            ["(2, 4, 32, 64)", "not contiguous"],
        ),
        ({"a": torch.empty(4, 2, 32, 160)}, ["(4, 2, 32, 160)", "'vec16'"]),
    ],
    ids=["odd-last-dim", "strided", "vec16-kernel"],
)
def test_cpu_attn_rejects_what_it_cannot_move(caches, needles):
    with pytest.raises(KVCacheLayoutError) as err:
        describe_kv_caches(caches)
    for needle in needles:
        assert needle in str(err.value)


def test_cpu_attn_layout_named_for_a_5d_cache_is_refused():
    with pytest.raises(KVCacheLayoutError, match=re.escape("(2, 12, 4, 2, 8)")):
        describe_kv_caches({"a": torch.empty(2, 12, 4, 2, 8)}, "cpu_attn")


def test_cpu_isa_names_the_kernel_order():
    """``cpu_isa`` takes the caches as that kernel's, whatever this CPU would run; a kernel
    whose order is not known is refused by name."""
    caches = make_cpu_caches("amx", num_blocks=4, seed=2)
    assert TransferBackend(caches, CC, cpu_isa="amx").spec.cpu_isa == "amx"
    assert describe_kv_caches(caches, cpu_isa="vec").cpu_isa == "vec"
    with pytest.raises(KVCacheLayoutError, match=re.escape("cpu_isa='vec16'")) as err:
        describe_kv_caches(caches, cpu_isa="vec16")
    assert "('vec', 'amx')" in str(err.value)


def test_transfer_keeps_the_names_users_import_from_it():
    """The layout facts moved to connector/kv_layout.py; connector.transfer still exports every
    name it exported before, each the very object of its home (one definition, so a patch of
    ``kv_layout.cpu_attn_isa`` is what the engine sees)."""
    import kvledger.connector.kv_layout as kv_layout
    import kvledger.connector.transfer as transfer

    before = {
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
    }
    assert set(transfer.__all__) == before
    for name in before - {"TransferBackend", "TransferHandle"}:
        assert getattr(transfer, name) is getattr(kv_layout, name), name
