"""The value a tier stores for a chunk: its bytes, bound to what they are.

A checksum proves that bytes were not damaged; it does not prove that they belong to the
chunk asked for. A value swapped between two keys (an operator's ``RENAME``, a buggy client,
a file copied over another), written by an engine of another KV layout, or written by a
tenant who may write to the shared tier, is well formed. So every value names what it is, and
the reader checks that against what it asked for before a byte of it is loaded.

The worker seals a value before ``Tier.put`` and opens it after ``Tier.get``
(``connector/worker.py``): a tier stores and returns the value verbatim and never sees the
check, so no tier, Redis, ``file://`` or a plug-in, can forget it (design note 21).

A value is a header, then the chunk's bytes::

    fixed   b"KVL2" | flags u8 | digest mode u8 | digests u16 | rank u32 | chunk key 16s
            | layout 16s | payload length u64 | piece size u32 | pieces u32
    checks  per piece: CRC-32 (u32), or SHA-256 truncated to 16 bytes when keyed
    digests (block key 16s, digest i64) each: the saver's KV-content digests of the chunk's
            blocks (``digests`` on; tracker/digests.py), which the loader's log judges by
    tag     CRC-32 of everything above (u32), or, keyed, its HMAC-SHA256 (32 bytes)

- **Bound.** ``key``, ``rank`` and ``layout`` (a fingerprint of the salt the chunk keys name:
  model, layers, heads, dtype, parallelism, pool format; and of the pool's chunk shape) must be
  the reader's, or the value is refused: ``misplaced`` (another chunk's), ``wrong_rank``,
  ``wrong_layout``. A swapped value is a recorded miss, never a load.
- **Keyed.** With a secret (``remote_secret_file`` / ``remote_secret_env``) the pieces are
  hashed with SHA-256 (the hash CPUs accelerate: about twice BLAKE2b's speed on one with
  SHA extensions) and the header carries an HMAC-SHA256 under the secret: only
  an engine holding the secret writes values that others load. A reader with a secret
  refuses a value without a MAC, or with a wrong one; a reader without one refuses a keyed
  value it cannot verify (``unauthenticated``). Threat model: docs/remote.md.
- **Versioned.** A value of another format (``KVL1``, written before values were bound, or
  not a kvledger value) is ``format``: a miss. The tiers also name their keys by the format
  (``kvledger:v2:...``, ``*.kvl2``), so an upgraded engine does not even find the old ones.

The reasons are one line each (``tracker/remote.py`` names the ones that say "not this
chunk's": :data:`tracker.remote.FOREIGN_REASONS`). Checks are computed on a few threads
(zlib and hashlib release the GIL), a piece of ``PIECE_BYTES`` each, while the payload is on
the wire where the tier can (``Sealed.head`` waits for them).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.tracker.remote import (
    FORMAT,
    MISPLACED,
    UNAUTHENTICATED,
    WRONG_LAYOUT,
    WRONG_RANK,
)

__all__ = [
    "MAGIC",
    "PIECE_BYTES",
    "Opened",
    "Sealed",
    "ValueSeal",
    "layout_fingerprint",
    "read_secret",
]

MAGIC = b"KVL2"
PIECE_BYTES = 4 << 20
MIN_SECRET_BYTES = 16
_FIXED = struct.Struct("<4sBBHI16s16sQII")
_DIGEST = struct.Struct("<16sq")
_KEYED = 1
_MODES = {"off": 0, "sampled": 1, "full": 2}
_CRC = struct.Struct("<I")
_MAC_BYTES = 32
_HASH_BYTES = 16
_MAX_DIGESTS = 0xFFFF
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvledger-seal")


class Sealed(NamedTuple):
    """A value to store: ``head()`` (``head_len`` bytes; it waits for the pieces' checks,
    computed on threads from the moment the value was sealed), then ``payload``. A tier
    that can send the payload first writes ``head_len`` zeros and the head over them."""

    payload: memoryview
    head_len: int
    head: Callable[[], bytes]

    def to_bytes(self) -> bytes:
        """The whole value in one buffer (a copy of the payload: tiers that cannot scatter)."""
        return self.head() + bytes(self.payload)


class Opened(NamedTuple):
    """A value that passed every check: the chunk's bytes, and the saver's digests of its
    blocks (block key, digest), if it carried any of this reader's digest mode."""

    payload: memoryview
    digests: tuple[tuple[bytes, int], ...] = ()


