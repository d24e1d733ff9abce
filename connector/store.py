"""The embedded host chunk pool: worker-side host memory that KV chunks are saved into.

Rule of this module: it holds bytes and knows which slots have a transfer in flight, nothing
more. Which chunk lives in which slot, LRU order and eviction are decided by the scheduler side's
chunk index and reach the worker as plans; the pool never picks a slot by itself.

All slots live in ONE preallocated tensor, so the pool costs one allocation (and one pinning) at
start-up and none per chunk. On CUDA the memory is pinned, because a ``non_blocking`` copy from
pageable memory is silently synchronous.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

from kvledger.connector.kv_layout import PagedKVSpec
from kvledger.connector.transfer import TransferBackend, TransferHandle

__all__ = ["HostChunkPool", "SlotBusyError", "SlotMode"]

SlotMode = Literal["read", "write"]


class SlotBusyError(RuntimeError):
    """A transfer would touch a host slot that another transfer is still reading or writing."""


class HostChunkPool:
    """``num_slots`` host chunk slots of ``spec.chunk_shape(chunk_tokens)``, in one tensor, in
    ``spec``'s pool format (``connector.kv_layout``): a slot's bytes are meaningful only to a
    backend of that format."""

    def __init__(
        self,
        spec: PagedKVSpec,
        chunk_tokens: int,
        num_slots: int,
        *,
        pin: bool | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.spec = spec
        self.chunk_tokens = chunk_tokens
        self.chunk_shape = spec.chunk_shape(chunk_tokens)
        self.slot_bytes = spec.chunk_bytes(chunk_tokens)
        if pin is None:
            pin = spec.device.type == "cuda" and torch.cuda.is_available()
        self.pinned = pin
        self._buffer = torch.empty((num_slots, *self.chunk_shape), dtype=spec.dtype)
        if pin and not _pin_in_place(self._buffer, self):
            # cudaHostRegister is unavailable: fall back to the CUDA caching host allocator,
            # which rounds the allocation up to a power of two.
            self._buffer = torch.empty(
                (num_slots, *self.chunk_shape), dtype=spec.dtype, pin_memory=True
            )
        # The transfers that may still be running, by slot (``_live``): a slot's list is made
        # when the slot is first used, and kept. A small model's default pool has hundreds of
        # thousands of slots, and a list for each took half a second to build (and
        # ``wait_all`` as long to walk).
        self._pending: dict[int, list[tuple[SlotMode, TransferHandle]]] = {}
        self._staging: torch.Tensor | None = None  # staging(), made on first use

    @classmethod
    def from_bytes_budget(
        cls,
        host_pool_bytes: int,
        spec: PagedKVSpec,
        chunk_tokens: int,
        *,
        pin: bool | None = None,
    ) -> HostChunkPool:
        """As many slots as fit in ``host_pool_bytes``."""
        slot_bytes = spec.chunk_bytes(chunk_tokens)
        num_slots = host_pool_bytes // slot_bytes
        if num_slots == 0:
            raise ValueError(
                f"host pool budget of {host_pool_bytes} bytes is smaller than one chunk slot "
                f"of {slot_bytes} bytes ({spec.num_layers} layers x K/V x {chunk_tokens} tokens "
                f"x {spec.num_kv_heads * spec.head_size} x {spec.element_size} B)"
            )
        return cls(spec, chunk_tokens, num_slots, pin=pin)

    @property
    def num_slots(self) -> int:
        return self._buffer.shape[0]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, i: int) -> torch.Tensor:
        """View of slot ``i``; bookkeeping is the caller's job when it transfers through this."""
        self._check_index(i)
        return self._buffer[i]

    def staging(self) -> torch.Tensor:
        """One chunk of host memory outside the slots, pinned when the slots are: where bytes
        from elsewhere (a remote tier's value, pageable) are put for a copy to the device,
        which reads pinned memory only (``TransferBackend``). One buffer, made on first use
        and reused: its user waits for each copy out of it before the next."""
        if self._staging is None:
            self._staging = torch.empty(
                self.chunk_shape, dtype=self.spec.dtype, pin_memory=self.pinned
            )
        return self._staging

    # -- transfers with bookkeeping -----------------------------------------------------------

    def save(
        self,
        backend: TransferBackend,
        i: int,
        slot_mapping: torch.Tensor | Sequence[int],
        offset: int = 0,
        *,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        """Save the tokens at ``slot_mapping`` into slot ``i`` at ``offset``, and track it
        (``after``: see ``TransferBackend.save``)."""
        self._check_backend(backend)
        pending = self._claim(i, "write")
        handle = backend.save(self._buffer[i], slot_mapping, offset, after=after)
        pending.append(("write", handle))
        return handle

    def load(
        self,
        backend: TransferBackend,
        i: int,
        slot_mapping: torch.Tensor | Sequence[int],
        offset: int = 0,
        *,
        after: Sequence[Any] = (),
    ) -> TransferHandle:
        """Load slot ``i`` from ``offset`` into the cache at ``slot_mapping``, and track it
        (``after``: see ``TransferBackend.load``)."""
        self._check_backend(backend)
        pending = self._claim(i, "read")
        handle = backend.load(self._buffer[i], slot_mapping, offset, after=after)
        pending.append(("read", handle))
        return handle

    def track(self, i: int, mode: SlotMode, handle: TransferHandle) -> None:
        """Record a transfer on slot ``i`` that was issued through :meth:`slot` directly."""
        self._claim(i, mode).append((mode, handle))

    def in_flight(self, i: int) -> bool:
        """True while a transfer on slot ``i`` may still be running."""
        self._check_index(i)
        return bool(self._live(i))

    def wait_slot(self, i: int) -> None:
        """Block the host until every transfer touching slot ``i`` has finished."""
        self._check_index(i)
        pending = self._pending.get(i)
        if pending:
            for _, handle in pending:
                with contextlib.suppress(Exception):  # failed: over all the same (see _over)
                    handle.synchronize()
            pending.clear()

    def wait_all(self) -> None:
        for i in self._pending:  # the slots ever used
            self.wait_slot(i)

    # -- internals ----------------------------------------------------------------------------

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range [0, {self.num_slots})")

    def _check_backend(self, backend: TransferBackend) -> None:
        theirs, mine = backend.spec, self.spec
        if (backend.chunk_shape, theirs.dtype, theirs.pool_format) != (
            self.chunk_shape,
            mine.dtype,
            mine.pool_format,
        ):
            raise ValueError(
                f"backend moves chunks of {backend.chunk_shape} {theirs.dtype} in pool format "
                f"{theirs.pool_format}, but this pool holds {self.chunk_shape} {mine.dtype} in "
                f"{mine.pool_format}"
            )

    def _live(self, i: int) -> list[tuple[SlotMode, TransferHandle]]:
        """Slot ``i``'s transfers that may still be running, those over dropped; the list is
        made on the slot's first use and kept (so a transfer adds to it, allocating nothing)."""
        pending = self._pending.get(i)
        if pending is None:
            pending = self._pending[i] = []
        elif pending:
            pending[:] = [(m, h) for m, h in pending if not _over(h)]
        return pending

    def _claim(self, i: int, mode: SlotMode) -> list[tuple[SlotMode, TransferHandle]]:
        """Refuse a transfer that would race one in flight: a write must be alone on its slot;
        reads may share it with other reads. Returns the slot's list, to add the transfer to."""
        self._check_index(i)
        pending = self._live(i)
        for other, _ in pending:
            if mode == "write" or other == "write":
                raise SlotBusyError(
                    f"slot {i}: cannot start a {mode} while a {other} is in flight; "
                    f"call wait_slot({i}) first"
                )
        return pending


def _over(handle: TransferHandle) -> bool:
    """Whether a transfer no longer uses its slot: done, or failed (its event raised, the
    device's error). A failure is its owner's to report (the worker's saves in flight); kept
    here, it would raise again at every later transfer on the slot, and refuse them all."""
    try:
        return handle.done()
    except Exception:
        return True


def _pin_in_place(buffer: torch.Tensor, owner: object) -> bool:
    """Pin ``buffer`` with cudaHostRegister until ``owner`` is collected; False if unavailable.

    Registering a plain allocation pins exactly its size, where ``pin_memory=True`` rounds up to
    a power of two (100 GB becomes 128 GB); vLLM's CPU offloading registers for the same reason.
    """
    try:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped in torch
        err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    except (AttributeError, RuntimeError):
        return False
    if int(getattr(err, "value", err)) != 0:
        return False
    weakref.finalize(owner, _unpin, cudart, buffer)
    return True


def _unpin(cudart: Any, buffer: torch.Tensor) -> None:
    # At interpreter shutdown the CUDA runtime may be gone already; the process is ending anyway.
    with contextlib.suppress(Exception):
        cudart.cudaHostUnregister(buffer.data_ptr())
