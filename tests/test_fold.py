"""tracker.state: the fold, one test per rule of its docstring, and its totality: any event in
any order, with any field values, gives a state or violations, and never raises."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.tracker import events as ev
from kvledger.tracker import state as state_module
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.seq import Seq
from kvledger.tracker.state import (
    LoadProgress,
    LookupResult,
    Phase,
    RequestState,
    SaveProgress,
    fold,
    new_state,
)
from kvledger.tracker.tracker import Tracker
from kvledger.tracker.violation import Violation

CFG = TrackerConfig(block_size=4, chunk_size=8)
NEW, RESUMED, RUNNING = ev.Admission.NEW, ev.Admission.RESUMED, ev.Admission.RUNNING


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def run(
    events: Sequence[ev.Event], state: RequestState | None = None, cfg: TrackerConfig = CFG
) -> tuple[RequestState | None, list[Violation]]:
    vs: list[Violation] = []
    for e in events:
        state, more = fold(state, e, cfg)
        vs.extend(more)
    return state, vs


def admitted(
    prompt: Sequence[int] = tuple(tokens(20)), blocks: Sequence[int] = (1, 2, 3, 4, 5)
) -> RequestState:
    """A new request, looked up (no hit), allocated and scheduled for its whole prompt."""
    n = len(prompt)
    s, vs = run(
        [
            ev.RequestAdded(0, "r", prompt),
            ev.LookupAsked(0, "r", 0, n),
            ev.LookupAnswered(0, "r", 0, 0),
            ev.Allocated(0, "r", blocks, 0),
            ev.Scheduled(0, "r", 0, n, 0, (), blocks, NEW),
        ]
    )
    assert vs == [] and s is not None
    return s


def rules(vs: Sequence[Violation]) -> list[str]:
    return [v.rule for v in vs]


# --- request lifecycle -----------------------------------------------------------------------


def test_new_state() -> None:
    s = new_state("r", tokens(20), CFG, cache_salt="tenant")
    assert s.phase is Phase.WAITING
    assert s.prompt_len == 20 and s.token_ids == tokens(20) and s.prefill_end == 20
    assert len(s.keys) == 2  # the full chunks of the prompt
    assert (s.num_tokens, s.num_computed, len(s.block_ids)) == (0, 0, 0)
    assert s.root != new_state("r", tokens(20), CFG).root  # the cache salt is in the chain
    assert s.keys[0] != new_state("r", tokens(20), CFG).keys[0]
    assert s.saved == 0 and not s.recompute_only and s.life.num_preemptions == 0


def test_request_added_twice_is_one_fact() -> None:
    s, vs = run([ev.RequestAdded(0, "r", tokens(10)), ev.RequestAdded(1, "r", tokens(10))])
    assert vs == [] and s == new_state("r", tokens(10), CFG)
    s, vs = run([ev.RequestAdded(2, "r", tokens(9))], s)
    assert rules(vs) == ["duplicate_request"]
    assert s is not None and s.recompute_only and s.token_ids == tokens(10)


def test_an_id_reused_after_finish_is_a_fresh_life() -> None:
    s = admitted()
    s, _ = run([ev.Preempted(1, "r"), ev.Finished(2, "r")], s)
    s, vs = run([ev.RequestAdded(3, "r", tokens(5, base=7))], s)
    assert vs == []
    assert s == new_state("r", tokens(5, base=7), CFG)


def test_unknown_request_and_unknown_event_types() -> None:
    assert fold(None, ev.LookupAsked(0, "x", 0, 3), CFG) == (
        None,
        (Violation("unknown_request", 0, "x", "LookupAsked"),),
    )
    s = admitted()
    for e in (ev.ChunkStored(0, "r", b"k", 0, 8), ev.ChunkEvicted(0, "r", b"k"), ev.Event(0, "r")):
        assert fold(s, e, CFG) == (s, ())


def test_violation_recorded_makes_the_request_recompute_only() -> None:
    s, vs = run([ev.ViolationRecorded(1, "r", "adapter_error", "Scheduled")], admitted())
    assert vs == [] and s is not None and s.recompute_only


# --- lookups -------------------------------------------------------------------------------------


def test_lookup_learns_tokens_and_records_the_question() -> None:
    s, vs = run([ev.RequestAdded(0, "r", tokens(10)), ev.LookupAsked(0, "r", 4, 13, 10, (1, 2, 3))])
    assert vs == [] and s is not None
    assert s.token_ids == [*tokens(10), 1, 2, 3]
    assert s.lookup == LookupResult(4, 0, 0, 13)
    s, _ = run([ev.LookupAnswered(0, "r", 8, 4)], s)
    assert s is not None and s.lookup == LookupResult(4, 8, 4, 13)
    again, _ = run([ev.LookupAnswered(0, "r", 8, 4)], s)
    assert again == s  # idempotent


def test_lookup_with_fewer_known_tokens_than_asked() -> None:
    _, vs = run([ev.RequestAdded(0, "r", tokens(10)), ev.LookupAsked(0, "r", 0, 12)])
    assert rules(vs) == ["lookup_tokens_known"]


def test_lookup_of_a_running_request_infers_its_preemption() -> None:
    """vLLM < 0.12 has no preempted_req_ids: a running request asked again was preempted."""
    s, vs = run([ev.LookupAsked(5, "r", 0, 20)], admitted())
    assert vs == [] and s is not None
    assert s.phase is Phase.PREEMPTED and s.life.num_preemptions == 1
    assert len(s.block_ids) == 0 and s.num_tokens == 0


# --- allocation ------------------------------------------------------------------------------------


def test_allocated_must_accept_what_we_offered() -> None:
    base = [ev.RequestAdded(0, "r", tokens(20)), ev.LookupAsked(0, "r", 0, 20)]
    s, vs = run([*base, ev.LookupAnswered(0, "r", 16, 16), ev.Allocated(0, "r", (1, 2), 16)])
    assert vs == [] and s is not None
    assert (s.accepted, s.allocated, s.block_ids) == (16, True, [1, 2])
    _, vs = run([*base, ev.LookupAnswered(0, "r", 16, 16), ev.Allocated(0, "r", (1,), 8)])
    assert rules(vs) == ["accepted_equals_answer"]
    assert vs[0].detail == {"accepted": 8, "answered": 16}
    _, vs = run([ev.RequestAdded(0, "r", tokens(20)), ev.Allocated(0, "r", (1,), 3)])
    assert rules(vs) == ["accepted_equals_answer"]  # nothing was ever offered


def test_second_allocation_after_an_async_load_replaces_the_table_only() -> None:
    s, vs = run(
        [
            ev.RequestAdded(0, "r", tokens(20)),
            ev.LookupAsked(0, "r", 0, 20),
            ev.LookupAnswered(0, "r", 16, 16),
            ev.Allocated(0, "r", (1, 2, 3, 4), 16),
            ev.Allocated(3, "r", (1, 2, 3, 4, 5), 0),
        ]
    )
    assert vs == [] and s is not None
    assert s.accepted == 16 and s.block_ids == [1, 2, 3, 4, 5]


# --- scheduling ------------------------------------------------------------------------------------


def test_admission_sets_the_counts() -> None:
    s = admitted()
    assert s.phase is Phase.RUNNING
    assert (s.num_computed, s.num_tokens, s.prefill_end) == (0, 20, 20)
    assert s.block_ids == [1, 2, 3, 4, 5]
    assert (s.life.first_local_hit, s.life.first_external) == (0, 0)


def test_admission_replaces_the_table_and_rebuilds_tokens() -> None:
    """#1969 / #2007 / I5: on admission the table is replaced, never extended, and every token
    vLLM has is learned (prompt and outputs)."""
    s = admitted()
    s, vs = run(
        [
            ev.Scheduled(1, "r", 20, 1, 20, (7,), (6,)),
            ev.Preempted(2, "r"),
            ev.LookupAsked(3, "r", 8, 22, 21, (8,)),
            ev.LookupAnswered(3, "r", 0, 0),
            ev.Allocated(3, "r", (9, 3, 4), 0),
            ev.Scheduled(3, "r", 8, 14, 22, (), (9, 3, 4, 10, 11, 12), RESUMED),
        ],
        s,
    )
    assert vs == [] and s is not None
    assert s.block_ids == [9, 3, 4, 10, 11, 12]
    assert s.token_ids == [*tokens(20), 7, 8]
    assert (s.num_computed, s.num_tokens, s.prefill_end) == (8, 22, 22)
    assert s.life.num_preemptions == 1
    assert (s.life.first_local_hit, s.life.first_external) == (0, 0)  # the first admission's
    assert s.lookup == LookupResult(8, 0, 0, 22)


def test_readmission_without_a_preemption_signal_is_inferred() -> None:
    """Model Runner V2: a preempted request comes back as NEW with its full table."""
    s, vs = run([ev.Scheduled(4, "r", 0, 20, 20, (), (7, 8, 9, 10, 11), NEW)], admitted())
    assert vs == [] and s is not None
    assert s.life.num_preemptions == 1 and s.block_ids == [7, 8, 9, 10, 11]


def test_admission_must_match_the_lookup() -> None:
    """I4: nc == local hit + accepted external tokens."""
    _, vs = run(
        [
            ev.RequestAdded(0, "r", tokens(20)),
            ev.LookupAsked(0, "r", 8, 20),
            ev.LookupAnswered(0, "r", 16, 8),
            ev.Allocated(0, "r", (1, 2, 3, 4, 5), 8),
            ev.Scheduled(0, "r", 12, 8, 20, (), (1, 2, 3, 4, 5), NEW),
        ]
    )
    assert rules(vs) == ["admission_matches_lookup"]
    assert vs[0].detail == {"num_computed": 12, "local_hit": 8, "accepted": 8}


def test_admission_resets_the_save_cursor_but_keeps_pending_saves() -> None:
    s = admitted()._replace(save=SaveProgress(16, ((b"k", 8),)))
    s, _ = run([ev.Preempted(1, "r")], s)
    assert s is not None and s.save == SaveProgress(0, ((b"k", 8),))
    s, _ = run([ev.Scheduled(2, "r", 0, 20, 20, (), (1, 2, 3, 4, 5), RESUMED)], s)
    assert s is not None and s.save == SaveProgress(0, ((b"k", 8),))


def test_running_step_appends_blocks_and_learns_the_tail() -> None:
    s, vs = run([ev.Scheduled(1, "r", 20, 1, 20, (5,), (6,))], admitted())
    assert vs == [] and s is not None
    assert s.block_ids == [1, 2, 3, 4, 5, 6]
    assert s.token_ids == [*tokens(20), 5]
    assert (s.num_computed, s.num_tokens) == (20, 21)
    assert len(s.keys) == 2  # 21 tokens: still two full chunks
    s, _ = run([ev.Scheduled(2, "r", 21, 3, 21, (6, 7, 8))], s)
    assert s is not None and len(s.keys) == 3 and s.num_tokens == 24


def test_async_step_with_nothing_new_to_learn() -> None:
    s, vs = run([ev.Scheduled(1, "r", 20, 1)], admitted())
    assert vs == [] and s is not None
    assert s.num_tokens == 21 and len(s.token_ids) == 20


def test_rollback_when_vllm_is_behind() -> None:
    """#2516: vLLM recomputes from its (smaller) count; the tracker truncates to it and the
    save cursor falls back to the chunk holding it."""
    s = admitted(tokens(40), tuple(range(1, 11)))._replace(save=SaveProgress(32, ()))
    s, vs = run([ev.Scheduled(1, "r", 20, 20)], s)
    assert vs == [] and s is not None
    assert (s.num_computed, s.num_tokens) == (20, 40)
    assert s.save.cursor == 16
    assert s.token_ids == tokens(40)  # tokens are facts: they stay


def test_vllm_ahead_of_the_tracker_is_a_violation() -> None:
    _, vs = run([ev.Scheduled(1, "r", 22, 1)], admitted())
    assert rules(vs) == ["tokens_match_schedule"]


def test_running_step_of_a_waiting_request_is_a_violation() -> None:
    s, _ = run([ev.RequestAdded(0, "r", tokens(4))])
    s, vs = run([ev.Scheduled(0, "r", 0, 4)], s)
    assert rules(vs) == ["scheduled_while_not_running"]
    assert s is not None and s.recompute_only


def test_token_content_and_gaps() -> None:
    s = admitted()
    _, vs = run([ev.Scheduled(1, "r", 20, 1, 19, (0, 5))], s)
    assert rules(vs) == ["token_content_matches"]
    assert vs[0].detail == {"position": 19, "known": 119, "got": 0}
    s2, vs = run([ev.Scheduled(1, "r", 20, 1, 19, (119, 5))], s)
    assert vs == [] and s2 is not None and len(s2.token_ids) == 21  # the overlap agrees
    _, vs = run([ev.Scheduled(1, "r", 20, 1, 21, (5,))], s)
    assert rules(vs) == ["token_gap"]


# --- preemption and finish -------------------------------------------------------------------------


def test_preemption_resets_the_admission_and_keeps_the_life() -> None:
    s = admitted()._replace(
        lookup=LookupResult(0, 8, 8, 20), accepted=8, load=LoadProgress(0, 8, (b"k",), True)
    )
    s, vs = run([ev.Preempted(1, "r")], s)
    assert vs == [] and s is not None
    assert s.phase is Phase.PREEMPTED
    assert (s.num_tokens, s.num_computed, len(s.block_ids)) == (0, 0, 0)
    assert (s.lookup, s.accepted, s.allocated, s.load) == (None, 0, False, None)
    assert s.life.num_preemptions == 1 and s.token_ids == tokens(20)
    again, vs = run([ev.Preempted(2, "r")], s)
    assert vs == [] and again == s  # signalled, then inferred: one fact


def test_preempting_a_waiting_request_is_a_violation() -> None:
    _, vs = run([ev.RequestAdded(0, "r", tokens(4)), ev.Preempted(0, "r")])
    assert rules(vs) == ["preempted_while_not_running"]


def test_finished_and_what_may_follow() -> None:
    s = admitted()._replace(save=SaveProgress(16, ((b"a", 0), (b"b", 8))))
    s, vs = run([ev.Finished(1, "r", "length")], s)
    assert vs == [] and s is not None
    assert s.phase is Phase.FINISHED and s.life.finish_reason == "length" and s.lookup is None
    for e in (ev.Scheduled(2, "r", 20, 1), ev.LookupAsked(2, "r", 0, 20), ev.Preempted(2, "r")):
        after, vs = fold(s, e, CFG)
        assert after == s and rules(vs) == ["event_after_finish"]
    _, vs = fold(s, ev.Finished(2, "r"), CFG)
    assert rules(vs) == ["finished_twice"]
    s, vs = run([ev.SaveDone(2, "r", (b"a",)), ev.SaveFailed(2, "r", (b"b",))], s)
    assert vs == [] and s is not None and s.save == SaveProgress(16, ())


# --- loads ---------------------------------------------------------------------------------------


def test_load_planned_and_done() -> None:
    s = admitted()
    s, vs = run([ev.LoadPlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1))], s)
    assert vs == [] and s is not None
    assert s.load == LoadProgress(0, 16, (b"a", b"b"), False) and s.life.tokens_loaded == 16
    s, vs = run([ev.LoadDone(1, "r")], s)
    assert vs == [] and s is not None and s.load is not None and s.load.done
    refused, _ = run([ev.LoadPlanned(0, "r", 8, 8, refused_blocks=(3,))], admitted())
    assert refused is not None and refused.load is None


def test_load_failed_rolls_back_to_the_first_failed_block() -> None:
    s = admitted(tokens(40), tuple(range(1, 11)))
    s = s._replace(save=SaveProgress(32, ((b"x", 24),)))
    s, _ = run([ev.LoadPlanned(0, "r", 0, 24, (b"a", b"b", b"c"), (0, 1, 2))], s)
    s, vs = run([ev.LoadFailed(1, "r", (6, 5))], s)  # blocks 5 and 6 hold tokens 16..23
    assert vs == [] and s is not None
    assert s.num_tokens == 16
    assert s.save.cursor == 16 and s.saved == 16
    assert s.load is not None and s.load.done
    _, vs = run([ev.LoadFailed(1, "r", (99,))], admitted())  # no load: a violation
    assert rules(vs) == ["load_result_without_load"]


def test_load_failed_on_blocks_outside_the_table_does_not_roll_back() -> None:
    s = admitted()
    s, _ = run([ev.LoadPlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1))], s)
    s, vs = run([ev.LoadFailed(1, "r", (77,))], s)
    assert vs == [] and s is not None and s.num_tokens == 20 and s.load is not None


def test_load_result_without_a_load() -> None:
    _, vs = run([ev.LoadDone(1, "r")], admitted())
    assert rules(vs) == ["load_result_without_load"]


def test_late_load_result_after_preemption() -> None:
    """Async scheduling: the preemption is scheduled before the load's result arrives."""
    s = admitted()
    s, _ = run([ev.LoadPlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1)), ev.Preempted(1, "r")], s)
    for late in (ev.LoadDone(1, "r"), ev.LoadFailed(1, "r", (2,))):
        after, vs = fold(s, late, CFG)
        assert vs == () and after == s


