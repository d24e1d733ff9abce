"""A replay checks steady decode steps as a batch (``tracker.tracker._Decoding``): the same
decisions, violations and states as checking each request on its own (``steady_decode``), on
a decode-heavy log (requests joining and leaving the batch, blocks appended, preemptions,
re-admissions) and on the same log with its ``StepDecoded`` records damaged at random."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.history import walk
from kvledger.tracker.tracker import Tracker, _Decoding

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import replay_bench
from _rigs import DECODING
from replay_bench import write_log  # the bench's decode-heavy workload


@contextmanager
def request_by_request() -> Iterator[None]:
    """Every StepDecoded checked request by request (the batch never applies)."""
    step = _Decoding.step
    _Decoding.step = lambda self, t, event: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Decoding.step = step  # type: ignore[method-assign]


@contextmanager
def bench_config(name: str) -> Iterator[None]:
    """The bench's workload as it is (``prompts-saved``), or with chunks of 32 tokens and
    decode chunks saved too (``decode-saved``), so that a steady step's other bound
    (``steady_limit``: a save may be due) binds every 32 steps of each request."""
    make = replay_bench.TrackerConfig
    if name == "decode-saved":
        replay_bench.TrackerConfig = lambda **kw: make(  # type: ignore[assignment,misc]
            **{**kw, "chunk_size": 32, "save_decode_cache": True}
        )
    try:
        yield
    finally:
        replay_bench.TrackerConfig = make  # type: ignore[misc]


@pytest.fixture(scope="module", params=["prompts-saved", "decode-saved"])
def history(request: Any, tmp_path_factory: Any) -> History:
    """24 live requests, 8 slots: joins, leaves, evictions, a preemption every 97 steps.
    ``decode-saved``: chunks of 32 tokens, decode chunks saved too, so that a steady step's
    other bound (``steady_limit``: a save may be due) binds every 32 steps of each request."""
    path = tmp_path_factory.mktemp("decode-batch") / "run.kvlog"
    with bench_config(request.param):
        write_log(path, 20_000, 24, 8)
    reader = LogReader(path)
    frames = [[e for e in f.events if isinstance(e, ev.InputEvent)] for f in reader]
    config = TrackerConfig(**{k: v for k, v in reader.header["config"].items() if k in _FIELDS})
    return History(config, frames)


class History(NamedTuple):
    """The fixture's log, by frame; its repr is short (hypothesis prints it on a failure)."""

    config: TrackerConfig
    frames: list[list[ev.Event]]

    def __repr__(self) -> str:
        return f"History({len(self.frames)} frames, chunk_size={self.config.chunk_size})"


_FIELDS = {f.name for f in attrs.fields(TrackerConfig)}


def replay(config: TrackerConfig, frames: Sequence[Sequence[ev.Event]]) -> list[Any]:
    """Every event's decisions, and after each frame the live states and the violations."""
    t = Tracker(config)
    out: list[Any] = []
    for frame in frames:
        for e in frame:
            out.append(t.apply(e))
        out.append(sorted(t.states.items()))
        out.append(list(t.violations))
    return out


def test_the_batch_decides_as_each_request_would(history: Any) -> None:
    config, frames = history
    decoded = sum(len(e.nums) for f in frames for e in f if isinstance(e, ev.StepDecoded))
    assert decoded > 10_000  # the log is mostly steady decode steps
    batched = replay(config, frames)
    with request_by_request():
        one_by_one = replay(config, frames)
    assert batched == one_by_one


def test_the_batch_applies_to_most_steps(history: Any) -> None:
    """Not vacuous: the batch is what checks most steady steps of a valid log."""
    config, frames = history
    calls = {"batch": 0, "applied": 0}
    step = _Decoding.step

    def counted(self: _Decoding, t: Tracker, event: ev.StepDecoded) -> bool:
        calls["batch"] += 1
        applied = step(self, t, event)
        calls["applied"] += applied
        return applied

    _Decoding.step = counted  # type: ignore[method-assign]
    try:
        t = Tracker(config)
        for frame in frames:
            for e in frame:
                t.apply(e)
    finally:
        _Decoding.step = step  # type: ignore[method-assign]
    assert t.violations == []
    assert calls["applied"] >= 0.95 * calls["batch"] > 0


