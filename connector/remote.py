"""The Redis tier: chunk bytes in a Redis server, shared by every engine that uses it.

``RemoteStore`` is the ``connector.tiers.Tier`` that a Redis ``remote_url`` opens; the
scheduler and worker sides reach it only through that interface.

Rule of this module: it moves bytes to and from the server and says what happened; it decides
nothing. Which chunks a lookup may count on is the tracker's decision, made from the facts the
connector records (``tracker/remote.py``): which keys a lookup found, which writes the server
confirmed, which reads came back missing, short, corrupt or refused, when the server went away.

A value is stored verbatim as the worker sealed it (``connector/values.py``: a header that
binds it to its chunk key, rank and KV layout, with its checksums, then the chunk's bytes); the
worker checks what ``get`` returns. A value is written to a temporary key (``SET`` of a zeroed
header and the payload, sent from the host slot without a copy, while the header's checksums
are computed on threads; ``SETRANGE`` of the header once they are known) and published by
``RENAME``: a reader sees the whole value or none (``RemoteStore.put``).

Keys: ``kvledger:v2:<chunk key hex>:<rank>``. The chunk key already names the model, the KV
layout and the request's cache salt; the rank separates the shares of a chunk that each
tensor-parallel worker holds; ``v2`` the value format (an engine of an earlier format, whose
keys were ``kvledger:<hex>:<rank>``, and this one never read each other's values).

Failures. Nothing the client raises leaves this module but ``RemoteUnavailable`` (and
``ConnectorConfigError`` at startup): every error of redis-py, and anything unforeseen, is
caught at the store's boundary and reported as ``Type: message``, the URL's credentials
scrubbed from it, its length bounded. Two kinds (docs/remote.md, "What each error becomes"):

- the server is not serving us: whatever the call raised (a refused, reset or timed-out
  connection, a reply that is not RESP or not of the shape its command returns, a server
  loading its data set, refused credentials, anything unforeseen), and any error reply to
  ``EXISTS`` or ``PING``, which do not depend on a key's value. ``RemoteUnavailable``: the
  store drops its connections (none goes back to the pool out of step) and backs off
  (``retry_s``, doubling up to ``MAX_BACKOFF_S``); meanwhile ``available()`` is False and the
  connector serves from the host pool alone;
- this chunk is bad: an error reply to one chunk's own command (``WRONGTYPE`` to its ``GET``,
  when a ``kvledger:*`` key holds a list, say; out of memory or a read-only replica to its
  write). That chunk's read or write fails, ``refused: <error>``; the call's other chunks and
  the server are unaffected.

A server that answers but refuses the credentials or the database at startup is
``ConnectorConfigError`` naming ``remote_url``; later it is an outage like any other.

Bounds: every read, write and connect by ``timeout_s``; on vLLM's scheduler thread, each
whole exchange too (``bounded``: its sockets are ``_BoundedSocket``s), so that no server,
however it spreads its replies, holds a lookup past its bound. None of them can be set from
the URL: redis-py is given the URL's host, port, database, credentials and client name, and
the bounds after them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

from kvledger.connector.config import (
    ConnectorConfig,
    ConnectorConfigError,
    check_redis_url,
    redacted,
)
from kvledger.connector.tiers import MISSING, REFUSED, UNAVAILABLE, TierUnavailable

if TYPE_CHECKING:
    from kvledger.connector.values import Sealed

__all__ = [
    "MISSING",
    "REFUSED",
    "TIER_COMMANDS",
    "UNAVAILABLE",
    "RemoteStore",
    "RemoteUnavailable",
    "UnexpectedReply",
    "describe",
    "remote_key",
]

MAX_BACKOFF_S = 30.0
# A write's temporary key expires after this long should its RENAME never come.
_TEMP_TTL_S = 300
# Every command the tier sends, connecting included (redis-py's handshake: AUTH with a
# password, CLIENT SETINFO, SELECT for a database other than 0, CLIENT SETNAME with a
# client_name). tests/test_remote_standin.py fails each of them every way a server can, and
# fails should the tier send one not listed here.
TIER_COMMANDS = (
    "AUTH",
    "CLIENT",
    "SELECT",
    "PING",
    "EXISTS",
    "GET",
    "SET",
    "SETRANGE",
    "RENAME",
    "EXPIRE",
    "PERSIST",
)
_MESSAGE_CHARS = 300  # a hostile server's error text is kept, bounded
# The connection settings a checked URL gives redis-py (connector/config.py refuses the rest).
_URL_KWARGS = frozenset(
    {"client_name", "connection_class", "db", "host", "password", "path", "port", "username"}
)


class RemoteUnavailable(TierUnavailable):
    """The server is not serving us; the message is ``Type: message`` of the cause.
    ``refused``: it answered, but refused ``"the credentials"`` or ``"the connection"`` (the
    database, the command); at startup, a configuration error."""

    def __init__(self, message: str, *, refused: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused


class UnexpectedReply(Exception):
    """A reply of a shape its command never returns: the peer does not speak Redis."""


def remote_key(key: bytes, rank: int) -> bytes:
    return b"kvledger:v2:%s:%d" % (key.hex().encode(), rank)


def _secrets(url: str) -> tuple[str, ...]:
    """The URL's credentials in each form a message could echo them in: as written, decoded,
    percent-encoded, and escaped as in a bytes repr; longest first."""
    try:
        parts = urlsplit(url)
        found = [p for p in (parts.password, parts.username) if p]
    except ValueError:
        return ()
    forms: set[str] = set()
    for raw in found:
        for text in (raw, unquote(raw)):
            forms.update((text, quote(text, safe=""), repr(text.encode())[2:-1]))
    return tuple(sorted(forms, key=len, reverse=True))


def describe(exc: BaseException, secrets: Sequence[str] = ()) -> str:
    """``Type: message`` of an exception, fit for the log: ``secrets`` scrubbed, one line,
    bounded."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    for secret in secrets:
        text = text.replace(secret, "***")
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _refused(exc: BaseException) -> str | None:
    """The server answered and refused us: credentials, permission, or a plain ``ERR`` (an
    out-of-range database, an unknown command). Transient states (``LOADING``, ``BUSY``,
    ``MASTERDOWN``, ...) have codes of their own and are not refusals."""
    try:
        from redis import exceptions as rx
    except ImportError:  # pragma: no cover - a client given without redis-py
        return None
    authorization = getattr(rx, "AuthorizationError", rx.AuthenticationError)  # redis-py 6+
    if isinstance(exc, (rx.AuthenticationError, authorization, rx.NoPermissionError)):
        return "the credentials"
    if type(exc) is rx.ResponseError and getattr(exc, "status_code", "ERR") == "ERR":
        return "the connection"
    return None


