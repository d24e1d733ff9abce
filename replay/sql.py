"""``kvledger sql``: DuckDB, embedded, over the tidy tables (``replay.tables``).

The sources, each a view per table of :data:`replay.tables.TABLES`:

- a log (a file, or a directory of one log's segments): its tables are computed in memory;
- several logs: the same, one ``run`` column added (:func:`replay.writers.run_name`), all
  runs in each view;
- an export directory (``kvledger export LOG -o DIR``): its ``<table>.parquet`` or
  ``<table>.jsonl`` files (``<table>.partial.parquet``, ... when the export was of a log
  read only in part: ``replay.partial``);
- a Hive tree (``kvledger export LOG... -o TREE --partition run``): its Hive partitions, so
  ``run`` is a column (``<name>.partial`` for a run read only in part).

What a source holds of a log read only in part is said in :attr:`QueryResult.partial`, as a
log's damage is in :attr:`QueryResult.damage`.

**Files.** By default a query reads these tables and nothing else: the sources are read
through pyarrow (a log's tables computed in memory, an export's files as pyarrow datasets,
scanned lazily), and DuckDB itself runs with its access to the outside turned off and its
configuration locked (:data:`LOCKED`): no ``read_csv('/etc/passwd')``, no ``COPY ... TO``, no
``ATTACH``, no ``INSTALL`` or ``LOAD``, no ``SET`` that turns any of it back on. DuckDB never
opens a source file, so a query cannot write over one either. ``allow_files=True`` (``kvledger
sql --allow-files``) gives DuckDB its defaults: a query may then read and write any file the
user can.

Needs the ``sql`` extra (duckdb, pyarrow). A query DuckDB refuses raises :class:`SqlError`
with DuckDB's message.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from kvledger.replay.extras import require
from kvledger.replay.partial import PARTIAL, PARTIAL_KEY
from kvledger.replay.tables import TABLES, collect
from kvledger.tracker.framing import StopInfo

__all__ = ["LOCKED", "QueryResult", "SqlError", "connect", "query", "source_kind"]

_WHAT = "kvledger sql"

LOCKED: dict[str, Any] = {
    # No file, network or extension directory: COPY, ATTACH, EXPORT, INSTALL, LOAD, the file
    # readers, and the scans of Python variables by name are all refused.
    "enable_external_access": False,
    # An extension a query names is neither fetched nor loaded behind its back.
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    # Last: no SET or RESET of any setting, these included, until the connection closes.
    "lock_configuration": True,
}
"""DuckDB's configuration for a connection that may read its views and nothing else."""


class SqlError(ValueError):
    """DuckDB refused the query (the message is DuckDB's), or a source is not one."""


