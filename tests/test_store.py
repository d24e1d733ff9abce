"""Tests for connector/store.py: the host chunk pool's memory and in-flight bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kvledger.connector.kv_layout import describe_kv_caches, slot_mapping_for
from kvledger.connector.store import HostChunkPool, SlotBusyError
from kvledger.connector.transfer import TransferBackend, TransferHandle

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]

L, NB, BS, H, D, C = 2, 8, 4, 2, 8, 8


def make_caches(device: str = "cpu") -> dict[str, torch.Tensor]:
    caches = {}
    for i in range(L):
        cache = torch.empty((2, NB, BS, H, D), dtype=torch.float16, device=device)
        cache.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, cache.shape, generator=torch.Generator().manual_seed(i))
        )
        caches[f"l{i}"] = cache
    return caches


SPEC = describe_kv_caches(make_caches())
SLOT_BYTES = L * 2 * C * H * D * 2


class FakeEvent:
    """Stands in for a torch.cuda.Event: finished when the test says so."""

    def __init__(self) -> None:
        self.finished = False
        self.synchronized = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.synchronized = True
        self.finished = True

    def wait(self, stream: object = None) -> None:
        raise AssertionError("the pool must block the host, not a stream")


def pending() -> tuple[TransferHandle, FakeEvent]:
    event = FakeEvent()
    return TransferHandle(event), event


def test_slots_are_views_of_one_buffer():
    pool = HostChunkPool(SPEC, C, 3)
    assert pool.num_slots == 3
    assert pool.slot_bytes == SLOT_BYTES == SPEC.chunk_bytes(C)
    assert pool.nbytes == 3 * SLOT_BYTES
    assert not pool.pinned
    slots = [pool.slot(i) for i in range(3)]
    for i, s in enumerate(slots):
        assert s.shape == (L, 2, C, H * D)
        assert s.dtype == torch.float16
        assert s.is_contiguous()
        assert s.data_ptr() == slots[0].data_ptr() + i * SLOT_BYTES
    for i, s in enumerate(slots):
        s.fill_(float(i))
    for i in range(3):
        assert (pool.slot(i) == float(i)).all()
    with pytest.raises(IndexError, match=r"slot 3 out of range \[0, 3\)"):
        pool.slot(3)
    with pytest.raises(IndexError):
        pool.slot(-1)


def test_from_bytes_budget_rounds_down():
    pool = HostChunkPool.from_bytes_budget(3 * SLOT_BYTES + SLOT_BYTES // 2, SPEC, C)
    assert pool.num_slots == 3
    assert HostChunkPool.from_bytes_budget(SLOT_BYTES, SPEC, C).num_slots == 1


def test_from_bytes_budget_too_small_names_both_sizes():
    with pytest.raises(ValueError) as err:
        HostChunkPool.from_bytes_budget(SLOT_BYTES - 1, SPEC, C)
    msg = str(err.value)
    assert f"{SLOT_BYTES - 1} bytes" in msg
    assert f"{SLOT_BYTES} bytes" in msg


def test_num_slots_must_be_positive():
    with pytest.raises(ValueError, match="num_slots"):
        HostChunkPool(SPEC, C, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_through_the_pool(device: str):
    """Bytes saved into one slot load back bitwise; the neighbouring slot is untouched."""
    caches = make_caches(device)
    backend = TransferBackend(caches, C)
    pool = HostChunkPool(backend.spec, C, 2)
    assert pool.pinned == (device == "cuda")
    pool.slot(0).view(torch.int16).fill_(99)
    src, dst = slot_mapping_for([5, 1], BS, 0, C), slot_mapping_for([2, 7], BS, 0, C)
    pool.save(backend, 1, src)
    pool.wait_slot(1)
    assert not pool.in_flight(1)
    before = [c.clone() for c in caches.values()]
    handle = pool.load(backend, 1, dst)
    handle.wait()
    for cache, old in zip(caches.values(), before, strict=True):
        for s_blk, d_blk in ((5, 2), (1, 7)):
            assert torch.equal(cache[:, d_blk].view(torch.int16), old[:, s_blk].view(torch.int16))
    assert (pool.slot(0).view(torch.int16) == 99).all()
    pool.wait_all()


@pytest.mark.cuda
@CUDA
def test_cuda_pool_is_pinned():
    spec = describe_kv_caches(make_caches("cuda"))
    pool = HostChunkPool(spec, C, 2)
    assert pool.pinned
    assert pool.slot(1).is_pinned()


def test_backend_must_match_pool():
    backend = TransferBackend(make_caches(), 2 * C)
    pool = HostChunkPool(SPEC, C, 1)
    with pytest.raises(ValueError, match="this pool holds"):
        pool.save(backend, 0, [0])


def test_write_waits_for_everything_read_waits_for_writes():
    pool = HostChunkPool(SPEC, C, 2)
    write, write_event = pending()
    pool.track(0, "write", write)
    assert pool.in_flight(0)
    assert not pool.in_flight(1)
    with pytest.raises(SlotBusyError, match="slot 0: cannot start a write while a write"):
        pool.track(0, "write", pending()[0])
    with pytest.raises(SlotBusyError, match="cannot start a read while a write"):
        pool.track(0, "read", pending()[0])
    pool.track(1, "read", pending()[0])  # other slots are independent

    write_event.finished = True
    assert not pool.in_flight(0)
    read_a, event_a = pending()
    read_b, event_b = pending()
    pool.track(0, "read", read_a)
    pool.track(0, "read", read_b)  # reads share a slot
    with pytest.raises(SlotBusyError, match="cannot start a write while a read"):
        pool.track(0, "write", pending()[0])
    event_a.finished = True
    with pytest.raises(SlotBusyError):
        pool.track(0, "write", pending()[0])
    event_b.finished = True
    pool.track(0, "write", pending()[0])


def test_busy_slot_refuses_pool_transfers():
    """pool.save / pool.load check the bookkeeping before they issue anything."""
    backend = TransferBackend(make_caches(), C)
    pool = HostChunkPool(backend.spec, C, 1)
    pool.slot(0).view(torch.int16).fill_(5)
    pool.track(0, "write", pending()[0])
    with pytest.raises(SlotBusyError):
        pool.save(backend, 0, [0, 1])
    with pytest.raises(SlotBusyError):
        pool.load(backend, 0, [0, 1])
    assert (pool.slot(0).view(torch.int16) == 5).all()


def test_wait_slot_blocks_on_every_pending_transfer():
    pool = HostChunkPool(SPEC, C, 2)
    (read_a, event_a), (read_b, event_b) = pending(), pending()
    pool.track(1, "read", read_a)
    pool.track(1, "read", read_b)
    pool.wait_slot(1)
    assert event_a.synchronized and event_b.synchronized
    assert not pool.in_flight(1)
    pool.track(1, "write", pending()[0])
    other, other_event = pending()
    pool.track(0, "write", other)
    pool.wait_all()
    assert other_event.synchronized
    assert not pool.in_flight(0) and not pool.in_flight(1)


def test_a_pool_of_a_million_slots_keeps_nothing_per_idle_slot():
    """A small model's default pool has hundreds of thousands of slots (4 GiB of 16 KiB
    chunks): the bookkeeping holds only the slots with a transfer, so building the pool and
    waiting for it cost what those transfers cost, not what the slots would."""
    import tracemalloc

    n = 1 << 20
    tracemalloc.start()
    try:
        pool = HostChunkPool(SPEC, C, n)
        built = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert pool.num_slots == n
    # A list per slot (56 bytes, and 8 for its place in the list of them) measured 67 MB.
    assert built < 1 << 20, f"{built:,} bytes of Python objects for an idle pool"
    write, write_event = pending()
    read, read_event = pending()
    pool.track(n - 1, "write", write)
    pool.track(7, "read", read)
    assert pool.in_flight(n - 1) and pool.in_flight(7) and not pool.in_flight(8)
    read_event.finished = True
    assert not pool.in_flight(7)
    pool.track(7, "write", pending()[0])  # the finished read no longer holds the slot
    pool.wait_all()
    assert write_event.synchronized
    assert not pool.in_flight(n - 1) and not pool.in_flight(7)
    with pytest.raises(IndexError, match=rf"slot {n} out of range"):
        pool.in_flight(n)
