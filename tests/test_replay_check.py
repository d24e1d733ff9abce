"""``replay.check`` and ``kvledger check``: re-fold a log, re-derive every decision, compare.

Two kinds of logs:

- real ones in ``tests/data`` written by vLLM's real scheduler through the connector
  (``tests/data/make_replay_logs.py``): ``replay-clean.kvlog`` from this code, and
  ``replay-short-load.kvlog`` from this code with a wrong planning rule injected (every load
  one block short). The sidecar ``replay-short-load.json`` names the first load the injected
  rule changed. If a change to ``tracker/`` makes the clean log fail, the change alters a
  decision this code makes from the same facts: either it is a regression, or it is meant,
  and then the logs are regenerated with that script;
- synthetic ones written here with ``Tracker`` + ``LogWriter`` for unit-level cases.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from _memory import traced_peak
from _replay_logs import copy_log

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import replay_bench  # the bench's decode-heavy workload

from kvledger import replay
from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import CheckResult, check, parse_overrides
from kvledger.replay.source import open_log
from kvledger.tracker import events as ev
from kvledger.tracker.config import ConfigError, TrackerConfig
from kvledger.tracker.tracker import Tracker

DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "replay-clean.kvlog"
FAULTY = DATA / "replay-short-load.kvlog"
SIDECAR = json.loads((DATA / "replay-short-load.json").read_text())
FIRST_BAD = SIDECAR["first_bad"]

NEW, RESUMED, RUNNING = ev.Admission.NEW, ev.Admission.RESUMED, ev.Admission.RUNNING
B, C = 16, 32
# Whole-chunk hits: the what-ifs below are about chunk sizes (block hits: test_block_hits.py).
CONFIG = TrackerConfig(
    block_size=B, chunk_size=C, num_slots=64, discard_partial_chunks=False, block_hits=False
)


# --- synthetic logs ---------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def saved_keys(decisions: list[ev.DecisionEvent]) -> tuple[bytes, ...]:
    return tuple(k for d in decisions if isinstance(d, ev.SavePlanned) for k in d.keys)


def drive(
    t: Tracker,
    n: int,
    *,
    start: int = 0,
    prompt: int = 40,
    decode: int = 4,
    shared: int = 64,
    hot: bool = True,
    grow: bool = False,
) -> None:
    """``n`` requests one after another, each: added, looked up (the shared prefix hits from
    the second on), allocated, prefilled, its saves confirmed, ``decode`` decode steps,
    finished. Every step is one log frame. ``hot``: decode steps the way the connector sends
    them, steady ones as ``StepDecoded`` (token ids learned later, in bulk), else all as
    ``Scheduled``. ``grow``: the prompt's blocks are allocated, and each decode step that
    fills the table appends one (in a ``StepDecoded``, as a number and block pair)."""
    prefix = list(range(7, 7 + shared))
    for i in range(start, start + n):
        rid = f"r{i}"
        ids = prefix + [10_000 + 31 * i + j for j in range(prompt)]
        t.add_request(rid, ids)
        ext = t.lookup(rid, 0, ids)
        table = list(range(1, cdiv(len(ids) + (0 if grow else decode), B) + 1))
        t.allocated(rid, table, ext)
        ds = t.scheduled(
            rid,
            num_computed=ext,
            num_scheduled=len(ids) - ext,
            all_token_ids=ids,
            block_ids=table,
            admission=NEW,
        )
        t.end_step()
        if keys := saved_keys(ds):
            t.save_done(rid, keys)
        if any(isinstance(d, ev.LoadPlanned) and d.keys for d in ds):
            t.load_done(rid)
        toks = list(ids)
        for k in range(decode):
            toks.append(50_000 + k)
            new = [len(table) + 1] if len(toks) > len(table) * B else []
            table += new
            num = t.decode_step_ok(rid, len(toks) - 1, *new) if hot else None
            if num is not None:
                t.decoded([num], [(num, b) for b in new])
            else:
                t.scheduled(
                    rid,
                    num_computed=len(toks) - 1,
                    num_scheduled=1,
                    all_token_ids=toks,
                    block_ids=new,
                )
            t.end_step()
        t.finished(rid)
        t.end_step()


def write_log(path: Path, n: int = 6, config: TrackerConfig = CONFIG, **kw: Any) -> Tracker:
    writer = LogWriter(path, {**config.to_dict(), "vllm_version": "test"}, fsync="never")
    t = Tracker(config, log=writer)
    drive(t, n, **kw)
    t.close()
    return t


def frame_offsets(path: Path) -> list[tuple[int, int]]:
    """(offset, number of events) of every frame."""
    return [(f.offset, len(f.records)) for f in LogReader(path).iter_raw()]


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    path = tmp_path / "synthetic.kvlog"
    write_log(path)
    return path


# --- the real logs ------------------------------------------------------------------------------


def test_clean_real_log_replays_clean() -> None:
    result = check(CLEAN)
    assert result.error is None and result.stop is None
    assert [p.describe() for p in result.problems] == []
    assert result.clean and result.exit_code == 0
    run = json.loads((DATA / "replay-clean.json").read_text())["run"]
    assert result.counts["requests"] == run["requests"]
    assert result.counts["by_type"]["Preempted"] > 0  # the run preempted: resumes are checked
    assert result.totals["recorded"] == result.totals["derived"]
    assert result.totals["recorded"]["tokens_loaded"] > 0
    assert result.totals["recorded"]["tokens_saved"] > 0
    assert result.run_info["vllm_version"]
    assert "vllm_version" not in result.config  # run info is not tracker config


def test_faulty_real_log_names_the_first_wrong_step_and_decision() -> None:
    result = check(FAULTY)
    assert result.exit_code == 1 and not result.clean
    first = result.problems[0]
    assert (first.step, first.req_id) == (FIRST_BAD["step"], FIRST_BAD["req_id"])
    assert (first.kind, first.name) == ("decision", FIRST_BAD["decision"])
    assert isinstance(first.event, ev.Scheduled) and first.event.admission is not RUNNING
    [recorded], [derived] = first.recorded, first.derived
    assert [recorded.start, recorded.end] == FIRST_BAD["recorded"]
    assert [derived.start, derived.end] == FIRST_BAD["correct"]
    # The state before and after, as the replay folds it.
    assert first.before is not None and first.after is not None
    assert first.after["load"] == FIRST_BAD["correct"]
    assert first.before["accepted"] == FIRST_BAD["correct"][1] - FIRST_BAD["correct"][0]
    # Every problem is that rule, on a request the injected code changed.
    assert {p.name for p in result.problems} == {"LoadPlanned"}
    assert {p.req_id for p in result.problems} <= set(SIDECAR["requests_changed"])
    assert result.totals["recorded"]["tokens_loaded"] < result.totals["derived"]["tokens_loaded"]


def test_problem_location_points_at_the_frame_holding_the_event() -> None:
    first = check(FAULTY).problems[0]
    assert first.path == str(FAULTY)
    frame = next(f for f in LogReader(FAULTY) if f.offset == first.offset)
    assert frame.seq == first.seq and frame.step == first.step
    assert first.event in frame.events
    # The event index counts every event before it.
    before = sum(len(f.events) for f in LogReader(FAULTY) if f.offset < first.offset)
    assert before <= first.index < before + len(frame.events)


def test_first_stops_at_the_first_problem() -> None:
    full = check(FAULTY)
    result = check(FAULTY, first=True)
    assert result.problems_total == 1 and result.stopped_early
    assert result.problems[0] == full.problems[0]
    assert result.counts["events"] < full.counts["events"]
    assert result.exit_code == 1


def test_request_narrows_the_report_but_the_whole_log_is_folded() -> None:
    full = check(FAULTY)
    other = next(p for p in full.problems if p.req_id != FIRST_BAD["req_id"])
    result = check(FAULTY, request=other.req_id)
    assert result.problems and {p.req_id for p in result.problems} == {other.req_id}
    assert result.problems[0] == other  # same decisions: the shared index was folded
    assert result.problems_elsewhere == full.problems_total - result.problems_total
    assert result.counts["events"] == full.counts["events"]
    first_only = check(FAULTY, request=other.req_id, first=True)
    assert first_only.problems == [other] and first_only.stopped_early
    clean_one = check(FAULTY, request="again-req-0")
    assert clean_one.problems == [] and clean_one.exit_code == 0


def test_what_if_doubled_chunk_size_reports_different_plans() -> None:
    base = check(CLEAN)
    result = check(CLEAN, chunk_size=2 * C)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.what_if is not None
    assert result.config["chunk_size"] == 2 * C
    assert result.what_if.recorded_config["chunk_size"] == C
    totals = result.what_if.totals()
    recorded = [base.totals["recorded"]["tokens_loaded"], base.totals["recorded"]["tokens_saved"]]
    assert [totals["loaded"][0], totals["saved"][0]] == recorded
    assert [totals["loaded"][1], totals["saved"][1]] != recorded
    assert totals["saved"][1] == result.totals["derived"]["tokens_saved"]
    assert result.what_if.divergent_admissions > 0
    rows = result.what_if.per_request
    assert any(
        r["loaded"][0] != r["loaded"][1] or r["saved"][0] != r["saved"][1] for r in rows.values()
    )


def test_what_if_with_the_recorded_config_reproduces_the_recorded_plans() -> None:
    """The what-if machinery itself (accepting this config's offers, synthesised worker
    results) changes nothing when the configuration does not change."""
    result = check(CLEAN, chunk_size=C)
    assert result.exit_code == 0
    assert result.what_if is not None and result.what_if.divergent_admissions == 0
    totals = result.what_if.totals()
    assert totals["loaded"][0] == totals["loaded"][1] > 0
    assert totals["saved"][0] == totals["saved"][1] > 0


def test_what_if_assumes_vllm_accepts_this_configs_offer(tmp_path: Path) -> None:
    """A 48-token shared prefix: with 32-token chunks the run loads 32 tokens per request.
    With 64-token chunks nothing hits (a divergent admission), yet every request still
    saves its chunks (it is not turned into a recompute-only request by the mismatch); with
    16-token chunks 48 tokens hit and are loaded, more than vLLM accepted in the run."""
    path = tmp_path / "shared48.kvlog"
    write_log(path, 5, shared=48, prompt=40)
    base = check(path)
    assert base.exit_code == 0 and base.totals["recorded"]["tokens_loaded"] == 4 * 32

    wider = check(path, chunk_size=64)
    assert wider.exit_code == 0, [p.describe() for p in wider.problems]
    assert wider.what_if.divergent_admissions == 4
    rows = wider.what_if.per_request
    assert all(rows[f"r{i}"]["loaded"][1] == 0 for i in range(5))
    assert all(rows[f"r{i}"]["saved"][1] == 88 for i in range(5))

    narrower = check(path, chunk_size=16)
    assert narrower.exit_code == 0, [p.describe() for p in narrower.problems]
    rows = narrower.what_if.per_request
    assert [rows[f"r{i}"]["loaded"] for i in range(1, 5)] == [[32, 48]] * 4


def test_what_if_offer_is_cut_to_the_recorded_schedule(tmp_path: Path) -> None:
    """The run stored nothing (partial chunks discarded), so vLLM admitted ``b`` with a
    9-token first chunk of prefill. Keeping partial chunks, ``b`` would hit its whole
    prompt; the recorded step has room for 8 loaded tokens, and that is what the what-if
    loads (not a recompute-only fallback)."""
    config = TrackerConfig(block_size=B, chunk_size=2 * C, num_slots=64, block_hits=False)
    path = tmp_path / "chunked.kvlog"
    t = Tracker(config, log=LogWriter(path, config.to_dict(), fsync="never"))
    ids = list(range(300, 360))  # 60 tokens: less than one 64-token chunk
    t.add_request("a", ids)
    t.lookup("a", 0, ids)
    t.allocated("a", [1, 2, 3, 4], 0)
    ds = t.scheduled(
        "a",
        num_computed=0,
        num_scheduled=60,
        all_token_ids=ids,
        block_ids=[1, 2, 3, 4],
        admission=NEW,
    )
    assert saved_keys(ds) == ()
    t.finished("a")
    t.end_step()
    t.add_request("b", ids)
    assert t.lookup("b", 0, ids) == 0
    t.allocated("b", [5], 0)
    t.scheduled(
        "b", num_computed=0, num_scheduled=9, all_token_ids=ids, block_ids=[5], admission=NEW
    )
    t.end_step()
    t.scheduled("b", num_computed=9, num_scheduled=51, all_token_ids=ids, block_ids=[6, 7, 8])
    t.finished("b")
    t.end_step()
    t.close()
    assert check(path).exit_code == 0
    result = check(path, discard_partial_chunks=False)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.what_if.divergent_admissions == 1
    assert result.what_if.per_request["b"]["loaded"] == [0, 8]
    assert result.what_if.per_request["a"]["saved"] == [0, 60]


def test_what_if_saving_decode_chunks_saves_more() -> None:
    result = check(CLEAN, save_decode_cache=True)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    totals = result.what_if.totals()
    assert totals["saved"][1] > totals["saved"][0]


def test_what_if_saving_decode_chunks_needs_their_token_ids(tmp_path: Path) -> None:
    """Saving decode chunks needs their token ids. A log whose decode steps carry them
    (``Scheduled``) gives the decode chunks; one whose steady decode steps were folded as
    ``StepDecoded`` does not hold them (the run never needed them): those steps go through
    ``Scheduled`` without ids, nothing is reported as a problem, and the what-if counts the
    steps it could not cover (the saved total is then a lower bound)."""
    full = tmp_path / "full.kvlog"
    write_log(full, 4, decode=80, prompt=20, shared=0, hot=False)
    result = check(full, save_decode_cache=True)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.what_if.steps_without_token_ids == 0
    rows = result.what_if.per_request
    for i in range(4):
        recorded, what_if = rows[f"r{i}"]["saved"]
        assert recorded == 20  # the prompt's partial chunk only
        # and, as decoding fills them, the full chunks [0, 32), [32, 64), [64, 96)
        assert what_if == 20 + 96

    steady = tmp_path / "steady.kvlog"
    write_log(steady, 4, decode=80, prompt=20, shared=0, hot=True)
    base = check(steady)
    assert base.exit_code == 0 and base.counts["by_type"]["StepDecoded"] > 200
    result = check(steady, save_decode_cache=True)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.what_if.steps_without_token_ids > 0
    assert result.what_if.totals()["saved"] == [80, 80]


def test_what_if_keeps_the_blocks_of_the_steady_steps_it_splits(tmp_path: Path) -> None:
    """A steady step the what-if config makes unsteady goes through ``Scheduled``; the block
    its table grew by that step goes with it, as do the blocks of the requests that stay
    steady. Before, the split dropped them: the next steps broke ``tokens_within_blocks``
    (235,750 times over a 250k-event decode log) where nothing was wrong."""
    path = tmp_path / "growing.kvlog"
    write_log(path, 3, decode=80, prompt=20, shared=0, hot=True, grow=True)
    grew = [
        e for f in LogReader(path) for e in f.events if isinstance(e, ev.StepDecoded) and e.blocks
    ]
    assert len(grew) >= 3 * 4  # a block every 16 tokens of 80, for each request
    assert check(path).exit_code == 0
    result = check(path, save_decode_cache=True)
    assert result.exit_code == 0, [p.describe() for p in result.problems[:3]]
    assert result.what_if.steps_without_token_ids > 0  # the steps were split
    # A config under which every step is as steady as it was splits none: a step that grows
    # a block is steady with its block (before, every such step was split).
    same = check(path, num_slots=2 * CONFIG.num_slots)
    assert same.exit_code == 0 and same.what_if.steps_without_token_ids == 0


@pytest.mark.parametrize(
    "what_if",
    [{"num_slots": 4}, {"chunk_size": 64}, {"save_decode_cache": True, "chunk_size": 32}],
)
def test_what_if_splits_a_step_of_many_requests_without_a_false_alarm(
    tmp_path: Path, what_if: dict[str, Any]
) -> None:
    """The replay bench's workload, 24 requests decoding at once, blocks appended every 16
    tokens: under another config some entries of a step stop being steady and the rest stay
    (a split of one record into both). The code before reported 18,490 problems under each
    of the configs this test then took, where nothing was wrong. ``num_slots`` is 4, not 16:
    since the bench's requests decode from the step after their admission, as in vLLM, 16
    slots keep every entry steady and split nothing."""
    path = tmp_path / "bench.kvlog"
    replay_bench.write_log(path, 20_000, 24, 8)
    entries = sum(
        len(e.nums) for f in LogReader(path) for e in f.events if isinstance(e, ev.StepDecoded)
    )
    assert entries > 15_000
    result = check(path, **what_if)
    assert result.exit_code == 0, [p.describe() for p in result.problems[:3]]
    assert 0 < result.what_if.steps_without_token_ids < entries


def test_a_rotated_log_reads_as_one(tmp_path: Path) -> None:
    """The clean log rewritten in small segments: a directory, or the list of its files."""
    out = tmp_path / "segments"
    out.mkdir()
    writer = copy_log(CLEAN, out / "run.kvlog", rotate_bytes=2048)
    assert len(writer.paths) > 3
    whole = check(CLEAN)
    for source in (out, [str(p) for p in writer.paths]):
        result = check(source)
        assert result.exit_code == 0, [p.describe() for p in result.problems]
        assert result.counts["events"] == whole.counts["events"]
        assert result.totals == whole.totals
        assert result.paths == [str(p) for p in writer.paths]
    # A missing middle segment breaks the chain: damage, reported where it was found.
    broken = check([str(writer.paths[0]), str(writer.paths[2])])
    assert broken.exit_code == 2 and broken.stop is not None
    assert broken.stop.path == str(writer.paths[2])


def test_the_reports_log_line_stays_short_for_a_thousand_segments(
    tmp_path: Path, capsys: Any
) -> None:
    """The report's `log` line named every segment: a thousand made a 60 KB line. Past three,
    it says how many and names the first and the last; --json's `paths` lists every one."""
    out = tmp_path / "segments"
    out.mkdir()
    writer = LogWriter(
        out / "run.kvlog",
        {**CONFIG.to_dict(), "vllm_version": "test"},
        fsync="never",
        rotate_bytes=1,  # a segment per frame
    )
    t = Tracker(CONFIG, log=writer)
    drive(t, 167)
    t.close()
    paths = [str(p) for p in writer.paths]
    assert len(paths) >= 1000
    assert main(["check", str(out)]) == 0
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("  log ")]
    assert line.startswith(f"  log       {len(paths):,} segments: {paths[0]} ... {paths[-1]} (")
    assert len(line) < 300
    assert main(["check", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["paths"] == paths
    # Three or fewer are each named.
    assert main(["check", *paths[:3]]) in (2, 3)
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("  log ")]
    assert line.startswith(f"  log       {', '.join(paths[:3])} (")
    # A log that cannot be read at all: the same bound on the line that names it.
    garbage = tmp_path / "garbage.kvlog"
    garbage.write_bytes(b"not a log")
    assert main(["check", str(garbage), *paths[1:]]) == 2
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        first == f"kvledger check: cannot check {len(paths):,} segments: {garbage} ... {paths[-1]}"
    )


