"""``export``: the tidy tables (``replay.tables``) written out, or a Perfetto trace.

The output's form and extension say what is written, and ``fmt`` (``--format``), when given,
must agree:

- a directory (one that exists, or a path with no extension): every table, one file each,
  ``DIR/<table>.parquet`` (the default: pyarrow, the ``parquet`` extra) or
  ``DIR/<table>.jsonl`` (``fmt="jsonl"``);
- one file, ``OUT.parquet`` or ``OUT.jsonl`` (``.ndjson``): one table, named by ``table``
  (``--table requests``); ``-`` writes it to standard output as JSON lines;
- ``OUT.json`` or ``OUT.perfetto.json``: a Chrome / Perfetto trace (``replay.perfetto``);
- ``OUT.otlp.json`` (or ``--format otlp`` with ``.json``/``.jsonl``), ``OUT.binpb``:
  OpenTelemetry spans per request with cache attribution, OTLP/JSON or protobuf
  (``replay.otlp``);
- many logs (a fleet of engines): :func:`export_runs` writes one Hive-partitioned tree,
  ``TREE/<table>/run=<name>/part-0.parquet``, which DuckDB reads with ``hive_partitioning``
  and Spark or Trino read as partitioned tables.

Every file appears complete or not at all (written aside, then renamed into place). A
mismatch between the form and ``fmt``, a missing parent directory, a file where a directory
is needed (or the reverse) raise :class:`ExportError` (a ``ValueError``) naming what was
wrong, before anything is read. A log read only in part (damage, segment files not there)
is written as far as it was read, every file marked partial in its name and inside
(``replay.partial``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvledger.replay.extras import require
from kvledger.replay.otlp import write_otlp
from kvledger.replay.partial import PARTIAL, PARTIAL_KEY, partial_reason, publish
from kvledger.replay.perfetto import write_trace
from kvledger.replay.results import ExportResult
from kvledger.replay.source import LogPath, open_log
from kvledger.replay.tables import TABLES, Column, Row, table_rows
from kvledger.tracker.framing import StopInfo

__all__ = ["FORMATS", "ExportError", "ExportResult", "export", "export_runs", "run_name"]

PathLike = str | os.PathLike[str]

FORMATS = ("parquet", "jsonl", "perfetto", "otlp")

# The extension of a one-file output, and the format it names.
_EXTENSIONS = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "perfetto",
}


class ExportError(ValueError):
    """The output cannot be written as asked: the message says what was wrong."""


def _named_format(out: str) -> str | None:
    name = out.lower()
    if name.endswith(".perfetto.json"):
        return "perfetto"
    if name.endswith((".otlp.json", ".otlp.jsonl", ".binpb", ".pb")):
        return "otlp"
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def _resolve(out: str, fmt: str | None, table: str | None, tree: bool = False) -> tuple[str, str]:
    """(form, format) of an output, or :class:`ExportError`."""
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if table is not None and table not in TABLES:
        raise ExportError(f"no table {table!r}: the tables are {', '.join(TABLES)}")
    if out == "-":
        if table is None or tree:
            raise ExportError("-o - (standard output) holds one table: pick it with --table")
        if fmt not in (None, "jsonl"):
            raise ExportError("-o - (standard output) is for JSON lines only")
        return "stdout", "jsonl"
    named = None if os.path.isdir(out) else _named_format(out)
    if fmt == "otlp" and named in ("perfetto", "jsonl"):
        named = "otlp"  # OTLP/JSON is JSON (lines): .json and .jsonl name it too
    if named is not None and fmt is not None and named != fmt:
        raise ExportError(f"{out!r} names {named}, but the format asked for is {fmt}")
    fmt = fmt or named
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ExportError(f"cannot write {out}: no such directory {parent}")
    if fmt == "perfetto":
        if named is None:
            raise ExportError(f"a Perfetto trace is one file: name it {out}.json, not a directory")
        if table is not None or tree:
            raise ExportError("a Perfetto trace holds no tables: drop --table and --partition")
        return "trace", fmt
    if fmt == "otlp":
        if named is None:
            raise ExportError(
                f"OTLP spans are one file: name it {out}.otlp.json (OTLP/JSON) or {out}.binpb "
                "(protobuf), not a directory"
            )
        if table is not None or tree:
            raise ExportError("OTLP spans hold no tables: drop --table and --partition")
        return "otlp", fmt
    if named is not None:  # one file
        if tree:
            raise ExportError(
                f"{out!r} names one file, but --partition writes a tree: name a directory"
            )
        if table is None:
            raise ExportError(
                f"{out!r} names one file, but the export is {len(TABLES)} tables: name a "
                "directory (-o DIR), or pick one table (--table requests)"
            )
        return "file", named
    if not os.path.isdir(out) and os.path.splitext(out)[1]:
        raise ExportError(
            f"cannot tell the format from {out!r}: name a directory (no extension), or a "
            "file ending in .parquet, .jsonl or .json (a Perfetto trace)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(
            f"{out} is a file: name a directory, or end the name in .parquet or .jsonl"
        )
    if table is not None:
        raise ExportError(
            f"{out!r} names a directory: name the file for --table {table} "
            f"({table}.parquet or {table}.jsonl)"
        )
    return ("tree" if tree else "directory"), fmt or "parquet"


def export(
    log: LogPath,
    out: PathLike,
    fmt: str | None = None,
    *,
    table: str | None = None,
    problems: bool = True,
    batch_rows: int = 65536,
) -> ExportResult:
    """Write the tidy tables of one log (or one of them, or a Perfetto trace) to ``out``; see
    the module docstring for the forms. ``problems=False`` leaves the ``problems`` table empty
    (it costs a replay of the log, as ``kvledger check`` does)."""
    out_s = os.fspath(out)
    form, fmt = _resolve(out_s, fmt, table)
    if fmt == "perfetto":
        return write_trace(log, out_s, problems=problems)
    if fmt == "otlp":
        return write_otlp(log, out_s)
    if fmt == "parquet":
        require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    src = open_log(log)  # unreadable: raise before anything is written
    if form == "stdout":
        stream = _JsonlSink(None, only=table, stream=sys.stdout)
        info = table_rows(src, stream.add, problems=problems and table == "problems")
        partial = partial_reason(info.damage, info.missing)
        if partial is not None:  # a stream has no name to mark: its last line says it
            stream.stream_line({PARTIAL_KEY: partial})
        stream.close()
        return ExportResult(
            out_s, fmt, form, stream.counts, _damage(info.damage), (), info.check_error, partial
        )
    with _Staging(out_s, form) as stage:
        sink = _make_sink(fmt, stage.path, only=table, batch_rows=batch_rows)
        want = problems and (table is None or table == "problems")
        info = table_rows(src, sink.add, problems=want)
        stage.partial = partial_reason(info.damage, info.missing)
        sink.close(stage.partial)
    return ExportResult(
        stage.written,
        fmt,
        form,
        sink.counts,
        _damage(info.damage),
        (),
        info.check_error,
        stage.partial,
    )


def run_name(log: LogPath) -> str:
    """The partition name of a log: its file or directory name without ``.kvlog``, with any
    character outside ``[A-Za-z0-9._-]`` replaced by ``_`` (a Hive path segment)."""
    first = log if isinstance(log, (str, os.PathLike)) else next(iter(log))
    name = Path(os.fspath(first)).resolve().name
    if name.endswith(".kvlog"):
        name = name[: -len(".kvlog")]
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "run"


def export_runs(
    logs: Sequence[LogPath],
    out: PathLike,
    fmt: str | None = None,
    *,
    names: Sequence[str] | None = None,
    problems: bool = True,
    batch_rows: int = 65536,
) -> ExportResult:
    """Write the tables of many logs as one Hive-partitioned tree:
    ``OUT/<table>/run=<name>/part-0.parquet`` (``names``: the runs' names, by default
    :func:`run_name` of each log; they must differ). A tree that exists already keeps its
    other runs: a fleet's tree grows run by run."""
    out_s = os.fspath(out)
    _, fmt = _resolve(out_s, fmt, None, tree=True)
    names = list(names) if names is not None else [run_name(log) for log in logs]
    if len(names) != len(logs):
        raise ExportError("give one name per log")
    twice = [n for n, k in Counter(names).items() if k > 1]
    if twice:
        raise ExportError(f"two logs would be run={twice[0]}: rename one of them")
    if fmt == "parquet":
        require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    sources = [open_log(log) for log in logs]  # every log readable before anything is written
    counts: Counter[str] = Counter()
    damage: list[StopInfo] = []
    errors: list[str] = []
    partial: list[str] = []
    runs: list[str] = []
    with _Staging(out_s, "tree") as stage:
        for name, src in zip(names, sources, strict=True):
            part = os.path.join(stage.path, "{table}", f"run={name}")
            sink = _make_sink(fmt, part, only=None, batch_rows=batch_rows, part=True)
            info = table_rows(src, sink.add, problems=problems)
            why = partial_reason(info.damage, info.missing)
            sink.close(why)
            counts.update(sink.counts)
            damage += _damage(info.damage)
            if info.check_error:
                errors.append(f"run={name}: {info.check_error}")
            # A run read only in part is run=<name>.partial: the run column says so on every
            # row, to any reader of the tree. The run's other partition, from an earlier
            # export, goes.
            run, other = (name + PARTIAL, name) if why is not None else (name, name + PARTIAL)
            if why is not None:
                partial.append(f"run={run}: {why}")
                for t in TABLES:
                    os.rename(part.replace("{table}", t), os.path.join(stage.path, t, f"run={run}"))
            stage.stale += [os.path.join(t, f"run={other}") for t in TABLES]
            runs.append(run)
        twice = [n for n, k in Counter(runs).items() if k > 1]
        if twice:
            raise ExportError(f"two logs would be run={twice[0]}: rename one of them")
    return ExportResult(
        out_s,
        fmt,
        "tree",
        dict(counts),
        damage,
        tuple(runs),
        "; ".join(errors) or None,
        "; ".join(partial) or None,
    )


