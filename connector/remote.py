"""The remote chunk tier: chunk bytes in a Redis server, shared by every engine that uses it.

Rule of this module: it moves bytes to and from the server and says what happened; it decides
nothing. Which chunks a lookup may count on is the tracker's decision, made from the facts the
connector records (``tracker/remote.py``): which keys a lookup found, which writes the server
confirmed, which reads came back missing, short or corrupt, when the server went away.

The value of a chunk is a header then the chunk's bytes::

    b"KVL1" | payload length (u64) | piece size (u32) | pieces (u32) | crc32 of each piece (u32)

A value whose length, header or any piece's checksum does not match is refused: a load
failure, never wrong KV. The checksum is CRC-32 over pieces of ``PIECE_BYTES``, computed on a
few threads at once (zlib releases the GIL), so that a 32 MiB chunk costs a few milliseconds,
not the twenty a single CRC-32 over it takes, and while the payload is on the wire. A value
is written to a temporary key (``SET`` of a zeroed header and the payload, sent from the host
slot without a copy; ``SETRANGE`` of the header once the checksums are known) and published
by ``RENAME``: a reader sees the whole value or none (``RemoteStore.put``).

Keys: ``kvledger:<chunk key hex>:<rank>``. The chunk key already names the model, the KV
layout and the request's cache salt; the rank separates the shares of a chunk that each
tensor-parallel worker holds.

Failures: a connection that is refused, reset or times out raises ``RemoteUnavailable``, and
the store backs off (``retry_s``, doubling up to ``MAX_BACKOFF_S``) before it tries again:
meanwhile ``available()`` is False and the connector serves from the host pool alone. A
server that refuses the credentials is ``ConnectorConfigError`` at startup, naming
``remote_url``.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from connector.config import ConnectorConfig, ConnectorConfigError

__all__ = [
    "MISSING",
    "RemoteStore",
    "RemoteUnavailable",
    "decode_value",
    "encode_header",
    "redacted",
    "remote_key",
]

MAGIC = b"KVL1"
_HEAD = struct.Struct("<4sQII")
PIECE_BYTES = 4 << 20
MAX_BACKOFF_S = 30.0
# A write's temporary key expires after this long should its RENAME never come.
_TEMP_TTL_S = 300
MISSING = "missing"
_CRC_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvledger-crc")


class RemoteUnavailable(Exception):
    """The server did not answer (refused, reset, timed out)."""


def remote_key(key: bytes, rank: int) -> bytes:
    return b"kvledger:%s:%d" % (key.hex().encode(), rank)


def redacted(url: str) -> str:
    """``url`` with its password replaced, for errors and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _pieces(payload: memoryview) -> list[memoryview]:
    n = len(payload)
    return [payload[i : i + PIECE_BYTES] for i in range(0, n, PIECE_BYTES)] or [payload]


def _crcs(payload: memoryview) -> list[int]:
    pieces = _pieces(payload)
    if len(pieces) == 1:
        return [zlib.crc32(pieces[0])]
    return list(_CRC_POOL.map(zlib.crc32, pieces))


def _header(length: int, crcs: Sequence[int]) -> bytes:
    return _HEAD.pack(MAGIC, length, PIECE_BYTES, len(crcs)) + struct.pack(f"<{len(crcs)}I", *crcs)


def encode_header(payload: memoryview) -> bytes:
    """The header stored before ``payload``: its length and the CRC-32 of each piece."""
    return _header(len(payload), _crcs(payload))


