"""``tracker.plans.lookup_spans``, the units a lookup reads, is the lookup's own rule: the
answer's hit is the end of the longest prefix of them a tier holds (``span_tier``), they tile
the tokens asked in order, each names the unit before it as its parent, and reading from a
token on gives the same units. ``replay.explain`` derives reasons from these functions, so a
change to how a lookup hits (chunks, blocks) reaches it, and this test says when the two part.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.plans import answer_lookup, lookup_spans, span_tier
from kvledger.tracker.state import new_state
from kvledger.tracker.tiers import POOL, REMOTE


@settings(max_examples=300, deadline=None)
@given(
    block=st.sampled_from([1, 2, 4]),
    blocks_per_chunk=st.sampled_from([1, 2, 3]),
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    asked_less=st.integers(0, 6),
    stored=st.lists(st.booleans(), max_size=20),
    remote=st.lists(st.booleans(), max_size=20),
    local=st.integers(0, 8),
    tail=st.booleans(),
    start=st.integers(0, 45),
)
def test_the_lookup_hits_a_prefix_of_its_spans(
    block: int,
    blocks_per_chunk: int,
    prompt: list[int],
    asked_less: int,
    stored: list[bool],
    remote: list[bool],
    local: int,
    tail: bool,
    start: int,
) -> None:
    config = TrackerConfig(block_size=block, chunk_size=block * blocks_per_chunk, num_slots=64)
    state = new_state("r", prompt, config)
    n = max(1, len(prompt) - asked_less)
    spans = list(lookup_spans(state, config, n))
    index = ChunkIndex(config.num_slots)
    slot = 0
    for i, span in enumerate(spans):
        if span.partial:
            if tail:
                index.apply_stored(span.key, slot)
                slot += 1
        elif i < len(stored) and stored[i]:
            index.apply_stored(span.key, slot)
            slot += 1
        elif i < len(remote) and remote[i]:
            index.remote.add([span.key])
    # They tile [0, n): contiguous, in order, each chained to the one before.
    assert spans and spans[0].start == 0 and spans[-1].end == n
    parent = state.root
    for a, b in zip([None, *spans], spans, strict=False):
        if a is not None:
            assert a.end == b.start
            parent = a.key
        assert b.parent == parent and b.start < b.end
        assert b.partial == (b.end - b.start < config.chunk_size)
    # The answer's hit: the end of the held prefix.
    held = 0
    for span in spans:
        tier = span_tier(index, span)
        assert tier in (None, POOL, REMOTE)
        if tier is None:
            break
        held = span.end
    hit, external = answer_lookup(state, index, config, min(local, n - 1), n)
    assert hit == held
    assert external == max(0, hit - min(local, n - 1) - (1 if hit >= n else 0))
    # Read from a token on: the same units, from the one holding that token.
    later = list(lookup_spans(state, config, n, start))
    assert later == [s for s in spans if s.end > start]
