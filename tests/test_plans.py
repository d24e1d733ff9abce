"""tracker.plans (lookup answer, load plan, save plan, transfer plan) and tracker.invariants,
one test per rule of their docstrings. States are built directly so that each rule is tested
on exactly the numbers it is about."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from _pool import stored_items

from kvledger.tracker import events as ev
from kvledger.tracker import invariants as inv
from kvledger.tracker.chunks import ChunkIndex, chunk_keys, partial_key
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.plans import (
    ChunkTransfer,
    answer_lookup,
    blocks_covering,
    plan_load,
    plan_save,
    transfer_plan,
)
from kvledger.tracker.seq import Seq
from kvledger.tracker.state import (
    LoadProgress,
    LookupResult,
    Phase,
    RequestState,
    SaveProgress,
    new_state,
)
from kvledger.tracker.violation import InvariantViolation, Violation

# The chunk-granular rules (block hits off, as every run before them); hits at block
# granularity are tested further down with BLOCKS.
CFG = TrackerConfig(block_size=4, chunk_size=8, num_slots=8, block_hits=False)
BLOCKS = TrackerConfig(block_size=4, chunk_size=8, num_slots=8)


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def running(
    prompt: Sequence[int],
    cfg: TrackerConfig = CFG,
    *,
    num_tokens: int | None = None,
    blocks: int | None = None,
    known: int | None = None,
    lookup: LookupResult | None = None,
    accepted: int = 0,
    cursor: int = 0,
    pending: tuple[tuple[bytes, int], ...] = (),
    prefill_end: int | None = None,
    recompute_only: bool = False,
) -> RequestState:
    """A running request whose tokens [0, num_tokens) are computed or being computed."""
    s = new_state("r", prompt, cfg)
    n = len(prompt) if num_tokens is None else num_tokens
    nb = -(-n // cfg.block_size) if blocks is None else blocks
    s = s._replace(
        phase=Phase.RUNNING,
        num_tokens=n,
        # As the fold leaves an admission: vLLM counts the local hit plus what it accepted.
        num_computed=n if lookup is None else lookup.local_hit + accepted,
        block_ids=Seq(range(10, 10 + nb)),
        lookup=lookup,
        accepted=accepted,
        allocated=True,
        save=SaveProgress(cursor, pending),
        recompute_only=recompute_only,
    )
    if prefill_end is not None:
        s = s._replace(prefill_end=prefill_end)
    if known is not None:
        s = s._replace(
            token_ids=Seq(s.token_ids[:known]), keys=Seq(s.keys[: known // cfg.chunk_size])
        )
    return s


def pool_with(keys: Sequence[bytes], num_slots: int = 8) -> ChunkIndex:
    index = ChunkIndex(num_slots)
    for key in keys:
        slots, evicted = index.choose_slots(1)
        index.apply_save_planned([key], slots, evicted)
        index.apply_save_done(key)
    return index


def tail_key(state: RequestState, end: int, c: int = 8) -> bytes:
    first = end // c * c
    prev = state.keys[first // c - 1] if first else state.root
    return partial_key(prev, state.token_ids[first:end])


# --- the lookup ------------------------------------------------------------------------------


def test_lookup_answers_hit_minus_local() -> None:
    s = new_state("r", tokens(30), CFG)
    index = pool_with(list(s.keys[:2]))  # [0, 16)
    assert answer_lookup(s, index, CFG, 0, 30) == (16, 16)
    assert answer_lookup(s, index, CFG, 8, 30) == (16, 8)
    assert answer_lookup(s, index, CFG, 16, 30) == (16, 0)
    assert answer_lookup(s, index, CFG, 24, 30) == (16, 0)  # negative need (#2703): 0
    assert answer_lookup(s, ChunkIndex(4), CFG, 0, 30) == (0, 0)


def test_lookup_counts_the_prefix_only() -> None:
    s = new_state("r", tokens(32), CFG)
    index = pool_with([s.keys[0], s.keys[2], s.keys[3]])  # chunk 1 missing
    assert answer_lookup(s, index, CFG, 0, 32) == (8, 8)


def test_full_hit_leaves_the_last_token() -> None:
    """#3322 / #4614: the hit covers every token: vLLM must compute the last one."""
    s = new_state("r", tokens(24), CFG)
    index = pool_with(list(s.keys))
    assert answer_lookup(s, index, CFG, 0, 24) == (24, 23)
    assert answer_lookup(s, index, CFG, 16, 24) == (24, 7)
    assert answer_lookup(s, index, CFG, 20, 24) == (24, 3)


