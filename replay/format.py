"""Events as text and as plain values: the one formatter every command and view uses.

- :func:`plain_fields`: how each field of an event type becomes a plain value (its kind, and
  the conversion: bytes as hex, enums by name, tuples as lists), for ``export``'s columns and
  rows and for :func:`event_fields`;
- :func:`event_fields` / :func:`event_dict`: an event as JSON values, its own fields or all of
  them;
- :func:`event_content`: what two runs must agree on (``diff``);
- :func:`describe_event`: one short line for a table cell (``show``, ``diff``);
- :func:`format_event`: the event as a line of ``name=value`` (``check``'s problems);
- :func:`elide`: a text cut to a width, saying how long it was: what every command prints of
  a value read from a log (a 5 MB string is as valid on the wire as a 5-byte one). Tables
  elide each cell; ``--json`` keeps every value whole.
- :func:`visible`: a value read from a log with its control characters escaped (``\\x1b``),
  so that a hostile log cannot drive the terminal; :func:`elide` and the text output
  (``replay.extras.Output``) apply it.
- :func:`printable`: a file name as text every encoder takes (bytes that are not UTF-8 as
  ``\\xff``), for what is drawn or written as UTF-8 (``timeline``'s pictures and pages).
- :func:`json_text`: a document as strict JSON, what every ``--json`` prints (the commands'
  and the demos').
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs

from kvledger.tracker import events as ev

__all__ = [
    "WIDE",
    "PlainField",
    "describe_event",
    "elide",
    "event_content",
    "event_dict",
    "event_fields",
    "field_names",
    "format_event",
    "json_text",
    "jsonable",
    "plain_fields",
    "printable",
    "visible",
]

_FIELDS: dict[type[ev.Event], tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls))[2:] for cls in ev.EVENT_TYPES
}


WIDE = 200
"""The widest a value read from a log is printed (a table cell, a field in a line), in
characters; past it, :func:`elide` cuts it."""


# The control characters (C0, DEL, C1) as repr writes them: a value read from a log goes to a
# terminal, where an escape sequence in a request id would set the window title or clear the
# screen, and a newline would break a table's row.
_CONTROLS = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}


def visible(text: str) -> str:
    """``text`` with its control characters (C0, DEL, C1) escaped as repr writes them
    (``\\x1b``, ``\\n``, ``\\r``, ``\\t``), every other character as it is: a value read
    from a log, as text for a terminal. :func:`elide` applies it; ``--json`` keeps every value
    exact (JSON escapes them itself)."""
    return text.translate(_CONTROLS)


def _cut(text: str, width: int, length: int | None = None) -> str:
    """``text`` if it fits in ``width``, else its head and ``length`` (its own by default)."""
    if len(text) <= width:
        return text
    tail = f"… ({len(text) if length is None else length:,} chars)"
    return text[: max(0, width - len(tail))] + tail


def elide(text: str, width: int = WIDE) -> str:
    """``text`` :func:`visible` (its control characters escaped) if it fits in ``width``
    characters, else its head and how long it was: ``abc… (5,242,880 chars)``, at most
    ``width`` characters (a width below 32 still keeps the count)."""
    return _cut(visible(text), width, len(text))  # the count is of the value's own characters


def printable(text: str) -> str:
    """``text`` (a path, or a message naming one) with the bytes of a file name that the file
    system's encoding could not decode (``os.fsdecode`` holds them as lone surrogates, which
    no UTF-8 encoder takes) shown as ``\\xff``: ``r\\xff.kvlog``. Other text is returned as
    it is."""
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode(sys.getfilesystemencoding(), "backslashreplace")


def field_names(cls: type[ev.Event]) -> tuple[str, ...]:
    """An event type's own fields (after ``step`` and ``req_id``), in wire order."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in attrs.fields(cls))[2:]
    return names


class PlainField(NamedTuple):
    """One field of an event type as a plain value."""

    name: str
    kind: str  # int, bool, str, hex (bytes), int_list or hex_list
    convert: Callable[[Any], Any] | None  # value -> plain value; None: it is one already


def _enum_name(value: enum.Enum) -> str:
    return value.name


def _hex_list(values: Sequence[bytes]) -> list[str]:
    return [v.hex() for v in values]


def _plain_field(name: str, hint: Any) -> PlainField:
    if hint is bool or hint is int or hint is str:
        return PlainField(name, hint.__name__, None)
    if hint is bytes:
        return PlainField(name, "hex", bytes.hex)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return PlainField(name, "str", _enum_name)
    if typing.get_origin(hint) is tuple:
        if typing.get_args(hint)[0] is bytes:
            return PlainField(name, "hex_list", _hex_list)
        return PlainField(name, "int_list", list)
    raise TypeError(f"no plain value for {name}: {hint!r}")


_PLAIN: dict[type[ev.Event], tuple[PlainField, ...]] = {}