class _Deadline:
    """When the current exchange must be over (``time.monotonic()``); None: no bound."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None


class _BoundedSocket:
    """A connection's socket whose every read and write ends by the exchange's deadline, so
    that the whole exchange is bounded, not each read: a server that answers each of a
    lookup's replies (or the handshake's) just under the timeout, or drips them a byte at a
    time, cannot hold vLLM's scheduler thread past the lookup's bound. Past it, a read raises
    ``socket.timeout``, which redis-py turns into its ``TimeoutError``."""

    def __init__(self, sock: Any, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._timeout: float | None = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _bound(self) -> None:
        at = self._deadline.at
        if at is None:
            return
        left = at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the exchange's time is spent")  # socket.timeout
        timeout = self._timeout
        self._sock.settimeout(left if timeout is None or timeout > left else timeout)

    def recv(self, *args: Any) -> Any:
        self._bound()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._bound()
        return self._sock.recv_into(*args)

    def sendall(self, *args: Any) -> Any:
        self._bound()
        return self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _bounded(connection_class: Any, deadline: _Deadline) -> Any:
    """``connection_class`` whose sockets are ``_BoundedSocket``s of ``deadline``."""

    class Bounded(connection_class):  # type: ignore[misc]
        def _connect(self) -> Any:
            return _BoundedSocket(super()._connect(), deadline)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{connection_class.__name__}"
    return Bounded


def _client(url: str, timeout_s: float, deadline: _Deadline | None) -> Any:
    """A ``redis.Redis`` for a checked URL, parsed by redis-py's own ``parse_url``, with the
    tier's bounds set last so that nothing in the URL overrides them; with ``deadline``,
    every exchange also ends by it (``_BoundedSocket``)."""
    check_redis_url(url)  # also when the URL did not come through ConnectorConfig
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.connection import parse_url
        from redis.retry import Retry
    except ImportError:  # pragma: no cover - the `remote` extra is not installed
        raise ConnectorConfigError(
            "remote_url needs the redis client: pip install 'kvledger[remote]'"
        ) from None
    try:
        kwargs: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    except Exception:
        raise ConnectorConfigError(f"remote_url redis-py cannot read: {redacted(url)}") from None
    if not set(kwargs) <= _URL_KWARGS:  # check_redis_url refuses every other option
        raise ConnectorConfigError(f"remote_url sets options it may not: {redacted(url)}")
    kwargs.update(
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # one bounded attempt, then the store's back-off
        health_check_interval=0,
        # RESP2 with every redis-py (8 defaults to RESP3): any server, no HELLO handshake.
        protocol=2,
    )
    if deadline is not None:
        base = kwargs.get("connection_class", redis.Connection)
        kwargs["connection_class"] = _bounded(base, deadline)
    try:
        return redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))
    except Exception as exc:
        raise ConnectorConfigError(
            f"remote_url {redacted(url)}: {describe(exc, _secrets(url))}"
        ) from None


def _set_command(
    name: bytes, payload: memoryview, head_len: int, ttl_s: int
) -> list[bytes | memoryview]:
    """``SET name <zeroed header><payload> [EX ttl_s]`` in RESP, as buffers sent one after
    the other: the payload is not copied into one value with its header."""
    value_len = head_len + len(payload)
    args: list[bytes] = [b"SET", name]
    tail: list[bytes] = [b"EX", str(ttl_s).encode()] if ttl_s else []
    out: list[bytes | memoryview] = [b"*%d\r\n" % (3 + len(tail))]
    out += [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
    out += [b"$%d\r\n" % value_len, bytes(head_len), payload, b"\r\n"]
    out += [b"$%d\r\n%s\r\n" % (len(a), a) for a in tail]
    return out


class RemoteStore:
    """One client of the server, with its bounds: ``timeout_s`` for every read, write and
    connect; with ``bounded``, for each whole exchange too (the scheduler's lookups and probes,
    handshake included); and a back-off after a failure during which nothing is sent. Its
    commands raise ``RemoteUnavailable`` and nothing else. A ``connector.tiers.Tier``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retry_s: float,
        ttl_s: int = 0,
        rank: int = 0,
        bounded: bool = False,
        client: Any = None,
        max_chunk_bytes: int | None = None,
    ) -> None:
        self.url = url
        self.max_chunk_bytes = max_chunk_bytes
        self.rank = rank
        self.ttl_s = ttl_s
        self._retry_s = retry_s
        self._backoff = retry_s
        self._next_try = 0.0
        self._secrets = _secrets(url)
        self._total_s = timeout_s
        self._deadline = _Deadline() if bounded else None
        self.client = _client(url, timeout_s, self._deadline) if client is None else client

    def __repr__(self) -> str:
        return f"RemoteStore({redacted(self.url)}, rank={self.rank})"

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
            # On vLLM's scheduler thread the lookup's bound holds for the whole exchange.
            bounded=scheduler,
            max_chunk_bytes=config.remote_max_chunk_bytes,
        )

    def check_chunk_bytes(self, chunk_bytes: int) -> None:
        """A chunk larger than ``remote_max_chunk_bytes`` (the server's largest value) refuses
        to start: every write of it would be refused."""
        limit = self.max_chunk_bytes
        if limit is not None and chunk_bytes > limit:
            raise ConnectorConfigError(
                f"remote_max_chunk_bytes ({limit}) is smaller than one chunk ({chunk_bytes} "
                f"bytes): raise it (and the server's proto-max-bulk-len) or lower chunk_size"
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

    def describe(self, exc: BaseException) -> str:
        """``Type: message`` of ``exc`` with this URL's credentials scrubbed."""
        return describe(exc, self._secrets)

    def _call(self, fn: Callable[[], Any], *, whole: bool = True) -> Any:
        """Run one exchange with the server: anything it raises is ``RemoteUnavailable``,
        the connections are dropped (a reply stream read halfway must not serve the next
        command) and the store backs off. A bounded store ends it by its bound (``whole``)."""
        if self._deadline is not None and whole:
            self._deadline.at = time.monotonic() + self._total_s
        try:
            result = fn()
        except Exception as exc:
            self._failed()
            with contextlib.suppress(Exception):
                self.client.connection_pool.disconnect()
            raise RemoteUnavailable(self.describe(exc), refused=_refused(exc)) from None
        finally:
            if self._deadline is not None:
                self._deadline.at = None
        self._ok()
        return result

    def check(self, *, startup: bool = False) -> str | None:
        """One ``PING``: None if the server answers, else why not. At ``startup``, a server
        that answers but refuses the credentials or the database (``/99999`` on a server
        with 16) raises ``ConnectorConfigError`` naming ``remote_url``; and the exchange,
        the first handshake, is bounded read by read only (engine startup is not a step)."""

        def ping() -> None:
            if self.client.ping() is not True:
                raise UnexpectedReply("PING did not answer PONG")

        try:
            self._call(ping, whole=not startup)
        except RemoteUnavailable as exc:
            if startup and exc.refused:
                raise ConnectorConfigError(
                    f"remote_url {redacted(self.url)}: the server refused {exc.refused} ({exc})"
                ) from None
            return str(exc)
        return None

    # --- commands ---------------------------------------------------------------------------

    def _error_class(self) -> type[Exception]:
        from redis.exceptions import ResponseError

        return ResponseError

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        """1 for each key the server holds, else 0: one round trip. ``EXISTS`` takes a key
        of any type, so an error reply is the server's, not the key's: ``RemoteUnavailable``."""

        def run() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(remote_key(key, self.rank))
            replies = list(pipe.execute(raise_on_error=False))
            if len(replies) != len(keys):
                raise UnexpectedReply(f"{len(replies)} replies to {len(keys)} EXISTS")
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
                if type(reply) is not int or reply < 0:
                    raise UnexpectedReply(f"EXISTS answered {type(reply).__name__}")
            return [1 if n else 0 for n in replies]

        found: list[int] = self._call(run)
        return found

    def put(self, items: Sequence[tuple[bytes, Sealed]]) -> list[str | None]:
        """Write every (key, value), each published atomically: one
        round trip. Returns, for each item, None once the server confirmed it, or why it
        was not written (``refused: <error reply>``: out of memory, a read-only replica, its
        temporary key lost; the other items are unaffected).

        The header's checksums are computed on threads while the payloads are on the wire,
        not before: each value goes out as a zeroed header then its payload (one ``SET`` to a
        temporary key, sent from the host slot without a copy), a ``SETRANGE`` writes the
        header over the zeros once its checksums are known, and a ``RENAME`` publishes it
        under its key, replacing whatever was there, of any type: no reader ever sees the
        zeroed header. (``MULTI``/``EXEC`` would be atomic too, but inside a transaction the
        ``SETRANGE`` copies the whole value: half the throughput.) The temporary key expires
        on its own should the connection die before the ``RENAME``."""
        names = [remote_key(key, self.rank) for key, _ in items]
        temps = [b"%s:tmp:%s" % (name, os.urandom(8).hex().encode()) for name in names]
        error_class = self._error_class()
        # What each reply must be, in the order sent: SET, SETRANGE, RENAME, EXPIRE/PERSIST.
        shapes: tuple[Callable[[Any], bool], ...] = (_is_ok, _is_count, _is_ok, _is_count)

        def run() -> list[str | None]:
            pool = self.client.connection_pool
            try:
                conn = pool.get_connection()
            except TypeError:  # redis-py before 5.3 wants the command's name
                conn = pool.get_connection("SET")

            def read() -> Any:
                try:
                    return conn.read_response()
                except error_class as exc:  # an error reply, read whole: still in step
                    return exc

            try:
                for (_, value), temp in zip(items, temps, strict=True):
                    conn.send_packed_command(
                        _set_command(temp, value.payload, value.head_len, _TEMP_TTL_S)
                    )
                for (_, value), temp, name in zip(items, temps, names, strict=True):
                    header = value.head()
                    ttl = ("EXPIRE", name, self.ttl_s) if self.ttl_s else ("PERSIST", name)
                    conn.send_packed_command(
                        conn.pack_commands(
                            [("SETRANGE", temp, 0, header), ("RENAME", temp, name), ttl]
                        )
                    )
                # The replies come in the order sent: every SET, then each item's three.
                replies = [read() for _ in items] + [read() for _ in range(3 * len(items))]
                results: list[str | None] = []
                for i in range(len(items)):
                    why: str | None = None
                    mine = [replies[i], *replies[len(items) + 3 * i : len(items) + 3 * i + 3]]
                    for reply, shape in zip(mine, shapes, strict=True):
                        if isinstance(reply, error_class):
                            why = why or f"{REFUSED}: {self.describe(reply)}"
                        elif not shape(reply):
                            raise UnexpectedReply(f"a write was answered {type(reply).__name__}")
                    results.append(why)
                return results
            except BaseException:
                conn.disconnect()  # a half-read reply stream must not go back to the pool
                raise
            finally:
                pool.release(conn)

        written: list[str | None] = self._call(run)
        return written

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | str]:
        """Each key's value as stored, or why it cannot be read: ``missing``, or
        ``refused: <error reply>`` (a key of another type: ``WRONGTYPE``)."""
        error_class = self._error_class()

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(remote_key(key, self.rank))
            replies = list(pipe.execute(raise_on_error=False))
            if len(replies) != len(keys):
                raise UnexpectedReply(f"{len(replies)} replies to {len(keys)} GET")
            for reply in replies:
                if not (reply is None or type(reply) is bytes or isinstance(reply, error_class)):
                    raise UnexpectedReply(f"GET answered {type(reply).__name__}")
            return replies

        return [
            f"{REFUSED}: {self.describe(v)}"
            if isinstance(v, BaseException)
            else MISSING
            if v is None
            else v
            for v in self._call(run)
        ]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a dead connection: nothing left to close
            self.client.close()
        with contextlib.suppress(Exception):
            self.client.connection_pool.disconnect()


def _is_ok(reply: Any) -> bool:
    return reply in (b"OK", "OK")


def _is_count(reply: Any) -> bool:
    return type(reply) is int and reply >= 0
