"""KVLedgerRecorder under vLLM 0.33's real scheduler (CPU), wrapping vLLM's ExampleConnector
and our KVLedgerConnector, with the KV-content oracle checking every computed token: what the
inner answers reaches vLLM unchanged, what vLLM told it is recorded, a failure of the recording
never reaches vLLM, and an exception of the inner reaches vLLM unchanged."""

from __future__ import annotations

import pytest
from _rigs import PREEMPTING_RECORDED as PREEMPTING
from _rigs import example_spec
from _verdicts import events_of

from kvledger.connector.testing.harness import skip_reason

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

# Repeated prompts: ExampleConnector saves each new prompt whole and loads it back for the
# same prompt again (its only kind of hit). A pool big enough not to preempt.
SMALL = dict(
    num_gpu_blocks=64,
    num_requests=4,
    prompt_len=(20, 60),
    max_tokens=(4, 10),
    shared_prefix=0,
    repeat_prompts=2,
    enable_prefix_caching=False,
)


def _run(tmp_path, **kw):
    from kvledger.connector.testing.recorded import WrappedSpec, run_wrapped

    kw = {**SMALL, **kw}
    if "inner" in kw:
        spec = WrappedSpec(**kw)
    else:  # vLLM's toy file connector, by this vLLM's name and layout
        spec = example_spec(tmp_path / "store", **kw)
    return run_wrapped(spec, log_dir=str(tmp_path / "logs"))


def test_example_connector_wrapped_loads_repeated_prompts_exactly(tmp_path):
    """ExampleConnector saves whole prompts and loads them back for a repeated prompt; wrapped,
    every computed token still holds its oracle value, and the log holds its answers."""
    from kvledger.tracker import events as ev

    report = _run(tmp_path)
    assert [m.describe() for m in report.mismatches] == []
    assert report.leaks == ()
    assert report.finished == report.requests
    events = events_of(report.log_path)
    answers = [e for e in events if isinstance(e, ev.InnerLookupAnswered)]
    asked = [e for e in events if isinstance(e, ev.LookupAsked)]
    assert len(answers) == len(asked) == report.requests
    hits = {e.req_id: e.external for e in answers if e.external > 0}
    # The two repeated prompts hit: the whole prompt but its last token, block aligned.
    assert sorted(hits) == ["again-req-0", "again-req-1"]
    allocated = {e.req_id: e.num_external for e in events if isinstance(e, ev.Allocated)}
    assert all(allocated[r] == n for r, n in hits.items())
    finished = [e for e in events if isinstance(e, ev.InnerFinishedAnswered)]
    assert len(finished) == report.requests and not any(e.delay for e in finished)
    assert not any(isinstance(e, (ev.RecordLost, ev.InnerRaised)) for e in events)


def test_wrapping_changes_nothing_vllm_sees(tmp_path):
    """The same workload with and without the recorder: vLLM schedules the same tokens in the
    same steps, finishes the same requests, and the oracle holds for both."""
    wrapped = _run(tmp_path / "a", record=True)
    bare = _run(tmp_path / "b", record=False)
    assert wrapped.trace == bare.trace
    assert wrapped.mismatches == bare.mismatches == ()
    assert bare.log_path is None and wrapped.log_path is not None


def _raising_harness(tmp_path):
    """vLLM's scheduler with KVLedgerRecorder (logging) over tests/_recorder_inners.py's
    RaisingExample."""
    from kvledger.connector.testing.harness import HarnessConfig, SchedulerHarness
    from kvledger.connector.testing.recorded import kv_transfer_config

    kv = kv_transfer_config(
        "_recorder_inners:RaisingExample",
        {"shared_storage_path": str(tmp_path / "store")},
        record=True,
        log_dir=str(tmp_path / "logs"),
    )
    return SchedulerHarness(HarnessConfig(kv_connector=kv, num_gpu_blocks=32))


