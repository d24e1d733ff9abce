"""The remote tier against a stand-in server on loopback (``tests/_redis.py``, ``StandIn``) that
answers any one command wrong: bytes that are not RESP, a truncated reply, a slow one, every
error code redis-py knows (and one it does not), a reply of the wrong shape; and against
redis-py raising each of its exception classes, and exceptions it never should.

For every command the tier sends (``TIER_COMMANDS``; a test fails should the tier send one not
listed there): the store raises nothing but ``RemoteUnavailable`` and its per-chunk reasons
name the fault; its connections are never left out of step (it answers right once the server
does); and under vLLM's real scheduler, every request finishes with the KV-content oracle
clean, the fault is an event in the log, and ``kvledger check`` re-derives the log clean.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _redis import CODES, DRIP_S, ERRORS, FAULTS, StandIn, standin

from kvledger.connector.remote import TIER_COMMANDS, RemoteStore, RemoteUnavailable
from kvledger.connector.values import ValueSeal
from kvledger.tracker import events as ev

__all__ = ["standin"]  # the fixture, imported for pytest

KEYS = [bytes([i]) * 16 for i in range(3)]
PAYLOAD = os.urandom(3000)
SEAL = ValueSeal(rank=0, layout=b"L" * 16)
# A password, a database other than 0 and a client name: the handshake sends AUTH, CLIENT
# (SETINFO, SETNAME) and SELECT.
QUERY = "?client_name=kvledger-test"


@pytest.fixture(autouse=True)
def _short_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's back-off capped at 4 ms. A fault on the handshake fails every operation
    a test runs, and each failure doubles the back-off from ``retry_s``: eight of them waited
    0.26 s, in each of some 140 tests. What a test here asks is what a fault is reported as
    and that the store answers right again; the back-off's own schedule is
    ``test_the_back_off_doubles_up_to_its_cap_and_a_success_resets_it``, below."""
    from kvledger.connector import remote

    monkeypatch.setattr(remote, "MAX_BACKOFF_S", 0.004)


def _store(server: StandIn, **kw: Any) -> RemoteStore:
    # 0.4 s: under SLOW_S, so a slow reply times out, and loose enough that a loaded machine
    # (tests in parallel) does not time out a reply that came at once (the scheduler's tests
    # below bound theirs at 400 ms too). Every slow fault waits it out, eight times a test:
    # at 0.8 s this file spent a minute of its two waiting.
    return RemoteStore(server.url("/1", QUERY), timeout_s=0.4, retry_s=0.001, **kw)


def _parsed(reply: bytes) -> BaseException:
    """The exception redis-py makes of an error reply."""
    from redis._parsers.base import _RESPBase

    return _RESPBase.parse_error(reply[1:].decode())


def _expected(command: str, fault: str, error: bytes | None) -> tuple[str, ...]:
    """What a report of this fault names (any one of them)."""
    if fault == "error":
        named = type(_parsed(error or ERRORS[command])).__name__
        if command == "SELECT" and named == "ResponseError":
            return (named, "Invalid Database")
        return (named,)
    if fault == "shape" and command == "AUTH":
        return ("Invalid Username or Password",)
    if fault == "shape" and command == "SELECT":
        return ("Invalid Database",)
    if fault == "shape" and command == "CLIENT":
        return ("Error setting client name",)
    return {
        "garbage": ("InvalidResponse",),
        "truncated": ("ConnectionError",),
        "slow": ("TimeoutError",),
        "shape": ("UnexpectedReply",),
    }[fault]


def _run_ops(store: RemoteStore, ops: list[Callable[[], Any]], outcomes: list[str]) -> None:
    """Each operation, after the store's back-off: what each says went wrong (what it
    raised, ``check``'s why-not, a chunk's reason) goes to ``outcomes``. Nothing but
    ``RemoteUnavailable`` may be raised."""
    for op in ops:
        while not store.available():
            time.sleep(0.001)
        try:
            result = op()
        except RemoteUnavailable as exc:
            outcomes.append(str(exc))
            continue
        if isinstance(result, str):
            outcomes.append(result)
        elif isinstance(result, list):
            outcomes.extend(r for r in result if isinstance(r, str))


