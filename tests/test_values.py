"""The value a tier stores (``connector/values.py``): whole, bound to its chunk key, rank and
KV layout, and, with a secret, authenticated. Properties over any payload and any damage:
a value opens only as exactly the bytes sealed, for exactly the chunk, rank and layout it was
sealed for; everything else is a reason, never bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.connector.values import (
    PIECE_BYTES,
    Opened,
    ValueSeal,
    layout_fingerprint,
    read_secret,
)
from kvledger.tracker.remote import FOREIGN_REASONS, foreign

LAYOUT = layout_fingerprint("model|2L|2x16:torch.float16|tp1r0", "tokens")
OTHER_LAYOUT = layout_fingerprint("model|2L|2x16:torch.bfloat16|tp1r0", "tokens")
SECRET = b"a shared secret of 32 bytes....."
keys = st.binary(min_size=16, max_size=16)


def _value(seal: ValueSeal, key: bytes, payload: bytes, digests: tuple = ()) -> bytes:
    return seal.seal(key, memoryview(payload), digests).to_bytes()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["checksums", "keyed"])
@given(payload=st.binary(min_size=1, max_size=512), key=keys, data=st.data())
def test_any_truncation_or_flipped_bit_is_refused(
    secret: bytes | None, payload: bytes, key: bytes, data: st.DataObject
) -> None:
    seal = ValueSeal(rank=0, layout=LAYOUT, secret=secret)
    value = _value(seal, key, payload)
    opened = seal.open(key, value, len(payload))
    assert isinstance(opened, Opened) and bytes(opened.payload) == payload
    cut = data.draw(st.integers(0, len(value) - 1))
    assert isinstance(seal.open(key, value[:cut], len(payload)), str)
    at = data.draw(st.integers(0, len(value) - 1))
    flipped = bytearray(value)
    flipped[at] ^= 1 << data.draw(st.integers(0, 7))
    assert isinstance(seal.open(key, bytes(flipped), len(payload)), str)
    assert seal.open(key, value, len(payload) + 1) == "length"


@given(payload=st.binary(min_size=1, max_size=256), key=keys, other=keys)
def test_a_value_opens_only_for_its_own_key_rank_and_layout(
    payload: bytes, key: bytes, other: bytes
) -> None:
    seal = ValueSeal(rank=0, layout=LAYOUT)
    value = _value(seal, key, payload)
    if other != key:  # swapped between keys: named, with the chunk it belongs to
        assert seal.open(other, value, len(payload)) == f"misplaced: the value of chunk {key.hex()}"
    why = ValueSeal(rank=1, layout=LAYOUT).open(key, value, len(payload))
    assert why == "wrong_rank: worker rank 0's share"
    why = ValueSeal(rank=0, layout=OTHER_LAYOUT).open(key, value, len(payload))
    assert isinstance(why, str) and why.startswith("wrong_layout: ")


def test_with_a_secret_only_values_signed_with_it_open() -> None:
    key, payload = b"k" * 16, os.urandom(1000)
    keyed = ValueSeal(rank=0, layout=LAYOUT, secret=SECRET)
    plain = ValueSeal(rank=0, layout=LAYOUT)
    stranger = ValueSeal(rank=0, layout=LAYOUT, secret=b"another secret, 32 bytes long..")
    assert keyed.open(key, _value(plain, key, payload), 1000) == (
        "unauthenticated: written without the secret"
    )
    assert stranger.open(key, _value(keyed, key, payload), 1000) == (
        "unauthenticated: its MAC does not match"
    )
    assert plain.open(key, _value(keyed, key, payload), 1000) == (
        "unauthenticated: written with a secret this engine does not hold"
    )
    assert isinstance(keyed.open(key, _value(keyed, key, payload), 1000), Opened)
    assert "secret" not in repr(keyed) and SECRET.decode() not in repr(keyed)


def test_a_writer_without_the_secret_cannot_forge_a_keyed_value() -> None:
    """The strongest forger without the secret: it knows the format, takes a valid keyed
    value and rewrites the payload and its piece hashes; the MAC covers them."""
    import hashlib

    key, payload = b"k" * 16, bytes(1000)
    keyed = ValueSeal(rank=0, layout=LAYOUT, secret=SECRET)
    value = bytearray(_value(keyed, key, payload))
    forged = b"\x01" * 1000
    value[-1000:] = forged
    start = 4 + 1 + 1 + 2 + 4 + 16 + 16 + 8 + 4 + 4
    value[start : start + 16] = hashlib.sha256(forged).digest()[:16]
    assert keyed.open(key, bytes(value), 1000) == "unauthenticated: its MAC does not match"


def test_a_payload_of_several_pieces_is_checked_piece_by_piece() -> None:
    payload = os.urandom(2 * PIECE_BYTES + 17)
    for secret in (None, SECRET):
        seal = ValueSeal(rank=0, layout=LAYOUT, secret=secret)
        value = bytearray(_value(seal, b"m" * 16, payload))
        assert bytes(seal.open(b"m" * 16, bytes(value), len(payload)).payload) == payload  # type: ignore[union-attr]
        value[-1] ^= 0xFF  # the last piece
        why = seal.open(b"m" * 16, bytes(value), len(payload))
        assert why == (
            "checksum" if secret is None else "unauthenticated: its bytes do not match its MAC"
        )


def test_an_older_format_or_anything_else_is_a_format_miss() -> None:
    seal = ValueSeal(rank=0, layout=LAYOUT)
    old = b"KVL1" + bytes(60)  # what kvledger wrote before values were bound
    for value in (old, b"not a value at all, some other client's", b"XY"):
        why = seal.open(b"k" * 16, value, 100)
        assert isinstance(why, str) and why.startswith("format"), why
        assert foreign(why)


def test_digests_travel_with_the_value_for_a_reader_of_the_same_mode() -> None:
    digests = ((b"a" * 16, -5), (b"b" * 16, 1 << 62))
    saver = ValueSeal(rank=0, layout=LAYOUT, digests="sampled")
    value = _value(saver, b"k" * 16, b"x" * 64, digests)
    opened = saver.open(b"k" * 16, value, 64)
    assert isinstance(opened, Opened) and opened.digests == digests
    full = ValueSeal(rank=0, layout=LAYOUT, digests="full").open(b"k" * 16, value, 64)
    assert isinstance(full, Opened) and full.digests == ()  # not comparable: not carried
    off = ValueSeal(rank=0, layout=LAYOUT)
    assert _value(off, b"k" * 16, b"x" * 64, digests) == _value(off, b"k" * 16, b"x" * 64)


def test_every_foreign_reason_is_named_by_the_core() -> None:
    for reason in FOREIGN_REASONS:
        assert foreign(f"{reason}: detail") and foreign(reason)
    for reason in ("missing", "length", "checksum", "refused: x", "unavailable: y"):
        assert not foreign(reason)


def test_the_secret_comes_from_a_file_or_the_environment_and_is_never_shown(
    tmp_path: Path,
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    url = {"remote_url": "redis://127.0.0.1:1/0"}
    config = ConnectorConfig.from_extra_config({**url, "remote_secret_file": str(path)})
    assert read_secret(config) == SECRET
    config = ConnectorConfig.from_extra_config({**url, "remote_secret_env": "KVL_SECRET"})
    assert read_secret(config, {"KVL_SECRET": SECRET.decode()}) == SECRET
    with pytest.raises(ConnectorConfigError, match=r"KVL_SECRET.*not set"):
        read_secret(config, {})
    path.write_bytes(b"short")
    config = ConnectorConfig.from_extra_config({**url, "remote_secret_file": str(path)})
    with pytest.raises(ConnectorConfigError, match="shorter than 16 bytes") as info:
        read_secret(config)
    assert "short'" not in str(info.value)
    with pytest.raises(ConnectorConfigError, match="cannot be read"):
        read_secret(attrs_evolve(config, remote_secret_file=str(tmp_path / "none")))
    with pytest.raises(ConnectorConfigError, match="both set"):
        ConnectorConfig.from_extra_config(
            {**url, "remote_secret_file": str(path), "remote_secret_env": "X"}
        )
    with pytest.raises(ConnectorConfigError, match="remote_url is not"):
        ConnectorConfig.from_extra_config({"remote_secret_env": "X"})


def attrs_evolve(config: ConnectorConfig, **changes: object) -> ConnectorConfig:
    import attrs

    return attrs.evolve(config, **changes)