# --- synthetic logs: one behaviour each ---------------------------------------------------------


def test_synthetic_log_is_clean_and_loads_shared_prefixes(synthetic: Path) -> None:
    result = check(synthetic)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    assert result.totals["recorded"]["loads"] == 5  # every request after the first
    assert result.counts["requests"] == 6
    assert result.counts["peak_live_requests"] == 1
    assert result.counts["by_type"]["StepDecoded"] > 0  # the hot path is replayed too


def test_a_steady_decode_that_is_not_steady_is_named(tmp_path: Path) -> None:
    """A recorded ``StepDecoded`` is re-validated: numbering a request whose step needs a
    decision (here: saves of decode chunks are due) is a problem about that request."""
    config = TrackerConfig(
        block_size=B, chunk_size=C, num_slots=64, save_decode_cache=True, block_hits=False
    )
    path = tmp_path / "steady.kvlog"
    t = Tracker(config, log=LogWriter(path, config.to_dict(), fsync="never"))
    ids = list(range(100, 130))  # 30 tokens: the first chunk completes at the 3rd decode step
    t.add_request("a", ids)
    t.lookup("a", 0, ids)
    t.allocated("a", [1, 2, 3], 0)
    t.scheduled(
        "a", num_computed=0, num_scheduled=30, all_token_ids=ids, block_ids=[1, 2, 3], admission=NEW
    )
    t.end_step()
    toks = list(ids)
    steps = []
    for k in range(4):
        toks.append(900 + k)
        num = t.decode_step_ok("a", len(toks) - 1)
        steps.append(num is not None)
        if num is not None:
            t.decoded([num])
        else:
            t.scheduled("a", num_computed=len(toks) - 1, num_scheduled=1, all_token_ids=toks)
        t.end_step()
    t.close()
    assert steps == [True, False, True, True]  # step 2 completes the chunk [0, 32): a save
    assert check(path).exit_code == 0

    # The same log claiming the later steps steady too.
    lie = tmp_path / "lie.kvlog"
    frames = list(LogReader(path))
    num = next(e.nums[0] for f in frames for e in f.events if isinstance(e, ev.StepDecoded))

    def claim_steady(e: ev.Event) -> ev.Event | None:
        if isinstance(e, ev.Scheduled) and e.admission is RUNNING and e.step == 2:
            return ev.StepDecoded(e.step, "", (num,))
        return None if isinstance(e, ev.SavePlanned) and e.step == 2 else e

    copy_log(path, lie, claim_steady)
    result = check(lie)
    p = result.problems[0]
    assert (p.kind, p.rule, p.req_id, p.step) == ("violation", "decoded_not_steady", "a", 2)
    assert isinstance(p.event, ev.StepDecoded)


