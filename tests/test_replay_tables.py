"""The tidy tables (``replay.tables``) and ``kvledger export`` (``replay.writers``).

The tables are checked against the two other readers of a log that count the same things:
``kvledger stats`` (requests, admissions, lookups, loads, saves, preemptions, violations),
``kvledger check`` (problems), and a live ``Tracker`` fed the log's input events (the pool and
the running / waiting counts after every step). Then every output form: a directory of
parquet or JSON lines, one table in one file, standard output, a Hive tree of many logs, and
each way of naming the output wrongly.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
from _replay_logs import write_log

from kvledger import replay
from kvledger.replay import writers
from kvledger.replay.cli import main
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import check
from kvledger.replay.tables import TABLES, collect
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.state import Phase
from kvledger.tracker.tracker import Tracker

DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "replay-clean.kvlog"
SHORT = DATA / "replay-short-load.kvlog"


def _total(rows: list[dict[str, Any]], column: str) -> int:
    return sum(r[column] or 0 for r in rows)


def assert_tables_agree_with_stats_and_check(log: Any) -> dict[str, list[dict[str, Any]]]:
    rows, info = collect(log)
    st = replay.stats(log)
    assert info.damage == st.damage
    for table, columns in TABLES.items():  # every row holds exactly its table's columns
        names = [c.name for c in columns]
        assert all(list(r) == names or set(r) == set(names) for r in rows[table]), table
    requests, admissions = rows["requests"], rows["admissions"]
    assert len(requests) == st.requests
    assert _total(requests, "preemptions") == st.preemptions
    assert sum(r["finished_step"] is not None for r in requests) == st.finished
    assert Counter(r["finish_reason"] for r in requests if r["finish_reason"]) == Counter(
        st.finish_reasons
    )
    assert _total(requests, "tokens_loaded") == st.tokens_loaded
    assert _total(requests, "tokens_saved") == st.tokens_saved
    for bucket, chosen in (
        (st.all_lookups, admissions),
        (st.first_lookup, [a for a in admissions if a["admission"] == 1]),
    ):
        assert len(chosen) == bucket.admissions
        assert sum(a["asked"] is None for a in chosen) == bucket.without_lookup
        assert _total(chosen, "asked") == bucket.tokens
        assert _total(chosen, "hit") == bucket.hit
        assert _total(chosen, "local_hit") == bucket.local
        assert _total(chosen, "accepted") == bucket.external
    assert sum(a["preempted_before"] for a in admissions) == st.readmissions
    assert sum(1 for a in admissions if a["loaded"]) == st.loads
    assert _total(admissions, "loaded") == st.tokens_loaded
    steps = rows["steps"]
    assert len(steps) == st.steps
    assert _total(steps, "events") == st.events == len(rows["events"])
    assert _total(steps, "tokens_loaded") == st.tokens_loaded
    assert _total(steps, "tokens_saved") == st.tokens_saved
    assert _total(steps, "chunks_saved") == st.chunks_saved == len(rows["saves"])
    assert _total(steps, "chunks_confirmed") == st.chunks_confirmed
    assert sum(s["result"] == "done" for s in rows["saves"]) == st.chunks_confirmed
    assert _total(steps, "chunks_failed") == st.chunks_failed
    assert _total(steps, "preemptions") == st.preemptions
    assert _total(steps, "loads_refused") == st.loads_refused
    assert _total(steps, "load_failures") == st.load_failures
    assert Counter(e["type"] for e in rows["events"]) == Counter(st.events_by_type)
    assert Counter(v["rule"] for v in rows["ev_violation_recorded"]) == Counter(st.violations)
    # A StepDecoded's rows: one per request it named (never a row with an empty request).
    assert len(rows["ev_step_decoded"]) == st.logical_events - st.events + st.events_by_type.get(
        "StepDecoded", 0
    )
    assert all(r["request"] for r in rows["ev_step_decoded"])
    # The type tables hold every event of their type, linked by event to the events table.
    by_type = {e["event"]: e["type"] for e in rows["events"]}
    for table in TABLES:
        if table.startswith("ev_") and table != "ev_step_decoded":
            assert all(by_type[r["event"]] for r in rows[table])
    # An admission's keys lead to its lookup, its answer, its allocation and its load.
    typed = {t: {r["event"]: r for r in rows[t]} for t in TABLES if t.startswith("ev_")}
    for a in admissions:
        if a["asked"] is not None:
            asked = typed["ev_lookup_asked"][a["lookup_event"]]
            answer = typed["ev_lookup_answered"][a["answer_event"]]
            assert asked["request"] == answer["request"] == a["request"]
            assert (asked["step"], asked["num_tokens"]) == (a["lookup_step"], a["asked"])
            assert (answer["hit"], answer["external"]) == (a["hit"], a["offered"])
        if a["allocated_event"] is not None:
            allocated = typed["ev_allocated"][a["allocated_event"]]
            assert (allocated["request"], allocated["step"]) == (a["request"], a["allocated_step"])
            assert allocated["num_external"] == a["accepted"]
        assert typed["ev_scheduled"][a["event"]]["admission"] == a["how"].upper()
        if a["load_event"] is not None:
            load = typed["ev_load_planned"][a["load_event"]]
            assert load["request"] == a["request"] and load["step"] == a["load_step"]
            assert max(0, load["end"] - load["start"]) == a["loaded"]
            assert len(load["refused_blocks"]) == a["refused_blocks"]
        else:
            assert a["loaded"] == a["refused_blocks"] == 0
    # problems: exactly what check reports, in its order.
    result = check(log)
    assert [(p["kind"], p["name"], p["step"], p["req_id"] or "") for p in rows["problems"]] == [
        (p.kind, p.name, p.step, p.req_id) for p in result.problems
    ]
    assert len(rows["problems"]) == result.problems_total
    return rows


def assert_steps_follow_a_live_tracker(path: Path, steps: list[dict[str, Any]]) -> int:
    """Feed the log's input events to a Tracker (which derives its own decisions, as the
    run did) and compare its pool and its requests' phases with each step's row."""
    reader = LogReader(path)
    fields = {f.name for f in attrs.fields(TrackerConfig)}
    config = TrackerConfig.from_header(
        {k: v for k, v in reader.header["config"].items() if k in fields}
    )
    by_step = {s["step"]: s for s in steps}
    tracker = Tracker(config)
    compared = 0
    for frame in reader:
        for e in frame.events:
            if e.KIND == "input":
                tracker.apply(e)
        row = by_step[frame.step]
        pool = tracker.index.stats()
        phases = Counter(s.phase for s in tracker.states.values())
        assert (row["pool_stored"], row["pool_writing"], row["pool_used"]) == (
            pool["stored"],
            pool["writing"],
            config.num_slots - pool["free"],
        ), frame.step
        assert row["remote_chunks"] == len(tracker.index.remote)
        assert (row["running"], row["waiting"], row["preempted"]) == (
            phases[Phase.RUNNING],
            phases[Phase.WAITING],
            phases[Phase.PREEMPTED],
        ), frame.step
        compared += 1
        tracker.end_step()
    return compared


DATA_LOGS = sorted(DATA.glob("*.kvlog"))


@pytest.mark.parametrize("log", DATA_LOGS, ids=[p.stem for p in DATA_LOGS])
def test_tables_of_the_data_logs_agree_with_stats_check_and_a_tracker(log: Path) -> None:
    rows = assert_tables_agree_with_stats_and_check(log)
    assert assert_steps_follow_a_live_tracker(log, rows["steps"]) == replay.stats(log).steps
    if log in (CLEAN, SHORT):
        assert max(s["pool_used"] for s in rows["steps"]) == 24  # the pool fills: evictions
    elif log.stem == "finished_v1":  # a format 1.0 log of events about requests it never added
        assert rows["requests"] == [] and len(rows["problems"]) == 1
    else:  # tail-alias-dd9a848 (tests/test_block_hits.py): two requests, no problem
        assert len(rows["requests"]) == 2 and rows["problems"] == []


def test_tables_of_a_synthetic_log(synthetic_log: Path) -> None:
    rows = assert_tables_agree_with_stats_and_check(synthetic_log)
    assert assert_steps_follow_a_live_tracker(synthetic_log, rows["steps"]) > 5
    # The synthetic run's story, read off the tables: b preempted at 3, back at 5 with a load
    # from the pool; d accepted more than it was offered (a violation).
    b = [a for a in rows["admissions"] if a["request"] == "req-b"]
    assert [(a["admission"], a["step"], a["ended_by"]) for a in b] == [
        (1, 0, "preempted"),
        (2, 5, "finished"),
    ]
    assert b[0]["end_step"] == 3 and b[1]["waiting_since"] == 3 and b[1]["lookups"] == 2
    assert b[1]["preempted_before"] and b[1]["loaded"] > 0 and b[1]["load_result"] == "done"
    d = next(a for a in rows["admissions"] if a["request"] == "req-d")
    assert d["accepted"] > d["offered"]
    (violation,) = rows["ev_violation_recorded"]
    assert (violation["request"], violation["rule"]) == ("req-d", "accepted_equals_answer")
    assert violation["event_type"] == "Allocated"  # the event field, not the key column
    r = {x["request"]: x for x in rows["requests"]}
    assert r["req-d"]["violations"] == 1 and r["req-d"]["recompute_only"]
    assert r["req-b"]["admissions"] == 2 and r["req-b"]["preemptions"] == 1


def test_the_short_load_shows_in_the_admissions_table() -> None:
    """The injected fault (loads one block short of what vLLM accepted) is a plain
    comparison of two columns of one row."""
    truth = json.loads((DATA / "replay-short-load.json").read_text())
    rows, _ = collect(SHORT, ["admissions"])
    short = [a for a in rows["admissions"] if a["loaded"] < a["accepted"]]
    assert sorted({a["request"] for a in short}) == sorted(truth["requests_changed"])
    first = min(short, key=lambda a: a["step"])
    assert (first["step"], first["request"]) == (truth["first_bad"]["step"], "req-2")
    assert [first["load_start"], first["load_end"]] == truth["first_bad"]["recorded"]
    assert first["accepted"] == truth["first_bad"]["correct"][1]
    clean, _ = collect(CLEAN, ["admissions"])
    assert not [a for a in clean["admissions"] if a["loaded"] < a["accepted"]]


def test_a_reused_id_is_two_requests(tmp_path: Path) -> None:
    """vLLM may reuse an id once the request finished: two lives, two rows, two keys."""
    from kvledger.connector.logwriter import LogWriter
    from kvledger.tracker import events as ev

    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=8)
    path = tmp_path / "reuse.kvlog"
    with LogWriter(path, config.to_dict(), fsync="never") as w:
        tracker = Tracker(config, log=w)
        for step in range(2):
            tracker.step = step * 2
            tracker.apply(ev.RequestAdded(step * 2, "r", tuple(range(10))))
            tracker.apply(ev.LookupAsked(step * 2, "r", 0, 10))
            tracker.apply(ev.Allocated(step * 2, "r", (1,), 0))
            tracker.apply(ev.Scheduled(step * 2, "r", 0, 10, 0, (), (1,), ev.Admission.NEW))
            tracker.end_step()
            tracker.apply(ev.Finished(step * 2 + 1, "r", "stopped"))
            tracker.end_step()
    rows, _ = collect(path, ["requests", "admissions"])
    assert [(r["request"], r["req_id"], r["admissions"]) for r in rows["requests"]] == [
        ("r", "r", 1),
        ("r#2", "r", 1),
    ]
    assert [(a["request"], a["step"]) for a in rows["admissions"]] == [("r", 0), ("r#2", 2)]


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["base", "loads", "chunk16"])
def test_tables_of_real_runs_agree_with_stats_check_and_a_tracker(
    real_logs: dict[str, Path], name: str
) -> None:
    rows = assert_tables_agree_with_stats_and_check(real_logs[name])
    (log,) = sorted(real_logs[name].glob("*.kvlog"))
    assert assert_steps_follow_a_live_tracker(log, rows["steps"]) == len(rows["steps"])


# --- writing: every form ----------------------------------------------------------------------


def _read_dir(directory: Path, fmt: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for table in TABLES:
        path = directory / f"{table}.{fmt}"
        if fmt == "jsonl":
            out[table] = [json.loads(line) for line in path.read_text().splitlines()]
        else:
            import pyarrow.parquet as pq

            t = pq.read_table(path)
            assert t.column_names == [c.name for c in TABLES[table]]
            out[table] = t.to_pylist()
    return out


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_directory_holds_every_table(tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    out = tmp_path / "tables"
    result = replay.export(SHORT, out, None if fmt == "parquet" else fmt)
    assert (result.form, result.format) == ("directory", fmt)
    expected, _ = collect(SHORT)
    assert _read_dir(out, fmt) == expected
    assert result.rows == {t: len(r) for t, r in expected.items()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvledger-export")]
    # Again into the same directory: replaced, not appended.
    replay.export(SHORT, out, None if fmt == "parquet" else fmt)
    assert _read_dir(out, fmt) == expected


def test_one_table_to_one_file_and_to_standard_output(tmp_path: Path, capsys: Any) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    expected, _ = collect(SHORT, ["admissions"], problems=False)
    result = replay.export(SHORT, tmp_path / "adm.parquet", table="admissions")
    assert (result.form, result.format, result.rows) == ("file", "parquet", {"admissions": 21})
    assert pq.read_table(tmp_path / "adm.parquet").to_pylist() == expected["admissions"]
    assert main(["export", str(SHORT), "--table", "admissions", "-o", "-"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line) for line in out.splitlines()] == expected["admissions"]
    assert "wrote 21 rows in 1 table to standard output (jsonl)" in err


def _cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_the_output_names_the_format_and_a_mismatch_is_an_error(
    tmp_path: Path, capsys: Any
) -> None:
    log = str(SHORT)
    # The seen bug: a .parquet output holding JSON lines. Now: parquet, or a clear error.
    code, _, err = _cli(
        capsys, "export", log, "--table", "steps", "-o", str(tmp_path / "s.parquet")
    )
    assert code == 0 and (tmp_path / "s.parquet").read_bytes()[:4] == b"PAR1"
    code, _, err = _cli(capsys, "export", log, "-o", str(tmp_path / "out.parquet"))
    assert code == 2 and f"names one file, but the export is {len(TABLES)} tables" in err
    assert not (tmp_path / "out.parquet").exists()
    for argv, message in (
        (["--table", "steps", "-o", "x.parquet", "--format", "jsonl"], "names parquet, but"),
        (["--table", "steps", "-o", "x.jsonl", "--format", "parquet"], "names jsonl, but"),
        (["-o", "x.json", "--format", "parquet"], "names perfetto, but"),
        (["-o", "tables", "--format", "perfetto"], "a Perfetto trace is one file"),
        (["-o", "x.txt"], "cannot tell the format from"),
        (["--table", "nosuch", "-o", "x.jsonl"], "no table 'nosuch'"),
        (["-o", "-"], "standard output) holds one table"),
        (["--table", "steps", "-o", "-", "--format", "parquet"], "JSON lines only"),
    ):
        argv = [str(tmp_path / a) if a.startswith(("x.", "tables")) else a for a in argv]
        code, _, err = _cli(capsys, "export", log, *argv)
        assert code == 2 and message in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.parquet"]


def test_a_missing_or_wrong_output_place_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    log = str(SHORT)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    for argv, message in (
        (["-o", str(tmp_path / "missing" / "tables")], "no such directory"),
        (["--table", "steps", "-o", str(tmp_path / "missing" / "s.jsonl")], "no such directory"),
        (["-o", str(tmp_path / "missing" / "t.json")], "no such directory"),
        (["-o", str(tmp_path / "afile")], "is a file"),
        (["--table", "steps", "-o", str(tmp_path / "adir")], "names a directory"),
        (["--table", "steps", "-o", str(tmp_path / "nodir")], "names a directory"),
    ):
        code, out, err = _cli(capsys, "export", log, *argv, "--json")
        assert code == 2 and err.startswith("kvledger: ") and message in err, (argv, err)
        assert message in json.loads(out)["error"]
    code, _, err = _cli(capsys, "export", log, log, "-o", str(tmp_path / "fleet"))
    assert code == 2 and "--partition run" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert not list((tmp_path / "adir").iterdir())


def test_an_unreadable_log_writes_nothing(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes(b"not a log at all")
    code, _, err = _cli(capsys, "export", str(bad), "-o", str(tmp_path / "tables"))
    assert code == 2 and "cannot read the log" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.kvlog"]


def test_a_torn_log_exports_what_it_holds_and_says_so(tmp_path: Path, capsys: Any) -> None:
    from _logfiles import torn_copy

    torn = torn_copy(SHORT, tmp_path / "torn.kvlog", 200)
    code, _, err = _cli(capsys, "export", str(torn), "-o", str(tmp_path / "t"), "--format", "jsonl")
    assert code == 2 and "read stopped early" in err
    st = replay.stats(torn)
    events = (tmp_path / "t" / "events.partial.jsonl").read_text().splitlines()
    assert 0 < len(events) == st.events < replay.stats(SHORT).events


def _damaged(kind: str, where: Path) -> Path:
    """SHORT torn inside its last frame (a crash mid-write), or with a byte of a frame near
    its end flipped (a checksum mismatch)."""
    from _logfiles import torn_copy

    if kind == "torn":
        return torn_copy(SHORT, where / "torn.kvlog", 200)
    data = bytearray(SHORT.read_bytes())
    data[len(data) - 60] ^= 0xFF
    bad = where / "corrupt.kvlog"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize(("kind", "says"), [("torn", "torn_tail"), ("corrupt", "checksum")])
def test_a_damaged_log_exports_files_marked_partial_in_name_and_metadata(
    kind: str, says: str, tmp_path: Path, capsys: Any
) -> None:
    """Exit 2 and a line on stderr are gone once the files are read elsewhere: each file of a
    log read only in part is <table>.partial.parquet, its footer's metadata says why, and a
    whole export of the same directory from before is not left beside it."""
    pq = pytest.importorskip("pyarrow.parquet")
    damaged = _damaged(kind, tmp_path)
    out = tmp_path / "t"
    assert _cli(capsys, "export", str(CLEAN), "-o", str(out))[0] == 0  # an earlier export
    code, text, err = _cli(capsys, "export", str(damaged), "-o", str(out), "--json")
    assert code == 2 and "read stopped early" in err and ".partial" in err
    report = json.loads(text)
    assert says in report["partial"] and report["out"] == str(out)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{t}.partial.parquet" for t in TABLES)
    for name in names:
        why = pq.read_metadata(out / name).metadata[b"kvledger.partial"].decode()
        assert why.startswith("read stopped early: ") and says in why
    assert pq.read_table(out / "events.partial.parquet").num_rows == replay.stats(damaged).events
    # kvledger sql over it says so, as over the log itself, and reads what is there.
    code, text, err = _cli(capsys, "sql", str(out), "SELECT count(*) AS n FROM requests", "--json")
    assert code == 2 and "an export of a log read only in part" in err and says in err
    assert json.loads(text)[0]["n"] > 0
    # A whole export afterwards replaces them all.
    assert _cli(capsys, "export", str(CLEAN), "-o", str(out))[0] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)


def test_every_form_of_a_partial_export_is_marked(tmp_path: Path, capsys: Any) -> None:
    """One table in one file (parquet, JSON lines), standard output, a Hive tree."""
    pq = pytest.importorskip("pyarrow.parquet")
    damaged = _damaged("torn", tmp_path)
    one = tmp_path / "adm.parquet"
    one.write_bytes(b"an earlier whole export")
    code, text, _ = _cli(
        capsys, "export", str(damaged), "--table", "admissions", "-o", str(one), "--json"
    )
    marked = tmp_path / "adm.partial.parquet"
    assert code == 2 and json.loads(text)["out"] == str(marked)
    assert not one.exists() and b"kvledger.partial" in pq.read_metadata(marked).metadata
    code, _, err = _cli(
        capsys, "export", str(damaged), "--table", "steps", "-o", str(tmp_path / "s.jsonl")
    )
    assert code == 2 and f"to {tmp_path / 's.partial.jsonl'} (jsonl)" in err
    assert (tmp_path / "s.partial.jsonl").exists() and not (tmp_path / "s.jsonl").exists()
    # Standard output has no name to mark: its last line says it.
    code, text, _ = _cli(capsys, "export", str(damaged), "--table", "steps", "-o", "-")
    *rows, last = text.splitlines()
    assert code == 2 and "torn_tail" in json.loads(last)["kvledger.partial"]
    assert rows and all("kvledger.partial" not in json.loads(r) for r in rows)
    # A tree: the run is <name>.partial, on every row; its earlier whole partition goes.
    tree = tmp_path / "fleet"
    writers.export_runs([CLEAN], tree, names=["torn"])
    code, _, err = _cli(
        capsys, "export", str(CLEAN), str(damaged), "-o", str(tree), "--partition", "run"
    )
    assert code == 2 and "runs replay-clean, torn.partial" in err
    assert sorted(p.name for p in (tree / "requests").iterdir()) == [
        "run=replay-clean",
        "run=torn.partial",
    ]
    part = tree / "requests" / "run=torn.partial" / "part-0.parquet"
    assert b"torn_tail" in pq.read_metadata(part).metadata[b"kvledger.partial"]
    code, text, err = _cli(
        capsys, "sql", str(tree), "SELECT DISTINCT run FROM steps ORDER BY run", "--json"
    )
    assert code == 2 and "run=torn.partial: read stopped early" in err
    assert [r["run"] for r in json.loads(text)] == ["replay-clean", "torn.partial"]


def test_many_logs_make_one_hive_tree(tmp_path: Path, synthetic_log: Path, capsys: Any) -> None:
    duckdb = pytest.importorskip("duckdb")
    tree = tmp_path / "fleet"
    code, _, err = _cli(
        capsys, "export", str(CLEAN), str(SHORT), "-o", str(tree), "--partition", "run"
    )
    assert code == 0 and "runs replay-clean, replay-short-load" in err
    assert (tree / "requests" / "run=replay-short-load" / "part-0.parquet").exists()
    # The tree grows run by run: a third log later keeps the first two.
    result = writers.export_runs([synthetic_log], tree, names=["synthetic"])
    assert result.runs == ("synthetic",)
    con = duckdb.connect()
    got = con.sql(
        f"SELECT run, count(*) FROM read_parquet('{tree}/admissions/*/*.parquet', "
        "hive_partitioning = true) GROUP BY run ORDER BY run"
    ).fetchall()
    assert got == [
        ("replay-clean", replay.stats(CLEAN).all_lookups.admissions),
        ("replay-short-load", replay.stats(SHORT).all_lookups.admissions),
        ("synthetic", replay.stats(synthetic_log).all_lookups.admissions),
    ]
    problems = con.sql(
        f"SELECT run, count(*) FROM read_parquet('{tree}/problems/*/*.parquet', "
        "hive_partitioning = true) GROUP BY run ORDER BY run"
    ).fetchall()
    assert dict(problems) == {
        "replay-short-load": check(SHORT).problems_total,
        "synthetic": check(synthetic_log).problems_total,
    }
    with pytest.raises(writers.ExportError, match="two logs would be run=replay-clean"):
        writers.export_runs([CLEAN, CLEAN], tmp_path / "twice")


def _many_requests(path: Path, n: int) -> None:
    """``n`` requests one after another (two live at a time), each saved and finished; their
    prompts repeat every 40 requests (the distinct prefixes computed are what explains a miss,
    kept by ``replay.explain``'s history, within its own bound)."""
    from kvledger.connector.logwriter import LogWriter
    from kvledger.tracker import events as ev

    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=16)
    with LogWriter(path, config.to_dict(), fsync="never") as w:
        tracker = Tracker(config, log=w)
        saved: list[ev.SaveDone] = []
        for i in range(n):
            step = tracker.step
            rid = f"req-{i}"
            prompt = tuple(((i % 40) * 7 + k) % 1000 for k in range(64))
            for done in saved:
                tracker.apply(done)
            saved = []
            tracker.apply(ev.RequestAdded(step, rid, prompt))
            tracker.apply(ev.LookupAsked(step, rid, 0, 64))
            tracker.apply(ev.Allocated(step, rid, (1, 2, 3, 4), 0))
            plans = tracker.apply(
                ev.Scheduled(step, rid, 0, 64, 0, prompt, (1, 2, 3, 4), ev.Admission.NEW)
            )
            saved += [
                ev.SaveDone(step + 1, rid, d.keys) for d in plans if isinstance(d, ev.SavePlanned)
            ]
            if i:
                tracker.apply(ev.Finished(step, f"req-{i - 1}", "stopped"))
            tracker.end_step()


