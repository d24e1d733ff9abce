"""tracker.codec: records, interning, trailing defaults, transforms, upcasters, validation."""

from __future__ import annotations

import typing
from typing import Any, ClassVar

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.tracker import codec
from kvledger.tracker import events as ev

# --- strategies: one per event class, derived from its attrs fields --------------------------

INTS = st.integers(min_value=-(2**62), max_value=2**62)


def _field_strategy(hint: Any) -> st.SearchStrategy[Any]:
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.one_of(st.integers(min_value=0, max_value=300), INTS)
    if hint is str:
        return st.text(max_size=20)
    if hint is bytes:
        return st.binary(max_size=40)
    if isinstance(hint, type) and issubclass(hint, ev.Admission):
        return st.sampled_from(list(ev.Admission))
    if typing.get_origin(hint) is tuple:
        elem = typing.get_args(hint)[0]
        inner = st.integers(min_value=0, max_value=2**40) if elem is int else st.binary(max_size=32)
        return st.lists(inner, max_size=12).map(tuple)
    raise AssertionError(f"no strategy for {hint!r}: add one (the codec accepted the type)")


def event_strategy(
    cls: type[ev.Event], req_ids: st.SearchStrategy[str] | None = None, step: int | None = None
) -> st.SearchStrategy[ev.Event]:
    """Events of ``cls``; fields with a default take it half of the time, so records with
    dropped trailing defaults (and with defaults in the middle) are common."""
    hints = typing.get_type_hints(cls)
    args: list[st.SearchStrategy[Any]] = []
    for f in attrs.fields(cls):
        if f.name == "step":
            args.append(st.just(step) if step is not None else st.integers(0, 2**40))
        elif f.name == "req_id":
            args.append(req_ids if req_ids is not None else st.text(max_size=12))
        else:
            s = _field_strategy(hints[f.name])
            if f.default is not attrs.NOTHING:
                s = st.one_of(st.just(f.default), s)
            args.append(s)
    return st.tuples(*args).map(lambda values: cls(*values))


def any_event(
    req_ids: st.SearchStrategy[str] | None = None, step: int | None = None
) -> st.SearchStrategy[ev.Event]:
    return st.one_of([event_strategy(c, req_ids, step) for c in ev.EVENT_TYPES])


def roundtrip(frames: list[list[ev.Event]]) -> list[tuple[ev.Event, ...]]:
    """Encode frames of events (one step each) through msgpack and decode them back."""
    enc = codec.Encoder()
    dec = codec.Decoder(codec.schemas(), codec.transforms())
    out = []
    for events in frames:
        records = [enc.encode(e) for e in events]
        step = events[0].step if events else 0
        data = msgpack.packb([0, step, 0, records], use_bin_type=True)
        obj = msgpack.unpackb(data, use_list=True, raw=False)
        out.append(dec.decode(obj[1], obj[3]))
    return out


# --- schema table ---------------------------------------------------------------------------


def test_schemas_list_every_type_with_its_wire_fields() -> None:
    table = codec.schemas()
    assert set(table) == {c.TAG for c in ev.EVENT_TYPES}
    for cls in ev.EVENT_TYPES:
        name, version, fields = table[cls.TAG]
        assert name == cls.__name__
        assert version == cls.VERSION
        assert fields == [f.name for f in attrs.fields(cls)][1:]  # step dropped, req_id kept
        assert fields[0] == "req_id"
    assert table[ev.Finished.TAG][1] == 2
    assert codec.transforms() == {ev.Scheduled.TAG: {"token_start": ["delta", "num_computed"]}}


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ev.EVENT_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_type_round_trips(cls: type[ev.Event], data: st.DataObject) -> None:
    step = data.draw(st.integers(0, 2**40))
    events = data.draw(st.lists(event_strategy(cls, step=step), min_size=1, max_size=5))
    (decoded,) = roundtrip([events])
    assert decoded == tuple(events)
    for a, b in zip(decoded, events, strict=True):
        assert type(a) is type(b)
        for f in attrs.fields(cls):
            assert type(getattr(a, f.name)) is type(getattr(b, f.name)), f.name


@settings(max_examples=100, deadline=None)
@given(
    frames=st.lists(
        st.integers(0, 1000).flatmap(
            lambda step: st.lists(
                any_event(st.sampled_from(["a", "b", "c", "", "req-λ"]), step=step), max_size=8
            )
        ),
        max_size=6,
    )
)
def test_mixed_frames_round_trip_with_interning_across_frames(
    frames: list[list[ev.Event]],
) -> None:
    frames = [f for f in frames if f]
    assert roundtrip(frames) == [tuple(f) for f in frames]


