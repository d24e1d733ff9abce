"""The bug classes of lmcache-adapter-and-bugs.md §2, each as a Tracker event sequence with the
numbers of the report, asserting the decision (lookup answer, load plan, save plan) and the
resulting RequestState, or the named Violation where the input is wrong.

Notation as in the report: ``B`` block size, ``C`` chunk size, ``P`` prompt length, ``nc``
vLLM's ``num_computed_tokens`` when ``build_connector_meta`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
from _pool import stored_items

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import chunk_keys, root_key
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.plans import ChunkTransfer, transfer_plan
from kvledger.tracker.state import LookupResult, Phase, RequestState
from kvledger.tracker.tracker import Tracker
from kvledger.tracker.violation import InvariantViolation

NEW, RESUMED = ev.Admission.NEW, ev.Admission.RESUMED

D = TypeVar("D", bound=ev.DecisionEvent)


# --- helpers ---------------------------------------------------------------------------------


def of(decisions: Sequence[ev.DecisionEvent], cls: type[D]) -> list[D]:
    return [d for d in decisions if isinstance(d, cls)]


def one(decisions: Sequence[ev.DecisionEvent], cls: type[D]) -> D:
    found = of(decisions, cls)
    assert len(found) == 1, f"expected one {cls.__name__}, got {decisions}"
    return found[0]


def saved_keys(decisions: Sequence[ev.DecisionEvent]) -> list[bytes]:
    return [k for d in of(decisions, ev.SavePlanned) for k in d.keys]


def tokens(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def blocks(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def st(t: Tracker, req_id: str) -> RequestState:
    s = t.state(req_id)
    assert s is not None
    return s


def rules(t: Tracker) -> list[str]:
    return [v.rule for v in t.violations]


def tracker(block: int = 16, chunk: int = 16, **cfg: Any) -> Tracker:
    """A Tracker over ``TrackerConfig(block_size=block, chunk_size=chunk, **cfg)``, which is
    its ``config``."""
    return Tracker(TrackerConfig(block_size=block, chunk_size=chunk, **cfg))


def admit(
    t: Tracker,
    req_id: str,
    ids: list[int],
    table: Sequence[int],
    external: int = 0,
    *,
    local_hit: int = 0,
    num_scheduled: int | None = None,
    admission: ev.Admission = NEW,
    lookup: bool = True,
) -> list[ev.DecisionEvent]:
    """vLLM admits a request: a new one is added with prompt ``ids``; it is looked up (unless
    ``lookup=False``: the test asked itself) and the answer must be ``external``; ``table`` is
    allocated accepting ``external`` tokens; the admission is scheduled from ``nc = local_hit
    + external``: ``num_scheduled`` tokens (the rest of ``ids`` unless given), with the whole
    table. Returns the step's decisions."""
    if lookup:
        if admission is NEW:
            t.add_request(req_id, ids)
        assert t.lookup(req_id, local_hit, ids) == external
    t.allocated(req_id, table, external)
    nc = local_hit + external
    return t.scheduled(
        req_id,
        num_computed=nc,
        num_scheduled=len(ids) - nc if num_scheduled is None else num_scheduled,
        all_token_ids=ids,
        block_ids=table,
        admission=admission,
    )


def evict_all(t: Tracker) -> None:
    """The pool loses every chunk it holds."""
    for key, _ in stored_items(t.index):
        t.apply(ev.ChunkEvicted(t.step, "", key=key))


def confirm(t: Tracker, req_id: str, decisions: Sequence[ev.DecisionEvent]) -> None:
    """The worker executed every load and save of the step."""
    for d in decisions:
        if isinstance(d, ev.LoadPlanned) and d.keys:
            t.load_done(req_id)
        elif isinstance(d, ev.SavePlanned) and d.keys:
            t.save_done(req_id, d.keys)


def run_prefill(
    t: Tracker, req_id: str, prompt: list[int], table: list[int], chunk: int | None = None
) -> None:
    """A new request with no hit: admitted, prefilled (in chunks of ``chunk``), every save
    confirmed."""
    step = chunk or len(prompt)
    confirm(t, req_id, admit(t, req_id, prompt, table, num_scheduled=min(step, len(prompt))))
    t.end_step()
    for done in range(step, len(prompt), step):
        n = min(step, len(prompt) - done)
        ds = t.scheduled(req_id, num_computed=done, num_scheduled=n, all_token_ids=prompt)
        confirm(t, req_id, ds)
        t.end_step()


def pool_with(t: Tracker, prompt: list[int], table: list[int]) -> None:
    """A donor request prefills ``prompt`` on ``table`` and finishes: the pool holds its
    chunks."""
    run_prefill(t, "donor", prompt, table)
    t.finished("donor")


def decode_sync(
    t: Tracker,
    req_id: str,
    all_ids: list[int],
    table: list[int],
    steps: int,
    block_size: int,
    out_base: int = 50_000,
) -> list[list[ev.DecisionEvent]]:
    """Synchronous decode: at each ``build_connector_meta`` ``nc == len(all_token_ids) - 1``;
    the sampled token is appended after the step. Grows ``all_ids`` and ``table`` in place."""
    per_step = []
    for _ in range(steps):
        nc = len(all_ids) - 1
        new_blocks = []
        while len(table) * block_size < nc + 1:
            new_blocks.append(max(table) + 1)
            table.append(new_blocks[-1])
        ds = t.scheduled(
            req_id, num_computed=nc, num_scheduled=1, all_token_ids=all_ids, block_ids=new_blocks
        )
        s = st(t, req_id)
        assert s.num_tokens == nc + 1
        assert s.token_ids == all_ids[: nc + 1]
        confirm(t, req_id, ds)
        per_step.append(ds)
        all_ids.append(out_base + len(all_ids))
        t.end_step()
    return per_step


