"""KV-content digests under vLLM 0.33's real scheduler (the harness and the KV oracle): clean
runs check clean with loads verified; a load that writes wrong bytes, or none, while reporting
success, is found by ``kvledger check`` of the log alone."""

from __future__ import annotations

import io

import attrs
import pytest
from _replay_logs import copy_log
from _verdicts import digests_by_key, events_of

from kvledger.connector.testing.harness import skip_reason
from kvledger.replay.commands.check import render
from kvledger.replay.whatif import whatif

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]


def _run(tmp_path, digests: str, fault=None, layout: str = "flash_attn", **engine):
    from kvledger.connector.testing.run import RunSpec, run

    spec = RunSpec(extra_config={"chunk_size": 32, "digests": digests}, layout=layout, **engine)
    return run(spec, log_dir=str(tmp_path), load_fault=fault)


def _check(path):
    from kvledger.replay.replayer import check

    return check(path)


@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer"])
def test_a_clean_run_checks_clean_with_its_loads_verified(tmp_path, mode: str, layout: str) -> None:
    report = _run(tmp_path, mode, layout=layout)
    assert report.ok, (report.violations, report.mismatches)
    assert report.tokens_loaded > 0
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    digests = result.counts["digests"]
    assert digests["verified"] > 0 and digests["verified"] == digests["loaded"]
    assert digests["digested"] > 0 and not digests["unverifiable"]
    assert _stats(report.log_path).digests == digests  # kvledger stats counts the same


