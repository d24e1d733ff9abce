"""The bug classes of lmcache-adapter-and-bugs.md §2, driven through the connector's public
callbacks (``SchedulerSide``: get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, update_connector_output, request_finished) in vLLM's order, without
vLLM's scheduler (see ``fakes.FakeEngine``).

Where bytes matter, a ``WorkerSide`` (the rigs' ``FaultyWorkerSide``, which can fail chosen
chunk loads) executes the plans over small CPU paged caches owned by the KV-content oracle, and
the test checks KV values (every computed token holds the value of its prefix, position, layer
and K/V), not just counts.

Notation as in the report: ``B`` block size, ``C`` chunk size, ``P`` prompt length, ``nc``
vLLM's ``num_computed_tokens`` when ``build_connector_meta`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
from fakes import (
    PREEMPT_SIGNALS,
    SHAPES,
    FakeBlocks,
    FakeEngine,
    FakeRequest,
    KVConnectorOutput,
    ManualEvent,
    NewRequestData,
    RequestStatus,
    SchedulerOutput,
    StepRecord,
    WorkerMeta,
    hold_saves,
)

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.messages import StepPlan, WorkerReport
from kvledger.connector.scheduler import SchedulerSide
from kvledger.connector.testing.faults import FaultyWorkerSide
from kvledger.connector.testing.oracle import KVOracle
from kvledger.connector.transfer import TransferHandle
from kvledger.tracker.state import LookupResult, Phase
from kvledger.tracker.violation import InvariantViolation

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


# --- helpers ---------------------------------------------------------------------------------


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` token ids; different seeds share no prefix."""
    return [3 + (seed * 7919 + i * 131 + (i * i) % 97) % 30000 for i in range(n)]


def make_side(
    block: int = 16, chunk: int = 16, slots: int = 64, world_size: int = 1, **cfg: Any
) -> SchedulerSide:
    config = ConnectorConfig(chunk_size=chunk, **cfg)
    return SchedulerSide(
        config, block_size=block, num_slots=slots, salt="tiny-llama|2L", world_size=world_size
    )


def make_engine(
    *,
    block: int = 16,
    chunk: int = 16,
    slots: int = 64,
    num_blocks: int | None = None,
    layout: str = "flash_attn",
    load_fault: Callable[[str, Any], bool] | None = None,
    shape: str = "v0.11.1",
    preempt_signal: str = "set",
    async_scheduling: bool = False,
    defer_finalize: bool = False,
    **cfg: Any,
) -> FakeEngine:
    """A scheduler side; with ``num_blocks`` also a worker over oracle-owned CPU caches."""
    side = make_side(block, chunk, slots, **cfg)
    worker = oracle = None
    if num_blocks is not None:
        oracle = KVOracle(
            LAYERS,
            num_blocks=num_blocks,
            block_size=block,
            num_kv_heads=2,
            head_size=4,
            layout=layout,
        )
        worker = FaultyWorkerSide(
            side.config, num_slots=slots, layout=layout, load_fault=load_fault
        )
        worker.register_kv_caches(oracle.caches)
    return FakeEngine(
        side,
        worker=worker,
        oracle=oracle,
        shape=shape,
        preempt_signal=preempt_signal,
        async_scheduling=async_scheduling,
        defer_finalize=defer_finalize,
    )


def blocks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def no_violations(eng: FakeEngine) -> None:
    assert not eng.violations, [v.describe() for v in eng.violations]
    assert eng.scheduler.adapter_errors == 0


def ok_kv(eng: FakeEngine, req_id: str, upto: int | None = None) -> None:
    mismatch = eng.verify(req_id, upto)
    assert mismatch is None, mismatch.describe()


def decode(eng: FakeEngine, req_id: str, steps: int, **kwargs: Any) -> list[Any]:
    return [eng.step({req_id: 1}, **kwargs) for _ in range(steps)]


def prefill(
    eng: FakeEngine,
    req_id: str,
    p: list[int],
    table: list[int],
    n: int | None = None,
    *,
    external: int = 0,
    local_hit: int = 0,
    finish: bool = False,
    cache_salt: str | None = None,
) -> tuple[FakeRequest, StepRecord]:
    """A new request added with prompt ``p`` and admitted on ``table`` (the lookup must answer
    ``external`` beyond vLLM's ``local_hit``), then ``n`` tokens (the rest of the prompt unless
    given) computed in one step, its last if ``finish``."""
    req = eng.add(req_id, p, cache_salt=cache_salt)
    assert eng.admit(req, table, local_hit=local_hit) == external
    n = len(p) - local_hit - external if n is None else n
    return req, eng.step({req_id: n}, finish=[req_id] if finish else [])


def pool_with(
    eng: FakeEngine,
    p: list[int],
    table: list[int] | None = None,
    req_id: str = "A",
    *,
    cache_salt: str | None = None,
) -> StepRecord:
    """``req_id`` prefills ``p`` on ``table`` (blocks 1..4 unless given) and finishes; the
    next step confirms its saves: the pool holds ``p``'s chunks. Returns the prefill step."""
    table = [1, 2, 3, 4] if table is None else table
    _, rec = prefill(eng, req_id, p, table, finish=True, cache_salt=cache_salt)
    eng.step({})
    return rec


def _finish_prefill(eng: FakeEngine, req_id: str, total: int) -> None:
    """Schedule what vLLM still has to compute (after a rollback, if any)."""
    req = eng.requests[req_id]
    if req.num_computed_tokens < total:
        eng.step({req_id: total - req.num_computed_tokens})


def side_admit(
    side: SchedulerSide, req: FakeRequest, table: list[int], external: int = 0
) -> NewRequestData:
    """Straight to the SchedulerSide, no engine: ``req`` looked up (the answer must be
    ``external``) and allocated ``table``; returns its entry for the step that schedules it."""
    assert side.get_num_new_matched_tokens(req, 0) == (external, False)
    side.update_state_after_alloc(req, FakeBlocks(table), external)
    return NewRequestData(req.request_id, req.prompt_token_ids, (table,), external)


def side_prefill(side: SchedulerSide, *reqs: tuple[FakeRequest, list[int]]) -> StepPlan:
    """Straight to the SchedulerSide: new requests (no hit), each with its block table,
    admitted and prefilled whole in one step; that step's plan."""
    new = [side_admit(side, req, table) for req, table in reqs]
    tokens = {req.request_id: len(req.prompt_token_ids) for req, _ in reqs}
    return side.build_connector_meta(
        SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens=tokens)
    )


# --- S1: a resumed request must load, and its tracker must be rebuilt ------------------------


def _s1_until_preempted(eng: FakeEngine) -> FakeRequest:
    """R1: P=34 on blocks [4,5,6], prefill saves [0,32) (partial chunk discarded), three
    decode steps (no meta), preempted with all_token_ids=38, nc=37."""
    r1, rec = prefill(eng, "R1", prompt(34), [4, 5, 6])
    assert rec.saved_ranges("R1") == [(0, 16), (16, 32)]
    assert rec.saves_of("R1")[0].block_ids == (4, 5)
    for rec in decode(eng, "R1", 3):
        assert rec.plan.loads == () and rec.plan.saves == ()
    assert (r1.num_tokens, r1.num_computed_tokens) == (38, 37)
    # TR grew 35, 36, 37 (steady decode steps; token ids are learned in bulk when needed)
    assert eng.state("R1").num_tokens == 37
    eng.preempt(r1)
    # Blocks 5 and 6 are reused by another request (as in #1969).
    prefill(eng, "R2", prompt(30, seed=2), [5, 6])
    return r1


