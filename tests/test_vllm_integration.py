"""vLLM's real scheduler (0.33.0, CPU) with KVLedgerConnector loaded by module path, our
worker side driven by hand over CPU paged caches, and the KV-content oracle checked after
every step: every computed token of every running request holds its oracle value."""

from __future__ import annotations

import itertools

import pytest
from _rigs import PREEMPTING, assert_clean
from _verdicts import digests_by_key, events_of

from kvledger.connector.testing.harness import (
    async_recovery_keeps_placeholders,
    load_failures_reportable,
    load_recovery_misses_resumed,
    model_runner_v2_available,
    skip_reason,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]


def _run(**kw):
    from kvledger.connector.testing.run import RunSpec, run

    load_fault = kw.pop("load_fault", None)
    log_dir = kw.pop("log_dir", None)
    return run(RunSpec(**{**PREEMPTING, **kw}), load_fault=load_fault, log_dir=log_dir)


@pytest.mark.parametrize(
    ("prefix_caching", "mrv2", "async_scheduling"),
    list(itertools.product([False, True], [False, True], [False, True])),
    ids=lambda v: str(v),
)
def test_preempting_workload_is_oracle_exact(prefix_caching, mrv2, async_scheduling):
    """Preemption, resumption, pool loads and saves under every scheduler mode keep every
    computed token's KV exact, with no violation and nothing leaked."""
    if mrv2 and not model_runner_v2_available():
        pytest.skip(
            "this vLLM cannot run Model Runner V2 here (none before 0.14; 0.22-0.30 need Triton)"
        )
    report = _run(
        enable_prefix_caching=prefix_caching,
        model_runner_v2=mrv2,
        async_scheduling=async_scheduling,
        extra_config={"chunk_size": 32, "strict": True},
    )
    assert_clean(report)
    assert report.preemptions > 0
    assert report.resumptions > 0
    assert report.tokens_saved > 0
    if not prefix_caching:
        # Nothing stays in vLLM's prefix cache, so a resumed request's KV must come back from
        # the pool (LMCache #1969: it never did).
        assert report.tokens_loaded_on_resume > 0


def test_full_prompt_hits_leave_last_token_for_vllm():
    """A repeated prompt hits the pool fully; the load stops one token short (#4614)."""
    report = _run(
        enable_prefix_caching=False,
        repeat_prompts=3,
        # Prompt tails are partial chunks: keep them, or no repeated prompt can hit fully.
        extra_config={"chunk_size": 16, "discard_partial_chunks": False},
    )
    assert_clean(report)
    assert report.full_hits >= 1


def test_chunked_prefill_with_decode_saving():
    """Long prompts prefilled in chunks and decode-phase saving stay exact."""
    report = _run(
        num_gpu_blocks=40,
        prompt_len=(150, 300),
        max_tokens=(20, 60),
        long_prefill_token_threshold=48,
        max_num_batched_tokens=96,
        enable_prefix_caching=False,
        extra_config={"chunk_size": 32, "save_decode_cache": True, "discard_partial_chunks": False},
    )
    assert_clean(report)
    assert report.tokens_loaded > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_drafters_deferred_finalize_keeps_every_layer_exact(async_scheduling):
    """With a drafter (speculative decoding) vLLM builds the connector output after the
    target's layers and before the draft model writes its own, and calls wait_for_save only
    after that: the saves still carry every layer, the drafter's included, so what comes back
    from the pool on resumption and for the repeated prompts is exact."""
    report = _run(
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        drafter_layers=1,
        extra_config={"chunk_size": 16, "strict": True},
    )
    assert_clean(report)
    assert report.preemptions > 0
    assert report.tokens_loaded > 0 and report.tokens_saved > 0


def _failing_every_other_load() -> tuple[list[object], object]:
    failures: list[object] = []

    def fault(req_id, chunk):
        # Fail the second chunk of every other load.
        if chunk.token_start >= 16 and len(failures) % 2 == 0:
            failures.append((req_id, chunk.token_start))
            return True
        failures.append(None)
        return False

    return failures, fault


def test_injected_load_failures_recompute_exactly():
    """Failed loads are reported as invalid blocks; vLLM's recompute policy rolls back and
    recomputes them; nothing computed over the failed prefix is ever stored or served."""
    if not load_failures_reportable():
        pytest.skip("this vLLM cannot be told of a failed load (invalid_block_ids: 0.11.1 on)")
    failures, fault = _failing_every_other_load()
    report = _run(enable_prefix_caching=False, load_fault=fault, extra_config={"chunk_size": 16})
    assert report.load_errors > 0
    assert any(f is not None for f in failures)
    if not load_recovery_misses_resumed():
        assert_clean(report)
        return
    # vLLM before PR #38096 (0.14.1, 0.18.1): the failed load of a resumed request is not
    # rolled back, and vLLM computes over the failed blocks. vLLM's fault, not the oracle's:
    # the tracker, told of the failure, expects vLLM to recompute from the first failed block,
    # and names every request whose KV went wrong at its next step.
    wrong = {m.req_id for m in report.mismatches}
    named = {v.split()[2].rstrip(":") for v in report.violations}
    assert wrong and wrong <= named
    assert all(" tokens_match_schedule at Scheduled " in v for v in report.violations)