def test_lookup_never_counts_chunks_past_num_tokens() -> None:
    s = new_state("r", tokens(32), CFG)
    index = pool_with(list(s.keys))
    assert answer_lookup(s, index, CFG, 0, 20) == (16, 16)


def test_partial_tail_counts_only_if_it_is_exactly_this_tail() -> None:
    s = new_state("r", tokens(20), CFG)
    index = pool_with([*s.keys, tail_key(s, 20)])
    assert answer_lookup(s, index, CFG, 0, 20) == (20, 19)
    longer = new_state("r", tokens(22), CFG)  # same prefix, a different tail
    assert answer_lookup(longer, index, CFG, 0, 22) == (16, 16)
    shorter = new_state("r", tokens(18), CFG)
    assert answer_lookup(shorter, index, CFG, 0, 18) == (16, 16)


def test_lookup_of_a_recompute_only_request_offers_nothing() -> None:
    s = new_state("r", tokens(20), CFG)._replace(recompute_only=True)
    index = pool_with(list(s.keys))
    assert answer_lookup(s, index, CFG, 0, 20) == (16, 0)


def test_lookup_is_pure() -> None:
    s = new_state("r", tokens(40), CFG)
    index = pool_with(list(s.keys[:3]))
    before = (stored_items(index), index.stats(), s)
    answers = {answer_lookup(s, index, CFG, 8, 40) for _ in range(10)}
    assert answers == {(24, 16)}
    assert (stored_items(index), index.stats(), s) == before


# --- the load ----------------------------------------------------------------------------------


def test_blocks_covering() -> None:
    table = [7, 8, 9, 10]
    assert blocks_covering(table, 4, 0, 4) == [7]
    assert blocks_covering(table, 4, 0, 5) == [7, 8]
    assert blocks_covering(table, 4, 3, 9) == [7, 8, 9]
    assert blocks_covering(table, 4, 8, 16) == [9, 10]
    assert blocks_covering(table, 4, 5, 5) == []
    assert blocks_covering(table, 4, 6, 2) == []


def test_no_load_without_accepted_tokens() -> None:
    s = running(tokens(20), lookup=LookupResult(0, 16, 16, 20), accepted=0)
    assert plan_load(s, pool_with(list(s.keys)), CFG, 3) == (None, ())
    s = running(tokens(20), lookup=None, accepted=8)
    assert plan_load(s, pool_with(list(s.keys)), CFG, 3) == (None, ())


def test_load_covers_exactly_what_vllm_accepted() -> None:
    s = running(tokens(30), lookup=LookupResult(8, 24, 16, 30), accepted=16)
    index = pool_with(list(s.keys[:3]))
    load, vs = plan_load(s, index, CFG, 5)
    assert vs == ()
    assert load == ev.LoadPlanned(5, "r", 8, 24, (s.keys[1], s.keys[2]), (1, 2))


def test_load_from_a_local_hit_inside_a_chunk() -> None:
    """vLLM's block-granular local hit can end inside a chunk: the load starts there."""
    s = running(tokens(30), lookup=LookupResult(4, 24, 20, 30), accepted=20)
    index = pool_with(list(s.keys[:3]))
    load, _ = plan_load(s, index, CFG, 0)
    assert load is not None and (load.start, load.end) == (4, 24)
    assert load.keys == tuple(s.keys[:3])
    plan = transfer_plan(load, s, CFG)
    assert plan is not None
    assert plan.chunks[0] == ChunkTransfer(s.keys[0], 0, 4, 8, 4)
    assert plan.num_tokens == 20


def test_load_of_a_partial_tail() -> None:
    s = running(tokens(20), lookup=LookupResult(0, 20, 19, 20), accepted=19)
    tail = tail_key(s, 20)
    index = pool_with([*s.keys, tail])
    load, vs = plan_load(s, index, CFG, 0)
    assert vs == ()
    assert load is not None and (load.start, load.end) == (0, 19)
    assert load.keys == (s.keys[0], s.keys[1], tail)
    plan = transfer_plan(load, s, CFG)
    assert plan is not None and plan.chunks[-1] == ChunkTransfer(tail, 2, 16, 19, 0)


def _refusal(load: ev.LoadPlanned | None) -> tuple[int, ...]:
    assert load is not None
    assert load.keys == () and load.slots == () and load.start == load.end
    return load.refused_blocks


