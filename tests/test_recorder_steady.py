"""The recorder's steady decode steps (tracker/recorded_steps.py) change no verdict.

Under vLLM 0.33's real scheduler, the same runs recorded both ways (``steady_decode`` on: the
running requests that decoded one token the plainest way batched into ``StepDecoded`` entries;
off: one ``Scheduled`` per request per step): vLLM does the same, the batched log expands back
into exactly the events of the full one, and ``kvledger check`` (with and without
``--differential``) finds the same problems, at the same events, with the same states. Then,
under hypothesis, recorder histories written both ways: the same events back, the same
verdicts from every rule and from ``check``."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _rigs import PREEMPTING_RECORDED as PREEMPTING
from _rigs import example_spec
from _verdicts import events_of, expanded, steady_entries, verdicts, write_recorded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.connector.testing.harness import skip_reason
from kvledger.tracker import events as ev
from kvledger.tracker.recorded_rules import check_recorded
from kvledger.tracker.recorded_steps import RecordedSteps
from tests._lmcache import need, runs

vllm = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

KVLEDGER = dict(inner="kvledger.connector.vllm:KVLedgerConnector", layout="flash_attn")

RUNS: dict[str, dict[str, Any]] = {
    # Our own connector wrapped: preemptions, resumptions, reloads; the differential agrees.
    "kvledger": dict(PREEMPTING, **KVLEDGER, extra_config={"chunk_size": 16}),
    # ... under async scheduling (the last token id is not known when a step is planned).
    "kvledger-async": dict(
        PREEMPTING, **KVLEDGER, extra_config={"chunk_size": 16}, async_scheduling=True
    ),
    # ... under Model Runner V1 (a resumed request comes back among the cached ones).
    "kvledger-mrv1": dict(
        PREEMPTING, **KVLEDGER, extra_config={"chunk_size": 16}, model_runner_v2=False
    ),
    # A connector that claims a block more than it holds: the differential names it.
    "overclaiming": dict(
        PREEMPTING,
        inner="_recorder_inners:OverclaimingKVLedger",
        layout="flash_attn",
        extra_config={"chunk_size": 16},
    ),
    # ExampleConnector saving prompts it never computed: the digests name the loads.
    "example-digests": dict(PREEMPTING, max_num_batched_tokens=128, digests="full"),
}


def _record(tmp_path: Path, name: str, steady: bool) -> Any:
    from kvledger.connector.testing.recorded import WrappedSpec, run_wrapped

    kw = dict(RUNS[name], steady_decode=steady)
    if "inner" in kw:
        spec = WrappedSpec(**kw)
    else:
        spec = example_spec(tmp_path / f"store-{steady}", **kw)
    return run_wrapped(spec, log_dir=str(tmp_path / f"logs-{steady}"))


@pytest.mark.vllm
@vllm
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_same_run_recorded_both_ways_gets_the_same_verdicts(tmp_path, name: str) -> None:
    batched = _record(tmp_path, name, steady=True)
    full = _record(tmp_path, name, steady=False)
    assert batched.trace == full.trace  # vLLM did the same
    assert [m.describe() for m in batched.mismatches] == [m.describe() for m in full.mismatches]
    # The fast path was taken, and the batched log holds exactly the full one's facts.
    assert steady_entries(batched.log_path) > 0 and steady_entries(full.log_path) == 0
    assert expanded(events_of(batched.log_path)) == events_of(full.log_path)
    for kw in ({}, {"differential": True, "chunk_size": 16}):
        assert verdicts(batched.log_path, **kw) == verdicts(full.log_path, **kw)
    if name in ("overclaiming", "example-digests"):  # the runs that break something
        assert verdicts(batched.log_path, differential=True, chunk_size=16)["exit"] == 1


# --- hypothesis: recorder histories, written both ways ------------------------------------

BS = 16


@st.composite
def recorder_histories(draw: Any) -> list[ev.Event]:
    """What a recorder writes in full for a few requests, step by step: admissions (a lookup,
    its answer, sync or async, the allocation vLLM accepted, maybe more than offered), decode
    steps (mostly one token at the expected count, a block every ``BS`` tokens; sometimes two
    tokens, a token id not known yet, a count off by one), preemptions and resumptions,
    transfer results, load errors, finishes with or without a delayed free, reused ids."""
    events: list[ev.Event] = []
    live: dict[str, dict[str, Any]] = {}  # req id -> its view: tokens, num_tokens, known, table
    lives = 0
    next_block = 1
    for step in range(draw(st.integers(3, 24))):
        # Transfer results and answers of vLLM's update_from_output (this step's number).
        for rid in sorted(live):
            r = live[rid]
            if r["async"] and draw(st.integers(0, 3)) == 0:
                events.append(ev.InnerRecvDone(step, rid, draw(st.booleans())))
                r["async"] = False
        if live and draw(st.integers(0, 9)) == 0:
            events.append(ev.InnerLoadErrors(step, "", (draw(st.integers(1, next_block)),)))
        for rid in sorted(live):
            if draw(st.integers(0, 7)) == 0:
                r = live.pop(rid)
                delay = draw(st.booleans())
                events += [
                    ev.Finished(step, rid, "stopped"),
                    ev.InnerFinishedAnswered(step, rid, delay, tuple(r["table"])),
                ]
                if delay:
                    events.append(ev.InnerSendDone(step, rid))
        # New requests: a reused id now and then.
        if len(live) < 4 and draw(st.booleans()):
            lives += 1
            rid = f"r{draw(st.integers(0, lives))}"
            if rid not in live:
                n = draw(st.integers(1, 3 * BS))
                prompt = tuple(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
                live[rid] = {
                    "tokens": list(prompt),
                    "num_tokens": -1,
                    "known": n,
                    "table": [],
                    "async": False,
                    "waiting": True,
                }
                events.append(ev.RequestAdded(step, rid, prompt))
        # Lookups and allocations of the waiting ones.
        admitted: list[str] = []
        for rid in sorted(live):
            r = live[rid]
            if not r["waiting"]:
                continue
            n = len(r["tokens"])
            offered = draw(st.integers(-1, max(0, n - 1) // BS)) * BS if n > 1 else 0
            load_async = draw(st.integers(0, 3)) == 0
            start = r["known"]
            events += [
                ev.LookupAsked(step, rid, 0, n, min(start, n), tuple(r["tokens"][start:])),
                ev.InnerLookupAnswered(step, rid, max(-1, offered), load_async),
            ]
            r["known"] = max(r["known"], n)
            accepted = max(0, offered) + draw(st.sampled_from((0, 0, 0, BS)))
            table = list(range(next_block, next_block + n // BS + 1))
            next_block += len(table)
            events.append(ev.Allocated(step, rid, tuple(table), accepted))
            r.update(table=table, waiting=False, accepted=accepted)
            r["async"] = load_async
            admitted.append(rid)
        # The scheduled requests, in vLLM's order: the admissions (a resumption after a
        # preemption), then the running ones.
        for rid in admitted:
            r = live[rid]
            n = len(r["tokens"])
            nc = min(r["accepted"], n - 1)
            start = min(r["known"], n)
            ids = tuple(r["tokens"][start:n])
            admission = 2 if r.get("resumes") else 1
            events.append(
                ev.Scheduled(step, rid, nc, n - nc, start, ids, tuple(r["table"]), admission)
            )
            r["num_tokens"], r["known"] = n, max(r["known"], start + len(ids))
        for rid in sorted(live):
            r = live[rid]
            if rid in admitted or r["waiting"] or r["num_tokens"] < 0:
                continue
            if draw(st.integers(0, 11)) == 0:  # preempted: back later as a resumption
                events.append(ev.Preempted(step, rid))
                r.update(waiting=True, num_tokens=-1, resumes=True)
                continue
            # vLLM sampled one more token; it decodes it now (usually).
            r["tokens"].append(draw(st.integers(0, 5)))
            kind = draw(st.sampled_from(("plain",) * 8 + ("two", "unknown", "off")))
            nc = r["num_tokens"] + (1 if kind == "off" else 0)
            ns = 2 if kind == "two" else 1
            known_end = len(r["tokens"]) - (1 if kind == "unknown" else 0)
            end = min(known_end, nc + ns)
            start = min(r["known"], end)
            ids = tuple(r["tokens"][start:end])
            grown: tuple[int, ...] = ()
            if (nc + ns) > len(r["table"]) * BS:
                grown = (next_block,)
                next_block += 1
                r["table"].append(grown[0])
            events.append(ev.Scheduled(step, rid, nc, ns, start, ids, grown, 0))
            r["num_tokens"] = nc + ns
            r["known"] = max(r["known"], start + len(ids))
    return events


def _rules(events: list[ev.Event]) -> list[tuple[str, int, str, dict[str, Any]]]:
    return [(v.rule, v.step, v.req_id, v.detail) for v in check_recorded(events, BS)]


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(recorder_histories())
def test_batched_steps_expand_back_and_every_rule_agrees(events: list[ev.Event]) -> None:
    batched = RecordedSteps().encode(events)
    assert expanded(batched) == events
    assert _rules(batched) == _rules(events)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(recorder_histories())
def test_check_of_a_batched_log_is_check_of_the_full_one(events: list[ev.Event]) -> None:
    """``kvledger check`` and ``check --differential`` of the two logs: the same problems, at
    the same events, with the same states."""
    batched = RecordedSteps().encode(events)
    with tempfile.TemporaryDirectory() as tmp:
        full_log = write_recorded(Path(tmp) / "full.kvlog", events)
        batched_log = write_recorded(Path(tmp) / "batched.kvlog", batched)
        for kw in ({}, {"differential": True}):
            assert verdicts(batched_log, **kw) == verdicts(full_log, **kw)


def _plans(events: list[ev.Event]) -> list[Any]:
    """The digest plans a recorder's planner makes of these events, step by step
    (connector/digests.py's RecorderDigests: a StepDecoded observed as what it stands for)."""
    from kvledger.tracker.digests import DigestPlanner

    planner, steps = DigestPlanner(BS), RecordedSteps()
    plans: list[Any] = []
    step = events[0].step if events else 0
    for e in events:
        if e.step != step:
            plans.append(planner.plan(step))
            step = e.step
        if isinstance(e, ev.StepDecoded):
            planner.observe_decoded(e, steps)
        else:
            planner.observe(e)
        steps.follow(e)
    plans.append(planner.plan(step))
    return plans


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(recorder_histories())
def test_the_digests_plan_a_batched_log_as_the_full_one(events: list[ev.Event]) -> None:
    """Which blocks the worker digests each step (blocks filled, loads before and after):
    the same plans whether the recorder batched its steady steps or not."""
    assert _plans(RecordedSteps().encode(events)) == _plans(events)


def test_the_histories_batch_and_break_rules() -> None:
    """The strategy is worth its examples: batched steps and broken rules both occur."""
    seen = {"batched": 0, "rules": 0}

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(recorder_histories())
    def count(events: list[ev.Event]) -> None:
        batched = RecordedSteps().encode(events)
        seen["batched"] += any(isinstance(e, ev.StepDecoded) for e in batched)
        seen["rules"] += bool(_rules(events))

    count()
    assert seen["batched"] > 50 and seen["rules"] > 20, seen


def test_a_step_decoded_that_stands_for_nothing_is_named() -> None:
    """A damaged or forged recorder log: an entry whose number no live request holds, one for
    a request never scheduled in its life, tokens that do not pair with the numbers."""
    added = [ev.RequestAdded(0, "a", (1, 2, 3)), ev.RequestAdded(0, "b", (1, 2))]
    first = ev.Scheduled(0, "a", 0, 3, 3, (), (1,), 1)
    rules = [
        v.rule
        for v in check_recorded(
            [*added, first, ev.StepDecoded(1, "", (0, 1, 7), (), (4, 5, 6))], BS
        )
    ]
    assert rules == ["decoded_not_steady", "decoded_unknown"]
    assert [
        v.rule for v in check_recorded([*added, first, ev.StepDecoded(1, "", (0,), ())], BS)
    ] == ["decoded_blocks"]


# --- LMCache's real adapter (connector/testing/lmcache.py), both ways ------------------------

LMCACHE_RUNS = {
    # #1969 (load_unchanged from the digests, the differential's step 16), under Model Runner
    # V1 and async scheduling; a mixed workload; chunked prefill saving decode tokens.
    "0.3.9.post2": ["issue1969", "issue1969_async", "mixed"],
    # Partial chunks saved (the differential's policy difference), chunked prefill.
    "0.4.2": ["big_chunks", "chunked_prefill", "mixed"],
}

# Each recorded both ways, in the run's one child per version (tests/_lmcache.py).
for _version, _names in LMCACHE_RUNS.items():
    need(__name__, _version, functools.partial(list, _names), ways=(True, False))


@pytest.mark.lmcache
@pytest.mark.vllm
@pytest.mark.slow
@vllm
@pytest.mark.parametrize("version", sorted(LMCACHE_RUNS))
def test_lmcache_recorded_both_ways_gets_the_same_verdicts(shared_dir: Path, version: str) -> None:
    """LMCache's real vLLM adapter wrapped in the recorder (digests sampled), each workload
    recorded with and without the steady-decode batching: the same facts, the same
    verdicts, including the ones that name #1969."""
    names = LMCACHE_RUNS[version]
    reports = runs(__name__, version, shared_dir)
    runs_by_way = {
        steady: {name: reports[f"{name}+recorded" + ("" if steady else "@False")] for name in names}
        for steady in (True, False)
    }
    for name in names:
        batched, full = (runs_by_way[s][name] for s in (True, False))
        assert batched.error == full.error
        assert steady_entries(batched.log_path) > 0 and steady_entries(full.log_path) == 0
        assert expanded(events_of(batched.log_path)) == events_of(full.log_path)
        for kw in ({}, {"differential": True}):
            assert verdicts(batched.log_path, **kw) == verdicts(full.log_path, **kw), name
    if version == "0.3.9.post2":  # #1969 is named from the batched log alone
        found = verdicts(runs_by_way[True]["issue1969"].log_path)
        assert [(p[1], p[2], p[3]) for p in found["problems"]] == [
            ("load_unchanged", 35, "req-1")
        ] * 2


# --- the writer, driven directly (vLLM's objects as the tests' stand-ins) -------------------


class _Sink:
    """A log that keeps the events, and can say it dropped a step (``lost_frames``)."""

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.lost_frames = 0

    def append(self, e: ev.Event) -> None:
        self.events.append(e)

    def end_step(self, step: int) -> None:
        pass


def _drive(
    steady: bool, *, legacy: bool, view: bool, lose_at: int = -1, back_at: int = -1
) -> list[ev.Event]:
    """Four requests admitted, then decode steps as vLLM schedules them: a block every 16
    tokens, request r1 not scheduled in step 5, r2 preempted in step 7 and resumed in step 9,
    (``lose_at``) the log dropping a step, and (``back_at``) vLLM scheduling r3 one token
    back, at a count one short of the log's (a token it computes again)."""
    from fakes import (
        CachedRequestData,
        FakeRequest,
        LegacyCachedRequestData,
        LegacySchedulerOutput,
        NewRequestData,
        SchedulerOutput,
    )

    from kvledger.connector.recording import SchedulerRecorder

    sink = _Sink()
    if view:  # the edge's reader of vLLM's list behind the view, as KVLedgerRecorder hands it in
        from kvledger.connector.edge import token_list

        rec = SchedulerRecorder(sink, steady=steady, token_list=token_list)
    else:
        rec = SchedulerRecorder(sink, steady=steady)
    requests = [FakeRequest(f"r{i}", list(range(10 + i, 40 + i))) for i in range(4)]
    if view:  # vLLM's own read-only view over the list it appends to
        from vllm.v1.utils import ConstantList

        for r in requests:
            r.all_token_ids = ConstantList(list(r.prompt_token_ids))  # type: ignore[assignment]
    tables = {r.request_id: [1 + 8 * i, 2 + 8 * i] for i, r in enumerate(requests)}
    computed = {}
    out_cls = LegacySchedulerOutput if legacy else SchedulerOutput
    cached_cls = LegacyCachedRequestData if legacy else CachedRequestData
    for r in requests:
        rec.see(r)
    new = [
        NewRequestData(r.request_id, r.prompt_token_ids, (tables[r.request_id],), 0)
        for r in requests
    ]
    rec.scheduled(
        out_cls(scheduled_new_reqs=new, num_scheduled_tokens={r.request_id: 30 for r in requests})
    )
    rec.end_step()
    computed = {r.request_id: 30 for r in requests}
    for step in range(1, 14):
        if step == lose_at:
            sink.lost_frames = 1
        cached = cached_cls()
        scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        for r in requests:
            rid = r.request_id
            ids = r.all_token_ids
            raw = ids._x if hasattr(ids, "_x") else ids
            raw.append(step % 7)  # vLLM appended the token it sampled
            if rid == "r1" and step == 5:
                continue
            if rid == "r2" and step in (7, 8):
                if step == 7:
                    preempted.add(rid)
                continue
            resumed = rid == "r2" and step == 9
            if rid == "r3" and step == back_at:
                computed[rid] -= 1
            nc = computed[rid]
            grow = None
            if resumed:
                nc, grow = 0, tables[rid] + [90]
                tables[rid] = grow
            elif nc + 1 > len(tables[rid]) * 16:
                grow = [100 + step]
                tables[rid].append(grow[0])
            ns = len(ids) - nc if resumed else 1
            cached.add(rid, nc, grow, resumed=resumed)
            scheduled[rid] = ns
            computed[rid] = nc + ns
        out = out_cls(scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled)
        if not legacy:
            out.preempted_req_ids = preempted
        rec.scheduled(out)
        rec.end_step()
    return sink.events


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("view", [False, True])
def test_the_writer_batches_and_expands_back_exactly(legacy: bool, view: bool) -> None:
    """The recorder's own choice, on both of vLLM's output shapes and both token views (a
    plain list: request by request; vLLM's ConstantList: the steady batch): the batched log
    expands to the full one, event for event."""
    if view:
        pytest.importorskip("vllm")
    batched = _drive(True, legacy=legacy, view=view)
    full = _drive(False, legacy=legacy, view=view)
    assert any(isinstance(e, ev.StepDecoded) for e in batched)
    assert not any(isinstance(e, ev.StepDecoded) for e in full)
    assert expanded(batched) == full


def test_after_the_log_drops_a_step_every_step_is_written_in_full() -> None:
    """A reader cannot resolve request numbers across a gap: from the step after the loss on,
    no StepDecoded."""
    events = _drive(True, legacy=False, view=False, lose_at=4)
    assert {e.step for e in events if isinstance(e, ev.StepDecoded)} == {1, 2, 3}
    assert expanded(events) == _drive(False, legacy=False, view=False)


@pytest.mark.parametrize("back_at", [3, 11])
def test_a_request_scheduled_at_another_count_than_the_logs_is_written_in_full(
    back_at: int,
) -> None:
    """The steady batch checks vLLM's count of every member against the log's: one request
    scheduled a token back is written as its Scheduled, not as an entry at the log's count
    (its token, at that count, is still in its list: only the count tells). In step 3 every
    request is a batch member; in step 11, r2 resumed two steps before."""
    pytest.importorskip("vllm")
    batched = _drive(True, legacy=False, view=True, back_at=back_at)
    full = _drive(False, legacy=False, view=True, back_at=back_at)
    assert expanded(batched) == full
    at = [e for e in batched if e.step == back_at]
    assert [e.req_id for e in at if isinstance(e, ev.Scheduled)] == ["r3"]
    assert any(isinstance(e, ev.StepDecoded) for e in at)


def test_the_tables_hold_the_steady_steps_tokens(tmp_path: Path) -> None:
    """``export`` and ``sql`` read a recorder's batched log with the token each steady step
    made known (``ev_step_decoded.token``), the ids its full twin holds in ``ev_scheduled``."""
    from kvledger.replay.tables import collect

    batched = write_recorded(tmp_path / "b.kvlog", _drive(True, legacy=False, view=True))
    full = write_recorded(tmp_path / "f.kvlog", _drive(False, legacy=False, view=True))
    steady = collect(batched, ["ev_step_decoded"], problems=False)[0]["ev_step_decoded"]
    assert steady and all(r["token"] is not None for r in steady)
    scheduled = collect(full, ["ev_scheduled"], problems=False)[0]["ev_scheduled"]
    by_step = {(r["step"], r["req_id"]): r["token_ids"] for r in scheduled}
    assert all(by_step[(r["step"], r["req_id"])] == [r["token"]] for r in steady)