def test_async_scheduling_digests_the_blocks_decode_fills(tmp_path) -> None:
    """Under async scheduling the token sampled last is not known when a step is planned: a
    block a decode step fills is digested a step later, so every full block still is."""
    from kvledger.replay.source import open_log

    sync = _run(tmp_path / "sync", "full")
    late = _run(tmp_path / "async", "full", async_scheduling=True)
    assert late.ok and sync.ok
    result = _check(late.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.counts["digests"]["verified"] == result.counts["digests"]["loaded"] > 0

    def digested(path) -> set[tuple[str, int]]:
        return {
            (e.req_id, e.start + i)
            for frame in open_log(path).frames()
            for e in frame.events
            if isinstance(e, _ev().BlockDigested)
            for i in range(len(e.keys))
        }

    # The same blocks as without async scheduling, but for the last block of a request,
    # which may fill in its final step (its last token id is never learned).
    missing = digested(sync.log_path) - digested(late.log_path)
    assert len(missing) <= sync.requests


def test_off_records_no_digest(tmp_path) -> None:
    report = _run(tmp_path, "off")
    result = _check(report.log_path)
    assert result.exit_code == 0
    assert "BlockDigested" not in result.counts["by_type"]
    assert result.counts["digests"]["digested"] == 0


@pytest.mark.parametrize(
    ("fault", "rule"), [("corrupt", "digest_mismatch"), ("skip", "load_unchanged")]
)
@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_a_silent_bad_load_is_found_by_check_of_the_log(
    tmp_path, fault: str, rule: str, mode: str
) -> None:
    """Every load reports success; ``corrupt`` loads changed bytes, ``skip`` loads nothing."""
    report = _run(tmp_path, mode, fault=lambda req_id, chunk: fault)
    assert report.mismatches  # the oracle sees the wrong KV too (the log alone must, below)
    result = _check(report.log_path)
    assert result.exit_code == 1
    first = result.problems[0]
    assert (first.kind, first.name) == ("violation", rule)
    events = events_of(report.log_path)
    loads = [e for e in events if isinstance(e, _ev().LoadDigested)]
    assert (first.req_id, first.step) == (loads[0].req_id, loads[0].judged_step)
    # Stamped at the step that planned the load, not the next one, whose output brought the
    # worker's report (the LoadDigested's own step).
    planned = [
        e.step
        for e in events
        if isinstance(e, _ev().LoadPlanned) and e.req_id == first.req_id and e.keys
    ]
    assert first.step in planned and loads[0].step == first.step + 1
    detail = dict(kv.split("=", 1) for kv in first.detail.split(","))
    assert int(detail["block"]) == loads[0].start
    assert detail["key"] == loads[0].keys[0].hex()
    if rule == "digest_mismatch":
        assert detail["found"] == f"{loads[0].after[0]:016x}" != detail["expected"]
    assert {p.name for p in result.problems} == {rule}
    assert result.counts["digests"]["verified"] == 0
    assert _stats(report.log_path).digests == result.counts["digests"]
    if fault == "corrupt" and mode == "full":
        # The digests are SQL's 64-bit ints: the tables of a log that holds them (Arrow,
        # DuckDB) read every one, and find the block check named.
        pytest.importorskip("duckdb")
        from kvledger.replay.sql import query

        rows = query(
            [report.log_path],
            f"select request, step, start, after[1] from ev_load_digested "
            f"where request = '{first.req_id}' order by step limit 1",
        ).rows
        assert rows == [(loads[0].req_id, loads[0].step, loads[0].start, loads[0].after[0])]


def test_without_digests_the_same_bad_load_checks_clean(tmp_path) -> None:
    """What the digests add: the log of a connector that loads the wrong bytes and says it
    succeeded holds nothing else that is wrong."""
    report = _run(tmp_path, "off", fault=lambda req_id, chunk: "corrupt")
    assert report.mismatches
    assert _check(report.log_path).exit_code == 0


def _stats(path):
    from kvledger.replay.summary import stats

    return stats(path)


def _ev():
    from kvledger.tracker import events

    return events


# --- a wrapped connector (KVLedgerRecorder): the same digests, from the recorded events ----


def _wrapped(tmp_path, inner: str, digests: str):
    from kvledger.connector.testing.recorded import WrappedSpec, run_wrapped

    extra = (
        {"chunk_size": 32}
        if inner.startswith("kvledger.connector.")
        else {"shared_storage_path": str(tmp_path / "store")}
    )
    spec = WrappedSpec(inner=inner, digests=digests, extra_config=extra)
    return run_wrapped(spec, log_dir=str(tmp_path / "logs"))


@pytest.mark.parametrize(
    ("inner", "mode"),
    [("ExampleConnector", "full"), ("kvledger.connector.vllm:KVLedgerConnector", "sampled")],
)
def test_a_wrapped_connector_checks_clean_with_its_loads_verified(
    tmp_path, inner: str, mode: str
) -> None:
    report = _wrapped(tmp_path, inner, mode)
    assert report.mismatches == ()
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    digests = result.counts["digests"]
    assert digests["verified"] > 0 and digests["verified"] == digests["loaded"]


@pytest.mark.parametrize(
    ("inner", "rule"),
    [
        ("_digest_inners:CorruptingExample", "digest_mismatch"),
        ("_digest_inners:SkippingExample", "load_unchanged"),
    ],
)
def test_a_wrapped_connectors_silent_bad_load_is_found_by_check(
    tmp_path, inner: str, rule: str
) -> None:
    """vLLM's ExampleConnector, with a fault it does not report: the recorded log alone names
    the request and the step of the load."""
    report = _wrapped(tmp_path, inner, "full")
    assert report.mismatches  # the oracle agrees that the KV is wrong
    result = _check(report.log_path)
    assert result.exit_code == 1
    events = events_of(report.log_path)
    loads = [e for e in events if isinstance(e, _ev().LoadDigested)]
    named = [(p.name, p.req_id, p.step) for p in result.problems if p.name == rule]
    assert named and named[0] == (rule, loads[0].req_id, loads[0].judged_step)
    # The step vLLM scheduled the load (the admission after an allocation with external
    # tokens), one before the step whose output carried the worker's digests.
    admitted = [
        e.step
        for e in events
        if isinstance(e, _ev().Scheduled)
        and e.req_id == named[0][1]
        and e.admission != _ev().Admission.RUNNING
    ]
    assert named[0][2] in admitted and loads[0].step == named[0][2] + 1


def test_a_wrapped_connectors_failed_load_records_no_digest_of_what_was_computed_over_it(
    tmp_path,
) -> None:
    """vLLM's ExampleConnector loading nothing and reporting every block it was to load as a
    load error: the repeated prompts' forwards run over a prefix that is not there (the rig
    writes their KV poisoned) and vLLM recomputes them. No digest of those poisoned blocks is
    recorded as its key's (it would verify a later load of the same wrong bytes): every key
    of the log has one digest, that of its recomputed, correct bytes. (Prompts of 64 tokens:
    the failed load covers blocks 0 to 2, and the forward over it fills block 3.) The step
    after, which async scheduling schedules before vLLM hears of the failure, is
    tests/test_digests.py's: vLLM 0.33's own recovery keeps that step's placeholder token,
    and the oracle cannot tell the two apart."""
    from kvledger.connector.testing.recorded import WrappedSpec, run_wrapped

    spec = WrappedSpec(
        inner="_digest_inners:FailingExample",
        digests="full",
        extra_config={"shared_storage_path": str(tmp_path / "store")},
        prompt_len=(64, 64),
    )
    report = run_wrapped(spec, log_dir=str(tmp_path / "logs"))
    assert report.mismatches == ()  # vLLM recomputed what failed
    assert report.load_errors > 0
    events = events_of(report.log_path)
    failed = {e.step for e in events if isinstance(e, _ev().InnerLoadErrors) and e.block_ids}
    assert failed
    digests = digests_by_key(events)
    assert digests and all(len(d) == 1 for d in digests.values()), [
        len(d) for d in digests.values()
    ]
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]