def test_load_beyond_the_blocks_is_refused() -> None:
    s = running(tokens(30), blocks=3, lookup=LookupResult(0, 24, 16, 30), accepted=16)
    load, vs = plan_load(s, pool_with(list(s.keys)), CFG, 0)
    assert [v.rule for v in vs] == ["load_within_allocation"]
    assert _refusal(load) == (10, 11, 12)


def test_load_beyond_the_hit_or_of_the_last_token_is_refused() -> None:
    s = running(tokens(30), lookup=LookupResult(0, 16, 20, 30), accepted=20)
    load, vs = plan_load(s, pool_with(list(s.keys)), CFG, 0)
    assert [v.rule for v in vs] == ["load_within_hit"]
    assert _refusal(load) == (10, 11, 12, 13, 14)
    s = running(tokens(24), lookup=LookupResult(0, 24, 24, 24), accepted=24)
    load, vs = plan_load(s, pool_with(list(s.keys)), CFG, 0)
    assert [v.rule for v in vs] == ["load_within_hit"]  # the last token: never
    assert _refusal(load)


def test_load_of_an_evicted_chunk_is_refused() -> None:
    s = running(tokens(30), lookup=LookupResult(0, 24, 24, 30), accepted=24)
    load, vs = plan_load(s, pool_with([s.keys[0], s.keys[2]]), CFG, 0)
    assert [(v.rule, v.detail) for v in vs] == [("load_chunks_present", {"chunk": 1})]
    assert _refusal(load) == (10, 11, 12, 13, 14, 15)


def test_recompute_only_refuses_silently() -> None:
    s = running(tokens(30), lookup=LookupResult(0, 24, 16, 30), accepted=16, recompute_only=True)
    load, vs = plan_load(s, pool_with(list(s.keys)), CFG, 0)
    assert vs == ()
    assert _refusal(load) == (10, 11, 12, 13)


# --- the save ----------------------------------------------------------------------------------


def test_save_whole_computed_chunks() -> None:
    s = running(tokens(30))
    index = ChunkIndex(8)
    save = plan_save(s, index, CFG, 1)
    assert save == ev.SavePlanned(1, "r", 0, 24, tuple(s.keys), (0, 1, 2), (), 0)
    assert index.stats()["free"] == 8  # a plan is a query: the index is unchanged


@pytest.mark.parametrize(
    ("num_tokens", "blocks", "known", "end"),
    [
        (15, None, None, 8),  # computed
        (30, 4, None, 16),  # capacity
        (30, None, 17, 16),  # known token ids (async scheduling)
    ],
    ids=["computed", "capacity", "known"],
)
def test_save_limited_by_computed_capacity_and_known(
    num_tokens: int, blocks: int | None, known: int | None, end: int
) -> None:
    s = running(tokens(30), num_tokens=num_tokens, blocks=blocks, known=known)
    save = plan_save(s, ChunkIndex(8), CFG, 0)
    assert save is not None and (save.start, save.end) == (0, end)


def test_decode_chunks_only_with_save_decode_cache() -> None:
    prompt = tokens(40)
    s = running(prompt, prefill_end=20, cursor=16)
    assert plan_save(s, ChunkIndex(8), CFG, 0) is None
    cfg = CFG.with_changes(save_decode_cache=True)
    save = plan_save(s, ChunkIndex(8), cfg, 0)
    assert save is not None and (save.start, save.end) == (16, 40)


def test_partial_chunk_only_without_discard() -> None:
    s = running(tokens(20))
    save = plan_save(s, ChunkIndex(8), CFG, 0)
    assert save is not None and (save.start, save.end) == (0, 16)
    keep = CFG.with_changes(discard_partial_chunks=False)
    save = plan_save(s, ChunkIndex(8), keep, 0)
    assert save is not None and (save.start, save.end) == (0, 20)  # one plan, same step
    assert save.keys == (s.keys[0], s.keys[1], tail_key(s, 20))


def test_partial_chunk_only_when_the_prefill_is_computed() -> None:
    keep = CFG.with_changes(discard_partial_chunks=False)
    s = running(tokens(20), num_tokens=18, cursor=16)
    assert plan_save(s, ChunkIndex(8), keep, 0) is None
    s = running(tokens(20), known=19, cursor=16)
    assert plan_save(s, ChunkIndex(8), keep, 0) is None


