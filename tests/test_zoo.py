"""The bug-shape zoo (connector/testing/zoo.py, docs/bug-zoo.md): each bug reported in the field
rebuilt as a faulty connector under vLLM 0.33's real scheduler, recorded by KVLedgerRecorder,
and named by ``kvledger check`` of the log alone (the rule, the request, the step), while the
KV-content oracle or vLLM itself shows that the bug happened. Each shape's clean twin (the same
workload, the fault taken out) checks clean. LMCache's own bugs run LMCache's real releases.

The verdicts are read through ``check``, never from the recorder's record layout. A digest
verdict is accepted at the step of the load it judges or the step after: the recorder reports
the worker's digests with the step whose output carried them, and may come to stamp them at
the load's own step.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvledger.connector.testing.harness import skip_reason
from kvledger.tracker import events as ev
from tests._lmcache import need, require_lmcache, runs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

# A shape's faulty run: the first problem check names (rule, request) and every rule it names.
BYTES = {  # only the KV-content digests can see these: the connector API shows nothing wrong
    "dynamo_8419": ("again", {"load_unchanged", "digest_mismatch"}),
    "dynamo_15079": ("again", {"load_unchanged"}),
    "lmcache_4463": ("again", {"digest_mismatch"}),
    "sglang_40193": ("again", {"load_unchanged"}),
    "vllm_52360": ("b", {"digest_mismatch"}),
    # vLLM's own OffloadingConnector, PR #47046's fix taken out for the faulty run
    "vllm_46951": ("again", {"load_unchanged", "digest_mismatch"}),
}
API = {  # visible at the connector API: named with digests off
    "vllm_51637": ("x", {"stale_completion"}),
    "vllm_46240": ("x", {"stale_completion"}),
    "vllm_50297": ("b", {"finished_without_blocks"}),
    "vllm_55113": ("again", {"full_hit_no_last_token"}),
    "sglang_40193_offer": ("again", {"stored_not_offered"}),
    # build_connector_meta raised: a callback about the step, not one request.
    "vllm_49635": ("", {"connector_raised"}),
    # vLLM's own OffloadingConnector under MultiConnector, its blocks bound taken out: its
    # store path asserted in build_connector_meta (the engine dies there).
    "vllm_52170": ("", {"connector_raised"}),
    "lmcache_4762": ("again", {"stale_completion"}),
}
ALL = {**BYTES, **API}
# No rule can name these (a legitimate run can look the same); ``check --differential``, which
# replays kvledger's own rules on the same facts, names the request and the lookup.
DIFFERENTIAL = {
    "vllm_54193": ("again", "offered 64 external tokens, kvledger would offer 48"),
}


def _check(path: str, **kw: Any) -> Any:
    from kvledger.replay.replayer import check

    return check(path, **kw)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """Each shape run once per module, faulty or fixed (or with its digests off), on demand."""
    from kvledger.connector.testing.zoo import SHAPES, run_shape

    cache: dict[tuple[str, bool, str | None], Any] = {}

    def get(name: str, *, fixed: bool = False, digests: str | None = None) -> Any:
        key = (name, fixed, digests)
        if key not in cache:
            shape = SHAPES[name]
            if digests is not None:
                import dataclasses

                shape = dataclasses.replace(shape, digests=digests)
            logs = tmp_path_factory.mktemp(f"{name}-{'fixed' if fixed else 'faulty'}")
            cache[key] = run_shape(shape, fixed=fixed, log_dir=str(logs))
        return cache[key]

    return get


def test_every_shape_of_the_zoo_is_tested() -> None:
    from kvledger.connector.testing.zoo import SHAPES

    assert set(SHAPES) == set(ALL) | set(DIFFERENTIAL)


@pytest.mark.parametrize("name", sorted(ALL))
def test_the_faulty_connector_is_named_by_check_of_its_log(zoo: Any, name: str) -> None:
    report = zoo(name)
    req, rules = ALL[name]
    result = _check(report.log_path)
    assert result.exit_code == 1, report
    first = result.problems[0]
    assert (first.kind, first.req_id) == ("violation", req)
    assert first.name in rules
    assert {p.name for p in result.problems} <= rules
    assert {p.req_id for p in result.problems} == {req}
    if name in BYTES:
        # The oracle saw the wrong KV of that request, in the step of its load; the digest
        # verdict names that load (its step, or the step whose output reported it).
        hit = report.first_mismatch(req)
        assert hit is not None and report.error is None
        assert first.step in (hit[0], hit[0] + 1)
    else:
        _assert_api_step(name, report, first)


def _assert_api_step(name: str, report: Any, problem: Any) -> None:
    """The step of an API verdict, from what vLLM did: a lookup is recorded in the step vLLM
    schedules; what vLLM reports after a step's forward pass (a finish, a transfer result) in
    the step after it."""
    if name == "vllm_55113":
        # vLLM's scheduler asserted num_new_tokens > 0 in the very schedule() that asked.
        assert report.error is not None and "AssertionError" in report.error
        assert "scheduler.py" in report.error
        assert problem.step == report.error_step
        assert "external=64" in problem.detail and "num_tokens=64" in problem.detail
    elif name == "vllm_51637":
        # vLLM 0.33's scheduler asserted the request finished, freeing the blocks of x's
        # second life for a finished_sending of its first one.
        assert report.error is not None and "AssertionError" in report.error
        assert problem.step == report.error_step + 1
        assert "completion=finished_sending" in problem.detail
        assert "request=running" in problem.detail and "earlier_life_finished=" in problem.detail
    elif name == "vllm_46240":
        # x's finished_sending came, vLLM freed x, and the same completion came again: vLLM's
        # scheduler asserted the id was still one of its requests (finished_sending's loop).
        assert report.error is not None and "AssertionError" in report.error
        assert "scheduler.py" in report.error
        assert problem.step == report.error_step + 1
        (finished,) = [s for r, s in report.finished_at if r == "x"]
        assert "completion=finished_sending" in problem.detail
        assert f"request=finished at step {finished + 1}, nothing outstanding" in problem.detail
    elif name == "lmcache_4762":
        # Under MultiConnector the first connector was chosen for "again"'s 64 tokens and
        # loaded them; the second, told 0, reported a finished_recving for it anyway, and
        # vLLM's scheduler asserted (a completion for a running request).
        assert report.error is not None and "AssertionError" in report.error
        assert "scheduler.py" in report.error
        assert problem.step == report.error_step + 1
        assert problem.detail == (
            "completion=finished_recving,request=running (request_finished not called)"
        )
    elif name == "vllm_49635":
        # "first" finished; in the next step's build_connector_meta the connector prepared its
        # final store for a request its manager had forgotten, and raised (the engine dies).
        assert report.error is not None and report.error.startswith("KeyError: 'first'")
        assert problem.step == report.error_step
        (finished,) = [s for r, s in report.finished_at if r == "first"]
        assert problem.step == finished + 1
        assert problem.detail == "callback=build_connector_meta,error=KeyError: 'first'"
    elif name == "vllm_52170":
        # "again" was aborted while waiting for the second connector's asynchronous load; in
        # the next step's build_connector_meta the first connector counted its 64 computed
        # tokens as 4 chunks to store, had no block id for them, and asserted.
        assert report.error is not None and report.error.startswith("AssertionError")
        assert "scheduler.py" in report.error
        assert problem.step == report.error_step
        assert problem.detail == "callback=build_connector_meta,error=AssertionError: "
    elif name == "sglang_40193_offer":
        # No error and no wrong KV: the hit was only short. The connector's own events say it
        # held b's two chunks when "again" asked; it offered one. explain splits the same way.
        from kvledger.replay.explain import explain

        assert report.error is None and not report.mismatches
        assert "held=64" in problem.detail and "external=32" in problem.detail
        (again,) = [a for a in explain(report.log_path).admissions() if a.request == "again"]
        assert again.lookup_step == problem.step
        assert [(m.start, m.end, m.reason) for m in again.misses] == [
            (32, 64, "inner_not_offered"),
            (64, 96, "new_prefix"),
        ]
    elif name == "vllm_50297":
        assert report.error is None and report.preemptions == 1
        (step,) = [s for r, s in report.finished_at if r == "b"]
        assert problem.step == step + 1
        assert "preempted=True" in problem.detail and "remote_block_ids" in problem.detail


def test_vllm_54193_the_sampled_tokens_slot_is_named_by_the_differential(zoo: Any) -> None:
    """ "first" (63 prompt tokens) samples one token, which closes its second chunk; the store
    counts it and saves that chunk with its last slot never written. The next turn ("again",
    first's prompt and output and 16 tokens more) is offered all 64 and loads the unwritten
    slot: the oracle finds position 63 wrong. No rule can name it from the log (a longer run
    elsewhere may have computed that token), and the digests cannot judge it: no forward ever
    filled that block, so the book has no digest for its key (one load unverifiable). The
    differential can: kvledger, on the same facts, would have offered 48."""
    report = zoo("vllm_54193")
    hit = report.first_mismatch("again")
    assert hit is not None and report.error is None
    step, mismatch = hit
    assert mismatch.position == 63
    plain = _check(report.log_path)
    assert plain.exit_code == 0
    assert plain.counts["digests"]["unverifiable"] == 1
    req, detail = DIFFERENTIAL["vllm_54193"]
    result = _check(report.log_path, differential=True)
    assert result.exit_code == 1
    first = result.problems[0]
    assert (first.kind, first.req_id) == ("differential", req)
    assert first.step == step  # the lookup is recorded in the step that loaded it
    assert detail in first.detail
    assert {p.req_id for p in result.problems} == {req}


@pytest.mark.parametrize("name", sorted({**ALL, **DIFFERENTIAL}))
def test_the_clean_twin_checks_clean(zoo: Any, name: str) -> None:
    """The same workload with the bug fixed: every computed token right, vLLM never asserts,
    every block returned, and the log clean; where digests are on, every load verified."""
    report = zoo(name, fixed=True)
    assert report.error is None and report.leaks == ()
    assert [m.describe() for _, m in report.mismatches] == []
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    if name in DIFFERENTIAL:
        assert _check(report.log_path, differential=True).exit_code == 0
    digests = result.counts["digests"]
    if name in BYTES:
        assert digests["loaded"] > 0 and digests["verified"] == digests["loaded"]
    faulty = zoo(name)
    # The twin ran the shape's moment too: the same preemptions; for a byte fault the same
    # loads accepted (the connector's answers are the same, only its bytes were wrong).
    assert report.preemptions == faulty.preemptions
    if name in BYTES:
        loads = result.counts["recorded"]["loads"]
        assert loads == _check(faulty.log_path).counts["recorded"]["loads"] > 0


@pytest.mark.parametrize("name", sorted(BYTES))
def test_without_digests_a_byte_fault_checks_clean(zoo: Any, name: str) -> None:
    """What the digests add: the same faulty run recorded with digests off. The oracle still
    sees the wrong KV; nothing in the log does."""
    report = zoo(name, digests="off")
    assert report.mismatches
    assert _check(report.log_path).exit_code == 0


def test_vllm_46951_a_store_reads_what_another_connectors_load_wrote(zoo: Any) -> None:
    """vLLM's MultiConnector over two of vLLM's own OffloadingConnectors (chunks of 32 and 16
    tokens; their scheduler roles, CPU managers and worker roles vLLM's, their copies the
    rig's), recorded as one connector. "r" finished with the first connector's store of its
    chunk still to run; "q" was a hit of the second alone, loaded asynchronously into one of
    r's freed blocks. With PR #47046's fix taken out (the faulty run only), the first connector
    never heard of q's blocks, so no fence: its store read them after q's load, and kept p's KV
    in r's chunk. The twin (vLLM 0.33 as shipped) flushed the store before the load. "again"
    loads that chunk: the oracle finds block 1 wrong, and only the digests say so."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    from kvledger.connector.testing.offloading import rig_workers
    from kvledger.replay.explain import explain

    faulty, twin = zoo("vllm_46951"), zoo("vllm_46951", fixed=True)
    # The patch lasted the faulty run only: vLLM's own method is back.
    assert "regardless of num_external_tokens" in inspect.getsource(
        OffloadingConnectorScheduler.update_state_after_alloc
    )
    # r's store (the first connector's first job): read late, after q's load; in the twin,
    # waited on (jobs_to_flush) before it. The second connector, which chose to load q, fenced
    # its own store of r in both runs.
    (first, second), (first_twin, second_twin) = (
        rig_workers(faulty.worker),
        rig_workers(twin.worker),
    )
    assert (first.blocks_per_chunk, second.blocks_per_chunk) == (2, 1)
    assert first.stores_read == [(0, "reported")]
    assert first_twin.stores_read == [(0, "waited")]
    assert (1, "waited") in second.stores_read and (1, "waited") in second_twin.stores_read
    # q: 16 tokens offered (the second connector's chunk), loaded asynchronously.
    (q,) = [a for a in explain(faulty.log_path).admissions() if a.request == "q"]
    assert (q.hit["inner"], q.accepted) == (16, 16)
    # again: r's chunk loaded; its second block (tokens 16-31) holds p's KV. check names the
    # load of that block: unchanged, since the block it went into last held p's first 16
    # tokens too (a block holding anything else would read as digest_mismatch).
    hit = faulty.first_mismatch("again")
    assert hit is not None and hit[1].position == 16 and faulty.error is None
    (problem,) = _check(faulty.log_path).problems
    assert (problem.name, problem.req_id, problem.step) == ("load_unchanged", "again", hit[0])
    assert problem.detail.startswith("block=1,")
    assert not twin.mismatches


def test_vllm_52170_the_store_path_asserts_on_a_request_it_has_no_blocks_of(zoo: Any) -> None:
    """vLLM's MultiConnector over two of vLLM's own OffloadingConnectors (chunks of 16 tokens,
    the first with a CPU tier of four chunks), recorded as one connector. "filler" evicted
    "first" from the first connector, so "again" (first's prompt and 16 tokens more) was a hit
    of the second alone, loaded asynchronously; vLLM aborted it while it waited. The first
    connector had looked "again" up (its block ids cleared, its cursor at 0) and was told of
    its blocks with 0 external tokens, which records none. With the blocks bound of
    ``storable_chunks`` taken out (the faulty run only), the abort's step counted the 64
    computed tokens as 4 chunks, sliced 4 keys and no block id, and vLLM's own assertion
    ``len(offload_keys) == len(offload_block_ids)`` raised in ``build_connector_meta``: the
    engine of #52170 dies there. The twin (vLLM 0.33 as shipped) stores nothing for it."""
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as offloading
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )

    from kvledger.connector.testing.offloading import rig_workers

    faulty, twin = zoo("vllm_52170"), zoo("vllm_52170", fixed=True)
    # The patch lasted the faulty run only: vLLM's own method is back.
    assert "num_allocated_chunks" in inspect.getsource(RequestOffloadState.storable_chunks)
    # The assertion is vLLM's own line, the one #52170 reports.
    assert faulty.error is not None and faulty.error_step is not None
    line = int(re.fullmatch(r"AssertionError \(scheduler\.py:(\d+)\)", faulty.error)[1])
    source = Path(offloading.__file__).read_text().splitlines()[line - 1]
    assert source.strip() == "assert len(offload_keys) == len(offload_block_ids)"
    # "again" was aborted, not finished by a token: it never produced one.
    assert "again" in faulty.finished and "again" not in dict(faulty.finished_at)
    # The first connector's tier holds four chunks; the second's far more.
    first, second = rig_workers(twin.worker)
    assert first.cpu[0].shape[0] == 4 < second.cpu[0].shape[0]
    (problem,) = _check(faulty.log_path).problems
    assert (problem.name, problem.req_id, problem.step) == (
        "connector_raised",
        "",
        faulty.error_step,
    )
    assert twin.error is None and not twin.mismatches


def test_vllm_36752_trigger_checks_clean(zoo: Any) -> None:
    """vLLM #36752 is vLLM's own prompt-token stats (a stale ``num_cached_tokens`` after a
    preemption), which never reach the connector API. Its trigger, a preempted request
    re-admitted with a larger external hit than its first admission, happens in vllm_52360's
    clean twin ("b": 0 external tokens, then 64 after its preemption); vLLM 0.33, which
    carries the fix, reports a computed-token count that covers the external tokens, and
    ``readmission_cached_below_external`` holds."""
    from kvledger.replay.source import open_log
    from kvledger.tracker import events as ev

    report = zoo("vllm_52360", fixed=True)
    accepted = [
        e.num_external
        for frame in open_log(report.log_path).frames()
        for e in frame.events
        if isinstance(e, ev.Allocated) and e.req_id == "b"
    ]
    assert accepted[0] == 0 and max(accepted[1:]) > 0
    assert _check(report.log_path).exit_code == 0


# --- the committed example logs of docs/bug-zoo.md ------------------------------------------

DATA = Path(__file__).parent / "data" / "zoo"


@pytest.mark.parametrize("name", ["vllm_51637", "vllm_50297", "vllm_55113", "vllm_54193"])
def test_the_docs_example_logs_are_what_the_zoo_records(zoo: Any, name: str) -> None:
    """docs/bug-zoo.md runs ``kvledger check`` on logs kept in tests/data/zoo
    (``python tests/data/make_zoo_logs.py`` writes them): a run now is judged the same (with
    ``--differential`` where only the differential names the shape)."""

    def verdict(path: str) -> list[tuple[str, str, int, str]]:
        result = _check(path, differential=name in DIFFERENTIAL)
        return [(p.name, p.req_id, p.step, p.detail) for p in result.problems]

    assert verdict(str(DATA / f"{name}.kvlog")) == verdict(zoo(name).log_path)


# --- LMCache's own bugs, on its real releases --------------------------------------------------

# version -> the zoo's LMCache workloads run against it (only recorded, digests sampled).
LMCACHE = {
    "0.3.9.post2": ["lmcache_1969"],
    "0.3.10": ["lmcache_1969", "lmcache_mismatch"],
    "0.4.2": ["lmcache_mismatch", "lmcache_2821"],
    "0.5.5": ["lmcache_4955"],
    "0.5.6": ["lmcache_2821", "lmcache_4133", "lmcache_4133_twin", "lmcache_4955"],
}


def _shapes(version: str) -> Callable[[], list[Any]]:
    def specs() -> list[Any]:
        from kvledger.connector.testing.zoo import lmcache_shapes

        shapes = lmcache_shapes()
        return [shapes[n] for n in LMCACHE[version]]

    return specs


# Each shape recorded (digests sampled), in the run's one child per version (tests/_lmcache.py).
for _version in LMCACHE:
    need(__name__, _version, _shapes(_version))


@pytest.fixture(scope="module")
def lmcache(shared_dir: Path) -> dict[str, dict[str, Any]]:
    """Every version's reports, two versions at a time (each a child process, or another
    worker's reports of it); by version, then shape."""
    from kvledger.connector.testing.zoo import lmcache_shapes

    require_lmcache(list(LMCACHE), mp=True)
    shapes = lmcache_shapes()

    def run(version: str) -> dict[str, Any]:
        reports = runs(__name__, version, shared_dir)
        return {n: reports[f"{shapes[n].name}+recorded"] for n in LMCACHE[version]}

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(LMCACHE, pool.map(run, LMCACHE), strict=True))


