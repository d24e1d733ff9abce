"""``export``: one row per event, for DuckDB or pandas: JSON lines, or parquet (the
``parquet`` extra)."""

from __future__ import annotations

import enum
import json
import os
import sys
import typing
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import attrs

from replay.extras import require
from replay.format import field_names
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


def _column_kind(hint: Any) -> str:
    if hint is bool:
        return "bool"
    if hint is int:
        return "int"
    if hint is str:
        return "str"
    if hint is bytes:
        return "hex"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "str"
    if typing.get_origin(hint) is tuple:
        (elem, *_rest) = typing.get_args(hint)
        return "hex_list" if elem is bytes else "int_list"
    raise TypeError(f"no export column type for {hint!r}")


def _export_columns() -> tuple[tuple[str, str], ...]:
    cols: dict[str, str] = dict(_BASE_COLUMNS)
    for cls in ev.EVENT_TYPES:
        hints = typing.get_type_hints(cls)
        for name in field_names(cls):
            kind = _column_kind(hints[name])
            col = name if name not in dict(_BASE_COLUMNS) else f"field_{name}"
            if cols.get(col, kind) != kind:
                raise TypeError(f"export column {col!r} has two types: {cols[col]}, {kind}")
            cols[col] = kind
    return tuple(cols.items())


EXPORT_COLUMNS: tuple[tuple[str, str], ...] = _export_columns()
"""``(column, kind)`` of an export: the base columns, then every event field of every type
(a field absent from an event type is null in its rows). Kinds: int, bool, str, hex (bytes as
hex), int_list, hex_list, str_list."""

_BASE_NAMES = frozenset(name for name, _ in _BASE_COLUMNS)


@attrs.frozen
class ExportResult:
    out: str
    format: str
    rows: int
    rows_by_type: dict[str, int]
    damage: StopInfo | None


def _row_makers() -> dict[type[ev.Event], tuple[tuple[str, str, Callable[[Any], Any] | None], ...]]:
    """Per event type: (attribute, column, converter or None) for each field. Tuples of ints
    need no converter (JSON and pyarrow take them as arrays)."""
    out: dict[type[ev.Event], tuple[tuple[str, str, Callable[[Any], Any] | None], ...]] = {}
    convert: dict[str, Callable[[Any], Any] | None] = {
        "int": None,
        "bool": None,
        "str": None,
        "hex": bytes.hex,
        "int_list": None,
        "hex_list": lambda keys: [k.hex() for k in keys],
    }
    for cls in ev.EVENT_TYPES:
        hints = typing.get_type_hints(cls)
        fields = []
        for name in field_names(cls):
            hint = hints[name]
            fn = convert[_column_kind(hint)]
            if isinstance(hint, type) and issubclass(hint, enum.Enum):
                fn = _enum_name
            fields.append((name, name if name not in _BASE_NAMES else f"field_{name}", fn))
        out[cls] = tuple(fields)
    return out


def _enum_name(value: enum.Enum) -> str:
    return value.name


def _export_rows(src: LogSource) -> Iterator[dict[str, Any]]:
    makers = _row_makers()
    row: dict[str, Any] | None = None
    last_pos = -1
    config, _ = src.lenient_config()
    for item in walk(src.frames(), config):
        pos, frame, e, rid = item.pos, item.frame, item.event, item.req_id
        if pos == last_pos:  # StepDecoded, once more for each request it names
            assert row is not None
            row["requests"].append(rid)
            continue
        if row is not None:
            yield row
        last_pos = pos
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
    path: LogPath | LogSource, out: PathLike, fmt: str = "jsonl", *, batch_rows: int = 65536
) -> ExportResult:
    """One row per event: ``index, seq, step, wall_ns, type, kind, request`` and the event's
    fields as columns (bytes as hex, enums by name), for DuckDB or pandas; a ``StepDecoded``
    row also has ``requests``, the ids its request numbers stood for. ``fmt="jsonl"``
    writes one JSON object per line (only the event's own fields; ``out="-"``: standard
    output); ``fmt="parquet"`` writes every column of :data:`EXPORT_COLUMNS` (pyarrow, the
    ``parquet`` extra), in row groups of ``batch_rows``. The file appears complete or not at
    all (written aside, then renamed)."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"export format must be 'jsonl' or 'parquet', got {fmt!r}")
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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
