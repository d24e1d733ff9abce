"""KV-content digests: the keys, the plan, the book and its rules (tracker/digests.py), the
events on the wire, and the Tracker's verdicts; then the worker's digests of real paged caches
in every layout (connector/digests.py, torch on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector.digests import BlockDigester, WorkerDigests
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import (
    DigestBlock,
    DigestBook,
    DigestPlan,
    DigestPlanner,
    DigestReport,
    block_keys,
)
from kvledger.tracker.tracker import Tracker
from tests.test_codec import roundtrip

BS = 4
tokens_st = st.lists(st.integers(0, 50_000), max_size=60)


# --- keys ---------------------------------------------------------------------------------


@given(tokens_st, tokens_st, st.sampled_from([1, 2, 4, 16]))
def test_keys_name_the_prefix(a: list[int], b: list[int], bs: int) -> None:
    whole = block_keys(a + b, bs)
    assert len(whole) == len(a + b) // bs
    assert whole[: len(a) // bs] == block_keys(a, bs)  # a prefix has its prefix's keys
    first = len(a) // bs
    if first:  # chained from the previous key, the same keys as from the start
        assert block_keys(a + b, bs, prev=whole[first - 1], first=first) == whole[first:]
    assert len(set(whole)) == len(whole)  # a key names its whole prefix, never another block


@given(st.lists(st.integers(0, 9), min_size=8, max_size=40), st.data())
def test_a_changed_token_changes_its_block_and_every_later_key(tokens: list[int], data) -> None:
    p = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens]
    changed[p] += 1
    a, b = block_keys(tokens, BS), block_keys(changed, BS)
    for i in range(len(a)):
        assert (a[i] == b[i]) == (i < p // BS)
    assert block_keys(tokens, BS, "salt") != a or not a  # the cache salt starts another chain


# --- the plan -----------------------------------------------------------------------------


@settings(max_examples=80)
@given(
    st.integers(1, 40),
    st.lists(st.integers(1, 9), min_size=1, max_size=12),
    st.integers(0, 10),
    st.booleans(),
)
def test_every_block_is_planned_once_when_it_becomes_full(
    prompt_len: int, chunks: list[int], decodes: int, lag: bool
) -> None:
    """Prefill in chunks of any size, then decode: each block is digested once, under the key
    of its prefix and with its block id, in the step that fills it; under async scheduling
    (``lag``: the token sampled last is not known when the step is planned) a block waits for
    its last token id, one step, and is planned then."""
    tokens = [7 * i + 3 for i in range(prompt_len + decodes)]
    planner = DigestPlanner(BS)
    planner.added("r")
    table: list[int] = []
    planned: list[DigestBlock] = []
    computed = 0
    sizes = [*chunks, *[1] * (prompt_len + decodes)]
    for step, size in enumerate(sizes):
        n = min(size, prompt_len + decodes - computed)
        if n <= 0:
            break
        need = -(-(computed + n) // BS) - len(table)
        new = [100 + len(table) + i for i in range(need)]
        table += new
        known = computed + n
        if lag and known > prompt_len:
            known = max(prompt_len, known - 1)
        planner.scheduled(
            "r",
            replace=step == 0,
            block_ids=table if step == 0 else new,
            num_computed=computed,
            num_scheduled=n,
            token_ids=tokens[:known],
        )
        plan = planner.plan(step)
        if plan is not None:
            assert not plan.before and not plan.verify
            assert all(b.block_index < (computed + n) // BS for b in plan.full)
            if not lag:
                assert all(computed // BS <= b.block_index for b in plan.full)
            planned += plan.full
        computed += n
    keys = block_keys(tokens[:computed], BS)
    full = computed // BS
    assert [b.block_index for b in planned] == list(range(len(planned)))
    # Only the block the last step filled may still wait for its last token id.
    assert len(planned) == full or (lag and len(planned) == full - 1)
    assert [b.key for b in planned] == list(keys[: len(planned)])
    assert [b.block_id for b in planned] == table[: len(planned)]


def _admitted(planner: DigestPlanner, tables: dict[str, list[int]], tokens: list[int]) -> None:
    """Each request of ``tables`` added, then admitted with its whole table, whose blocks it
    computes in one step."""
    for rid, table in tables.items():
        planner.added(rid)
        planner.scheduled(
            rid,
            replace=True,
            block_ids=table,
            num_computed=0,
            num_scheduled=len(table) * BS,
            token_ids=tokens[: len(table) * BS],
        )


def test_a_request_whose_step_could_not_be_read_is_not_digested_until_its_table_is_whole() -> None:
    """A step's facts about request ``a`` could not be read (the scheduler side's digest plan
    catches it): the blocks vLLM appended to its table then are not known, and a table a
    block short would pair every later key with the next block's bytes. So ``a`` is lost:
    none of its blocks is planned, whatever is appended, until a resumption gives its whole
    table; then each block again pairs with its own key. ``b`` is planned throughout."""
    tokens = [7 * i + 3 for i in range(8 * BS)]
    planner = DigestPlanner(BS)
    _admitted(planner, {"a": [10, 11], "b": [20, 21]}, tokens)
    plan = planner.plan(0)
    assert plan is not None and {(b.req_id, b.block_id) for b in plan.full} == {
        ("a", 10),
        ("a", 11),
        ("b", 20),
        ("b", 21),
    }
    planner.lose(["a", "c"])  # step 1: a's facts unreadable (its block 12 never told)
    planner.scheduled(
        "b",
        replace=False,
        block_ids=[22],
        num_computed=2 * BS,
        num_scheduled=BS,
        token_ids=tokens[: 3 * BS],
    )
    planner.scheduled(  # c, never told of before, lost too: no table of it is known
        "c",
        replace=False,
        block_ids=[40, 41],
        num_computed=0,
        num_scheduled=2 * BS,
        token_ids=tokens[: 2 * BS],
    )
    plan = planner.plan(1)
    assert plan is not None and [(b.req_id, b.block_id) for b in plan.full] == [("b", 22)]
    for step in (2, 3, 4, 5):  # a's next blocks, appended to a table the planner lost
        planner.scheduled(
            "a",
            replace=False,
            block_ids=[11 + step],
            num_computed=(step + 1) * BS,
            num_scheduled=BS,
            token_ids=tokens[: (step + 2) * BS],
        )
        assert planner.plan(step) is None
    planner.scheduled(  # preempted and resumed: its whole table again
        "a",
        replace=True,
        block_ids=[30, 31, 32, 33, 34, 35, 36, 37],
        num_computed=7 * BS,
        num_scheduled=BS,
        token_ids=tokens[: 8 * BS],
    )
    plan = planner.plan(6)
    keys = block_keys(tokens[: 8 * BS], BS)
    assert plan is not None
    assert [(b.req_id, b.block_index, b.block_id, b.key) for b in plan.full] == [
        ("a", 7, 37, keys[7])
    ]


def test_a_lost_request_costs_the_recorders_steady_steps_nothing(monkeypatch) -> None:
    """A lost request plans nothing until its whole table comes again, so a steady step that
    fills none of its blocks does not go through ``scheduled`` for it: only a step that fills
    a block or appends one does (as for any request), where it returns at once."""
    tokens = [7 * i + 3 for i in range(8 * BS)]
    planner = DigestPlanner(BS)
    _admitted(planner, {"a": [10, 11]}, tokens)
    planner._tokens["a"] = list(tokens[: 2 * BS])
    planner.plan(0)
    planner.lose(["a"])
    told: list[int] = []
    real = planner.scheduled

    def spy(rid: str, **kw: Any) -> None:
        told.append(kw["num_computed"])
        real(rid, **kw)

    monkeypatch.setattr(planner, "scheduled", spy)
    for nc in range(2 * BS, 5 * BS):  # steady steps; a block fills at every BS-th
        block = 12 + (nc - 2 * BS) // BS if nc % BS == 0 else None
        planner.decoded([("a", nc, nc, tokens[nc], block)])
        assert planner.plan(nc) is None
    assert told == [2 * BS, 3 * BS - 1, 3 * BS, 4 * BS - 1, 4 * BS, 5 * BS - 1]


def test_the_scheduler_side_loses_only_the_request_whose_facts_it_could_not_read() -> None:
    """``_plan_digests`` reads vLLM's step request by request: one request's unreadable count
    loses that request (as above), and the others of the step are planned as ever; a request
    that fell back to recompute is never digested again."""
    from types import SimpleNamespace

    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.scheduler import SchedulerSide

    side = SchedulerSide(
        ConnectorConfig(chunk_size=2 * BS, digests="full"), block_size=BS, num_slots=4
    )
    planner = side.digests
    assert planner is not None
    tokens = [7 * i + 3 for i in range(4 * BS)]
    _admitted(planner, {"a": [10, 11], "b": [20, 21]}, tokens)
    for rid in ("a", "b"):
        side._requests[rid] = SimpleNamespace(all_token_ids=tokens[: 3 * BS])
    planner.plan(0)

    def step(counts: list[Any], blocks: list[int]) -> Any:
        cached = SimpleNamespace(
            req_ids=["a", "b"],
            num_computed_tokens=counts,
            new_block_ids=[([blocks[0]],), ([blocks[1]],)],
            resumed_req_ids=set(),
        )
        out = SimpleNamespace(
            num_scheduled_tokens={"a": BS, "b": BS},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
        )
        return side._plan_digests(1, out, ())

    plan = step([None, 2 * BS], [12, 22])  # a's count cannot be read
    assert plan is not None and [(b.req_id, b.block_id) for b in plan.full] == [("b", 22)]
    for rid in ("a", "b"):
        side._requests[rid].all_token_ids = tokens[: 4 * BS]
    plan = step([3 * BS, 3 * BS], [13, 23])
    assert plan is not None and [(b.req_id, b.block_id) for b in plan.full] == [("b", 23)]
    # b falls back to recompute (a refused load, say): what its step computed may stand on
    # blocks vLLM recomputes, so none of its blocks is recorded as its key's any more.
    side.tracker.add_request("b", tokens[: 2 * BS])
    side.tracker.mark_violation("b", "adapter_error", "Scheduled")
    side.tracker.violations.clear()
    for rid in ("a", "b"):
        side._requests[rid].all_token_ids = tokens
    planner.scheduled(
        "a",
        replace=True,
        block_ids=[30, 31, 32, 33],
        num_computed=3 * BS,
        num_scheduled=0,
        token_ids=tokens,
    )
    planner.plan(2)
    plan = step([3 * BS, 3 * BS], [34, 24])
    assert plan is not None and [(b.req_id, b.block_id) for b in plan.full] == [("a", 33)]


def test_a_recorded_fact_the_plan_cannot_take_loses_its_request_only(monkeypatch) -> None:
    """The recorder's digests read the events it writes (``RecorderDigests.observe``): one
    the planner cannot take loses its request, and the events after it, in the same call,
    are still taken (they were dropped with it)."""
    from kvledger.connector.digests import RecorderDigests

    digests = RecorderDigests(None, BS)
    tokens = tuple(7 * i + 3 for i in range(2 * BS))
    real = digests.planner.observe

    def refuse_a(e: ev.Event) -> None:
        if e.req_id == "a" and isinstance(e, ev.Scheduled):
            raise ValueError("a fact this planner cannot take")
        real(e)

    monkeypatch.setattr(digests.planner, "observe", refuse_a)
    admitted = [
        ev.Scheduled(0, rid, 0, 2 * BS, 0, tokens, table, ev.Admission.NEW)
        for rid, table in (("a", (10, 11)), ("b", (20, 21)))
    ]
    digests.observe(*(ev.RequestAdded(0, rid, tokens) for rid in ("a", "b")), *admitted)
    plan = digests.plan(None)
    assert plan is not None
    assert [(b.req_id, b.block_id) for b in plan.full] == [("b", 20), ("b", 21)]


def test_the_recorder_records_no_digest_computed_over_a_failed_load() -> None:
    """``RecorderDigests.report``: a request holding a block the wrapped connector reported
    in error (its own load's, or one vLLM shares with it through its prefix cache: "b"
    holds block 10 too) has none of its blocks of that step recorded as its keys', nor of
    the next (async scheduling scheduled it before vLLM heard); those of the step after
    are, and another request's always. An output without reports counts as a step."""
    from kvledger.connector.digests import RecorderDigests

    tokens = tuple(7 * i + 3 for i in range(4 * BS))
    tables = {"a": (10, 11, 12, 13), "b": (10, 21, 22, 23), "c": (30, 31, 32, 33)}

    def recorded(digests: RecorderDigests, *rids: str, empty: bool = False) -> list[str]:
        rows = tuple((rid, 3, KEYS[0], 5) for rid in rids)
        events = digests.report([] if empty else [DigestReport(blocks=rows)])
        return sorted(e.req_id for e in events if isinstance(e, ev.BlockDigested))

    for gap in (False, True):
        digests = RecorderDigests(None, BS)
        digests.observe(
            *(ev.RequestAdded(0, rid, tokens) for rid in tables),
            *(
                ev.Scheduled(0, rid, 0, 4 * BS, 0, tokens, table, ev.Admission.NEW)
                for rid, table in tables.items()
            ),
        )
        digests.plan(None)
        assert recorded(digests, "a", "b", "c") == ["a", "b", "c"]
        digests.observe(ev.InnerLoadErrors(1, "", (10,)))
        assert recorded(digests, "a", "b", "c") == ["c"]
        if gap:
            assert recorded(digests, empty=True) == []
        else:
            assert recorded(digests, "a", "b", "c") == ["c"]  # the step scheduled before
        assert recorded(digests, "a", "b", "c") == ["a", "b", "c"]