def test_after_a_partial_chunk_the_next_full_chunk_is_saved_whole() -> None:
    """Regression: the cursor sits at 20 after the partial [16, 20); the chunk [16, 24) must be
    saved from 16, or its slot keeps garbage for tokens 16..19 under a key naming them."""
    cfg = CFG.with_changes(discard_partial_chunks=False, save_decode_cache=True)
    s = running(tokens(30), num_tokens=24, prefill_end=20, cursor=20)
    save = plan_save(s, ChunkIndex(8), cfg, 0)
    assert save is not None and (save.start, save.end, save.keys) == (16, 24, (s.keys[2],))
    plan = transfer_plan(save, s, cfg)
    assert plan is not None and plan.chunks == (ChunkTransfer(s.keys[2], 0, 16, 24, 0),)
    # and the partial chunk is never saved twice
    s = running(tokens(30), num_tokens=22, prefill_end=20, cursor=20)
    assert plan_save(s, ChunkIndex(8), cfg, 0) is None


def test_stored_chunks_are_skipped_and_move_the_watermark() -> None:
    s = running(tokens(40))
    index = pool_with([s.keys[0], s.keys[1]])
    save = plan_save(s, index, CFG, 0)
    assert save is not None
    assert (save.skip_to, save.start, save.end) == (16, 16, 40)
    only_stored = pool_with(list(s.keys))
    save = plan_save(s, only_stored, CFG, 0)
    assert save == ev.SavePlanned(0, "r", 40, 40, (), (), (), 40)


def test_a_stored_pool_tail_moves_the_watermark() -> None:
    keep = CFG.with_changes(discard_partial_chunks=False)
    s = running(tokens(20), cursor=16)
    save = plan_save(s, pool_with([tail_key(s, 20)]), keep, 0)
    assert save == ev.SavePlanned(0, "r", 20, 20, (), (), (), 20)


def test_the_plan_is_one_contiguous_range() -> None:
    s = running(tokens(40))
    index = pool_with([s.keys[1]])
    save = plan_save(s, index, CFG, 0)
    assert save is not None
    assert (save.start, save.end, save.keys) == (0, 8, (s.keys[0],))


def test_a_chunk_another_request_writes_is_waited_for() -> None:
    s = running(tokens(40))
    index = ChunkIndex(8)
    index.apply_save_planned([s.keys[1]], [5], [])
    save = plan_save(s, index, CFG, 0)
    assert save is not None and save.keys == (s.keys[0],)
    s2 = running(tokens(40), cursor=8)
    assert plan_save(s2, index, CFG, 0) is None


def test_eviction_is_lru_and_never_evicts_pinned_chunks() -> None:
    other = [bytes([i]) * 16 for i in range(3)]
    index = pool_with(other, num_slots=3)
    index.pin([other[0]])
    s = running(tokens(24))
    save = plan_save(s, index, CFG, 0)
    assert save is not None
    assert save.evicted == (other[1], other[2])
    assert save.slots == (1, 2)
    assert save.keys == tuple(s.keys[:2])  # two slots for three chunks: the rest later
    index.pin(other[1:])
    assert plan_save(s, index, CFG, 0) is None


def test_no_save_for_a_recompute_only_request() -> None:
    s = running(tokens(40), recompute_only=True)
    assert plan_save(s, ChunkIndex(8), CFG, 0) is None


# --- transfer plans ----------------------------------------------------------------------------


def test_transfer_plan_of_a_save() -> None:
    s = running(tokens(40))
    save = ev.SavePlanned(0, "r", 8, 24, (b"a", b"b"), (3, 4))
    plan = transfer_plan(save, s, CFG)
    assert plan is not None and plan.kind == "save"
    assert plan.chunks == (ChunkTransfer(b"a", 3, 8, 16, 0), ChunkTransfer(b"b", 4, 16, 24, 0))
    assert plan.block_ids == (10, 11, 12, 13, 14, 15)  # the table up to the range's end
    assert plan.num_tokens == 16


def test_no_transfer_plan_for_an_empty_decision() -> None:
    s = running(tokens(40))
    assert transfer_plan(ev.SavePlanned(0, "r", 8, 8, (), (), (), 8), s, CFG) is None
    assert transfer_plan(ev.LoadPlanned(0, "r", 0, 0, refused_blocks=(1,)), s, CFG) is None


# --- invariants --------------------------------------------------------------------------------


def _sched(nc: int, ns: int) -> ev.Scheduled:
    return ev.Scheduled(1, "r", nc, ns)


