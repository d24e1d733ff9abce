"""``kvledger sql`` and the ready queries of docs/sql.md.

Each documented query is run as it is written, and its output compared with the page; then the
same query runs over every test log (``tests/data``, a synthetic log, logs of vLLM's real
scheduler) and must give ``kvledger stats``'s numbers (and ``kvledger check``'s problems). The
sources (a log, several logs, an export directory of parquet or JSON lines, a Hive tree) must
all give the same answer.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from kvledger import replay
from kvledger.replay import sql, writers
from kvledger.replay.cli import main
from kvledger.replay.extras import MissingExtra
from kvledger.replay.replayer import check
from kvledger.replay.tables import markdown_reference

pytest.importorskip("duckdb")

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
CLEAN = DATA / "replay-clean.kvlog"
SHORT = DATA / "replay-short-load.kvlog"
PAGE = ROOT / "docs" / "sql.md"


def documented_queries() -> dict[str, tuple[str, str, str]]:
    """name -> (log, query, output) of each ``<!-- query: name -->`` block of docs/sql.md."""
    text = PAGE.read_text()
    out = {}
    for m in re.finditer(r"<!-- query: (\S+) -->\n```console\n(.*?)```", text, re.S):
        block = m.group(2)
        head = re.match(r'\$ kvledger sql (\S+) "(.*?)"\n(.*)', block, re.S)
        assert head is not None, m.group(1)
        out[m.group(1)] = (head.group(1), head.group(2), head.group(3))
    return out


QUERIES = documented_queries()


def run(log: Any, name: str) -> list[dict[str, Any]]:
    return sql.query([str(log)], QUERIES[name][1]).to_dicts()


def test_the_page_documents_these_queries() -> None:
    assert set(QUERIES) == {
        "hit-rate",
        "hit-rate-per-step",
        "naive-hit-rate",
        "first-admissions",
        "short-loads",
        "pool-pressure",
        "missed-by-reason",
        "problems",
    }


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_each_documented_query_prints_what_the_page_shows(name: str, capsys: Any) -> None:
    log, query, shown = QUERIES[name]
    assert main(["sql", str(ROOT / log), query]) == 0
    assert capsys.readouterr().out == shown


def test_the_reference_is_the_code() -> None:
    """docs/sql.md's reference is replay.tables.TABLES. A new event type (a new ev_ table) or
    column makes it stale: ``KVLEDGER_WRITE_DOCS=1 pytest tests/test_sql.py -k reference``
    rewrites it."""
    text = PAGE.read_text()
    head, rest = text.split("<!-- BEGIN generated: tables -->\n", 1)
    block, tail = rest.split("<!-- END", 1)
    if block != markdown_reference() and os.environ.get("KVLEDGER_WRITE_DOCS"):
        PAGE.write_text(
            f"{head}<!-- BEGIN generated: tables -->\n{markdown_reference()}<!-- END{tail}"
        )
        return
    assert block == markdown_reference(), (
        "docs/sql.md's reference is stale: KVLEDGER_WRITE_DOCS=1 pytest tests/test_sql.py -k "
        "reference rewrites it"
    )


def assert_queries_agree_with_stats(log: Any) -> None:
    st = replay.stats(log)
    every, first = st.all_lookups, st.first_lookup
    (total,) = run(log, "hit-rate")
    assert (total["admissions"], total["asked"] or 0, total["hit"] or 0) == (
        every.admissions,
        every.tokens,
        every.hit,
    )
    if every.tokens:
        assert total["hit_rate"] == round(every.hit / every.tokens, 3)
        assert total["accepted_rate"] == round(every.external / every.tokens, 3)
    per_step = run(log, "hit-rate-per-step")
    assert sum(r["admissions"] for r in per_step) == every.admissions
    assert sum(r["asked"] or 0 for r in per_step) == every.tokens
    assert sum(r["hit"] or 0 for r in per_step) == every.hit
    assert [r["step"] for r in per_step] == sorted({r["step"] for r in per_step})
    (naive,) = run(log, "naive-hit-rate")
    assert naive["lookups"] == st.events_by_type.get("LookupAsked", 0)
    if naive["lookups"] > every.admissions:  # somebody waited: the naive sum counts it again
        assert (naive["asked"] or 0) > every.tokens
    (firsts,) = run(log, "first-admissions")
    assert (firsts["admissions"], firsts["asked"] or 0, firsts["hit"] or 0) == (
        first.admissions,
        first.tokens,
        first.hit,
    )
    pool = run(log, "pool-pressure")
    assert sum(r["saved"] for r in pool) == st.chunks_saved
    assert all(r["peak_used"] <= r["slots"] for r in pool)
    missed = {r["reason"]: r["tokens"] for r in run(log, "missed-by-reason")}
    assert missed == st.misses["reasons"]
    assert run(log, "problems") == [
        {"problem": n, "step": p.step, "request": p.req_id or None, "headline": p.headline()}
        for n, p in enumerate(check(log).problems, 1)
    ]


DATA_LOGS = sorted(DATA.glob("*.kvlog"))


@pytest.mark.parametrize("log", DATA_LOGS, ids=[p.stem for p in DATA_LOGS])
def test_the_queries_give_the_numbers_of_stats_on_the_data_logs(log: Path) -> None:
    assert_queries_agree_with_stats(log)


def test_the_short_load_query_names_the_requests_the_fault_changed() -> None:
    truth = json.loads((DATA / "replay-short-load.json").read_text())
    rows = run(SHORT, "short-loads")
    assert sorted(r["request"] for r in rows) == sorted(truth["requests_changed"])
    assert all(r["accepted"] - r["loaded"] == 16 for r in rows)  # one block short each
    assert run(CLEAN, "short-loads") == []


def test_the_queries_on_a_synthetic_log(synthetic_log: Path) -> None:
    log = synthetic_log
    assert_queries_agree_with_stats(log)
    # req-b: preempted, back with a load of everything it was offered.
    assert run(log, "short-loads") == []


@pytest.mark.vllm
def test_the_queries_on_logs_of_vllms_scheduler(real_logs: dict[str, Path]) -> None:
    for name, log in real_logs.items():
        assert_queries_agree_with_stats(log)
        assert run(log, "short-loads") == [], name


@pytest.mark.vllm
def test_the_naive_join_on_the_demo_log_reads_what_the_page_says(
    tmp_path: Path, capsys: Any
) -> None:
    """The issue's case: on ``kvledger demo``'s log the naive join gives 12.9 %, the
    admissions 24.2 %, which is ``stats``'s number."""
    block = PAGE.read_text().split("<!-- demo: naive-vs-admissions -->\n```console\n", 1)[1]
    block = block.split("```", 1)[0]
    logs = tmp_path / "demo"
    assert main(["demo", "--log-dir", str(logs)]) == 0
    capsys.readouterr()
    runs = re.findall(r'\$ kvledger sql demo "(.*?)"\n(.*?)(?=\$ |\Z)', block, re.S)
    assert len(runs) == 2
    for query, shown in runs:
        assert main(["sql", str(logs), query]) == 0
        assert capsys.readouterr().out == shown
    # The admissions query's hit rate is the truth the page names, and stats' own figure.
    shown_rate = float(runs[1][1].strip().splitlines()[-1].split()[3])
    every = replay.stats(logs).all_lookups
    assert every.hit_rate is not None and round(every.hit_rate, 3) == shown_rate
    assert f"pool hit {every.hit} ({every.hit_rate:.1%})" in PAGE.read_text()


