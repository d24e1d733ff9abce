"""The scheduler harness drives vLLM's real scheduler; these tests pin down what it shows a
connector (recorded by ``_recording_connector``) under both model runners and both
scheduling modes.

Each scenario runs once per (model runner, scheduling) and is shared by the tests that read
it: a run takes milliseconds, importing vLLM takes seconds.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvledger.connector.testing.harness import (
    HarnessConfig,
    SchedulerHarness,
    StepResult,
    fake_token,
    make_kv_connector_output,
    model_runner_v2_available,
    random_workload,
    shared_prefix_prompts,
    skip_reason,
)

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

MODES = [
    pytest.param(False, False, id="mrv1-sync"),
    pytest.param(True, False, id="mrv2-sync"),
    pytest.param(False, True, id="mrv1-async"),
    pytest.param(True, True, id="mrv2-async"),
]

BASE = HarnessConfig(block_size=16, num_gpu_blocks=10, max_num_batched_tokens=256)


def _connector(**extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config of the recording connector, loaded by module path."""
    return {
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": "_recording_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def vllm_env() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    # vLLM imports kv_connector_module_path by name; make this directory importable whatever
    # pytest's import mode is.
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))


def vllm_test(fn: Any) -> Any:
    """Marked ``vllm`` and skipped (at run time, so deselecting costs no import) without it."""
    return pytest.mark.vllm(pytest.mark.usefixtures("vllm_env")(fn))


def _resumed(cached: Any) -> frozenset[str]:
    from _recording_connector import _resumed as resumed  # imports vLLM

    return resumed(cached)


def _vllm_at_least(version: str) -> bool:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__) >= Version(version)


def _mode(mrv2: bool) -> None:
    """Skips a Model Runner V2 case where vLLM cannot run it (model_runner_v2_available)."""
    if mrv2 and not model_runner_v2_available():
        pytest.skip(
            "this vLLM cannot run Model Runner V2 here (none before 0.14; 0.22-0.30 need Triton)"
        )


# ----------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------


@dataclass
class Run:
    harness: SchedulerHarness
    steps: list[StepResult] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    max_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def connector(self) -> Any:
        return self.harness.connector


def _fake_worker(scheduler_output: Any) -> Any:
    """Completes every async load the connector started in this step, at once."""
    meta = scheduler_output.kv_connector_metadata
    if meta is None or not meta.loads:
        return None
    return make_kv_connector_output(finished_recving=meta.loads)


def _check_views(harness: SchedulerHarness) -> None:
    """Oracle-style check after every step: each running request's block table covers its
    computed tokens and its token list starts with its prompt."""
    for view in harness.running_views().values():
        capacity = len(view.block_ids[0]) * harness.config.block_size
        assert view.num_computed_tokens <= capacity, view
        assert view.all_token_ids[: view.num_prompt_tokens] == harness.prompts[view.req_id]


def _drive(run: Run, abort_at: dict[int, str] | None = None) -> Run:
    abort_at = abort_at or {}
    for _ in range(2000):
        result = run.harness.step()
        if result is None:
            return run
        run.steps.append(result)
        _check_views(run.harness)
        if result.step in abort_at:
            run.harness.abort_request(abort_at[result.step])
            run.aborted.add(abort_at[result.step])
    raise AssertionError(f"did not finish: {run.harness.describe()}")


@functools.cache
def preemption_run(mrv2: bool, async_sched: bool) -> Run:
    """Two 48-token prompts, 40 output tokens each, 9 usable 16-token blocks: 2 x 6 blocks
    do not fit, so one request is preempted and later resumed."""
    _mode(mrv2)
    cfg = BASE.with_(model_runner_v2=mrv2, async_scheduling=async_sched, kv_connector=_connector())
    run = Run(SchedulerHarness(cfg, on_scheduled=_fake_worker))
    for rid, prompt in zip(("A", "B"), shared_prefix_prompts(2, 0, 48, seed=1), strict=True):
        run.harness.add_request(rid, prompt, 40)
        run.max_tokens[rid] = 40
    return _drive(run)