def _error_step(report: Any) -> int:
    match = re.match(r"step (\d+): ", report.error or "")
    assert match is not None, report.error
    return int(match.group(1))


@pytest.mark.lmcache
@pytest.mark.slow
def test_lmcache_1969_resumed_request_never_reloads(lmcache: Any) -> None:
    """0.3.9.post2: vLLM counts 34 tokens of req-1 as loaded on its resumption and the adapter
    never loads them. Only the digests see it: the two full blocks vLLM accepted are unchanged
    by the load. 0.3.10 (PR #2007) reloads them: clean, both verified."""
    report = lmcache["0.3.9.post2"]["lmcache_1969"]
    first_wrong = report.first_mismatch()
    assert first_wrong is not None and first_wrong["req_id"] == "req-1"
    result = _check(report.log_path)
    assert result.exit_code == 1
    assert [(p.name, p.req_id) for p in result.problems] == [("load_unchanged", "req-1")] * 2
    assert result.problems[0].step in (first_wrong["step"], first_wrong["step"] + 1)
    fixed = lmcache["0.3.10"]["lmcache_1969"]
    assert fixed.clean
    result = _check(fixed.log_path)
    assert result.exit_code == 0
    assert result.counts["digests"]["verified"] == result.counts["digests"]["loaded"] == 2