def test_interning_first_occurrence_is_the_string_then_the_ref() -> None:
    enc = codec.Encoder()
    ids = ["x", "y", "x", "z", "y", "x"]
    refs = [enc.encode(ev.Preempted(1, i))[1] for i in ids]
    assert refs == ["x", "y", 0, "z", 1, 0]
    assert len(enc) == 3
    mark = enc.mark()
    assert enc.encode(ev.Preempted(1, "w"))[1] == "w"
    enc.rollback(mark)
    assert enc.encode(ev.Preempted(1, "w"))[1] == "w"  # forgotten: declared again
    assert codec.Encoder().encode(ev.Preempted(1, "x"))[1] == "x"  # a new segment restarts


def test_trailing_defaults_are_dropped_and_middle_defaults_kept() -> None:
    enc = codec.Encoder()
    enc.encode(ev.Preempted(0, "r"))  # intern "r" as ref 0
    assert enc.encode(ev.Finished(1, "r")) == [6, 0]
    assert enc.encode(ev.Finished(1, "r", "aborted")) == [6, 0, "aborted"]
    assert enc.encode(ev.Scheduled(1, "r", 10, 5)) == [4, 0, 10, 5]
    # token_start is a delta from num_computed when present
    assert enc.encode(ev.Scheduled(1, "r", 10, 1, 10, (7,))) == [4, 0, 10, 1, 0, (7,)]
    # admission not default: everything before it stays, defaults included
    assert enc.encode(ev.Scheduled(1, "r", 0, 4, 0, (1, 2, 3, 4), (), ev.Admission.NEW)) == [
        4,
        0,
        0,
        4,
        0,
        (1, 2, 3, 4),
        (),
        ev.Admission.NEW,
    ]
    assert enc.encode(ev.ChunkStored(1, "r")) == [11, 0]
    assert enc.encode(ev.ChunkStored(1, "r", b"", -1, 3)) == [11, 0, b"", -1, 3]
    # a record decodes to the same event with the defaults filled back in
    assert roundtrip([[ev.Scheduled(1, "q", 10, 5), ev.ChunkStored(1, "q", b"", -1, 3)]]) == [
        (ev.Scheduled(1, "q", 10, 5), ev.ChunkStored(1, "q", b"", -1, 3))
    ]


def test_decode_step_scheduled_fits_the_byte_budget() -> None:
    # DESIGN: at most 16 bytes per decode-step event (256 requests, token ids < 32000),
    # frame overhead included. Measured exactly here (sizes, not time).
    import random

    rng = random.Random(7)
    enc = codec.Encoder()
    packer = msgpack.Packer(use_bin_type=True)
    reqs = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(256)]
    for base in (2048, 70_000):  # uint16 and uint32 contexts
        for r in reqs:  # declare the ids in an earlier frame
            enc.encode(ev.Preempted(0, r))
        total = n = 0
        for k in range(50):
            records = [
                enc.encode(ev.Scheduled(k, r, base + k, 1, base + k, (rng.randrange(32000),)))
                for r in reqs
            ]
            payload = packer.pack([1000 + k, k, 1_700_000_000_000_000_000, records])
            total += len(payload) + 12  # frame: len, crc(len), payload, crc
            n += len(records)
        assert total / n <= 16, (base, total / n)


# --- decoding validates ---------------------------------------------------------------------