def test_a_sync_load_is_digested_before_and_after_in_the_step_that_schedules_it() -> None:
    tokens = list(range(30))
    planner = DigestPlanner(BS)
    planner.added("r")
    table = [10, 11, 12, 13, 14, 15, 16, 17]
    # vLLM's prefix cache holds 4 tokens (1 block); the connector's 14 more: [4, 18).
    planner.allocated("r", table, 14)
    planner.scheduled(
        "r", replace=True, block_ids=table, num_computed=18, num_scheduled=12, token_ids=tokens
    )
    plan = planner.plan(0)
    assert plan is not None
    keys = block_keys(tokens, BS)
    # Whole blocks of [4, 18): 1..3; block 4 ([16, 20)) is partly computed here: no key judges it.
    loaded = [DigestBlock("r", i, table[i], keys[i]) for i in (1, 2, 3)]
    assert list(plan.before) == loaded and list(plan.verify) == loaded
    assert [b.block_index for b in plan.full] == [4, 5, 6]  # 18 + 12 = 30 tokens: blocks 4-6
    assert planner.plan(1) is None  # nothing carries over
    # A sync load vLLM allocated but did not schedule in that step is not judged later.
    planner.added("q")
    planner.allocated("q", table, 8)
    assert planner.plan(2) is None
    planner.scheduled(
        "q", replace=True, block_ids=table, num_computed=8, num_scheduled=4, token_ids=tokens
    )
    plan = planner.plan(3)
    assert plan is not None and not plan.before and not plan.verify