@pytest.mark.parametrize("signal", PREEMPT_SIGNALS)
@pytest.mark.parametrize("shape", SHAPES)
def test_s1_resumed_request_loads_and_is_rebuilt(shape: str, signal: str) -> None:
    eng = make_engine(num_blocks=12, shape=shape, preempt_signal=signal)
    r1 = _s1_until_preempted(eng)
    if signal == "set":
        assert eng.state("R1").phase is Phase.PREEMPTED
    # Block 4 is still a prefix-cache hit: the lookup runs over all 38 tokens, hits 32.
    assert eng.admit(r1, [4, 9, 10], local_hit=16) == 16
    assert eng.state("R1").lookup == LookupResult(16, 32, 16, 38)
    rec = eng.step({"R1": 6})
    assert rec.loaded_ranges("R1") == [(16, 32)]
    assert rec.load_of("R1").block_ids == (4, 9)
    assert rec.saves_of("R1") == []  # S=32, L=38 < 48
    state = eng.state("R1")
    assert list(state.block_ids) == [4, 9, 10]  # replaced, not [4,5,6,4,9,10]
    assert list(state.token_ids) == r1.all_token_ids[:38]
    assert (state.num_computed, state.num_tokens, state.saved) == (32, 38, 32)
    assert state.life.num_preemptions == 1
    assert eng.scheduler.tracker.counts["preemptions"] == 1
    ok_kv(eng, "R1")  # tokens 16..31 arrived in block 9; 32..37 computed
    ok_kv(eng, "R2")  # blocks 5 and 6 untouched by R1
    no_violations(eng)


def test_s1_without_prefix_caching_loads_all_32_tokens() -> None:
    """The #2007 repro: local hit 0, the whole stored prefix is loaded."""
    eng = make_engine(num_blocks=12)
    r1 = _s1_until_preempted(eng)
    assert eng.admit(r1, [9, 10, 11], local_hit=0) == 32
    rec = eng.step({"R1": 6})
    assert rec.loaded_ranges("R1") == [(0, 16), (16, 32)]
    assert rec.load_of("R1").block_ids == (9, 10)
    ok_kv(eng, "R1")
    ok_kv(eng, "R2")
    no_violations(eng)


def test_s1_saves_after_resume_read_only_the_new_blocks() -> None:
    """With save_decode_cache the next save (at L=48) reads block 10, not the reused blocks 5
    and 6 of another request: a later request loading the chunk gets R1's KV."""
    eng = make_engine(num_blocks=16, save_decode_cache=True)
    r1 = _s1_until_preempted(eng)
    eng.admit(r1, [4, 9, 10], local_hit=16)
    eng.step({"R1": 6})
    saved = []
    for rec in decode(eng, "R1", 10):  # nc 38 -> 48
        saved += [(p.block_ids, r) for p in rec.saves_of("R1") for r in rec.saved_ranges("R1")]
    assert saved == [((4, 9, 10), (32, 48))]
    ok_kv(eng, "R1")
    _, rec = prefill(eng, "Q", [*eng.tokens("R1", 48), 7, 8], [12, 13, 14, 15], external=48)
    assert rec.loaded_ranges("Q") == [(0, 16), (16, 32), (32, 48)]
    ok_kv(eng, "Q")
    no_violations(eng)


# --- S2: the lookup is a query, asked again after every failed allocation ---------------------


def test_s2_lookup_repeated_across_allocation_failures() -> None:
    """#2158: P=10009, C=256; after preemption the local hit (336) exceeds the pool hit (256):
    every retry answers 0 and leaves the pool untouched, then USAA(0) is consistent."""
    eng = make_engine(block=16, chunk=256)
    table = blocks(1, 626)
    r, rec = prefill(eng, "R", prompt(10009), table, 336)  # chunked prefill
    assert rec.saved_ranges("R") == [(0, 256)]
    eng.preempt(r)
    eng.step({})
    pool = eng.scheduler.tracker.index.stats()
    for _ in range(3):  # allocation fails: R stays waiting, vLLM asks again next step
        assert eng.lookup(r, 336) == 0
        eng.step({})
    assert eng.scheduler.tracker.index.stats() == pool
    assert eng.state("R").lookup == LookupResult(336, 256, 0, 10009)
    assert eng.admit(r, table, local_hit=336) == 0
    rec = eng.step({"R": 256})
    assert rec.plan.loads == () and rec.plan.refused_blocks == ()
    assert rec.saved_ranges("R") == [(256, 512)]  # chunk 0 is already in the pool
    no_violations(eng)


def test_get_num_new_matched_tokens_asked_ten_times_answers_the_same() -> None:
    eng = make_engine(block=16, chunk=16, num_blocks=16)
    p = prompt(50)
    pool_with(eng, p)
    b = eng.add("B", [*p, 9, 9])
    tracker = eng.scheduler.tracker
    pool, counts = tracker.index.stats(), dict(tracker.counts)
    answers = []
    for _ in range(10):
        answers.append(eng.lookup(b, 16))
        eng.step({})  # allocation failed: a step without B
    assert answers == [32] * 10
    assert tracker.index.stats() == pool
    assert tracker.counts["tokens_loaded"] == counts["tokens_loaded"]
    assert eng.admit(b, [1, 5, 6, 7], local_hit=16) == 32
    rec = eng.step({"B": 4})
    assert rec.loaded_ranges("B") == [(16, 32), (32, 48)]
    ok_kv(eng, "B")
    no_violations(eng)


def test_s2_4508_two_lookups_then_allocation_store_from_512() -> None:
    """#4508 (MP mode): two lookups that hit 512 before the allocation succeeds must not
    double the stored watermark: the next save starts at 512."""
    eng = make_engine(block=16, chunk=256, num_blocks=110, slots=8, block_hits=False)
    p = prompt(1000)
    assert pool_with(eng, p[:600], blocks(1, 38)).saved_ranges("A") == [(0, 256), (256, 512)]
    r = eng.add("R", p)
    assert eng.lookup(r, 0) == 512
    eng.step({})  # allocation failed
    assert eng.admit(r, blocks(40, 63)) == 512  # the second lookup, then USAA(512)
    rec = eng.step({"R": 488})
    assert rec.loaded_ranges("R") == [(0, 256), (256, 512)]
    assert rec.saved_ranges("R") == [(512, 768)]
    assert eng.state("R").saved == 768
    ok_kv(eng, "R")
    no_violations(eng)


# --- S3: vLLM's prefix hit and the pool hit disagree on resume --------------------------------


def test_s3a_vllm_prefix_hit_larger_than_the_pool_hit() -> None:
    """P=600 (S=512), 10 outputs, preempted; resume with local 592 > pool hit 512: the
    lookup answers 0 (#2703: a negative need is normal), no load, no save, no violation."""
    eng = make_engine(block=16, chunk=256, block_hits=False)
    table = blocks(1, 39)
    r, rec = prefill(eng, "R", prompt(600), table)
    assert rec.saved_ranges("R") == [(0, 256), (256, 512)]
    decode(eng, "R", 9)
    assert r.num_tokens == 610
    eng.preempt(r)
    eng.step({})
    assert eng.admit(r, table, local_hit=592) == 0
    rec = eng.step({"R": 18})
    assert rec.plan.loads == () and rec.plan.saves == () and rec.plan.refused_blocks == ()
    state = eng.state("R")
    assert list(state.token_ids) == r.all_token_ids[:610]
    assert (state.num_computed, state.num_tokens, state.saved) == (592, 610, 512)
    no_violations(eng)


def test_s3b_pool_hit_grew_while_preempted() -> None:
    """R1 (P=1000) preempted mid-prefill at 768; R2 with the same prompt stores up to 1000
    (partial chunks kept); R1 resumes with a full hit: 999 external, the tracker holds all
    1000 tokens and the load fills [0, 999), the partial chunk included."""
    eng = make_engine(block=16, chunk=256, num_blocks=1 + 63 * 3, discard_partial_chunks=False)
    p = prompt(1000)
    r1, rec = prefill(eng, "R1", p, blocks(1, 63), 768)
    assert rec.saved_ranges("R1") == [(0, 256), (256, 512), (512, 768)]
    eng.preempt(r1)
    _, rec = prefill(eng, "R2", p, blocks(64, 63), external=768, finish=True)
    assert rec.loaded_ranges("R2") == [(0, 256), (256, 512), (512, 768)]
    assert rec.saved_ranges("R2") == [(768, 1000)]
    eng.step({})
    assert eng.admit(r1, blocks(127, 63)) == 999  # full hit: the last token is recomputed
    rec = eng.step({"R1": 1})
    assert rec.loaded_ranges("R1") == [(0, 256), (256, 512), (512, 768), (768, 999)]
    state = eng.state("R1")
    assert list(state.token_ids) == p and state.num_tokens == 1000
    ok_kv(eng, "R1")
    no_violations(eng)


