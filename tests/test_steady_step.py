"""The connector's and the recorder's steady decode step, where it takes shortcuts (issue 25):
each shortcut gives what the long way gives.

- ``Tracker._nums_of``: the request numbers of a list of ids equal to the step before's,
  under the same numbering, are taken again; any other list is looked up.
- ``SchedulerSide.metrics``: after steady steps only, vLLM's question is answered from one
  flag; every answer is what the counters and the pool say.
- ``SchedulerSide._plan``: a steady step's plan, built in one C call, is the plan.
- ``LogWriter.append_decoded``: the log holds what ``append(StepDecoded(...))`` writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _rigs import DECODING
from fakes import FakeBlocks, FakeRequest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector.logwriter import LogWriter
from kvledger.connector.messages import StepPlan, WorkerReport
from kvledger.connector.metrics import COUNTERS, Counters
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

# --- the request numbers of a step -----------------------------------------------------------

_IDS = st.sampled_from(["a", "b", "c", "d", "e"])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _IDS),
        st.tuples(st.just("finish"), _IDS),
        st.tuples(st.just("ask"), st.lists(_IDS, max_size=5)),
        st.tuples(st.just("again"), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS)
def test_the_numbers_of_a_step_are_those_of_its_ids(ops: list[tuple[str, Any]]) -> None:
    """Requests added and finished (an id may come back, and take another number), and lists
    of ids asked for, each a new list or the last one asked again: every answer is the ids'
    numbers now (-1: none)."""
    t = Tracker(TrackerConfig(block_size=4, chunk_size=8, num_slots=4))
    last: list[str] = []
    for op, arg in ops:
        if op == "add":
            t.add_request(arg, [1, 2, 3])
        elif op == "finish" and t.state(arg) is not None:
            t.finished(arg, "finished_stopped")
        elif op in ("ask", "again"):
            ids = list(arg) if op == "ask" else list(last)  # an equal list, a new object
            assert t._nums_of(ids) == tuple(t._num_of.get(r, -1) for r in ids)
            last = ids


def test_a_list_equal_to_the_last_under_other_numbers_is_looked_up() -> None:
    """The case the numbering's version is for: the same ids, "a" finished and back under
    another number in between."""
    t = Tracker(TrackerConfig(block_size=4, chunk_size=8, num_slots=4))
    for rid in ("a", "b"):
        t.add_request(rid, [1, 2, 3])
    assert t._nums_of(["a", "b"]) == (0, 1)
    t.finished("a", "finished_stopped")
    t.add_request("c", [1, 2, 3])  # takes 0
    t.add_request("a", [1, 2, 3])  # takes 2
    assert t._nums_of(["a", "b"]) == (2, 1)


# --- the plan of a steady step ---------------------------------------------------------------


@pytest.mark.parametrize("preempted", [(), ("x", "y")])
def test_a_steady_steps_plan_is_the_plan(preempted: tuple[str, ...]) -> None:
    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig(chunk_size=32), block_size=16, num_slots=4)
    plan = side._plan(7, [], preempted)
    assert type(plan) is StepPlan
    assert plan == StepPlan(7, preempted=preempted)
    assert plan._asdict() == StepPlan(7, preempted=preempted)._asdict()


# --- the metrics vLLM asks for after each step -----------------------------------------------


@pytest.mark.vllm
def test_after_steady_steps_the_metrics_are_what_the_counters_say(tmp_path: Path) -> None:
    """Under vLLM's real scheduler (loads, saves, preemptions, finishes, steady decode steps):
    every answer of ``metrics()`` is what an answer computed without the flag would be, and
    the flag answered most steps."""
    from kvledger.connector.scheduler import SchedulerSide
    from kvledger.connector.testing.harness import skip_reason

    if skip_reason() is not None:
        pytest.skip(str(skip_reason()))
    from kvledger.connector.testing.run import RunSpec, run

    real = SchedulerSide.metrics
    shadow = Counters()
    seen = {"asked": 0, "flag": 0, "sent": 0}

    def checked(self: SchedulerSide) -> dict[str, int] | None:
        c, t = self.counters, self.tracker
        for name in COUNTERS:
            setattr(shadow, name, getattr(c, name))
        shadow.violations = len(t.violations)
        shadow.adapter_errors = self.adapter_errors
        slots = self.tracker_config.num_slots
        want = shadow.since({"pool_used_slots": slots - t.index.free_slots, "pool_slots": slots})
        seen["flag"] += not self._moved
        got = real(self)
        seen["asked"] += 1
        seen["sent"] += got is not None
        assert got == want
        return got

    spec = RunSpec(**DECODING)
    SchedulerSide.metrics = checked  # type: ignore[method-assign]
    try:
        report = run(spec, log_dir=str(tmp_path))
    finally:
        SchedulerSide.metrics = real  # type: ignore[method-assign]
    assert report.preemptions > 0 and report.tokens_loaded > 0 and report.tokens_saved > 0
    assert seen["sent"] > 0
    assert seen["flag"] >= 0.5 * seen["asked"] > 0


_CALLBACKS: dict[str, Any] = {
    "on_new_request": lambda side, req: side.on_new_request(req),
    "get_num_new_matched_tokens": lambda side, req: side.get_num_new_matched_tokens(req, 0),
    "update_state_after_alloc": lambda side, req: side.update_state_after_alloc(
        req, FakeBlocks([1, 2]), 0
    ),
    "request_finished": lambda side, req: side.request_finished(req, [1, 2]),
    "apply_report": lambda side, req: side.apply_report(WorkerReport(rank=0)),
}


@pytest.mark.parametrize("callback", sorted(_CALLBACKS))
def test_every_callback_but_a_steady_steps_has_the_metrics_read(callback: str) -> None:
    """What the run above cannot show where its worker reports in the step that planned
    (the rig's): a report, or any other callback, in a step that is otherwise steady."""
    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig(chunk_size=32), block_size=16, num_slots=4)
    req = FakeRequest("r", list(range(40)))
    side.on_new_request(req)
    side.metrics()
    assert side.metrics() is None and not side._moved  # nothing since: the flag answers
    _CALLBACKS[callback](side, req)
    assert side._moved