# --- saves ---------------------------------------------------------------------------------------


def test_the_watermark_moves_on_confirmation_only() -> None:
    s = admitted()
    s, vs = run([ev.SavePlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1))], s)
    assert vs == [] and s is not None
    assert s.save == SaveProgress(16, ((b"a", 0), (b"b", 8))) and s.saved == 0
    assert s.life.tokens_saved == 16
    s, _ = run([ev.SaveDone(1, "r", (b"b",))], s)
    assert s is not None and s.saved == 0  # [0, 8) still unconfirmed
    s, _ = run([ev.SaveDone(1, "r", (b"a",))], s)
    assert s is not None and s.saved == 16


def test_skip_moves_the_cursor_at_once() -> None:
    s, _ = run([ev.SavePlanned(0, "r", 16, 16, (), (), (), 16)], admitted())
    assert s is not None and s.saved == 16 and s.save.pending == ()


def test_save_failed_is_replanned_while_running_only() -> None:
    planned = ev.SavePlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1))
    s, _ = run([planned, ev.SaveFailed(1, "r", (b"b",))], admitted())
    assert s is not None and s.save == SaveProgress(8, ((b"a", 0),))
    s, _ = run([planned, ev.Preempted(1, "r"), ev.SaveFailed(1, "r", (b"b",))], admitted())
    assert s is not None and s.save == SaveProgress(0, ((b"a", 0),))