# --- S4: decode tokens must reach the tracker (async scheduling) -----------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_s4_decode_tokens_reach_the_tracker(async_scheduling: bool) -> None:
    """C=256, save_decode_cache, partial chunks kept, P=300. Under async scheduling step k+1
    is built before token k exists (nc == len(all_token_ids)); the tracker must never get
    stuck: it counts every step, learns the token ids (in bulk, when the decode chunk is due,
    not one per step: steady decode steps are StepDecoded), and saves the decode chunk
    [256, 512) once 512 tokens exist, whole."""
    eng = make_engine(
        block=16,
        chunk=256,
        num_blocks=1 + 38 + 34,
        slots=8,
        save_decode_cache=True,
        discard_partial_chunks=False,
        async_scheduling=async_scheduling,
    )
    r, rec = prefill(eng, "R", prompt(300), blocks(1, 38))
    saves = [(0, rng) for rng in rec.saved_ranges("R")]
    lag = 1 if async_scheduling else 0
    for _i in range(1, 230):
        nc, known_to_vllm = r.num_computed_tokens, r.num_tokens
        assert nc == known_to_vllm - 1 + lag  # the #2929 vectors: nc=100/101, all=101/100
        rec = eng.step({"R": 1})
        saves += [(nc + 1, rng) for rng in rec.saved_ranges("R")]
        state = eng.state("R")
        assert state.num_tokens == nc + 1  # never stuck at P
        if state.num_tokens >= 512:  # the decode chunk was due: its token ids were learned
            assert len(state.token_ids) >= 512 - lag
            assert list(state.token_ids) == r.all_token_ids[: len(state.token_ids)]
    eng.drain()
    # The prefill's partial chunk right away; the decode chunk [256, 512) as a whole chunk,
    # in the step whose tokens reach 512.
    assert saves == [(0, (0, 256)), (0, (256, 300)), (512 + lag, (256, 512))]
    ok_kv(eng, "R")
    # The stored decode chunk holds R's KV: a new request with R's first 520 tokens loads it.
    _, rec = prefill(eng, "Q", eng.tokens("R", 520), blocks(39, 33), external=512)
    assert rec.loaded_ranges("Q") == [(0, 256), (256, 512)]
    eng.drain()
    ok_kv(eng, "Q")
    no_violations(eng)


def test_s4_pr2929_vectors_preemption_and_chunked_prefill() -> None:
    """(prompt 100 + 50 decoded, resumed at nc=50, 50 scheduled) keeps all 150 tokens and
    computes [0, 100); (P=500 chunked at 256) learns 256..499 in the second chunk."""
    # C > P and whole chunks only: nothing stored, every lookup answers 0.
    eng = make_engine(block=10, chunk=200, block_hits=False)
    table = blocks(1, 16)
    r, _ = prefill(eng, "R", prompt(100), table)
    decode(eng, "R", 49)
    assert r.num_tokens == 150
    eng.preempt(r)
    eng.step({})
    assert eng.admit(r, table, local_hit=50) == 0
    eng.step({"R": 50})
    state = eng.state("R")
    assert list(state.token_ids) == r.all_token_ids[:150]
    assert (state.num_computed, state.num_tokens) == (50, 100)

    c, _ = prefill(eng, "C", prompt(500, seed=3), blocks(20, 52), 256)
    assert len(eng.state("C").token_ids) == 500 and eng.state("C").num_tokens == 256
    eng.step({"C": 244})
    state = eng.state("C")
    assert (state.num_computed, state.num_tokens) == (256, 500)
    assert list(state.token_ids) == c.all_token_ids[:500]
    for _ in range(10):  # the 10-step decode loop: counted every step (token ids in bulk later)
        before = c.num_tokens
        eng.step({"C": 1})
        assert eng.state("C").num_tokens == before  # nc + 1 == len(all_token_ids), sync
    no_violations(eng)


# --- S5 / S6: full hits leave the last token to vLLM -------------------------------------------


def test_s5_full_hit_on_resume_loads_all_but_the_last_token() -> None:
    """R: P=100, 100 decoded (all_token_ids=200); the pool holds all 200 tokens (stored by R2,
    whose prompt is R's 200 tokens). Resume with local 100: external = 200-100-1 = 99, nc=199,
    one token scheduled; the load fills [100, 199) and the KV is right."""
    eng = make_engine(block=4, chunk=40, num_blocks=1 + 51 + 50 + 26, slots=16, block_hits=False)
    r_table = blocks(1, 51)
    r, _ = prefill(eng, "R", prompt(100), r_table)
    decode(eng, "R", 99)
    assert (r.num_tokens, r.num_computed_tokens) == (200, 199)
    eng.preempt(r)
    # 80 external: R's prefill chunks
    _, rec = prefill(eng, "R2", list(r.all_token_ids), blocks(52, 50), external=80, finish=True)
    assert rec.saved_ranges("R2") == [(80, 120), (120, 160), (160, 200)]
    eng.step({})
    # Blocks 1..25 (tokens 0..99) are still a prefix-cache hit in vLLM.
    table = r_table[:25] + blocks(102, 26)
    assert eng.admit(r, table, local_hit=100) == 99
    rec = eng.step({"R": 1})
    assert rec.loaded_ranges("R") == [(100, 120), (120, 160), (160, 199)]
    state = eng.state("R")
    assert (state.num_computed, state.num_tokens, len(state.token_ids)) == (199, 200, 200)
    ok_kv(eng, "R")
    no_violations(eng)


@pytest.mark.parametrize(
    ("local", "hit", "num_tokens", "num_computed", "violation"),
    [
        (0, 4032, 4032, 4031, False),  # full hit from nothing: -1
        (0, 4032, 4032, 4030, True),  # vLLM counts one token less than it accepted
        (0, 4032, 4032, 4032, True),  # vLLM counts the last token as loaded too
        (96, 4032, 4032, 4031, False),  # (vllm=100, lmc=4032, nc=4031), block-aligned
        (496, 192, 1000, 496, False),  # vLLM's hit > pool hit: 0 external
        (496, 192, 1000, 495, True),
    ],
)
def test_s5_pr2929_admission_vectors(
    local: int, hit: int, num_tokens: int, num_computed: int, violation: bool
) -> None:
    """At a resumed admission vLLM's num_computed must be local hit + accepted external
    tokens; anything else is recorded and the request recomputes (no load)."""
    eng = make_engine(block=16, chunk=64, slots=128)
    p = prompt(num_tokens)
    pool_with(eng, p[:hit], blocks(1, 252), "S")
    r = eng.add("R", p)
    r.status = RequestStatus.PREEMPTED
    external = eng.admit(r, blocks(300, 253), local_hit=local)
    assert external == max(0, hit - local - (hit == num_tokens))
    r.num_computed_tokens = num_computed  # what vLLM claims
    rec = eng.step({"R": 1})
    if violation:
        assert eng.rules() == ["admission_matches_lookup"]
        assert eng.state("R").recompute_only
        assert rec.load_of("R") is None
    else:
        no_violations(eng)
        load = rec.load_of("R")
        if external:
            assert load.chunks[0].token_start == local
            assert load.chunks[-1].token_end == local + external
            assert load.num_tokens == external
        else:
            assert load is None