def test_tokens_within_blocks() -> None:
    ok = running(tokens(16), blocks=4)
    assert inv.tokens_within_blocks(ok, _sched(0, 16), CFG) is None
    bad = running(tokens(17), blocks=4)
    v = inv.tokens_within_blocks(bad, _sched(0, 17), CFG)
    assert v is not None and v.rule == "tokens_within_blocks"
    assert v.detail == {"num_tokens": 17, "capacity": 16}
    waiting = bad._replace(phase=Phase.PREEMPTED)
    assert inv.tokens_within_blocks(waiting, _sched(0, 17), CFG) is None


def test_tokens_match_schedule_and_async_lag() -> None:
    s = running(tokens(20), known=19)
    assert inv.tokens_match_schedule(s, _sched(19, 1), CFG) is None  # one unsampled token
    v = inv.tokens_match_schedule(s, _sched(18, 1), CFG)
    assert v is not None and v.rule == "tokens_match_schedule"
    lagging = running(tokens(20), known=18)
    v = inv.tokens_match_schedule(lagging, _sched(19, 1), CFG)
    assert v is not None and v.rule == "tokens_known"
    spec = CFG.with_changes(max_async_lag=2)
    assert inv.tokens_match_schedule(lagging, _sched(19, 1), spec) is None
    assert inv.tokens_match_schedule(s, ev.LoadDone(1, "r"), CFG) is None  # only Scheduled


def test_saved_le_computed() -> None:
    assert inv.saved_le_computed(running(tokens(20), cursor=16), _sched(0, 20), CFG) is None
    v = inv.saved_le_computed(running(tokens(20), cursor=24), _sched(0, 20), CFG)
    assert v is not None and v.rule == "saved_le_computed"
    pend = running(tokens(20), cursor=24, pending=((b"k", 16),))
    v = inv.saved_le_computed(pend, _sched(0, 20), CFG)
    assert v is not None and v.detail == {"save_cursor": 24, "num_tokens": 20}


def test_load_within_allocation() -> None:
    s = running(tokens(20))._replace(num_computed=16, load=LoadProgress(0, 16, (b"k",), False))
    assert inv.load_within_allocation(s, ev.LoadPlanned(0, "r", 0, 16), CFG) is None
    for bad in (
        s._replace(block_ids=Seq([1, 2, 3])),  # beyond the blocks
        s._replace(num_computed=15),  # beyond what vLLM counts computed
        s._replace(token_ids=Seq(s.token_ids[:16])),  # the last known token
    ):
        v = inv.load_within_allocation(bad, ev.LoadPlanned(0, "r", 0, 16), CFG)
        assert v is not None and v.rule == "load_within_allocation"
    done = s._replace(num_computed=15, load=s.load._replace(done=True))  # type: ignore[union-attr]
    assert inv.load_within_allocation(done, ev.LoadDone(0, "r"), CFG) is None


def test_check_runs_the_checks_of_the_event_type() -> None:
    bad = running(tokens(17), blocks=4, cursor=24)
    assert [v.rule for v in inv.check(bad, _sched(0, 17), CFG)] == [
        "tokens_within_blocks",
        "saved_le_computed",
    ]
    assert [v.rule for v in inv.check(bad, ev.SavePlanned(0, "r", 0, 0), CFG)] == [
        "saved_le_computed"
    ]
    assert inv.check(bad, ev.LookupAsked(0, "r", 0, 17), CFG) == []
    assert inv.check(None, _sched(0, 17), CFG) == []
    only = inv.check(bad, ev.LookupAsked(0, "r", 0, 17), CFG, (inv.tokens_within_blocks,))
    assert [v.rule for v in only] == ["tokens_within_blocks"]
    assert set(inv.ALL_CHECKS) >= {f for fs in inv.CHECKS_BY_EVENT.values() for f in fs}


def test_invariant_violation_carries_the_violation() -> None:
    v = Violation("tokens_within_blocks", 3, "r", "Scheduled", {"num_tokens": 17})
    err = InvariantViolation(v)
    assert isinstance(err, AssertionError)
    assert err.violation is v
    assert str(err) == "step 3 r: tokens_within_blocks at Scheduled (num_tokens=17)"


def test_chunk_keys_of_the_state_are_the_chain() -> None:
    s = new_state("r", tokens(40), CFG)
    assert list(s.keys) == chunk_keys(s.root, tokens(40), 8)