def test_memory_follows_the_live_requests_not_the_log(tmp_path: Path) -> None:
    """A request's rows go out when the walk retires it: four times the requests, about the
    same peak (the same prompts: the history of computed prefixes, which explains misses,
    grows with distinct prompts only, up to its bound: test_explain.py)."""
    from _memory import traced_peak

    from kvledger.replay.tables import table_rows

    peaks = []
    for n in (300, 1200):
        path = tmp_path / f"many-{n}.kvlog"
        _many_requests(path, n)
        seen: Counter[str] = Counter()

        def count(table: str, row: Any, seen: Counter[str] = seen) -> None:
            seen[table] += 1

        with traced_peak() as traced:
            table_rows(path, count, problems=False)
        peaks.append(traced.bytes)
        assert seen["requests"] == seen["admissions"] == n
        assert seen["saves"] == 2 * n
    assert peaks[1] < 1.5 * peaks[0], peaks


def test_a_rotated_log_reads_as_one(tmp_path: Path) -> None:
    """A log split into segments (a directory) gives the tables of the whole run."""
    from kvledger.replay.logreader import segment_paths

    whole, rotated = tmp_path / "whole.kvlog", tmp_path / "rotated" / "run.kvlog"
    rotated.parent.mkdir()
    write_log(whole)
    write_log(rotated, rotate_bytes=600)
    assert len(segment_paths(rotated.parent)) > 2
    rows = assert_tables_agree_with_stats_and_check(rotated.parent)
    expected, _ = collect(whole)
    for table in ("requests", "admissions", "saves", "problems"):
        assert rows[table] == expected[table], table
    assert [{**s, "wall_ns": 0, "seq": 0} for s in rows["steps"]] == [
        {**s, "wall_ns": 0, "seq": 0} for s in expected["steps"]
    ]