@pytest.mark.parametrize(
    ("prompt_len", "discard_partial"), [(895, False), (512, True)], ids=["895", "512-aligned"]
)
def test_s6_full_prompt_hit_leaves_the_last_token(prompt_len: int, discard_partial: bool) -> None:
    """#4614: hit == P == 895 -> 894 external; the worker loads exactly positions 0..893 and
    leaves 894 to the forward pass (also for a chunk-aligned prompt: the last chunk is loaded
    short of its end)."""
    n_blocks = -(-prompt_len // 16)
    eng = make_engine(
        block=16, chunk=256, num_blocks=1 + n_blocks * 2, discard_partial_chunks=discard_partial
    )
    p = prompt(prompt_len)
    rec = pool_with(eng, p, blocks(1, n_blocks), "R0")
    starts = list(range(0, prompt_len, 256))
    assert rec.saved_ranges("R0") == [(s, min(s + 256, prompt_len)) for s in starts]
    r = eng.add("R", p)
    last = prompt_len - 1
    assert eng.admit(r, blocks(1 + n_blocks, n_blocks)) == last
    loaded_before = eng.worker.stats["tokens_loaded"]
    seen: dict[str, Any] = {}

    def before_forward(plan: StepPlan) -> None:
        # After the loads, before the forward: 0..P-2 hold R's KV, P-1 was never written.
        seen["all_but_last"] = eng.verify("R", last)
        seen["all"] = eng.verify("R", prompt_len)

    rec = eng.step({"R": 1}, before_forward=before_forward)
    assert rec.loaded_ranges("R") == [(s, min(s + 256, last)) for s in starts]
    assert eng.worker.stats["tokens_loaded"] - loaded_before == last
    assert seen["all_but_last"] is None
    assert seen["all"].position == last and seen["all"].wrong_tokens == 1
    ok_kv(eng, "R")
    no_violations(eng)


def test_load_starting_inside_a_chunk_reads_at_the_slot_offset() -> None:
    """C=32, B=16, local hit 16: the load starts half-way into chunk 0."""
    eng = make_engine(block=16, chunk=32, num_blocks=12)
    p = prompt(70)
    pool_with(eng, p, [1, 2, 3, 4, 5])
    _, rec = prefill(eng, "B", p, [1, 6, 7, 8, 9], external=48, local_hit=16)
    (load,) = rec.plan.loads
    assert [(c.token_start, c.token_end, c.slot_offset) for c in load.chunks] == [
        (16, 32, 16),
        (32, 64, 0),
    ]
    ok_kv(eng, "B")
    no_violations(eng)


def test_partial_chunk_hit_after_a_local_prefix() -> None:
    """Partial chunks kept: a 40-token prompt is stored as [0, 32) and the tail [32, 40). The
    same prompt again with 2 local blocks: full hit, 40 - 32 - 1 = 7 external tokens, loaded
    from the tail's slot at offset 0."""
    eng = make_engine(block=16, chunk=32, num_blocks=12, discard_partial_chunks=False)
    p = prompt(40)
    assert pool_with(eng, p, [1, 2, 3]).saved_ranges("A") == [(0, 32), (32, 40)]
    _, rec = prefill(eng, "B", p, [1, 2, 4], external=7, local_hit=32)
    (load,) = rec.plan.loads
    assert [(c.token_start, c.token_end, c.slot_offset) for c in load.chunks] == [(32, 39, 0)]
    ok_kv(eng, "B")
    # A different tail does not match the partial chunk: only the full chunk hits.
    c = eng.add("C", [*p[:39], 1])
    assert eng.lookup(c, 0) == 32
    no_violations(eng)


def test_cache_salt_separates_identical_prompts() -> None:
    eng = make_engine(block=16, chunk=16, num_blocks=12)
    p = prompt(40)
    pool_with(eng, p, [1, 2, 3], cache_salt="tenant-a")
    assert eng.lookup(eng.add("B", p, cache_salt="tenant-b"), 0) == 0
    assert eng.lookup(eng.add("C", p), 0) == 0
    prefill(eng, "D", p, [4, 5, 6], external=32, cache_salt="tenant-a")
    ok_kv(eng, "D")
    no_violations(eng)


# --- S7: a failed load rolls back, and the chunk is saved again ------------------------------


@pytest.mark.parametrize("prompt_len", [1000, 1100])
def test_s7_load_failure_rolls_back_and_resaves(prompt_len: int) -> None:
    """C=256, B=16: 768 tokens hit; the chunk [512, 768) fails to load. The worker reports its
    blocks (32..47 of the table); vLLM rolls back to 512 and recomputes; the tracker truncates
    and saves [512, 768) again. With P=1100 the failed step also planned [768, 1024): it is
    reported failed and never stored (its KV was computed over the failed prefix)."""
    failing = {"on": True}

    def fault(req_id: str, chunk: Any) -> bool:
        return failing["on"] and req_id == "R" and chunk.token_start == 512

    eng = make_engine(
        block=16, chunk=256, num_blocks=1 + 69 * 2, slots=16, load_fault=fault, block_hits=False
    )
    p = prompt(prompt_len)
    pool_with(eng, p[:800], blocks(1, 50), "R0")
    table = blocks(70, 69)
    r, rec = prefill(eng, "R", p, table, external=768)
    assert rec.loaded_ranges("R") == [(0, 256), (256, 512), (512, 768)]
    assert rec.load_errors == set(table[32:48])
    assert rec.report.loads_failed == (("R", tuple(table[32:48])),)
    if prompt_len == 1100:
        assert rec.saved_ranges("R") == [(768, 1024)]
        assert rec.report.saves_done == ()
        assert [r for r, _ in rec.report.saves_failed] == ["R"]
    assert r.num_computed_tokens == 512  # vLLM's recompute policy
    state = eng.state("R")
    assert (state.num_tokens, state.saved) == (512, 512)
    failing["on"] = False
    rec = eng.step({"R": prompt_len - 512})
    expected = [(512, 768)] + ([(768, 1024)] if prompt_len == 1100 else [])
    assert rec.saved_ranges("R") == expected
    assert rec.plan.loads == ()
    ok_kv(eng, "R")
    assert eng.state("R").saved == expected[-1][1]
    # What the pool holds now is R's recomputed KV: a new request loads and checks it.
    prefill(eng, "Q", p, blocks(1, 69), external=expected[-1][1])
    ok_kv(eng, "Q")
    no_violations(eng)


# --- more of §2.8 ------------------------------------------------------------------------------


def test_2984_resumed_with_none_block_ids_keeps_no_stale_blocks() -> None:
    """A resumed entry whose new_block_ids is None: the old (freed) table must not survive,
    and nothing is loaded into or saved from it."""
    eng = make_engine(block=16, chunk=16)
    r, _ = prefill(eng, "R", prompt(40), [1, 2, 3])
    decode(eng, "R", 2)
    eng.preempt(r)
    eng.step({})
    eng.admit(r, [7, 8, 9], local_hit=0)
    rec = eng.step({"R": r.num_tokens - r.num_computed_tokens}, new_blocks={"R": None})
    state = eng.state("R")
    assert not set(state.block_ids) & {1, 2, 3}
    assert rec.plan.loads == () and rec.plan.saves == ()
    # vLLM claims tokens with no blocks: recorded, and the request recomputes.
    assert state.recompute_only


def test_decode_phase_is_not_sticky_after_preemption() -> None:
    """Preempted during decode, resumed with pool hit 0: the re-prefill of prompt + outputs
    is a prefill, so its full chunks are saved even with save_decode_cache=False."""
    eng = make_engine(block=16, chunk=16, num_blocks=12)
    # shorter than a chunk: nothing saved at prefill
    r, rec = prefill(eng, "R", prompt(10), [1, 2, 3, 4])
    assert rec.plan.saves == ()
    for rec in decode(eng, "R", 39):
        assert rec.plan.saves == ()  # decode chunks are not saved
    assert r.num_tokens == 50
    eng.preempt(r)
    eng.step({})
    assert eng.admit(r, [5, 6, 7, 8]) == 0
    rec = eng.step({"R": 50})
    assert rec.saved_ranges("R") == [(0, 16), (16, 32), (32, 48)]
    ok_kv(eng, "R")
    prefill(eng, "Q", [*eng.tokens("R", 48), 5], [9, 10, 11, 1], external=48)
    ok_kv(eng, "Q")
    no_violations(eng)


def test_save_before_reuse_finished_request_keeps_its_blocks(monkeypatch) -> None:
    """request_finished answers (True, None) while the request's save is in flight; the
    worker reports it in finished_sending only once the save completed."""
    eng = make_engine(block=16, chunk=16, num_blocks=8)
    events = hold_saves(eng.worker, monkeypatch)
    # max_tokens=1: finishes after its prefill
    _, rec = prefill(eng, "R", prompt(40), [1, 2, 3], finish=True)
    assert rec.saved_ranges("R") == [(0, 16), (16, 32)]
    assert rec.finished == {"R": (True, None)}
    assert eng.delayed_free == {"R"}
    rec = eng.step({})
    assert rec.plan.delayed_free == ("R",)
    assert rec.finished_sending == set()  # still in flight: blocks stay allocated
    assert eng.delayed_free == {"R"} and "R" not in eng.freed
    assert eng.state("R") is not None and eng.state("R").save.pending
    for event in events:
        event.completed = True
    rec = eng.step({})
    assert rec.finished_sending == {"R"}
    assert eng.freed == ["R"] and eng.delayed_free == set()
    assert eng.state("R") is None  # retired once its saves were confirmed
    assert eng.scheduler.tracker.index.stats()["stored"] == 2
    prefill(eng, "Q", prompt(40), [4, 5, 6], external=32)
    ok_kv(eng, "Q")
    no_violations(eng)


def test_preempted_request_aborted_while_waiting() -> None:
    eng = make_engine(block=16, chunk=16)
    r, _ = prefill(eng, "R", prompt(40), [1, 2, 3])
    eng.preempt(r)
    eng.step({})
    assert eng.lookup(r, 0) == 32  # considered, allocation failed
    assert eng.finish("R", RequestStatus.FINISHED_ABORTED) == (False, None)
    assert eng.scheduler.tracker.states == {}
    assert eng.scheduler.tracker.index.stats()["pinned"] == 0
    eng.step({})
    no_violations(eng)


def test_request_without_saves_in_flight_is_freed_at_once() -> None:
    eng = make_engine(block=16, chunk=16, num_blocks=8)
    _, rec = prefill(eng, "R", prompt(10), [1], finish=True)  # nothing to save
    assert rec.finished == {"R": (False, None)}
    assert eng.freed == ["R"] and eng.state("R") is None
    no_violations(eng)


def test_handle_preemptions_drains_saves_before_the_blocks_are_reused(monkeypatch) -> None:
    eng = make_engine(block=16, chunk=16, num_blocks=8)
    events = hold_saves(eng.worker, monkeypatch)
    r, _ = prefill(eng, "R", prompt(40), [1, 2, 3])
    eng.step({"R": 1})  # no preemption: saves stay in flight, nothing waits on them
    r_saves = list(events)
    assert len(r_saves) == 2 and not any(e.synchronized for e in r_saves)
    eng.preempt(r)
    seen = {}

    def before_forward(plan: StepPlan) -> None:
        seen["drained"] = all(e.completed for e in r_saves)

    other = eng.add("O", prompt(30, seed=5))
    eng.admit(other, [1, 2])  # R's freed blocks
    rec = eng.step({"O": 30}, before_forward=before_forward)
    assert rec.plan.preempted == ("R",)
    assert seen["drained"] and all(e.synchronized for e in r_saves)
    assert [r for r, _ in rec.report.saves_done] == ["R"]
    assert eng.state("R").save.pending == ()
    no_violations(eng)


def test_failed_save_is_retried_and_each_chunk_written_once(monkeypatch) -> None:
    """Two requests with one prefix in one step: A writes the chunks, B waits for them. A's
    stores fail; A plans them again next step (its blocks still hold the KV), B still waits,
    and once stored the pool holds A's KV."""
    eng = make_engine(block=16, chunk=16, num_blocks=16, slots=8)
    a = eng.add("A", prompt(48))
    b = eng.add("B", [*prompt(48), 1])
    eng.admit(a, [1, 2, 3, 4])
    eng.admit(b, [5, 6, 7, 8])
    real_save = eng.worker.backend.save

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("host pool write failed")

    monkeypatch.setattr(eng.worker.backend, "save", broken)
    rec = eng.step({"A": 48, "B": 49})
    assert rec.saved_ranges("A") == [(0, 16), (16, 32), (32, 48)]
    assert rec.saved_ranges("B") == []  # the same chunks are being written by A
    assert [r for r, _ in rec.report.saves_failed] == ["A", "A", "A"]
    assert eng.scheduler.tracker.index.stats()["stored"] == 0
    monkeypatch.setattr(eng.worker.backend, "save", real_save)
    rec = eng.step({"A": 1, "B": 1})
    assert rec.saved_ranges("A") == [(0, 16), (16, 32), (32, 48)]
    assert rec.saved_ranges("B") == []
    eng.step({"A": 1, "B": 1})
    assert eng.scheduler.tracker.index.stats()["stored"] == 3
    assert (eng.state("A").saved, eng.state("B").saved) == (48, 48)
    prefill(eng, "Q", [*prompt(48), 2], [9, 10, 11, 12], external=48)
    ok_kv(eng, "Q")
    no_violations(eng)


def test_request_finishing_in_the_step_its_load_failed_leaks_nothing() -> None:
    eng = make_engine(
        block=16, chunk=16, num_blocks=16, load_fault=lambda req_id, chunk: req_id == "R"
    )
    p = prompt(60)
    pool_with(eng, p)
    # finishes in the step its load fails (e.g. aborted by the client)
    _, rec = prefill(eng, "R", p, [5, 6, 7, 8], external=48, finish=True)
    assert rec.load_errors == {5, 6, 7}
    eng.step({})
    assert "R" in eng.freed and not eng.delayed_free
    assert eng.scheduler.tracker.states == {}
    stats = eng.scheduler.tracker.index.stats()
    assert stats["pinned"] == 0 and stats["writing"] == 0
    no_violations(eng)


@pytest.mark.parametrize("shape", ["new", "resumed"])
def test_saves_never_evict_chunks_accepted_in_the_same_step(shape: str) -> None:
    """Pool full (3 slots). X, admitted first, plans to store 3 chunks; B accepted a 48-token
    hit in update_state_after_alloc: X's save must not evict (LRU) the chunks B is about to
    load, or B's load is refused and its hit recomputed."""
    eng = make_engine(block=16, chunk=16, num_blocks=20, slots=3)
    b = eng.add("B", [*prompt(48), 5, 6])
    if shape == "resumed":  # B (scheduled_cached_reqs) is planned after every new request
        eng.admit(b, [1, 2, 3, 4])
        eng.step({"B": 50})
        eng.preempt(b)
        eng.step({})
    else:
        pool_with(eng, prompt(48), [1, 2, 3])
    assert eng.scheduler.tracker.index.stats() == {
        "stored": 3,
        "writing": 0,
        "pinned": 0,
        "free": 0,
    }
    x = eng.add("X", prompt(48, seed=9))  # admitted first in this step, stores 3 chunks
    assert eng.admit(x, [5, 6, 7]) == 0
    assert eng.admit(b, [8, 9, 10, 11]) == 48
    rec = eng.step({"X": 48, "B": b.num_tokens - 48})
    assert rec.plan.refused_blocks == ()
    assert rec.loaded_ranges("B") == [(0, 16), (16, 32), (32, 48)]
    ok_kv(eng, "B")
    no_violations(eng)


# --- every signal shape -------------------------------------------------------------------------


@pytest.mark.parametrize("signal", PREEMPT_SIGNALS)
def test_preemption_signal_shapes(signal: str) -> None:
    """preempted_req_ids (>= 0.12), None, or no attribute (< 0.12: inferred when the request
    is looked up again): one preemption either way, and admission-scoped state is reset."""
    eng = make_engine(block=16, chunk=16, preempt_signal=signal)
    r, _ = prefill(eng, "R", prompt(40), [1, 2, 3])
    eng.preempt(r)
    out = eng.step({}).output
    assert hasattr(out, "preempted_req_ids") is (signal != "absent")
    phase = eng.state("R").phase
    assert phase is (Phase.PREEMPTED if signal == "set" else Phase.RUNNING)
    eng.lookup(r, 0)
    state = eng.state("R")
    assert state.phase is Phase.PREEMPTED and state.life.num_preemptions == 1
    assert (len(state.block_ids), state.num_tokens, state.accepted) == (0, 0, 0)
    assert eng.admit(r, [4, 5, 6]) == 32
    eng.step({"R": 9})
    assert eng.scheduler.tracker.counts["preemptions"] == 1
    no_violations(eng)


@pytest.mark.parametrize("shape", SHAPES)
def test_running_request_appends_blocks_in_every_shape(shape: str) -> None:
    eng = make_engine(block=4, chunk=8, shape=shape)
    prefill(eng, "R", prompt(8), [1, 2])
    eng.step({"R": 1}, new_blocks={"R": [3]})
    decode(eng, "R", 3)
    eng.step({"R": 1}, new_blocks={"R": [4]})
    assert list(eng.state("R").block_ids) == [1, 2, 3, 4]
    no_violations(eng)


def test_mrv2_readmission_of_a_known_id_as_a_new_request() -> None:
    """Model Runner V2 re-admits a preempted request through scheduled_new_reqs, with all its
    tokens in prefill_token_ids; the tracker treats it as a re-admission, not a duplicate."""
    eng = make_engine(block=16, chunk=16, shape="mrv2", preempt_signal="none", num_blocks=8)
    r, _ = prefill(eng, "R", prompt(20), [1, 2, 6])
    decode(eng, "R", 15)
    eng.preempt(r)
    eng.step({})
    assert eng.admit(r, [3, 4, 5]) == 16
    rec = eng.step({"R": 20})
    (new,) = rec.output.scheduled_new_reqs
    assert new.req_id == "R" and new.prefill_token_ids == r.all_token_ids[:36]
    assert rec.loaded_ranges("R") == [(0, 16)]
    assert rec.saved_ranges("R") == [(16, 32)]
    assert list(eng.state("R").block_ids) == [3, 4, 5]
    assert eng.state("R").life.num_preemptions == 1
    ok_kv(eng, "R")
    no_violations(eng)


# --- the engine never crashes ------------------------------------------------------------------


class Unreadable(list):
    """Token ids the connector cannot read (``len`` fails), as a broken vLLM object."""

    def __len__(self) -> int:
        raise RuntimeError("unreadable all_token_ids")


def _known_request(side: SchedulerSide) -> FakeRequest:
    r = FakeRequest("K", prompt(20))
    side.get_num_new_matched_tokens(r, 0)
    return r


GARBAGE: dict[str, Callable[[SchedulerSide], Any]] = {
    "on_new_request": lambda side: side.on_new_request(object()),
    "get_num_new_matched_tokens": lambda side: side.get_num_new_matched_tokens(object(), 0),
    "get_num_new_matched_tokens/no-tokens": lambda side: side.get_num_new_matched_tokens(
        SimpleNamespace(request_id="G", prompt_token_ids=[1, 2, 3]), 0
    ),
    "get_num_new_matched_tokens/bad-count": lambda side: side.get_num_new_matched_tokens(
        _known_request(side), "sixteen"
    ),
    "update_state_after_alloc": lambda side: side.update_state_after_alloc(
        _known_request(side), object(), 0
    ),
    "build_connector_meta": lambda side: side.build_connector_meta(object()),
    "build_connector_meta/cached": lambda side: side.build_connector_meta(
        SchedulerOutput(scheduled_cached_reqs=object(), num_scheduled_tokens={})
    ),
    "request_finished": lambda side: side.request_finished(object(), [1, 2]),
}


@pytest.mark.parametrize("callback", sorted(GARBAGE))
def test_garbage_never_crashes_the_engine(callback: str) -> None:
    side = make_side()
    before = side.tracker.step
    result = GARBAGE[callback](side)
    assert side.adapter_errors + len(side.tracker.violations) >= 1
    if callback.startswith("get_num_new_matched_tokens"):
        assert result == (0, False)  # no hit: vLLM recomputes
    elif callback.startswith("build_connector_meta"):
        assert isinstance(result, StepPlan) and result.loads == () and result.saves == ()
        assert side.tracker.step == before + 1  # the step is still closed
    elif callback == "request_finished":
        assert result == (False, None)  # never hold blocks we know nothing about


@pytest.mark.parametrize("callback", sorted(GARBAGE))
def test_garbage_raises_in_strict_mode(callback: str) -> None:
    side = make_side(strict=True)
    with pytest.raises((AttributeError, TypeError, ValueError, InvariantViolation)):
        GARBAGE[callback](side)


def test_garbage_worker_output_is_ignored() -> None:
    side = make_side(strict=True)
    r = _known_request(side)
    for output in (object(), KVConnectorOutput(), KVConnectorOutput(kv_connector_worker_meta=7)):
        side.update_connector_output(output)
    assert side.tracker.state("K").lookup is not None
    assert side.adapter_errors == 0 and not side.tracker.violations
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)


