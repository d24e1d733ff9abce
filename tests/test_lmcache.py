"""LMCache's real vLLM v1 adapter under vLLM 0.33's real scheduler, checked by the KV-content
oracle (connector/testing/lmcache.py). Each pinned LMCache release runs in its own child
process (``make lmcache`` installs them under build/); only its storage engine, lookup client
and GPU/server plumbing are replaced. The facts below are measured on the real adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvledger.connector.testing.harness import skip_reason
from tests._lmcache import need, runs

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

Runs = Callable[[str], dict]
VERSIONS = ("0.3.9.post2", "0.3.10", "0.4.2", "0.5.6")


def _workloads(version: str) -> Callable[[], list[str]]:
    def names() -> list[str]:
        from kvledger.connector.testing.lmcache import EVENT_WORKLOADS, WORKLOADS

        return list(WORKLOADS) + (list(EVENT_WORKLOADS) if version == "0.5.6" else [])

    return names


# Every rig workload against each version, bare and wrapped in KVLedgerRecorder (digests
# sampled): in the run's one child per version (tests/_lmcache.py).
for _version in VERSIONS:
    need(__name__, _version, _workloads(_version), bare=True)


@pytest.fixture(scope="module")
def lmcache_runs(shared_dir: Path) -> Runs:
    """A version's reports by workload name, ``NAME+recorded`` wrapped in the recorder."""
    cache: dict[str, dict] = {}

    def get(version: str) -> dict:
        if version not in cache:
            cache[version] = runs(__name__, version, shared_dir)
        return cache[version]

    return get


def _req(rows, req_id):
    return [r for r in rows if r[1] == req_id]


def test_issue1969_0_3_9_post2_claims_a_load_it_never_issues(lmcache_runs: Runs) -> None:
    """LMCache #1969 on the last release before its fix (PR #2007): req-1 is preempted, comes
    back among the cached requests (Model Runner V1) and LMCache answers 34 external tokens,
    which vLLM accepts, but the adapter never loads them (a cached request gets no load spec):
    at step 35 the oracle finds all 34 tokens wrong, in blocks that hold req-0's KV."""
    report = lmcache_runs("0.3.9.post2")["issue1969"]
    assert report.error is None
    assert report.preemptions == [(15, "req-1")]
    assert report.resumptions == [(35, "req-1")]
    assert report.claims == [(35, "req-1", 34)]
    assert _req(report.loads, "req-1") == []  # nothing loaded, ever
    first = report.first_mismatch()
    assert first is not None
    assert (first["step"], first["req_id"], first["wrong_tokens"]) == (35, "req-1", 34)
    holders = dict(zip(first["blocks"], first["holders"], strict=True))
    assert 6 in holders and holders[6].startswith("req-0[")  # block 6 holds req-0's KV
    assert holders[first["block"]].startswith("req-0[")


def test_issue1969_0_3_10_reloads_the_resumed_request(lmcache_runs: Runs) -> None:
    """The first release after PR #2007: the same run is clean, 32 tokens reloaded (the 2-token
    partial chunk saved with the prompt is keyed by the prompt alone, so the lookup over the
    prompt and its outputs stops at 32)."""
    report = lmcache_runs("0.3.10")["issue1969"]
    assert report.error is None
    assert report.resumptions == [(35, "req-1")]
    assert report.claims == [(35, "req-1", 32)]
    assert report.loads == [(35, "req-1", 32)]
    assert report.mismatches == []
    assert report.finished == ["req-0", "req-1"]


def test_issue1969_with_prefix_caching_0_3_9_post2(lmcache_runs: Runs) -> None:
    """With vLLM's prefix cache on, req-1's first block survives: LMCache still claims the
    other 18 prompt tokens and loads none; the oracle sees position 16 on (req-0's KV)."""
    report = lmcache_runs("0.3.9.post2")["issue1969_prefix_cache"]
    assert report.claims == [(35, "req-1", 18)]
    assert _req(report.loads, "req-1") == []
    first = report.first_mismatch()
    assert first is not None
    assert (first["step"], first["req_id"], first["position"]) == (35, "req-1", 16)
    assert first["holder"].startswith("req-0[")


def test_0_3_10_crashes_the_scheduler_on_a_retried_lookup(lmcache_runs: Runs) -> None:
    """A real bug of 0.3.10 (LMCache #2158/#2091, fixed by #2159), found by the rig: PR
    #2007's lookup cache returns the raw hit on a retried lookup. req-1 (49 tokens, 32 of
    them still in vLLM's prefix cache) is answered 0 at step 16, cannot be allocated, and is
    asked again at step 17: the cached 32 comes back unadjusted, 32 + 32 > 49, and vLLM's
    scheduler asserts (EngineCore would die)."""
    report = lmcache_runs("0.3.10")["issue1969_prefix_cache"]
    assert _req(report.lookups, "req-1")[-2:] == [
        (16, "req-1", 32, 0, 49),
        (17, "req-1", 32, 32, 49),
    ]
    assert report.error is not None
    assert report.error.startswith("step 17: AssertionError")
    assert "scheduler.py" in report.error