def test_the_remote_stores_facts_have_their_tables_and_count_in_the_steps(tmp_path: Path) -> None:
    """Remote tier facts (issue 12): typed tables of their own, and the steps' remote_chunks
    follow the Tracker's remote index (an outage forgets everything)."""
    from kvledger.connector.logwriter import LogWriter
    from kvledger.tracker import events as ev

    config = TrackerConfig(block_size=16, chunk_size=32, num_slots=8)
    path = tmp_path / "remote.kvlog"
    k1, k2, k3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    with LogWriter(path, config.to_dict(), fsync="never") as w:
        tracker = Tracker(config, log=w)
        tracker.apply(ev.RequestAdded(0, "r", tuple(range(40))))
        tracker.apply(ev.RemoteFound(0, "r", (k1, k2), (1, 0)))
        tracker.end_step()
        tracker.apply(ev.RemoteSaveDone(1, "r", (k2, k3)))
        tracker.end_step()
        tracker.apply(ev.RemoteOutage(2, "", "connection refused"))
        tracker.end_step()
        tracker.apply(ev.RemoteRestored(3, ""))
        tracker.apply(ev.RemoteFound(3, "r", (k1,), (1,)))
        tracker.end_step()
    rows = assert_tables_agree_with_stats_and_check(path)
    assert assert_steps_follow_a_live_tracker(path, rows["steps"]) == 4
    assert [s["remote_chunks"] for s in rows["steps"]] == [1, 3, 0, 1]
    (outage,) = rows["ev_remote_outage"]
    assert outage == {"event": 3, "step": 2, "error": "connection refused"}  # no request
    found = rows["ev_remote_found"]
    assert [(f["request"], f["keys"], f["found"]) for f in found] == [
        ("r", [k1.hex(), k2.hex()], [1, 0]),
        ("r", [k1.hex()], [1]),
    ]