@functools.cache
def waiting_run(mrv2: bool, async_sched: bool) -> Run:
    """5 usable blocks: A (48 + 8 tokens, 4 blocks) runs, B waits for blocks until A ends."""
    _mode(mrv2)
    cfg = BASE.with_(
        num_gpu_blocks=6,
        model_runner_v2=mrv2,
        async_scheduling=async_sched,
        kv_connector=_connector(),
    )
    run = Run(SchedulerHarness(cfg, on_scheduled=_fake_worker))
    for rid, prompt in zip(("A", "B"), shared_prefix_prompts(2, 0, 48, seed=2), strict=True):
        run.harness.add_request(rid, prompt, 8)
        run.max_tokens[rid] = 8
    return _drive(run)


@functools.cache
def workload_run(mrv2: bool, async_sched: bool) -> Run:
    """A random workload with chunked prefill (long prompts split at 48 tokens), a pool
    small enough to preempt, and one request aborted mid-run."""
    _mode(mrv2)
    cfg = BASE.with_(
        num_gpu_blocks=16,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=48,
        model_runner_v2=mrv2,
        async_scheduling=async_sched,
        kv_connector=_connector(),
    )
    run = Run(SchedulerHarness(cfg, on_scheduled=_fake_worker))
    for r in random_workload(10, seed=7, prompt_len=(8, 120), max_tokens=(1, 40)):
        run.harness.add_request(r.req_id, r.prompt_token_ids, r.max_tokens)
        run.max_tokens[r.req_id] = r.max_tokens
    return _drive(run, abort_at={4: "req-3"})


@functools.cache
def async_load_run(mrv2: bool, async_sched: bool) -> Run:
    """The connector claims 32 external tokens per request, loaded asynchronously; prefix
    caching is off so the resumed request loads again."""
    _mode(mrv2)
    cfg = BASE.with_(
        model_runner_v2=mrv2,
        async_scheduling=async_sched,
        enable_prefix_caching=False,
        kv_connector=_connector(hit_tokens=32, async_load=True),
    )
    run = Run(SchedulerHarness(cfg, on_scheduled=_fake_worker))
    for rid, prompt in zip(("A", "B"), shared_prefix_prompts(2, 0, 48, seed=3), strict=True):
        run.harness.add_request(rid, prompt, 40)
        run.max_tokens[rid] = 40
    return _drive(run)


ALL_RUNS = (preemption_run, waiting_run, workload_run, async_load_run)


# ----------------------------------------------------------------------------------------
# (1) preemption and resumption, in the shape each model runner gives it
# ----------------------------------------------------------------------------------------


@vllm_test
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_preempted_request_comes_back(mrv2: bool, async_sched: bool) -> None:
    run = preemption_run(mrv2, async_sched)
    h = run.harness
    assert h.use_v2_model_runner is mrv2
    assert run.connector.use_v2_model_runner is mrv2  # the connector sees the same mode
    assert type(h.scheduler).__name__ == ("AsyncScheduler" if async_sched else "Scheduler")
    assert h.stats.preemptions >= 1

    preempted_at = {rid: r.step for r in run.steps for rid in r.preempted}
    assert preempted_at
    for rid, step in preempted_at.items():
        back = next(r for r in run.steps if r.step > step and rid in r.resumed)
        out = back.scheduler_output
        assert out is not None
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        if mrv2:  # a fresh NewRequestData with the full block table
            assert rid in new_ids
            assert not _resumed(out.scheduled_cached_reqs)
        else:  # a cached request flagged as resumed; new_block_ids is the full table
            assert rid in _resumed(out.scheduled_cached_reqs)
            assert rid not in new_ids
        # Either way the connector is handed the whole table allocated at re-admission.
        if mrv2:
            table = out.scheduled_new_reqs[new_ids.index(rid)].block_ids
        else:
            cached = out.scheduled_cached_reqs
            table = cached.new_block_ids[cached.req_ids.index(rid)]
        alloc = [
            c
            for c in run.connector.named("update_state_after_alloc")
            if c.args["req_id"] == rid and c.step == back.step
        ]
        assert tuple(tuple(g) for g in table) == alloc[-1].args["block_ids"]
        if mrv2:
            # prefill_token_ids carries the outputs too, and is the request's live list: it
            # kept growing after this step (a connector must copy it, never keep it).
            data = out.scheduled_new_reqs[new_ids.index(rid)]
            recorded = run.connector.named("build_connector_meta")[back.step].args["prefill_len"]
            assert recorded[rid] > len(h.prompts[rid])
            assert len(data.prefill_token_ids) == len(h.prompts[rid]) + run.max_tokens[rid]
    assert set(h.finished) == {"A", "B"}