def test_a_request_sharing_a_block_whose_load_failed_saves_nothing_computed_over_it(tmp_path):
    """vLLM's prefix cache shares a block from its allocation on. B, admitted in the step
    in which A's load of a shared 64-token prefix fails, takes A's blocks as a local hit and
    computes its own 32 tokens over KV that was never loaded; vLLM reschedules both. B's
    chunks of that step must not be saved: D, B's prompt again, would load them (the save of
    KV computed over a prefix that failed to load), nor their digests recorded as their keys'.
    The oracle checks every token of every step, D's loaded ones included."""
    import random

    from kvledger.connector.testing.run import RunSpec, runner
    from kvledger.replay.replayer import check
    from kvledger.tracker import events as ev

    if not load_failures_reportable():
        pytest.skip("this vLLM cannot be told of a failed load (invalid_block_ids: 0.11.1 on)")
    failing = {"A"}
    extra = {"chunk_size": 16, "digests": "full"}
    spec = RunSpec(num_gpu_blocks=24, max_num_batched_tokens=256, extra_config=extra)
    rig = runner(spec, load_fault=lambda req_id, chunk: req_id in failing, log_dir=str(tmp_path))
    rng = random.Random(3)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 900) for _ in range(n)]

    def fill() -> list[tuple[str, list[int], int]]:  # evicts the prefix from vLLM's cache
        return [(f"fill-{rng.random()}", tokens(112), 2) for _ in range(3)]

    prefix, b_prompt = tokens(64), tokens(32)
    rig.run([("R", prefix + tokens(16), 2)], max_steps=200)  # the pool holds the prefix
    rig.run(fill(), max_steps=200)
    rig.run([("A", prefix + tokens(8), 2), ("B", prefix + b_prompt, 2)], max_steps=200)
    rig.run(fill(), max_steps=200)
    failing.clear()
    rig.run([("D", prefix + b_prompt, 2)], max_steps=200)
    side = rig.harness.connector.scheduler_side
    side.shutdown()
    rig.harness.close()
    assert rig.load_errors > 0
    assert [m.describe() for _, m in rig.mismatches] == []
    events = events_of(side.log_path)
    failed_at = {e.step for e in events if isinstance(e, ev.LoadFailed) and e.req_id == "A"}
    refused = [e for e in events if isinstance(e, ev.SaveFailed) and e.req_id == "B"]
    assert failed_at and refused and all(e.step >= min(failed_at) for e in refused)
    (d_lookup,) = [e for e in events if isinstance(e, ev.Allocated) and e.req_id == "D"]
    assert d_lookup.num_external >= 64  # D loaded from the pool
    # Nor is a digest of what B computed over the failed load recorded as its keys': every
    # key has the one digest of its correct bytes.
    digests = digests_by_key(events)
    assert digests and all(len(d) == 1 for d in digests.values())
    result = check(side.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]


def test_failed_loads_under_async_scheduling_are_named_where_vllm_loses_a_token(tmp_path):
    """The same failed loads under async scheduling. vLLM up to 0.33 rolls the request back
    but keeps the failed step's output placeholder (issues #45138, #49250), so the next
    step's token lands one position early: from there vLLM's token ids are not the model's,
    and what it serves has lost a token. Its KV is still the model's (the oracle's KV check
    passes); the token check sees the ids. kvledger names each such request (``tokens_known``:
    vLLM schedules two tokens whose ids it never reported), at the first step it schedules
    after the failure, stops saving it (decode chunks included), and ``check`` names the
    same requests. Where vLLM resets the placeholders, the run is clean."""
    from kvledger.connector.testing.oracle import Mismatch, TokenMismatch
    from kvledger.replay.logreader import LogReader
    from kvledger.replay.replayer import check
    from kvledger.tracker import events as ev

    if not load_failures_reportable():
        pytest.skip("this vLLM cannot be told of a failed load (invalid_block_ids: 0.11.1 on)")
    failures, fault = _failing_every_other_load()
    report = _run(
        enable_prefix_caching=False,
        async_scheduling=True,
        load_fault=fault,
        log_dir=str(tmp_path),
        extra_config={"chunk_size": 16, "save_decode_cache": True},
    )
    assert report.load_errors > 0
    if not async_recovery_keeps_placeholders():
        assert_clean(report)
        return
    diverged: dict[str, int] = {}
    for m in report.mismatches:
        if isinstance(m, TokenMismatch):
            diverged.setdefault(m.req_id, m.position)
    assert diverged, "no request lost a token: the failures did not reach vLLM's recovery"
    assert diverged.keys() <= {f[0] for f in failures if f is not None}
    assert [m.describe() for m in report.mismatches if isinstance(m, Mismatch)] == []
    named = {v.split()[2].rstrip(":") for v in report.violations}
    assert named == diverged.keys()
    assert all(" tokens_known at Scheduled " in v for v in report.violations)
    assert report.leaks == () and report.adapter_errors == 0
    # Nothing of a diverged request is saved from its first wrong id on: a later prompt
    # holding vLLM's ids must never load the KV of the model's.
    for frame in LogReader(report.log_path):
        for e in frame.events:
            if isinstance(e, ev.SavePlanned) and e.keys and e.req_id in diverged:
                assert e.end <= diverged[e.req_id], (e, diverged[e.req_id])
    result = check(report.log_path)
    assert result.exit_code == 1
    assert {(p.rule, p.req_id) for p in result.problems} == {("tokens_known", r) for r in diverged}


