"""Pure decisions: the lookup answer, the load plan and the save plan.

Rule of this module: all chunk arithmetic lives here, and every function is a pure function of
(state, index, config). Nothing here changes the index or the state: the tracker records the
decision as an event and folds it, so a replay re-derives the same decision from the same
facts and can tell when this code would now decide differently.

The rules:

- A lookup answers ``external = max(0, hit - local_hit - full)`` where ``full`` is 1 when the
  hit covers every token: vLLM must compute at least the last token to get logits. Asked ten
  times with the same pool, it answers ten times the same.
- The hit is the longest prefix the pool holds: whole chunks, then (``block_hits``) the whole
  blocks of the next chunk that a stored chunk holds (its aliases), or the exact prompt tail
  saved as a partial chunk.
- A load covers exactly ``[local_hit, local_hit + accepted)``: never the recomputed last token,
  never more than vLLM accepted, never beyond the allocated blocks.
- A save covers whole chunks of tokens whose KV exists after this step and whose ids are
  known. Chunks past the admission's prefill (decode chunks) only with ``save_decode_cache``;
  the partial chunk at the end of a prefill, whole, only without ``discard_partial_chunks``;
  with ``block_hits`` its whole blocks are saved anyway. Chunks the
  pool already holds are skipped (the watermark moves over them); a chunk another request is
  writing is waited for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

import attrs

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import (
    BlockPrefixes,
    ChunkIndex,
    RemoteKeys,
    block_prefixes,
    partial_key,
)
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.state import Phase, RequestState
from kvledger.tracker.tiers import POOL, REMOTE, slot_of
from kvledger.tracker.violation import Violation

__all__ = [
    "ChunkTransfer",
    "PoolView",
    "Span",
    "TransferPlan",
    "answer_lookup",
    "blocks_covering",
    "failed_load_keys",
    "lookup_spans",
    "plan_load",
    "plan_save",
    "save_aliases",
    "save_policy_end",
    "saved_tail",
    "span_tier",
    "transfer_plan",
]


class PoolView(Protocol):
    """What a lookup asks of the pool (``ChunkIndex`` answers it; ``kvledger whatif``'s hit
    curve answers it for every pool size at once from a recency stack)."""

    remote: RemoteKeys

    def slot_of(self, key: bytes) -> int | None: ...

    def __contains__(self, key: object) -> bool: ...

    def hash_aliases(self, group: bytes) -> None:
        """Before asking about the aliases of a group of prefixes (``ChunkIndex``)."""


def _prefix_key(state: RequestState, chunk: int) -> bytes:
    """Key of full chunk ``chunk - 1`` (the chain's previous link), or the root."""
    return state.keys[chunk - 1] if chunk > 0 else state.root


def _tail_key(state: RequestState, config: TrackerConfig, end: int) -> bytes:
    c = config.chunk_size
    first = end // c * c
    return partial_key(_prefix_key(state, first // c), state.token_ids[first:end])


class Span(NamedTuple):
    """One unit a lookup reads: the chunk keyed ``key`` holds tokens ``[start, end)``, and
    ``parent`` is the key of the unit before it (the chain's root for the first). ``partial``:
    the tail of the tokens asked, shorter than a chunk, whose key names exactly those tokens
    (stored only when a prefill ended there and partial chunks are kept)."""

    key: bytes
    start: int
    end: int
    partial: bool
    parent: bytes


def lookup_spans(
    state: RequestState, config: TrackerConfig, num_tokens: int, start: int = 0
) -> Iterator[Span]:
    """The units a lookup of the first ``num_tokens`` tokens reads, in token order, from the
    one holding token ``start`` on: the full chunks whose keys are known, then, when the
    tokens asked end inside a chunk and are all known, that tail as a partial chunk. A lookup
    hits the longest prefix of them that a tier holds (:func:`span_tier`). Lazy: a reader that
    stops at the first miss pays for no more."""
    c = config.chunk_size
    n_keys = min(len(state.keys), num_tokens // c)
    keys = state.keys
    for i in range(max(start, 0) // c, n_keys):
        yield Span(keys[i], i * c, (i + 1) * c, False, keys[i - 1] if i else state.root)
    if n_keys == num_tokens // c and num_tokens % c and len(state.token_ids) >= num_tokens:
        first = n_keys * c
        if num_tokens > start:
            parent = _prefix_key(state, n_keys)
            tail = partial_key(parent, state.token_ids[first:num_tokens])
            yield Span(tail, first, num_tokens, True, parent)


def saved_tail(state: RequestState, config: TrackerConfig, span: Span) -> Span | None:
    """For the tail of the tokens asked (a partial span), the unit a prefill ending there
    saves (``TrackerConfig.saved_tail_end``) when it is not the span itself: its whole blocks
    (``block_hits`` with ``discard_partial_chunks``). None otherwise."""
    end = config.saved_tail_end(span.end)
    if not span.partial or end <= span.start or end >= span.end:
        return None
    key = partial_key(span.parent, state.token_ids[span.start : end])
    return Span(key, span.start, end, True, span.parent)


def span_tier(index: PoolView, span: Span) -> str | None:
    """The tier a lookup finds ``span`` in (``tracker/tiers.py``, nearest first): ``POOL``
    (the host pool's index holds it), ``REMOTE`` (the remote tier was seen holding it: a
    recorded fact, tracker/remote.py), or None. A partial tail counts from the host pool
    only."""
    if index.slot_of(span.key) is not None:
        return POOL
    if not span.partial and span.key in index.remote:
        return REMOTE
    return None


def block_hit(state: RequestState, index: PoolView, config: TrackerConfig, chunk: int,
               num_tokens: int) -> int:  # fmt: skip
    """Whole blocks of chunk ``chunk`` (the first one not held whole) that a stored chunk
    holds, found by their aliases (``block_hits``): the longest such prefix, in tokens. Aliases are taken in
    order and the search stops at the first block missing (a chunk holding j blocks is found
    under all of its first j), so a miss costs one block's hash."""
    b, c = config.block_size, config.chunk_size
    start = chunk * c
    blocks = min(c // b - 1, (min(num_tokens, len(state.token_ids)) - start) // b)
    if blocks <= 0:
        return 0
    tokens = state.token_ids[start : start + blocks * b]
    prefixes = block_prefixes(_prefix_key(state, chunk), tokens, b, blocks)
    assert prefixes is not None
    index.hash_aliases(prefixes.group)
    found = 0
    for key in prefixes.prefix_keys():
        if key not in index:
            break
        found += 1
    return found * b


def answer_lookup(
    state: RequestState, index: PoolView, config: TrackerConfig, local_hit: int, num_tokens: int
) -> tuple[int, int]:
    """(hit, external): tokens the pool holds for this prefix, tokens to offer vLLM."""
    hit = 0
    for span in lookup_spans(state, config, num_tokens):
        if span_tier(index, span) is None:
            break
        hit = span.end
    if config.block_hits and hit % config.chunk_size == 0 and hit < num_tokens:
        # The first chunk not held whole: its whole blocks a stored chunk holds.
        hit += block_hit(state, index, config, hit // config.chunk_size, num_tokens)
    if state.recompute_only:
        return hit, 0
    external = max(0, hit - local_hit - (1 if hit >= num_tokens else 0))
    return hit, external


def blocks_covering(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The blocks holding token positions ``[start, end)``."""
    if end <= start:
        return []
    return list(block_ids[start // block_size : (end - 1) // block_size + 1])


def failed_load_keys(
    state: RequestState, failed_blocks: Iterable[int], config: TrackerConfig
) -> list[bytes]:
    """The keys of ``state.load`` whose token range touches one of ``failed_blocks``."""
    load = state.load
    if load is None:
        return []
    b, c = config.block_size, config.chunk_size
    failed = set(failed_blocks)
    positions = [i * b for i, block in enumerate(state.block_ids) if block in failed]
    keys: list[bytes] = []
    for i, key in enumerate(load.keys):
        lo = max(load.start, (load.start // c + i) * c)
        hi = min(load.end, (load.start // c + i + 1) * c)
        if any(p < hi and p + b > lo for p in positions):
            keys.append(key)
    return keys


def plan_load(
    state: RequestState, index: ChunkIndex, config: TrackerConfig, step: int
) -> tuple[ev.LoadPlanned | None, tuple[Violation, ...]]:
    """The admission's load, or a refusal naming the blocks vLLM must recompute.

    Once admitted (the fold has set the request running at vLLM's ``num_computed``), vLLM
    counts ``[local_hit, num_computed)`` as loaded from us. If that is more than vLLM accepted
    (the allocation callback failed, say), all of it is refused: a load that never happens
    must never pass for one that did."""
    if state.lookup is None:
        return None, ()
    start = state.lookup.local_hit
    end = start + state.accepted
    admitted = state.phase is Phase.RUNNING
    counted_end = max(end, state.num_computed) if admitted else end
    if counted_end <= start:
        return None, ()
    c, b = config.chunk_size, config.block_size

    def refuse(rule: str | None, **detail: int) -> tuple[ev.LoadPlanned, tuple[Violation, ...]]:
        refused = blocks_covering(state.block_ids, b, start, counted_end)
        decision = ev.LoadPlanned(step, state.req_id, start, start, refused_blocks=refused)
        if rule is None:
            return decision, ()
        return decision, (Violation(rule, step, state.req_id, "LoadPlanned", detail),)

    if state.recompute_only or counted_end != end:
        return refuse(None)  # the admission's violation is already recorded
    if end > state.block_capacity(b):
        return refuse("load_within_allocation", end=end, capacity=state.block_capacity(b))
    if end > state.lookup.hit or end > state.lookup.num_tokens - 1:
        # Never load past the hit, and never the last token: vLLM recomputes it for logits.
        return refuse(
            "load_within_hit", end=end, hit=state.lookup.hit, num_tokens=state.lookup.num_tokens
        )
    keys: list[bytes] = []
    slots: list[int] = []
    for chunk in range(start // c, (end - 1) // c + 1):
        if chunk < len(state.keys) and (chunk + 1) * c <= state.lookup.hit:
            key = state.keys[chunk]
        else:
            # The hit ends inside this chunk: whole blocks a stored chunk holds (an alias),
            # or a prompt tail saved at the end of a prefill. The load reads the chunk
            # stored under it, from its start.
            key = _tail_key(state, config, state.lookup.hit)
            # Not only the chunk the lookup found: one of its group stored since may be the
            # one to read now (the lookup's was evicted), its aliases not yet hashed.
            _hash_group(index, state, config, state.lookup.hit // c)
        stored = index.resolve(key)
        if stored is not None:
            key, slot = stored, index.slot_of(stored)
        elif index.remote.loadable(key):
            slot = slot_of(REMOTE)  # the worker reads it from the remote tier
        else:
            return refuse("load_chunks_present", chunk=chunk)
        assert slot is not None
        keys.append(key)
        slots.append(slot)
    return ev.LoadPlanned(step, state.req_id, start, end, tuple(keys), tuple(slots)), ()


def plan_save(
    state: RequestState, index: ChunkIndex, config: TrackerConfig, step: int
) -> ev.SavePlanned | None:
    """The chunks to save after this step, or None.

    One contiguous range of chunks: the full chunks from the cursor on, then, when every full
    chunk of the prefill is stored or planned, the prefill's partial chunk (if the
    configuration keeps them) in the same plan, so a request that finishes after its prefill
    step (a P/D prefill, ``max_tokens=1``) still saves it.
    """
    if state.recompute_only:
        return None
    c = config.chunk_size
    cursor = state.save.cursor
    limit = min(state.num_tokens, len(state.token_ids), state.block_capacity(config.block_size))
    limit = min(limit, save_policy_end(state, config))
    # The cursor is a chunk boundary except just after a partial chunk was saved (it is then
    # the prefill's end). The next full chunk starts at the beginning of the chunk holding the
    # cursor: its key names all of its tokens, so its slot must receive all of them.
    chunk = cursor // c
    if (chunk + 1) * c > limit and config.discard_partial_chunks:
        # The hot path: nothing new to save this step, unless the prefill's whole blocks are
        # (block hits).
        if cursor >= config.saved_tail_end(state.prefill_end):
            return None
    skip_to = cursor
    ranges: list[tuple[bytes, int, int]] = []  # (key, start, end), contiguous
    complete = True  # every full chunk below the limit is stored or in this plan
    while (chunk + 1) * c <= limit:
        if chunk >= len(state.keys):
            complete = False
            break
        key = state.keys[chunk]
        if key in index:
            if ranges:
                complete = False
                break  # keep the plan one contiguous range; the next step continues
            skip_to = (chunk + 1) * c
        elif index.is_writing(key):
            complete = False
            break  # another request is writing it: wait for its result
        else:
            ranges.append((key, chunk * c, (chunk + 1) * c))
        chunk += 1
    if complete:
        at = ranges[-1][2] if ranges else skip_to
        tail = _partial_tail(state, config, limit, at)
        if tail is not None:
            key, start, end = tail
            # Its whole blocks: the key can be another chunk's alias, hashed or not yet.
            _hash_group(index, state, config, start // c)
            if key in index:
                if not ranges:
                    skip_to = end  # the pool already holds this exact tail
            elif not index.is_writing(key):
                ranges.append(tail)
    slots: list[int] = []
    evicted: list[bytes] = []
    if ranges:
        slots, evicted = index.choose_slots(len(ranges))
        ranges = ranges[: len(slots)]
    if not ranges and skip_to == cursor:
        return None
    start = ranges[0][1] if ranges else skip_to
    end = ranges[-1][2] if ranges else skip_to
    return ev.SavePlanned(
        step,
        state.req_id,
        start,
        end,
        tuple(r[0] for r in ranges),
        tuple(slots),
        tuple(evicted),
        skip_to,
    )


def save_policy_end(state: RequestState, config: TrackerConfig) -> int:
    """How far saves may reach by policy: the prefill's end, unless ``save_decode_cache``
    (then no bound). A chunk that ends past it is a decode chunk, never saved."""
    return _NO_BOUND if config.save_decode_cache else state.prefill_end


_NO_BOUND = 1 << 62


def _partial_tail(
    state: RequestState, config: TrackerConfig, limit: int, at: int
) -> tuple[bytes, int, int] | None:
    """(key, start, end) of the prefill's partial chunk when a save range reaching ``at`` can
    include it: its tokens are all computed and known, and it starts exactly at ``at``. Whole
    (to the prefill's end) without ``discard_partial_chunks``, else its whole blocks."""
    c = config.chunk_size
    end = config.saved_tail_end(state.prefill_end)
    start = end // c * c
    if end % c == 0 or at != start or limit < end or len(state.keys) < start // c:
        return None
    return _tail_key(state, config, end), start, end


def _hash_group(index: PoolView, state: RequestState, config: TrackerConfig, chunk: int) -> None:
    """Before asking the index about a partial key of chunk ``chunk`` (a prompt tail, a block
    hit's prefix): it may be a stored chunk's alias, so the aliases of its group are hashed
    first (``ChunkIndex.hash_aliases``). Every such question in this module asks here first.
    Without ``block_hits`` no chunk has aliases: nothing to do."""
    if not config.block_hits:
        return
    b, start = config.block_size, chunk * config.chunk_size
    prefixes = block_prefixes(_prefix_key(state, chunk), state.token_ids[start : start + b], b, 1)
    if prefixes is not None and len(prefixes.data) == prefixes.width:
        index.hash_aliases(prefixes.group)


def save_aliases(
    decision: ev.SavePlanned, state: RequestState, config: TrackerConfig
) -> tuple[BlockPrefixes | None, ...]:
    """For each chunk a save plan writes, its whole-block prefixes other than its own key
    (``block_hits``; else none), unhashed: the index finds the chunk under their keys once it
    is stored, hashed when first asked about. Derived from the request's recorded token ids,
    so a replay derives the same."""
    if not config.block_hits or not decision.keys:
        return ()
    b, c = config.block_size, config.chunk_size
    out: list[BlockPrefixes | None] = []
    first = decision.start // c
    for i in range(len(decision.keys)):
        chunk = first + i
        if not 0 <= chunk <= len(state.keys):
            # A recorded plan for tokens this state never keyed (a hostile or damaged log):
            # no aliases, as there is no chain to hang them on.
            out.append(None)
            continue
        chunk_start = chunk * c
        tokens = state.token_ids[chunk_start : min(chunk_start + c, decision.end)]
        blocks = len(tokens) // b
        if blocks * b == len(tokens):
            blocks -= 1  # the last prefix is the chunk itself: its own key, or a full one
        out.append(block_prefixes(_prefix_key(state, chunk), tokens, b, blocks))
    return tuple(out)


@attrs.frozen(slots=True)
class ChunkTransfer:
    """Move tokens ``[token_start, token_end)`` of a request between its blocks and host
    ``slot``, at ``slot_offset`` tokens into the slot."""

    key: bytes
    slot: int
    token_start: int
    token_end: int
    slot_offset: int

    @property
    def chunk_start(self) -> int:
        """The first token of the chunk this part belongs to (its slot's first token)."""
        return self.token_start - self.slot_offset


@attrs.frozen(slots=True)
class TransferPlan:
    """What the worker needs to execute a load or save: plain values that cross processes."""

    req_id: str
    kind: str  # "load" | "save"
    block_ids: tuple[int, ...]
    chunks: tuple[ChunkTransfer, ...]

    @property
    def num_tokens(self) -> int:
        return sum(ch.token_end - ch.token_start for ch in self.chunks)


def transfer_plan(
    decision: ev.LoadPlanned | ev.SavePlanned, state: RequestState, config: TrackerConfig
) -> TransferPlan | None:
    """Expand a load or save decision into per-chunk token ranges over the block table."""
    if not decision.keys or decision.end <= decision.start:
        return None
    c = config.chunk_size
    kind = "load" if isinstance(decision, ev.LoadPlanned) else "save"
    chunks: list[ChunkTransfer] = []
    first_chunk = decision.start // c
    for i, (key, slot) in enumerate(zip(decision.keys, decision.slots, strict=True)):
        chunk_start = (first_chunk + i) * c
        lo = max(decision.start, chunk_start)
        hi = min(decision.end, chunk_start + c)
        chunks.append(ChunkTransfer(key, slot, lo, hi, lo - chunk_start))
    blocks = blocks_covering(state.block_ids, config.block_size, decision.start, decision.end)
    first_block = decision.start // config.block_size
    # Block ids for the whole table prefix up to the range end, so token positions index it.
    table = tuple(state.block_ids[: first_block + len(blocks)])
    return TransferPlan(state.req_id, kind, table, tuple(chunks))