def test_a_tampered_decision_is_a_decision_problem(synthetic: Path, tmp_path: Path) -> None:
    target = tmp_path / "tampered.kvlog"
    done = []

    def edit(e: ev.Event) -> list[ev.Event]:
        if isinstance(e, ev.LookupAnswered) and e.req_id == "r3" and not done:
            done.append(e)
            return [ev.LookupAnswered(e.step, e.req_id, e.hit, e.external - 1)]
        return [e]

    copy_log(synthetic, target, edit)
    result = check(target)
    assert result.exit_code == 1
    p = result.problems[0]
    assert (p.kind, p.name, p.req_id, p.step) == ("decision", "LookupAnswered", "r3", done[0].step)
    assert p.recorded[0].external == done[0].external - 1
    assert p.derived == (done[0],)
    assert isinstance(p.event, ev.LookupAsked)


def test_a_missing_decision_and_an_unexplained_one(synthetic: Path, tmp_path: Path) -> None:
    target = tmp_path / "moved.kvlog"
    moved: list[ev.Event] = []

    def edit(e: ev.Event) -> list[ev.Event]:
        # Drop r2's save plan, and put a copy of it at the start of the log.
        if isinstance(e, ev.SavePlanned) and e.req_id == "r2" and not moved:
            moved.append(e)
            return []
        return [e]

    copy_log(synthetic, target, edit)
    result = check(target)
    p = result.problems[0]
    assert (p.kind, p.name, p.req_id) == ("decision", "SavePlanned", "r2")
    assert p.recorded == () and p.derived == (moved[0],)

    orphan = tmp_path / "orphan.kvlog"
    writer = LogWriter(orphan, CONFIG.to_dict(), fsync="never")
    writer.append(moved[0])
    writer.end_step(moved[0].step)
    writer.close()
    result = check(orphan)
    p = result.problems[0]
    assert (p.kind, p.name, p.event) == ("unexplained", "SavePlanned", None)