# --- S1 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("local_hit", [16, 0], ids=["prefix-caching", "no-prefix-caching"])
def test_s1_resumed_request_loads_and_is_rebuilt(local_hit: int) -> None:
    """#1969 / #2007: a resumed request loads what the pool holds beyond vLLM's local hit; its
    block table is replaced, not appended, and its tokens are rebuilt from all_token_ids."""
    t = tracker(discard_partial_chunks=True)
    prompt = tokens(34)
    ds = admit(t, "R1", prompt, [4, 5, 6])
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end, len(save.keys)) == (0, 32, 2)
    assert not of(ds, ev.LoadPlanned)
    s = st(t, "R1")
    assert (s.num_tokens, len(s.token_ids), s.saved, s.save.cursor) == (34, 34, 0, 32)
    t.save_done("R1", save.keys)
    assert st(t, "R1").saved == 32
    t.end_step()

    # three synchronous decode steps: 35, 36, 37 tokens, nothing to load or save
    all_ids = [*prompt, 5000]
    table = [4, 5, 6]
    for ds in decode_sync(t, "R1", all_ids, table, 3, block_size=16):
        assert ds == []
    assert len(all_ids) == 38 and st(t, "R1").num_tokens == 37

    t.preempted("R1")  # blocks 4, 5, 6 freed; 5 and 6 go to another request
    s = st(t, "R1")
    assert s.phase is Phase.PREEMPTED and len(s.block_ids) == 0
    assert s.life.num_preemptions == 1

    external = 32 - local_hit
    assert t.lookup("R1", local_hit, all_ids) == external
    assert t.lookup("R1", local_hit, all_ids) == external  # asked again: same answer
    assert st(t, "R1").lookup == LookupResult(local_hit, 32, external, 38)
    new_table = [4, 9, 10] if local_hit else [11, 9, 10]
    ds = admit(
        t, "R1", all_ids, new_table, external, local_hit=local_hit, admission=RESUMED, lookup=False
    )
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end) == (local_hit, 32)
    assert load.keys == save.keys[local_hit // 16 :]
    assert load.refused_blocks == ()
    assert saved_keys(ds) == []  # L=38 < 48: nothing new to save
    s = st(t, "R1")
    assert s.block_ids == new_table  # replaced: never [4, 5, 6, 4, 9, 10]
    assert s.token_ids == all_ids  # prompt and the 4 outputs
    assert (s.num_tokens, s.num_computed, s.saved) == (38, 32, 32)
    plan = transfer_plan(load, s, t.config)
    assert plan is not None and plan.kind == "load"
    assert [(c.token_start, c.token_end, c.slot_offset) for c in plan.chunks] == [
        (start, start + 16, 0) for start in range(local_hit, 32, 16)
    ]
    assert plan.block_ids[1] == 9  # tokens 16..31 go into block 9, not the reused block 5
    assert t.violations == []


# --- S2 ----------------------------------------------------------------------------------------


def test_s2_lookup_repeated_across_allocation_failures() -> None:
    """#2158 / #2159 / #2090: asked again after an allocation failure, the lookup answers the
    same (0, not the raw hit 256) and changes nothing; the resumed save starts at 256."""
    t = tracker(chunk=256)
    prompt = tokens(10009)
    ds = admit(t, "R", prompt, blocks(21), num_scheduled=336)
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end) == (0, 256)
    t.save_done("R", save.keys)
    t.end_step()
    t.preempted("R")

    assert t.lookup("R", 336, prompt) == 0  # hit 256 < local 336: need -80 -> 0
    first = st(t, "R")
    assert first.lookup == LookupResult(336, 256, 0, 10009)
    pool = (stored_items(t.index), t.index.stats())
    for _ in range(3):  # allocation fails; vLLM asks again every step
        t.end_step()
        assert t.lookup("R", 336, prompt) == 0
        assert st(t, "R") == first  # no side effect on the state ...
        assert (stored_items(t.index), t.index.stats()) == pool  # ... nor on the pool

    table = blocks(cdiv(336 + 512, 16))
    ds = admit(
        t, "R", prompt, table, local_hit=336, num_scheduled=512, admission=RESUMED, lookup=False
    )
    assert not of(ds, ev.LoadPlanned)
    save = one(ds, ev.SavePlanned)
    assert (save.skip_to, save.start, save.end, len(save.keys)) == (256, 256, 768, 2)
    assert st(t, "R").saved == 256
    assert t.violations == []


