"""``kvledger diff`` relaxed: ``--ignore FIELDS`` leaves fields out of the comparison, and
``--order async`` compares a run under vLLM's async scheduling with one under sync scheduling
without flagging what async scheduling legitimately moves (the worker's reports a step later,
a waiting request asking once more), while still finding what differs. On synthetic logs and
on logs of vLLM's real scheduler (``AsyncScheduler`` under async scheduling)."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import attrs
import pytest
from _replay_logs import SMALL, copy_log

from kvledger.replay import cli
from kvledger.replay.divergence import diff, ignorable_fields
from kvledger.tracker import events as ev


@functools.cache
def _runs(root: str) -> dict[str, Path]:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvledger.connector.testing.run import RunSpec, run

    out = {}
    for name, async_scheduling in (("sync", False), ("async", True)):
        d = Path(root) / name
        spec = RunSpec(**SMALL, enable_prefix_caching=False, async_scheduling=async_scheduling)
        report = run(spec, log_dir=str(d))
        assert report.ok, report
        assert report.preemptions > 0 and report.tokens_loaded > 0  # waits, loads, saves
        out[name] = d
    return out


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(f"vLLM's scheduler is not usable: {reason}")
    return _runs(str(tmp_path_factory.getbasetemp() / "replay-sync-async"))


# --- sync against async, vLLM's real scheduler ----------------------------------------------


def test_sync_against_async_differs_only_in_order(real: dict[str, Path], capsys) -> None:
    strict = diff(real["sync"], real["async"])
    # The strict order flags requests whose reports arrived a step later, or who waited a
    # step more or less: not a difference in what happened.
    assert not strict.identical and strict.per_request
    assert {d.kind for d in strict.per_request.values()} == {"differ"}
    relaxed = diff(real["sync"], real["async"], order="async")
    assert relaxed.identical, [d.describe() for d in relaxed.per_request.values()]
    assert relaxed.order == "async" and len(relaxed.matched) == len(strict.matched)
    assert cli.main(["diff", str(real["sync"]), str(real["async"]), "--order", "async"]) == 0
    out = capsys.readouterr().out
    assert "compared: async order" in out
    assert "identical: every request has the same progress and the same reports" in out
    assert cli.main(["diff", str(real["sync"]), str(real["async"])]) == 1


def _alter_one(src: Path, dst: Path, cls: type[ev.Event], change: dict) -> str:
    """Copy the log with the first event of type ``cls`` changed; returns its request."""
    seen: list[str] = []

    def alter(e: ev.Event) -> ev.Event:
        if type(e) is cls and not seen:
            seen.append(e.req_id)
            return attrs.evolve(e, **change)
        return e

    segments = sorted(src.iterdir())
    assert len(segments) == 1
    copy_log(segments[0], dst, alter)
    assert seen
    return seen[0]


@pytest.mark.parametrize(
    ("cls", "change", "stream", "fields"),
    [
        (ev.LookupAnswered, {"hit": 16, "external": 16}, "progress", ("hit", "external")),
        (ev.SaveDone, {"keys": ()}, "reports", ("keys",)),
        (ev.Finished, {"reason": "abort"}, "progress", ("reason",)),
    ],
)
def test_the_async_order_still_finds_what_differs(
    real: dict[str, Path], tmp_path: Path, cls, change, stream, fields
) -> None:
    changed = tmp_path / "changed.kvlog"
    rid = _alter_one(real["async"], changed, cls, change)
    r = diff(real["sync"], changed, order="async")
    assert not r.identical and list(r.per_request) == [rid]
    d = r.per_request[rid]
    assert (d.kind, d.stream, d.fields) == ("differ", stream, fields)
    assert type(d.b.event) is cls
    assert f"of its {stream}" in d.describe()


def test_the_async_order_finds_a_missing_report(real: dict[str, Path], tmp_path: Path) -> None:
    dropped: list[ev.Event] = []

    def drop(e: ev.Event) -> ev.Event | None:
        if isinstance(e, ev.LoadDone) and not dropped:
            dropped.append(e)
            return None
        return e

    changed = tmp_path / "dropped.kvlog"
    copy_log(next(real["async"].iterdir()), changed, drop)
    r = diff(real["sync"], changed, order="async")
    d = r.per_request[dropped[0].req_id]
    assert d.stream == "reports" and type(d.a.event) is ev.LoadDone
    assert d.b is None or type(d.b.event) is not ev.LoadDone


def test_a_lookup_answered_differently_while_waiting_is_not_folded(
    synthetic_log: Path, tmp_path: Path
) -> None:
    """req-b waits at step 4 (a lookup again); a different answer there is a difference."""

    def alter(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.LookupAnswered) and e.req_id == "req-b" and e.step == 4:
            return attrs.evolve(e, hit=32, external=32)
        return e

    changed = tmp_path / "changed.kvlog"
    copy_log(synthetic_log, changed, alter)
    r = diff(synthetic_log, changed, order="async")
    assert list(r.per_request) == ["req-b"]
    assert r.first is not None and r.first.fields == ("hit", "external")
    assert diff(synthetic_log, synthetic_log, order="async").identical


# --- --ignore -------------------------------------------------------------------------------


def test_ignored_fields_are_left_out(synthetic_log: Path, tmp_path: Path, capsys) -> None:
    def move(e: ev.Event) -> ev.Event:
        if isinstance(e, (ev.SavePlanned, ev.LoadPlanned)) and e.slots:
            return attrs.evolve(e, slots=tuple(s + 7 for s in e.slots))
        if isinstance(e, ev.Allocated) and e.req_id == "req-c":
            return attrs.evolve(e, block_ids=tuple(b + 100 for b in e.block_ids))
        return e

    moved = tmp_path / "moved.kvlog"
    copy_log(synthetic_log, moved, move)
    r = diff(synthetic_log, moved)
    assert {d.fields for d in r.per_request.values()} <= {("slots",), ("block_ids",)}
    assert r.first is not None and r.first.fields == ("slots",)
    assert diff(synthetic_log, moved, ignore=["slots"]).per_request.keys() == {"req-c"}
    both = diff(synthetic_log, moved, ignore=["block_ids", "slots"])
    assert both.identical and both.ignored == ("block_ids", "slots")
    argv = ["diff", str(synthetic_log), str(moved)]
    assert cli.main(argv) == 1
    capsys.readouterr()
    assert cli.main([*argv, "--ignore", "block_ids,slots", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical"] and doc["ignored"] == ["block_ids", "slots"]
    assert cli.main([*argv, "--ignore", "block_ids", "--ignore", "slots"]) == 0
    assert "ignoring block_ids, slots" in capsys.readouterr().out


def test_an_unknown_field_is_exit_2_listing_the_valid_ones(synthetic_log: Path, capsys) -> None:
    assert (
        cli.main(["diff", str(synthetic_log), str(synthetic_log), "--ignore", "slots,blocks_ids"])
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert re.search(r"cannot ignore 'blocks_ids': not a field of any event; valid: ", captured.err)
    assert all(name in captured.err for name in ("block_ids", "slots", "keys", "hit"))
    assert {"block_ids", "slots", "keys", "num_scheduled"} <= set(ignorable_fields())
    with pytest.raises(ValueError, match="unknown order"):
        diff(synthetic_log, synthetic_log, order="loose")