def test_a_violation_is_a_problem_recorded_or_not(tmp_path: Path) -> None:
    path = tmp_path / "violation.kvlog"
    t = Tracker(CONFIG, log=LogWriter(path, CONFIG.to_dict(), fsync="never"))
    ids = list(range(100, 140))
    t.add_request("a", ids)
    t.lookup("a", 0, ids)
    t.allocated("a", [1, 2, 3], 16)  # vLLM accepted 16 external tokens; we offered 0
    t.end_step()
    t.close()
    [v] = t.violations
    result = check(path)
    assert result.exit_code == 1
    [p] = result.problems
    assert (p.kind, p.rule, p.req_id, p.step) == ("violation", v.rule, "a", 0)
    assert p.recorded_too and isinstance(p.event, ev.Allocated)
    assert p.after is not None and p.after["recompute_only"] is True

    # The same inputs in a log without the recorded violation: still a problem, not recorded.
    bare = tmp_path / "bare.kvlog"
    copy_log(path, bare, lambda e: [] if isinstance(e, ev.ViolationRecorded) else [e])
    [q] = check(bare).problems
    assert (q.kind, q.rule, q.recorded_too) == ("violation", v.rule, False)

    # A violation recorded where this code derives none: unexplained.
    extra = tmp_path / "extra.kvlog"

    def add_one(e: ev.Event) -> list[ev.Event]:
        if isinstance(e, ev.LookupAnswered):
            return [e, ev.ViolationRecorded(e.step, e.req_id, "tokens_within_blocks", "X", "")]
        return [e]

    copy_log(bare, extra, add_one)
    problems = check(extra).problems
    assert (problems[0].kind, problems[0].name) == (
        "unexplained",
        "ViolationRecorded tokens_within_blocks",
    )