def test_save_result_for_a_chunk_never_planned() -> None:
    _, vs = run([ev.SaveDone(1, "r", (b"zz",))], admitted())
    assert rules(vs) == ["save_result_planned"] and vs[0].detail == {"unplanned": 1}


# --- purity ----------------------------------------------------------------------------------------


def test_fold_never_changes_the_state_it_was_given() -> None:
    s = admitted()
    snapshot = (list(s.token_ids), list(s.block_ids), list(s.keys), s.summary())
    a, _ = run([ev.Scheduled(1, "r", 20, 4, 20, (1, 2, 3, 4), (6,))], s)
    b, _ = run([ev.Scheduled(1, "r", 20, 4, 20, (9, 9, 9, 9), (7,))], s)  # another branch
    assert (list(s.token_ids), list(s.block_ids), list(s.keys), s.summary()) == snapshot
    assert a is not None and b is not None
    assert a.token_ids == [*tokens(20), 1, 2, 3, 4] and a.block_ids == [1, 2, 3, 4, 5, 6]
    assert b.token_ids == [*tokens(20), 9, 9, 9, 9] and b.block_ids == [1, 2, 3, 4, 5, 7]
    assert a.keys[2] != b.keys[2]


def test_fold_is_deterministic() -> None:
    events = [
        ev.RequestAdded(0, "r", tokens(20)),
        ev.LookupAsked(0, "r", 0, 20),
        ev.LookupAnswered(0, "r", 0, 0),
        ev.Allocated(0, "r", (1, 2, 3, 4, 5), 0),
        ev.Scheduled(0, "r", 0, 20, 0, (), (1, 2, 3, 4, 5), NEW),
        ev.SavePlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1)),
        ev.Scheduled(1, "r", 20, 1, 20, (3,), (6,)),
        ev.SaveDone(1, "r", (b"a",)),
    ]
    assert run(events) == run(events)


