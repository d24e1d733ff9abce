"""Events <-> msgpack arrays: the schema table, the record layout, upcasters. Pure: no I/O.

A record is a msgpack array ``[tag, req_ref, *fields]``:

- ``tag`` is the event class's ``TAG``; ``fields`` are the class's attrs fields after
  ``step`` and ``req_id``, in declaration order (declaration order is wire order).
- ``step`` is not in the record: the log frame carries it (one frame per scheduler step).
- ``req_ref`` interns ``req_id`` per log segment: the first occurrence of an id is written as the
  string and takes the next integer ref (0, 1, 2, ...); every later occurrence in the segment is
  written as that int. :class:`Encoder` and :class:`Decoder` each hold one segment's table.
- Trailing fields equal to their declared default are dropped; the decoder fills them in.
- Values: ints and bools as themselves, enums as their int value, ``str`` as str, ``bytes`` as
  bin, tuples as arrays.
- Field transforms (:data:`DELTA_FIELDS`) make hot fields small: ``Scheduled.token_start`` is
  written as ``token_start - num_computed`` (0 on every decode step, 1 byte instead of 3 to 5).
  A transform applies only to a field present on the wire; an absent trailing field is its
  declared default. The log header declares the transforms it used (:func:`transforms`).

Versions: every class has a ``VERSION``. A log header records, per tag, the class name, the
version and the field names it was written with (:func:`schemas`). Reading an older version
runs the upcasters ``UPCASTERS[(tag, v)]`` for ``v`` up to the current version; each takes the
record's field list at version ``v`` (after ``req_id``, trailing defaults possibly dropped) and
returns the list at ``v + 1``. :func:`check_upcasters` runs at import: a type at version ``v > 1``
without an upcaster for each of ``1 .. v-1`` is an import error. The class name is checked
too: a tag the header declares under another name than this reader's class for it (an unknown
type, or a known type at another tag) is an error, never decoded as this reader's type.

Decoding validates every record (arity, types, enum values, interning) and raises
:class:`DecodeError` naming the type and field; it never executes anything from the data.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, NamedTuple

import attrs

from kvledger.tracker.events import (
    EVENT_TYPES,
    BlockDigested,
    Event,
    Finished,
    LoadDigested,
    Scheduled,
    StepDecoded,
)

__all__ = [
    "DELTA_FIELDS",
    "UPCASTERS",
    "CodecError",
    "DecodeError",
    "Decoder",
    "EncodeError",
    "Encoder",
    "SchemaError",
    "Upcaster",
    "check_upcasters",
    "defaults",
    "describe_exception",
    "encoder_table",
    "escaped",
    "generated_source",
    "schemas",
    "transforms",
]

Upcaster = Callable[[list[Any]], list[Any]]
"""``fields at version v -> fields at version v + 1`` (lists of wire values after ``req_id``)."""


class SchemaError(RuntimeError):
    """The event classes, transforms or upcasters are inconsistent (raised at import)."""


class CodecError(ValueError):
    """A value could not be encoded or decoded."""


class EncodeError(CodecError):
    """An event holds a value the wire format cannot carry."""


class DecodeError(CodecError):
    """A record is malformed: the message names the record, the type and the field."""


# --- upcasters ----------------------------------------------------------------------------


def _finished_v1_to_v2(fields: list[Any]) -> list[Any]:
    # v1: [aborted: bool = False]  ->  v2: [reason: str = "stopped"]
    if len(fields) > 1:
        raise DecodeError(f"Finished v1: expected at most 1 field (aborted), got {len(fields)}")
    aborted = fields[0] if fields else False
    if type(aborted) is not bool:
        raise DecodeError(f"Finished v1.aborted: expected bool, got {type(aborted).__name__}")
    return ["aborted" if aborted else "stopped"]


def _step_decoded_v1_to_v2(fields: list[Any]) -> list[Any]:
    # v1: [nums]  ->  v2: [nums, blocks]: v1 steady steps never appended a block.
    if len(fields) > 1:
        raise DecodeError(f"StepDecoded v1: expected at most 1 field (nums), got {len(fields)}")
    return [*fields, []] if fields else []


def _step_decoded_v2_to_v3(fields: list[Any]) -> list[Any]:
    # v2: [nums, blocks]  ->  v3: [nums, blocks, tokens]: v2 carried no token ids (empty, the
    # trailing default).
    if len(fields) > 2:
        raise DecodeError(
            f"StepDecoded v2: expected at most 2 fields (nums, blocks), got {len(fields)}"
        )
    return fields


def _load_digested_v1_to_v2(fields: list[Any]) -> list[Any]:
    # v1: [start, keys, before, after, rank]  ->  v2: + load_step (unknown: the default, -1).
    if len(fields) > 5:
        raise DecodeError(f"LoadDigested v1: expected at most 5 fields, got {len(fields)}")
    return fields


def _block_digested_v1_to_v2(fields: list[Any]) -> list[Any]:
    # v1: [start, keys, digests, rank]  ->  v2: + carried (the default, False: computed here).
    if len(fields) > 4:
        raise DecodeError(f"BlockDigested v1: expected at most 4 fields, got {len(fields)}")
    return fields


UPCASTERS: Final[dict[tuple[int, int], Upcaster]] = {
    (Finished.TAG, 1): _finished_v1_to_v2,
    (StepDecoded.TAG, 1): _step_decoded_v1_to_v2,
    (StepDecoded.TAG, 2): _step_decoded_v2_to_v3,
    (LoadDigested.TAG, 1): _load_digested_v1_to_v2,
    (BlockDigested.TAG, 1): _block_digested_v1_to_v2,
}
"""``(tag, from_version) -> upcaster`` to ``from_version + 1``."""


def check_upcasters(
    types: Iterable[type[Event]], upcasters: Mapping[tuple[int, int], Upcaster]
) -> None:
    """Raise :class:`SchemaError` unless every type at version ``v`` has upcasters from each of
    ``1 .. v-1``, and every upcaster belongs to a known type and an older version."""
    versions: dict[int, tuple[str, int]] = {}
    for cls in types:
        versions[cls.TAG] = (cls.__name__, cls.VERSION)
        for v in range(1, cls.VERSION):
            if (cls.TAG, v) not in upcasters:
                raise SchemaError(
                    f"{cls.__name__} (tag {cls.TAG}) is at version {cls.VERSION} but has no "
                    f"upcaster from version {v} to {v + 1}: add UPCASTERS[({cls.TAG}, {v})]"
                )
    for tag, v in upcasters:
        if tag not in versions:
            raise SchemaError(f"upcaster ({tag}, {v}) names no known event tag")
        name, current = versions[tag]
        if not 1 <= v < current:
            raise SchemaError(
                f"upcaster ({tag}, {v}) for {name}: version must be in 1..{current - 1}"
            )


# --- field kinds --------------------------------------------------------------------------

_INT_ONLY: Final = frozenset((int,))
_BYTES_ONLY: Final = frozenset((bytes,))


class _Kind(NamedTuple):
    """How one field travels: the wire type, an element type for arrays, enum values."""

    wire: type  # type of the unpacked value (int, bool, str, bytes, list)
    elem: frozenset[type] | None  # element types of an array field
    enum_values: frozenset[int] | None
    enum_type: type[enum.IntEnum] | None
    label: str  # for error messages


def _kind_of(cls: type[Event], name: str, hint: Any) -> _Kind:
    if hint is bool:
        return _Kind(bool, None, None, None, "bool")
    if hint is int:
        return _Kind(int, None, None, None, "int")
    if hint is str:
        return _Kind(str, None, None, None, "str")
    if hint is bytes:
        return _Kind(bytes, None, None, None, "bytes")
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return _Kind(int, None, frozenset(int(m) for m in hint), hint, hint.__name__)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, bytes):
            elem = _INT_ONLY if args[0] is int else _BYTES_ONLY
            return _Kind(list, elem, None, None, f"array of {args[0].__name__}")
    raise SchemaError(f"codec cannot carry {cls.__name__}.{name}: type {hint!r}")


def _check(kind: _Kind, value: Any) -> bool:
    if type(value) is not kind.wire:
        return False
    if kind.elem is not None:
        return not value or set(map(type, typing.cast("list[Any]", value))) <= kind.elem
    if kind.enum_values is not None:
        return value in kind.enum_values
    return True


# --- the schema table ---------------------------------------------------------------------

_NO_DEFAULT: Final = object()

DELTA_FIELDS: Final[dict[type[Event], dict[str, str]]] = {
    Scheduled: {"token_start": "num_computed"},
}
"""Per type, ``field -> base field``: the field is written as ``value - base``. The base must
come earlier (it is then always on the wire when the field is) and both must be ints."""


class _Schema(NamedTuple):
    cls: type[Event]
    tag: int
    name: str
    version: int
    fields: tuple[str, ...]  # wire fields: req_id first, then the rest (no step)
    kinds: tuple[_Kind, ...]  # per wire field after req_id
    defaults: tuple[Any, ...]  # aligned with fields, _NO_DEFAULT where required
    required: int  # number of leading fields without default (req_id included)
    deltas: tuple[tuple[int, int], ...]  # (record index, base record index)


def _build_schema(cls: type[Event]) -> _Schema:
    hints = typing.get_type_hints(cls)
    attrs_fields = attrs.fields(cls)
    names = [f.name for f in attrs_fields]
    if names[:2] != ["step", "req_id"]:
        raise SchemaError(f"{cls.__name__}: fields must start with step, req_id; got {names}")
    wire = attrs_fields[1:]
    defaults: list[Any] = []
    for f in wire:
        if f.default is attrs.NOTHING:
            if defaults and defaults[-1] is not _NO_DEFAULT:
                raise SchemaError(f"{cls.__name__}.{f.name}: required field after a default")
            defaults.append(_NO_DEFAULT)
        elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            raise SchemaError(f"{cls.__name__}.{f.name}: factory defaults are not supported")
        else:
            defaults.append(f.default)
    fields = tuple(f.name for f in wire)
    kinds = tuple(_kind_of(cls, f.name, hints[f.name]) for f in wire[1:])
    deltas = []
    for name, base in DELTA_FIELDS.get(cls, {}).items():
        if name not in fields or base not in fields or fields.index(base) >= fields.index(name):
            raise SchemaError(f"{cls.__name__}: delta {name} - {base} needs an earlier base")
        if (
            kinds[fields.index(name) - 1].label != "int"
            or kinds[fields.index(base) - 1].label != "int"
        ):
            raise SchemaError(f"{cls.__name__}: delta {name} - {base} needs int fields")
        deltas.append((fields.index(name) + 1, fields.index(base) + 1))
    required = sum(d is _NO_DEFAULT for d in defaults)
    return _Schema(
        cls=cls,
        tag=cls.TAG,
        name=cls.__name__,
        version=cls.VERSION,
        fields=fields,
        kinds=kinds,
        defaults=tuple(defaults),
        required=max(required, 1),
        deltas=tuple(deltas),
    )


_SCHEMAS: Final[dict[int, _Schema]] = {cls.TAG: _build_schema(cls) for cls in EVENT_TYPES}
_BY_CLASS: Final[dict[type[Event], _Schema]] = {s.cls: s for s in _SCHEMAS.values()}

check_upcasters(EVENT_TYPES, UPCASTERS)


def schemas() -> dict[int, list[Any]]:
    """The schema table for a log header: ``{tag: [class name, version, [field names]]}``;
    field names are the wire fields (``req_id`` first, ``step`` excluded)."""
    return {t: [s.name, s.version, list(s.fields)] for t, s in _SCHEMAS.items()}


def defaults() -> dict[int, dict[str, Any]]:
    """The declared defaults for a log header, ``{tag: {field: default}}`` (fields with a
    default only; enums as ints, tuples as arrays): what a reader in another language fills in
    for dropped trailing fields. This library's reader uses its classes' own defaults."""
    out: dict[int, dict[str, Any]] = {}
    for t, s in _SCHEMAS.items():
        declared = {
            name: (
                int(d) if isinstance(d, enum.IntEnum) else list(d) if isinstance(d, tuple) else d
            )
            for name, d in zip(s.fields, s.defaults, strict=True)
            if d is not _NO_DEFAULT
        }
        if declared:
            out[t] = declared
    return out


def transforms() -> dict[int, dict[str, list[str]]]:
    """The field transforms for a log header: ``{tag: {field: ["delta", base field]}}``."""
    return {
        cls.TAG: {name: ["delta", base] for name, base in spec.items()}
        for cls, spec in DELTA_FIELDS.items()
    }


# --- code generation ----------------------------------------------------------------------
#
# Like attrs' generated ``__init__``, the codec compiles one small encode function and one
# decode function per event class from the schema table above, at import. They are the hot
# path of logging (about 4x faster than a generic loop over an attrgetter tuple). The source
# is derived only from this library's own class definitions, never from log data, and is
# kept for reading: ``codec.generated_source(Scheduled)``.

_SOURCES: Final[dict[type[Event], str]] = {}


def _compile(cls: type[Event], source: str, namespace: dict[str, Any], fn: str) -> Any:
    _SOURCES[cls] = _SOURCES.get(cls, "") + source
    exec(compile(source, f"<kvledger codec {cls.__name__}>", "exec"), namespace)
    return namespace[fn]


def generated_source(cls: type[Event]) -> str:
    """The generated encode and decode functions of ``cls`` (for reading and debugging)."""
    return _SOURCES[cls]


def _make_encoder(s: _Schema) -> Callable[[Any, dict[str, int]], list[Any]]:
    """``encode(event, refs) -> record``: intern ``req_id``, drop trailing defaults, apply the
    delta transforms. Generated so that a decode-step ``Scheduled`` costs a few attribute reads
    and one list."""
    k = len(s.fields) - 1  # wire fields after req_id: v1..vk
    delta = {i - 1: b - 1 for i, b in s.deltas}  # field number -> base field number
    wire = [f"v{j} - v{delta[j]}" if j in delta else f"v{j}" for j in range(1, k + 1)]
    lines = [
        "def encode(e, refs):",
        "    rid = e.req_id",
        "    ref = refs.get(rid)",
        "    if ref is None:",
        "        if rid.__class__ is not str:",
        f"            raise EncodeError('{s.name}.req_id: not a str: ' + type(rid).__name__)",
        "        refs[rid] = len(refs)",
        "        ref = rid",
    ]
    lines += [f"    v{j} = e.{s.fields[j]}" for j in range(1, k + 1)]
    # Keep fields up to the last one that differs from its default.
    for j in range(k, s.required - 2, -1):
        if j >= s.required:
            lines.append(f"    if v{j} != d{j}:")
            lines.append(f"        return [{s.tag}, ref, {', '.join(wire[:j])}]")
        else:
            lines.append(f"    return [{s.tag}, ref{''.join(', ' + w for w in wire[:j])}]")
    ns: dict[str, Any] = {f"d{j}": s.defaults[j] for j in range(s.required, k + 1)}
    ns["EncodeError"] = EncodeError
    return _compile(s.cls, "\n".join(lines) + "\n", ns, "encode")  # type: ignore[no-any-return]


def _make_decoder(s: _Schema) -> Callable[[int, str, list[Any], int], Event]:
    """``decode(step, req_id, record, n) -> event`` for a record of the current version and
    transforms whose length ``n`` is already known to be in bounds: checks each field's type,
    undoes the deltas, converts arrays to tuples and ints to enums, builds the event (absent
    trailing fields take their defaults)."""
    k = len(s.fields) - 1
    delta = {i - 1: b - 1 for i, b in s.deltas}
    ns: dict[str, Any] = {"cls": s.cls, "bad": _bad_field(s), "new": object.__new__}
    setters = _direct_setters(s)
    if setters is not None:
        ns.update({f"S{j}": setter for j, setter in enumerate(setters)})
        ns.update({f"D{j}": _converted_default(s, j) for j in range(s.required, k + 1)})

    def build(present: int) -> list[str]:
        values = [f"v{i}" for i in range(1, present + 1)]
        if setters is None:  # through the class's own __init__
            return [f"return cls(step, rid{''.join(', ' + v for v in values)})"]
        values += [f"D{i}" for i in range(present + 1, k + 1)]
        sets = "; ".join(f"S{i + 2}(o, {v})" for i, v in enumerate(values))
        return ["o = new(cls)", f"S0(o, step); S1(o, rid){'; ' + sets if sets else ''}", "return o"]

    lines = ["def decode(step, rid, rec, n):"]
    for j in range(1, k + 1):
        kind = s.kinds[j - 1]
        if j > s.required - 1:
            lines.append(f"    if n == {j + 1}:")
            lines += [f"        {line}" for line in build(j - 1)]
        lines.append(f"    v{j} = rec[{j + 1}]")
        ns[f"t{j}"] = kind.wire
        cond = f"v{j}.__class__ is not t{j}"
        if kind.elem is not None:
            ns[f"ok{j}"] = kind.elem.issuperset
            ns[f"e{j}"] = next(iter(kind.elem))
            # (a one-element array, the common case of a decode step, checked inline)
            cond += (
                f" or (v{j} and not (len(v{j}) == 1 and v{j}[0].__class__ is e{j})"
                f" and not ok{j}(map(type, v{j})))"
            )
        elif kind.enum_type is not None:
            ns[f"m{j}"] = {int(m): m for m in kind.enum_type}
            cond += f" or v{j} not in m{j}"
        lines.append(f"    if {cond}:")
        lines.append(f"        bad({j}, v{j})")
        if j in delta:
            lines.append(f"    v{j} += v{delta[j]}")
        if kind.elem is not None:
            lines.append(f"    v{j} = tuple(v{j})")
        elif kind.enum_type is not None:
            lines.append(f"    v{j} = m{j}[v{j}]")
    lines += [f"    {line}" for line in build(k)]
    return _compile(s.cls, "\n".join(lines) + "\n", ns, "decode")  # type: ignore[no-any-return]


def _direct_setters(s: _Schema) -> list[Callable[[Any, Any], None]] | None:
    """The slot setters of ``s.cls`` (step, req_id, fields...) when a decoded event may be
    built without ``__init__`` (about twice as fast for a frozen slotted class): the class is
    attrs-generated, slotted, without validators, hooks or a cached hash, and every converter
    does what the decoder does anyway (arrays to tuples, ints to the enum). Otherwise None, and
    the decoder calls the class. A sample event built both ways must compare equal."""
    cls = s.cls
    init = getattr(cls.__init__, "__code__", None)
    if (
        init is None
        or not init.co_filename.startswith("<attrs generated")
        or "__slots__" not in cls.__dict__
        or hasattr(cls, "__attrs_post_init__")
        or hasattr(cls, "__attrs_pre_init__")
        or any(hasattr(c, "_attrs_cached_hash") for c in cls.__mro__)
    ):
        return None
    setters = []
    sample: list[Any] = [7, "r"]
    for i, f in enumerate(attrs.fields(cls)):
        if f.validator is not None or f.on_setattr not in (None, attrs.setters.NO_OP):
            return None
        kind = s.kinds[i - 2] if i >= 2 else _Kind(int if i == 0 else str, None, None, None, "")
        conv = f.converter
        if kind.elem is not None:
            value: Any = (1,) if kind.elem == _INT_ONLY else (b"k",)
            if conv is not None and (not callable(conv) or conv(list(value)) != value):
                return None
        elif kind.enum_type is not None:
            if conv is not kind.enum_type:
                return None
            value = list(kind.enum_type)[-1]
        elif conv is not None:
            return None
        else:
            value = {int: 3, str: "s", bytes: b"b", bool: True}[kind.wire]
        descriptor = next((c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__), None)
        if type(descriptor) is not types.MemberDescriptorType:
            return None
        setters.append(descriptor.__set__)
        if i >= 2:
            sample.append(value)
    built = object.__new__(cls)
    for setter, value in zip(setters, sample, strict=True):
        setter(built, value)
    try:
        if built != cls(*sample):
            return None
    except Exception:
        return None
    return setters


def _converted_default(s: _Schema, j: int) -> Any:
    # The value __init__ would store for an absent field j: its default through the converter.
    f = attrs.fields(s.cls)[j + 1]
    return f.converter(f.default) if callable(f.converter) else f.default


def _bad_field(s: _Schema) -> Callable[[int, Any], None]:
    def bad(j: int, value: Any) -> None:
        kind = s.kinds[j - 1]
        raise DecodeError(f"{s.name}.{s.fields[j]}: expected {kind.label}, got {_describe(value)}")

    return bad


_ENCODERS: Final[dict[type[Event], Callable[[Any, dict[str, int]], list[Any]]]] = {
    s.cls: _make_encoder(s) for s in _SCHEMAS.values()
}
_DECODERS: Final[dict[int, Callable[[int, str, list[Any], int], Event]]] = {
    s.tag: _make_decoder(s) for s in _SCHEMAS.values()
}


# --- encoding -----------------------------------------------------------------------------


class Encoder:
    """Turns events into records; holds one segment's ``req_id`` intern table."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[str, int] = {}

    def encode(self, event: Event) -> list[Any]:
        """The record ``[tag, req_ref, *fields]``; interns ``event.req_id``."""
        try:
            fn = _ENCODERS[event.__class__]
        except KeyError:
            raise EncodeError(f"not an event type the codec knows: {type(event)!r}") from None
        try:
            return fn(event, self._refs)
        except TypeError as e:  # e.g. a delta over a non-int
            raise EncodeError(f"cannot encode {event!r}: {e}") from None

    @property
    def refs(self) -> dict[str, int]:
        """The segment's intern table (``req_id -> ref``), for a caller of
        :func:`encoder_table`."""
        return self._refs

    def mark(self) -> int:
        """A point to :meth:`rollback` to (the number of interned ids)."""
        return len(self._refs)

    def rollback(self, mark: int) -> None:
        """Forget the ids interned since ``mark`` (their records were never written)."""
        refs = self._refs
        while len(refs) > mark:
            refs.popitem()

    def __len__(self) -> int:
        return len(self._refs)


