"""The commands that hand a log to other tools: ``timeline`` (a page or a picture), ``export``
(tables as parquet or JSON lines, a Perfetto trace, OpenTelemetry spans) and ``sql`` (DuckDB
over the tables)."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

from kvledger.replay import charts
from kvledger.replay.commands.common import (
    EXIT_OK,
    EXIT_UNREADABLE,
    LINE,
    fail,
    guard,
    log_argument,
    print_json,
    warn_damage,
)
from kvledger.replay.extras import Output
from kvledger.replay.format import elide
from kvledger.replay.partial import PARTIAL, PARTIAL_KEY
from kvledger.replay.steps import parse_steps

__all__ = ["add_export", "add_sql", "add_timeline"]


def add_timeline(sub: Any) -> None:
    p = sub.add_parser(
        "timeline",
        help="a picture that shows the bug: requests over the steps, check's problems marked "
        "(.html; .png, .svg, .pdf with kvledger[timeline])",
        description="Draw, one lane per request, waiting / running / preempted, what vLLM "
        "accepted from the pool beside what was loaded (a short load is visibly short), "
        "tokens computed and saved, and the problems kvledger check finds; above them, "
        "requests running / waiting / preempted, pool occupancy and hit rate per step. "
        "Without --request: the most telling requests (with problems first, then preempted, "
        "then by tokens computed). .html (zoom: wheel, pan: drag) needs nothing extra; "
        ".png, .svg and .pdf need matplotlib (pip install kvledger[timeline]).",
    )
    log_argument(p)
    p.add_argument(
        "-o", "--out", required=True, metavar="FILE", help="FILE.html, .png, .svg or .pdf"
    )
    p.add_argument("--top", type=int, default=8, metavar="N", help="requests to draw (8)")
    p.add_argument(
        "--request",
        "-r",
        action="append",
        metavar="ID",
        help="draw this request (a life like id#2, or an id: all its lives); repeat it, or "
        "give a comma list",
    )
    p.add_argument("--steps", metavar="A:B", help="only steps A to B (both included; A:, :B or N)")
    p.add_argument("--json", action="store_true", help="print what was drawn as JSON")
    p.set_defaults(handler=_timeline)


def add_export(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="the tidy tables (parquet or JSON lines), a Hive tree of many logs, or a "
        "Perfetto trace",
        description="Write the log's tidy tables (requests, admissions, saves, steps, events "
        "and one table per event type, problems: docs/sql.md), one file per table, into "
        "a directory; one table (--table) into one file; the tables of several logs into one "
        "Hive-partitioned tree (--partition run); or a Chrome / Perfetto trace (.json). "
        "The format follows the output: a directory holds parquet unless --format jsonl; "
        "OUT.parquet, OUT.jsonl, OUT.json name theirs, and --format must agree. parquet "
        "needs pyarrow (pip install kvledger[parquet]).",
        epilog=_EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="a log file, or a directory of one log's segments; several with --partition run",
    )
    p.add_argument(
        "--format",
        choices=("parquet", "jsonl", "perfetto", "otlp"),
        default=None,
        help="default: from the output (a directory: parquet; .parquet, .jsonl, .json; "
        ".otlp.json and .binpb: OpenTelemetry spans)",
    )
    p.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="OUT",
        help="DIR, TABLE.parquet / TABLE.jsonl with --table ('-': standard output), "
        "TRACE.json, or TREE with --partition run",
    )
    p.add_argument("--table", metavar="NAME", help="write only this table, to one file")
    p.add_argument(
        "--partition",
        choices=("run",),
        help="one Hive-partitioned tree for many logs: TREE/<table>/run=<name>/",
    )
    p.add_argument(
        "--no-problems",
        dest="problems",
        action="store_false",
        help="leave the problems table empty (it costs a replay, as kvledger check does)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(handler=_export)


def add_sql(sub: Any) -> None:
    p = sub.add_parser(
        "sql",
        help="run SQL (DuckDB) over the tidy tables of logs, an export or a Hive tree",
        description="Run one SQL query with DuckDB, embedded, over the tidy tables (views "
        "named requests, admissions, saves, steps, events, ev_<type>, problems: docs/sql.md). "
        "SOURCE is a log, several logs (a run column is added), an export directory, or a "
        "Hive tree (kvledger export ... --partition run). Needs duckdb and pyarrow "
        "(pip install kvledger[sql]).",
        epilog=_SQL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a log, an export directory or a tree (one or more), then the query",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument(
        "--tables", action="store_true", help="list the tables and their columns (no query)"
    )
    p.add_argument(
        "--allow-files",
        action="store_true",
        help="let the query read and write files, attach databases and load extensions "
        "(DuckDB's defaults); without it a query reads the tables and nothing else",
    )
    p.set_defaults(handler=_sql)


_EXPORT_EPILOG = """\
examples:
  kvledger export run.kvlog -o tables/                      # tables/requests.parquet, ...
  kvledger export run.kvlog -o tables/ --format jsonl       # tables/requests.jsonl, ...
  kvledger export run.kvlog --table admissions -o admissions.parquet
  kvledger export run.kvlog --table events -o -             # JSON lines on standard output
  kvledger export a.kvlog b.kvlog -o fleet/ --partition run # fleet/requests/run=a/part-0.parquet
  kvledger export run.kvlog -o run.perfetto.json            # open in ui.perfetto.dev
  kvledger export run.kvlog -o run.otlp.json                # OpenTelemetry spans (OTLP/JSON)