def _damage(d: StopInfo | None) -> list[StopInfo]:
    return [] if d is None else [d]


class _Staging:
    """A directory beside ``out`` to write into; on success its files are renamed into
    ``out`` (a file output: the one file is), their names marked when ``partial`` is set
    (``replay.partial.publish``), and the ``stale`` paths under ``out`` (a tree's partitions
    replaced) are removed; on failure it is removed. ``written``: the file or directory."""

    def __init__(self, out: str, form: str) -> None:
        self.out = out
        self.form = form
        self.partial: str | None = None
        self.stale: list[str] = []
        self.written = out
        parent = os.path.dirname(os.path.abspath(out))
        self.path = tempfile.mkdtemp(prefix=".kvledger-export-", dir=parent)

    def __enter__(self) -> _Staging:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        try:
            if kind is None:
                self._commit()
        finally:
            shutil.rmtree(self.path, ignore_errors=True)

    def _commit(self) -> None:
        if self.form == "file":
            (only,) = os.listdir(self.path)
            self.written = publish(os.path.join(self.path, only), self.out, self.partial)
            return
        for root, _, files in os.walk(self.path):
            rel = os.path.relpath(root, self.path)
            target = os.path.normpath(os.path.join(self.out, rel))
            os.makedirs(target, exist_ok=True)
            for f in files:
                publish(os.path.join(root, f), os.path.join(target, f), self.partial)
        for rel in self.stale:
            shutil.rmtree(os.path.join(self.out, rel), ignore_errors=True)