def test_an_adapter_error_is_applied_as_a_fact(tmp_path: Path) -> None:
    """``mark_violation`` (the connector could not read vLLM's object): nothing derives it, the
    request falls back to recompute. The replay applies it, so it plans no save either."""
    path = tmp_path / "adapter.kvlog"
    t = Tracker(CONFIG, log=LogWriter(path, CONFIG.to_dict(), fsync="never"))
    ids = list(range(100, 180))
    t.add_request("a", ids)
    t.lookup("a", 0, ids)
    t.allocated("a", [1, 2, 3, 4, 5, 6], 0)
    t.mark_violation("a", "adapter_error", "Scheduled", error="AttributeError('x')")
    ds = t.scheduled(
        "a",
        num_computed=0,
        num_scheduled=80,
        all_token_ids=ids,
        block_ids=[1, 2, 3, 4, 5, 6],
        admission=NEW,
    )
    assert saved_keys(ds) == ()  # recompute only: no save
    t.end_step()
    t.close()
    result = check(path)
    assert result.exit_code == 0, [p.describe() for p in result.problems]
    [rv] = result.recorded_violations
    assert (rv.rule, rv.req_id, rv.step, rv.event) == ("adapter_error", "a", 0, "Scheduled")
    assert "AttributeError" in rv.detail