# --- sources ------------------------------------------------------------------------------------


def test_every_source_gives_the_same_answer(tmp_path: Path) -> None:
    query = QUERIES["hit-rate-per-step"][1]
    expected = sql.query([str(SHORT)], query).rows
    replay.export(SHORT, tmp_path / "parquet")
    replay.export(SHORT, tmp_path / "jsonl", "jsonl")
    assert sql.query([str(tmp_path / "parquet")], query).rows == expected
    assert sql.query([str(tmp_path / "jsonl")], query).rows == expected
    writers.export_runs([CLEAN, SHORT], tmp_path / "tree")
    writers.export_runs([CLEAN, SHORT], tmp_path / "jtree", "jsonl")
    runs = "SELECT run, count(*) AS n, sum(hit) AS hit FROM admissions GROUP BY run ORDER BY run"
    by_run = [
        ("replay-clean", 21, replay.stats(CLEAN).all_lookups.hit),
        ("replay-short-load", 21, replay.stats(SHORT).all_lookups.hit),
    ]
    for source in ([str(tmp_path / "tree")], [str(tmp_path / "jtree")], [str(CLEAN), str(SHORT)]):
        assert sql.query(source, runs).rows == by_run, source
    # Empty tables are views too, typed: a query over them is not an error.
    none = "SELECT count(*), sum(len(keys)) FROM ev_save_failed"
    for source in ("parquet", "jsonl", "tree", "jtree"):
        assert sql.query([str(tmp_path / source)], none).rows == [(0, None)], source