def _exercise(store: RemoteStore, outcomes: list[str]) -> None:
    """Every operation of the tier once (``_run_ops``)."""
    ops: list[Callable[[], Any]] = [
        store.check,
        lambda: store.exists(KEYS),
        lambda: store.get(KEYS),
        lambda: store.put([(k, SEAL.seal(k, memoryview(PAYLOAD))) for k in KEYS]),
    ]
    _run_ops(store, ops, outcomes)


def _assert_answers_right(store: RemoteStore) -> None:
    """Once the server answers right, so does the store: no reply left out of step."""
    deadline = time.monotonic() + 10
    while not store.available() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.check() is None
    assert store.put([(k, SEAL.seal(k, memoryview(PAYLOAD))) for k in KEYS]) == [None] * len(KEYS)
    assert store.exists([*KEYS, b"z" * 16]) == [1, 1, 1, 0]
    got = [SEAL.open(k, g, len(PAYLOAD)) for k, g in zip(KEYS, store.get(KEYS), strict=True)]
    assert [bytes(g.payload) for g in got] == [PAYLOAD] * len(KEYS)  # type: ignore[union-attr]


class _Clock:
    """``time`` as the remote module reads it, at an instant the test sets."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_back_off_doubles_up_to_its_cap_and_a_success_resets_it(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each failure in a row keeps the store unavailable twice as long as the one before,
    from ``retry_s`` up to ``MAX_BACKOFF_S``; one exchange that succeeds starts it again
    from ``retry_s``."""
    from kvledger.connector import remote

    clock = _Clock()
    monkeypatch.setattr(remote, "time", clock)
    monkeypatch.setattr(remote, "MAX_BACKOFF_S", 0.5)
    store = RemoteStore(standin.url("/1", QUERY), timeout_s=0.4, retry_s=0.0625)

    def unavailable_for() -> float:
        """How long ``available()`` stays False from now (the clock then past it)."""
        start = clock.now
        for wait in (0.0625, 0.125, 0.25, 0.5, 1.0):
            clock.now = start + wait - 0.001
            if store.available():
                raise AssertionError(f"available {wait - 0.001} s after a failure")
            clock.now = start + wait
            if store.available():
                return wait
        raise AssertionError("unavailable for over 1 s")

    standin.fail("PING", "error", b"-ERR down\r\n")
    waits = []
    for _ in range(5):
        assert store.check() is not None
        waits.append(unavailable_for())
    assert waits == [0.0625, 0.125, 0.25, 0.5, 0.5]
    standin.fail(None)
    assert store.check() is None and store.available()
    standin.fail("PING", "error", b"-ERR down\r\n")
    assert store.check() is not None
    assert unavailable_for() == 0.0625


# --- the commands: every one the tier sends is listed, and so faulted below ------------------


def test_the_tier_sends_exactly_the_commands_it_lists(standin: StandIn) -> None:
    for ttl in (0, 60):
        store = _store(standin, ttl_s=ttl)
        assert store.check(startup=True) is None
        assert store.put([(k, SEAL.seal(k, memoryview(PAYLOAD))) for k in KEYS]) == [None] * len(
            KEYS
        )
        assert store.exists(KEYS) == [1, 1, 1]
        assert all(not isinstance(g, str) for g in store.get(KEYS))
        store.close()
    assert set(standin.seen) == set(TIER_COMMANDS), (
        "the tier sends a command TIER_COMMANDS does not list (or no longer sends one): "
        "list it there, and the tests below fail it every way"
    )


# --- the store: each command, each fault --------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", TIER_COMMANDS)
def test_a_fault_on_any_command_is_reported_never_raised(
    standin: StandIn, command: str, fault: str
) -> None:
    store = _store(standin, ttl_s=60 if command == "EXPIRE" else 0)
    assert store.check(startup=True) is None
    standin.fail(command, fault)
    expected = _expected(command, fault, None)
    outcomes: list[str] = []
    for _ in range(2):  # a fault on connecting shows on the next connection
        _exercise(store, outcomes)
        # Once every operation ran beside the fault and it was reported, a second round
        # would only wait out a slow fault's timeouts again (eight of 0.4 s on a handshake).
        if standin.injected and any(name in text for text in outcomes for name in expected):
            break
    assert standin.injected, f"{command} was never sent"
    assert any(name in text for text in outcomes for name in expected), outcomes
    standin.fail(None)
    _assert_answers_right(store)