def test_token_ids_outside_uint32_are_refused() -> None:
    """Chunk keys encode token ids as uint32: anything else never enters the state (a plan
    hashing it later would raise)."""
    for prompt in ([-1], [2**32], [1, 2, 3, 4, 5, 6, 7, 8, -5]):
        s, vs = fold(None, ev.RequestAdded(0, "r", prompt), CFG)
        assert s is None and rules(vs) == ["token_ids_valid"]
    s = admitted()
    after, vs = fold(s, ev.Scheduled(1, "r", 20, 1, 20, (2**40,)), CFG)
    assert rules(vs) == ["token_ids_valid"] and after is not None
    assert after.token_ids == tokens(20)
    _, vs = fold(s, ev.LookupAsked(1, "r", 0, 21, 20, (-1,)), CFG)
    assert "token_ids_valid" in rules(vs)


def test_a_handler_error_is_a_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold's last line of defence: a bug in a handler is a violation, never a raise."""

    def boom(state: object, e: object, cfg: object) -> None:
        raise ZeroDivisionError("bug")

    monkeypatch.setitem(state_module._HANDLERS, ev.Preempted, boom)
    s = admitted()
    after, vs = fold(s, ev.Preempted(1, "r"), CFG)
    assert after is s and rules(vs) == ["fold_error"]
    assert vs[0].detail == {"error": "ZeroDivisionError: bug"}


