"""Chunk keys and the chunk index.

Keys: a chunk's key is a hash chain over the token ids up to its end, so equal prefixes share
keys across requests and a chunk's key names its whole prefix, not just its own tokens. The
chain starts from a root made of the model/layout salt and the request's cache salt. Hashing
uses blake2b over a fixed little-endian encoding: stable across processes, platforms and
Python versions (never Python's ``hash``). Partial chunks (the tail of a prompt shorter than a
chunk) use a separate personalisation, so a partial key can never equal a full one.

Index: which chunks the host pool holds, and in which slot. It is an event-sourced value: it
changes only through ``apply_*`` methods called by the tracker's fold with recorded events,
so replaying a log rebuilds it exactly, and every lookup replays to the same answer. Queries
(``prefix_hit``, ``choose_slots``) never change it.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

__all__ = [
    "BlockPrefixes",
    "ChunkIndex",
    "RemoteKeys",
    "block_prefixes",
    "chunk_keys",
    "packed_chunk_keys",
    "partial_key",
    "root_key",
    "tokens_bytes",
]

_FULL = b"kvledger-full"
_PART = b"kvledger-part"
_ROOT = b"kvledger-root"
KEY_BYTES = 16
# Keys the remote store is known to hold, remembered at most (the oldest fact is forgotten
# first; a lookup asks the store again anyway for every key the host pool misses).
REMOTE_MEMORY = 1 << 18


@functools.lru_cache(maxsize=1024)
def root_key(salt: str, cache_salt: str = "") -> bytes:
    """The chain's start: model/layout salt plus the request's own cache salt. Cached: every
    request of one (salt, cache salt) pair starts from the same root, and bytes are immutable."""
    data = salt.encode() + b"\x00" + cache_salt.encode()
    return hashlib.blake2b(data, digest_size=KEY_BYTES, person=_ROOT).digest()


_TOKEN_BYTES = 4  # a token id is a little-endian uint32 in every key


@functools.lru_cache(maxsize=1024)
def _packer(n: int) -> Callable[..., bytes]:
    # struct's own cache of formats holds 100 and is cleared whole when full: with a
    # format per length, most packs compiled their format again (half a pack's cost).
    return struct.Struct(f"<{n}I").pack


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """``tokens`` as the keys encode them, a little-endian uint32 each. Raises
    ``struct.error`` or ``TypeError`` for an id that is not one (the fold refuses those:
    ``tracker.state``)."""
    return _packer(len(tokens))(*tokens)


def chunk_keys(
    prev: bytes, tokens: Sequence[int], chunk_size: int, first_chunk: int = 0
) -> list[bytes]:
    """Keys of the full chunks of ``tokens`` from chunk ``first_chunk`` on, chained from
    ``prev`` (the key of chunk ``first_chunk - 1``, or the root)."""
    start = first_chunk * chunk_size
    full = (len(tokens) - start) // chunk_size
    if full <= 0:
        return []
    # Packed once, hashed in slices: a pack per chunk cost as much as the hashing.
    return packed_chunk_keys(
        prev, tokens_bytes(tokens[start : start + full * chunk_size]), chunk_size
    )


def packed_chunk_keys(prev: bytes, data: bytes, chunk_size: int) -> list[bytes]:
    """:func:`chunk_keys` of tokens already packed (:func:`tokens_bytes`), chained from
    ``prev``: the keys of the whole chunks ``data`` holds (a partial chunk at its end has
    none). For a caller that packed the tokens anyway (the fold validates a prompt so)."""
    keys: list[bytes] = []
    view = memoryview(data)
    width = chunk_size * _TOKEN_BYTES
    for i in range(len(data) // width):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=_FULL)
        h.update(view[i * width : (i + 1) * width])
        prev = h.digest()
        keys.append(prev)
    return keys


def partial_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a partial chunk holding ``tokens`` after the full chunk keyed ``prev``."""
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=_PART)
    h.update(tokens_bytes(tokens))
    return h.digest()