def encoder_table() -> Mapping[type[Event], Callable[[Any, dict[str, int]], list[Any]]]:
    """``event class -> encode(event, refs) -> record``: the generated functions that
    :meth:`Encoder.encode` calls, for a hot loop that holds an Encoder's :attr:`~Encoder.refs`
    (the log writer). Read-only."""
    return _ENCODERS


# --- decoding -----------------------------------------------------------------------------


class _Plan(NamedTuple):
    """How to decode one tag of one segment (built from that segment's header).

    ``fast`` is the generated decoder when the segment wrote the current version with the
    current transforms; otherwise the generic path undoes the header's transforms, runs the
    upcasters and checks the fields against the current schema."""

    schema: _Schema
    lo: int  # record length bounds (tag and req_ref included)
    hi: int
    fast: Callable[[int, str, list[Any], int], Event] | None
    deltas: tuple[tuple[int, int], ...]  # the header's transforms (record index, base index)
    upcast: tuple[tuple[int, Upcaster], ...]  # (from version, fn)


def _header_deltas(
    name: str, fields: list[str], declared: Any
) -> tuple[tuple[int, int], ...] | str:
    if declared is None:
        return ()
    if not isinstance(declared, dict):
        return f"{name}: transforms must be a map"
    out = []
    for field, spec in declared.items():
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or spec[0] != "delta"
            or field not in fields
            or spec[1] not in fields
            or fields.index(spec[1]) >= fields.index(field)
        ):
            return f"{name}: unsupported field transform {field!r}: {spec!r}"
        out.append((fields.index(field) + 1, fields.index(spec[1]) + 1))
    return tuple(sorted(out))


