"""One value the log cannot hold costs one record, never the rest of the run's audit trail,
and never a log that `kvledger check` calls clean. Integer-likes (numpy, torch) are ints."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

CFG = TrackerConfig(block_size=4, chunk_size=8, num_slots=16)


def _run(path: Path, prompts: dict[str, list[object]]) -> Tracker:
    """Each request: added, looked up, allocated, scheduled whole, its saves confirmed."""
    t = Tracker(CFG, log=LogWriter(path, CFG.to_dict(), fsync="never"))
    for step, (rid, prompt) in enumerate(prompts.items()):
        t.add_request(rid, prompt)  # type: ignore[arg-type]
        ext = t.lookup(rid, 0, prompt)  # type: ignore[arg-type]
        blocks = list(range(step * 4, step * 4 + 3))
        t.allocated(rid, blocks, ext)
        t.scheduled(rid, num_computed=ext, num_scheduled=len(prompt) - ext,
                    all_token_ids=prompt, block_ids=blocks, admission=ev.Admission.NEW)  # type: ignore[arg-type]  # fmt: skip
        state = t.state(rid)
        if state is not None and state.save.pending:
            t.save_done(rid, [k for k, _ in state.save.pending])
        t.end_step()
    t.close()
    return t


def _logged(path: Path) -> list[ev.Event]:
    return [e for frame in LogReader(path) for e in frame.events]


def test_an_unencodable_token_costs_its_record_and_the_loss_is_recorded(tmp_path: Path) -> None:
    from kvledger import replay

    path = tmp_path / "run.kvlog"
    t = _run(
        path,
        {
            "a": list(range(100, 110)),
            "bad": [*range(200, 209), 2**64],  # beyond any msgpack integer
            "c": list(range(100, 110)),
        },
    )
    assert t.log_error is None  # the log was never turned off
    events = _logged(path)
    lost = [e for e in events if isinstance(e, ev.ViolationRecorded) and e.rule == "record_lost"]
    # each record that carries the value is lost, and only those
    assert [(v.req_id, v.step, v.event) for v in lost] == [
        ("bad", 1, "RequestAdded"),
        ("bad", 1, "LookupAsked"),
        ("bad", 1, "Scheduled"),
    ]
    assert any(isinstance(e, ev.Allocated) and e.req_id == "bad" for e in events)
    assert "cannot encode a RequestAdded of step 1" in lost[0].detail
    # every other request's trail is whole: c even loads what a saved
    for rid in ("a", "c"):
        kinds = [type(e).__name__ for e in events if e.req_id == rid]
        assert kinds[:4] == ["RequestAdded", "LookupAsked", "LookupAnswered", "Allocated"]
        assert "Scheduled" in kinds
    assert any(isinstance(e, ev.SaveDone) and e.req_id == "a" for e in events)
    assert any(isinstance(e, ev.LoadPlanned) and e.req_id == "c" and e.end > 0 for e in events)
    result = replay.check(path)
    assert result.exit_code == 1  # never "clean"
    assert result.problems and result.problems[0].req_id == "bad"
    assert "record_lost" in result.problems[0].describe()


def test_numpy_and_torch_integers_are_ints(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from kvledger import replay

    path = tmp_path / "run.kvlog"
    plain = list(range(100, 110))
    t = _run(
        path,
        {
            "np": list(np.arange(100, 110, dtype=np.int64)),
            "torch": list(torch.arange(100, 110)),
            "plain": plain,
        },
    )
    assert t.log_error is None and not t.violations
    added = [e for e in _logged(path) if isinstance(e, ev.RequestAdded)]
    assert [e.prompt_token_ids for e in added] == [tuple(plain)] * 3
    assert all(type(x) is int for e in added for x in e.prompt_token_ids)
    assert replay.check(path).exit_code == 0


def test_a_non_integer_token_is_refused_by_name() -> None:
    t = Tracker(CFG)
    with pytest.raises(TypeError, match=r"expected integers, got float 1\.5"):
        t.add_request("r", [1, 1.5])  # type: ignore[list-item]
    assert t.state("r") is None


def test_a_request_id_the_log_cannot_hold_costs_its_records_not_the_log(tmp_path: Path) -> None:
    """A lone surrogate in a request id (a JSON request id can carry one into vLLM): UTF-8
    cannot hold it, so each record naming it is lost. The loss is written with the id
    escaped, and the request gives back the number its lost RequestAdded took, so the
    steady steps of the requests after it still name them: their trail checks whole."""
    from _replay_logs import Sim, prompt

    from kvledger import replay

    path = tmp_path / "run.kvlog"
    cfg = TrackerConfig(block_size=16, chunk_size=32, num_slots=64)
    t = Tracker(cfg, log=LogWriter(path, cfg.to_dict(), fsync="never"))
    sim = Sim(t)
    bad = "bad-\ud800"
    ids = ("ok-1", bad, "ok-2")
    for seed, rid in enumerate(ids):
        sim.add(rid, prompt(40, seed))
        sim.admit(rid)
    sim.end_step()
    for _ in range(20):
        sim.deliver()
        for rid in ids:
            sim.decode(rid)
        sim.end_step()
    for rid in ids:
        sim.finish(rid)
    sim.end_step()
    t.close()
    assert t.log_error is None  # the log was never turned off
    events = _logged(path)
    lost = [e for e in events if isinstance(e, ev.ViolationRecorded) and e.rule == "record_lost"]
    assert lost and {v.req_id for v in lost} == {"bad-\\ud800"}
    # ok-2 took the number after ok-1's, as a reader numbers them, and decoded steadily
    steady = [e for e in events if isinstance(e, ev.StepDecoded)]
    assert steady and all(sorted(e.nums) == [0, 1] for e in steady)
    for rid in ("ok-1", "ok-2"):
        assert any(isinstance(e, ev.Finished) and e.req_id == rid for e in events)
    result = replay.check(path)
    assert result.exit_code == 1  # never "clean"
    assert {p.req_id for p in result.problems} == {"bad-\\ud800"}


def test_a_request_id_the_recorders_log_cannot_hold_costs_its_records_not_the_log(
    tmp_path: Path,
) -> None:
    """The same lone surrogate reaching KVLedgerRecorder's bookkeeping: each record naming it
    is lost, and its loss is written with the id escaped. Before, the loss record could not be
    written either, and that turned the recorder's log off for the rest of the run."""
    from fakes import CachedRequestData, FakeRequest, NewRequestData, SchedulerOutput

    from kvledger.connector.recording import SchedulerRecorder
    from kvledger.replay.replayer import check

    ids = ("ok-1", "bad-\ud800", "ok-2")
    path = tmp_path / "recorded.kvlog"
    rec = SchedulerRecorder(LogWriter(path, {}, fsync="never"))
    requests = [FakeRequest(rid, list(range(7 * i, 7 * i + 8))) for i, rid in enumerate(ids)]
    for r in requests:
        rec.see(r)
    rec.scheduled(
        SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(r.request_id, r.prompt_token_ids, ([10 + i, 20 + i],), 0)
                for i, r in enumerate(requests)
            ],
            num_scheduled_tokens={r.request_id: 8 for r in requests},
        )
    )
    rec.end_step()
    for step in range(1, 4):
        cached = CachedRequestData()
        for r in requests:
            r.all_token_ids.append(step)
            cached.add(r.request_id, 7 + step, None)
        rec.scheduled(
            SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={r: 1 for r in ids})
        )
        rec.end_step()
    rec.close()
    assert rec.log_error is None and rec.records_lost > 0
    events = _logged(path)
    lost = [e for e in events if isinstance(e, ev.RecordLost)]
    assert lost and {e.req_id for e in lost} == {"bad-\\ud800"}
    assert [e.req_id for e in events if isinstance(e, ev.RequestAdded)] == ["ok-1", "ok-2"]
    # The log was on to the end: the last step's decode is in it, and the log is complete.
    assert any(e.step == 3 and not isinstance(e, ev.RecordLost) for e in events)
    result = check(path)  # what the lost records would have shown is not judged
    assert result.exit_code == 0 and not result.problems, result.exit_code
