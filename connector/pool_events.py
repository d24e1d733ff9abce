"""KV events for the pool: what kvledger's tiers hold, told to vLLM's KV-event stream.

With vLLM's KV cache events on (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``),
vLLM publishes its prefix cache as ``BlockStored`` / ``BlockRemoved`` events (medium ``GPU``),
and KV-aware routers (llm-d's KV-cache manager, Dynamo's KV router) count a prefix as cached
where those events put it. vLLM also collects ``take_events()`` from the connector; this module
is what ours answers:

- a chunk the host pool confirms (every worker reported it saved) is one ``BlockStored`` with
  medium ``CPU``: vLLM's own block hashes for its whole blocks (the hashes the prefix cache
  publishes for the same tokens), the hash of the block before it, its token ids and vLLM's
  block size;
- a chunk that leaves the pool (evicted for room, dropped after a failed read) is one
  ``BlockRemoved`` (medium ``CPU``) of its hashes that no other chunk the pool still holds
  contains: a partial chunk and a whole one can hold the same blocks, and a router that does
  not count references would otherwise forget a block still cached;
- the remote tier, shared by every engine, has a medium of its own, ``REMOTE``
  (:data:`MEDIUM_REMOTE`): a write of this engine that every rank confirmed is a ``BlockStored``,
  and a key that a load found gone or not its chunk's is a ``BlockRemoved``. What other engines
  write or evict there is in their streams, not this one. The tier has no bound, so what this
  engine remembers of it has one (``REMOTE_MEMORY`` chunks, as the remote index): a chunk
  forgotten is announced removed, the cautious side for a router.

The facts a ``BlockStored`` needs (vLLM's hashes, the tokens) exist only while vLLM's
``Request`` does, so they are taken when the save is planned (:meth:`PoolEvents.planned`), from
the request, and published when the tier confirms the chunk, as vLLM's OffloadingConnector does
(its ``OffloadingEventsTracker``). A chunk stays described while the pool holds it; for a
``BlockRemoved`` only its hashes are kept.

Nothing here runs with events off: the scheduler side makes no ``PoolEvents`` and the chunk
index has no watcher. Records are plain values (:class:`PoolEvent`); ``connector/vllm.py``
turns them into vLLM's classes through ``connector/edge.py``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs

from kvledger.tracker.chunks import REMOTE_MEMORY

__all__ = ["MEDIUM_CPU", "MEDIUM_REMOTE", "PoolEvent", "PoolEvents"]

MEDIUM_CPU = "CPU"  # vLLM's own name for a host-memory tier (vllm.distributed.kv_events)
MEDIUM_REMOTE = "REMOTE"  # kvledger's remote tier (Redis, file://, a plug-in), shared by engines


@attrs.frozen(slots=True)
class PoolEvent:
    """One KV event, as plain values: ``stored`` (a ``BlockStored``) or not (a
    ``BlockRemoved``, whose ``parent``, ``token_ids`` and ``block_size`` are unused)."""

    stored: bool
    medium: str
    block_hashes: tuple[Any, ...]
    parent: Any = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0


@attrs.frozen(slots=True)
class _Chunk:
    """What a ``BlockStored`` of one chunk says: vLLM's hashes of its whole blocks, the hash
    before them, their tokens."""

    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: tuple[int, ...]


class PoolEvents:
    """The scheduler side's KV events: described when planned, published when a tier confirms
    or drops a chunk, handed to vLLM by :meth:`take`."""

    def __init__(self, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        # Planned saves not yet settled, oldest first. A save settles (stored, failed, or
        # cancelled) at its worker's report; the bound only guards against a report that never
        # comes (a process gone): a pool of num_slots cannot have more writes in flight.
        self._planned: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._limit = max(64, 4 * num_slots)
        # Chunks a tier holds, by medium, oldest first. The pool's are described in full (the
        # remote write of a chunk is confirmed after the pool's, and its BlockStored says the
        # same), bounded by the pool; the remote tier's keep only hashes (it has no bound). And
        # how many held chunks hold each hash: a BlockRemoved names only the hashes no held
        # chunk still has.
        self._held: dict[str, OrderedDict[bytes, _Chunk]] = {
            MEDIUM_CPU: OrderedDict(),
            MEDIUM_REMOTE: OrderedDict(),
        }
        self._holders: dict[str, Counter[Any]] = {MEDIUM_CPU: Counter(), MEDIUM_REMOTE: Counter()}
        self._out: list[PoolEvent] = []
        # Chunks confirmed with nothing to describe them (a warm pool's ChunkStored, a save of
        # blocks vLLM had not hashed): counted, never published half-described.
        self.undescribed = 0

    # --- the facts, from the scheduler side -----------------------------------------------

    def planned(self, request: Any, key: bytes, start: int, end: int) -> None:
        """A save of tokens ``[start, end)`` of ``request`` as the chunk ``key`` is planned:
        describe it from vLLM's request while it exists. Only whole blocks: vLLM hashes no
        partial block, and its events never name one. A key has one writer at a time, and a
        save plan starts at a chunk's first token, so the first description is the chunk's."""
        if key in self._planned or key in self._held[MEDIUM_CPU]:
            return
        hashes = getattr(request, "block_hashes", None)
        bs = self.block_size
        if not hashes or start % bs:
            return
        first, last = start // bs, min(end // bs, len(hashes))
        if last <= first:
            return
        tokens = request.all_token_ids
        chunk = _Chunk(
            tuple(hashes[first:last]),
            hashes[first - 1] if first > 0 else None,
            tuple(tokens[first * bs : last * bs]),
        )
        self._planned[key] = chunk
        while len(self._planned) > self._limit:
            self._planned.popitem(last=False)

    def pool_changed(self, key: bytes, stored: bool) -> None:
        """The chunk index's watcher (``ChunkIndex.watch``): ``key`` became stored in the host
        pool, or left it."""
        if stored:
            self._hold(MEDIUM_CPU, key, self._planned.pop(key, None))
        else:
            self._drop(MEDIUM_CPU, key)

    def settled(self, keys: Iterable[bytes]) -> None:
        """The workers' reports on these saves are in (stored or not): a chunk still planned
        was never stored, and nothing will publish it."""
        for key in keys:
            self._planned.pop(key, None)

    def remote_stored(self, keys: Iterable[bytes]) -> None:
        """This engine's writes of ``keys`` to the remote tier, confirmed by every rank."""
        for key in keys:
            described = self._held[MEDIUM_CPU].get(key) or self._planned.get(key)
            self._hold(MEDIUM_REMOTE, key, described)

    def remote_gone(self, keys: Iterable[bytes]) -> None:
        """A load found ``keys`` gone from the remote tier, or not its chunks' values."""
        for key in keys:
            self._drop(MEDIUM_REMOTE, key)

    def take(self) -> list[PoolEvent]:
        """The events since the last call, in the order they happened."""
        out, self._out = self._out, []
        return out

    # --- the bookkeeping ------------------------------------------------------------------

    def _hold(self, medium: str, key: bytes, chunk: _Chunk | None) -> None:
        held = self._held[medium]
        if key in held:
            return  # already announced on this medium
        if chunk is None:
            self.undescribed += 1
            return
        held[key] = chunk if medium == MEDIUM_CPU else _Chunk(chunk.block_hashes, None, ())
        self._holders[medium].update(chunk.block_hashes)
        self._out.append(
            PoolEvent(
                True, medium, chunk.block_hashes, chunk.parent, chunk.token_ids, self.block_size
            )
        )
        if medium == MEDIUM_REMOTE and len(held) > REMOTE_MEMORY:
            self._drop(medium, next(iter(held)))  # forgotten: announced removed

    def _drop(self, medium: str, key: bytes) -> None:
        chunk = self._held[medium].pop(key, None)
        if chunk is None:
            return
        holders = self._holders[medium]
        gone = []
        for h in chunk.block_hashes:
            holders[h] -= 1
            if holders[h] <= 0:
                del holders[h]
                gone.append(h)
        if gone:
            self._out.append(PoolEvent(False, medium, tuple(gone)))