def _plan_for(tag: int, entry: Any, declared_transforms: Any) -> _Plan | str:
    """A plan for a tag declared in a header, or an error message (raised when a record with
    this tag appears: the header may list types the segment never uses)."""
    if (
        not isinstance(entry, list)
        or len(entry) != 3
        or not isinstance(entry[0], str)
        or type(entry[1]) is not int
        or not isinstance(entry[2], list)
        or not all(isinstance(f, str) for f in entry[2])
        or not entry[2]
        or entry[2][0] != "req_id"
    ):
        return f"tag {tag}: malformed schema entry in the header: {entry!r}"
    name, version, fields = entry
    s = _SCHEMAS.get(tag)
    if s is None:
        return f"tag {tag} ({name} v{version}) is unknown to this kvledger"
    if name != s.name:
        # The tag is this reader's, the type is not: decoding it as s would misread every
        # record (a forged or foreign header, or a type this reader does not know). Type
        # names never change: a rename would need its own entry here, like an upcaster.
        return (
            f"tag {tag} is declared as {name} v{version} in the header; this kvledger's tag "
            f"{tag} is {s.name}"
        )
    deltas = _header_deltas(s.name, fields, declared_transforms)
    if isinstance(deltas, str):
        return deltas
    if version > s.version:
        return (
            f"{s.name} v{version} was written by a newer kvledger; this one reads up to "
            f"v{s.version}"
        )
    if version == s.version:
        if tuple(fields) != s.fields:
            return (
                f"{s.name} v{version}: the header declares fields {fields}, this kvledger "
                f"has {list(s.fields)}"
            )
        fast = _DECODERS[tag] if deltas == tuple(sorted(s.deltas)) else None
        return _Plan(s, 1 + s.required, 1 + len(s.fields), fast, deltas, ())
    if version < 1:
        return f"{s.name}: bad version {version}"
    chain = tuple((v, UPCASTERS[(tag, v)]) for v in range(version, s.version))
    return _Plan(s, 2, 1 + len(fields), None, deltas, chain)