@pytest.mark.lmcache
@pytest.mark.slow
def test_lmcache_mismatch_in_tokens_to_load(lmcache: Any) -> None:
    """0.3.10: req-1 waits for blocks with 80 tokens in vLLM's prefix cache and 64 in LMCache;
    re-asked, the lookup cache returns the raw 64, vLLM accepts them on top of its 80, and
    LMCache's update_state_after_alloc asserts (the seed's "Mismatch in tokens to load",
    LMCache #2158). ``check`` names the raise; the differential names the first answer that
    kvledger would not give. 0.4.2 answers 0 every time: clean."""
    report = lmcache["0.3.10"]["lmcache_mismatch"]
    assert report.error is not None
    assert "Mismatch in tokens to load: 64 vs 64 (tokens in lmcache) - 80 (tokens in vllm)" in (
        report.error
    )
    result = _check(report.log_path)
    assert result.exit_code == 1
    (problem,) = result.problems
    assert (problem.name, problem.req_id, problem.step) == (
        "connector_raised",
        "req-1",
        _error_step(report),
    )
    assert "callback=update_state_after_alloc" in problem.detail
    assert "Mismatch in tokens to load" in problem.detail
    diff = [p for p in _check(report.log_path, differential=True).problems if p.kind != "violation"]
    raw = [s for s, r, local, answer, _ in report.lookups if r == "req-1" and answer == 64]
    assert (diff[0].req_id, diff[0].step) == ("req-1", raw[0])
    assert "offered 64 external tokens, kvledger would offer 0" in diff[0].detail
    fixed = lmcache["0.4.2"]["lmcache_mismatch"]
    assert fixed.error is None and fixed.clean
    assert _check(fixed.log_path).exit_code == 0
    assert _check(fixed.log_path, differential=True).exit_code == 0


