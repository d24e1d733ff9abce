"""tracker.chunks: chunk keys (a salted blake2b prefix chain) and the chunk index."""

from __future__ import annotations

import hashlib
import itertools
import struct

from _pool import stored_items
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvledger.tracker.chunks import (
    BlockPrefixes,
    ChunkIndex,
    block_prefixes,
    chunk_keys,
    partial_key,
    root_key,
    tokens_bytes,
)
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.state import new_state


def _busy(index: ChunkIndex, key: bytes) -> bool:
    """Stored or being written: either way nobody else should write it."""
    return key in index or index.is_writing(key)


# --- keys ------------------------------------------------------------------------------------

# Golden values: a log written today must find the same chunks in a pool years from now, so a
# change of the hash scheme (algorithm, personalisation, encoding, digest size) must fail here.
GOLDEN_ROOT = "97934bd2cb5b0bd23d75d88951beda75"
GOLDEN_ROOT_SALTED = "a60f11c55af0e07c372f2ce5eb7ddccf"
GOLDEN_CHUNKS = ["7e0870af1cba9a0d44ee51c895d54932", "ba1b1357afad6d2520d59d185da5922d"]
GOLDEN_PARTIAL = "32252573863a43312345bc2d20b52be4"


def test_golden_keys() -> None:
    root = root_key("", "")
    assert root.hex() == GOLDEN_ROOT
    assert root_key("model-a", "tenant").hex() == GOLDEN_ROOT_SALTED
    assert [k.hex() for k in chunk_keys(root, list(range(32)), 16)] == GOLDEN_CHUNKS
    assert partial_key(root, list(range(5))).hex() == GOLDEN_PARTIAL


def test_golden_keys_follow_the_documented_construction() -> None:
    """blake2b, 16-byte digests, a personalisation per kind, little-endian uint32 tokens."""
    root = hashlib.blake2b(b"model-a\x00tenant", digest_size=16, person=b"kvledger-root").digest()
    assert root == root_key("model-a", "tenant")
    prev = root_key("", "")
    for i, key in enumerate(chunk_keys(prev, list(range(32)), 16)):
        h = hashlib.blake2b(prev, digest_size=16, person=b"kvledger-full")
        h.update(struct.pack("<16I", *range(16 * i, 16 * i + 16)))
        assert key == h.digest()
        prev = key


def test_salts_separate_keys() -> None:
    tokens = list(range(16))
    roots = [
        root_key("", ""),
        root_key("model-a", ""),
        root_key("model-b", ""),
        root_key("model-a", "tenant-1"),
        root_key("model-a", "tenant-2"),
        root_key("", "model-a"),  # model salt and cache salt are separate fields
        root_key("ab", ""),
        root_key("a", "b"),
    ]
    assert len(set(roots)) == len(roots)
    firsts = {chunk_keys(r, tokens, 16)[0] for r in roots}
    assert len(firsts) == len(roots)


def test_keys_are_deterministic_and_sized() -> None:
    root = root_key("m", "")
    a = chunk_keys(root, list(range(64)), 16)
    b = chunk_keys(root, list(range(64)), 16)
    assert a == b
    assert len(a) == 4 and all(len(k) == 16 for k in a)
    assert len(set(a)) == 4


def test_only_full_chunks_get_keys() -> None:
    root = root_key("", "")
    assert chunk_keys(root, list(range(15)), 16) == []
    assert len(chunk_keys(root, list(range(16)), 16)) == 1
    assert len(chunk_keys(root, list(range(47)), 16)) == 2


def test_a_key_names_its_whole_prefix() -> None:
    """Equal chunk tokens after different prefixes give different keys; equal prefixes give
    equal keys across requests whatever follows."""
    root = root_key("", "")
    x = [1] * 16 + [7] * 16
    y = [2] * 16 + [7] * 16
    kx, ky = chunk_keys(root, x, 16), chunk_keys(root, y, 16)
    assert kx[0] != ky[0]
    assert kx[1] != ky[1]  # same tokens in chunk 1, different prefix
    z = [1] * 16 + [8] * 16 + [9] * 5
    kz = chunk_keys(root, z, 16)
    assert kz[0] == kx[0]  # shared prefix, shared chunk
    assert kz[1] != kx[1]


def test_chain_continues_from_any_chunk() -> None:
    root = root_key("s", "")
    tokens = list(range(100))
    full = chunk_keys(root, tokens, 8)
    for k in range(1, len(full)):
        assert chunk_keys(full[k - 1], tokens, 8, first_chunk=k) == full[k:]
    assert chunk_keys(root, tokens, 8, first_chunk=0) == full