def test_s2_mp_two_lookups_then_allocation_commit_the_watermark_once() -> None:
    """MP #4508 / #4525: two lookups with hit 512 before the allocation succeeds; the stored
    watermark is 512 (not 1024) and the next store starts at 512."""
    t = tracker(chunk=256, block_hits=False)
    shared = tokens(512)
    pool_with(t, [*shared, *tokens(100, base=9000)], blocks(39))
    prompt = [*shared, *tokens(488, base=20_000)]
    t.add_request("R", prompt)
    assert t.lookup("R", 0, prompt) == 512
    t.end_step()  # allocation failed
    assert t.lookup("R", 0, prompt) == 512
    assert st(t, "R").lookup == LookupResult(0, 512, 512, 1000)
    ds = admit(t, "R", prompt, blocks(63), 512, lookup=False)
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end) == (0, 512)
    save = one(ds, ev.SavePlanned)
    assert (save.skip_to, save.start, save.end) == (512, 512, 768)
    assert st(t, "R").saved == 512
    t.load_done("R")
    t.save_done("R", save.keys)
    assert st(t, "R").saved == 768
    assert t.violations == []


# --- S3 ----------------------------------------------------------------------------------------


def test_s3a_vllm_prefix_hit_larger_than_pool_hit_on_resume() -> None:
    """#2243 (a): resumed with local hit 592 > pool hit 512: no load, nothing is wrong, the
    tokens are all 610 of all_token_ids and the watermark is the pool's 512."""
    t = tracker(chunk=256, block_hits=False)
    prompt = tokens(600)
    table = blocks(38)
    run_prefill(t, "R", prompt, table)
    assert st(t, "R").saved == 512
    all_ids = [*prompt, 7000]
    decode_sync(t, "R", all_ids, table, 9, block_size=16)
    assert len(all_ids) == 610 and st(t, "R").num_tokens == 609
    t.preempted("R")

    assert t.lookup("R", 592, all_ids) == 0
    assert st(t, "R").lookup == LookupResult(592, 512, 0, 610)
    table = blocks(39, first=300)
    ds = admit(t, "R", all_ids, table, local_hit=592, admission=RESUMED, lookup=False)
    assert not of(ds, ev.LoadPlanned)
    assert saved_keys(ds) == []  # 610 < 768
    s = st(t, "R")
    assert s.token_ids == all_ids and s.num_tokens == 610 and s.saved == 512
    assert t.violations == []  # pre-#2243: assert 592 == 512


def test_s3b_pool_hit_grew_while_preempted() -> None:
    """#2243 (b): R1 preempted mid-prefill at 768; R2 with the same 1000-token prompt stores
    up to 1000 (save_unfull_chunk); R1 resumes with a full hit: external 999, tokens rebuilt
    to 1000, the load is [0, 999) and the watermark is 1000."""
    t = tracker(chunk=256, discard_partial_chunks=False)
    prompt = tokens(1000)
    ds = admit(t, "R1", prompt, blocks(48), num_scheduled=768)
    confirm(t, "R1", ds)
    assert st(t, "R1").saved == 768
    t.end_step()
    t.preempted("R1")

    # R2: same prompt, loads 768, computes 232, stores the partial tail [768, 1000)
    ds = admit(t, "R2", prompt, blocks(63, first=500), 768)
    assert (one(ds, ev.LoadPlanned).start, one(ds, ev.LoadPlanned).end) == (0, 768)
    confirm(t, "R2", ds)
    assert st(t, "R2").saved == 1000  # the prefill's partial chunk is saved with it
    assert t.finished("R2") is False  # one output token: done after its prefill step
    t.end_step()

    assert t.lookup("R1", 0, prompt) == 999  # hit 1000 == num_tokens: the last is recomputed
    assert st(t, "R1").lookup == LookupResult(0, 1000, 999, 1000)
    ds = admit(t, "R1", prompt, blocks(63), 999, admission=RESUMED, lookup=False)
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end, len(load.keys)) == (0, 999, 4)
    s = st(t, "R1")
    assert s.token_ids == prompt and s.num_tokens == 1000
    assert s.saved == 1000  # the pool holds every chunk, the partial one included
    plan = transfer_plan(load, s, t.config)
    assert plan is not None
    assert plan.chunks[-1].token_start == 768 and plan.chunks[-1].token_end == 999
    assert t.violations == []


# --- S4 ----------------------------------------------------------------------------------------


def test_s4_async_scheduling_decode_tokens_reach_the_tracker() -> None:
    """#2821 / #2929: under async scheduling nc runs one token ahead of all_token_ids; the
    token list keeps growing and the decode chunk [256, 512) is saved at step 213."""
    t = tracker(chunk=256, save_decode_cache=True, discard_partial_chunks=False)
    prompt = tokens(300)
    table = blocks(19)
    ds = admit(t, "R", prompt, table)
    # the whole prompt is saved in its step: the full chunk and the partial one
    assert [(d.start, d.end) for d in of(ds, ev.SavePlanned) if d.keys] == [(0, 300)]
    confirm(t, "R", ds)
    assert st(t, "R").saved == 300
    t.end_step()

    all_ids = list(prompt)  # step 1 is scheduled before t300 is sampled
    saves: dict[int, list[ev.SavePlanned]] = {}
    for step in range(1, 260):
        nc = 299 + step
        assert len(all_ids) == nc  # one token behind vLLM's count
        new_blocks = []
        while len(table) * 16 < nc + 1:
            table.append(table[-1] + 1)
            new_blocks.append(table[-1])
        ds = t.scheduled(
            "R", num_computed=nc, num_scheduled=1, all_token_ids=all_ids, block_ids=new_blocks
        )
        s = st(t, "R")
        assert s.num_tokens == nc + 1
        assert s.token_ids == all_ids  # never stuck at the prompt length
        if of(ds, ev.SavePlanned):
            saves[step] = of(ds, ev.SavePlanned)
        confirm(t, "R", ds)
        all_ids.append(60_000 + nc - 1)  # the token sampled by the previous step
        t.end_step()

    assert list(saves) == [213]
    (save,) = saves[213]
    assert (save.start, save.end, len(save.keys)) == (256, 512, 1)
    plan = transfer_plan(save, st(t, "R"), t.config)
    assert plan is not None
    assert plan.chunks == (ChunkTransfer(save.keys[0], save.slots[0], 256, 512, 0),)
    assert st(t, "R").saved == 512
    assert t.violations == []