def test_garbage_for_one_request_sends_only_that_request_to_recompute() -> None:
    """A request whose tokens cannot be read at build_connector_meta is recorded and
    recomputes; the other request of the step goes on loading and saving."""
    eng = make_engine(block=16, chunk=16, num_blocks=16)
    p = prompt(40)
    pool_with(eng, p, [1, 2, 3])
    good, bad = eng.add("G", p), eng.add("X", prompt(40, seed=4))
    eng.admit(good, [4, 5, 6])
    eng.admit(bad, [7, 8, 9])
    bad.all_token_ids = Unreadable(bad.all_token_ids)
    rec = eng.step({"G": 8, "X": 40}, sample=False)
    assert rec.loaded_ranges("G") == [(0, 16), (16, 32)]
    assert not rec.saves_of("X") and not rec.load_of("X")
    assert [(v.req_id, v.rule) for v in eng.violations] == [("X", "adapter_error")]
    assert eng.state("X").recompute_only and not eng.state("G").recompute_only
    ok_kv(eng, "G")


def test_request_finished_of_an_unseen_request_is_harmless() -> None:
    """#3337: an abort of a request the connector never saw (vLLM < 0.22 has no
    on_new_request; a request aborted while deep in the waiting queue) must not assert."""
    side = make_side()
    req = FakeRequest("never-seen", [1, 2, 3], status=RequestStatus.FINISHED_ABORTED)
    assert side.request_finished(req, []) == (False, None)
    assert side.adapter_errors == 0