def test_partial_keys_never_equal_full_keys() -> None:
    root = root_key("", "")
    tokens = list(range(16))
    full = chunk_keys(root, tokens, 16)[0]
    assert partial_key(root, tokens) != full
    assert partial_key(root, tokens[:5]) != partial_key(root, tokens[:6])
    assert partial_key(root, tokens[:5]) != partial_key(full, tokens[:5])  # chained too
    assert partial_key(root, tokens[:5]) == partial_key(root, tokens[:5])


def test_token_encoding_is_not_ambiguous() -> None:
    """Each token is a fixed 4 bytes: [1, 256] and [256, 1] differ, and so do byte-aligned
    look-alikes."""
    root = root_key("", "")
    assert partial_key(root, [1, 256]) != partial_key(root, [256, 1])
    assert partial_key(root, [0x01020304]) != partial_key(root, [0x04030201])
    assert partial_key(root, [0, 0]) != partial_key(root, [0])


# --- the index -------------------------------------------------------------------------------


def _k(i: int) -> bytes:
    return bytes([i]) * 16


def _store(index: ChunkIndex, keys: list[bytes]) -> list[int]:
    slots, evicted = index.choose_slots(len(keys))
    assert len(slots) == len(keys)
    index.apply_save_planned(keys, slots, evicted)
    for key in keys:
        assert index.apply_save_done(key)
    return slots


def test_slots_are_handed_out_in_order_and_queries_change_nothing() -> None:
    index = ChunkIndex(4)
    assert index.choose_slots(3) == ([0, 1, 2], [])
    assert index.choose_slots(3) == ([0, 1, 2], [])  # a query, not a reservation
    assert index.stats() == {"stored": 0, "writing": 0, "pinned": 0, "free": 4}
    assert _store(index, [_k(1), _k(2)]) == [0, 1]
    assert index.choose_slots(2) == ([2, 3], [])
    # beyond the free slots: the least recently used stored chunks, in LRU order
    assert index.choose_slots(9) == ([2, 3, 0, 1], [_k(1), _k(2)])
    assert index.prefix_hit([_k(1), _k(2), _k(3)]) == 2
    assert index.prefix_hit([_k(2), _k(1)]) == 2
    assert index.prefix_hit([_k(3), _k(1)]) == 0  # counts from the first key only
    before = (stored_items(index), index.stats())
    for _ in range(3):
        index.prefix_hit([_k(1)])
        index.choose_slots(4)
    assert (stored_items(index), index.stats()) == before


def test_a_reserved_chunk_is_not_readable_until_confirmed() -> None:
    index = ChunkIndex(2)
    slots, evicted = index.choose_slots(1)
    index.apply_save_planned([_k(1)], slots, evicted)
    assert _k(1) not in index
    assert index.is_writing(_k(1)) and _busy(index, _k(1))
    assert index.prefix_hit([_k(1)]) == 0
    assert index.slot_of(_k(1)) is None
    assert index.choose_slots(2) == ([1], [])  # the reserved slot is not offered again
    assert index.apply_save_done(_k(1))
    assert _k(1) in index and index.slot_of(_k(1)) == 0
    assert not index.is_writing(_k(1)) and _busy(index, _k(1))
    assert not index.apply_save_done(_k(1))  # a second confirmation is not a write


def test_a_failed_or_cancelled_write_frees_its_slot_and_is_never_stored() -> None:
    index = ChunkIndex(2)
    index.apply_save_planned([_k(1), _k(2)], [0, 1], [])
    assert index.apply_save_failed(_k(1))
    assert not index.apply_save_failed(_k(1))
    index.cancel_write(_k(2))
    assert index.apply_save_done(_k(2))  # the worker finished, but the KV was not right
    assert _k(1) not in index and _k(2) not in index
    assert index.stats() == {"stored": 0, "writing": 0, "pinned": 0, "free": 2}
    index.cancel_write(_k(3))  # not being written: nothing to cancel, nothing remembered
    _store(index, [_k(3)])
    assert _k(3) in index


def test_lru_eviction_order_and_pins() -> None:
    index = ChunkIndex(3)
    _store(index, [_k(1), _k(2), _k(3)])
    assert index.choose_slots(1) == ([0], [_k(1)])  # least recently stored first
    index.pin([_k(1)])  # a planned load reads k1: never evicted, and now most recent
    assert index.choose_slots(1) == ([1], [_k(2)])
    assert index.choose_slots(3) == ([1, 2], [_k(2), _k(3)])  # k1 is pinned: only two
    index.pin([_k(2), _k(3)])
    assert index.choose_slots(2) == ([], [])
    assert index.stats()["pinned"] == 3
    index.unpin([_k(2), _k(3)])
    index.pin([_k(1)])  # two readers of k1
    index.unpin([_k(1)])
    assert index.choose_slots(3) == ([1, 2], [_k(2), _k(3)])  # k1 still has a reader
    index.unpin([_k(1)])
    assert index.stats()["pinned"] == 0
    assert index.choose_slots(3)[1] == [_k(2), _k(3), _k(1)]