# ----------------------------------------------------------------------------------------
# (2) the lookup is asked again every step while a request waits
# ----------------------------------------------------------------------------------------


def _asks(run: Run, rid: str, status: str) -> list[Any]:
    return [
        c
        for c in run.connector.named("get_num_new_matched_tokens")
        if c.args["req_id"] == rid and c.args["status"] == status
    ]


@vllm_test
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_lookup_is_reasked_while_waiting(mrv2: bool, async_sched: bool) -> None:
    waiting = _asks(waiting_run(mrv2, async_sched), "B", "WAITING")
    assert len({c.step for c in waiting}) >= 3  # one ask per schedule() while B cannot fit
    assert len({(c.args["num_computed_tokens"], c.args["answer"]) for c in waiting}) == 1

    run = preemption_run(mrv2, async_sched)
    preempted = [rid for r in run.steps for rid in r.preempted]
    asks = _asks(run, preempted[0], "PREEMPTED")
    assert len({c.step for c in asks}) >= 3
    # Request.num_preemptions came in vLLM 0.14; 0.11's request does not count them.
    assert {c.args["num_preemptions"] for c in asks} == ({1} if _vllm_at_least("0.14") else {None})


# ----------------------------------------------------------------------------------------
# (3) every request completes, with exactly the tokens the fake sampler gives
# ----------------------------------------------------------------------------------------


def _expected_tokens(run: Run, rid: str) -> list[int]:
    h = run.harness
    start = len(h.prompts[rid])
    return [
        fake_token(rid, start + i, h.config.seed, h.config.vocab_size)
        for i in range(run.max_tokens[rid])
    ]