def test_inner_exception_reaches_vllm_unchanged(tmp_path):
    """The inner raises in get_num_new_matched_tokens: vLLM gets that very exception object,
    and the log records it (InnerRaised) before it left."""
    import _recorder_inners as inners

    from kvledger.tracker import events as ev

    harness = _raising_harness(tmp_path)
    harness.add_request("req-boom", list(range(10, 50)), 4)
    inners.RaisingExample.raised.clear()
    with pytest.raises(inners.InnerBoom) as caught:
        harness.step()
    assert caught.value is inners.RaisingExample.raised[-1]
    harness.connector.shutdown()
    events = events_of(harness.connector.log_path)
    raised = [e for e in events if isinstance(e, ev.InnerRaised)]
    assert [(e.req_id, e.callback) for e in raised] == [("req-boom", "get_num_new_matched_tokens")]
    assert "InnerBoom: inner refuses req-boom" in raised[0].error


@pytest.mark.parametrize("callback", ["on_new_request", "get_kv_connector_stats"])
def test_every_scheduler_callback_the_inner_raises_from_is_recorded(
    callback, tmp_path, monkeypatch
):
    """As for the lookup above: vLLM gets the inner's own exception from the callbacks whose
    answer the recorder does not record too (``on_new_request``, the scheduler's
    ``get_kv_connector_stats``), and the log says which callback raised what, and for which
    request, before it left (docs/recording.md: anything that raises is an InnerRaised)."""
    import _recorder_inners as inners

    from kvledger.tracker import events as ev

    harness = _raising_harness(tmp_path)
    inners.RaisingExample.raised.clear()
    with pytest.raises(inners.InnerBoom) as caught:
        if callback == "on_new_request":
            harness.add_request("req-early", list(range(10, 50)), 4)
        else:
            harness.add_request("req-0", list(range(10, 50)), 4)
            monkeypatch.setattr(inners.RaisingExample, "stats_boom", True)
            harness.step()
    assert caught.value is inners.RaisingExample.raised[-1]
    harness.connector.shutdown()
    events = events_of(harness.connector.log_path)
    raised = [(e.req_id, e.callback) for e in events if isinstance(e, ev.InnerRaised)]
    rid = "req-early" if callback == "on_new_request" else ""
    assert raised == [(rid, callback)]


def test_recording_failure_never_reaches_vllm(tmp_path, monkeypatch):
    """The recorder cannot read what it records (a broken request object): vLLM's run goes on
    exactly as unwrapped, and the log says which records were lost and why."""
    from kvledger.connector import recording
    from kvledger.tracker import events as ev

    real = recording.SchedulerRecorder.lookup

    def broken(self, request, local_hit, answer):
        if request.request_id == "req-1":
            raise ValueError("cannot read this request")
        return real(self, request, local_hit, answer)

    monkeypatch.setattr(recording.SchedulerRecorder, "lookup", broken)
    wrapped = _run(tmp_path / "a", record=True)
    bare = _run(tmp_path / "b", record=False)
    assert wrapped.trace == bare.trace
    assert wrapped.mismatches == ()
    events = events_of(wrapped.log_path)
    lost = [e for e in events if isinstance(e, ev.RecordLost)]
    assert [(e.req_id, e.callback) for e in lost] == [("req-1", "get_num_new_matched_tokens")]
    assert "cannot read this request" in lost[0].error
    assert wrapped.scheduler_connector.recording.records_lost == 1


def test_unencodable_value_costs_one_record(tmp_path, monkeypatch):
    """A value the log cannot hold (a token id past 2**64, say) costs that record: a
    RecordLost takes its place and every later record is written."""
    from kvledger.connector import recording
    from kvledger.tracker import events as ev

    real = recording.SchedulerRecorder.see

    def huge_token(self, request):
        if request.request_id == "req-2" and request.request_id not in self._requests:
            self._requests[request.request_id] = request
            self.write(ev.RequestAdded(self.step, "req-2", (1 << 64,), ""))
            return "req-2"
        return real(self, request)

    monkeypatch.setattr(recording.SchedulerRecorder, "see", huge_token)
    report = _run(tmp_path)
    assert report.mismatches == ()
    events = events_of(report.log_path)
    lost = [e for e in events if isinstance(e, ev.RecordLost)]
    assert [(e.req_id, e.callback) for e in lost] == [("req-2", "RequestAdded")]
    assert sum(isinstance(e, ev.Finished) for e in events) == report.requests


