"""LMCache's real vLLM v1 adapter under vLLM 0.33's real scheduler, checked by the KV-content
oracle (connector/testing/lmcache.py). Each pinned LMCache release runs in its own child
process (``make lmcache`` installs them under build/); only its storage engine, lookup client
and GPU/server plumbing are replaced. The facts below are measured on the real adapters."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from connector.testing.harness import skip_reason
from tests._lmcache import require_lmcache

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

Runs = Callable[[str], dict]


@pytest.fixture(scope="module")
def lmcache_runs() -> Runs:
    """Every rig workload against a version, run once per module (one child process each:
    importing vLLM and LMCache is most of its ~40 s)."""
    from connector.testing.lmcache import WORKLOADS, run_version

    cache: dict[str, dict] = {}

    def get(version: str) -> dict:
        require_lmcache([version])
        if version not in cache:
            cache[version] = run_version(version, list(WORKLOADS))
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