@vllm_test
@pytest.mark.parametrize("scenario", ALL_RUNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_every_request_finishes_with_its_tokens(
    scenario: Any, mrv2: bool, async_sched: bool
) -> None:
    run = scenario(mrv2, async_sched)
    h = run.harness
    assert h.is_done()
    assert set(h.finished) == set(h.prompts)
    assert h.stats.finished == len(h.prompts)
    for rid in h.prompts:
        if rid in run.aborted:
            assert h.finished[rid] == "abort"
            continue
        assert h.finished[rid] == "length"
        assert h.output_tokens[rid] == _expected_tokens(run, rid)
    # No block leaked: everything but the null block is free again.
    assert h.num_free_blocks == h.config.num_gpu_blocks - 1
    assert not h.scheduler.requests


@vllm_test
@pytest.mark.parametrize("mrv2", [False, True], ids=["mrv1", "mrv2"])
def test_async_scheduling_applies_outputs_one_step_late(mrv2: bool) -> None:
    sync, asyn = workload_run(mrv2, False), workload_run(mrv2, True)
    # Same tokens, except for the request aborted at a fixed step: by then async scheduling
    # has applied one output fewer.
    done = set(sync.harness.prompts) - sync.aborted
    assert {r: asyn.harness.output_tokens[r] for r in done} == {
        r: sync.harness.output_tokens[r] for r in done
    }
    assert asyn.harness.stats.preemptions >= 1
    applied = [r.applied_step for r in asyn.steps]
    assert applied[0] is None  # the queue fills first
    assert all(a == r.step - 1 for r, a in zip(asyn.steps[1:], applied[1:], strict=True))
    assert all(r.applied_step == r.step for r in sync.steps)
    # The last call only drains the queue.
    assert asyn.steps[-1].scheduler_output is None


# ----------------------------------------------------------------------------------------
# (4) request_finished exactly once; finished_req_ids in the next build_connector_meta
# ----------------------------------------------------------------------------------------


@vllm_test
@pytest.mark.parametrize("scenario", ALL_RUNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_request_finished_once(scenario: Any, mrv2: bool, async_sched: bool) -> None:
    run = scenario(mrv2, async_sched)
    calls = run.connector.named("request_finished")
    assert Counter(c.args["req_id"] for c in calls) == dict.fromkeys(run.harness.prompts, 1)
    metas = run.connector.named("build_connector_meta")
    for c in calls:
        rid = c.args["req_id"]
        expected = "FINISHED_ABORTED" if rid in run.aborted else "FINISHED_LENGTH_CAPPED"
        assert c.args["status"] == expected
        if rid not in run.aborted:
            assert c.args["num_output_tokens"] == run.max_tokens[rid]
        # c.step counts the build_connector_meta calls made before request_finished.
        assert rid in metas[c.step].args["finished"]
        assert all(rid not in m.args["finished"] for m in metas[: c.step])


# ----------------------------------------------------------------------------------------
# What a connector sees: num_computed_tokens at build_connector_meta, async loads
# ----------------------------------------------------------------------------------------


@vllm_test
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_num_computed_tokens_at_build_connector_meta(mrv2: bool, async_sched: bool) -> None:
    gaps: Counter[int] = Counter()
    for meta in workload_run(mrv2, async_sched).connector.named("build_connector_meta"):
        a = meta.args
        reported = {r: n for r, n, _ in a["new"]} | {r: n for r, n, _ in a["cached"]}
        for rid, n in a["num_scheduled_tokens"].items():
            # Not yet advanced: the live request agrees with the output (tokens before it).
            assert a["live_num_computed"][rid] == reported[rid]
            gaps[reported[rid] + n - a["live_num_tokens"][rid]] += 1
    # Sync: computed + scheduled never passes the known tokens (a partial prefill stays
    # behind). Async: a decode step schedules the position of a token not yet sampled.
    assert max(gaps) == (1 if async_sched else 0)
    assert min(gaps) < 0


@vllm_test
@pytest.mark.parametrize(("mrv2", "async_sched"), MODES)
def test_async_load_waits_for_finished_recving(mrv2: bool, async_sched: bool) -> None:
    run = async_load_run(mrv2, async_sched)
    allocs = run.connector.named("update_state_after_alloc")
    for rid in ("A", "B"):
        external = [c.args["num_external_tokens"] for c in allocs if c.args["req_id"] == rid]
        # Per admission: once with the blocks to load into, once more with 0 after the load.
        assert external[:2] == [32, 0]
    recv = [c for c in run.connector.named("update_connector_output") if c.args["finished_recving"]]
    assert {r for c in recv for r in c.args["finished_recving"]} == {"A", "B"}
    assert run.harness.stats.empty_steps >= 1  # steps where only loads were outstanding


# ----------------------------------------------------------------------------------------
# Without vLLM
# ----------------------------------------------------------------------------------------


def test_import_needs_neither_vllm_nor_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["vllm"] = None  # any import of them now fails
        sys.modules["torch"] = None
        import kvledger.connector.testing.harness as h
        assert h.shared_prefix_prompts(2, 4, 2, seed=1)[0][:4] == h.shared_prefix_prompts(2, 4, 2, seed=1)[1][:4]
        assert not h.vllm_available() and "not importable" in h.skip_reason()
        assert "vllm" not in sys.modules or sys.modules["vllm"] is None
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


def test_workload_helpers_are_deterministic() -> None:
    prompts = shared_prefix_prompts(3, prefix_len=20, suffix_len=5, seed=4)
    assert prompts == shared_prefix_prompts(3, prefix_len=20, suffix_len=5, seed=4)
    assert all(len(p) == 25 and p[:20] == prompts[0][:20] for p in prompts)
    assert len({tuple(p[20:]) for p in prompts}) == 3
    work = random_workload(50, seed=9, prompt_len=(5, 9), max_tokens=(2, 3))
    assert work == random_workload(50, seed=9, prompt_len=(5, 9), max_tokens=(2, 3))
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 2 <= r.max_tokens <= 3 for r in work)
    assert all(min(r.prompt_token_ids) >= 3 for r in work)  # no special tokens
    assert fake_token("a", 7) == fake_token("a", 7) != fake_token("a", 8)


def test_config_rejects_incomplete_connector() -> None:
    with pytest.raises(ValueError, match="kv_role"):
        HarnessConfig(kv_connector={"kv_connector": "X"})