def _cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_errors_are_exit_2_with_a_message(tmp_path: Path, capsys: Any) -> None:
    log = str(SHORT)
    code, _, err = _cli(capsys, "sql", log, "SELECT nosuch FROM requests")
    assert code == 2 and err.startswith("kvledger: Binder Error") and '"nosuch"' in err
    code, _, err = _cli(capsys, "sql", log, "SELEC 1")
    assert code == 2 and "Parser Error" in err
    code, out, err = _cli(capsys, "sql", log, "SELECT * FROM nosuch", "--json")
    assert code == 2 and "nosuch" in err and json.loads(out)["exit_code"] == 2
    code, _, err = _cli(capsys, "sql", log)
    assert code == 2 and "give a source and a query" in err
    code, _, err = _cli(capsys, "sql", str(tmp_path / "missing.kvlog"), "SELECT 1")
    assert code == 2 and "no such file" in err
    replay.export(SHORT, tmp_path / "tables", "jsonl", problems=False)
    code, _, err = _cli(capsys, "sql", str(tmp_path / "tables"), log, "SELECT 1")
    assert code == 2 and "several sources must all be logs" in err


def test_json_and_the_table_list(capsys: Any) -> None:
    code, out, _ = _cli(capsys, "sql", str(SHORT), "SELECT request, admissions FROM requests "
                        "WHERE preemptions > 1 ORDER BY request", "--json")  # fmt: skip
    assert code == 0 and json.loads(out) == [{"request": "req-8", "admissions": 3}]
    code, out, _ = _cli(capsys, "sql", str(SHORT), "--tables")
    assert code == 0 and "admissions" in out and "preempted_before" in out


def test_json_is_strict_json_a_number_that_is_not_finite_is_null(capsys: Any) -> None:
    # 1/0 printed `"a": Infinity` and 0/0 `NaN`, which no strict JSON parser takes.
    query = "SELECT 1/0 AS a, -1/0 AS b, 0/0 AS c, [1/0, 2.5] AS d, {'e': 0/0} AS f"
    code, out, _ = _cli(capsys, "sql", str(SHORT), query, "--json")

    def refuse(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    assert code == 0
    assert json.loads(out, parse_constant=refuse) == [
        {"a": None, "b": None, "c": None, "d": [None, 2.5], "f": {"e": None}}
    ]


def test_json_refuses_a_result_with_a_column_named_twice(capsys: Any) -> None:
    # Each row became an object keyed by column name: one of the two columns was lost.
    query = "SELECT 'x' AS a, 'y' AS a, 1 AS b"
    code, out, err = _cli(capsys, "sql", str(SHORT), query, "--json")
    assert code == 2 and "'a' more than once" in err and "AS a_2" in err and "'b'" not in err
    assert json.loads(out)["exit_code"] == 2 and "'a' more than once" in json.loads(out)["error"]
    code, out, _ = _cli(capsys, "sql", str(SHORT), query)  # the table shows both
    assert code == 0 and out.split() == ["a", "a", "b", "x", "y", "1"]
    code, out, _ = _cli(capsys, "sql", str(SHORT), "SELECT 'x' AS a, 'y' AS a_2", "--json")
    assert code == 0 and json.loads(out) == [{"a": "x", "a_2": "y"}]


def test_a_damaged_log_is_queried_up_to_the_damage_and_said(tmp_path: Path, capsys: Any) -> None:
    from _logfiles import torn_copy

    torn = torn_copy(SHORT, tmp_path / "torn.kvlog", 200)
    code, out, err = _cli(capsys, "sql", str(torn), "SELECT count(*) AS n FROM events")
    assert code == 2 and "read stopped early" in err
    assert out.split() == ["n", str(replay.stats(torn).events)]


def test_without_duckdb_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "duckdb", None)
    with pytest.raises(MissingExtra, match=re.escape("pip install kvledger[sql]")):
        sql.query([str(SHORT)], "SELECT 1")
    code, _, err = _cli(capsys, "sql", str(SHORT), "SELECT 1")
    assert code == 2 and "pip install kvledger[sql]" in err


# --- files: a query reads the tables and nothing else ---------------------------------------