@pytest.mark.parametrize("version", ["0.4.2", "0.5.6"])
def test_current_releases_are_oracle_exact(lmcache_runs: Runs, version: str) -> None:
    """Current releases on every rig workload: #1969's (with and without vLLM's prefix
    cache, under both model runners) and a mixed one (shared prefixes, three preemptions,
    repeated prompts): no error, every computed token right, every request finished."""
    reports = lmcache_runs(version)
    for name, report in reports.items():
        assert report.error is None, name
        assert report.mismatches == [], name
        assert report.finished, name
        assert report.resumptions, name
    assert reports["issue1969"].loads == [(35, "req-1", 32)]
    # Prefix caching keeps req-1's first block: LMCache loads only the second.
    assert reports["issue1969_prefix_cache"].loads == [(35, "req-1", 16)]
    assert len(reports["mixed"].preemptions) == 3


def test_model_runner_v2_resumes_as_new_request_even_on_0_3_9_post2(lmcache_runs: Runs) -> None:
    """Under Model Runner V2 a resumed request comes back in scheduled_new_reqs, the path
    that always loaded: 0.3.9.post2 reloads req-1 there and the run is clean."""
    report = lmcache_runs("0.3.9.post2")["issue1969_mrv2"]
    assert report.error is None
    assert report.claims == [(35, "req-1", 34)]
    assert report.loads == [(35, "req-1", 34)]
    assert report.mismatches == []
    # Recorded, the log checks clean; the differential's difference is 0.3.9's policy (the
    # prompt alone looked up, its partial chunk kept), a false alarm the oracle settles.
    recorded = lmcache_runs("0.3.9.post2")["issue1969_mrv2+recorded"]
    assert _check(recorded.log_path).exit_code == 0
    diff = _check(recorded.log_path, differential=True, chunk_size=16)
    first = diff.problems[0]
    assert (first.name, first.req_id, first.step) == ("LookupAnswered", "req-1", 16)
    assert (first.recorded[0].external, first.derived[0].external) == (34, 32)


# --- KVLedgerRecorder wrapping LMCache: the recorded log alone -------------------------------


def _check(path, **kw):
    from kvledger.replay.replayer import check

    return check(path, **kw)


def _same_run(bare, recorded) -> None:
    """The recorder changes nothing vLLM or LMCache does: the same lookups and answers, the
    same accepted tokens, loads, saves, preemptions, oracle findings and outcome."""
    for field in ("lookups", "claims", "loads", "saves", "preemptions", "resumptions"):
        assert getattr(recorded, field) == getattr(bare, field), field
    assert recorded.mismatches == bare.mismatches
    assert recorded.error == bare.error
    assert recorded.finished == bare.finished
    assert bare.log_path is None and recorded.log_path is not None


@pytest.mark.parametrize("version", ["0.3.9.post2", "0.3.10"])
def test_recording_lmcache_changes_nothing(lmcache_runs: Runs, version: str) -> None:
    reports = lmcache_runs(version)
    for name in ("issue1969", "issue1969_prefix_cache", "issue1969_mrv2", "mixed"):
        _same_run(reports[name], reports[f"{name}+recorded"])


def test_recorded_issue1969_on_0_3_9_post2_is_caught_by_the_digests(lmcache_runs: Runs) -> None:
    """kvledger check of the recorded log alone (no oracle) names req-1's load: the blocks vLLM
    accepted as loaded from LMCache are byte for byte what they held before the load
    (load_unchanged), stamped at step 35, the step of the load (the worker's digests of it
    came back with the next step's output). With digests off no API-level rule could see it:
    vLLM's facts are consistent."""
    report = lmcache_runs("0.3.9.post2")["issue1969+recorded"]
    assert report.first_mismatch()["step"] == 35  # the oracle, for reference only
    result = _check(report.log_path)
    assert result.exit_code == 1
    named = [(p.name, p.req_id, p.step) for p in result.problems]
    assert named == [("load_unchanged", "req-1", 35)] * 2  # its two full blocks
    digests = result.counts["digests"]
    assert digests["unchanged"] == digests["loaded"] == 2 and digests["verified"] == 0