class Decoder:
    """Turns records back into events for one segment: built from the segment header's schema
    table (and transforms); holds the segment's ``req_id`` table."""

    __slots__ = ("_bounds", "_ids", "_known", "_plans")

    def __init__(self, header_schemas: Mapping[Any, Any], header_transforms: Any = None) -> None:
        if not isinstance(header_schemas, Mapping):
            raise DecodeError("header schemas must be a map")
        if header_transforms is None:
            header_transforms = {}
        if not isinstance(header_transforms, Mapping):
            raise DecodeError("header transforms must be a map")
        plans: dict[int, _Plan | str] = {}
        for tag, entry in header_schemas.items():
            if type(tag) is not int:
                raise DecodeError(f"header schemas: tag {tag!r} is not an int")
            plans[tag] = _plan_for(tag, entry, header_transforms.get(tag))
        self._plans = plans
        # Hot-loop view of the usable plans: tag -> (min length, max length, fast decoder).
        self._bounds = {
            tag: (p.lo, p.hi, p.fast) for tag, p in plans.items() if isinstance(p, _Plan)
        }
        self._ids: list[str] = []
        self._known: set[str] = set()

    @property
    def req_ids(self) -> list[str]:
        """The segment's req_id table so far (ref ``i`` is ``req_ids[i]``)."""
        return self._ids

    def _req_id(self, ref: Any, index: int) -> str:
        ids = self._ids
        if type(ref) is int:
            if 0 <= ref < len(ids):
                return ids[ref]
            raise DecodeError(f"record {index}: req ref {ref} not declared ({len(ids)} known)")
        if type(ref) is str:
            if ref in self._known:
                raise DecodeError(f"record {index}: req_id {ref!r} declared twice")
            ids.append(ref)
            self._known.add(ref)
            return ref
        raise DecodeError(f"record {index}: req_id must be str or int, got {type(ref).__name__}")

    def _plan(self, record: Any, index: int) -> _Plan:
        if type(record) is not list:
            raise DecodeError(f"record {index}: expected an array, got {type(record).__name__}")
        if len(record) < 2:
            raise DecodeError(f"record {index}: expected [tag, req_id, ...], got {record!r}")
        tag = record[0]
        if type(tag) is not int:
            raise DecodeError(f"record {index}: tag must be an int, got {type(tag).__name__}")
        plan = self._plans.get(tag)
        if plan is None:
            raise DecodeError(f"record {index}: tag {tag} is not in the header's schema table")
        if isinstance(plan, str):
            raise DecodeError(f"record {index}: {plan}")
        n = len(record)
        if n < plan.lo or n > plan.hi:
            raise DecodeError(
                f"record {index}: {plan.schema.name} takes {plan.lo - 2} to {plan.hi - 2} "
                f"fields after req_id, got {n - 2}"
            )
        return plan

    def resolve(self, records: Any) -> list[list[Any]]:
        """Check a frame's records (array shape, tag, arity) and replace each ``req_ref`` by
        its ``req_id`` in place: the raw records, fields as written (no defaults filled, no
        transforms or upcasters applied, field types not checked). The fast path for
        verification and statistics."""
        if type(records) is not list:
            raise DecodeError(f"records: expected an array, got {type(records).__name__}")
        bounds = self._bounds
        ids = self._ids
        nids = len(ids)
        for i, rec in enumerate(records):
            # Inline fast path; anything unusual goes through the checked helpers.
            if rec.__class__ is list and len(rec) >= 2 and rec[0].__class__ is int:
                b = bounds.get(rec[0])
                if b is not None and b[0] <= len(rec) <= b[1]:
                    ref = rec[1]
                    if ref.__class__ is int and 0 <= ref < nids:
                        rec[1] = ids[ref]
                        continue
            self._plan(rec, i)
            rec[1] = self._req_id(rec[1], i)
            nids = len(ids)
        return records

    def decode(self, step: int, records: Any) -> tuple[Event, ...]:
        """A frame's records as events of ``step``; raises :class:`DecodeError`."""
        if type(records) is not list:
            raise DecodeError(f"records: expected an array, got {type(records).__name__}")
        bounds = self._bounds
        ids = self._ids
        nids = len(ids)
        out: list[Event] = []
        append = out.append
        for i, rec in enumerate(records):
            # Fast path: a well-formed record of a current-version tag with a known ref.
            if rec.__class__ is list and len(rec) >= 2 and rec[0].__class__ is int:
                b = bounds.get(rec[0])
                n = len(rec)
                if b is not None and b[0] <= n <= b[1]:
                    ref = rec[1]
                    fast = b[2]
                    if fast is not None and ref.__class__ is int and 0 <= ref < nids:
                        try:
                            append(fast(step, ids[ref], rec, n))
                        except DecodeError as e:
                            raise DecodeError(f"record {i}: {e}") from None
                        continue
            plan = self._plan(rec, i)
            rid = self._req_id(rec[1], i)
            nids = len(ids)
            append(self._slow(plan, step, rid, rec, i))
        return tuple(out)

    def _slow(self, plan: _Plan, step: int, rid: str, rec: list[Any], index: int) -> Event:
        s = plan.schema
        if plan.fast is not None:
            try:
                return plan.fast(step, rid, rec, len(rec))
            except DecodeError as e:
                raise DecodeError(f"record {index}: {e}") from None
        fields = rec[2:]
        for j, base in plan.deltas:
            if j < len(rec):
                value, b = rec[j], rec[base]
                if type(value) is not int or type(b) is not int:
                    raise DecodeError(f"record {index}: {s.name}: a delta field is not an int")
                fields[j - 2] = value + b
        for version, fn in plan.upcast:
            try:
                fields = fn(list(fields))
            except DecodeError as e:
                raise DecodeError(f"record {index}: {e}") from None
            except Exception as e:  # an upcaster meets old, possibly hostile data
                raise DecodeError(
                    f"record {index}: {s.name} upcaster from v{version} failed: {describe_exception(e)}"
                ) from None
            if type(fields) is not list:
                raise DecodeError(f"record {index}: {s.name} upcaster from v{version}: not a list")
        if not s.required - 1 <= len(fields) <= len(s.fields) - 1:
            raise DecodeError(
                f"record {index}: {s.name} v{s.version} takes {s.required - 1} to "
                f"{len(s.fields) - 1} fields after req_id, got {len(fields)}"
            )
        for j, value in enumerate(fields, start=1):
            if not _check(s.kinds[j - 1], value):
                raise DecodeError(
                    f"record {index}: {s.name}.{s.fields[j]}: expected {s.kinds[j - 1].label}, "
                    f"got {_describe(value)}"
                )
        return s.cls(step, rid, *fields)


def describe_exception(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line for a stop reason or a loss record, cut to ``limit``
    characters and :func:`escaped` (an error can quote a request id vLLM was handed)."""
    return escaped(f"{type(e).__name__}: {e}"[:limit])


def escaped(text: str) -> str:
    """``text`` as the log can hold it: what UTF-8 cannot encode (lone surrogates, which a
    JSON request id can carry into vLLM) escaped as ``\\udXXXX``; any other text unchanged."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _describe(value: Any) -> str:
    if type(value) is list:
        kinds = sorted({type(v).__name__ for v in value})
        return f"array of {'/'.join(kinds) or 'nothing'}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}"