# --- sinks: rows in, files out --------------------------------------------------------------


class _Sink:
    """Receives ``add(table, row)``; writes each table (or the one asked for) on its way."""

    def __init__(self, only: str | None) -> None:
        self.only = only
        self.counts: Counter[str] = Counter({t: 0 for t in self.tables()})

    def add(self, table: str, row: Row) -> None:
        raise NotImplementedError

    def close(self, partial: str | None = None) -> None:
        """Finish the files; ``partial``: why they hold the log only in part, written inside
        them where the format has a place (parquet's key-value metadata)."""
        raise NotImplementedError

    def tables(self) -> list[str]:
        return [self.only] if self.only is not None else list(TABLES)


def _file_of(directory: str, table: str, ext: str, part: bool) -> str:
    if part:  # a Hive partition: DIR/<table>/run=<name>/part-0.<ext>
        d = directory.replace("{table}", table)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, "part-0" + ext)
    return os.path.join(directory, table + ext)


class _JsonlSink(_Sink):
    def __init__(
        self,
        directory: str | None,
        *,
        only: str | None,
        stream: IO[str] | None = None,
        part: bool = False,
    ) -> None:
        super().__init__(only)
        self.files: dict[str, IO[str]] = {}
        self.dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
        for table in self.tables():
            if stream is not None:
                self.files[table] = stream
            else:
                assert directory is not None
                path = _file_of(directory, table, ".jsonl", part)
                self.files[table] = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self.stream = stream

    def add(self, table: str, row: Row) -> None:
        f = self.files.get(table)
        if f is not None:
            f.write(self.dumps(row))
            f.write("\n")
            self.counts[table] += 1

    def stream_line(self, obj: dict[str, Any]) -> None:
        """One more line on the standard output stream (not a row of any table)."""
        assert self.stream is not None
        self.stream.write(self.dumps(obj))
        self.stream.write("\n")

    def close(self, partial: str | None = None) -> None:
        # No place inside a JSON lines file that is not a row: the name says partial.
        for f in self.files.values():
            if f is self.stream:
                f.flush()
            else:
                f.close()