"""

_SQL_EPILOG = """\
examples:
  kvledger sql run.kvlog "SELECT step, sum(hit) / sum(asked) AS hit_rate
                          FROM admissions GROUP BY step ORDER BY step"
  kvledger sql fleet/ "SELECT run, count(*) FROM requests GROUP BY run" --json
  kvledger sql run.kvlog --tables
"""


# --- timeline, export -----------------------------------------------------------------------


@guard
def _timeline(args: argparse.Namespace) -> int:
    steps = None if args.steps is None else parse_steps(args.steps)
    wanted = [r.strip() for arg in args.request or () for r in arg.split(",") if r.strip()]
    if args.request is not None and not wanted:
        raise ValueError("--request takes request ids (none given)")
    result = charts.timeline(args.log, args.out, top=args.top, requests=wanted, steps=steps)
    status = warn_damage(args.log, result.damage)
    if result.check_error:
        print(
            f"kvledger: timeline: problems incomplete: {elide(result.check_error, LINE)}",
            file=sys.stderr,
        )
    if args.json:
        print_json(result.to_dict() | {"exit_code": status})
        return status
    names = ", ".join(elide(s.label) for s in result.series)
    lo, hi = result.steps
    print(
        f"wrote {result.out}: {len(result.series)} of {result.requests} requests"
        f"{f' ({names})' if names else ''}, steps {lo}..{hi}"
    )
    names_count = Counter(m.name for s in result.series for m in s.problems)
    names_count.update(m.name for m in result.run.problems)
    marked = ", ".join(f"{elide(name)} x{n}" for name, n in names_count.most_common())
    print(
        f"problems: {result.problems_drawn} marked ({marked or 'none'}) of "
        f"{result.problems_total} check found"
    )
    for label, a in result.short_loads():
        print(
            f"short load: {elide(label)} at step {a.step}: loaded {a.loaded} of {a.accepted} "
            "accepted"
        )
    return status


# How each form of a partial export is marked (replay.partial), said after the damage.
_PARTIAL_SAID = {
    "directory": f"the files hold the log only up to where reading stopped: each is named "
    f"<table>{PARTIAL}.<ext>, and a parquet file's metadata says why ({PARTIAL_KEY})",
    "file": f"the file holds the log only up to where reading stopped: it is named "
    f"*{PARTIAL}.*, and a parquet file's metadata says why ({PARTIAL_KEY})",
    "tree": f"runs read only in part are run=<name>{PARTIAL}, and their parquet files' "
    f"metadata says why ({PARTIAL_KEY})",
    "trace": f"the trace holds the log only up to where reading stopped: it is named "
    f"*{PARTIAL}.*, with {PARTIAL_KEY} in otherData and an instant where the log ends",
    "otlp": f"the spans hold the log only up to where reading stopped: the file is named "
    f"*{PARTIAL}.*, and every span's resource has {PARTIAL_KEY}",
    "stdout": f"the rows are the log's only up to where reading stopped: the last line is "
    f'{{"{PARTIAL_KEY}": why}}',
}


@guard
def _export(args: argparse.Namespace) -> int:
    from kvledger.replay import writers

    if args.partition is not None:
        result = writers.export_runs(args.logs, args.out, args.format, problems=args.problems)
    elif len(args.logs) > 1:
        return fail(
            "export: several logs go into one tree: add --partition run (the segments of one "
            "log: pass their directory)"
        )
    else:
        try:
            result = writers.export(
                args.logs[0], args.out, args.format, table=args.table, problems=args.problems
            )
        except BrokenPipeError:  # `kvledger export LOG --table events -o - | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
    status = warn_damage(", ".join(args.logs), *result.damage)
    if result.check_error:
        print(f"kvledger: export: problems table incomplete: {result.check_error}", file=sys.stderr)
    if result.partial is not None:
        print(f"kvledger: export: {_PARTIAL_SAID[result.form]}", file=sys.stderr)
    where = "standard output" if result.form == "stdout" else result.out
    if args.json:
        print_json(
            {
                "out": result.out,
                "format": result.format,
                "form": result.form,
                "rows": result.rows,
                "runs": list(result.runs),
                "damage": [d.describe() for d in result.damage],
                "check_error": result.check_error,
                "partial": result.partial,
                "exit_code": status,
            }
        )
    elif result.form == "trace":
        shown = ", ".join(f"{n} {k}" for k, n in result.rows.items())
        print(f"wrote {where} (a Chrome trace, for ui.perfetto.dev): {shown}", file=sys.stderr)
    elif result.form == "otlp":
        shown = ", ".join(f"{n} {k}" for k, n in result.rows.items())
        what = "protobuf" if result.out.lower().endswith((".binpb", ".pb")) else "OTLP/JSON"
        print(f"wrote {where} (OpenTelemetry spans, {what}): {shown}", file=sys.stderr)
    else:
        what = f"{len(result.rows)} tables" if len(result.rows) > 1 else "1 table"
        runs = f", runs {', '.join(result.runs)}" if result.runs else ""
        print(
            f"wrote {result.total} rows in {what} to {where} ({result.format}{runs})",
            file=sys.stderr,
        )
    return status


@guard
def _sql(args: argparse.Namespace) -> int:
    from kvledger.replay import sql

    if args.tables:
        return _print_tables(args)
    if len(args.sources) < 2:
        return fail('sql: give a source and a query: kvledger sql LOG "SELECT ..."')
    *sources, query = args.sources
    result = sql.query(sources, query, allow_files=args.allow_files)
    status = warn_damage(", ".join(sources), *result.damage)
    for why in result.partial:  # an export of a log read only in part: as the log would say
        print(f"kvledger: an export of a log read only in part: {why}", file=sys.stderr)
        status = EXIT_UNREADABLE
    if args.json:
        print_json(result.to_dicts())
        return status
    numeric = ("INTEGER", "BIGINT", "DOUBLE", "FLOAT", "HUGEINT", "DECIMAL", "SMALLINT")
    right = [c for c, t in zip(result.columns, result.types, strict=True) if t.startswith(numeric)]
    rows = [[_cell(v) for v in row] for row in result.rows]
    Output().table(result.columns, rows, right=right)
    return status


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.6g}"
    return value


def _print_tables(args: argparse.Namespace) -> int:
    from kvledger.replay.tables import TABLES

    if args.json:
        print_json({t: [c._asdict() for c in cols] for t, cols in TABLES.items()})
        return EXIT_OK
    out = Output()
    for table, columns in TABLES.items():
        out.table(["column", "type", "meaning"], [list(c) for c in columns], title=table)
        out.line()
    return EXIT_OK