def plain_fields(cls: type[ev.Event]) -> tuple[PlainField, ...]:
    """An event type's own fields (:func:`field_names`), each with the kind of its plain
    value and the conversion to it. Raises ``TypeError`` for a field type it cannot convert."""
    out = _PLAIN.get(cls)
    if out is None:
        hints = typing.get_type_hints(cls)
        out = _PLAIN[cls] = tuple(_plain_field(n, hints[n]) for n in field_names(cls))
    return out


def event_fields(e: ev.Event) -> dict[str, Any]:
    """The event's own fields as JSON values: bytes as hex, enums by name, tuples as lists."""
    out: dict[str, Any] = {}
    for name, _, convert in plain_fields(type(e)):
        value = getattr(e, name)
        out[name] = value if convert is None else convert(value)
    return out


def event_content(e: ev.Event) -> tuple[Any, ...]:
    """What two runs must agree on: the type and every field but ``step`` and ``req_id``."""
    return (type(e), *(getattr(e, name) for name in field_names(type(e))))


def _short_ints(values: Sequence[int], limit: int = 6) -> str:
    if len(values) <= limit:
        return "[" + " ".join(map(str, values)) + "]"
    head = " ".join(map(str, values[: limit - 2]))
    return f"[{head} … {values[-1]}]({len(values)})"


def describe_event(e: ev.Event) -> str:
    """One short line for a table: the fields that say something, sequences abridged."""
    if isinstance(e, ev.RequestAdded):
        salt = f" salt={e.cache_salt}" if e.cache_salt else ""
        return f"prompt {len(e.prompt_token_ids)} tokens{salt}"
    if isinstance(e, ev.StepDecoded):
        n = len(e.nums)
        return f"+1 token for each of {n} request{'s' if n != 1 else ''} nums={_short_ints(e.nums)}"
    parts: list[str] = []
    cls = type(e)
    for f in attrs.fields(cls)[2:]:
        value = getattr(e, f.name)
        name = f.name
        if isinstance(value, enum.Enum):
            parts.insert(0, value.name)
        elif isinstance(value, bool):
            if value:
                parts.append(name)
        elif isinstance(value, bytes):
            parts.append(f"{name}={value.hex()[:8]}")
        elif isinstance(value, tuple):
            if name == "token_ids":
                if value:
                    parts.append(f"+{len(value)} ids")
            elif value and isinstance(value[0], bytes):
                parts.append(f"{name}={len(value)}")
            elif value or f.default is attrs.NOTHING:
                parts.append(f"{name}={_short_ints(value)}")
        elif name == "token_start":
            continue  # where the new ids go: noise in a table
        elif isinstance(value, str):
            if value:
                parts.append(f"{name}={value}")
        elif f.default is attrs.NOTHING or value != f.default:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def event_dict(event: ev.Event | None) -> dict[str, Any] | None:
    """An event as plain JSON-able values: ``{"type": name, field: value, ...}`` (bytes as
    hex, enums by name)."""
    if event is None:
        return None
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in attrs.fields(type(event)):
        out[f.name] = jsonable(getattr(event, f.name))
    return out


def _value(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        return v.hex()[:8]
    if isinstance(v, enum.Enum):
        return v.name.lower()
    if isinstance(v, tuple):
        if name in ("prompt_token_ids", "token_ids") and len(v) > 8:
            return f"({len(v)} ids: {', '.join(map(str, v[:4]))}, ...)"
        items = [_value(name, x) for x in v[:12]]
        more = f", ... ({len(v)} in all)" if len(v) > 12 else ""
        return "[" + ", ".join(items) + more + "]"
    return repr(_cut(v, WIDE)) if isinstance(v, str) else str(v)  # repr escapes controls


def _is_default(field: Any, value: Any) -> bool:
    default = field.default
    if default is attrs.NOTHING:
        return False
    if field.converter is not None and callable(field.converter):
        default = field.converter(default)
    return bool(value == default) and type(value) is type(default)


def format_event(event: Any) -> str:
    """``Scheduled num_computed=0 num_scheduled=49 ... admission=resumed``: the fields but
    ``step``, ``req_id`` and those at their default; chunk keys as their first 8 hex digits,
    long token lists cut, long strings elided (:func:`elide`)."""
    if event is None:
        return "-"
    fields = [
        f"{f.name}={_value(f.name, getattr(event, f.name))}"
        for f in attrs.fields(type(event))
        if f.name not in ("step", "req_id") and not _is_default(f, getattr(event, f.name))
    ]
    return " ".join([type(event).__name__, *fields])


def _finite(obj: Any) -> Any:
    """``obj`` with every float that is not finite (inf, -inf, nan: ``sql``'s ``1/0``) as None,
    in dicts, lists and tuples at any depth: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: int | None = None) -> str:
    """``obj`` as strict JSON (RFC 8259, which every parser takes): a float that is not finite
    becomes null; what json cannot write, its ``str``. Every ``--json`` output is this."""
    return json.dumps(_finite(obj), indent=indent, default=str, allow_nan=False)