# One way to damage a StepDecoded record: what the fold must judge the same either way.
# The last five break a rule of tracker.wellformed that the batch must refuse on its own (it
# proves the numbers' rules itself, and checks the rest with ``sound_but_nums``).
_DAMAGE = st.sampled_from(
    [
        *("drop_num", "unknown_num", "twice", "skip", "block", "bad_blocks", "early", "late"),
        *("num_repeated", "num_negative", "block_negative", "req_id", "tokens"),
    ]
)


def _damaged(e: ev.StepDecoded, how: str, other: int) -> list[ev.Event]:
    nums = e.nums
    if how == "drop_num" and nums:
        return [attrs.evolve(e, nums=nums[1:], blocks=_kept(e.blocks, nums[1:]))]
    if how == "unknown_num":
        return [attrs.evolve(e, nums=(*nums, 10_000 + other))]
    if how == "twice":
        return [e, e]  # the same step twice: a request one token ahead of vLLM's count
    if how == "skip":
        return []
    if how == "block" and nums:
        return [attrs.evolve(e, blocks=(*e.blocks, nums[-1], 900_000 + other))]
    if how == "bad_blocks":
        return [attrs.evolve(e, blocks=(*e.blocks, 5))]  # an odd number of ints
    if how == "early" and nums:
        return [attrs.evolve(e, nums=(nums[0],)), e]
    if how == "late" and nums:
        return [e, attrs.evolve(e, nums=nums[-1:], blocks=())]
    if how == "num_repeated" and nums:
        return [attrs.evolve(e, nums=(*nums, nums[other % len(nums)]))]
    if how == "num_negative":
        return [attrs.evolve(e, nums=(*nums, -1 - other))]
    if how == "block_negative" and nums:
        return [attrs.evolve(e, blocks=(*_kept(e.blocks, nums[1:]), nums[0], -1 - other))]
    if how == "req_id":
        return [attrs.evolve(e, req_id=f"req-{other}")]
    if how == "tokens" and nums:
        return [attrs.evolve(e, tokens=tuple(range(len(nums) + 1)))]
    return [e]


def _kept(blocks: tuple[int, ...], nums: tuple[int, ...]) -> tuple[int, ...]:
    keep = set(nums)
    pairs = [(blocks[i], blocks[i + 1]) for i in range(0, len(blocks) - 1, 2)]
    return tuple(x for n, b in pairs if n in keep for x in (n, b))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), _DAMAGE, st.integers(0, 99)), max_size=6))
def test_damaged_steps_are_judged_the_same(history: Any, damage: list[Any]) -> None:
    config, frames = history
    frames = [list(f) for f in frames[:400]]  # keep each example quick
    steady = [i for i, f in enumerate(frames) if any(isinstance(e, ev.StepDecoded) for e in f)]
    for pick, how, other in damage:
        frame = frames[steady[pick % len(steady)]]
        j = next((j for j, e in enumerate(frame) if isinstance(e, ev.StepDecoded)), None)
        e = frame[j] if j is not None else None
        if isinstance(e, ev.StepDecoded):  # (a step skipped by an earlier damage: none)
            frame[j : j + 1] = _damaged(e, how, other)
    batched = replay(config, frames)
    with request_by_request():
        one_by_one = replay(config, frames)
    assert batched == one_by_one


