"""``explain`` adds up on histories nobody wrote by hand: the hypothesis state machine of
``test_stateful.py`` (a Tracker driven as vLLM's scheduler drives it, with prefix caching,
async scheduling, preemption, failed loads and saves, chunks leaving the pool, Model Runner V1
and V2) records its log, and every admission of it is explained.

What must hold for every admission: the tokens hit plus the tokens missed are the tokens asked;
the missed spans are disjoint, in order, inside the tokens asked, and sum to the tokens
missed; every missed token has a reason the tracker's rules derived (none ``unexplained``:
these histories are well-formed); the admissions are the ones the fold counts (one per
``Scheduled`` admission with a lookup before it).
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_replay_fuzz import _EVENTS as _HOSTILE
from test_replay_fuzz import _fields as _fuzz_fields
from test_stateful import _CONFIG, _SETTINGS, VLLMModel

from kvledger.replay.explain import REASONS, AdmissionMisses, Explainer
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.history import walk
from kvledger.tracker.tracker import Tracker


class _Frame:
    __slots__ = ("events", "step", "wall_ns")

    def __init__(self, step: int, events: list[ev.Event]) -> None:
        self.step = step
        self.wall_ns = step * 1000
        self.events = tuple(events)


class _Frames:
    """A log sink that keeps the frames in memory."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.pending: list[ev.Event] = []

    def append(self, event: ev.Event) -> None:
        self.pending.append(event)

    def end_step(self, step: int) -> None:
        self.frames.append(_Frame(step, self.pending))
        self.pending = []


def check_admission(a: AdmissionMisses) -> None:
    """The rules every explained admission keeps (the module docstring)."""
    assert a.tokens_hit + a.missed_tokens == a.asked, a
    assert all(v >= 0 for v in a.hit.values()), a
    assert a.hit["last_token"] in (0, 1)
    assert sum(a.reasons().values()) == a.missed_tokens
    at = None
    for m in a.misses:
        assert m.reason in REASONS, m
        assert 0 <= m.start < m.end <= a.asked, (a, m)
        if at is not None:
            assert m.start == at, f"missed spans overlap or leave a gap: {a.misses}"
        at = m.end
    if a.misses:
        # Missed: one run of tokens after the ones served, up to the last (or the one before
        # it, recomputed by rule).
        assert a.misses[-1].end == a.asked - a.hit["last_token"], a
        served = a.hit["local"] + a.hit["pool"] + a.hit["remote"] + a.hit["inner"]
        assert a.misses[0].start == served, a


class ExplainedHistories(VLLMModel):
    """The state machine of test_stateful, its log explained at the end."""

    @initialize(**_CONFIG)
    def init(self, **config: Any) -> None:
        self.setup(**config)
        self.sink = _Frames()
        self.t = Tracker(self.cfg, log=self.sink)

    def teardown(self) -> None:
        if not hasattr(self, "t"):
            return
        super().teardown()
        self.t.end_step()
        explained: list[AdmissionMisses] = []
        explainer = Explainer(self.cfg, explained.append)
        admissions = 0
        for item in walk(self.sink.frames, self.cfg):
            explainer.feed(item)
            e = item.event
            if (
                isinstance(e, ev.Scheduled)
                and e.admission is not ev.Admission.RUNNING
                and item.before is not None
                and item.before.lookup is not None
                and item.after is not None
            ):
                admissions += 1
        explainer.finish()
        assert len(explained) == admissions
        for a in explained:
            check_admission(a)
            for m in a.misses:
                event(f"missed: {m.reason}")
            if a.hit["last_token"]:
                event("hit: last token, by rule")
            unexplained = [m for m in a.misses if m.reason == "unexplained"]
            assert not unexplained, (a, unexplained)


class ExplainedFailures(ExplainedHistories):
    """Failed loads and saves three times as often, a pool small enough to evict (as
    test_stateful's LoadFailures)."""

    fail_one_in = 2

    @initialize(
        **{
            **_CONFIG,
            "num_slots": st.sampled_from([2, 4, 8]),
            "async_sched": st.just(False),
            "failures": st.just(True),
        }
    )
    def init(self, **config: Any) -> None:
        self.setup(**config)
        self.sink = _Frames()
        self.t = Tracker(self.cfg, log=self.sink)


ExplainedHistories.TestCase.settings = settings(max_examples=150, **_SETTINGS)
ExplainedFailures.TestCase.settings = settings(max_examples=80, **_SETTINGS)
TestExplainedHistories = ExplainedHistories.TestCase
TestExplainedFailures = ExplainedFailures.TestCase


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_HOSTILE, max_size=8), max_size=12))
def test_hostile_histories_are_explained_without_a_raise(steps: list[list[ev.Event]]) -> None:
    """Valid frames holding any events with hostile values (test_replay_fuzz's): explain never
    raises, and every admission it explains still adds up."""
    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=8)
    frames = [
        _Frame(step, [type(e)(step, *_fuzz_fields(e)) for e in events])
        for step, events in enumerate(steps)
    ]
    explained: list[AdmissionMisses] = []
    explainer = Explainer(config, explained.append)
    for item in walk(frames, config):
        explainer.feed(item)
    explainer.finish()
    for a in explained:
        check_admission(a)