@pytest.mark.lmcache
@pytest.mark.slow
def test_lmcache_2821_decode_kv_never_saved_under_async_scheduling(lmcache: Any) -> None:
    """0.4.2 under async scheduling with decode saving on: the adapter slices a cached
    request's new tokens from vLLM's num_computed_tokens, already advanced, so its tracker never
    grows and no decode chunk is saved. No rule is broken (saving less only costs hits), so
    ``check`` is clean; the differential, told that kvledger saves decode chunks too, names
    req-1's first lookup after its preemption: 32 offered where 48 were computed and saveable.
    0.5.6 (PR #2929) saves them and agrees."""
    report = lmcache["0.4.2"]["lmcache_2821"]
    assert report.error is None and report.clean
    assert _check(report.log_path).exit_code == 0
    result = _check(report.log_path, differential=True, save_decode_cache=True)
    assert result.exit_code == 1
    first = result.problems[0]
    ((preempted_at, who),) = report.preemptions
    assert (first.kind, first.req_id, first.step) == ("differential", who, preempted_at + 1)
    assert "offered 32 external tokens, kvledger would offer 48" in first.detail
    fixed = lmcache["0.5.6"]["lmcache_2821"]
    assert fixed.clean
    assert _check(fixed.log_path).exit_code == 0
    assert _check(fixed.log_path, differential=True, save_decode_cache=True).exit_code == 0


