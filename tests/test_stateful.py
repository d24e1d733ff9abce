"""A hypothesis state machine drives a Tracker the way vLLM's scheduler would, with a small
reference model of vLLM's own view (all_token_ids, num_computed_tokens, a block pool with a
prefix cache) and of the worker (paged KV blocks, host pool slots), and checks after every
step that the tracker agrees with it and that every byte it made the worker move is right.

The KV-content oracle: every computed position of every request holds a value derived from
its whole token prefix. The forward pass writes it; loads and saves copy it exactly as the
tracker's transfer plans say. A stale block, an off-by-one load, a chunk stored under the
wrong key or from the wrong offset all show up as a wrong value at a known position.

Sequences are well-formed by construction, so the tracker must record no violation at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _pool import stored_items
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.plans import TransferPlan, transfer_plan
from kvledger.tracker.state import Phase
from kvledger.tracker.tracker import Tracker

POISON = -1  # KV computed over a failed load: attends to garbage
BASE = [i * 7 % 5 for i in range(48)]  # a shared corpus: prompts share its prefixes
MAX_LIVE = 5


def _chain(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % (1 << 61)


@dataclass(eq=False)  # identity: one object per request
class VReq:
    """vLLM's ``Request`` as far as the connector can see it."""

    rid: str
    all: list[int]  # all_token_ids
    max_out: int
    values: list[int] = field(default_factory=list)  # the oracle KV value at each position
    nc: int = 0  # num_computed_tokens
    table: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    ever_ran: bool = False
    outputs: int = 0

    def __post_init__(self) -> None:
        self._extend_values()

    def _extend_values(self) -> None:
        prev = self.values[-1] if self.values else 0
        for tok in self.all[len(self.values) :]:
            prev = _chain(prev, tok)
            self.values.append(prev)

    def append(self, token: int) -> None:
        self.all.append(token)
        self._extend_values()

    def next_token(self) -> int:
        # A function of the prefix: equal prefixes generate equal outputs (shared decode chunks).
        return self.values[-1] % 5


@dataclass
class Scheduled:
    req: VReq
    nc: int
    ns: int
    admission: ev.Admission
    new_blocks: list[int]
    table: list[int] = field(default_factory=list)  # the whole table when scheduled
    loads: list[TransferPlan] = field(default_factory=list)
    saves: list[tuple[ev.SavePlanned, TransferPlan]] = field(default_factory=list)


@dataclass
class Output:
    """What one executed step tells the scheduler (``ModelRunnerOutput`` + connector output)."""

    sampled: list[tuple[VReq, int]] = field(default_factory=list)
    loads_done: list[str] = field(default_factory=list)
    loads_failed: list[tuple[VReq, tuple[int, ...], int]] = field(default_factory=list)
    saves: list[tuple[str, tuple[bytes, ...], bool]] = field(default_factory=list)


_CONFIG: dict[str, st.SearchStrategy[Any]] = dict(
    block_size=st.sampled_from([2, 4]),
    blocks_per_chunk=st.sampled_from([1, 2]),
    num_slots=st.sampled_from([2, 3, 4, 6, 12]),
    num_blocks=st.integers(10, 40),
    discard_partial=st.booleans(),
    save_decode=st.booleans(),
    prefix_caching=st.booleans(),
    async_sched=st.booleans(),
    preempt_signal=st.booleans(),
    mrv2=st.booleans(),
    late_saves=st.booleans(),
    failures=st.booleans(),
    fast_decode=st.booleans(),
)