def test_request_finished_of_an_unseen_request_is_no_violation() -> None:
    side = make_side(strict=True)
    req = FakeRequest("never-seen", [1, 2, 3], status=RequestStatus.FINISHED_ABORTED)
    assert side.request_finished(req, []) == (False, None)
    assert not side.tracker.violations


# --- bugs: vLLM counts tokens as loaded that nobody loads ---------------------------------------


def test_failed_update_state_after_alloc_never_leaves_unloaded_kv() -> None:
    eng = make_engine(block=16, chunk=16, num_blocks=16)
    p = prompt(50)
    pool_with(eng, p)
    b = eng.add("B", p)
    ext = eng.lookup(b, 0)
    assert ext == 48
    eng.scheduler.update_state_after_alloc(b, object(), ext)  # garbage blocks
    assert eng.scheduler.adapter_errors == 1
    # vLLM allocated [5, 6, 7, 8] and counts 48 tokens computed all the same.
    eng.admit(b, [5, 6, 7, 8], external=ext, lookup=False, notify=False)
    eng.step({"B": 2})
    _finish_prefill(eng, "B", 50)
    ok_kv(eng, "B")


def _meta_fails_midway(finish: list[str]) -> FakeEngine:
    """B (a 48-token hit) and C admitted and scheduled in one step whose second new request
    (C) is corrupt: build_connector_meta fails after B's entry. ``finish``: who stops after it."""
    eng = make_engine(block=16, chunk=16, num_blocks=16)
    p = prompt(50)
    pool_with(eng, p)
    b = eng.add("B", p)
    assert eng.admit(b, [5, 6, 7, 8]) == 48
    c = eng.add("C", prompt(20, seed=6))
    eng.admit(c, [9, 10])

    def corrupt(out: Any) -> None:
        out.scheduled_new_reqs[1].num_computed_tokens = "garbage"

    eng.step({"B": 2, "C": 20}, tamper=corrupt, finish=finish)
    return eng