def _decoder(**overrides: Any) -> codec.Decoder:
    table = codec.schemas()
    table.update(overrides)
    return codec.Decoder(table, codec.transforms())


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([[4, "r", 1]], "Scheduled takes 2 to 6 fields after req_id, got 1"),
        ([[4, "r", 1, 2, 3, [], [], 0, 9]], "Scheduled takes 2 to 6 fields after req_id, got 7"),
        ([[4, "r", "1", 2]], "Scheduled.num_computed: expected int, got str"),
        ([[4, "r", True, 2]], "Scheduled.num_computed: expected int, got bool"),
        ([[4, "r", 1, 2, 0, [1, "x"]]], "Scheduled.token_ids: expected array of int, got array"),
        ([[4, "r", 1, 2, 0, [True]]], "Scheduled.token_ids: expected array of int"),
        ([[4, "r", 1, 2, 0, [], [], 7]], "Scheduled.admission: expected Admission, got int 7"),
        ([[7, "r", [b"k", 3]]], "SaveDone.keys: expected array of bytes"),
        ([[6, "r", b"stopped"]], "Finished.reason: expected str, got bytes"),
        ([[2, "r", 1, 2, 0, [], 1]], "LookupAsked.preempted: expected bool, got int"),
        ([[99, "r"]], "tag 99 is not in the header's schema table"),
        ([["4", "r"]], "tag must be an int"),
        ([[4]], "expected [tag, req_id, ...]"),
        (["x"], "record 0: expected an array, got str"),
        ([[5, 0]], "req ref 0 not declared (0 known)"),
        ([[5, "a"], [5, -1]], "record 1: req ref -1 not declared"),
        ([[5, "a"], [5, "a"]], "req_id 'a' declared twice"),
        ([[5, 1.5]], "req_id must be str or int, got float"),
        ([[5, "a"], [4, 0, 1, 2, 0, [None]]], "record 1: Scheduled.token_ids"),
        ("nope", "records: expected an array"),
    ],
)
def test_malformed_records_are_named(records: Any, message: str) -> None:
    with pytest.raises(codec.DecodeError) as info:
        _decoder().decode(3, records)
    assert message in str(info.value)


def test_header_problems_surface_when_a_record_of_that_tag_appears() -> None:
    table = codec.schemas()
    table[6] = ["Finished", 3, ["req_id", "reason", "detail"]]
    table[4] = ["Scheduled", 1, ["req_id", "num_computed"]]
    table[50] = ["FromTheFuture", 1, ["req_id"]]
    table[9] = "garbage"
    dec = codec.Decoder(table, {})
    dec.decode(1, [[5, "a"]])  # unaffected tags decode fine
    for record, message in [
        ([6, 0], "Finished v3 was written by a newer kvledger; this one reads up to v2"),
        ([4, 0, 1, 2], "the header declares fields ['req_id', 'num_computed']"),
        ([50, 0], "tag 50 (FromTheFuture v1) is unknown to this kvledger"),
        ([9, 0], "malformed schema entry"),
    ]:
        with pytest.raises(codec.DecodeError, match="record 0: ") as info:
            dec.decode(1, [record])
        assert message in str(info.value)
    with pytest.raises(codec.DecodeError, match="not an int"):
        codec.Decoder({"4": ["Scheduled", 1, ["req_id"]]})


def test_a_tag_declared_under_another_types_name_is_never_decoded_as_this_readers() -> None:
    """The header's type name counts, not only its tag: tag 4 declared as a type this reader
    does not know, or as another known type, is an error naming the tag, the declared name and
    the reader's; records of the tag are never read as ``Scheduled``."""
    scheduled = codec.schemas()[4][2]
    for declared, name in [
        (["Nope", 1, scheduled], "Nope"),
        (["Finished", 1, scheduled], "Finished"),
    ]:
        table = codec.schemas()
        table[4] = declared
        dec = codec.Decoder(table, codec.transforms())
        assert dec.decode(1, [[5, "a"]]) == (ev.Preempted(1, "a"),)  # other tags decode
        message = (
            f"tag 4 is declared as {name} v1 in the header; this kvledger's tag 4 is Scheduled"
        )
        with pytest.raises(codec.DecodeError, match="record 0: ") as info:
            dec.decode(2, [[4, 0, 10, 1, 0, [3]]])
        assert message in str(info.value)
        with pytest.raises(codec.DecodeError, match="record 0: ") as info:
            dec.resolve([[4, 0, 10, 1, 0, [3]]])  # raw records: refused too
        assert message in str(info.value)
    # Two tags swapped: neither is read as the other.
    table = codec.schemas()
    table[4], table[6] = ["Finished", 2, ["req_id", "reason"]], table[4]
    dec = codec.Decoder(table, codec.transforms())
    for record, message in [
        ([4, "a", "stopped"], "tag 4 is declared as Finished v2"),
        ([6, "b", 1, 1], "tag 6 is declared as Scheduled v1"),
    ]:
        with pytest.raises(codec.DecodeError, match=message):
            dec.decode(1, [record])