def test_s4_sync_control_case() -> None:
    """#2929 control: with synchronous scheduling nc == len(all_token_ids) - 1 at every step;
    the tracker holds every computed token and saves [256, 512) when 512 tokens are computed."""
    t = tracker(chunk=256, save_decode_cache=True, discard_partial_chunks=False)
    prompt = tokens(300)
    table = blocks(19)
    run_prefill(t, "R", prompt, table)
    all_ids = [*prompt, 6000]
    per_step = decode_sync(t, "R", all_ids, table, 259, block_size=16)
    with_saves = [i for i, ds in enumerate(per_step) if saved_keys(ds)]
    assert with_saves == [211]  # nc = 300 + 211 = 511: 512 tokens computed
    save = one(per_step[211], ev.SavePlanned)
    assert (save.start, save.end) == (256, 512)
    assert t.violations == []


@pytest.mark.parametrize(
    ("known", "nc", "all_len", "num_new", "expect"),
    [
        (100, 100, 101, 1, (100, 101)),  # sync decode: the just-sampled token
        (100, 101, 101, 1, (101, 102)),  # async: nc ahead; t100 is learned, not dropped
        (256, 256, 500, 244, (256, 500)),  # chunked prefill
    ],
    ids=["sync", "async", "chunked-prefill"],
)
def test_s4_pr2929_slice_vectors(
    known: int, nc: int, all_len: int, num_new: int, expect: tuple[int, int]
) -> None:
    """#2929's vectors: the tokens computed in the step are all_token_ids[nc : nc + new], and
    every token vLLM has is learned, whatever nc says."""
    t = tracker(block=4, chunk=8)
    all_ids = tokens(all_len)
    prompt_len = 500 if all_len == 500 else 100
    table = blocks(cdiv(known, 4))
    admit(t, "R", all_ids[:prompt_len], table, num_scheduled=known)
    if nc > known:  # the async step before: scheduled while its input token was unsampled
        extra = blocks(cdiv(known + 1, 4) - len(table), first=800)
        table += extra
        t.scheduled(
            "R", num_computed=known, num_scheduled=1, all_token_ids=all_ids[:known],
            block_ids=extra,
        )  # fmt: skip
    t.scheduled(
        "R",
        num_computed=nc,
        num_scheduled=num_new,
        all_token_ids=all_ids,
        block_ids=blocks(cdiv(nc + num_new, 4) - len(table), first=900),
    )
    s = st(t, "R")
    assert s.num_tokens == nc + num_new
    assert s.token_ids[nc : s.num_tokens] == all_ids[expect[0] : expect[1]]
    assert s.token_ids == all_ids[: min(all_len, s.num_tokens)]
    assert t.violations == []


def test_s4_pr2929_preemption_vector() -> None:
    """#2929's preemption vector: prompt 100 + 50 decoded, resumed with nc=50 and 50 new: the
    tokens computed are prompt[50:100], and the tracker knows all 150."""
    t = tracker(block=10, chunk=50)
    prompt = tokens(100)
    table = blocks(10)
    run_prefill(t, "R", prompt, table)
    all_ids = [*prompt, 4000]
    decode_sync(t, "R", all_ids, table, 49, block_size=10)
    assert len(all_ids) == 150
    t.preempted("R")
    evict_all(t)  # the pool lost the prompt's chunks
    admit(t, "R", all_ids, blocks(10, first=50), local_hit=50, num_scheduled=50, admission=RESUMED)
    s = st(t, "R")
    assert s.token_ids[50:100] == prompt[50:100]
    assert s.token_ids == all_ids and s.num_tokens == 100
    assert t.violations == []


# --- S5 ----------------------------------------------------------------------------------------


def test_s5_full_hit_on_resume_leaves_the_last_token() -> None:
    """#2929: resumed with the pool holding all 200 tokens: external = 200 - 100 - 1 = 99,
    nc = 199, and the load is [100, 199), never the last token."""
    t = tracker(block=10, chunk=50, save_decode_cache=True)
    prompt = tokens(100)
    table = blocks(10)
    run_prefill(t, "R", prompt, table)
    all_ids = [*prompt, 3000]
    decode_sync(t, "R", all_ids, table, 99, block_size=10)
    assert len(all_ids) == 200
    t.preempted("R")
    assert t.index.prefix_hit(chunk_keys(root_key(""), all_ids, 50)) == 3  # [0, 150)
    # a follow-up request with R's 200 tokens as its prompt stores the last chunk too
    ds = admit(t, "R2", all_ids, blocks(20, first=400), 150)
    confirm(t, "R2", ds)
    assert t.index.prefix_hit(chunk_keys(root_key(""), all_ids, 50)) == 4
    t.finished("R2")

    assert t.lookup("R", 100, all_ids) == 99
    assert st(t, "R").lookup == LookupResult(100, 200, 99, 200)
    ds = admit(
        t, "R", all_ids, blocks(20, first=700), 99, local_hit=100, admission=RESUMED, lookup=False
    )
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end, len(load.keys)) == (100, 199, 2)
    s = st(t, "R")
    assert s.token_ids == all_ids and s.num_tokens == 200 and s.num_computed == 199
    plan = transfer_plan(load, s, t.config)
    assert plan is not None
    assert [(c.token_start, c.token_end) for c in plan.chunks] == [(100, 150), (150, 199)]
    assert t.violations == []  # pre-#2929: assert 199 == 200


