"""``kvledger sql``: DuckDB, embedded, over the tidy tables (``replay.tables``).

The sources, each a view per table of :data:`replay.tables.TABLES`:

- a log (a file, or a directory of one log's segments): its tables are computed in memory;
- several logs: the same, one ``run`` column added (:func:`replay.writers.run_name`), all
  runs in each view;
- an export directory (``kvledger export LOG -o DIR``): its ``<table>.parquet`` or
  ``<table>.jsonl`` files;
- a Hive tree (``kvledger export LOG... -o TREE --partition run``): read with
  ``hive_partitioning``, so ``run`` is a column.

Needs the ``sql`` extra (duckdb, pyarrow). A query DuckDB refuses raises :class:`SqlError`
with DuckDB's message.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import attrs

from replay.extras import require
from replay.tables import TABLES, Column, collect
from tracker.framing import StopInfo

__all__ = ["QueryResult", "SqlError", "connect", "query", "source_kind"]

_WHAT = "kvledger sql"
_DUCK_TYPES = {
    "int": "BIGINT",
    "float": "DOUBLE",
    "bool": "BOOLEAN",
    "str": "VARCHAR",
    "int_list": "BIGINT[]",
    "str_list": "VARCHAR[]",
}


class SqlError(ValueError):
    """DuckDB refused the query (the message is DuckDB's), or a source is not one."""


@attrs.frozen
class QueryResult:
    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]
    damage: list[StopInfo] = attrs.field(factory=list)  # logs read only up to damage

    def to_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def source_kind(path: str) -> tuple[str, str]:
    """(kind, format) of a source: ``tree`` or ``directory`` (with ``parquet`` or
    ``jsonl``), else ``log``."""
    if os.path.isdir(path):
        for fmt, ext in (("parquet", ".parquet"), ("jsonl", ".jsonl")):
            if os.path.exists(os.path.join(path, "requests" + ext)):
                return "directory", fmt
            if glob.glob(os.path.join(path, "requests", "run=*", "*" + ext)):
                return "tree", fmt
    return "log", ""


def _reader(files: str, fmt: str, columns: Sequence[Column], hive: bool) -> str:
    quoted = files.replace("'", "''")
    if fmt == "parquet":
        return f"read_parquet('{quoted}', hive_partitioning = {str(hive).lower()})"
    cols = ", ".join(f"'{c.name}': '{_DUCK_TYPES[c.kind]}'" for c in columns)
    return (
        f"read_json('{quoted}', format = 'newline_delimited', columns = {{{cols}}}, "
        f"hive_partitioning = {str(hive).lower()})"
    )


def connect(
    sources: Sequence[str], *, problems: bool = True, damage: list[StopInfo] | None = None
) -> Any:
    """A DuckDB connection with one view per table over ``sources`` (see the module
    docstring). ``problems=False`` leaves a log's ``problems`` view empty (no replay); the
    damage of logs read only in part is appended to ``damage``."""
    duckdb = require("duckdb", "sql", _WHAT)
    if not sources:
        raise SqlError("no source: name a log, an export directory or a tree")
    kinds = [source_kind(os.fspath(s)) for s in sources]
    con = duckdb.connect()
    if len(sources) == 1 and kinds[0][0] != "log":
        path = os.fspath(sources[0])
        kind, fmt = kinds[0]
        ext = "." + fmt
        for table, columns in TABLES.items():
            if kind == "tree":
                files = os.path.join(path, table, "*", "*" + ext)
                if not glob.glob(files):
                    continue  # a table no run of the tree has
            else:
                files = os.path.join(path, table + ext)
                if not os.path.exists(files):
                    continue
            con.execute(
                f'CREATE VIEW "{table}" AS SELECT * FROM {_reader(files, fmt, columns, kind == "tree")}'
            )
        return con
    if any(kind != "log" for kind, _ in kinds):
        raise SqlError("several sources must all be logs (a tree already holds many runs)")
    _register_logs(con, [os.fspath(s) for s in sources], problems, damage)
    return con


def _register_logs(
    con: Any, logs: list[str], problems: bool, damage: list[StopInfo] | None
) -> None:
    pa = require("pyarrow", "sql", _WHAT)
    from replay.writers import arrow_table, run_name

    names = [run_name(log) for log in logs]
    if len(set(names)) != len(names):
        raise SqlError("two logs have the same name: their runs could not be told apart")
    parts: dict[str, list[Any]] = {t: [] for t in TABLES}
    for log, name in zip(logs, names, strict=True):
        rows, info = collect(log, problems=problems)
        if info.damage is not None and damage is not None:
            damage.append(info.damage)
        for table, table_rows in rows.items():
            t = arrow_table(table, table_rows)
            if len(logs) > 1:
                t = t.append_column("run", pa.array([name] * t.num_rows, pa.string()))
            parts[table].append(t)
    for table, tables in parts.items():
        con.register(f"_{table}", pa.concat_tables(tables))
        con.execute(f'CREATE VIEW "{table}" AS SELECT * FROM "_{table}"')


def query(sources: Sequence[str], sql: str, *, problems: bool | None = None) -> QueryResult:
    """Run ``sql`` over ``sources``. The ``problems`` table costs a replay of each log; it is
    computed when the query names it (``problems=None``), or as told."""
    duckdb = require("duckdb", "sql", _WHAT)
    if problems is None:
        problems = "problems" in sql.lower()
    damage: list[StopInfo] = []
    try:
        con = connect(sources, problems=problems, damage=damage)
    except duckdb.Error as e:
        raise SqlError(str(e)) from None
    try:
        rel = con.sql(sql)
        if rel is None:  # a statement with no result (CREATE, SET, ...)
            return QueryResult([], [], [], damage)
        return QueryResult(list(rel.columns), [str(t) for t in rel.types], rel.fetchall(), damage)
    except duckdb.Error as e:
        raise SqlError(str(e)) from None
    finally:
        con.close()
