"""``export``: one row per event, for DuckDB or pandas: JSON lines, or parquet (the
``parquet`` extra)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import attrs

from replay.extras import require
from replay.format import plain_fields
from replay.source import LogPath, LogSource, open_log
from tracker import events as ev
from tracker.history import walk
from tracker.log import StopInfo

__all__ = ["EXPORT_COLUMNS", "ExportResult", "export"]

PathLike = str | os.PathLike[str]

_BASE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("index", "int"),  # position of the event in the log
    ("seq", "int"),  # frame sequence number
    ("step", "int"),
    ("wall_ns", "int"),  # when the frame was written
    ("type", "str"),
    ("kind", "str"),  # input | decision
    ("request", "str"),  # req_id ("" for the events about no one request)
    ("requests", "str_list"),  # StepDecoded: the ids of the requests it names
)


_BASE_NAMES = frozenset(name for name, _ in _BASE_COLUMNS)


def _column(name: str) -> str:
    """An event field's column: its name, unless a base column has it."""
    return name if name not in _BASE_NAMES else f"field_{name}"


def _export_columns() -> tuple[tuple[str, str], ...]:
    cols: dict[str, str] = dict(_BASE_COLUMNS)
    for cls in ev.EVENT_TYPES:
        for field in plain_fields(cls):
            col = _column(field.name)
            if cols.get(col, field.kind) != field.kind:
                raise TypeError(f"export column {col!r} has two types: {cols[col]}, {field.kind}")
            cols[col] = field.kind
    return tuple(cols.items())


EXPORT_COLUMNS: tuple[tuple[str, str], ...] = _export_columns()
"""``(column, kind)`` of an export: the base columns, then every event field of every type
(a field absent from an event type is null in its rows). Kinds: int, bool, str, hex (bytes as
hex), int_list, hex_list, str_list."""


@attrs.frozen
class ExportResult:
    out: str
    format: str
    rows: int
    rows_by_type: dict[str, int]
    damage: StopInfo | None


def _row_makers() -> dict[type[ev.Event], tuple[tuple[str, str, Callable[[Any], Any] | None], ...]]:
    """Per event type: (attribute, column, conversion to a plain value or None) per field."""
    return {
        cls: tuple((f.name, _column(f.name), f.convert) for f in plain_fields(cls))
        for cls in ev.EVENT_TYPES
    }


def _export_rows(src: LogSource) -> Iterator[dict[str, Any]]:
    makers = _row_makers()
    row: dict[str, Any] | None = None
    last_pos = -1
    config, _ = src.lenient_config()
    for item in walk(src.frames(), config):
        pos = item.pos
        if pos == last_pos:  # StepDecoded, once more for each request it names
            assert row is not None
            row["requests"].append(item.req_id)
            continue
        if row is not None:
            yield row
        last_pos = pos
        frame, e = item.frame, item.event
        cls = e.__class__
        row = {
            "index": pos,
            "seq": frame.seq,
            "step": frame.step,
            "wall_ns": frame.wall_ns,
            "type": cls.__name__,
            "kind": cls.KIND,
            "request": e.req_id,
        }
        if cls is ev.StepDecoded:
            row["requests"] = []
        for name, column, fn in makers[cls]:
            value = getattr(e, name)
            row[column] = value if fn is None else fn(value)
    if row is not None:
        yield row


def export(
    path: LogPath | LogSource,
    out: PathLike,
    fmt: str | None = None,
    *,
    batch_rows: int = 65536,
) -> ExportResult:
    """One row per event: ``index, seq, step, wall_ns, type, kind, request`` and the event's
    fields as columns (bytes as hex, enums by name), for DuckDB or pandas; a ``StepDecoded``
    row also has ``requests``, the ids its request numbers stood for. ``fmt="jsonl"``
    writes one JSON object per line (only the event's own fields; ``out="-"``: standard
    output); ``fmt="parquet"`` writes every column of :data:`EXPORT_COLUMNS` (pyarrow, the
    ``parquet`` extra), in row groups of ``batch_rows``. The file appears complete or not at
    all (written aside, then renamed)."""
    fmt = _format_of(os.fspath(out), fmt)
    if fmt == "parquet":
        require("pyarrow", "parquet", "a parquet export (or use --format jsonl)")
    src = open_log(path)
    out_s = os.fspath(out)
    counts: Counter[str] = Counter()
    if fmt == "jsonl":
        if out_s == "-":
            n = _write_jsonl(src, sys.stdout, counts)
        else:
            tmp = out_s + ".tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    n = _write_jsonl(src, f, counts)
                os.replace(tmp, out_s)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    else:
        n = _write_parquet(src, out_s, counts, batch_rows)
    return ExportResult(out_s, fmt, n, dict(counts.most_common()), src.damage)


_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


def _format_of(out: str, fmt: str | None) -> str:
    """The format the output's extension names; ``fmt``, when given, must agree with it (a
    ``.parquet`` file of JSON lines is a silent wrong answer)."""
    if fmt is not None and fmt not in ("jsonl", "parquet"):
        raise ValueError(f"export format must be 'jsonl' or 'parquet', got {fmt!r}")
    if out == "-":
        return fmt or "jsonl"
    if os.path.isdir(out):
        raise ValueError(f"{out} is a directory: name the file to write")
    ext = os.path.splitext(out)[1].lower()
    named = _EXTENSIONS.get(ext)
    if fmt is None:
        if named is None:
            raise ValueError(
                f"cannot tell the format from {out!r}: end it in .jsonl or .parquet, or pass "
                "--format"
            )
        return named
    if named is not None and named != fmt:
        raise ValueError(f"{out!r} names {named}, but the format asked for is {fmt}")
    return fmt


def _write_jsonl(src: LogSource, f: IO[str], counts: Counter[str]) -> int:
    n = 0
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    write = f.write
    for row in _export_rows(src):
        write(dumps(row))
        write("\n")
        counts[row["type"]] += 1
        n += 1
    f.flush()
    return n


def _write_parquet(src: LogSource, out: str, counts: Counter[str], batch_rows: int) -> int:
    what = "a parquet export (or use --format jsonl)"
    pa = require("pyarrow", "parquet", what)
    pq = require("pyarrow.parquet", "parquet", what)

    types = {
        "int": pa.int64(),
        "bool": pa.bool_(),
        "str": pa.string(),
        "hex": pa.string(),
        "int_list": pa.list_(pa.int64()),
        "hex_list": pa.list_(pa.string()),
        "str_list": pa.list_(pa.string()),
    }
    schema = pa.schema([(name, types[kind]) for name, kind in EXPORT_COLUMNS])
    names = [name for name, _ in EXPORT_COLUMNS]
    tmp = out + ".tmp"
    n = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[dict[str, Any]] = []
            for row in _export_rows(src):
                batch.append(row)
                counts[row["type"]] += 1
                n += 1
                if len(batch) >= batch_rows:
                    writer.write_table(_table(pa, schema, names, batch))
                    batch = []
            if batch or n == 0:
                writer.write_table(_table(pa, schema, names, batch))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def _table(pa: Any, schema: Any, names: Sequence[str], rows: Sequence[dict[str, Any]]) -> Any:
    columns = {name: [row.get(name) for row in rows] for name in names}
    return pa.Table.from_pydict(columns, schema=schema)