@pytest.mark.parametrize(
    ("num_tokens", "local", "pool", "nc", "ok"),
    [
        (4032, 0, 4032, 4031, True),
        (4032, 0, 4032, 4030, False),
        (4032, 4032, 4032, 4032, True),  # no -1 when vLLM's own hit covers it
        (4032, 500, 200, 500, True),
        (4032, 500, 200, 499, False),
        (4032, 100, 4032, 4031, True),
        (4032, 100, 4032, 4032, False),  # the -1 forgotten
    ],
)
def test_s5_pr2929_resume_assertion_vectors(
    num_tokens: int, local: int, pool: int, nc: int, ok: bool
) -> None:
    """#2929's resume vectors: nc must be local + the external tokens we offered (with the
    full-hit -1); anything else is a named violation and the request recomputes."""
    t = tracker(block=4, chunk=8)
    all_ids = tokens(num_tokens)
    for i, key in enumerate(chunk_keys(root_key(""), all_ids[:pool], 8)):
        t.apply(ev.ChunkStored(0, "", key=key, slot=i, num_tokens=8))  # a warm pool
    t.add_request("R", all_ids)
    external = t.lookup("R", local, all_ids)
    assert external == max(0, pool - local - (1 if pool == num_tokens else 0))
    table = blocks(cdiv(num_tokens + 1, 4))
    t.allocated("R", table, external)
    ds = t.scheduled(
        "R", num_computed=nc, num_scheduled=num_tokens - nc or 1, all_token_ids=all_ids,
        block_ids=table, admission=RESUMED,
    )  # fmt: skip
    if ok:
        assert t.violations == []
        if external:
            load = one(ds, ev.LoadPlanned)
            assert (load.start, load.end) == (local, local + external)
            assert load.end < num_tokens
    else:
        assert rules(t) == ["admission_matches_lookup"]
        assert not saved_keys(ds)
        if external:
            load = one(ds, ev.LoadPlanned)
            assert load.keys == () and load.start == load.end  # nothing loaded
            assert load.refused_blocks  # vLLM is told to recompute them


# --- S6 ----------------------------------------------------------------------------------------


def test_s6_full_prompt_hit_loads_exactly_894_of_895() -> None:
    """#4614 / vLLM #52617: a new request whose whole 895-token prompt is in the pool is
    offered 894 tokens and the load covers exactly [0, 894), never position 894."""
    t = tracker(chunk=256, discard_partial_chunks=False)
    prompt = tokens(895)
    run_prefill(t, "donor", prompt, blocks(56))
    donor_all = [*prompt, 1]
    decode_sync(t, "donor", donor_all, blocks(56), 1, block_size=16)
    t.finished("donor")

    t.add_request("R", prompt)
    assert t.lookup("R", 0, prompt) == 894
    assert st(t, "R").lookup == LookupResult(0, 895, 894, 895)
    ds = admit(t, "R", prompt, blocks(56, first=900), 894, lookup=False)
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end, len(load.keys)) == (0, 894, 4)
    plan = transfer_plan(load, st(t, "R"), t.config)
    assert plan is not None
    assert plan.num_tokens == 894
    assert max(c.token_end for c in plan.chunks) == 894
    assert plan.chunks[-1] == ChunkTransfer(load.keys[3], load.slots[3], 768, 894, 0)
    assert t.violations == []


# --- S7 ----------------------------------------------------------------------------------------


def _s7_setup(prompt_len: int) -> tuple[Tracker, list[int], list[int], list[ev.DecisionEvent]]:
    t = tracker(chunk=256, block_hits=False)
    prompt = tokens(prompt_len)
    pool_with(t, prompt[:768], blocks(48, first=1000))
    table = blocks(cdiv(prompt_len, 16))
    ds = admit(t, "R", prompt, table, 768)
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end, len(load.keys)) == (0, 768, 3)
    return t, prompt, table, ds