# --- totality --------------------------------------------------------------------------------------

# Mostly small values (so that sequences reach deep states: admissions, plans, rollbacks),
# with a sprinkle of anything: negative, huge, out-of-range token ids.
_ints = st.one_of(st.integers(0, 8), st.integers(-3, 40), st.integers(-(2**63), 2**63))
_token = st.one_of(st.integers(0, 3), st.sampled_from([-1, 2**32, 2**40, -(2**63)]))
_tokens = st.lists(_token, max_size=12)
_ids = st.sampled_from(["a", "a", "b", ""])
_keys = st.lists(st.binary(min_size=16, max_size=16), max_size=3).map(tuple)
_blocks = st.lists(st.integers(-2, 12), max_size=8)

_EVENT = st.one_of(
    st.builds(ev.RequestAdded, _ints, _ids, _tokens, st.text(max_size=3)),
    st.builds(ev.LookupAsked, _ints, _ids, _ints, _ints, _ints, _tokens, st.booleans()),
    st.builds(ev.Allocated, _ints, _ids, _blocks, _ints),
    st.builds(
        ev.Scheduled,
        _ints,
        _ids,
        _ints,
        _ints,
        _ints,
        _tokens,
        _blocks,
        st.sampled_from(ev.Admission),
    ),
    st.builds(ev.Preempted, _ints, _ids),
    st.builds(ev.Finished, _ints, _ids, st.text(max_size=5)),
    st.builds(ev.SaveDone, _ints, _ids, _keys),
    st.builds(ev.SaveFailed, _ints, _ids, _keys),
    st.builds(ev.LoadDone, _ints, _ids),
    st.builds(ev.LoadFailed, _ints, _ids, _blocks),
    st.builds(ev.ChunkStored, _ints, _ids, st.binary(max_size=16), _ints, _ints),
    st.builds(ev.ChunkEvicted, _ints, _ids, st.binary(max_size=16)),
    st.builds(ev.LookupAnswered, _ints, _ids, _ints, _ints),
    st.builds(ev.LoadPlanned, _ints, _ids, _ints, _ints, _keys, _blocks, _blocks),
    st.builds(ev.SavePlanned, _ints, _ids, _ints, _ints, _keys, _blocks, _keys, _ints),
    st.builds(ev.ViolationRecorded, _ints, _ids, st.text(max_size=4), st.text(max_size=4)),
    st.builds(ev.Event, _ints, _ids),
)