def test_strict_in_the_header_does_not_make_the_replay_raise(tmp_path: Path) -> None:
    path = tmp_path / "strict.kvlog"
    writer = LogWriter(path, {**CONFIG.to_dict(), "strict": True}, fsync="never")
    writer.append(ev.Scheduled(0, "ghost", 0, 16))  # unknown request
    writer.end_step(0)
    writer.close()
    result = check(path)
    assert [p.rule for p in result.problems] == ["unknown_request"]
    assert result.config["strict"] is False


def test_progress_reports_bytes(synthetic: Path) -> None:
    seen: list[tuple[int, int]] = []
    check(synthetic, progress=lambda done, total: seen.append((done, total)))
    size = synthetic.stat().st_size
    assert seen and seen[-1] == (size, size)
    assert all(done <= total == size for done, total in seen)


def test_memory_is_bounded_by_live_requests_not_log_length(tmp_path: Path) -> None:
    """A log 4x longer (more requests, one after another) replays in about the same memory:
    the replay holds one frame and the live requests, and the tracker retires finished ones."""
    peaks = []
    for n in (150, 600):
        path = tmp_path / f"long-{n}.kvlog"
        write_log(path, n, TrackerConfig(block_size=B, chunk_size=C, num_slots=64), decode=8)
        with traced_peak() as traced:
            result = check(path)
        peaks.append(traced.bytes)
        assert result.exit_code == 0 and result.counts["peak_live_requests"] == 1
    assert peaks[1] < 1.3 * peaks[0] + 200_000, peaks


# --- damage -------------------------------------------------------------------------------------


def test_a_torn_tail_is_reported_after_checking_every_complete_frame(tmp_path: Path) -> None:
    frames = frame_offsets(CLEAN)
    cut_frame = len(frames) - 5
    offset, _ = frames[cut_frame]
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(CLEAN.read_bytes()[: offset + 11])
    result = check(torn)
    assert result.exit_code == 2 and not result.clean
    assert result.stop is not None and result.stop.kind == "torn_tail"
    assert result.stop.offset == offset and result.stop.path == str(torn)
    assert result.counts["events"] == sum(n for _, n in frames[:cut_frame])
    assert result.problems == []