@attrs.frozen
class QueryResult:
    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]
    damage: list[StopInfo] = attrs.field(factory=list)  # logs read only up to damage
    partial: list[str] = attrs.field(factory=list)  # exports of logs read only in part, why

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as objects, a key per column: :class:`SqlError` when two columns have one
        name (an object keeps one of them: a column would be lost without a word)."""
        repeated = [c for c, n in Counter(self.columns).items() if n > 1]
        if repeated:
            names = ", ".join(repr(c) for c in repeated)
            raise SqlError(
                f"--json gives each row as an object keyed by column name, and the "
                f"query's result names {'a column' if len(repeated) == 1 else 'columns'} "
                f"{names} more than once: give each its own name with AS "
                f"(SELECT ... AS {repeated[0]}_2)"
            )
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def source_kind(path: str) -> tuple[str, str]:
    """(kind, format) of a source: ``tree`` or ``directory`` (with ``parquet`` or
    ``jsonl``), else ``log``."""
    if os.path.isdir(path):
        for fmt, ext in (("parquet", ".parquet"), ("jsonl", ".jsonl")):
            if any(os.path.exists(os.path.join(path, "requests" + m + ext)) for m in ("", PARTIAL)):
                return "directory", fmt
            if glob.glob(os.path.join(path, "requests", "run=*", "*" + ext)):
                return "tree", fmt
    return "log", ""


def _dataset(files: list[str], fmt: str, table: str, hive_root: str | None) -> Any:
    """An export's files of ``table`` as a pyarrow dataset of the table's schema (plus the
    ``run`` partition of a Hive tree): DuckDB scans it through pyarrow, lazily, without
    opening a file itself."""
    pa = require("pyarrow", "sql", _WHAT)
    ds = require("pyarrow.dataset", "sql", _WHAT)
    from kvledger.replay.writers import arrow_schema

    schema = arrow_schema(TABLES[table])
    full = schema if hive_root is None else schema.append(pa.field("run", pa.string()))
    if fmt == "parquet":
        file_format = ds.ParquetFileFormat()
    else:
        pj = require("pyarrow.json", "sql", _WHAT)
        options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        file_format = ds.JsonFileFormat(parse_options=options)
        # An empty table is an empty file, which pyarrow's JSON reader refuses to open.
        files = [f for f in files if os.path.getsize(f) > 0]
        if not files:
            return full.empty_table()
    if hive_root is None:
        return ds.dataset(files, schema=full, format=file_format)
    partitioning = ds.partitioning(pa.schema([("run", pa.string())]), flavor="hive")
    return ds.dataset(
        files,
        schema=full,
        format=file_format,
        partitioning=partitioning,
        partition_base_dir=hive_root,
    )


def connect(
    sources: Sequence[str],
    *,
    problems: bool = True,
    damage: list[StopInfo] | None = None,
    allow_files: bool = False,
    partial: list[str] | None = None,
) -> Any:
    """A DuckDB connection with one view per table over ``sources`` (see the module
    docstring). ``problems=False`` leaves a log's ``problems`` view empty (no replay); the
    damage of logs read only in part is appended to ``damage``, and why an export's files
    hold a log only in part to ``partial``. Unless ``allow_files``, the connection is
    :data:`LOCKED` once the views exist: queries read them and nothing else."""
    duckdb = require("duckdb", "sql", _WHAT)
    if not sources:
        raise SqlError("no source: name a log, an export directory or a tree")
    kinds = [source_kind(os.fspath(s)) for s in sources]
    if len(sources) > 1 and any(kind != "log" for kind, _ in kinds):
        raise SqlError("several sources must all be logs (a tree already holds many runs)")
    con = duckdb.connect()
    try:
        if kinds[0][0] != "log":
            _register_export(con, os.fspath(sources[0]), *kinds[0], partial)
        else:
            _register_logs(con, [os.fspath(s) for s in sources], problems, damage)
        if not allow_files:
            for name, value in LOCKED.items():  # lock_configuration last (dicts keep order)
                con.execute(f"SET {name} = {str(value).lower()}")
    except BaseException:
        con.close()
        raise
    return con


def _register_export(
    con: Any, path: str, kind: str, fmt: str, partial: list[str] | None = None
) -> None:
    """One view per table of an export directory or a Hive tree; why its files hold a log
    only in part (a directory's, once; a tree's, run by run) appended to ``partial``."""
    ext = "." + fmt
    said: dict[str, str] = {}
    for table in TABLES:
        if kind == "tree":
            root = os.path.join(path, table)
            files = sorted(glob.glob(os.path.join(glob.escape(root), "*", "*" + ext)))
            for f in files:
                run = os.path.basename(os.path.dirname(f))
                if run.endswith(PARTIAL):
                    said.setdefault(run, _partial_why(f, fmt))
        else:
            root = None
            whole = os.path.join(path, table + ext)
            part = os.path.join(path, table + PARTIAL + ext)
            files = [f for f in (whole, part) if os.path.exists(f)]
            if len(files) == 2:
                raise SqlError(
                    f"{path} holds {table}{ext} and {table}{PARTIAL}{ext}, of two exports: "
                    "export again, or remove one"
                )
            if files == [part]:
                said.setdefault(path, _partial_why(part, fmt))
        if not files:
            continue  # a table this export (or no run of the tree) has
        con.register(f"_{table}", _dataset(files, fmt, table, root))
        con.execute(f'CREATE VIEW "{table}" AS SELECT * FROM "_{table}"')
    if partial is not None:
        partial += [f"{where}: {why}" for where, why in said.items()]


def _partial_why(path: str, fmt: str) -> str:
    """Why a partial export's file holds its log only in part: its metadata says (parquet),
    else only its name does."""
    if fmt == "parquet":
        pq = require("pyarrow.parquet", "sql", _WHAT)
        why = (pq.read_metadata(path).metadata or {}).get(PARTIAL_KEY.encode())
        if why is not None:
            return str(why.decode("utf-8", "replace"))
    return f"its files are named {PARTIAL}: the log was read only in part"


def _register_logs(
    con: Any, logs: list[str], problems: bool, damage: list[StopInfo] | None
) -> None:
    pa = require("pyarrow", "sql", _WHAT)
    from kvledger.replay.writers import arrow_table, run_name

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


def query(
    sources: Sequence[str],
    sql: str,
    *,
    problems: bool | None = None,
    allow_files: bool = False,
) -> QueryResult:
    """Run ``sql`` over ``sources``. The ``problems`` table costs a replay of each log; it is
    computed when the query names it (``problems=None``), or as told. ``allow_files``: see
    the module docstring (off: the query reads the tables and nothing else)."""
    duckdb = require("duckdb", "sql", _WHAT)
    pa = require("pyarrow", "sql", _WHAT)
    # DuckDB's refusals, and pyarrow's when an export's file does not hold what its table
    # says (read while the query scans it).
    refused = (duckdb.Error, pa.ArrowException)
    if problems is None:
        problems = "problems" in sql.lower()
    damage: list[StopInfo] = []
    partial: list[str] = []
    try:
        con = connect(
            sources, problems=problems, damage=damage, allow_files=allow_files, partial=partial
        )
    except refused as e:
        raise SqlError(str(e)) from None
    try:
        rel = con.sql(sql)
        if rel is None:  # a statement with no result (CREATE, SET, ...)
            return QueryResult([], [], [], damage, partial)
        rows = rel.fetchall()
        return QueryResult(list(rel.columns), [str(t) for t in rel.types], rows, damage, partial)
    except refused as e:
        message = str(e)
        if not allow_files and any(word in message for word in _LOCK_WORDS):
            message += (
                " (kvledger sql reads its sources and nothing else: --allow-files, or "
                "allow_files=True, lets a query use files; docs/sql.md)"
            )
        raise SqlError(message) from None
    finally:
        con.close()


# What DuckDB says when the lock refused a query.
_LOCK_WORDS = ("disabled by configuration", "disabled through configuration", "been locked")