_CONFIGS = st.builds(
    TrackerConfig,
    block_size=st.sampled_from([1, 2, 4]),
    chunk_size=st.just(4),
    num_slots=st.integers(1, 4),
    discard_partial_chunks=st.booleans(),
    save_decode_cache=st.booleans(),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_CONFIGS, events=st.lists(_EVENT, max_size=30))
def test_fold_is_total(cfg: TrackerConfig, events: list[ev.Event]) -> None:
    states: dict[str, RequestState | None] = {}
    for e in events:
        before = states.get(e.req_id)
        after, vs = fold(before, e, cfg)
        assert after is None or isinstance(after, RequestState)
        assert isinstance(vs, tuple) and all(isinstance(v, Violation) for v in vs)
        assert before is not None or after is None or isinstance(e, ev.RequestAdded)
        states[e.req_id] = after


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_CONFIGS, events=st.lists(_EVENT, max_size=30))
def test_tracker_is_total(cfg: TrackerConfig, events: list[ev.Event]) -> None:
    """Non-strict, the Tracker takes anything: it returns decisions, records violations,
    and its index stays within bounds."""
    t = Tracker(cfg)
    for e in events:
        out = t.apply(e)
        assert isinstance(out, list) and all(isinstance(d, ev.DecisionEvent) for d in out)
        stats = t.index.stats()
        assert len(t.index) <= cfg.num_slots
        assert stats["stored"] + stats["writing"] + stats["free"] == cfg.num_slots
        for state in t.states.values():
            assert isinstance(state, RequestState)
        for d in out:
            if isinstance(d, ev.SavePlanned | ev.LoadPlanned):
                state = t.state(d.req_id)
                assert state is None or not state.recompute_only or not d.keys
        t.end_step()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=_CONFIGS,
    prompt=st.lists(_token, min_size=1, max_size=12),
    calls=st.lists(
        st.tuples(
            st.sampled_from(["lookup", "alloc", "sched", "preempt", "finish", "done", "fail"]),
            st.integers(0, 16),
            st.integers(0, 16),
            st.lists(_token, max_size=4),
        ),
        max_size=25,
    ),
)
def test_tracker_helpers_are_total(
    cfg: TrackerConfig, prompt: list[int], calls: list[tuple[str, int, int, list[int]]]
) -> None:
    """The named helpers, called in any order with plausible but unchecked values (token ids
    included: vLLM never sends a negative one, but bookkeeping must not crash the engine)."""
    t = Tracker(cfg)
    t.add_request("r", prompt)
    all_ids = list(prompt)
    for name, a, b, more in calls:
        all_ids += more
        if name == "lookup":
            assert t.lookup("r", a, all_ids) >= 0
        elif name == "alloc":
            t.allocated("r", list(range(a)), b)
        elif name == "sched":
            t.scheduled(
                "r",
                num_computed=a,
                num_scheduled=b,
                all_token_ids=all_ids,
                block_ids=list(range(b)),
                admission=ev.Admission(a % 3),
            )
        elif name == "preempt":
            t.preempted("r")
        elif name == "finish":
            assert isinstance(t.finished("r"), bool)
        elif name == "done":
            t.save_done("r", list(t.index)[:a])
            t.load_done("r")
        else:
            t.load_failed("r", list(range(a)))
        t.end_step()
    assert len(t.index) <= cfg.num_slots