class BlockPrefixes(NamedTuple):
    """The whole-block prefixes of a chunk's tokens after the key ``prev`` (the chain's
    previous link), unhashed: ``data`` the tokens packed (:func:`tokens_bytes`), ``width``
    bytes a block. What a stored chunk's aliases are hashed from when first needed
    (``ChunkIndex``), and what a block hit looks up."""

    prev: bytes
    data: bytes
    width: int
    # What every prefix that can share a key with these shares: ``prev`` and the first block
    # (a prefix holds at least one whole block).
    group: bytes

    def prefix_keys(self) -> Iterator[bytes]:
        """``partial_key(prev, tokens[: j * block_size])`` for j = 1, 2, ...: the key of each
        whole-block prefix, hashed in one pass (lazily: a caller that stops at the first key
        the pool lacks hashes no further)."""
        h = hashlib.blake2b(self.prev, digest_size=KEY_BYTES, person=_PART)
        view, width = memoryview(self.data), self.width
        for j in range(0, len(view) - width + 1, width):
            h.update(view[j : j + width])
            yield h.copy().digest()


def block_prefixes(
    prev: bytes, tokens: Sequence[int], block_size: int, blocks: int
) -> BlockPrefixes | None:
    """The first ``blocks`` whole-block prefixes of ``tokens`` after ``prev`` (None: none)."""
    if blocks <= 0:
        return None
    data = tokens_bytes(tokens[: blocks * block_size])
    width = block_size * _TOKEN_BYTES
    return BlockPrefixes(prev, data, width, prev + data[:width])