@pytest.mark.parametrize("error", CODES, ids=lambda c: c.split()[0][1:].decode())
@pytest.mark.parametrize("command", TIER_COMMANDS)
def test_every_error_code_on_any_command_is_reported_as_its_kind(
    standin: StandIn, command: str, error: bytes
) -> None:
    """An error reply to a chunk's own read or write (``GET``, ``SET``, ``SETRANGE``,
    ``RENAME``, ``EXPIRE``/``PERSIST``) fails that chunk alone, ``refused: ...``, and the
    server stays up; unless redis-py raises it as a connection error (``LOADING``, ``NOAUTH``,
    ``WRONGPASS``, too many clients): then, as for any error reply to the handshake, ``PING``
    or ``EXISTS``, the store is unavailable and backs off."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    store = _store(standin, ttl_s=60 if command == "EXPIRE" else 0)
    assert store.check(startup=True) is None
    assert store.put([(k, SEAL.seal(k, memoryview(PAYLOAD))) for k in KEYS]) == [None] * len(KEYS)
    standin.fail(command, "error", error)
    outcomes: list[str] = []
    _exercise(store, outcomes)
    _exercise(store, outcomes)
    assert standin.injected
    parsed = _parsed(error)
    named = type(parsed).__name__
    assert any(named in text for text in outcomes), outcomes
    per_chunk = command in ("GET", "SET", "SETRANGE", "RENAME", "EXPIRE", "PERSIST")
    if per_chunk and not isinstance(parsed, RedisConnectionError):
        assert all(text.startswith("refused: ") for text in outcomes), outcomes
    else:
        assert not any(text.startswith("refused: ") for text in outcomes), outcomes
    standin.fail(None)
    _assert_answers_right(store)


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class redis-py defines, and a few it should never raise."""
    import redis.exceptions as rx

    found: list[type[BaseException]] = []
    todo: list[type[BaseException]] = [rx.RedisError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    found = sorted(
        {c for c in found if c.__module__.startswith("redis")}, key=lambda c: c.__qualname__
    )
    return [*found, OSError, TimeoutError, ValueError, KeyError, RuntimeError, MemoryError]


@pytest.mark.parametrize("exc_class", _exception_classes(), ids=lambda c: c.__qualname__)
def test_any_exception_redis_py_raises_is_reported_never_raised(
    standin: StandIn, exc_class: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py raising any of its exception classes (``DataError``, ``InvalidResponse``,
    ``NoScriptError``, ...) or one nobody foresaw, from any read of any operation."""
    import redis.connection

    store = _store(standin)
    assert store.check(startup=True) is None
    try:
        exc = exc_class("injected: kvledger-test")
    except Exception:  # MOVED and ASK parse their message: "<slot> <host>:<port>"
        exc = exc_class("3999 127.0.0.1:6381")
    read = redis.connection.AbstractConnection.read_response

    def failing(self: Any, *args: Any, **kw: Any) -> Any:
        read(self, *args, **kw)  # the reply is read whole: the fault is the client's
        raise exc

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", failing)
    for name in ("Connection", "UnixDomainSocketConnection", "SSLConnection"):
        monkeypatch.setattr(getattr(redis.connection, name), "read_response", failing)
    outcomes: list[str] = []
    _exercise(store, outcomes)
    assert len(outcomes) >= 4, outcomes
    assert all(exc_class.__name__ in text for text in outcomes), outcomes
    monkeypatch.undo()
    _assert_answers_right(store)


@pytest.mark.parametrize("command", ["AUTH", "CLIENT", "SELECT", "PING", "EXISTS"])
def test_a_lookup_is_bounded_as_a_whole_not_read_by_read(standin: StandIn, command: str) -> None:
    """The scheduler's exchanges (a lookup, a probe, the handshake of either) end by the
    lookup's bound however the server spreads its replies: each byte of them in time for the
    socket's timeout, but all of them not. A worker's store, bounded read by read, waits."""
    scheduler = RemoteStore(standin.url("/1", QUERY), timeout_s=0.2, retry_s=0.001, bounded=True)
    worker = _store(standin)
    assert scheduler.check(startup=True) is None and worker.check(startup=True) is None
    assert worker.put([(k, SEAL.seal(k, memoryview(PAYLOAD))) for k in KEYS]) == [None] * len(KEYS)
    standin.fail(command, "drip")  # every reply byte DRIP_S apart: each read in time
    assert DRIP_S < 0.2
    outcomes: list[str] = []
    _run_ops(scheduler, [scheduler.check, lambda: scheduler.exists(KEYS)], outcomes)
    assert any("TimeoutError" in text for text in outcomes), outcomes
    assert worker.check() is None and worker.exists(KEYS) == [1, 1, 1]  # slowly, but read
    standin.fail(None)
    _assert_answers_right(scheduler)


# --- under vLLM's real scheduler -------------------------------------------------------------------

WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=6, prompt_len=(48, 120), max_tokens=(4, 12), seed=3
)


def _extra(url: str, **more: Any) -> dict[str, Any]:
    return {
        "chunk_size": 32,
        "remote_url": url,
        "remote_retry_ms": 20,
        # Well under the stand-in's slow reply, well over a loaded machine's thread switch.
        "remote_timeout_ms": 400,
        "remote_lookup_timeout_ms": 400,
        **more,
    }


# The commands of a write: a replica writes the chunks it did not find, so these run against
# an empty server.
_WRITES = ("SET", "SETRANGE", "RENAME", "EXPIRE", "PERSIST")


@pytest.fixture(scope="module")
def written() -> Iterator[dict[bytes, bytes]]:
    """What a first replica wrote to a stand-in that answered right: every chunk of the
    workload, for the second replica to find."""
    pytest.importorskip("vllm")
    from kvledger.connector.testing.harness import skip_reason
    from kvledger.connector.testing.run import RunSpec, run

    if skip_reason() is not None:
        pytest.skip(str(skip_reason()))
    server = StandIn()
    try:
        report = run(RunSpec(**WORKLOAD, extra_config=_extra(server.url("/1", QUERY))))
        assert report.finished == report.requests and not report.mismatches
        assert any(k.startswith(b"kvledger:") for k in server.data)
        yield dict(server.data)
    finally:
        server.close()


def _faults_in(events: list[ev.Event]) -> list[str]:
    texts: list[str] = []
    for e in events:
        if isinstance(e, ev.RemoteOutage):
            texts.append(e.error)
        elif isinstance(e, (ev.RemoteLoadFailed, ev.RemoteSaveFailed)):
            texts.append(e.reason)
    return texts


@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", TIER_COMMANDS)
def test_under_vllms_scheduler_a_fault_on_any_command_is_recorded_and_served_around(
    written: dict[bytes, bytes], tmp_path: Path, command: str, fault: str
) -> None:
    from kvledger.connector.testing.run import RunSpec, run
    from kvledger.replay.replayer import check
    from kvledger.replay.source import open_log

    server = StandIn()
    try:
        if command not in _WRITES:
            server.data.update(written)  # chunks to find and read
        url = server.url("/1", QUERY)
        more = {"remote_ttl_s": 60} if command == "EXPIRE" else {}

        def arm(step: int, finished: int, total: int) -> None:
            if step == 2:  # after the startup checks and the first admissions
                server.fail(command, fault)

        if command == "PING":  # sent at startup, and by the probes of an outage
            server.fail(command, fault)
        report = run(
            RunSpec(**WORKLOAD, extra_config=_extra(url, **more)),
            log_dir=str(tmp_path),
            progress=arm,
        )
    finally:
        server.close()
    assert [m.describe() for m in report.mismatches] == []
    assert report.violations == () and report.adapter_errors == 0
    assert report.finished == report.requests
    assert server.injected, f"{command} was not sent after the fault was armed"
    events = [e for frame in open_log(report.log_path).frames() for e in frame.events]
    expected = _expected(command, fault, None)
    faults = _faults_in(events)
    assert any(name in text for text in faults for name in expected), faults
    result = check(report.log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems[:5]]
