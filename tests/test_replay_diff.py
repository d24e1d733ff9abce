"""``replay.diff``: the first divergence between two logs, per request and overall, with requests
aligned by id, by prompt and arrival order, or by id without vLLM's random suffix. On
synthetic logs written by a real Tracker and LogWriter, and on logs of vLLM's real scheduler."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest
from _logfiles import torn_copy
from _replay_logs import copy_log, suffixed, write_log

from kvledger import replay
from kvledger.replay import cli
from kvledger.replay.divergence import diff
from kvledger.replay.source import open_log
from kvledger.tracker import events as ev


def other(tmp_path: Path, name: str = "other.kvlog", **kw) -> Path:
    path = tmp_path / name
    write_log(path, **kw)
    return path


# --- no divergence --------------------------------------------------------------------------


def test_a_log_against_itself_is_identical(synthetic_log: Path) -> None:
    r = diff(synthetic_log, synthetic_log)
    assert r.identical and r.first is None and r.per_request == {}
    assert r.unmatched_a == r.unmatched_b == ()
    assert r.events_a == r.events_b == replay.stats(synthetic_log).events
    assert r.aligned_by == {"id": 4, "prompt": 0, "suffix": 0}
    assert r.config_changes == {}


def test_two_runs_of_the_same_workload_are_identical(synthetic_log: Path, tmp_path: Path) -> None:
    """Run ids, creation times and frame wall clocks differ; the events do not."""
    r = diff(synthetic_log, other(tmp_path))
    assert r.identical


def test_a_split_log_equals_the_single_file(synthetic_log: Path, tmp_path: Path) -> None:
    split = tmp_path / "split"
    split.mkdir()
    write_log(split / "run.kvlog", rotate_bytes=400)
    assert len(list(split.iterdir())) > 2
    assert diff(synthetic_log, split).identical


# --- one event altered at a known step ------------------------------------------------------


def test_one_altered_event_is_found_at_its_step_and_request(
    synthetic_log: Path, tmp_path: Path
) -> None:
    def alter(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.LookupAnswered) and e.req_id == "req-b" and e.step == 5:
            return attrs.evolve(e, hit=48, external=48)
        return e

    r = diff(synthetic_log, other(tmp_path, alter=alter))
    assert not r.identical
    assert list(r.per_request) == ["req-b"]
    d = r.first
    assert d is not None and d is r.per_request["req-b"]
    assert (d.request_a, d.request_b, d.kind) == ("req-b", "req-b", "differ")
    assert (d.step_a, d.step_b) == (5, 5)
    assert d.fields == ("hit", "external")
    assert isinstance(d.a.event, ev.LookupAnswered) and d.a.event.hit == 64
    assert d.b.event.hit == 48
    # Its place among the request's events, and the events both logs agree on before it.
    rows = replay.show(synthetic_log, "req-b")
    assert rows[d.position].index == d.a.index == d.b.index
    assert [c.index for c in d.context] == [r.index for r in rows[d.position - 3 : d.position]]


def test_a_dropped_event_is_missing_and_an_added_one_extra(
    synthetic_log: Path, tmp_path: Path
) -> None:
    def drop(e: ev.Event) -> ev.Event | None:
        return None if isinstance(e, ev.LoadDone) and e.req_id == "req-c" else e

    r = diff(synthetic_log, other(tmp_path, alter=drop))
    d = r.per_request["req-c"]
    # c's LoadDone (step 8) is missing in B: B has c's next event at that position instead.
    assert d.kind == "differ" and d.fields == ("type",)
    assert (type(d.a.event).__name__, d.step_a) == ("LoadDone", 8)
    assert (type(d.b.event).__name__, d.step_b) == ("StepDecoded", 8)

    # A log that stops early lacks the tail of every request still running.
    shorter = tmp_path / "shorter.kvlog"
    copy_log(synthetic_log, shorter, lambda e: None if e.step >= 9 else e)
    r = diff(synthetic_log, shorter)
    assert {k: v.kind for k, v in r.per_request.items()} == {
        "req-b": "missing",
        "req-c": "missing",
        "req-d": "missing",
    }
    assert r.first is not None and r.first.step_a == 9 and r.first.b is None
    r = diff(shorter, synthetic_log)
    assert {v.kind for v in r.per_request.values()} == {"extra"}
    assert r.first is not None and r.first.step_b == 9


def test_the_earliest_divergence_comes_first(synthetic_log: Path, tmp_path: Path) -> None:
    def alter(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.LookupAnswered) and e.req_id == "req-c":
            return attrs.evolve(e, hit=0)
        if isinstance(e, ev.Finished) and e.req_id == "req-a":
            return attrs.evolve(e, reason="abort")
        return e

    r = diff(synthetic_log, other(tmp_path, alter=alter))
    assert list(r.per_request) == ["req-a", "req-c"]
    assert r.first is r.per_request["req-a"]
    assert r.first.step == 6 and r.first.fields == ("reason",)
    assert r.per_request["req-c"].step == 7 and r.per_request["req-c"].fields == ("hit",)


def test_a_decode_step_missing_from_step_decoded_is_found(
    synthetic_log: Path, tmp_path: Path
) -> None:
    """StepDecoded names requests by number: diff compares it as each request's own event."""
    late = [e for f in open_log(synthetic_log).frames() for e in f.events if e.step == 9]
    step9 = next(e for e in late if isinstance(e, ev.StepDecoded))
    c_num = 0  # req-c took number 0 when req-a retired

    def drop_c(e: ev.Event) -> ev.Event:
        if e == step9:
            return attrs.evolve(e, nums=tuple(n for n in e.nums if n != c_num))
        return e

    changed = tmp_path / "changed.kvlog"
    copy_log(synthetic_log, changed, drop_c)
    r = diff(synthetic_log, changed)
    assert list(r.per_request) == ["req-c"]
    d = r.first
    assert d is not None and (d.step_a, d.step_b) == (9, 10)
    assert (type(d.a.event).__name__, type(d.b.event).__name__) == ("StepDecoded", "Finished")