def test_oracle_catches_a_wrong_load_range(monkeypatch):
    """The oracle must be able to fail: a load shifted by one block is seen as wrong KV."""
    import attrs

    import kvledger.tracker.tracker as tracker_module

    real = tracker_module.plan_load

    def off_by_one_block(state, index, config, step):
        decision, violations = real(state, index, config, step)
        if decision is not None and decision.end - decision.start > config.block_size:
            decision = attrs.evolve(decision, end=decision.end - config.block_size)
        return decision, violations

    monkeypatch.setattr(tracker_module, "plan_load", off_by_one_block)
    report = _run(enable_prefix_caching=False, extra_config={"chunk_size": 32})
    assert report.mismatches, "a short load left stale KV that the oracle did not see"


def test_oracle_catches_a_block_table_that_is_extended_on_resume(monkeypatch):
    """LMCache #1969's bug (stale blocks kept on resume) re-introduced on purpose is caught,
    by the tracker's invariants or the oracle. The fold replaces the table in three places
    (preemption, allocation, admission): all three must be broken to get the bug back."""
    import kvledger.tracker.state as state_module
    from kvledger.tracker import events as ev
    from kvledger.tracker.seq import Seq

    real = state_module._on_scheduled
    real_preempt = state_module._preempt

    def keep_blocks_on_preempt(state):
        # The fold forgets the block table at preemption; the bug needs it kept.
        return real_preempt(state)._replace(block_ids=state.block_ids)

    def extend_on_resume(state, e, config):
        stale = state.block_ids
        new_state, vs = real(state, e, config)
        if e.admission is not ev.Admission.RUNNING and len(stale):
            new_state = new_state._replace(block_ids=Seq([*stale, *e.block_ids]))
        return new_state, vs

    real_allocated = state_module._on_allocated

    def drop_allocated_blocks(state, e, config):
        # LMCache's update_state_after_alloc drops the blocks (lmcache-adapter-and-bugs §1).
        new_state, vs = real_allocated(state, e, config)
        return new_state._replace(block_ids=state.block_ids), vs

    monkeypatch.setattr(state_module, "_preempt", keep_blocks_on_preempt)
    monkeypatch.setitem(state_module._HANDLERS, ev.Allocated, drop_allocated_blocks)
    monkeypatch.setitem(state_module._HANDLERS, ev.Scheduled, extend_on_resume)
    report = _run(enable_prefix_caching=False, extra_config={"chunk_size": 16})
    assert report.mismatches or report.violations


@pytest.mark.parametrize("background", [True, False])
def test_a_disk_filling_mid_run_never_stops_the_engine(
    tmp_path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """The disk fills after some steps: logging stops (said once), the engine serves every
    request with every token right, and the log reads up to the last step it holds."""
    import errno

    from kvledger.connector import logwriter as kvlog
    from kvledger.replay.logreader import LogReader

    budget = {"bytes": 6000}

    def filling(write):
        def limited(self, *args):
            data = args[-1]
            if isinstance(data, bytes | bytearray) and (not args[:-1] or args[0] == "write"):
                budget["bytes"] -= len(data)
                if budget["bytes"] < 0:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return write(self, *args)

        return limited

    if background:
        monkeypatch.setattr(kvlog._BackgroundOutput, "_do", filling(kvlog._BackgroundOutput._do))
    else:
        monkeypatch.setattr(kvlog._DirectOutput, "write", filling(kvlog._DirectOutput.write))
    report = _run(
        log_dir=str(tmp_path), extra_config={"chunk_size": 32, "log_background": background}
    )
    assert_clean(report)
    assert report.finished == report.requests and report.preemptions > 0
    assert budget["bytes"] < 0  # the disk did fill
    reader = LogReader(report.log_path)
    frames = list(reader)
    assert frames and reader.stop is None and reader.ending == "open"
    assert frames[-1].step < report.steps - 1  # it stopped early, and says it is incomplete