def test_header_transforms_are_honoured() -> None:
    # A segment written without the delta transform stores token_start as is.
    dec = codec.Decoder(codec.schemas(), {})
    (e,) = dec.decode(2, [[4, "r", 100, 1, 100, [5]]])
    assert e == ev.Scheduled(2, "r", 100, 1, 100, (5,))
    with pytest.raises(codec.DecodeError, match="unsupported field transform"):
        codec.Decoder(codec.schemas(), {4: {"token_start": ["xor", "num_computed"]}}).decode(
            1, [[4, "r", 1, 1]]
        )


def test_resolve_keeps_raw_fields_and_resolves_refs() -> None:
    dec = _decoder()
    raw = dec.resolve([[5, "a"], [4, 0, 10, 1, 0, [3]], [6, "b", "aborted"], [6, 0]])
    assert raw == [[5, "a"], [4, "a", 10, 1, 0, [3]], [6, "b", "aborted"], [6, "a"]]
    assert dec.req_ids == ["a", "b"]
    with pytest.raises(codec.DecodeError, match="tag 77"):
        dec.resolve([[77, 0]])
    with pytest.raises(codec.DecodeError, match="req ref 5"):
        dec.resolve([[5, 5]])


def test_encode_rejects_what_the_wire_cannot_carry() -> None:
    class NotAnEvent:
        step = 1
        req_id = "r"

    with pytest.raises(codec.EncodeError, match="not an event type"):
        codec.Encoder().encode(NotAnEvent())  # type: ignore[arg-type]
    with pytest.raises(codec.EncodeError, match="req_id"):
        codec.Encoder().encode(ev.Preempted(1, 5))  # type: ignore[arg-type]
    with pytest.raises(codec.EncodeError, match="cannot encode"):
        codec.Encoder().encode(ev.Scheduled(1, "r", None, 1, 3))  # type: ignore[arg-type]


# --- upcasters ------------------------------------------------------------------------------


def test_finished_v1_is_upcast_to_v2() -> None:
    table = codec.schemas()
    table[6] = ["Finished", 1, ["req_id", "aborted"]]
    dec = codec.Decoder(table, codec.transforms())
    events = dec.decode(9, [[6, "a", True], [6, "b", False], [6, "c"]])
    assert events == (
        ev.Finished(9, "a", "aborted"),
        ev.Finished(9, "b", "stopped"),
        ev.Finished(9, "c", "stopped"),
    )
    for bad, message in [
        ([6, 0, "yes"], "Finished v1.aborted: expected bool, got str"),
        ([6, 0, True, 1], "takes 0 to 1 fields after req_id, got 2"),
    ]:
        with pytest.raises(codec.DecodeError, match="record 0") as info:
            dec.decode(9, [bad])
        assert message in str(info.value)


def test_upcaster_chain_runs_in_order() -> None:
    assert codec.UPCASTERS[(6, 1)]([True]) == ["aborted"]
    assert codec.UPCASTERS[(6, 1)]([]) == ["stopped"]


class _FakeV3(ev.InputEvent):  # not registered anywhere: only its TAG/VERSION are read
    TAG: ClassVar[int] = 90
    VERSION: ClassVar[int] = 3


class _FakeV1(ev.InputEvent):
    TAG: ClassVar[int] = 91


def test_upcaster_gap_check() -> None:
    ok: dict[tuple[int, int], codec.Upcaster] = {(90, 1): list, (90, 2): list}
    codec.check_upcasters([_FakeV3, _FakeV1], ok)
    with pytest.raises(
        codec.SchemaError, match=r"_FakeV3 \(tag 90\) is at version 3 .* from version 2 to 3"
    ):
        codec.check_upcasters([_FakeV3], {(90, 1): list})
    with pytest.raises(codec.SchemaError, match="from version 1 to 2"):
        codec.check_upcasters([_FakeV3], {(90, 2): list})
    with pytest.raises(codec.SchemaError, match="names no known event tag"):
        codec.check_upcasters([_FakeV1], {(90, 1): list})
    with pytest.raises(codec.SchemaError, match=r"version must be in 1\.\.2"):
        codec.check_upcasters([_FakeV3], {**ok, (90, 3): list})
    # the real table passes (it also ran at import)
    codec.check_upcasters(ev.EVENT_TYPES, codec.UPCASTERS)


def test_generated_functions_are_inspectable() -> None:
    source = codec.generated_source(ev.Scheduled)
    assert "def encode(e, refs):" in source
    assert "def decode(step, rid, rec, n):" in source