def test_build_connector_meta_failure_midway_never_leaves_unloaded_kv() -> None:
    eng = _meta_fails_midway(finish=[])
    assert eng.scheduler.adapter_errors == 1
    _finish_prefill(eng, "B", 50)
    ok_kv(eng, "B")


def test_build_connector_meta_failure_midway_leaks_no_pins() -> None:
    eng = _meta_fails_midway(finish=["B", "C"])
    eng.step({})
    eng.step({})
    stats = eng.scheduler.tracker.index.stats()
    assert stats["pinned"] == 0 and stats["writing"] == 0
    assert eng.scheduler.tracker.states == {}


# --- tensor parallelism: vLLM aggregates every worker's metadata into one report --------------


def _saved_by_r(side: SchedulerSide) -> tuple[bytes, ...]:
    """R (40 tokens) planned to save two chunks; their keys."""
    plan = side_prefill(side, (FakeRequest("R", prompt(40)), [1, 2, 3]))
    return tuple(c.key for p in plan.saves for c in p.chunks)


def _tp2(rank0: WorkerReport, rank1: WorkerReport) -> KVConnectorOutput:
    # vLLM's KVOutputAggregator folds the tensor-parallel workers' metadata of one step with
    # KVLedgerWorkerMetadata.aggregate, which keeps each rank's report apart.
    from kvledger.connector.vllm import KVLedgerWorkerMetadata

    meta = KVLedgerWorkerMetadata(attrs.evolve(rank0, rank=0)).aggregate(
        KVLedgerWorkerMetadata(attrs.evolve(rank1, rank=1))
    )
    return KVConnectorOutput(kv_connector_worker_meta=meta)


def test_tp2_saves_confirmed_by_every_rank_are_no_violation() -> None:
    side = make_side(world_size=2)
    keys = _saved_by_r(side)
    done = WorkerReport(saves_done=(("R", keys),))
    side.update_connector_output(_tp2(done, done))
    assert side.tracker.state("R").saved == 32
    assert not side.tracker.violations
    assert not side.tracker.state("R").recompute_only


def test_tp2_a_chunk_failed_on_one_rank_is_not_offered() -> None:
    side = make_side(world_size=2)
    keys = _saved_by_r(side)
    side.update_connector_output(
        _tp2(
            WorkerReport(saves_done=(("R", keys),)),
            # Rank 1 stored its share of the first chunk and failed the second.
            WorkerReport(saves_done=(("R", keys[:1]),), saves_failed=(("R", keys[1:]),)),
        )
    )
    q = FakeRequest("Q", prompt(40))
    assert side.get_num_new_matched_tokens(q, 0) == (16, False)


def test_tp2_a_chunk_that_failed_to_load_on_one_rank_is_not_offered_again() -> None:
    side = make_side(world_size=2)
    keys = _saved_by_r(side)
    done = WorkerReport(saves_done=(("R", keys),))
    side.update_connector_output(_tp2(done, done))
    new = side_admit(side, FakeRequest("B", prompt(40)), [4, 5, 6], 32)
    side.build_connector_meta(
        SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"B": 8})
    )
    side.update_connector_output(
        _tp2(WorkerReport(loads_done=("B",)), WorkerReport(loads_failed=(("B", (5, 6)),)))
    )
    assert side.get_num_new_matched_tokens(FakeRequest("Q", prompt(40)), 0) == (16, False)


def test_worker_meta_is_read_from_the_report_attribute() -> None:
    """update_connector_output accepts vLLM's KVConnectorOutput carrying our worker metadata
    (``.report``) or a bare WorkerReport."""
    side = make_side()
    (save,) = side_prefill(side, (FakeRequest("R", prompt(40)), [1, 2, 3])).saves
    keys = tuple(c.key for c in save.chunks)
    side.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=WorkerMeta(WorkerReport(saves_done=(("R", keys[:1]),)))
        )
    )
    assert side.tracker.state("R").saved == 16
    side.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=WorkerReport(saves_done=(("R", keys[1:]),)))
    )
    assert side.tracker.state("R").saved == 32
    assert not side.tracker.violations


# --- worker reports: each one is judged on its own ----------------------------------------------


def _three_saving(side: SchedulerSide) -> dict[str, tuple[bytes, ...]]:
    """A, B and C (40 tokens each, nothing shared) prefilled in one step, each saving two
    chunks; all three finish at once (their blocks held until the saves are confirmed)."""
    keys: dict[str, tuple[bytes, ...]] = {}
    plan = side_prefill(
        side,
        *(
            (FakeRequest(req_id, prompt(40, seed=10 + i)), [1 + 3 * i, 2 + 3 * i, 3 + 3 * i])
            for i, req_id in enumerate("ABC")
        ),
    )
    for save in plan.saves:
        keys[save.req_id] = tuple(c.key for c in save.chunks)
    assert sorted(keys) == ["A", "B", "C"] and all(len(k) == 2 for k in keys.values())
    for req_id in "ABC":
        finished = FakeRequest(req_id, [], status=RequestStatus.FINISHED_STOPPED)
        assert side.request_finished(finished, []) == (True, None)
    assert side.tracker.index.stats()["writing"] == 6
    return keys


# One rank's report for B that cannot be read, and whether it still names B.
MALFORMED: dict[str, tuple[Any, str]] = {
    "keys-not-a-sequence": (WorkerReport(saves_done=(("B", None),)), "B"),
    "load-blocks-unreadable": (WorkerReport(loads_failed=(("B", 7),)), "B"),
    "entry-not-a-pair": (WorkerReport(saves_done=(None,)), ""),
    "field-not-a-sequence": (WorkerReport(saves_done=7), ""),  # type: ignore[arg-type]
    "not-a-report": ("garbage", ""),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_report_costs_only_itself(kind: str) -> None:
    """Audit: one malformed worker report discarded every report in the same batch (slots
    "writing" forever, requests held forever, no violation). Each report, and each entry of
    one, is judged on its own: the others are applied, the bad one is a recorded violation."""
    from kvledger.connector.vllm import KVLedgerWorkerMetadata

    side = make_side()
    keys = _three_saving(side)
    bad, about = MALFORMED[kind]
    batch = KVLedgerWorkerMetadata(
        bad,  # first: before the fix, nothing after it was applied
        WorkerReport(saves_done=(("A", keys["A"]),)),
        WorkerReport(saves_done=(("C", keys["C"]),)),
    )
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=batch))
    states = side.tracker.states
    assert "A" not in states and "C" not in states  # confirmed, finished: retired
    assert [(v.req_id, v.rule) for v in side.tracker.violations] == [(about, "adapter_error")]
    assert side.adapter_errors == 1
    stats = side.tracker.index.stats()
    assert stats["stored"] == 4  # A's and C's chunks
    if about:  # the request it names falls back: its saves are given up, its blocks freed
        assert "B" not in states and stats["writing"] == 0
    # A and C's chunks are offered to the next request with their prompt.
    assert side.get_num_new_matched_tokens(FakeRequest("A2", prompt(40, seed=10)), 0) == (
        32,
        False,
    )