class VLLMModel(RuleBasedStateMachine):
    """The model and its checks; the machines below choose the configurations."""

    fail_one_in = 6  # a load chunk or a save fails once in this many, when failures are on

    def setup(
        self,
        block_size: int,
        blocks_per_chunk: int,
        num_slots: int,
        num_blocks: int,
        discard_partial: bool,
        save_decode: bool,
        prefix_caching: bool,
        async_sched: bool,
        preempt_signal: bool,
        mrv2: bool,
        late_saves: bool,
        failures: bool,
        fast_decode: bool,
    ) -> None:
        self.B = block_size
        self.C = block_size * blocks_per_chunk
        self.cfg = TrackerConfig(
            block_size=self.B,
            chunk_size=self.C,
            num_slots=num_slots,
            discard_partial_chunks=discard_partial,
            save_decode_cache=save_decode,
        )
        self.t = Tracker(self.cfg)
        self.prefix_caching = prefix_caching
        self.async_sched = async_sched
        self.preempt_signal = preempt_signal
        self.mrv2 = mrv2
        self.late_saves = late_saves
        # The connector's hot path: a steady single-token step is only numbered
        # (decode_step_ok / decoded, one StepDecoded for the step) and folded lazily.
        self.fast_decode = fast_decode
        # Load failures roll num_computed back; under async scheduling the next step is
        # already scheduled from the old count, a case vLLM itself does not support.
        self.load_failures = failures and not async_sched
        self.save_failures = failures
        # vLLM: requests, queues, block pool with a prefix cache
        self.reqs: dict[str, VReq] = {}
        self.waiting: list[VReq] = []
        self.running: list[VReq] = []
        self.n_req = 0
        self.free: list[int] = list(range(num_blocks))  # ref count 0, LRU first
        self.ref: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # prefix value at a block's end -> block id
        self.block_hash: dict[int, int] = {}
        self.delayed_free: dict[str, VReq] = {}
        # worker: paged KV blocks and host pool slots, with the oracle's expectations
        self.gpu: dict[int, list[int | None]] = {b: [None] * self.B for b in range(num_blocks)}
        self.pool: dict[int, list[int | None]] = {s: [None] * self.C for s in range(num_slots)}
        self.expect: dict[bytes, list[int]] = {}
        # the pipeline: the last executed step's output, and save results held back a step
        self.output: Output | None = None
        self.late: list[tuple[str, tuple[bytes, ...], bool]] = []
        self.steps = 0

    # --- rules -----------------------------------------------------------------------------

    # Rules are always enabled (a disabled rule makes hypothesis discard examples); the
    # scheduler step is three rules so that most of a run is spent stepping.

    @rule(
        prefix=st.one_of(st.sampled_from([12, 24, 40]), st.integers(0, 40)),
        suffix=st.lists(st.integers(0, 4), max_size=8),
        max_out=st.integers(1, 14),
    )
    def add_request(self, prefix: int, suffix: list[int], max_out: int) -> None:
        if sum(r.status != "finished" for r in self.reqs.values()) >= MAX_LIVE:
            return
        prompt = BASE[:prefix] + suffix or [1]
        rid = f"r{self.n_req}"
        self.n_req += 1
        req = VReq(rid, list(prompt), max_out)
        self.reqs[rid] = req
        self.waiting.append(req)
        self.t.add_request(rid, prompt)

    @rule(data=st.data())
    def step_a(self, data: st.DataObject) -> None:
        self.step(data)

    @rule(data=st.data())
    def step_b(self, data: st.DataObject) -> None:
        self.step(data)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        if not self.async_sched:
            self._deliver()
        sched = self._schedule(data)
        self._build_connector_meta(sched)
        if self.async_sched:
            self._deliver()  # the previous step's output arrives after this schedule
        self.output = self._execute(sched, data)
        if not self.async_sched:
            self._deliver()
        self._register_cached_blocks()
        self.t.end_step()
        self.steps += 1

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted((r for r in self.reqs.values() if r.status != "finished"), key=_rid)
        if live and data.draw(st.booleans(), label="abort"):
            victim: VReq = data.draw(st.sampled_from(live))
            self._finish(victim, "aborted")

    @rule(data=st.data())
    def pool_evicts(self, data: st.DataObject) -> None:
        """A chunk leaves the pool outside our plans (``reset_cache``, a second tier)."""
        stored = stored_items(self.t.index)
        if stored and data.draw(st.integers(0, 2), label="evict") == 0:
            key, _ = data.draw(st.sampled_from(stored))
            self.t.apply(ev.ChunkEvicted(self.t.step, "", key=key))

    # --- vLLM's scheduler --------------------------------------------------------------------

    def _schedule(self, data: st.DataObject) -> list[Scheduled]:
        budget = data.draw(st.integers(1, 24), label="long_prefill_budget")
        sched: list[Scheduled] = []
        preempted: list[VReq] = []
        if self.running and data.draw(st.integers(0, 9), label="priority_preempt") == 0:
            preempted.append(self._preempt(self.running[-1]))
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = len(req.all) - req.nc
            ns = min(remaining, budget) if remaining > 0 else 1  # 0: async placeholder
            need = _cdiv(req.nc + ns, self.B) - len(req.table)
            while need > len(self.free):
                victim = self.running[-1]
                preempted.append(self._preempt(victim))
                if victim is req:
                    break
            if req.status != "running":
                continue  # preempted itself; the list shrank
            new = [self._take_block() for _ in range(max(0, need))]
            req.table += new
            sched.append(Scheduled(req, req.nc, ns, ev.Admission.RUNNING, new, list(req.table)))
            i += 1
        if not preempted:  # vLLM schedules no waiting request in a step that preempted
            while self.waiting:
                req = self.waiting[0]
                if not self._admit(req, budget, sched):
                    break  # allocation failed: asked again next step
                self.waiting.pop(0)
        self._preempted_now = preempted
        return sched

    def _admit(self, req: VReq, budget: int, sched: list[Scheduled]) -> bool:
        hit_blocks = self._local_hit(req)
        local = len(hit_blocks) * self.B
        external = self.t.lookup(req.rid, local, req.all, preempted=req.ever_ran)
        state, stats = self.t.state(req.rid), self.t.index.stats()
        stored = stored_items(self.t.index)
        again = self.t.lookup(req.rid, local, req.all, preempted=req.ever_ran)
        assert again == external, "a repeated lookup answered differently"
        assert self.t.state(req.rid) == state, "a repeated lookup changed the state"
        assert (self.t.index.stats(), stored_items(self.t.index)) == (stats, stored)
        assert 0 <= external <= len(req.all) - local - 1, "offered the last token"
        nc = local + external
        ns = min(len(req.all) - nc, budget)
        assert ns >= 1
        need = _cdiv(nc + ns, self.B) - len(hit_blocks)
        reusable = sum(1 for b in hit_blocks if self.ref.get(b, 0) == 0)
        if need > len(self.free) - reusable:
            event("allocation failed: lookup asked again")
            return False
        for b in hit_blocks:
            if self.ref.get(b, 0) == 0:
                self.free.remove(b)
            self.ref[b] = self.ref.get(b, 0) + 1
        req.table = hit_blocks + [self._take_block() for _ in range(need)]
        self.t.allocated(req.rid, req.table, external)
        admission = ev.Admission.NEW
        if req.ever_ran and not self.mrv2:
            admission = ev.Admission.RESUMED
        req.nc, req.status, req.ever_ran = nc, "running", True
        self.running.append(req)
        sched.append(Scheduled(req, nc, ns, admission, list(req.table), list(req.table)))
        return True

    def _local_hit(self, req: VReq) -> list[int]:
        if not self.prefix_caching:
            return []
        hit: list[int] = []
        while (len(hit) + 1) * self.B <= len(req.all) - 1:  # never the last token
            block = self.cached.get(req.values[(len(hit) + 1) * self.B - 1])
            if block is None:
                break
            hit.append(block)
        return hit

    def _take_block(self) -> int:
        block = self.free.pop(0)
        h = self.block_hash.pop(block, None)
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.ref[block] = 1
        self.gpu[block] = [None] * self.B  # whatever was there is not this request's KV
        return block

    def _release(self, req: VReq) -> None:
        for b in req.table:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        req.table = []

    def _preempt(self, req: VReq) -> VReq:
        event("preemption")
        self.running.remove(req)
        self._release(req)
        req.nc, req.status = 0, "waiting"
        self.waiting.insert(0, req)
        return req

    def _finish(self, req: VReq, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = "finished"
        delay = self.t.finished(req.rid, reason)
        state = self.t.state(req.rid)
        assert delay == (state is not None and bool(state.save.pending))
        if delay:
            event("finished with a save in flight")
            self.delayed_free[req.rid] = req  # freed once its saves are confirmed
        else:
            self._release(req)

    def _register_cached_blocks(self) -> None:
        if not self.prefix_caching:
            return
        for req in self.running:
            for i in range(min(req.nc, len(req.all)) // self.B):
                h = req.values[(i + 1) * self.B - 1]
                block = req.table[i]
                if h not in self.cached and block not in self.block_hash:
                    self.cached[h] = block
                    self.block_hash[block] = h

    # --- the connector: build_connector_meta ---------------------------------------------------

    def _build_connector_meta(self, sched: list[Scheduled]) -> None:
        t = self.t
        if self.preempt_signal:
            for req in sorted(set(self._preempted_now), key=_rid):
                if req.status == "waiting":
                    t.preempted(req.rid)
        # The connector's order: scheduled_new_reqs, then scheduled_cached_reqs (running
        # requests first, then those resumed from preemption, as vLLM scheduled them).
        order = [s for s in sched if s.admission is ev.Admission.NEW] + [
            s for s in sched if s.admission is not ev.Admission.NEW
        ]
        loading: set[bytes] = set()  # chunks this step's loads read
        steady: list[int] = []
        for s in order:
            req = s.req
            if (
                self.fast_decode
                and s.admission is ev.Admission.RUNNING
                and s.ns == 1
                and not s.new_blocks
            ):
                num = t.decode_step_ok(req.rid, s.nc)
                if num is not None:
                    event("steady decode step")
                    steady.append(num)
                    req.nc = s.nc + s.ns
                    continue
            ds = t.scheduled(
                req.rid,
                num_computed=s.nc,
                num_scheduled=s.ns,
                all_token_ids=req.all,
                block_ids=s.new_blocks,
                admission=s.admission,
            )
            state = t.state(req.rid)
            assert state is not None and state.phase is Phase.RUNNING
            assert not state.recompute_only, t.violations
            assert state.num_tokens == s.nc + s.ns
            assert state.num_computed == s.nc
            assert state.token_ids == req.all[: len(state.token_ids)]
            assert len(state.token_ids) >= state.num_tokens - (1 if self.async_sched else 0)
            assert state.block_ids == req.table
            assert state.num_tokens <= state.block_capacity(self.B)
            assert state.saved <= state.num_tokens
            for d in ds:
                assert not isinstance(d, ev.ViolationRecorded), d
                if isinstance(d, ev.LoadPlanned):
                    assert s.admission is not ev.Admission.RUNNING
                    assert d.refused_blocks == ()
                    assert state.lookup is not None
                    assert d.start == state.lookup.local_hit
                    assert d.end == s.nc  # exactly what vLLM accepted, no more
                    assert d.end < state.num_tokens  # never the last token
                    assert d.end <= state.lookup.num_tokens - 1
                    plan = transfer_plan(d, state, self.cfg)
                    assert plan is not None and plan.num_tokens == d.end - d.start
                    s.loads.append(plan)
                    loading.update(d.keys)
                    event(f"load on {s.admission.name} admission")
                    if d.end == state.lookup.num_tokens - 1:
                        event("load of a full hit")
                elif isinstance(d, ev.SavePlanned) and d.keys:
                    assert not loading & set(d.evicted), "evicted a chunk being loaded"
                    assert d.end <= state.num_tokens
                    plan = transfer_plan(d, state, self.cfg)
                    assert plan is not None
                    for ch in plan.chunks:
                        want = req.values[ch.token_start - ch.slot_offset : ch.token_end]
                        if ch.key in self.expect:  # a key always names the same KV
                            n = min(len(want), len(self.expect[ch.key]))
                            assert self.expect[ch.key][:n] == want[:n]
                        self.expect[ch.key] = want
                    s.saves.append((d, plan))
                    if d.evicted:
                        event("save evicts")
                    if d.end % self.C:
                        event("partial chunk saved")
            req.nc = s.nc + s.ns  # vLLM's _update_after_schedule
        t.decoded(steady)

    # --- the worker ------------------------------------------------------------------------------

    def _execute(self, sched: list[Scheduled], data: st.DataObject) -> Output:
        out = Output()
        for s in sched:
            req = s.req
            failed_at: int | None = None
            failed_blocks: list[int] = []
            for plan in s.loads:
                for ch in plan.chunks:
                    failed = self.load_failures and (
                        data.draw(st.integers(1, self.fail_one_in), label="load_fails") == 1
                    )
                    if failed:
                        lo = ch.token_start // self.B
                        hi = _cdiv(ch.token_end, self.B)
                        failed_blocks += plan.block_ids[lo:hi]
                        failed_at = lo * self.B if failed_at is None else failed_at
                        continue
                    for p in range(ch.token_start, ch.token_end):
                        value = self.pool[ch.slot][ch.slot_offset + p - ch.token_start]
                        self.gpu[plan.block_ids[p // self.B]][p % self.B] = value
            # The forward pass. Under async scheduling the request may have finished since it
            # was scheduled (its blocks freed, not yet reused): the step still runs.
            for p in range(s.nc, s.nc + s.ns):
                value = req.values[p] if failed_at is None else POISON
                self.gpu[s.table[p // self.B]][p % self.B] = value
            for d, plan in s.saves:
                ok = not self.save_failures or (
                    data.draw(st.integers(1, self.fail_one_in), label="save_fails") > 1
                )
                if ok:
                    for ch in plan.chunks:
                        for p in range(ch.token_start, ch.token_end):
                            block = plan.block_ids[p // self.B]
                            self.pool[ch.slot][ch.slot_offset + p - ch.token_start] = self.gpu[
                                block
                            ][p % self.B]
                out.saves.append((req.rid, d.keys, ok))
            if s.loads:
                if failed_at is None:
                    out.loads_done.append(req.rid)
                else:
                    if s.saves:
                        event("a save computed over a failed load")
                    out.loads_failed.append((req, tuple(failed_blocks), failed_at))
            elif s.nc + s.ns >= len(req.all):
                out.sampled.append((req, s.nc + s.ns))
            if s.loads and failed_at is None and s.nc + s.ns >= len(req.all):
                out.sampled.append((req, s.nc + s.ns))
        return out

    def _deliver(self) -> None:
        """vLLM's update_from_output: the connector's results first, then sampled tokens."""
        out, self.output = self.output, None
        late, self.late = self.late, []
        if out is None:
            out = Output()
        t = self.t
        for rid in out.loads_done:
            t.load_done(rid)
        for req, blocks, at in out.loads_failed:
            event("load failed")
            t.load_failed(req.rid, blocks)
            if req.status == "running":
                req.nc = min(req.nc, at)  # vLLM's recompute policy rolls back
        results = late + out.saves
        if self.late_saves:
            results, self.late = late, out.saves
        for rid, keys, ok in results:
            (t.save_done if ok else t.save_failed)(rid, keys)
        for req, computed in out.sampled:
            if req.status == "finished" or computed < len(req.all):
                continue  # discarded (finished meanwhile) or preempted and recomputing
            req.append(req.next_token())
            req.outputs += 1
            if req.outputs >= req.max_out:
                self._finish(req, "stopped")
        for rid, req in list(self.delayed_free.items()):
            if t.state(rid) is None:
                del self.delayed_free[rid]
                self._release(req)

    # --- checks after every step -----------------------------------------------------------------

    @invariant()
    def no_violations(self) -> None:
        assert self.t.violations == [], [v.describe() for v in self.t.violations]

    @invariant()
    def index_is_bounded_and_conserves_slots(self) -> None:
        index = self.t.index
        stats = index.stats()
        assert len(index) <= self.cfg.num_slots
        assert stats["stored"] + stats["writing"] + stats["free"] == self.cfg.num_slots

    @invariant()
    def stored_chunks_hold_their_kv(self) -> None:
        for key, slot in stored_items(self.t.index):
            want = self.expect.get(key)
            if want is not None:
                assert self.pool[slot][: len(want)] == want, "the pool serves wrong KV"

    @invariant()
    def running_requests_hold_their_kv(self) -> None:
        for req in self.running:
            for p in range(min(req.nc, len(req.values))):
                got = self.gpu[req.table[p // self.B]][p % self.B]
                assert got == req.values[p], f"{req.rid} position {p}: {got} != oracle"

    @invariant()
    def tracker_agrees_with_vllm(self) -> None:
        if self.fast_decode and self.steps % 4:
            return  # reading a state folds its pending steady steps: let a few pile up
        for req in self.reqs.values():
            state = self.t.state(req.rid)
            if req.status == "finished":
                assert state is None or state.phase is Phase.FINISHED
                continue
            assert state is not None
            if req.status == "running":
                assert state.num_tokens == req.nc
                assert state.block_ids == req.table
                assert state.saved <= state.num_tokens
                assert state.token_ids == req.all[: len(state.token_ids)]
                if not self.fast_decode:  # steady steps learn their token ids later
                    assert len(state.token_ids) >= state.num_tokens - 1

    def teardown(self) -> None:
        if not hasattr(self, "t"):
            return
        # Everything finishes; every result in flight arrives.
        for req in sorted(self.reqs.values(), key=_rid):
            if req.status != "finished":
                self._finish(req, "aborted")
        self._deliver()
        self._deliver()
        assert self.t.violations == [], [v.describe() for v in self.t.violations]
        assert self.t.states == {}, "a finished request was never retired"
        stats = self.t.index.stats()
        assert stats["pinned"] == 0, "a pin leaked"
        assert stats["writing"] == 0, "a write leaked"
        assert stats["stored"] + stats["free"] == self.cfg.num_slots
        assert not self.delayed_free
        assert sorted(self.free) == sorted(self.gpu), "a block leaked"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rid(req: VReq) -> int:
    return int(req.rid[1:])


class VLLMAndTracker(VLLMModel):
    """Every configuration: sync and async scheduling, MRV1 and MRV2 re-admission, with and
    without the preemption signal, prefix caching, partial and decode chunks, late results."""

    @initialize(**_CONFIG)
    def init(self, **config: Any) -> None:
        self.setup(**config)


class LoadFailures(VLLMModel):
    """Focused on failed loads and saves (#2516): synchronous scheduling, a pool large enough
    to keep hits, and failures three times as often."""

    fail_one_in = 2

    @initialize(
        **{
            **_CONFIG,
            "num_slots": st.sampled_from([8, 16]),
            "async_sched": st.just(False),
            "failures": st.just(True),
            "discard_partial": st.just(True),
        }
    )
    def init(self, **config: Any) -> None:
        self.setup(**config)


_SETTINGS: dict[str, Any] = dict(
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
VLLMAndTracker.TestCase.settings = settings(max_examples=250, **_SETTINGS)
LoadFailures.TestCase.settings = settings(max_examples=100, **_SETTINGS)
TestVLLMAndTracker = VLLMAndTracker.TestCase
TestLoadFailures = LoadFailures.TestCase