def layout_fingerprint(*parts: object) -> bytes:
    """16 bytes naming a KV layout: what a chunk's bytes mean (the chunk keys' salt, the pool
    format, dtype and chunk shape). Two engines whose bytes differ in meaning never match."""
    text = "\x1f".join(map(str, parts)).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvledger-layout").digest()


def read_secret(config: ConnectorConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared tier's secret, from ``remote_secret_file`` or the variable
    ``remote_secret_env`` names (None: neither set). Errors name the key and never show the
    secret: a file that cannot be read, a variable unset, or fewer than 16 bytes."""
    environ = os.environ if environ is None else environ
    if config.remote_secret_file is not None:
        where = f"remote_secret_file {config.remote_secret_file!r}"
        try:
            with open(config.remote_secret_file, "rb") as f:
                secret = f.read(1 << 16)
        except OSError as exc:
            raise ConnectorConfigError(
                f"{where} cannot be read: {type(exc).__name__}: {exc.strerror or exc}"
            ) from None
    elif config.remote_secret_env is not None:
        where = f"remote_secret_env {config.remote_secret_env!r}"
        if config.remote_secret_env not in environ:
            raise ConnectorConfigError(f"{where}: the variable is not set in this process")
        secret = environ[config.remote_secret_env].encode()
    else:
        return None
    secret = secret.strip()  # a file written by `echo` ends in a newline
    if len(secret) < MIN_SECRET_BYTES:
        raise ConnectorConfigError(
            f"{where}: the secret is shorter than {MIN_SECRET_BYTES} bytes (has {len(secret)}); "
            "make one with: head -c 32 /dev/urandom | base64"
        )
    return secret


def _pieces(payload: memoryview) -> list[memoryview]:
    n = len(payload)
    return [payload[i : i + PIECE_BYTES] for i in range(0, n, PIECE_BYTES)] or [payload]


def _crc(piece: memoryview) -> bytes:
    return _CRC.pack(zlib.crc32(piece))


def _hash(piece: memoryview) -> bytes:
    return hashlib.sha256(piece).digest()[:_HASH_BYTES]


def _checks(payload: memoryview, check: Callable[[memoryview], bytes]) -> list[Future[bytes]]:
    pieces = _pieces(payload)
    if len(pieces) == 1:
        done: Future[bytes] = Future()
        done.set_result(check(pieces[0]))
        return [done]
    return [_POOL.submit(check, p) for p in pieces]


def _piece_count(length: int) -> int:
    return max(1, -(-length // PIECE_BYTES))


class ValueSeal:
    """Seals and opens the values of one worker rank: its ``rank``, its ``layout``
    fingerprint, the tier's ``secret`` (None: checksums only) and its digest mode."""

    def __init__(
        self, *, rank: int, layout: bytes, secret: bytes | None = None, digests: str = "off"
    ) -> None:
        if len(layout) != 16:
            raise ValueError(f"a layout fingerprint is 16 bytes, got {len(layout)}")
        self.rank = rank
        self.layout = layout
        self.mode = _MODES[digests]
        self._mac_key = secret
        self.keyed = secret is not None
        self._check = _hash if self.keyed else _crc
        self._check_bytes = _HASH_BYTES if self.keyed else _CRC.size
        self._tag_bytes = _MAC_BYTES if self.keyed else _CRC.size

    def __repr__(self) -> str:  # never the secret
        return f"ValueSeal(rank={self.rank}, keyed={self.keyed}, digests={self.mode})"

    def _tag(self, head: bytes) -> bytes:
        if self._mac_key is None:
            return _CRC.pack(zlib.crc32(head))
        return hmac.new(self._mac_key, head, "sha256").digest()

    def seal(
        self, key: bytes, payload: memoryview, digests: Sequence[tuple[bytes, int]] = ()
    ) -> Sealed:
        """The value of chunk ``key``: the pieces' checks start on the threads now."""
        if len(key) != 16:
            raise ValueError(f"a chunk key is 16 bytes, got {len(key)}")
        digests = tuple(digests)[:_MAX_DIGESTS] if self.mode else ()
        checks = _checks(payload, self._check)
        fixed = _FIXED.pack(
            MAGIC,
            _KEYED if self.keyed else 0,
            self.mode if digests else 0,
            len(digests),
            self.rank,
            key,
            self.layout,
            len(payload),
            PIECE_BYTES,
            len(checks),
        )
        carried = b"".join(_DIGEST.pack(k, d) for k, d in digests)
        head_len = len(fixed) + len(checks) * self._check_bytes + len(carried) + self._tag_bytes

        def head() -> bytes:
            body = fixed + b"".join(f.result() for f in checks) + carried
            return body + self._tag(body)

        return Sealed(payload, head_len, head)

    def open(self, key: bytes, value: bytes | memoryview, expected_len: int) -> Opened | str:
        """The chunk's bytes if ``value`` is chunk ``key``'s, of this rank and layout, whole
        and (keyed) authentic; else why not, one line."""
        view = memoryview(value)
        if len(view) < _FIXED.size:
            return FORMAT if bytes(view[:4]) != MAGIC[: len(view[:4])] else "length"
        magic, flags, mode, count, rank, stored_key, layout, length, piece, pieces = (
            _FIXED.unpack_from(view)
        )
        if magic != MAGIC:
            return (
                f"{FORMAT}: not a {MAGIC.decode()} value (an older kvledger's, or not kvledger's)"
            )
        keyed = bool(flags & _KEYED)
        check_bytes = _HASH_BYTES if keyed else _CRC.size
        tag_bytes = _MAC_BYTES if keyed else _CRC.size
        body_len = _FIXED.size + pieces * check_bytes + count * _DIGEST.size
        if (
            piece != PIECE_BYTES
            or pieces != _piece_count(length)
            or len(view) != body_len + tag_bytes + length
        ):
            return "length"
        if keyed != self.keyed:
            return (
                f"{UNAUTHENTICATED}: written without the secret"
                if self.keyed
                else f"{UNAUTHENTICATED}: written with a secret this engine does not hold"
            )
        body = view[:body_len]
        tag = bytes(view[body_len : body_len + tag_bytes])
        if not hmac.compare_digest(self._tag(bytes(body)), tag):
            return f"{UNAUTHENTICATED}: its MAC does not match" if keyed else "checksum"
        # Only now are the header's fields known to be as written: judge what they say.
        if stored_key != key:
            return f"{MISPLACED}: the value of chunk {stored_key.hex()}"
        if rank != self.rank:
            return f"{WRONG_RANK}: worker rank {rank}'s share"
        if layout != self.layout:
            return f"{WRONG_LAYOUT}: written under another KV layout ({layout.hex()[:12]})"
        if length != expected_len:
            return "length"
        payload = view[body_len + tag_bytes :]
        checks = b"".join(f.result() for f in _checks(payload, self._check))
        if checks != bytes(view[_FIXED.size : _FIXED.size + pieces * check_bytes]):
            return f"{UNAUTHENTICATED}: its bytes do not match its MAC" if keyed else "checksum"
        carried: tuple[tuple[bytes, int], ...] = ()
        if count and mode and mode == self.mode:  # a reader with digests off takes none
            start = _FIXED.size + pieces * check_bytes
            carried = tuple(_DIGEST.iter_unpack(view[start : start + count * _DIGEST.size]))
        return Opened(payload, carried)