def test_the_recording_reads_vllms_token_lists_through_the_edge(tmp_path):
    """The steady batch (connector/recording.py) indexes the list behind each request's
    ``all_token_ids`` view; the recording imports no vLLM, so the class vLLM loads hands it the
    edge's reader of that list. Without it every request would be recorded one by one."""
    from kvledger.connector.edge import token_list

    report = _run(tmp_path)
    assert report.scheduler_connector.recording._token_list is token_list


def test_forwards_every_base_method():
    """Every method and property of the installed vLLM's KVConnectorBase_V1 is the
    recorder's own: written out, or generated to forward to the inner."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvledger.connector.recorder import KVLedgerRecorder

    assert not KVLedgerRecorder.__abstractmethods__
    missing = [
        name
        for name, value in vars(KVConnectorBase_V1).items()
        if not name.startswith("__")
        and (callable(value) or isinstance(value, property))
        and name not in ("_get_connector_metadata", "has_connector_metadata", "role")
        and name not in vars(KVLedgerRecorder)
    ]
    assert missing == []


KVLEDGER = "kvledger.connector.vllm:KVLedgerConnector"


def _check(path, **kw):
    from kvledger.replay.replayer import check

    return check(path, **kw)


def test_kvledger_connector_wrapped_is_clean_and_unchanged(tmp_path):
    """Our own connector, wrapped, under preemption: oracle-exact, the same schedule as
    unwrapped, and its recorded log clean, also against kvledger's own decisions (the same
    code deciding on the same inputs: every lookup answered alike)."""
    spec = dict(PREEMPTING, inner=KVLEDGER, layout="flash_attn", extra_config={"chunk_size": 16})
    wrapped = _run(tmp_path / "a", record=True, **spec)
    bare = _run(tmp_path / "b", record=False, **spec)
    assert wrapped.preemptions > 0 and wrapped.resumptions > 0
    assert wrapped.trace == bare.trace
    assert wrapped.mismatches == bare.mismatches == ()
    assert wrapped.leaks == ()
    result = _check(wrapped.log_path, differential=True, chunk_size=16)
    assert [p.describe() for p in result.problems] == []
    assert result.exit_code == 0
    recorded = result.counts["recorded"]
    assert recorded["loads"] > 0
    assert recorded["differential"]["lookups_compared"] == recorded["lookups"] > 0


def test_overclaiming_inner_is_named_by_the_differential(tmp_path):
    """A connector that claims one block more than it holds: vLLM skips computing tokens whose
    KV never arrives (the oracle sees it), and the differential names the first lookup where
    it offered more than kvledger would, from the recorded log alone."""
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    if "invalid_block_ids" not in {f.name for f in dataclasses.fields(KVConnectorOutput)}:
        pytest.skip("this vLLM cannot hear of a failed load (no invalid_block_ids, < 0.11.1)")
    spec = dict(
        PREEMPTING,
        inner="_recorder_inners:OverclaimingKVLedger",
        layout="flash_attn",
        extra_config={"chunk_size": 16},
    )
    report = _run(tmp_path, record=True, **spec)
    result = _check(report.log_path, differential=True, chunk_size=16)
    assert result.exit_code == 1
    first = result.problems[0]
    assert (first.kind, first.name) == ("differential", "LookupAnswered")
    assert first.recorded[0].external == first.derived[0].external + 16
    assert "the wrapped connector offered" in first.detail
    # The lie is real: some request computed on KV that was never loaded.
    assert report.mismatches or report.load_errors


def test_example_connector_under_preemption_mrv2(tmp_path):
    """ExampleConnector under preemption with Model Runner V2 (vLLM 0.33's default): a resumed
    request comes back in scheduled_new_reqs, is offered its saved prompt again (whole blocks,
    last token excluded) and recomputes its output tokens; every computed token holds its
    oracle value and the recorded log is clean."""
    report = _run(tmp_path, **PREEMPTING)
    assert report.preemptions > 0 and report.resumptions > 0
    assert [m.describe() for m in report.mismatches] == []
    result = _check(report.log_path)
    assert [p.describe() for p in result.problems] == []
    assert result.counts["recorded"]["loads"] > 0


def test_example_connector_under_preemption_mrv1_raises_through(tmp_path):
    """With Model Runner V1 a resumed request comes back in scheduled_cached_reqs, and
    ExampleConnector loads a file named by its prompt *and* output tokens, which it never
    saved: FileNotFoundError from its worker. The wrapper lets it through unchanged; the
    scheduler-side log up to that step still checks."""
    with pytest.raises(FileNotFoundError):
        _run(tmp_path, model_runner_v2=False, **PREEMPTING)
    (log,) = (tmp_path / "logs").iterdir()
    result = _check(str(log))
    assert result.problems == []


def test_example_connector_saves_uncomputed_prefill_chunks(tmp_path):
    """ExampleConnector saves a new request's whole prompt in the step that first schedules
    it, though chunked prefill computes only part of it there: the file holds KV that was never
    computed, and the request that later loads it computes on garbage (the oracle sees it). The
    scheduler's facts are all consistent, so no scheduler-side rule names it; the recorder's
    KV-content digests do, from the log alone, naming the request the oracle names."""
    spec = dict(PREEMPTING, max_num_batched_tokens=128, digests="full")
    report = _run(tmp_path, **spec)
    assert report.mismatches
    result = _check(report.log_path)
    assert result.exit_code == 1
    assert {p.name for p in result.problems} == {"digest_mismatch"}
    assert {p.req_id for p in result.problems} <= {m.req_id for m in report.mismatches}
    assert result.counts["digests"]["verified"] > 0
    assert _check(report.log_path, differential=True, chunk_size=16).exit_code == 1


def test_the_inners_kv_events_reach_vllm_and_the_log_alike(tmp_path, monkeypatch):
    """KVLedgerConnector with vLLM's KV events on publishes its pool's stores and evictions
    through take_events. Wrapped, every one still reaches vLLM's publisher, in order, and the
    log holds each as a fact (InnerStored, InnerRemoved) with the same keys, parent and
    tokens."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, NullEventPublisher

    from kvledger.connector.recording import _event_key
    from kvledger.tracker import events as ev

    published = []
    monkeypatch.setattr(
        NullEventPublisher, "publish", lambda self, batch: published.extend(batch.events)
    )
    report = _run(
        tmp_path,
        inner="kvledger.connector.vllm:KVLedgerConnector",
        kv_events=True,
        num_requests=6,
        repeat_prompts=3,
        extra_config={"chunk_size": 32, "host_pool_bytes": 6 * 16384},
    )
    assert report.mismatches == () and report.log_path is not None
    theirs = [e for e in published if getattr(e, "medium", None) == "CPU"]  # not the GPU's
    expected = [
        (
            "stored",
            tuple(_event_key(h) for h in e.block_hashes),
            tuple(e.token_ids),
            b"" if e.parent_block_hash is None else _event_key(e.parent_block_hash),
        )
        if isinstance(e, BlockStored)
        else ("removed", tuple(_event_key(h) for h in e.block_hashes), (), b"")
        for e in theirs
        if isinstance(e, (BlockStored, BlockRemoved))
    ]
    logged = [
        ("stored", e.hashes, e.token_ids, e.parent)
        if isinstance(e, ev.InnerStored)
        else ("removed", e.hashes, (), b"")
        for e in events_of(report.log_path)
        if isinstance(e, (ev.InnerStored, ev.InnerRemoved))
    ]
    assert logged == expected
    assert {kind for kind, *_ in logged} == {"stored", "removed"}  # the pool filled and evicted