def test_an_async_load_is_verified_once_finished_recving_names_it() -> None:
    tokens = list(range(20))
    planner = DigestPlanner(BS)
    planner.added("r")
    table = [5, 6, 7, 8, 9]
    planner.allocated("r", table, 12, load_async=True, local_hit=4, token_ids=tokens)
    plan = planner.plan(0)
    assert plan is not None and [b.block_index for b in plan.before] == [1, 2, 3]
    assert not plan.verify
    assert planner.plan(1) is None  # still loading
    planner.finished_recving(["r"])
    plan = planner.plan(2)
    assert plan is not None and [b.block_id for b in plan.verify] == [6, 7, 8]
    # A request that finished before its load did is not verified (its blocks may be reused).
    planner.added("q")
    planner.allocated("q", table, 8, load_async=True, local_hit=0, token_ids=tokens)
    planner.plan(3)
    planner.finished("q")
    planner.finished_recving(["q"])
    assert planner.plan(4) is None


# --- the book and its rules ---------------------------------------------------------------

KEYS = [bytes([k]) * 16 for k in range(4)]


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=12),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 5)), max_size=12),
)
def test_the_book_accepts_any_recorded_digest_and_names_the_rest(
    records: list[tuple[int, int]], loads: list[tuple[int, int, int]]
) -> None:
    book = DigestBook()
    model: dict[bytes, set[int]] = {}
    for k, d in records:
        assert book.apply(ev.BlockDigested(1, "a", 0, (KEYS[k],), (d,))) == []
        model.setdefault(KEYS[k], set()).add(d)
    want = {"verified": 0, "mismatched": 0, "unchanged": 0, "unverifiable": 0}
    for k, before, after in loads:
        key = KEYS[k]
        found = book.apply(ev.LoadDigested(2, "b", 7, (key,), (before,), (after,)))
        if key in model and after in model[key]:
            # Right bytes, even when the load left the block as it was (it held them already).
            want["verified"] += 1
            assert found == []
        elif after == before:
            want["unchanged"] += 1
            assert [v.rule for v in found] == ["load_unchanged"]
        elif key not in model:
            want["unverifiable"] += 1
            assert found == []
        else:
            want["mismatched"] += 1
            (v,) = found
            assert (v.rule, v.req_id, v.step, v.event) == (
                "digest_mismatch",
                "b",
                2,
                "LoadDigested",
            )
            assert v.detail["block"] == 7 and v.detail["key"] == key.hex()
            assert v.detail["found"] == f"{after:016x}"
            assert set(v.detail["expected"].split("|")) == {f"{d:016x}" for d in model[key]}
    stats = book.stats.to_dict()
    assert {k: stats[k] for k in want} == want
    assert stats["loaded"] == len(loads) and stats["digested"] == len(records)