def test_a_corrupt_frame_stops_the_check_there(tmp_path: Path) -> None:
    frames = frame_offsets(FAULTY)
    first = check(FAULTY).problems[0]
    # Corrupt the frame right after the first problem: the problem is still reported.
    index = next(i for i, (off, _) in enumerate(frames) if off > first.offset)
    offset, _ = frames[index]
    data = bytearray(FAULTY.read_bytes())
    data[offset + 9] ^= 0x40  # inside the payload: the payload checksum fails
    bad = tmp_path / "corrupt.kvlog"
    bad.write_bytes(bytes(data))
    result = check(bad)
    assert result.exit_code == 2
    assert result.stop is not None and result.stop.kind == "corrupt"
    assert result.stop.offset == offset
    assert result.problems[0].step == first.step
    assert result.counts["events"] == sum(n for _, n in frames[:index])


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"definitely not a log", "not a kvledger log"),
        (b"KVLEDGER" + struct.pack("<HH", 9, 0) + b"\0" * 40, "9.x"),
        (b"KVLEDGER\x01\x00", "preamble"),
        (b"", "empty file"),
    ],
    ids=["not-a-log", "unknown-major", "short-preamble", "empty"],
)
def test_unreadable_logs_give_an_error_result(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "x.kvlog"
    path.write_bytes(content)
    result = check(path)
    assert result.exit_code == 2 and result.error is not None
    assert needle in result.error
    assert result.problems == []


def test_a_missing_file_and_a_damaged_header(tmp_path: Path) -> None:
    assert check(tmp_path / "nope.kvlog").exit_code == 2
    data = bytearray(CLEAN.read_bytes())
    data[12 + 8 + 3] ^= 1  # a byte of the header payload
    path = tmp_path / "header.kvlog"
    path.write_bytes(bytes(data))
    result = check(path)
    assert result.exit_code == 2 and result.stop is not None and result.stop.kind == "bad_header"
    assert "unreadable header" in (result.error or "")


# --- the Python API around check ----------------------------------------------------------------


def test_open_reads_files_lists_and_directories(synthetic: Path, tmp_path: Path) -> None:
    source = replay.open(synthetic)
    pairs = list(source)
    assert pairs and all(frame.step == e.step for e, frame in pairs)
    assert source.header is not None and source.stop is None
    assert source.tracker_config == CONFIG.to_dict()
    assert source.run_info == {"vllm_version": "test"}
    assert [e for e, _ in replay.open(synthetic.parent)] == [e for e, _ in pairs]
    assert [e for e, _ in replay.open([synthetic])] == [e for e, _ in pairs]
    with pytest.raises(FileNotFoundError):
        open_log(tmp_path / "missing.kvlog")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="no"):
        open_log(empty)


def test_package_exports_are_lazy_and_complete() -> None:
    assert set(replay.__all__) >= {"open", "check"}
    assert replay.check is check
    try:
        from kvledger.replay import diff as diff_fn
    except ImportError:
        pytest.skip("replay.diff is not written yet")
    assert callable(diff_fn)


def test_result_json_roundtrips() -> None:
    result = check(FAULTY, first=True)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["exit_code"] == 1
    p = data["problems"][0]
    assert (p["step"], p["req_id"], p["name"]) == (
        FIRST_BAD["step"],
        FIRST_BAD["req_id"],
        "LoadPlanned",
    )
    assert p["recorded"][0]["end"] == FIRST_BAD["recorded"][1]
    assert p["event"]["type"] == "Scheduled"
    assert all(isinstance(k, str) for k in p["recorded"][0]["keys"])  # bytes as hex


def test_parse_overrides() -> None:
    assert parse_overrides(["chunk_size=512", "save_decode_cache=true", "salt=m"]) == {
        "chunk_size": 512,
        "save_decode_cache": True,
        "salt": "m",
    }
    for bad in (["chunk_size=big"], ["nope=1"], ["chunk_size"], ["save_decode_cache=maybe"]):
        with pytest.raises(ConfigError):
            parse_overrides(bad)
    result = check(CLEAN, chunk_size=33)  # not a multiple of the block size
    assert result.exit_code == 2 and "chunk_size" in (result.error or "")


def test_check_result_exit_codes() -> None:
    assert CheckResult(paths=[]).exit_code == 0
    assert CheckResult(paths=[], problems_total=3).exit_code == 1
    assert CheckResult(paths=[], problems_total=3, error="x").exit_code == 2


# --- the command line ---------------------------------------------------------------------------


def test_cli_clean_log(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(CLEAN)]) == 0
    out = capsys.readouterr().out
    assert "result: clean" in out and "(exit 0)" in out