# --- the log's record of a steady step -------------------------------------------------------


def _records(path: Path) -> list[tuple[int, list[ev.Event]]]:
    return [(f.step, list(f.events)) for f in LogReader(path)]


class _IntLike:
    """An integer that is not an int (numpy's and torch's are such): the log takes its value."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


@pytest.mark.parametrize("background", [False, True])
def test_append_decoded_writes_what_append_writes(tmp_path: Path, background: bool) -> None:
    steps: list[tuple[Any, ...]] = [
        ((0, 1, 2), (1, 40), ()),
        ([0, 1, 2], [], [5, 6, 7]),  # lists: copied when appended
        ((0, _IntLike(1)), (), ()),  # an integer-like: an int in the log
        ((0, "one"), (), ()),  # not an integer: the record is lost, and says so
    ]
    paths = []
    for how in ("append", "append_decoded"):
        path = tmp_path / f"{how}-{background}.kvlog"
        w = LogWriter(path, {"block_size": 16}, fsync="never", background=background)
        for step, (nums, blocks, tokens) in enumerate(steps):
            w.append(ev.RequestAdded(step, f"r{step}", (1, 2, 3)))
            if how == "append":
                w.append(ev.StepDecoded(step, "", tuple(nums), tuple(blocks), tuple(tokens)))
            else:
                w.append_decoded(step, nums, blocks, tokens)
                if isinstance(nums, list):
                    nums.append(99)  # after the append: the log must not see it
            w.end_step(step)
        w.close()
        paths.append(path)
    appended, decoded = (_records(p) for p in paths)
    assert decoded == appended
    kinds = [type(e).__name__ for _, events in decoded for e in events]
    assert kinds.count("StepDecoded") == 3 and kinds.count("RecordLost") == 1
    assert decoded[1][1][1] == ev.StepDecoded(1, "", (0, 1, 2), (), (5, 6, 7))
    assert decoded[2][1][1] == ev.StepDecoded(2, "", (0, 1))