def test_the_book_is_per_rank_and_bounded() -> None:
    book = DigestBook(max_keys=2)
    book.apply(ev.BlockDigested(0, "a", 0, (KEYS[0],), (1,), rank=1))
    # Rank 0 never digested key 0: unverifiable there, not a mismatch.
    assert book.apply(ev.LoadDigested(1, "b", 0, (KEYS[0],), (0,), (9,))) == []
    assert [v.rule for v in book.apply(ev.LoadDigested(1, "b", 0, (KEYS[0],), (0,), (9,), 1))] == [
        "digest_mismatch"
    ]
    book.apply(ev.BlockDigested(2, "a", 0, KEYS[1:3], (1, 1)))
    assert book.digests_of(KEYS[0], rank=1) == ()  # forgotten: the oldest key went first
    assert book.digests_of(KEYS[2]) == (1,)


# --- the report on the wire, and the Tracker's verdict -------------------------------------


def test_a_report_becomes_one_event_per_run_of_blocks_and_survives_the_codec() -> None:
    big = -(1 << 63)  # digests are signed 64-bit ints
    report = DigestReport(
        blocks=(("a", 0, KEYS[0], big), ("a", 1, KEYS[1], 2), ("b", 0, KEYS[0], 3)),
        loads=(
            ("c", 2, KEYS[2], 0, big, 8),
            ("c", 3, KEYS[3], 1, 2, 8),
            ("c", 5, KEYS[0], 1, 3, 8),
            ("c", 6, KEYS[1], 1, 4, 7),  # digested after a load of an earlier step
        ),
        rank=1,
    )
    assert DigestReport.from_plain(report.to_plain()) == report
    events = report.events(9)
    assert events == [
        ev.BlockDigested(9, "a", 0, KEYS[:2], (big, 2), 1),
        ev.BlockDigested(9, "b", 0, (KEYS[0],), (3,), 1),
        ev.LoadDigested(9, "c", 2, KEYS[2:4], (0, 1), (big, 2), 1, 8),
        ev.LoadDigested(9, "c", 5, (KEYS[0],), (1,), (3,), 1, 8),
        ev.LoadDigested(9, "c", 6, (KEYS[1],), (1,), (4,), 1, 7),
    ]
    assert list(roundtrip([events])[0]) == events