@pytest.mark.lmcache
@pytest.mark.slow
def test_lmcache_4133_eviction_between_lookup_and_retrieve(lmcache: Any) -> None:
    """0.5.6: the lookup promised 63 tokens of again-req-0's prompt, and its last chunk was
    evicted before the worker's retrieve. The adapter (non-layerwise) staged 48 tokens,
    reported the blocks it could not (invalid_block_ids), and vLLM 0.33 ended the request
    with an error (its kv_load_failure_policy): nothing was computed over the missing KV.
    check: clean, a failure reported is the API working. explain: 48 tokens hit, 15 whose
    load failed, at the step the worker's report came (after the request had ended)."""
    from kvledger.replay.explain import explain
    from kvledger.replay.source import open_log
    from kvledger.tracker import events as ev

    report = lmcache["0.5.6"]["lmcache_4133"]
    assert report.error is None and report.clean
    ((step, who, claimed),) = report.claims
    assert (who, claimed) == ("again-req-0", 63)
    assert report.loads == [(step, who, 48)] and report.load_errors
    assert _check(report.log_path).exit_code == 0
    finished = [
        e.reason
        for f in open_log(report.log_path).frames()
        for e in f.events
        if isinstance(e, ev.Finished) and e.req_id == who
    ]
    assert finished == ["finished_error"]
    (again,) = [a for a in explain(report.log_path).admissions() if a.request == who]
    assert again.hit["inner"] == 48
    assert [(m.start, m.end, m.reason, m.step) for m in again.misses] == [
        (48, 63, "load_failed", step + 1)
    ]
    # The twin, nothing evicted: all 63 tokens loaded, the request finishes, clean.
    twin = lmcache["0.5.6"]["lmcache_4133_twin"]
    assert twin.error is None and twin.clean and not twin.load_errors
    # (LMCache retrieves its whole last chunk, the token vLLM computes itself included.)
    assert [(w, n) for _, w, n in twin.loads] == [(who, 64)]
    assert _check(twin.log_path).exit_code == 0
    (again,) = [a for a in explain(twin.log_path).admissions() if a.request == who]
    assert (again.hit["inner"], again.misses) == (63, [])