def test_a_number_given_back_and_taken_in_one_step() -> None:
    """b finishes and c takes its number in the same step, admitted at once: the next step
    names the same numbers as the last one, and c is a new request in the batch. (Prompts
    shorter than a block: no save is ever due, every decode step is steady.)"""
    config = TrackerConfig(block_size=4, chunk_size=8, num_slots=4)

    def run() -> list[Any]:
        t = Tracker(config)
        out: list[Any] = []
        blocks = iter(range(1, 1000))

        def admit(rid: str, prompt: list[int]) -> None:
            t.add_request(rid, prompt)
            t.lookup(rid, 0, prompt)
            table = [next(blocks), next(blocks)]
            t.allocated(rid, table, 0)
            new = ev.Admission.NEW
            out.append(t.scheduled(rid, num_computed=0, num_scheduled=len(prompt),
                                   all_token_ids=prompt, block_ids=table, admission=new))  # fmt: skip

        admit("a", [1, 2, 3])
        admit("b", [1, 2, 3])
        t.end_step()
        for _ in range(2):
            out.append(t.apply(ev.StepDecoded(t.step, "", (0, 1))))
            t.end_step()
        out.append(t.apply(ev.Finished(t.step, "b")))
        admit("c", [7, 8, 9])
        [entry] = t.entries_of(ev.StepDecoded(t.step, "", (1,)))[0]
        assert entry.req_id == "c"
        t.end_step()
        out.append(t.apply(ev.StepDecoded(t.step, "", (0, 1))))  # a, and now c
        out.append(t.apply(ev.StepDecoded(t.step + 1, "", (0, 1), (0, next(blocks)))))
        out.append(sorted(t.states.items()))
        out.append(list(t.violations))
        return out

    batched = run()
    with request_by_request():
        one_by_one = run()
    assert batched == one_by_one
    assert batched[-1] == []


# --- the connector's batch (Tracker.decode_batch): the log decode_step_ok would write ----------


