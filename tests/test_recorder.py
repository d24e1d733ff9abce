"""KVLedgerRecorder under vLLM 0.33's real scheduler (CPU), wrapping vLLM's ExampleConnector
and our KVLedgerConnector, with the KV-content oracle checking every computed token: what the
inner answers reaches vLLM unchanged, what vLLM told it is recorded, a failure of the recording
never reaches vLLM, and an exception of the inner reaches vLLM unchanged."""

from __future__ import annotations

import pytest

from connector.testing.harness import skip_reason

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


def _events(path):
    from replay.source import open_log

    return [e for frame in open_log(path).frames() for e in frame.events]


def _run(tmp_path, **kw):
    from connector.testing.recorded import WrappedSpec, run_wrapped

    extra = kw.pop("extra_config", None)
    if extra is None and kw.get("inner", "ExampleConnector").endswith("Example"):
        extra = {"shared_storage_path": str(tmp_path / "store")}
    if extra is None and kw.get("inner", "ExampleConnector") == "ExampleConnector":
        extra = {"shared_storage_path": str(tmp_path / "store")}
    spec = WrappedSpec(**{**SMALL, **kw, "extra_config": extra or {}})
    return run_wrapped(spec, log_dir=str(tmp_path / "logs"))


def test_example_connector_wrapped_loads_repeated_prompts_exactly(tmp_path):
    """ExampleConnector saves whole prompts and loads them back for a repeated prompt; wrapped,
    every computed token still holds its oracle value, and the log holds its answers."""
    from tracker import events as ev

    report = _run(tmp_path)
    assert [m.describe() for m in report.mismatches] == []
    assert report.leaks == ()
    assert report.finished == report.requests
    events = _events(report.log_path)
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


def test_inner_exception_reaches_vllm_unchanged(tmp_path):
    """The inner raises in get_num_new_matched_tokens: vLLM gets that very exception object,
    and the log records it (InnerRaised) before it left."""
    import _recorder_inners as inners

    from connector.testing.harness import HarnessConfig, SchedulerHarness
    from connector.testing.recorded import kv_transfer_config
    from tracker import events as ev

    kv = kv_transfer_config(
        "_recorder_inners:RaisingExample",
        {"shared_storage_path": str(tmp_path / "store")},
        record=True,
        log_dir=str(tmp_path / "logs"),
    )
    harness = SchedulerHarness(HarnessConfig(kv_connector=kv, num_gpu_blocks=32))
    harness.add_request("req-boom", list(range(10, 50)), 4)
    inners.RaisingExample.raised.clear()
    with pytest.raises(inners.InnerBoom) as caught:
        harness.step()
    assert caught.value is inners.RaisingExample.raised[-1]
    harness.connector.shutdown()
    events = _events(harness.connector.log_path)
    raised = [e for e in events if isinstance(e, ev.InnerRaised)]
    assert [(e.req_id, e.callback) for e in raised] == [("req-boom", "get_num_new_matched_tokens")]
    assert "InnerBoom: inner refuses req-boom" in raised[0].error


def test_recording_failure_never_reaches_vllm(tmp_path, monkeypatch):
    """The recorder cannot read what it records (a broken request object): vLLM's run goes on
    exactly as unwrapped, and the log says which records were lost and why."""
    from connector import recorder
    from tracker import events as ev

    real = recorder.SchedulerRecorder.lookup

    def broken(self, request, local_hit, answer):
        if request.request_id == "req-1":
            raise ValueError("cannot read this request")
        return real(self, request, local_hit, answer)

    monkeypatch.setattr(recorder.SchedulerRecorder, "lookup", broken)
    wrapped = _run(tmp_path / "a", record=True)
    bare = _run(tmp_path / "b", record=False)
    assert wrapped.trace == bare.trace
    assert wrapped.mismatches == ()
    events = _events(wrapped.log_path)
    lost = [e for e in events if isinstance(e, ev.RecordLost)]
    assert [(e.req_id, e.callback) for e in lost] == [("req-1", "get_num_new_matched_tokens")]
    assert "cannot read this request" in lost[0].error
    assert wrapped.scheduler_connector.recording.records_lost == 1


def test_unencodable_value_costs_one_record(tmp_path, monkeypatch):
    """A value the log cannot hold (a token id past 2**64, say) costs that record: a
    RecordLost takes its place and every later record is written."""
    from connector import recorder
    from tracker import events as ev

    real = recorder.SchedulerRecorder.see

    def huge_token(self, request):
        if request.request_id == "req-2" and request.request_id not in self._requests:
            self._requests[request.request_id] = request
            self._known[request.request_id] = len(request.prompt_token_ids)
            self.write(ev.RequestAdded(self.step, "req-2", (1 << 64,), ""))
            return "req-2"
        return real(self, request)

    monkeypatch.setattr(recorder.SchedulerRecorder, "see", huge_token)
    report = _run(tmp_path)
    assert report.mismatches == ()
    events = _events(report.log_path)
    lost = [e for e in events if isinstance(e, ev.RecordLost)]
    assert [(e.req_id, e.callback) for e in lost] == [("req-2", "RequestAdded")]
    assert sum(isinstance(e, ev.Finished) for e in events) == report.requests


def test_forwards_every_base_method():
    """Every method and property of the installed vLLM's KVConnectorBase_V1 is the
    recorder's own: written out, or generated to forward to the inner."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector.recorder import KVLedgerRecorder

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