def test_recorded_issue1969_on_0_3_9_post2_is_caught_by_the_differential(
    lmcache_runs: Runs,
) -> None:
    """The differential (kvledger's own decisions on the recorded inputs) names req-1 at its
    first lookup after the preemption: LMCache 0.3.9 looks up the prompt alone and offers its
    34 tokens (the 2-token partial chunk included), kvledger over the prompt and its outputs
    offers the 32 of its whole chunks."""
    report = lmcache_runs("0.3.9.post2")["issue1969+recorded"]
    result = _check(report.log_path, differential=True, chunk_size=16)
    assert result.exit_code == 1
    first = result.problems[0]
    assert (first.name, first.req_id, first.step) == ("LookupAnswered", "req-1", 16)
    assert (first.recorded[0].external, first.derived[0].external) == (34, 32)


def test_recorded_issue1969_on_0_3_10_checks_clean(lmcache_runs: Runs) -> None:
    """The fixed release: the recorded log checks clean, every loaded block verified by its
    digest, and kvledger would have answered every lookup alike."""
    report = lmcache_runs("0.3.10")["issue1969+recorded"]
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    digests = result.counts["digests"]
    assert digests["verified"] == digests["loaded"] == 2
    diff = _check(report.log_path, differential=True, chunk_size=16)
    assert diff.exit_code == 0, [p.describe() for p in diff.problems]
    compared = diff.counts["recorded"]["differential"]
    assert compared["lookups_compared"] == 22 and compared["lookups_differing"] == 0


def test_recorded_log_of_the_0_3_10_crash_names_the_retried_lookup(lmcache_runs: Runs) -> None:
    """The log 0.3.10 leaves when vLLM's scheduler dies on its retried lookup (LMCache #2158)
    names the answer that killed it: at step 17 req-1 is offered 32 tokens on top of the 32
    vLLM holds, every one of its 49 tokens and more (full_hit_no_last_token)."""
    report = lmcache_runs("0.3.10")["issue1969_prefix_cache+recorded"]
    assert report.error is not None and report.error.startswith("step 17: AssertionError")
    result = _check(report.log_path)
    assert [(p.name, p.req_id, p.step) for p in result.problems] == [
        ("full_hit_no_last_token", "req-1", 17)
    ]


@pytest.mark.parametrize("version", ["0.4.2", "0.5.6"])
def test_current_releases_recorded_logs_check_clean(lmcache_runs: Runs, version: str) -> None:
    """Current releases, every workload wrapped: the recorded logs break no rule and every
    loaded block's digest matches, and kvledger answers every lookup alike except where the
    two differ by policy (big_chunks, below)."""
    reports = lmcache_runs(version)
    recorded = {name: r for name, r in reports.items() if name.endswith("+recorded")}
    assert len(recorded) >= 7
    for name, report in recorded.items():
        result = _check(report.log_path)
        assert result.exit_code == 0, (name, [p.describe() for p in result.problems])
        digests = result.counts["digests"]
        assert digests["verified"] == digests["loaded"], name
        if not name.startswith("big_chunks"):  # its twin with KV events too
            diff = _check(report.log_path, differential=True, chunk_size=16)
            assert diff.exit_code == 0, (name, [p.describe() for p in diff.problems])


@pytest.mark.parametrize("version", ["0.4.2", "0.5.6"])
def test_differential_on_partial_chunks_is_a_policy_difference(
    lmcache_runs: Runs, version: str
) -> None:
    """False alarms, written down: differences of policy, not bugs. (1) kvledger's hits are
    whole blocks (block_hits), LMCache's whole chunks: a preempted request whose prefix the
    pool holds to 80 tokens (a chunk of 64 and a block of 16) is offered 16 by kvledger and 0 by
    LMCache, which holds only the 64 vLLM still has. (2) With chunks of 64 and
    save_unfull_chunk, LMCache keeps the 26-token tail of a 90-token prompt, so a repeated
    prompt (80 tokens in vLLM's prefix cache) is offered 9 more; kvledger's default pool saves
    a prefill's partial chunk up to its last whole block and would offer 0. The oracle is
    exact, and told LMCache's policy (whole chunks, discard_partial_chunks=False) the
    differential agrees on every lookup."""
    report = lmcache_runs(version)["big_chunks+recorded"]
    assert report.mismatches == [] and report.error is None
    diff = _check(report.log_path, differential=True, chunk_size=64)
    assert diff.exit_code == 1
    first, second = diff.problems[:2]
    assert (first.name, first.req_id, first.step) == ("LookupAnswered", "req-3", 39)
    assert (first.recorded[0].hit, first.recorded[0].external) == (64, 0)
    assert (first.derived[0].hit, first.derived[0].external) == (80, 16)
    assert (second.name, second.req_id, second.step) == ("LookupAnswered", "again-req-0", 58)
    assert (second.recorded[0].hit, second.recorded[0].external) == (89, 9)
    assert (second.derived[0].hit, second.derived[0].external) == (80, 0)
    told = _check(
        report.log_path,
        differential=True,
        chunk_size=64,
        block_hits=False,
        discard_partial_chunks=False,
    )
    assert told.exit_code == 0, [p.describe() for p in told.problems]