def _written(tmp: Any, *, batch: bool, config: str, **kw: Any) -> list[tuple[int, ev.Event]]:
    """The events of the bench's workload as the connector's hot path writes them: request by
    request (``decode_step_ok``) or as a batch."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{config}-{'batch' if batch else 'each'}.kvlog"
    with bench_config(config):
        write_log(path, batch=batch, **kw)
    return [(f.step, e) for f in LogReader(path) for e in f.events]


@pytest.mark.parametrize("config", ["prompts-saved", "decode-saved"])
@pytest.mark.parametrize("jitter", [0.0, 0.01])
def test_the_connectors_batch_writes_what_each_request_would(
    tmp_path: Any, config: str, jitter: float
) -> None:
    """24 and then 64 live requests on 8 and 16 slots: joins, leaves, blocks appended, saves
    due (``decode-saved``: every 32 tokens of each request), a preemption every 97 steps;
    ``jitter``: one step in a hundred reported one token ahead, which the hot path refuses
    and the full path names. The same events, in the same order, either way."""
    for live, slots in ((24, 8), (64, 16)):
        kw = {"target": 20_000, "live": live, "num_slots": slots, "jitter": jitter}
        each = _written(tmp_path / f"{live}", batch=False, config=config, **kw)
        batch = _written(tmp_path / f"{live}", batch=True, config=config, **kw)
        steady = sum(len(e.nums) for _, e in batch if isinstance(e, ev.StepDecoded))
        assert steady > 10_000
        if jitter:
            assert any(isinstance(e, ev.ViolationRecorded) for _, e in batch)
        assert batch == each


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), jitter=st.sampled_from([0.0, 0.05, 0.5]))
def test_the_connectors_batch_on_any_workload(
    tmp_path_factory: pytest.TempPathFactory, seed: int, jitter: float
) -> None:
    d = tmp_path_factory.mktemp("batch")
    kw = {"target": 3_000, "live": 12, "num_slots": 4, "seed": seed, "jitter": jitter}
    assert _written(d, batch=True, config="decode-saved", **kw) == _written(
        d, batch=False, config="decode-saved", **kw
    )


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_under_vllms_scheduler_the_batch_writes_the_same_log(
    tmp_path: Any, async_scheduling: bool
) -> None:
    """KVLedgerConnector under vLLM's real scheduler, the KV-content oracle checking every
    computed token: 8 requests decoding up to 120 tokens on a pool that preempts, twice,
    once with the connector's batch and once request by request. Both runs are right, their
    logs hold the same events, and the batch carried most steady steps."""
    from kvledger.connector.scheduler import SchedulerSide
    from kvledger.connector.testing.harness import skip_reason

    if skip_reason() is not None:
        pytest.skip(str(skip_reason()))
    from kvledger.connector.testing.run import RunSpec, run

    spec = RunSpec(**DECODING, async_scheduling=async_scheduling)
    batch = SchedulerSide._steady_batch
    taken = {"steady": 0}

    def counted(self: Any, *args: Any) -> Any:
        out = batch(self, *args)
        if out is not None:
            taken["steady"] += len(out[1])
        return out

    logs = []
    for name, patched in (("batch", counted), ("each", lambda self, *a: None)):
        SchedulerSide._steady_batch = patched  # type: ignore[method-assign]
        try:
            report = run(spec, log_dir=str(tmp_path / name))
        finally:
            SchedulerSide._steady_batch = batch  # type: ignore[method-assign]
        assert [m.describe() for m in report.mismatches] == [] and report.violations == ()
        assert report.finished == report.requests and report.preemptions > 0
        assert report.log_path is not None
        logs.append([(f.step, e) for f in LogReader(report.log_path) for e in f.events])
    steady = sum(len(e.nums) for _, e in logs[1] if isinstance(e, ev.StepDecoded))
    assert logs[0] == logs[1]
    assert taken["steady"] >= 0.8 * steady > 0


def _walked(config: TrackerConfig, frames: Sequence[Sequence[ev.Event]]) -> dict[str, Any]:
    """Each request's last state as ``history.walk`` folds it (``explain``'s and ``show``'s
    reading), as (num_tokens, block ids)."""
    last: dict[str, Any] = {}
    for item in walk([_Frame(tuple(f)) for f in frames], config):
        if item.after is not None:
            last[item.req_id] = (item.after.num_tokens, tuple(item.after.block_ids))
    return last


@attrs.frozen
class _Frame:
    events: tuple[ev.Event, ...] = ()


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**6),
            st.sampled_from(["drop_num", "unknown_num", "block", "bad_blocks"]),
            st.integers(0, 99),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_walk_and_the_replay_read_damaged_steps_alike(history: Any, damage: Any) -> None:
    """A damaged steady step, read by the replay (``Tracker``) and by the walk behind
    ``explain`` and ``show``: both resolve its entries through ``tracker.decoded``, so each
    request ends with the same count and block table. (Damage that only the replay's bounds
    judge, a step taken twice or early, is left out: the walk follows the recording Tracker,
    which validated nothing; a request whose table a dropped block left short is stopped by the
    replay's bounds and advanced by the walk.)"""
    config, frames = history
    frames = [list(f) for f in frames[:200]]
    steady = [i for i, f in enumerate(frames) if any(isinstance(e, ev.StepDecoded) for e in f)]
    for pick, how, other in damage:
        frame = frames[steady[pick % len(steady)]]
        j = next(j for j, e in enumerate(frame) if isinstance(e, ev.StepDecoded))
        frame[j : j + 1] = _damaged(frame[j], how, other)
    t = Tracker(config)
    for frame in frames:
        for e in frame:
            t.apply(e)
    # A request the replay's bounds stopped (a dropped block leaves its table short) is
    # advanced by the walk regardless: compared are the others, most of them.
    stopped = {v.req_id for v in t.violations if v.rule == "decoded_not_steady"}
    replayed = {
        r: (s.num_tokens, tuple(s.block_ids)) for r, s in t.states.items() if r not in stopped
    }
    walked = _walked(config, frames)
    assert {r: walked[r] for r in replayed} == replayed