def test_eviction_applies_with_the_planned_save() -> None:
    index = ChunkIndex(2)
    _store(index, [_k(1), _k(2)])
    slots, evicted = index.choose_slots(1)
    index.apply_save_planned([_k(3)], slots, evicted)
    assert _k(1) not in index and _k(2) in index and index.is_writing(_k(3))
    assert index.stats() == {"stored": 1, "writing": 1, "pinned": 0, "free": 0}
    index.apply_save_done(_k(3))
    assert index.slot_of(_k(3)) == 0


def test_pool_events_outside_our_plans() -> None:
    index = ChunkIndex(2)
    index.apply_stored(_k(1), 1)
    assert index.slot_of(_k(1)) == 1
    index.apply_stored(_k(2), 1)  # the slot is taken: ignored
    index.apply_stored(_k(1), 0)  # already stored: ignored
    index.apply_stored(_k(3), 7)  # no such slot: ignored
    assert stored_items(index) == [(_k(1), 1)]
    index.apply_evicted(_k(1))
    index.apply_evicted(_k(1))
    assert len(index) == 0 and index.stats()["free"] == 2


# --- property: the index never holds more than num_slots, and never loses a slot -------------


@settings(max_examples=200, deadline=None)
@given(
    num_slots=st.integers(1, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["plan", "done", "fail", "cancel", "pin", "unpin", "store", "evict"]),
            st.integers(0, 6),
            st.integers(0, 5),
        ),
        max_size=60,
    ),
)
# Found by this property: a warm-pool ChunkStored of a key being written stored it twice.
@example(num_slots=2, ops=[("plan", 1, 0), ("store", 1, 1), ("done", 1, 0)])
def test_index_conserves_slots(num_slots: int, ops: list[tuple[str, int, int]]) -> None:
    index = ChunkIndex(num_slots)
    pins: dict[bytes, int] = {}
    for op, i, n in ops:
        key = _k(i)
        if op == "plan" and not _busy(index, key):
            slots, evicted = index.choose_slots(1)
            assert not any(pins.get(k) for k in evicted), "evicted a pinned chunk"
            if slots:
                index.apply_save_planned([key], slots, evicted)
        elif op == "done":
            index.apply_save_done(key)
        elif op == "fail":
            index.apply_save_failed(key)
        elif op == "cancel":
            index.cancel_write(key)
        elif op == "pin":
            index.pin([key])
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            index.unpin([key])
            pins[key] -= 1
        elif op == "store":
            index.apply_stored(key, n)
        elif op == "evict":
            index.apply_evicted(key)
        stats = index.stats()
        assert len(index) <= num_slots
        assert stats["stored"] + stats["writing"] + stats["free"] == num_slots
        stored_slots = [slot for _, slot in stored_items(index)]
        writing_slots = list(index._writing.values())
        in_use = stored_slots + writing_slots + list(index._free)
        assert sorted(in_use) == list(range(num_slots)), "a slot leaked or is used twice"


# --- the free-slot list: the exact order of a plain list, in memory of the slots touched ------


class _ListFreeSlots:
    """The reference: the plain list the free slots were before (O(num_slots) memory)."""

    def __init__(self, n: int) -> None:
        self.slots: list[int] = []
        self.pos: dict[int, int] = {}
        for s in range(n - 1, -1, -1):
            self.append(s)

    def append(self, s: int) -> None:
        if s not in self.pos:
            self.pos[s] = len(self.slots)
            self.slots.append(s)

    def discard(self, s: int) -> None:
        i = self.pos.pop(s, None)
        if i is None:
            return
        last = self.slots.pop()
        if last != s:
            self.slots[i] = last
            self.pos[last] = i

    def last(self, count: int) -> list[int]:
        return self.slots[: -count - 1 : -1] if count > 0 else []


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(1, 12),
    ops=st.lists(
        st.tuples(st.sampled_from(["append", "discard", "last"]), st.integers(0, 14)),
        max_size=60,
    ),
)
def test_free_slots_keep_the_plain_lists_order(n: int, ops: list[tuple[str, int]]) -> None:
    # Slot choice is recorded in every SavePlanned: a replay must hand out the same slots.
    from kvledger.tracker.chunks import _FreeSlots

    lazy, plain = _FreeSlots(n), _ListFreeSlots(n)
    for op, arg in ops:
        if op == "last":
            assert lazy.last(arg) == plain.last(arg)
        else:
            getattr(lazy, op)(arg)
            getattr(plain, op)(arg)
        assert list(lazy) == plain.slots and len(lazy) == len(plain.slots)
        assert all((s in lazy) == (s in plain.pos) for s in range(n + 3))