def test_cli_faulty_log_prints_the_first_problem_readably(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", str(FAULTY)]) == 1
    out = capsys.readouterr().out
    step, req = FIRST_BAD["step"], FIRST_BAD["req_id"]
    lines = out.splitlines()
    assert (
        lines[0]
        == f"problem 1: step {step}, request {req}: LoadPlanned differs from the recorded one"
    )
    start, end = FIRST_BAD["recorded"]
    assert lines[3].split()[:3] == ["recorded", "LoadPlanned", f"start={start}"]
    assert f"end={end} " in lines[3]
    assert f"end={FIRST_BAD['correct'][1]} " in lines[4] and lines[4].split()[0] == "derived"
    assert lines[5].split()[0] == "before" and lines[6].split()[0] == "after"
    assert f"first     step {step}, request {req}" in out
    assert out.rstrip().endswith("(exit 1)")


def test_cli_json_first_and_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(FAULTY), "--json", "--first"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["problems_total"] == 1 and data["stopped_early"]
    assert data["problems"][0]["step"] == FIRST_BAD["step"]
    other = next(r for r in SIDECAR["requests_changed"] if r != FIRST_BAD["req_id"])
    assert main(["check", str(FAULTY), "--json", "--request", other]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["problems"] and {p["req_id"] for p in data["problems"]} == {other}


def test_cli_what_if(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(CLEAN), "--with", f"chunk_size={2 * C}"]) == 0
    out = capsys.readouterr().out
    assert f"what-if: chunk_size {C} -> {2 * C}" in out
    assert "divergent admissions" in out
    assert main(["check", str(CLEAN), "--with", "chunk_size=x"]) == 2
    assert "chunk_size" in capsys.readouterr().err


def test_cli_damage_names_file_offset_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offset, _ = frame_offsets(CLEAN)[-3]
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(CLEAN.read_bytes()[: offset + 20])
    assert main(["check", str(torn)]) == 2
    out = capsys.readouterr().out
    assert f"DAMAGED   {torn}: byte offset {offset}: torn_tail" in out
    assert "(exit 2)" in out
    assert main(["check", str(torn), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["stop"]["offset"] == offset and data["stop"]["kind"] == "torn_tail"


def test_cli_not_a_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.kvlog"
    path.write_bytes(b"hello world, not a log")
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "offset 0" in out and "not a kvledger log" in out


def test_cli_segments_as_several_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "d"
    out_dir.mkdir()
    writer = LogWriter(out_dir / "s.kvlog", CONFIG.to_dict(), rotate_bytes=1024, fsync="never")
    t = Tracker(CONFIG, log=writer)
    drive(t, 5)
    t.close()
    assert len(writer.paths) > 1
    assert main(["check", *map(str, writer.paths), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["paths"] == [str(p) for p in writer.paths]
    assert main(["check", str(out_dir)]) == 0
    capsys.readouterr()


def test_data_generator_is_where_the_logs_say() -> None:
    """The logs are regenerated by the script next to them, from the same workload."""
    script = DATA / "make_replay_logs.py"
    assert script.exists()
    text = script.read_text()
    for name in ("replay-clean.kvlog", "replay-short-load.kvlog", "replay-short-load.json"):
        assert name in text and (DATA / name).exists()
    for name in ("replay-clean.kvlog", "replay-short-load.kvlog"):
        assert (DATA / name).stat().st_size < 300_000


@pytest.mark.skipif(shutil.which("git") is None, reason="git not available")
def test_logs_are_not_ignored_by_git() -> None:
    import subprocess

    root = DATA.parent.parent
    res = subprocess.run(
        ["git", "check-ignore", "-q", str(CLEAN)], cwd=root, capture_output=True, check=False
    )
    if res.returncode == 128:
        pytest.skip("not a git checkout")
    assert res.returncode == 1, "tests/data/*.kvlog must not be ignored"


def test_version_names_the_release_and_where_kvledger_runs_from(capsys) -> None:
    import importlib.metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    here = Path(__file__).resolve().parent.parent / "kvledger"  # this checkout's
    assert out == f"kvledger {importlib.metadata.version('kvledger')} (from {here})"


def test_version_falls_back_to_the_pyproject_version_when_not_installed(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    expected = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert capsys.readouterr().out.startswith(f"kvledger {expected} (from ")


def test_check_replicas_reads_each_log_and_judges_them_together(tmp_path: Path) -> None:
    """``check --replicas``: each log checked alone, then together; a log that cannot be read
    is its own exit 2 and is left out of the cross-check, never a crash."""
    from _verdicts import check_replicas

    clean = str(Path(__file__).parent / "data" / "replay-clean.kvlog")
    junk = tmp_path / "junk.kvlog"
    junk.write_bytes(b"hello, not a log")
    code, out = check_replicas(clean, clean)
    assert code == 0 and out["exit_code"] == 0
    assert [r["exit_code"] for r in out["logs"]] == [0, 0]
    assert out["replicas"]["problems"] == [] and len(out["replicas"]["logs"]) == 2
    code, out = check_replicas(clean, str(junk))
    assert code == 2 and [r["exit_code"] for r in out["logs"]] == [0, 2]
    assert out["replicas"]["logs"] == [clean]