@pytest.mark.parametrize("version", ["0.4.2", "0.5.6"])
def test_lmcache_reloads_more_than_vllm_accepted(lmcache_runs: Runs, version: str) -> None:
    """What no rule reports (written down in docs/recording.md): vLLM accepts 9 external
    tokens (80..88) for a repeated prompt, and LMCache's worker copies 26 (64..89): it masks
    only the chunk-aligned part of vLLM's local hit, so it rewrites 16 tokens of a block in
    vLLM's prefix cache and the last token vLLM computes itself. The bytes are the ones
    already there here (the oracle is exact); on a GPU they are whatever another batch
    computed for that prefix."""
    report = lmcache_runs(version)["big_chunks"]
    assert report.claims == [(58, "again-req-0", 9), (58, "again-req-1", 9)]
    assert report.loads == [(58, "again-req-0", 26), (58, "again-req-1", 26)]
    assert report.mismatches == []


@pytest.mark.parametrize("version", ["0.3.9.post2", "0.3.10"])
def test_vllm_0_33_calls_get_kv_events_that_0_3_x_lacks(lmcache_runs: Runs, version: str) -> None:
    """Why the rig gives 0.3.x an empty get_kv_events: without it, vLLM 0.33's own
    LMCacheConnectorV1 raises AttributeError at the first forward pass (and wrapped, the
    very same error reaches vLLM through the recorder). 0.4.2 and 0.5.6 have the method."""
    reports = lmcache_runs(version)
    for name in ("issue1969_as_is", "issue1969_as_is+recorded"):
        error = reports[name].error
        assert error is not None and error.startswith("step 0: AttributeError"), name
        assert "get_kv_events" in error and "lmcache_connector.py" in error, name


# --- LMCache's own KV events, through vLLM's LMCacheConnectorV1 -------------------------------


def _stored(path):
    from kvledger.replay.source import open_log
    from kvledger.tracker import events as ev

    return [e for f in open_log(path).frames() for e in f.events if isinstance(e, ev.InnerStored)]


def test_lmcache_kv_events_split_not_offered(lmcache_runs: Runs) -> None:
    """0.5.6 with enable_kv_events: its engine publishes a CacheStoreEvent per chunk stored,
    vLLM's wrapper turns them into BlockStored, and the recorder logs them. req-1, preempted,
    asks again for its prompt and outputs: LMCache offers the two chunks it stored; explain
    says why not the rest: LMCache never stored it (the prompt's partial chunk and the
    outputs: save_decode_cache off). The log checks clean."""
    from kvledger.replay.explain import explain

    report = lmcache_runs("0.5.6")["issue1969_events+recorded"]
    assert report.clean and report.error is None
    stored = _stored(report.log_path)
    assert [(len(e.hashes), e.block_size, bool(e.parent)) for e in stored] == [
        (1, 16, False),
        (1, 16, True),
    ] * 2
    assert _check(report.log_path).exit_code == 0
    ((preempted_at, who),) = report.preemptions
    (again,) = [a for a in explain(report.log_path).admissions() if a.admission == 2]
    assert (again.request, again.hit["inner"]) == (who, 32)
    assert [(m.start, m.end, m.reason) for m in again.misses] == [
        (32, 48, "inner_never_stored"),
        (48, 49, "new_prefix"),
    ]
    assert (again.misses[0].by, again.misses[0].step) == (who, preempted_at)


def test_lmcache_events_of_a_chunk_stored_twice_in_a_step_are_lost(lmcache_runs: Runs) -> None:
    """Four requests share a 70-token prefix, chunks of 64: each one's store puts the shared
    first chunk again, and LMCache publishes it again (its store has no "already stored"
    check), four identical events in one step. vLLM's LMCacheKVEvents keeps only events seen
    once per worker (KVEventAggregator.get_common_events: count == num_workers), so the first
    chunk is published by none, and every tail names a parent the log never saw stored.
    explain says so and falls back to not_offered; nothing is judged on it."""
    from kvledger.replay.explain import explain

    report = lmcache_runs("0.5.6")["big_chunks_events+recorded"]
    assert report.clean and report.error is None
    stored = _stored(report.log_path)
    assert stored and all(e.block_size == 26 and e.parent for e in stored)
    assert {e.parent for e in stored} == {stored[0].parent}
    assert stored[0].parent not in {h for e in stored for h in e.hashes}
    assert _check(report.log_path).exit_code == 0
    resumed = [a for a in explain(report.log_path).admissions() if a.admission == 2]
    reasons = {m.reason for a in resumed for m in a.misses}
    assert "not_offered" in reasons and not reasons & {"inner_never_stored", "inner_evicted"}
    details = {m.detail for a in resumed for m in a.misses if m.reason == "not_offered"}
    assert details == {f"{len(stored)} of its stores name a parent it never stored: unplaced"}