# --- a digest that fails: a recorded fact, and the run goes on -----------------------------


@pytest.mark.parametrize("who", ["connector", "recorder"])
def test_a_worker_digest_that_fails_is_a_record_lost_in_the_log(
    tmp_path, monkeypatch, who: str
) -> None:
    """torch raising in the worker's digests (every third digest call, from the tenth on)
    costs those digests only: the run goes on and its output is right, its log says which
    digests are missing and why (a RecordLost, callback ``digest_after_forward`` or
    ``digest_before_load``, naming the rank and the error), and ``kvledger check`` finds
    nothing broken. Before, only the worker's structlog said it."""
    from kvledger.connector.digests import BlockDigester

    real = BlockDigester.digest
    calls = {"n": 0}

    def flaky(self, blocks):
        calls["n"] += 1
        if calls["n"] >= 10 and calls["n"] % 3 == 0:
            raise RuntimeError("CUDA error: an illegal memory access (injected)")
        return real(self, blocks)

    monkeypatch.setattr(BlockDigester, "digest", flaky)
    if who == "connector":
        report = _run(tmp_path, "full")
        assert report.ok, (report.violations, report.mismatches)
    else:
        report = _wrapped(tmp_path, "ExampleConnector", "full")
        assert report.mismatches == ()
    assert calls["n"] >= 12
    lost = [e for e in events_of(report.log_path) if isinstance(e, _ev().RecordLost)]
    assert lost, "no RecordLost for the failed digests"
    assert {e.callback for e in lost} <= {"digest_after_forward", "digest_before_load"}
    assert all(e.error.startswith("rank 0: RuntimeError: CUDA error") for e in lost)
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.counts["by_type"]["RecordLost"] == len(lost)
    assert result.counts["digests"]["digested"] > 0  # the others were recorded
    text = io.StringIO()
    render(result, text)
    assert f"  lost      {len(lost)} records the run could not make (RecordLost" in text.getvalue()
    # kvledger whatif replays the scheduler's facts, none of which is missing: no caveat.
    # The same records under a scheduler callback's name are one each.
    changes = {"num_slots": 4}
    assert whatif(report.log_path, changes).lost_records == 0
    other = tmp_path / "facts-lost.kvlog"
    copy_log(
        report.log_path,
        other,
        lambda e: (
            attrs.evolve(e, callback="build_connector_meta")
            if isinstance(e, _ev().RecordLost)
            else e
        ),
    )
    assert whatif(other, changes).lost_records == len(lost)


def test_a_digest_plan_that_fails_is_a_record_lost_in_the_connectors_log(
    tmp_path, monkeypatch
) -> None:
    """KVLedgerConnector's scheduler side failing to plan one request's digests (its facts
    unreadable) leaves that request undigested and says so in the log: a RecordLost with
    callback ``digest_plan`` (the recorder's name for its own plan's failure), the request
    named in its text. The run and the verdict are untouched."""
    from kvledger.tracker.digests import DigestPlanner

    real = DigestPlanner.scheduled
    failed: list[str] = []

    def flaky(self, req_id, **kw):
        if not failed and kw.get("num_scheduled", 0) > 1:  # the first prefill
            failed.append(req_id)
            raise TypeError("a block table vLLM never gives (injected)")
        return real(self, req_id, **kw)

    monkeypatch.setattr(DigestPlanner, "scheduled", flaky)
    report = _run(tmp_path, "full")
    assert report.ok, (report.violations, report.mismatches)
    assert failed
    lost = [e for e in events_of(report.log_path) if isinstance(e, _ev().RecordLost)]
    # Named in the text: a record of the request would be folded into its state.
    assert [(e.req_id, e.callback) for e in lost] == [("", "digest_plan")]
    assert lost[0].error == f"{failed[0]}: TypeError: a block table vLLM never gives (injected)"
    result = _check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