class ChunkIndex:
    """Key -> host slot, bounded by ``num_slots``, least recently used first.

    A stored chunk is readable; a reserved one is being written (its save is planned, not yet
    confirmed) and is never offered to a lookup; a pinned one is being read by a planned load
    and is never evicted. Cancelled reservations (their source KV turned out wrong) free their
    slot when the worker reports back, and are never stored.

    Aliases (block hits, design note 14): a stored chunk is also found under the key of each
    whole-block prefix it holds (``BlockPrefixes.prefix_keys``), so a prompt that shares only its
    first blocks with a stored chunk finds them. An alias names its chunks (the first stored
    one serves it); it goes when they go. Only keys are aliased: slots, pins and LRU order
    belong to the chunk's own key.

    A stored chunk's aliases are hashed when a lookup, a load or a save plan first asks about
    its group (``BlockPrefixes.group``: the key before it and its first block; every prefix
    that could name it starts there), not when its save is planned: most chunks are never
    asked about (a hash a block cost a replay 4 % of its time, and a long prompt's save plan
    on vLLM's scheduler thread half of its). A group's chunks are hashed all at once, in the
    order they were stored, so each alias still names its chunks in that order.
    ``hash_on_store``: each as it is stored instead, for a reader that asks about any key, not
    only through a group.
    """

    __slots__ = (
        "_alias_of",
        "_aliases",
        "_cancelled",
        "_free",
        "_hash_on_store",
        "_pending_aliases",
        "_readers",
        "_stored",
        "_unhashed",
        "_unhashed_groups",
        "_writing",
        "num_slots",
        "remote",
        "watch",
    )

    # Every operation here is O(chunks involved), never O(num_slots): a 4 GiB pool of small
    # chunks has hundreds of thousands of slots, and plans run on vLLM's scheduler thread.

    def __init__(self, num_slots: int, *, hash_on_store: bool = False) -> None:
        self.num_slots = num_slots
        self._hash_on_store = hash_on_store
        self._stored: OrderedDict[bytes, int] = OrderedDict()
        self._writing: dict[bytes, int] = {}
        self._cancelled: set[bytes] = set()
        self._readers: dict[bytes, int] = {}
        # Handed out from the end (0, 1, 2, ... at first), deterministically, so a replay
        # assigns the same slots.
        self._free = _FreeSlots(num_slots)
        # The remote tier's facts (tracker/remote.py folds them); empty without one.
        self.remote = RemoteKeys()
        # alias -> the stored chunks it names, in the order they were stored; chunk -> its
        # aliases (hashed); the stored chunks whose aliases are not hashed yet, and each
        # group's of them in the order they were stored; and the writes in flight, whose
        # sources are taken up when the write is stored.
        self._aliases: dict[bytes, list[bytes]] = {}
        self._alias_of: dict[bytes, tuple[bytes, ...]] = {}
        self._unhashed: dict[bytes, BlockPrefixes] = {}
        self._unhashed_groups: dict[bytes, list[bytes]] = {}
        self._pending_aliases: dict[bytes, BlockPrefixes] = {}
        # Told ``(key, True)`` when a chunk becomes stored and ``(key, False)`` when it leaves,
        # nothing else: the connector's KV events for the pool (connector/pool_events.py). None,
        # the default, costs one test per stored or dropped chunk.
        self.watch: Callable[[bytes, bool], None] | None = None

    # --- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, key: object) -> bool:
        """Whether a stored chunk is found under ``key``: its own key, or an alias. A partial
        key (a prompt tail, a block prefix) can be an alias: ask :meth:`hash_aliases` for its
        group first, or an alias not hashed yet is not seen."""
        return key in self._stored or key in self._aliases

    def __iter__(self) -> Iterator[bytes]:
        """The stored keys, least recently used first."""
        return iter(self._stored)

    def slot_of(self, key: bytes) -> int | None:
        """The slot of the chunk stored under its own ``key`` (aliases: :meth:`resolve`)."""
        return self._stored.get(key)

    def resolve(self, key: bytes) -> bytes | None:
        """The stored chunk's own key that ``key`` names: itself, or for an alias (of a group
        hashed: :meth:`hash_aliases` first) the first chunk stored under it; None when nothing
        is stored under ``key``."""
        if key in self._stored:
            return key
        chunks = self._aliases.get(key)
        return chunks[0] if chunks else None

    def aliases(self, key: bytes) -> tuple[bytes, ...]:
        """The whole-block prefix keys a stored chunk is also found under (none: not stored,
        or no block hits)."""
        source = self._unhashed.get(key)
        if source is not None:
            self.hash_aliases(source.group)
        return self._alias_of.get(key, ())

    def hash_aliases(self, group: bytes) -> None:
        """Hash the aliases of the stored chunks of ``group`` (``BlockPrefixes.group``) not hashed
        yet, in the order they were stored: from here on :meth:`__contains__` and
        :meth:`resolve` see every alias of a prefix of that group. The index's contents do
        not change, only when their hashes are computed."""
        keys = self._unhashed_groups.pop(group, None)
        if keys is None:
            return
        unhashed, aliases = self._unhashed, self._aliases
        for key in keys:
            names = tuple(unhashed.pop(key).prefix_keys())
            self._alias_of[key] = names
            for name in names:
                aliases.setdefault(name, []).append(key)

    def is_writing(self, key: bytes) -> bool:
        return key in self._writing

    def prefix_hit(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are stored."""
        n = 0
        stored = self._stored
        for key in keys:
            if key not in stored:
                break
            n += 1
        return n

    def choose_slots(self, count: int) -> tuple[list[int], list[bytes]]:
        """Up to ``count`` slots for new chunks: free slots first, then the least recently used
        stored chunks that no planned load is reading. Returns (slots, evicted keys)."""
        slots = self._free.last(count)
        evicted: list[bytes] = []
        if len(slots) < count:
            for key, slot in self._stored.items():
                if len(slots) >= count:
                    break
                if not self._readers.get(key):
                    slots.append(slot)
                    evicted.append(key)
        return slots, evicted

    @property
    def free_slots(self) -> int:
        """Slots holding nothing (what :meth:`stats` calls ``free``), read every step."""
        return len(self._free)

    def stats(self) -> dict[str, int]:
        return {
            "stored": len(self._stored),
            "writing": len(self._writing),
            "pinned": sum(1 for v in self._readers.values() if v),
            "free": len(self._free),
        }

    # --- event application (only the tracker's fold calls these) --------------------------

    def apply_save_planned(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        evicted: Sequence[bytes],
        aliases: Sequence[BlockPrefixes | None] = (),
    ) -> None:
        """Reserve ``slots`` for ``keys`` (evicting ``evicted``); ``aliases``: what each
        chunk's whole-block prefix keys are hashed from (None: it has none), found once it
        is stored."""
        for key in evicted:
            self.apply_evicted(key)
        for slot in slots:
            self._free.discard(slot)
        for key, slot in zip(keys, slots, strict=True):
            self._writing[key] = slot
        for key, source in zip(keys, aliases, strict=False):
            if source is not None:
                self._pending_aliases[key] = source

    def apply_save_done(self, key: bytes) -> bool:
        """The worker stored ``key``; False if no such write was planned."""
        slot = self._writing.pop(key, None)
        if slot is None:
            return False
        source = self._pending_aliases.pop(key, None)
        if key in self._cancelled or key in self._stored:
            # Never stored (its source KV was wrong), or stored meanwhile in another slot:
            # either way this slot goes back, and the key keeps at most one slot.
            self._cancelled.discard(key)
            self._free.append(slot)
            return True
        self._stored[key] = slot
        if self.watch is not None:
            self.watch(key, True)
        if source is not None:
            group = source.group
            self._unhashed[key] = source
            self._unhashed_groups.setdefault(group, []).append(key)
            if self._hash_on_store:
                self.hash_aliases(group)
        return True

    def apply_save_failed(self, key: bytes) -> bool:
        slot = self._writing.pop(key, None)
        if slot is None:
            return False
        self._pending_aliases.pop(key, None)
        self._cancelled.discard(key)
        self._free.append(slot)
        return True

    def cancel_write(self, key: bytes) -> None:
        """The chunk's source KV is not trustworthy: never store it."""
        if key in self._writing:
            self._cancelled.add(key)

    def pin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._readers[key] = self._readers.get(key, 0) + 1
            if key in self._stored:
                self._stored.move_to_end(key)

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            n = self._readers.get(key, 0) - 1
            if n > 0:
                self._readers[key] = n
            else:
                self._readers.pop(key, None)

    def drop_unread(self, keys: Iterable[bytes]) -> None:
        """A planned read of these chunks failed: forget them, unless another planned load
        still reads one (its own result will tell)."""
        for key in keys:
            if not self._readers.get(key):
                self.apply_evicted(key)

    def apply_stored(self, key: bytes, slot: int) -> None:
        """A chunk that appeared outside our plans (a warm pool)."""
        if key in self._stored or key in self._writing or slot not in self._free:
            return  # already there, being written by us, or its slot is in use
        self._free.discard(slot)
        self._stored[key] = slot
        if self.watch is not None:
            self.watch(key, True)

    def apply_evicted(self, key: bytes) -> None:
        slot = self._stored.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            if self.watch is not None:
                self.watch(key, False)
            for name in self._alias_of.pop(key, ()):
                chunks = self._aliases[name]
                chunks.remove(key)
                if not chunks:
                    del self._aliases[name]
            source = self._unhashed.pop(key, None)
            if source is not None:
                group = self._unhashed_groups[source.group]
                group.remove(key)
                if not group:
                    del self._unhashed_groups[source.group]


class RemoteKeys:
    """What the remote store was last seen to hold: keys a lookup found or a write confirmed,
    dropped when a lookup or a load found them gone. During an outage it holds nothing and
    offers nothing. A key whose value was not its chunk's (``distrust``) is not counted again
    when a lookup finds it, only once this engine's own write of it is confirmed. Changed only
    by ``tracker.remote``'s fold of recorded events."""

    __slots__ = ("_before", "_distrusted", "_present", "up")

    def __init__(self) -> None:
        self._present: OrderedDict[bytes, None] = OrderedDict()
        # Keys whose value a load found foreign (another chunk's, layout's, unsigned): the
        # store says it holds them, and what it holds is not theirs (bounded: oldest first).
        self._distrusted: OrderedDict[bytes, None] = OrderedDict()
        # What it held when it last went down: a lookup answered just before (earlier in the
        # same step) counted on these, and its load may still read them (``loadable``).
        self._before: OrderedDict[bytes, None] = OrderedDict()
        self.up = True

    def __contains__(self, key: object) -> bool:
        return self.up and key in self._present

    def __len__(self) -> int:
        return len(self._present) if self.up else 0

    def loadable(self, key: bytes) -> bool:
        """A load may name ``key`` as remote: it is held, or was when the store last went
        down. A lookup offers only what is held (``in``); a load plans what its lookup
        counted, and an outage between the two (another request's lookup timing out in the
        same step) does not make that load a broken rule: the worker reads the key, and one
        gone is a load failure vLLM recomputes."""
        return key in self._present or key in self._before

    def add(self, keys: Iterable[bytes], *, written: bool = False) -> None:
        """Keys the store holds: a lookup found them, or (``written``) this engine's write
        was confirmed, which alone makes a distrusted key trusted again."""
        present, distrusted = self._present, self._distrusted
        for key in keys:
            if key in distrusted:
                if not written:
                    continue
                del distrusted[key]
            present[key] = None
            present.move_to_end(key)
        while len(present) > REMOTE_MEMORY:
            present.popitem(last=False)

    def distrust(self, keys: Iterable[bytes]) -> None:
        """The store's values under ``keys`` are not their chunks': not held, and not
        counted when a lookup finds them, until this engine writes them."""
        distrusted = self._distrusted
        for key in keys:
            self._present.pop(key, None)
            self._before.pop(key, None)
            distrusted[key] = None
            distrusted.move_to_end(key)
        while len(distrusted) > REMOTE_MEMORY:
            distrusted.popitem(last=False)

    def distrusted(self, key: bytes) -> bool:
        return key in self._distrusted

    def discard(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._present.pop(key, None)
            self._before.pop(key, None)

    def set_up(self, up: bool) -> None:
        # A store that went away may come back empty (a restart without persistence):
        # nothing it held before counts until it is seen again.
        if not up and self.up:
            self._before = self._present
            self._present = OrderedDict()
        self._present.clear()
        self.up = up


class _FreeSlots:
    """Free host slots: append, remove any slot, and read the most recently freed ones, each
    in O(1), in memory that grows with the slots ever touched, never with ``num_slots``.

    Logically a list that starts as ``[n-1, ..., 1, 0]`` (so slots are first handed out 0, 1,
    2, ...), where ``last`` reads from the end, ``append`` adds at the end and ``discard``
    swaps the last slot into the removed one's place. The order is part of the log's
    meaning: a replay must choose the same slots, so it is kept exactly. Only the positions
    whose slot differs from the starting list are stored (``_at``), and the slots whose
    position differs from their starting one (``_pos``; -1: not free), so a header claiming
    ``num_slots = 2**32`` costs nothing until slots are used.
    """

    __slots__ = ("_at", "_len", "_n", "_pos")

    def __init__(self, num_slots: int) -> None:
        self._n = num_slots  # the starting list's length: position p holds n - 1 - p
        self._len = num_slots
        self._at: dict[int, int] = {}
        self._pos: dict[int, int] = {}

    def __len__(self) -> int:
        return self._len

    def _slot_at(self, p: int) -> int:
        return self._at.get(p, self._n - 1 - p)

    def _position(self, slot: int) -> int | None:
        p = self._pos.get(slot)
        if p is None:
            p = self._n - 1 - slot
        if 0 <= p < self._len and self._slot_at(p) == slot:
            return p
        return None

    def _put(self, p: int, slot: int) -> None:
        if slot == self._n - 1 - p:
            self._at.pop(p, None)
            self._pos.pop(slot, None)
        else:
            self._at[p] = slot
            self._pos[slot] = p

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and self._position(slot) is not None

    def __iter__(self) -> Iterator[int]:
        return iter([self._slot_at(p) for p in range(self._len)])

    def append(self, slot: int) -> None:
        if self._position(slot) is None:
            self._put(self._len, slot)
            self._len += 1

    def discard(self, slot: int) -> None:
        p = self._position(slot)
        if p is None:
            return
        last_p = self._len - 1
        last = self._slot_at(last_p)
        self._len = last_p
        self._at.pop(last_p, None)  # beyond the end now
        self._pos[slot] = -1  # not free (its default position may still be below _len)
        if last != slot:
            self._put(p, last)

    def last(self, count: int) -> list[int]:
        """Up to ``count`` slots, the most recently freed first."""
        if count <= 0:
            return []
        stop = max(self._len - count, 0)
        return [self._slot_at(p) for p in range(self._len - 1, stop - 1, -1)]