def arrow_schema(columns: Sequence[Column]) -> Any:
    """The pyarrow schema of a table's columns."""
    pa = require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    types = {
        "int": pa.int64(),
        "float": pa.float64(),
        "bool": pa.bool_(),
        "str": pa.string(),
        "int_list": pa.list_(pa.int64()),
        "str_list": pa.list_(pa.string()),
    }
    return pa.schema([pa.field(c.name, types[c.kind]) for c in columns])


def arrow_table(table: str, rows: Sequence[Row]) -> Any:
    """Rows of one of :data:`TABLES` as a pyarrow table of its schema. An integer its
    64-bit column cannot hold (a hostile log's: ``kvledger check`` names the event,
    ``field_range``) is null there."""
    pa = require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    columns = TABLES[table]
    data = {c.name: [row.get(c.name) for row in rows] for c in columns}
    schema = arrow_schema(columns)
    try:
        return pa.Table.from_pydict(data, schema=schema)
    except (OverflowError, pa.ArrowInvalid):
        for c in columns:
            if c.kind == "int":
                data[c.name] = [_int64(v) for v in data[c.name]]
            elif c.kind == "int_list":
                data[c.name] = [None if v is None else [_int64(x) for x in v] for v in data[c.name]]
        return pa.Table.from_pydict(data, schema=schema)


def _int64(value: Any) -> Any:
    return value if value is None or -(1 << 63) <= value < 1 << 63 else None


class _ParquetSink(_Sink):
    def __init__(
        self, directory: str, *, only: str | None, batch_rows: int, part: bool = False
    ) -> None:
        super().__init__(only)
        self.pq = require("pyarrow.parquet", "parquet", "a parquet export")
        self.directory = directory
        self.batch_rows = batch_rows
        self.part = part
        self.batches: dict[str, list[Row]] = {t: [] for t in self.tables()}
        self.writers: dict[str, Any] = {}

    def _flush(self, table: str) -> None:
        writer = self.writers.get(table)
        if writer is None:
            path = _file_of(self.directory, table, ".parquet", self.part)
            writer = self.writers[table] = self.pq.ParquetWriter(path, arrow_schema(TABLES[table]))
        writer.write_table(arrow_table(table, self.batches[table]))
        self.batches[table] = []

    def add(self, table: str, row: Row) -> None:
        batch = self.batches.get(table)
        if batch is not None:
            batch.append(row)
            self.counts[table] += 1
            if len(batch) >= self.batch_rows:
                self._flush(table)

    def close(self, partial: str | None = None) -> None:
        for table, batch in self.batches.items():
            if batch or table not in self.writers:  # an empty table still has its schema
                self._flush(table)
        for writer in self.writers.values():
            if partial is not None:  # known only now: the footer is written at close
                writer.add_key_value_metadata({PARTIAL_KEY: partial})
            writer.close()


def _make_sink(
    fmt: str, directory: str, *, only: str | None, batch_rows: int, part: bool = False
) -> _Sink:
    if fmt == "jsonl":
        return _JsonlSink(directory, only=only, part=part)
    return _ParquetSink(directory, only=only, batch_rows=batch_rows, part=part)