def test_s7_load_failure_rolls_back_and_resaves() -> None:
    """#2516: the load of [512, 768) fails (blocks 32..47); vLLM rolls back to 512 and
    reschedules 488 tokens: the tracker truncates, stays within the 63 blocks, and re-saves
    chunk [512, 768) from the recomputed KV."""
    t, prompt, table, ds = _s7_setup(1000)
    assert saved_keys(ds) == []  # 1000 < 1024
    s = st(t, "R")
    assert (s.num_tokens, s.saved) == (1000, 768)
    failed_key = one(ds, ev.LoadPlanned).keys[2]
    t.load_failed("R", table[32:48])
    s = st(t, "R")
    assert s.num_tokens == 512 and s.saved <= 512
    assert failed_key not in t.index  # the pool could not serve it: never offered again
    assert t.index.stats()["pinned"] == 0
    t.end_step()

    ds = t.scheduled("R", num_computed=512, num_scheduled=488, all_token_ids=prompt)
    s = st(t, "R")
    assert s.num_tokens == 1000 and len(s.token_ids) == 1000  # never 1000 + 488
    assert s.num_tokens <= s.block_capacity(16) == 1008
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end, save.keys) == (512, 768, (failed_key,))
    plan = transfer_plan(save, s, t.config)
    assert plan is not None and plan.block_ids[32:48] == tuple(table[32:48])
    t.save_done("R", save.keys)
    assert st(t, "R").saved == 768 and failed_key in t.index
    assert t.violations == []


def test_s7_saves_planned_over_the_failed_range_are_never_stored() -> None:
    """#2516: a chunk saved in the admission step was computed over the failed load; when the
    worker reports it stored, the pool must not offer it, and it is saved again later."""
    t, prompt, table, ds = _s7_setup(1100)
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end) == (768, 1024)
    (bad,) = save.keys
    t.load_failed("R", table[32:48])
    t.save_done("R", save.keys)  # the worker copied it anyway: KV over a wrong prefix
    assert bad not in t.index
    assert not t.index.is_writing(bad)
    stats = t.index.stats()
    assert stats["stored"] + stats["writing"] + stats["free"] == t.config.num_slots
    t.end_step()

    ds = t.scheduled("R", num_computed=512, num_scheduled=588, all_token_ids=prompt)
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end) == (512, 1024)
    assert save.keys[1] == bad  # stored again, this time from recomputed KV
    t.save_done("R", save.keys)
    assert bad in t.index
    assert t.violations == []


# --- §2.8 --------------------------------------------------------------------------------------


def test_2984_resumed_with_no_block_ids_drops_the_stale_table() -> None:
    """#2984: a resumed request reported with no block ids (None) keeps none of its freed
    blocks; a running one with None simply gets no new blocks."""
    t = tracker()
    prompt = tokens(40)
    run_prefill(t, "R", prompt, [1, 2, 3])
    all_ids = [*prompt, 1]
    t.scheduled("R", num_computed=40, num_scheduled=1, all_token_ids=all_ids, block_ids=None)
    assert st(t, "R").block_ids == [1, 2, 3]
    t.preempted("R")
    evict_all(t)
    assert t.lookup("R", 0, all_ids) == 0
    t.allocated("R", [7, 8, 9], 0)
    ds = t.scheduled(
        "R", num_computed=0, num_scheduled=41, all_token_ids=all_ids, block_ids=None,
        admission=RESUMED,
    )  # fmt: skip
    s = st(t, "R")
    assert len(s.block_ids) == 0  # not [1, 2, 3]
    assert rules(t) == ["tokens_within_blocks"]
    assert saved_keys(ds) == [] and not of(ds, ev.LoadPlanned)
    assert s.recompute_only


def test_decode_phase_is_not_sticky_after_preemption() -> None:
    """§2.8 (is_decode_phase never reset): preempted during decode, resumed with pool hit 0 and
    a multi-chunk re-prefill: the recomputed chunks are saved with save_decode_cache=False."""
    t = tracker(save_decode_cache=False)
    prompt = tokens(40)
    table = [1, 2, 3]
    run_prefill(t, "R", prompt, table)
    all_ids = [*prompt, 2000]
    for ds in decode_sync(t, "R", all_ids, table, 29, block_size=16):
        assert saved_keys(ds) == []  # decode chunks are not saved
    assert len(all_ids) == 70
    t.preempted("R")
    evict_all(t)  # the pool is reset: hit 0

    ds = admit(t, "R", all_ids, [20, 21], num_scheduled=32, admission=RESUMED)
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end) == (0, 32)
    confirm(t, "R", ds)
    t.end_step()
    ds = t.scheduled(
        "R",
        num_computed=32,
        num_scheduled=38,
        all_token_ids=all_ids,
        block_ids=[22, 23, 24],
    )
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end) == (32, 64)  # tokens 40..63 were decoded before: saved now
    confirm(t, "R", ds)
    t.end_step()
    all_ids.append(2100)
    decode = decode_sync(t, "R", all_ids, [20, 21, 22, 23, 24], 10, block_size=16)
    assert all(saved_keys(ds) == [] for ds in decode)  # [64, 80) is a decode chunk again
    assert st(t, "R").saved == 64
    assert t.violations == []