def test_seq_state_fields_are_seqs() -> None:
    s = admitted()
    assert all(isinstance(x, Seq) for x in (s.token_ids, s.block_ids, s.keys))


def test_a_load_failure_after_the_load_was_confirmed_is_a_violation() -> None:
    s = admitted()
    s, _ = run([ev.LoadPlanned(0, "r", 0, 16, (b"a", b"b"), (0, 1)), ev.LoadDone(1, "r")], s)
    for blocks, foreign in (((77,), 1), ((s.block_ids[0],), 0)):
        after, vs = run([ev.LoadFailed(2, "r", blocks)], s)
        assert rules(vs) == ["load_result_twice"] and vs[0].detail == {"foreign_blocks": foreign}
        assert after is not None and after.num_tokens == s.num_tokens  # nothing rolled back


def test_the_core_tells_only_the_logger_its_caller_gives() -> None:
    """The core writes nowhere (an import contract forbids it a logging library): a Tracker
    given no logger records and counts a violation and says nothing; one given a logger tells
    it; the connector's scheduler side gives structlog's, named ``kvledger``."""
    from structlog.testing import capture_logs

    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.scheduler import SchedulerSide

    told: list[tuple[str, dict[str, object]]] = []

    class Told:
        def warning(self, event: str, **kw: object) -> None:
            told.append((event, kw))

        error = warning

    with capture_logs() as said:
        silent = Tracker(TrackerConfig())
        silent.mark_violation("r", "adapter_error", "Scheduled", error="boom")
        assert [v.rule for v in silent.violations] == ["adapter_error"]
        assert said == []
        given = Tracker(TrackerConfig(), logger=Told())
        given.mark_violation("r", "adapter_error", "Scheduled", error="boom")
        assert said == []
        assert [(e, kw["rule"], kw["error"]) for e, kw in told] == [
            ("kvledger.violation", "adapter_error", "boom")
        ]
        side = SchedulerSide(ConnectorConfig(chunk_size=16), block_size=16, num_slots=4)
        side.tracker.mark_violation("r", "adapter_error", "Scheduled", error="boom")
    assert [(e["event"], e["rule"]) for e in said] == [("kvledger.violation", "adapter_error")]