def _set_command(
    name: bytes, payload: memoryview, pieces: int, ttl_s: int
) -> list[bytes | memoryview]:
    """``SET name <zeroed header><payload> [EX ttl_s]`` in RESP, as buffers sent one after
    the other: the payload is not copied into one value with its header."""
    value_len = _HEAD.size + 4 * pieces + len(payload)
    args: list[bytes] = [b"SET", name]
    tail: list[bytes] = [b"EX", str(ttl_s).encode()] if ttl_s else []
    out: list[bytes | memoryview] = [b"*%d\r\n" % (3 + len(tail))]
    out += [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
    out += [b"$%d\r\n" % value_len, bytes(_HEAD.size + 4 * pieces), payload, b"\r\n"]
    out += [b"$%d\r\n%s\r\n" % (len(a), a) for a in tail]
    return out


def decode_value(value: bytes | None, expected_len: int) -> memoryview | str:
    """The payload of a stored value, or why it cannot be used: ``missing`` (no such key),
    ``length`` (a header or payload of the wrong length), ``checksum`` (wrong bytes)."""
    if value is None:
        return MISSING
    view = memoryview(value)
    if len(view) < _HEAD.size:
        return "length"
    magic, length, piece, count = _HEAD.unpack_from(view)
    head = _HEAD.size + 4 * count
    if (
        magic != MAGIC
        or length != expected_len
        or piece != PIECE_BYTES
        or count != max(1, -(-length // PIECE_BYTES))
        or len(view) != head + length
    ):
        return "length"
    payload = view[head:]
    if list(struct.unpack_from(f"<{count}I", view, _HEAD.size)) != _crcs(payload):
        return "checksum"
    return payload


class RemoteStore:
    """One client of the server, with its bounds: ``timeout_s`` for every command (connect
    included), and a back-off after a failure during which nothing is sent."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retry_s: float,
        ttl_s: int = 0,
        rank: int = 0,
        client: Any = None,
    ) -> None:
        self.url = url
        self.rank = rank
        self.ttl_s = ttl_s
        self._retry_s = retry_s
        self._backoff = retry_s
        self._next_try = 0.0
        if client is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:  # pragma: no cover - the `remote` extra is not installed
                raise ConnectorConfigError(
                    "remote_url needs the redis client: pip install 'kvledger[remote]'"
                ) from None
            # No retries inside the client: one bounded attempt, then our back-off.
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        self.client = client

    @classmethod
    def from_config(cls, config: ConnectorConfig, *, rank: int = 0, scheduler: bool) -> RemoteStore:
        assert config.remote_url is not None
        timeout_ms = config.remote_lookup_timeout_ms if scheduler else config.remote_timeout_ms
        return cls(
            config.remote_url,
            timeout_s=timeout_ms / 1000,
            retry_s=config.remote_retry_ms / 1000,
            ttl_s=config.remote_ttl_s,
            rank=rank,
        )

    # --- availability ----------------------------------------------------------------------

    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._next_try

    def _failed(self) -> None:
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _ok(self) -> None:
        self._backoff = self._retry_s
        self._next_try = 0.0

    def _call(self, fn: Any) -> Any:
        import redis

        try:
            result = fn()
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
            raise ConnectorConfigError(
                f"remote_url {redacted(self.url)}: the server refused the credentials ({exc})"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._failed()
            raise RemoteUnavailable(f"{type(exc).__name__}: {exc}") from None
        except redis.ResponseError as exc:
            if str(exc).startswith(("NOAUTH", "WRONGPASS")):
                raise ConnectorConfigError(
                    f"remote_url {redacted(self.url)}: the server refused the credentials ({exc})"
                ) from None
            raise
        self._ok()
        return result

    def check(self) -> str | None:
        """Startup: None if the server answers; why not if it cannot be reached. Bad
        credentials raise ``ConnectorConfigError``."""
        try:
            self._call(self.client.ping)
        except RemoteUnavailable as exc:
            return str(exc)
        return None

    # --- commands ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        """1 for each key the server holds, else 0: one round trip."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(remote_key(key, self.rank))
            return list(pipe.execute())

        return [1 if n else 0 for n in self._call(run)]

    def put(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Write every (key, payload), each with its header, published atomically: one
        round trip. Returns once the server confirmed them all.

        The checksums are computed on the CRC threads while the payloads are on the wire,
        not before: each value goes out as a zeroed header then its payload (one ``SET`` to a
        temporary key, sent from the host slot without a copy), a ``SETRANGE`` writes the
        header over the zeros once its checksums are known, and a ``RENAME`` publishes it
        under its key: no reader ever sees the zeroed header. (``MULTI``/``EXEC`` would be
        atomic too, but inside a transaction the ``SETRANGE`` copies the whole value: half
        the throughput.) The temporary key expires on its own should the connection die
        before the ``RENAME``."""
        crcs = [[_CRC_POOL.submit(zlib.crc32, p) for p in _pieces(payload)] for _, payload in items]
        names = [remote_key(key, self.rank) for key, _ in items]
        temps = [b"%s:tmp:%s" % (name, os.urandom(8).hex().encode()) for name in names]

        def run() -> list[Any]:
            pool = self.client.connection_pool
            conn = pool.get_connection("SET")
            try:
                for (_, payload), futures, temp in zip(items, crcs, temps, strict=True):
                    conn.send_packed_command(_set_command(temp, payload, len(futures), _TEMP_TTL_S))
                for (_, payload), futures, temp, name in zip(
                    items, crcs, temps, names, strict=True
                ):
                    header = _header(len(payload), [f.result() for f in futures])
                    ttl = ("EXPIRE", name, self.ttl_s) if self.ttl_s else ("PERSIST", name)
                    conn.send_packed_command(
                        conn.pack_commands(
                            [("SETRANGE", temp, 0, header), ("RENAME", temp, name), ttl]
                        )
                    )
                # An error reply (a RENAME whose temporary key the server evicted) raises.
                return [conn.read_response() for _ in range(4 * len(items))]
            except BaseException:
                conn.disconnect()  # a half-read reply stream must not go back to the pool
                raise
            finally:
                pool.release(conn)

        self._call(run)

    def get(self, keys: Sequence[bytes], expected_len: int) -> list[memoryview | str]:
        """Each key's verified payload, or why it cannot be used (``decode_value``)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(remote_key(key, self.rank))
            return list(pipe.execute())

        return [decode_value(v, expected_len) for v in self._call(run)]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a dead connection: nothing left to close
            self.client.close()