_REFUSED = {
    "read a file": "SELECT count(*) FROM read_csv('{secret}')",
    "read a file's text": "SELECT content FROM read_text('{secret}')",
    "read a file by name": "SELECT * FROM '{secret}'",
    "list files": "SELECT * FROM glob('{dir}/*')",
    "write a file": "COPY (SELECT 1 AS x) TO '{dir}/written.csv'",
    "export the database": "EXPORT DATABASE '{dir}/exported'",
    "attach a database": "ATTACH '{dir}/attached.duckdb' AS other",
    "install an extension": "INSTALL httpfs",
    "load an extension": "LOAD httpfs",
    "turn file access back on": "SET enable_external_access = true",
    "unlock the configuration": "SET lock_configuration = false",
    "reset the lock": "RESET lock_configuration",
    "allow a directory": "SET allowed_directories = ['/']",
}


@pytest.mark.parametrize("what", list(_REFUSED))
def test_by_default_a_query_touches_no_file(what: str, tmp_path: Path, capsys: Any) -> None:
    """Shared log servers: ``kvledger sql`` reads its sources, then DuckDB's access to files,
    extensions and its own settings is off (docs/sql.md, "Files")."""
    secret = tmp_path / "secret.csv"
    secret.write_text("password\nhunter2\n")
    query = _REFUSED[what].format(secret=secret, dir=tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(sql.SqlError) as refused:
        sql.query([str(SHORT)], query)
    assert "hunter2" not in str(refused.value)
    assert any(word in str(refused.value) for word in ("disabled", "locked", "Permission")), (
        refused.value
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a file was written"
    code, out, err = _cli(capsys, "sql", str(SHORT), query)
    assert code == 2 and "hunter2" not in out + err and err.startswith("kvledger: ")


def test_by_default_etc_passwd_cannot_be_read(capsys: Any) -> None:
    code, out, err = _cli(capsys, "sql", str(SHORT), "SELECT * FROM read_csv('/etc/passwd')")
    assert code == 2 and "root" not in out and "disabled by configuration" in err


def test_the_sources_are_read_and_cannot_be_overwritten(tmp_path: Path) -> None:
    """An export directory and a Hive tree are read before the lock, through pyarrow: the
    query sees their tables, and can neither write over their files nor read beside them."""
    writers.export_runs([CLEAN, SHORT], tmp_path / "tree")
    replay.export(SHORT, tmp_path / "jsonl", "jsonl")
    part = next((tmp_path / "tree" / "requests").glob("run=*/*.parquet"))
    data = part.read_bytes()
    count = "SELECT count(*) FROM requests"
    assert sql.query([str(tmp_path / "tree")], count).rows == [(26,)]
    assert sql.query([str(tmp_path / "jsonl")], count).rows == [(13,)]
    for query in (
        f"COPY (SELECT 1 AS x) TO '{part}' (USE_TMP_FILE false)",
        f"COPY (SELECT 1 AS x) TO '{tmp_path / 'tree' / 'x.csv'}'",
        f"SELECT count(*) FROM read_parquet('{part}')",
        f"SELECT count(*) FROM read_json('{tmp_path / 'jsonl' / 'steps.jsonl'}')",
    ):
        with pytest.raises(sql.SqlError, match="disabled by configuration"):
            sql.query([str(tmp_path / "tree")], query)
    assert part.read_bytes() == data
    assert sql.query([str(tmp_path / "tree")], count).rows == [(26,)]


def test_allow_files_gives_duckdb_its_files_back(tmp_path: Path, capsys: Any) -> None:
    secret = tmp_path / "notes.csv"
    secret.write_text("word\nhello\n")
    read = f"SELECT word FROM read_csv('{secret}')"
    assert sql.query([str(SHORT)], read, allow_files=True).rows == [("hello",)]
    code, out, _ = _cli(capsys, "sql", str(SHORT), read, "--allow-files")
    assert code == 0 and "hello" in out
    out_file = tmp_path / "requests.csv"
    code, _, _ = _cli(capsys, "sql", "--allow-files", str(SHORT), f"COPY requests TO '{out_file}'")
    assert code == 0 and out_file.read_text().count("\n") == 14  # a header and 13 requests
    # The tables, from every kind of source, are the same either way.
    writers.export_runs([CLEAN, SHORT], tmp_path / "tree")
    runs = "SELECT run, count(*) FROM admissions GROUP BY run ORDER BY run"
    assert (
        sql.query([str(tmp_path / "tree")], runs, allow_files=True).rows
        == sql.query([str(tmp_path / "tree")], runs).rows
        == [("replay-clean", 21), ("replay-short-load", 21)]
    )