def test_a_digest_verdict_is_stamped_at_the_step_of_the_load() -> None:
    """The worker's report reaches the scheduler a step after the load: the book stamps a
    verdict with the load's step; the Tracker records it in the step it learned it (a log's
    frames stay in order), naming the load's step; a LoadDigested of a log before
    ``load_step`` (-1) is judged at its own step."""
    book = DigestBook()
    book.apply(ev.BlockDigested(3, "a", 0, KEYS[:1], (5,)))
    (v,) = book.apply(ev.LoadDigested(36, "b", 0, KEYS[:1], (0,), (7,), 0, 35))
    assert (v.rule, v.step, v.req_id) == ("digest_mismatch", 35, "b")
    (old,) = book.apply(ev.LoadDigested(36, "b", 0, KEYS[:1], (7,), (7,)))
    assert (old.rule, old.step) == ("load_unchanged", 36)
    log: list[ev.Event] = []

    class Sink:
        def append(self, e: ev.Event) -> None:
            log.append(e)

        def end_step(self, step: int) -> None:
            pass

    t = Tracker(TrackerConfig(block_size=BS, chunk_size=BS), log=Sink())
    t.add_request("b", list(range(8)))
    t.step = 36
    (recorded,) = t.apply(ev.LoadDigested(36, "b", 0, KEYS[:1], (7,), (7,), 0, 35))
    assert (recorded.step, recorded.rule) == (36, "load_unchanged")
    assert recorded.detail.endswith(",load_step=35")
    assert log[-1] == recorded