def test_save_watermark_moves_only_on_confirmation() -> None:
    """§2.8 (watermark advanced at scheduling time, failed stores never retried): planned is
    not saved; SaveDone moves the watermark; SaveFailed replans the chunk."""
    t = tracker()
    prompt = tokens(50)
    ds = admit(t, "R", prompt, [1, 2, 3, 4])
    save = one(ds, ev.SavePlanned)
    assert (save.start, save.end, len(save.keys)) == (0, 48, 3)
    s = st(t, "R")
    assert s.saved == 0 and s.save.cursor == 48
    assert not any(k in t.index for k in save.keys)  # reserved, not readable
    t.save_done("R", save.keys[:1])
    assert st(t, "R").saved == 16
    t.save_done("R", save.keys[2:])  # out of order: [16, 32) still unconfirmed
    assert st(t, "R").saved == 16
    t.save_failed("R", save.keys[1:2])
    assert st(t, "R").saved == 16
    assert save.keys[1] not in t.index and not t.index.is_writing(save.keys[1])
    t.end_step()

    all_ids = [*prompt, 9]
    ds = t.scheduled("R", num_computed=50, num_scheduled=1, all_token_ids=all_ids)
    retry = one(ds, ev.SavePlanned)
    assert (retry.start, retry.end, retry.keys) == (16, 32, save.keys[1:2])
    t.save_done("R", retry.keys)
    assert st(t, "R").saved == 32
    t.end_step()
    # [32, 48) was confirmed before the failure rewound the watermark: skipped, not re-saved
    ds = t.scheduled("R", num_computed=51, num_scheduled=1, all_token_ids=[*all_ids, 10])
    assert saved_keys(ds) == []
    assert st(t, "R").saved == 48
    assert t.violations == []


def test_save_before_reuse_finished_request_waits_for_its_save() -> None:
    """§1.5 / MP #4822: a request that finishes while its save is in flight tells vLLM to delay
    freeing its blocks, and its state stays until the worker confirms."""
    t = tracker()
    prompt = tokens(32)
    ds = admit(t, "R", prompt, [1, 2])
    save = one(ds, ev.SavePlanned)
    assert t.finished("R") is True  # delay free: the save still reads blocks 1 and 2
    s = st(t, "R")
    assert s.phase is Phase.FINISHED and len(s.save.pending) == 2
    t.end_step()
    t.save_done("R", save.keys[:1])
    assert t.state("R") is not None
    t.save_done("R", save.keys[1:])
    assert t.state("R") is None  # retired once nothing of it is in flight
    assert all(k in t.index for k in save.keys)
    assert t.violations == []

    t.add_request("Q", prompt)  # the same prompt: a full hit, nothing in flight
    t.lookup("Q", 0, prompt)
    assert t.finished("Q") is False
    assert t.state("Q") is None


# --- pins: a chunk being (or about to be) loaded is never evicted -------------------------------


def test_a_promised_chunk_survives_another_requests_save_in_the_same_step() -> None:
    """#1686 / #2106 (evicted between lookup and retrieve): once vLLM accepted our external
    tokens (Allocated), another request's save in the same step must not evict their chunks."""
    t = tracker(num_slots=3)
    a, b = tokens(16), tokens(16, base=5000)
    pool_with(t, [*a, *b], [1, 2])  # the pool: k(a), k(ab)
    q = tokens(48, base=9000)
    ds = admit(t, "X", q, [3, 4], num_scheduled=16)
    confirm(t, "X", ds)  # the pool is full: k(a) is the least recently used
    t.end_step()

    prompt = [*a, *tokens(16, base=7000)]
    t.add_request("R", prompt)
    assert t.lookup("R", 0, prompt) == 16
    t.allocated("R", [5, 6], 16)
    ds_x = t.scheduled("X", num_computed=16, num_scheduled=16, all_token_ids=q)
    save = one(ds_x, ev.SavePlanned)
    ds_r = t.scheduled(
        "R", num_computed=16, num_scheduled=16, all_token_ids=prompt, block_ids=[5, 6],
        admission=NEW,
    )  # fmt: skip
    load = one(ds_r, ev.LoadPlanned)
    assert load.keys and load.keys[0] not in save.evicted
    assert (load.start, load.end) == (0, 16)
    assert t.violations == []


def test_a_save_never_evicts_the_chunk_its_own_load_reads() -> None:
    t = tracker(num_slots=1)
    a = tokens(16)
    pool_with(t, a, [1])
    prompt = [*a, *tokens(16, base=3000)]
    ds = admit(t, "R", prompt, [2, 3], 16)
    load = one(ds, ev.LoadPlanned)
    assert all(load.keys[0] not in d.evicted for d in of(ds, ev.SavePlanned))
    assert saved_keys(ds) == []  # the only slot is being read
    assert load.keys[0] in t.index


def test_a_request_finished_while_loading_keeps_its_pin_until_the_result() -> None:
    """Two requests read the same chunk; one is aborted before its load reports back: the
    other's pin must survive the aborted one's result (released once, not twice)."""
    t = tracker(num_slots=4)
    a = tokens(16)
    pool_with(t, a, [1])
    (key,) = [k for k, _ in stored_items(t.index)]
    prompt = [*a, 1, 2, 3]
    for rid, table in (("R1", [2, 3]), ("R2", [4, 5])):
        ds = admit(t, rid, prompt, table, 16)
        assert one(ds, ev.LoadPlanned).keys == (key,)
    assert t.finished("R1", "aborted") is False
    assert t.state("R1") is not None  # its load is still in flight
    t.load_done("R1")
    assert t.state("R1") is None
    assert t.index.stats()["pinned"] == 1  # R2 still reads it
    assert key not in t.index.choose_slots(4)[1]
    t.load_done("R2")
    assert t.index.stats()["pinned"] == 0
    assert t.violations == []


# --- wrong inputs: named violations, recompute fallback ---------------------------------------