@pytest.mark.lmcache
@pytest.mark.slow
def test_lmcache_4955_in_flight_mp_store_reads_reused_blocks(lmcache: Any) -> None:
    """LMCache's MP mode, its connector and its server (LMCache-driven transfer over CPU
    shared memory). "a" and "b" prefill together and fill the pool; in the next step vLLM
    preempts "b" and hands its last block to "a", whose forward writes it while the server's
    STORE of b's chunks is in flight. 0.5.5's preemption flush is a no-op: nothing waits for
    that store before the forward, the server reads a's KV into b's last chunk, and "again"
    (b's prompt and 16 tokens more) loads it. Only the digests see it: ``digest_mismatch`` on
    again's load, block 3. 0.5.6 waits for the store in ``flush_inflight_stores`` before the
    forward: the same run is clean, every loaded block verified."""
    report = lmcache["0.5.5"]["lmcache_4955"]
    assert report.error is None
    ((preempted_at, who),) = report.preemptions
    assert who == "b"
    # Nothing of LMCache waited on a store in the preempting step (the forward ran first).
    assert not [w for w in report.store_waits if w[1] == preempted_at]
    first = report.first_mismatch()
    assert first is not None
    assert (first["req_id"], first["position"]) == ("again", 48)
    assert first["holder"].startswith("a[")  # b's last chunk holds a's KV
    ((load_step, _, loaded),) = [x for x in report.loads if x[1] == "again"]
    assert loaded == 64 and first["step"] >= load_step
    result = _check(report.log_path)
    assert result.exit_code == 1
    assert [(p.name, p.req_id) for p in result.problems] == [("digest_mismatch", "again")]
    (problem,) = result.problems
    # Judged when the worker digests the load, which LMCache's MP mode completes
    # asynchronously: a step or more after it was planned on a loaded machine (16 for 14 once).
    assert problem.step >= load_step and isinstance(problem.event, ev.LoadDigested)
    assert "block=3" in problem.detail
    # The twin: the same schedule; LMCache's flush waits for every in-flight store first.
    twin = lmcache["0.5.6"]["lmcache_4955"]
    assert twin.error is None and twin.clean
    assert twin.preemptions == report.preemptions
    flushed = [w for w in twin.store_waits if w[1] == preempted_at]
    assert flushed and flushed[0][2].endswith("flush_inflight_stores")
    result = _check(twin.log_path)
    assert result.exit_code == 0
    digests = result.counts["digests"]
    assert digests["loaded"] > 0 and digests["verified"] == digests["loaded"]