def test_the_tracker_records_a_mismatch_and_the_request_falls_back_to_recompute() -> None:
    log: list[ev.Event] = []

    class Sink:
        def append(self, e: ev.Event) -> None:
            log.append(e)

        def end_step(self, step: int) -> None:
            pass

    t = Tracker(TrackerConfig(block_size=BS, chunk_size=BS), log=Sink())
    t.add_request("a", list(range(8)))
    t.add_request("b", list(range(8)))
    assert t.apply(ev.BlockDigested(0, "a", 0, KEYS[:2], (5, 6))) == []
    assert t.apply(ev.LoadDigested(0, "b", 0, KEYS[:2], (0, 0), (5, 6))) == []  # verified
    # A block that already held its right KV and that the load left as it was: verified.
    assert t.apply(ev.LoadDigested(0, "b", 0, KEYS[:2], (0, 6), (5, 6))) == []
    out = t.apply(ev.LoadDigested(0, "b", 0, KEYS[:2], (0, 7), (5, 7)))
    assert [(d.rule, d.req_id) for d in out] == [("load_unchanged", "b")]
    assert out[0].detail == f"block=1,key={KEYS[1].hex()},digest={7:016x}"
    state = t.state("b")
    assert state is not None and state.recompute_only
    assert t.digests.stats.verified == 5 and t.digests.stats.unchanged == 1
    assert log[-1] == out[0] and isinstance(log[-2], ev.LoadDigested)  # the event, its verdict


# --- the worker's digests of real paged caches (torch, CPU) ------------------------------

L, NB, H, D = 3, 6, 2, 8


def _caches(layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = {
        "flash_attn": (2, NB, BS * 8, H, D),
        "flashinfer": (NB, 2, BS * 8, H, D),
        "cpu_attn": (NB, H, 32, 2 * D),
    }[layout]
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g, dtype=torch.float32)
        for i in range(L)
    }