def test_a_huge_pool_costs_nothing_until_used() -> None:
    # A log header may claim any num_slots; the index must not allocate per slot.
    from _memory import traced_peak

    with traced_peak() as traced:
        index = ChunkIndex(2**40)
        slots, evicted = index.choose_slots(3)
        index.apply_save_planned([_k(1), _k(2), _k(3)], slots, evicted)
    peak = traced.bytes
    assert slots == [0, 1, 2] and not evicted
    assert peak < 1 << 20, peak
    assert index.stats()["free"] == 2**40 - 3


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    salt=st.sampled_from(["", "m"]),
    cache_salt=st.sampled_from(["", "tenant"]),
)
def test_a_request_packed_once_keys_its_prompt_as_the_chain_does(
    tokens: list[int], salt: str, cache_salt: str
) -> None:
    """The fold packs a prompt once (to validate it) and keys it from those bytes
    (``packed_chunk_keys``); the root is cached per salt pair. The keys are the chain's own:
    each full chunk hashed from the key before it, from the uncached root."""
    config = TrackerConfig(block_size=4, chunk_size=16, num_slots=8, salt=salt)
    state = new_state("r", tokens, config, cache_salt, packed=tokens_bytes(tokens))
    prev = root_key.__wrapped__(salt, cache_salt)
    assert state.root == prev
    expected = []
    for i in range(len(tokens) // 16):
        h = hashlib.blake2b(prev, digest_size=16, person=b"kvledger-full")
        h.update(struct.pack("<16I", *tokens[i * 16 : (i + 1) * 16]))
        prev = h.digest()
        expected.append(prev)
    assert list(state.keys) == expected
    assert list(new_state("r", tokens, config, cache_salt).keys) == expected


# --- aliases hashed when first asked about: the same answers as hashed when stored ----------

_STEMS = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 6, 7, 8, 1, 2, 3, 4))
# What a chunk's aliases are hashed from: (the key before it, stem, cut, whole blocks). Most
# share a group (the key before and the first block) and some aliases: stems 0 and 1 share
# their first two blocks.
_SOURCES = ((0, 0, 8, 3), (0, 1, 8, 3), (0, 0, 2, 2), (0, 1, 4, 1), (0, 2, 8, 3), (1, 0, 8, 3))


def _prefixes(prev: int, stem: int, cut: int, blocks: int) -> BlockPrefixes | None:
    """The whole-block prefixes (2 tokens a block) of a stem cut at ``cut`` and continued by
    tokens of its own."""
    tokens = [*_STEMS[stem][:cut], *range(100 + cut, 108)][:8]
    return block_prefixes(_k(100 + prev), tokens, 2, blocks)


@settings(max_examples=300, deadline=None)
@given(
    num_slots=st.integers(1, 5),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["save", "plan", "done", "fail", "cancel", "evict", "ask", "aliases"]),
            st.integers(0, 3),  # the chunk
            st.integers(0, len(_SOURCES)),  # its source (the last: no aliases)
        ),
        max_size=30,
    ),
)
def test_aliases_hashed_when_asked_answer_as_if_hashed_when_stored(
    num_slots: int, ops: list[tuple[str, int, int]]
) -> None:
    """A stored chunk's aliases are hashed when a lookup or a load first asks about its group
    (``hash_aliases``), not when stored: the same operations on an index that hashes each at
    its store (as the index did before) give, to every question asked through a group, the
    same answer: whether a prefix key is held, the chunk it resolves to (the first stored),
    and a chunk's aliases."""
    lazy, eager = ChunkIndex(num_slots), ChunkIndex(num_slots, hash_on_store=True)
    for op, i, source in ops:
        key = _k(i)
        if op in ("save", "plan"):  # a save planned, and (save) stored
            if key in eager._stored or eager.is_writing(key):
                continue
            slots, evicted = eager.choose_slots(1)
            assert lazy.choose_slots(1) == (slots, evicted)
            if slots:
                prefixes = _prefixes(*_SOURCES[source]) if source < len(_SOURCES) else None
                for index in (lazy, eager):
                    index.apply_save_planned([key], slots, evicted, [prefixes])
                    if op == "save":
                        index.apply_save_done(key)
        elif op in ("done", "fail", "cancel", "evict"):
            for index in (lazy, eager):
                {
                    "done": index.apply_save_done,
                    "fail": index.apply_save_failed,
                    "cancel": index.cancel_write,
                    "evict": index.apply_evicted,
                }[op](key)
        elif op == "ask":  # a lookup of every stem, whole, after either key
            for prev, stem in itertools.product((0, 1), range(len(_STEMS))):
                query = _prefixes(prev, stem, 8, 4)
                assert query is not None
                lazy.hash_aliases(query.group)
                for name in query.prefix_keys():
                    assert (name in lazy) == (name in eager)
                    assert lazy.resolve(name) == eager.resolve(name)
        else:
            assert lazy.aliases(key) == eager.aliases(key)
    assert list(lazy) == list(eager)