def test_a_changed_prompt_is_found_at_its_first_event(synthetic_log: Path, tmp_path: Path) -> None:
    r = diff(synthetic_log, other(tmp_path, prompt_change="req-b"))
    d = r.first
    assert d is not None and d.request_a == d.request_b == "req-b"
    assert d.position == 0 and d.step == 0 and d.fields == ("prompt_token_ids",)
    assert r.unmatched_a == r.unmatched_b == ()


def test_a_different_chunk_size(synthetic_log: Path, tmp_path: Path) -> None:
    r = diff(synthetic_log, other(tmp_path, chunk_size=16))
    assert r.config_changes["chunk_size"] == (32, 16)
    d = r.first
    assert d is not None and d.request_a == "req-a" and d.step == 0
    assert isinstance(d.a.event, ev.SavePlanned) and isinstance(d.b.event, ev.SavePlanned)
    assert "keys" in d.fields


# --- alignment ------------------------------------------------------------------------------


def test_requests_align_by_prompt_when_ids_get_other_suffixes(tmp_path: Path) -> None:
    a = other(tmp_path, "a.kvlog", rename=suffixed("0123abcd"))
    b = other(tmp_path, "b.kvlog", rename=suffixed("fedc9876"))
    r = diff(a, b)
    assert r.identical, r.first
    assert r.aligned_by == {"id": 0, "prompt": 4, "suffix": 0}
    assert r.matched["req-b-0123abcd"] == "req-b-fedc9876"


def test_equal_prompts_align_in_arrival_order(tmp_path: Path) -> None:
    """a and c have the same prompt: the first with the first, the second with the second."""
    a = other(tmp_path, "a.kvlog", rename=suffixed("0123abcd"))
    b = other(tmp_path, "b.kvlog", rename=suffixed("fedc9876"))
    r = diff(a, b)
    assert r.matched["req-a-0123abcd"] == "req-a-fedc9876"
    assert r.matched["req-c-0123abcd"] == "req-c-fedc9876"