def test_accepted_tokens_we_never_offered() -> None:
    """§1.7 #4 (the "Mismatch in tokens to load" assert): vLLM accepts 48 external tokens when
    we offered 32: a violation, no load, and the blocks vLLM thinks are loaded are refused."""
    t = tracker()
    prompt = tokens(64)
    pool_with(t, prompt[:32], blocks(2, first=5000))
    t.add_request("R", prompt)
    assert t.lookup("R", 0, prompt) == 32
    t.allocated("R", [1, 2, 3, 4], 48)
    assert rules(t) == ["accepted_equals_answer"]
    ds = t.scheduled(
        "R", num_computed=48, num_scheduled=16, all_token_ids=prompt, block_ids=[1, 2, 3, 4],
        admission=NEW,
    )  # fmt: skip
    load = one(ds, ev.LoadPlanned)
    assert (load.start, load.end, load.keys) == (0, 0, ())
    assert load.refused_blocks == (1, 2, 3)  # tokens [0, 48): vLLM must recompute them
    assert saved_keys(ds) == []
    assert st(t, "R").recompute_only
    ds = t.scheduled(
        "R", num_computed=64, num_scheduled=1, all_token_ids=[*prompt, 1], block_ids=[5]
    )
    assert ds == []  # never saved for the rest of its life
    assert t.index.stats()["pinned"] == 0 and t.index.stats()["writing"] == 0


def test_token_content_must_match() -> None:
    """§1.7 I2: the tokens vLLM reports must equal what the tracker knows (content, not just
    length); a mismatch is a violation and the lookup offers nothing."""
    t = tracker()
    prompt = tokens(32)
    pool_with(t, prompt, blocks(2, first=5000))
    t.add_request("R", prompt)
    other = list(prompt)
    other[5] = -7 + 100
    assert t.apply(ev.LookupAsked(t.step, "R", 0, 32, 0, other))[0] == ev.LookupAnswered(
        t.step, "R", 32, 0
    )
    assert rules(t) == ["token_content_matches"]
    assert t.violations[0].detail == {"position": 5, "known": prompt[5], "got": 93}
    assert st(t, "R").token_ids == prompt  # what we knew stays


def test_token_gap_is_refused() -> None:
    """A token range that starts past what the tracker knows would leave a hole: violation."""
    t = tracker()
    prompt = tokens(20)
    admit(t, "R", prompt, [1, 2])
    ds = t.apply(ev.Scheduled(t.step, "R", 20, 1, token_start=22, token_ids=(5,)))
    # (ids past num_computed + num_scheduled: no connector sends them, tracker/wellformed.py)
    assert rules(t) == ["field_order", "token_gap"]
    assert of(ds, ev.ViolationRecorded)[1].rule == "token_gap"
    assert len(st(t, "R").token_ids) == 20


def test_scheduled_beyond_block_capacity() -> None:
    """#2516 / §1.7 I1: tokens beyond the block table's capacity are a violation; no save is
    planned from a table that cannot hold the tokens."""
    t = tracker()
    prompt = tokens(40)
    ds = admit(t, "R", prompt, [1, 2])
    assert rules(t) == ["tokens_within_blocks"]
    assert t.violations[0].detail == {"num_tokens": 40, "capacity": 32}
    assert saved_keys(ds) == []
    assert t.index.stats()["writing"] == 0
    assert st(t, "R").recompute_only


def test_vllm_ahead_of_the_tracker() -> None:
    """vLLM counts tokens the tracker never saw scheduled (a missed step): violation."""
    t = tracker()
    prompt = tokens(40)
    run_prefill(t, "R", prompt, [1, 2, 3, 4])
    ds = t.scheduled("R", num_computed=45, num_scheduled=1, all_token_ids=[*prompt, *range(6)])
    assert rules(t) == ["tokens_match_schedule"]
    assert t.violations[0].detail == {"num_computed": 45, "tracker_tokens": 40}
    assert saved_keys(ds) == []
    assert st(t, "R").recompute_only


def test_unknown_request() -> None:
    """An event about a request the tracker never saw is named, and answers nothing."""
    t = Tracker()
    assert t.lookup("ghost", 0, tokens(10)) == 0
    t.allocated("ghost", [1], 0)
    assert rules(t) == ["unknown_request", "unknown_request"]
    assert t.state("ghost") is None


def test_event_after_finish() -> None:
    """Anything but a worker result about a finished request is a violation, whether its state
    is still held (save in flight) or already retired."""
    t = tracker()
    prompt = tokens(32)
    ds = admit(t, "R", prompt, [1, 2])
    assert t.finished("R")
    assert t.scheduled("R", num_computed=32, num_scheduled=1, all_token_ids=prompt) == [
        ev.ViolationRecorded(t.step, "R", "event_after_finish", "Scheduled", "")
    ]
    t.save_done("R", saved_keys(ds))  # a worker result after finish is fine
    assert t.state("R") is None
    t.lookup("R", 0, prompt)
    assert rules(t) == ["event_after_finish", "event_after_finish"]


def test_strict_mode_raises() -> None:
    """strict=True (tests): the first violation raises InvariantViolation carrying it."""
    t = Tracker(TrackerConfig(strict=True))
    t.add_request("R", tokens(10))
    with pytest.raises(InvariantViolation) as info:
        t.allocated("R", [1], 5)
    assert info.value.violation.rule == "accepted_equals_answer"
    assert "accepted_equals_answer" in str(info.value)