def _block(cache: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    return cache[:, b] if layout == "flash_attn" else cache[b]


@pytest.fixture(params=["flash_attn", "flashinfer", "cpu_attn"])
def layout(request, monkeypatch) -> str:
    if request.param == "cpu_attn":
        import kvledger.connector.kv_layout as kv_layout

        monkeypatch.setattr(kv_layout, "cpu_attn_isa", lambda dtype, bs, d: "vec")
    return request.param


def _blocks(*ids: int) -> tuple[DigestBlock, ...]:
    return tuple(DigestBlock("r", i, b, KEYS[i % 4]) for i, b in enumerate(ids))


def _digests(d: BlockDigester, blocks: tuple[DigestBlock, ...]) -> list[int]:
    return [d.finish(v) for v in d.digest(blocks).tolist()]


def test_a_digest_is_a_function_of_the_block_bytes_alone(layout: str) -> None:
    caches = _caches(layout)
    for cache in caches.values():  # block 4 holds block 1's bytes, in every layer
        _block(cache, layout, 4).copy_(_block(cache, layout, 1))
    d = BlockDigester(caches, "full", layout)
    one = _digests(d, _blocks(1, 2, 4))
    assert one == _digests(BlockDigester(_caches(layout), "full", layout), _blocks(1, 2, 1))
    assert one[0] == one[2] != one[1]
    assert one == _digests(d, _blocks(1, 2, 4))  # deterministic


@pytest.mark.parametrize("layer", range(L))
def test_full_sees_one_changed_value_in_any_layer(layout: str, layer: int) -> None:
    caches = _caches(layout)
    d = BlockDigester(caches, "full", layout)
    blocks = _blocks(1, 2, 3)
    before = _digests(d, blocks)
    cache = list(caches.values())[layer]
    blk = _block(cache, layout, 2)
    blk[(1,) * blk.dim()] += 2**-10  # one element of block 2
    after = _digests(d, blocks)
    assert after[1] != before[1] and (after[0], after[2]) == (before[0], before[2])


def test_sampled_reads_the_layer_its_key_names(layout: str) -> None:
    caches = _caches(layout)
    d = BlockDigester(caches, "sampled", layout)
    (block,) = _blocks(2)
    seen = d.layer_of(block.key)
    before = _digests(d, (block,))
    other = list(caches.values())[(seen + 1) % L]
    _block(other, layout, 2)[0, 0, 0] += 1  # a layer the sample does not read
    assert _digests(d, (block,)) == before
    _block(list(caches.values())[seen], layout, 2)[0, 0, 0] += 1
    assert _digests(d, (block,)) != before


def test_the_worker_reports_blocks_and_loads_and_drops_refused_ones(layout: str) -> None:
    caches = _caches(layout)
    w = WorkerDigests("full", layout=layout, rank=2)
    w.register_kv_caches(caches)
    loaded = (DigestBlock("r", 0, 1, KEYS[0]), DigestBlock("r", 1, 2, KEYS[1]))
    full = (DigestBlock("r", 2, 3, KEYS[2]),)
    plan = DigestPlan(5, full=full, before=loaded, verify=loaded)
    w.before_load(plan)
    for cache in caches.values():  # "the load" writes block 1 only
        _block(cache, layout, 1).fill_(0.5)
    w.after_forward(plan, load_errors={2})  # block 2's load was refused: not judged
    report = w.report()
    assert report is not None and report.rank == 2
    d = BlockDigester(caches, "full", layout)
    (b1, b3) = _digests(d, (loaded[0], full[0]))
    assert report.blocks == (("r", 2, KEYS[2], b3),)
    ((rid, index, key, before, after, step),) = report.loads
    assert (rid, index, key, after) == ("r", 0, KEYS[0], b1) and before != after
    assert step == 5  # the plan's step: the load's
    assert w.report() is None  # reported once


def test_a_request_whose_load_failed_has_no_block_digested_as_its_keys() -> None:
    """The step's forward ran over a prefix whose load failed (vLLM recomputes it): the blocks
    it filled are not what their keys name, so none is reported as the key's digest (a later
    load of wrong bytes would read as verified against it). Another request's are."""
    caches = _caches("flash_attn")
    w = WorkerDigests("full", layout="flash_attn")
    w.register_kv_caches(caches)
    full = (DigestBlock("bad", 2, 3, KEYS[2]), DigestBlock("ok", 0, 4, KEYS[3]))
    w.after_forward(DigestPlan(5, full=full), load_errors={1}, failed={"bad"})
    report = w.report()
    assert report is not None
    assert [(rid, index) for rid, index, _, _ in report.blocks] == [("ok", 0)]


@pytest.mark.parametrize("block_id", [-1, NB])
def test_a_block_id_out_of_range_is_a_failed_digest_never_a_device_error(block_id: int) -> None:
    """Checked on the host before any index reaches the device (on CUDA an index out of range
    is a device-side assert that fails the engine's every later call): the step's digests are
    skipped, counted and reported as errors, the worker's step goes on."""
    w = WorkerDigests("full", layout="flash_attn")
    w.register_kv_caches(_caches("flash_attn"))
    with pytest.raises(ValueError, match=rf"block id {block_id} out of range \[0, {NB}\)"):
        assert w.digester is not None
        w.digester.digest((DigestBlock("r", 0, block_id, KEYS[0]),))
    w.before_load(DigestPlan(1, before=(DigestBlock("r", 0, block_id, KEYS[0]),)))
    w.after_forward(DigestPlan(1, full=(DigestBlock("r", 1, block_id, KEYS[1]),)))
    assert w.errors == 2
    report = w.report()
    assert report is not None and not (report.blocks or report.loads or report.carried)
    assert report.errors == tuple(
        (where, f"ValueError: block id {block_id} out of range [0, {NB})")
        for where in ("before_load", "after_forward")
    )
    assert w.report() is None  # said once


def test_a_failed_digest_is_a_record_lost_in_the_log() -> None:
    """A place where the worker's digests failed is a RecordLost (the rank and the error in
    its text) at its 1st, 2nd, 4th, 8th, ... failure: a digester failing at every step costs
    the log a record per doubling. Through the report's plain form (the connector's worker
    stats); a plain report of before the errors reads as none."""
    w = WorkerDigests("full", layout="flash_attn", rank=3)
    w.register_kv_caches(_caches("flash_attn"))
    said: dict[int, list[tuple[Any, ...]]] = {}
    for n in range(1, 10):  # a step each: its forward's digests fail, then the report
        w.after_forward(DigestPlan(n, full=(DigestBlock("r", 1, NB + n, KEYS[1]),)))
        report = w.report()
        if report is None:
            continue
        again = DigestReport.from_plain(report.to_plain())
        assert again == report
        assert DigestReport.from_plain(report.to_plain()[:4]).errors == ()
        said[n] = [(type(e), e.step, e.req_id, e.callback, e.error) for e in again.events(n)]
    error = "rank 3: ValueError: block id {} out of range [0, {})"
    assert said == {
        1: [(ev.RecordLost, 1, "", "digest_after_forward", error.format(NB + 1, NB))],
        **{
            n: [
                (
                    ev.RecordLost,
                    n,
                    "",
                    "digest_after_forward",
                    error.format(NB + n, NB)
                    + f" (failure {n} here; the next said: failure {2 * n})",
                )
            ]
            for n in (2, 4, 8)
        },
    }


def test_moved_bytes_change_the_digest(layout: str) -> None:
    """Not a checksum of the values: the same values in other places (K and V swapped, tokens
    in another order) digest differently."""
    caches = _caches(layout)
    d = BlockDigester(caches, "full", layout)
    (block,) = _blocks(2)
    before = _digests(d, (block,))
    blk = _block(list(caches.values())[1], layout, 2)
    flat = blk.reshape(-1).clone()  # swap the first and last 8 bytes
    flat[:2], flat[-2:] = flat[-2:].clone(), flat[:2].clone()
    blk.copy_(flat.reshape(blk.shape))
    assert _digests(d, (block,)) != before


def test_the_digest_is_the_documented_function() -> None:
    """Per layer the weighted sum of the block's 64-bit words modulo 2**64, the layers' sums
    weighted and added, then mixed: recomputed here in Python integers from the raw bytes."""
    caches = _caches("flashinfer")
    d = BlockDigester(caches, "full", "flashinfer")
    mask = (1 << 64) - 1
    w = d._weights.tolist()
    lw = d._layer_weights.tolist()
    total = 0
    for layer, cache in enumerate(caches.values()):
        words = cache[3].reshape(-1).view(torch.int64).tolist()
        total += lw[layer] * sum(a * b for a, b in zip(words, w, strict=True))
    (got,) = _digests(d, _blocks(3))
    assert got == d.finish(total & mask)


def test_the_plan_read_off_recorded_events_is_the_plan_told_directly() -> None:
    """A recorder's log (vLLM's facts, the inner's answers) gives the planner what a connector
    tells it directly: the same plans, step by step (a sync load, then decode steps)."""
    tokens = list(range(40))
    table = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    told, read = DigestPlanner(BS), DigestPlanner(BS)
    told.added("r")
    told.allocated("r", table, 12)
    told.scheduled(
        "r", replace=True, block_ids=table, num_computed=16, num_scheduled=14, token_ids=tokens
    )
    for e in (
        ev.RequestAdded(0, "r", tuple(tokens[:30])),
        ev.LookupAsked(0, "r", 4, 30),
        ev.InnerLookupAnswered(0, "r", 12, False),
        ev.Allocated(0, "r", tuple(table), 12),
        ev.Scheduled(0, "r", 16, 14, 30, (), tuple(table), ev.Admission.NEW),
    ):
        read.observe(e)
    assert told.plan(0) == read.plan(0) is not None
    for step, n in enumerate(range(30, 36), 1):
        told.scheduled(
            "r", replace=False, block_ids=(), num_computed=n, num_scheduled=1, token_ids=tokens
        )
        read.observe(ev.Scheduled(step, "r", n, 1, n, (tokens[n],), (), ev.Admission.RUNNING))
        assert told.plan(step) == read.plan(step)


def test_an_async_loads_before_digest_survives_a_step_without_forward() -> None:
    """vLLM starts an asynchronous load in a step with nothing scheduled (no forward, no
    wait_for_save): the before-digests are kept until the step that verifies the load."""
    caches = _caches("flashinfer")
    w = WorkerDigests("full", layout="flashinfer")
    w.register_kv_caches(caches)
    loaded = (DigestBlock("r", 0, 1, KEYS[0]),)
    w.before_load(DigestPlan(1, before=loaded))  # the load starts; no forward follows
    for cache in caches.values():
        cache[1].fill_(0.25)  # the load lands
    w.before_load(None)  # the next step
    w.after_forward(DigestPlan(2, verify=loaded))  # finished_recving named the request
    report = w.report()
    assert report is not None
    ((_, _, _, before, after, step),) = report.loads
    assert before != after
    assert step == 2  # the step that verified it, after vLLM reported the load done