def test_a_changed_prompt_under_a_new_suffix_aligns_by_id_stem(tmp_path: Path) -> None:
    a = other(tmp_path, "a.kvlog", rename=suffixed("0123abcd"))
    b = other(tmp_path, "b.kvlog", rename=suffixed("fedc9876"), prompt_change="req-b")
    r = diff(a, b)
    assert r.aligned_by == {"id": 0, "prompt": 3, "suffix": 1}
    d = r.first
    assert d is not None
    assert (d.request_a, d.request_b) == ("req-b-0123abcd", "req-b-fedc9876")
    assert d.fields == ("prompt_token_ids",) and d.step == 0


def test_requests_without_a_counterpart_are_unmatched(synthetic_log: Path, tmp_path: Path) -> None:
    fewer = tmp_path / "fewer.kvlog"
    copy_log(synthetic_log, fewer, lambda e: None if e.req_id == "req-d" else e)
    r = diff(synthetic_log, fewer)
    assert r.unmatched_a == ("req-d",) and r.unmatched_b == ()
    assert not r.identical and r.first is None
    r = diff(fewer, synthetic_log)
    assert r.unmatched_b == ("req-d",)


def test_alignment_reads_raw_records_as_it_reads_events(
    synthetic_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The alignment pass reads raw records when the log's RequestAdded schema is this
    version's; it must name the same lives as the decoded events: a reused id, a request
    never added, the pool's own events."""
    diff_module = sys.modules["kvledger.replay.divergence"]

    def rewrite(e: ev.Event) -> ev.Event | None:
        if e.req_id == "req-c":
            return attrs.evolve(e, req_id="req-a")  # reused after req-a finished
        if isinstance(e, ev.RequestAdded) and e.req_id == "req-d":
            return None  # events of a request the log never added
        if isinstance(e, ev.Finished) and e.req_id == "req-b":
            return ev.ChunkStored(e.step, "", b"k" * 16, 3, 32)  # a pool event instead
        return e

    path = tmp_path / "odd.kvlog"
    copy_log(synthetic_log, path, rewrite)
    src = open_log(path)
    assert diff_module._raw_request_added(src.header)
    raw = diff_module._lives(src)
    monkeypatch.setattr(diff_module, "_raw_request_added", lambda header: False)
    decoded = diff_module._lives(src)
    assert raw == decoded
    assert [life.label for life in raw] == ["req-a", "req-b", "req-a#2", "req-d"]
    assert raw[3].prompt is None and raw[0].prompt == raw[2].prompt
    assert diff(path, path).identical


# --- damage, unreadable, JSON, commands ---------------------------------------------------------


def test_diff_reports_read_damage(synthetic_log: Path, tmp_path: Path) -> None:
    torn = torn_copy(synthetic_log, tmp_path / "torn.kvlog", 5)
    r = diff(synthetic_log, torn)
    assert r.damage_a is None and r.damage_b is not None and r.damage_b.kind == "torn_tail"
    assert r.first is not None and r.first.kind == "missing" and r.first.step_a == 10
    assert cli.main(["diff", str(synthetic_log), str(torn)]) == 2  # compared, but incomplete
    assert cli.main(["diff", str(synthetic_log), str(synthetic_log)]) == 0


def test_diff_command_exit_codes_and_output(synthetic_log: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["diff", str(synthetic_log), str(synthetic_log)]) == 0
    assert "identical" in capsys.readouterr().out

    def alter(e: ev.Event) -> ev.Event:
        if isinstance(e, ev.Allocated) and e.req_id == "req-c":
            return attrs.evolve(e, block_ids=(14, 15, 17))
        return e

    changed = other(tmp_path, alter=alter)
    assert cli.main(["diff", str(synthetic_log), str(changed)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 7, request req-c" in out
    assert "block_ids differ" in out
    assert cli.main(["diff", str(synthetic_log), str(changed), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical"] is False
    first = doc["first"]
    assert (first["request_a"], first["step_a"], first["step_b"]) == ("req-c", 7, 7)
    assert first["a"]["fields"]["block_ids"] == [14, 15, 16]
    assert first["b"]["fields"]["block_ids"] == [14, 15, 17]
    assert list(doc["per_request"]) == ["req-c"]

    junk = tmp_path / "junk.kvlog"
    junk.write_bytes(b"not a log")
    assert cli.main(["diff", str(synthetic_log), str(junk)]) == 2
    assert "cannot read the log" in capsys.readouterr().err


def test_keys_print_as_hex_in_json(synthetic_log: Path, tmp_path: Path) -> None:
    r = diff(synthetic_log, other(tmp_path, chunk_size=16))
    doc = json.loads(json.dumps(r.to_dict()))
    keys = doc["first"]["a"]["fields"]["keys"]
    assert keys and all(len(k) == 32 and int(k, 16) >= 0 for k in keys)


# --- vLLM's real scheduler ---------------------------------------------------------------------


@pytest.mark.vllm
def test_real_runs_of_one_workload_are_identical(real_logs: dict[str, Path]) -> None:
    assert diff(real_logs["base"], real_logs["base"]).identical
    r = diff(real_logs["base"], real_logs["again"])
    assert r.identical, r.first and r.first.describe()


@pytest.mark.vllm
def test_real_runs_with_another_chunk_size_diverge_at_the_first_save(
    real_logs: dict[str, Path],
) -> None:
    r = diff(real_logs["base"], real_logs["chunk16"])
    assert r.config_changes["chunk_size"] == (32, 16)
    d = r.first
    assert d is not None and d.kind == "differ"
    # The first save plan: the same prefill, saved as one 32-token chunk or two of 16.
    saves = [
        (f.step, e)
        for f in open_log(real_logs["base"]).frames()
        for e in f.events
        if isinstance(e, ev.SavePlanned) and e.keys
    ]
    step, first_save = saves[0]
    assert (d.step_a, d.request_a) == (step, first_save.req_id)
    assert d.a.event == first_save
    assert len(d.b.event.keys) == 2 * len(first_save.keys)


@pytest.mark.vllm
def test_real_run_with_suffixed_ids_aligns_by_prompt(
    real_logs: dict[str, Path], tmp_path: Path
) -> None:
    renamed = tmp_path / "renamed.kvlog"
    rename = suffixed("9f8e7d6c")
    copy_log(
        next(real_logs["base"].iterdir()),
        renamed,
        lambda e: attrs.evolve(e, req_id=rename(e.req_id)),
    )
    r = diff(real_logs["base"], renamed)
    assert r.identical, r.first and r.first.describe()
    # Two requests repeat an earlier prompt ("again-req-0" has req-0's): arrival order decides.
    assert r.aligned_by["prompt"] == 6
    assert r.matched == {rid: rename(rid) for rid in r.matched}

    # Now perturb one event of the renamed copy at a known step: found there.
    events = [(f.step, e) for f in open_log(real_logs["base"]).frames() for e in f.events]
    step, target = next((s, e) for s, e in events if isinstance(e, ev.Allocated) and s > 0)
    perturbed = tmp_path / "perturbed.kvlog"

    def alter(e: ev.Event) -> ev.Event:
        e = attrs.evolve(e, req_id=rename(e.req_id))
        if e == attrs.evolve(target, req_id=rename(target.req_id)):
            return attrs.evolve(e, block_ids=(*e.block_ids, 999))
        return e

    copy_log(next(real_logs["base"].iterdir()), perturbed, alter)
    r = diff(real_logs["base"], perturbed)
    d = r.first
    assert d is not None and list(r.per_request) == [target.req_id]
    assert (d.request_a, d.request_b) == (target.req_id, rename(target.req_id))
    assert (d.step_a, d.step_b) == (step, step) and d.fields == ("block_ids",)