def test_a_malformed_report_in_the_connector_stats_costs_only_itself() -> None:
    """vLLM 0.11-0.17 (reports in the connector stats, as plain data): one plain report that
    does not parse leaves the others applied."""
    side = make_side()
    keys = _three_saving(side)
    plain = [
        WorkerReport(saves_done=(("A", keys["A"]),)).to_plain(),
        ["not", "a", "report"],
        WorkerReport(saves_done=(("C", keys["C"]),)).to_plain(),
    ]
    out = SimpleNamespace(kv_connector_stats=SimpleNamespace(data={"kvledger_reports": plain}))
    side.update_connector_output(out)
    assert "A" not in side.tracker.states and "C" not in side.tracker.states
    assert [(v.req_id, v.rule) for v in side.tracker.violations] == [("", "adapter_error")]


def test_a_malformed_entry_costs_only_that_entry() -> None:
    """Inside one report: A's entry is unreadable, C's (after it) is still applied."""
    side = make_side()
    keys = _three_saving(side)
    report = WorkerReport(
        saves_done=(("A", None), ("B", keys["B"]), ("C", keys["C"])),  # type: ignore[arg-type]
    )
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    assert side.tracker.states == {}
    assert [(v.req_id, v.rule) for v in side.tracker.violations] == [("A", "adapter_error")]
    stats = side.tracker.index.stats()
    assert (stats["stored"], stats["writing"]) == (4, 0)


def test_a_malformed_report_raises_in_strict_mode() -> None:
    from kvledger.connector.vllm import KVLedgerWorkerMetadata

    side = make_side(strict=True)
    keys = _three_saving(side)
    batch = KVLedgerWorkerMetadata(
        WorkerReport(saves_done=(("B", None),)), WorkerReport(saves_done=(("A", keys["A"]),))
    )
    with pytest.raises(TypeError):
        side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=batch))


# --- update_state_after_alloc for a request the connector never saw ----------------------------


@pytest.mark.parametrize("external", [0, 32])
def test_alloc_of_a_request_never_added_holds_nothing(external: int) -> None:
    """Audit: ``update_state_after_alloc`` for a request that was never added (no
    on_new_request, no lookup) created a tracker state for it (and pinned the chunks a load
    would read) that nothing ever released. It is recorded (``unknown_request``) and nothing
    is kept for it: no state, no pin, no admission to process."""
    eng = make_engine(block=16, chunk=16)
    p = prompt(50)
    pool_with(eng, p)  # the pool holds p's first 48 tokens: U's allocation could pin them
    side = eng.scheduler
    u = FakeRequest("U", p)
    side.update_state_after_alloc(u, FakeBlocks([5, 6, 7, 8]), external)
    assert [(v.req_id, v.rule) for v in side.tracker.violations] == [("U", "unknown_request")]
    assert "U" not in side.tracker.states
    assert side.tracker.index.stats()["pinned"] == 0
    plan = side.build_connector_meta(SchedulerOutput())  # vLLM did not schedule it
    assert plan.refused_blocks == () and plan.loads == ()
    assert side.tracker.states == {} and side.summary()["live_requests"] == 0
    stats = side.tracker.index.stats()
    assert (stats["pinned"], stats["writing"], stats["stored"]) == (0, 0, 3)
    assert side.adapter_errors == 0
    # Its finish is harmless (nothing to forget), and a later life of the id starts clean.
    u.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(u, [5, 6, 7, 8]) == (False, None)
    assert side.get_num_new_matched_tokens(FakeRequest("U", p), 0) == (48, False)


def test_alloc_of_a_request_never_added_with_external_tokens_is_recomputed() -> None:
    """vLLM counts the external tokens of the allocation as computed, but nobody looked them
    up, so nobody loads them: their blocks are refused in the step that schedules it, and vLLM
    recomputes them (the KV is right, and nothing of the request stays held after it)."""
    eng = make_engine(block=16, chunk=16, num_blocks=16)
    p = prompt(50)
    pool_with(eng, p)
    u = FakeRequest("U", p)
    eng.requests["U"] = u  # vLLM's request; the connector was never told of it
    eng.admit(u, [5, 6, 7, 8], external=32, lookup=False)
    rec = eng.step({"U": 18})
    assert set(rec.plan.refused_blocks) == {5, 6} and rec.load_of("U") is None
    assert rec.load_errors == {5, 6}
    assert u.num_computed_tokens == 0  # rolled back by vLLM's recompute policy
    _finish_prefill(eng, "U", 50)
    ok_kv(eng, "U")
    eng.finish("U")
    eng.step({})
    assert eng.scheduler.tracker.states == {}
    assert eng.scheduler.tracker.index.stats()["pinned"] == 0
    assert {v.rule for v in eng.violations} == {"unknown_request"}
    assert {v.req_id for v in eng.violations} == {"U"}


# --- speculative decoding: wait_for_save deferred past the connector output ----------------------


class SaveWatch:
    """The truth about every save of ``worker``, kept apart from the worker: which requests have
    saves bound but not issued, and the completion event of every chunk issued (held in flight
    until ``complete_all``). Every ``get_finished`` answer is checked against it."""

    def __init__(self, worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.unissued: list[Any] = []
        self.events: dict[str, list[ManualEvent]] = {}
        self.reported: list[str] = []
        issuing: list[str] = []
        real_bind, real_wait = worker.bind, worker.wait_for_save
        real_save, real_finished = worker.backend.save, worker.get_finished

        def bind(plan: StepPlan) -> None:
            real_bind(plan)
            self.unissued = list(plan.saves)

        def wait_for_save() -> None:
            issuing[:] = [s.req_id for s in self.unissued for _ in s.chunks]
            self.unissued = []
            real_wait()

        def save(*args: Any, **kwargs: Any) -> Any:
            real_save(*args, **kwargs)
            event = ManualEvent()
            self.events.setdefault(issuing.pop(0), []).append(event)
            return TransferHandle(event)

        def get_finished(ids: set[str]) -> Any:
            sending, recving = real_finished(ids)
            for req_id in sending or ():
                assert req_id not in {s.req_id for s in self.unissued}, f"{req_id}: not issued"
                assert self.events.get(req_id), f"{req_id}: reported with no save issued"
                assert all(e.completed for e in self.events[req_id]), f"{req_id}: in flight"
                self.reported.append(req_id)
            return sending, recving

        monkeypatch.setattr(worker, "bind", bind)
        monkeypatch.setattr(worker, "wait_for_save", wait_for_save)
        monkeypatch.setattr(worker.backend, "save", save)
        monkeypatch.setattr(worker, "get_finished", get_finished)

    def complete_all(self) -> None:
        for events in self.events.values():
            for event in events:
                event.completed = True


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_deferred_finalize_reports_sent_only_after_the_saves_completed(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33 with a drafter calls get_finished (and builds the report) before the step's
    wait_for_save, which runs after the draft forward. A request finishing with saves planned
    is reported finished-sending only once they were issued and completed; the saved chunks
    hold every layer (the drafter's, written after get_finished, included): a second request
    with the prompt loads KV the oracle finds right."""
    eng = make_engine(
        block=16, chunk=16, num_blocks=16, defer_finalize=True, async_scheduling=async_scheduling
    )
    watch = SaveWatch(eng.worker, monkeypatch)
    p = prompt(40)
    _, rec = prefill(eng, "A", p, [1, 2, 3], finish=True)
    assert rec.saved_ranges("A") == [(0, 16), (16, 32)]
    for _ in range(3):
        eng.step({})
    assert "A" in eng.delayed_free and "A" not in eng.freed  # its saves are still in flight
    assert watch.reported == []
    watch.complete_all()
    eng.step({})
    eng.drain()
    assert watch.reported == ["A"] and eng.freed == ["A"]
    _, rec = prefill(eng, "B", p, [4, 5, 6], external=32)
    assert rec.loaded_ranges("B") == [(0, 16), (16, 32)]
    eng.drain()
    ok_kv(eng, "B")
    no_violations(eng)
    assert eng.scheduler.tracker.index.stats()["writing"] == 0
