"""A real ``redis-server`` for the remote tier's tests: started on 127.0.0.1 and a free port,
in a temporary directory, without persistence (``--save "" --appendonly no``), and stopped
after. It can be killed and started again on the same port (an outage and a restart).

Where no ``redis-server`` is installed the tests are skipped, except in CI (``CI`` or
``KVLEDGER_REQUIRE_REDIS`` set): there a missing server is a failure, never a silent skip.

And ``StandIn``: a stand-in server on loopback, written here, for what a real server will not
do on demand: answer a chosen command with bytes that are not RESP, a truncated reply, a slow
one, any error code, or a reply of the wrong shape.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import socket
import socketserver
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.connector.testing.served import free_port

__all__ = [
    "CODES",
    "DRIP_S",
    "ERRORS",
    "FAULTS",
    "RedisServer",
    "StandIn",
    "redis_server",
    "require_redis_server",
    "standin",
]


def require_redis_server() -> str:
    """The ``redis-server`` binary, or skip (fail in CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        why = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI") or os.environ.get("KVLEDGER_REQUIRE_REDIS"):
            pytest.fail(f"{why}; CI requires it (CI / KVLEDGER_REQUIRE_REDIS is set)")
        pytest.skip(why)
    return binary


class RedisServer:
    """One ``redis-server`` process; ``url`` carries the password when there is one."""

    def __init__(self, binary: str, directory: Path, password: str | None = None) -> None:
        self.binary = binary
        self.directory = directory
        self.password = password
        self.port = free_port()
        # It also listens on a Unix socket (unix:// URLs); short: sun_path holds 107 bytes.
        self.socket_path = tempfile.mktemp(prefix="kvl-redis-", suffix=".sock", dir="/tmp")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_with(self, password: str) -> str:
        return f"redis://:{password}@127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--unixsocket", self.socket_path,
            "--unixsocketperm", "700",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {args}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):  # +PONG, or -NOAUTH with a password: it answers
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """Stop the server at once (SIGKILL): an outage, everything it held lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty ``redis-server`` for one test."""
    server = RedisServer(require_redis_server(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- a stand-in server on loopback that answers wrong on purpose ------------------------------

# How a stand-in answers a command it was told to fail (StandIn.fail):
# - garbage: bytes that are not RESP;
# - truncated: the first part of the right reply, then the connection closed;
# - slow: the right reply, after longer than any client's timeout here;
# - error: an error reply (ERRORS: the one a real server would give that command, or CODES);
# - shape: valid RESP of a type the command never returns (an array).
# And drip (not in FAULTS: a worker's reads are bounded one by one, not as a whole): the right
# reply, a byte at a time, each a little later.
FAULTS = ("garbage", "truncated", "slow", "error", "shape")
SLOW_S = 1.0  # over every client timeout the tests set (0.4 s at most), twice over
DRIP_S = 0.06
# A real server's error reply to each command, of the kind that command can meet.
ERRORS = {
    "AUTH": b"-WRONGPASS invalid username-password pair or user is disabled.",
    "CLIENT": b"-ERR unknown subcommand",
    "SELECT": b"-ERR DB index is out of range",
    "PING": b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL",
    "EXISTS": b"-LOADING Redis is loading the dataset in memory",
    "GET": b"-WRONGTYPE Operation against a key holding the wrong kind of value",
    "SET": b"-OOM command not allowed when used memory > 'maxmemory'.",
    "SETRANGE": b"-READONLY You can't write against a read only replica.",
    "RENAME": b"-ERR no such key",
    "EXPIRE": b"-NOPERM this user has no permissions to access one of the keys",
    "PERSIST": b"-MISCONF Redis is configured to save RDB snapshots, but it's failing",
}
# Every error code redis-py maps to an exception class of its own, and one it does not.
CODES = (
    b"-ERR injected",
    b"-ERR max number of clients reached",
    b"-ERR invalid password",
    b"-OOM command not allowed",
    b"-WRONGPASS invalid username-password pair",
    b"-EXECABORT Transaction discarded",
    b"-LOADING Redis is loading the dataset in memory",
    b"-NOSCRIPT No matching script",
    b"-READONLY You can't write against a read only replica.",
    b"-NOAUTH Authentication required.",
    b"-NOPERM no permissions",
    b"-ASK 3999 127.0.0.1:6381",
    b"-TRYAGAIN Multiple keys request during rehashing of slot",
    b"-MOVED 3999 127.0.0.1:6381",
    b"-CLUSTERDOWN The cluster is down",
    b"-CROSSSLOT Keys in request don't hash to the same slot",
    b"-MASTERDOWN Link with MASTER is down",
    b"-WRONGTYPE Operation against a key holding the wrong kind of value",
    b"-BUSY Redis is busy running a script",
    b"-SOMETHINGNEW a code no client knows",
)


class StandIn:
    """A Redis stand-in on 127.0.0.1 and a free port, in threads of this process: string
    values in a dict, RESP2, the commands the remote tier sends. ``fail(command, fault)``
    makes it answer that command wrong (``FAULTS``) from then on; ``seen`` counts every
    command it was sent (a command it does not know is answered ``-ERR unknown command``)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.seen: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self.fault: tuple[str, str] | None = None
        self.error: bytes | None = None  # the "error" fault's reply (default: ERRORS)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        # Polled often: close() waits for the loop to see its stop (0.5 s by default, each test).
        threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True).start()

    def url(self, path: str = "/0", query: str = "") -> str:
        return f"redis://:standin-pw@127.0.0.1:{self.port}{path}{query}"

    def fail(
        self, command: str | None, fault: str | None = None, error: bytes | None = None
    ) -> None:
        """Answer ``command`` with ``fault`` from now on (None: answer right again); the
        connections open now are closed, so that the clients connect again (a handshake)."""
        with self._lock:
            self.fault = None if command is None else (command, str(fault))
            self.error = error
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.fail(None)
        self._server.shutdown()
        self._server.server_close()

    # --- the server ----------------------------------------------------------------------

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        standin = self

        class Handler(socketserver.StreamRequestHandler):
            # Replies go out at once, as a Redis server's do: with Nagle's algorithm on, a reply
            # waited for the client's delayed ACK of the previous one.
            disable_nagle_algorithm = True

            def handle(self) -> None:
                with standin._lock:
                    standin._conns.add(self.connection)
                with contextlib.suppress(OSError, ValueError):
                    while (args := _read_command(self.rfile)) is not None:
                        if not standin._answer(args, self.connection):
                            return

        return Handler

    def _answer(self, args: list[bytes], conn: socket.socket) -> bool:
        name = args[0].decode(errors="replace").upper()
        with self._lock:
            self.seen[name] += 1
            fault = self.fault[1] if self.fault and self.fault[0] == name else None
            if fault:
                self.injected[f"{name} {fault}"] += 1
            reply = self._execute(name, args[1:])
        if fault == "garbage":
            conn.sendall(b"?this is not RESP\r\n")
        elif fault == "truncated":
            conn.sendall(reply[: max(1, len(reply) // 2)])
            return False
        elif fault == "slow":
            time.sleep(SLOW_S)
            conn.sendall(reply)
        elif fault == "error":
            conn.sendall((self.error or ERRORS.get(name, b"-ERR injected")) + b"\r\n")
        elif fault == "shape":
            conn.sendall(b"*2\r\n:1\r\n$1\r\nx\r\n")
        elif fault == "drip":
            for i in range(len(reply)):
                time.sleep(DRIP_S)
                conn.sendall(reply[i : i + 1])
        else:
            conn.sendall(reply)
        return True

    def _execute(self, name: str, args: list[bytes]) -> bytes:
        data = self.data
        if name == "PING":
            return b"+PONG\r\n"
        if name in ("AUTH", "CLIENT", "SELECT"):
            return b"+OK\r\n"
        if name == "EXISTS":
            return b":%d\r\n" % sum(1 for k in args if k in data)
        if name == "GET":
            value = data.get(args[0])
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if name == "SET":
            data[args[0]] = args[1]
            return b"+OK\r\n"
        if name == "SETRANGE":
            offset, patch = int(args[1]), args[2]
            value = data.get(args[0], b"").ljust(offset, b"\0")
            data[args[0]] = value[:offset] + patch + value[offset + len(patch) :]
            return b":%d\r\n" % len(data[args[0]])
        if name == "RENAME":
            if args[0] not in data:
                return b"-ERR no such key\r\n"
            data[args[1]] = data.pop(args[0])
            return b"+OK\r\n"
        if name in ("EXPIRE", "PERSIST"):
            return b":%d\r\n" % (args[0] in data)
        return b"-ERR unknown command '%s'\r\n" % name.encode()


def _read_command(rfile: Any) -> list[bytes] | None:
    """One command, an array of bulk strings; None at the end of the stream."""
    line = rfile.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ValueError(f"not a command: {line!r}")
    args = []
    for _ in range(int(line[1:])):
        size = int(rfile.readline()[1:])
        args.append(rfile.read(size + 2)[:-2])
    return args


@pytest.fixture
def standin() -> Iterator[StandIn]:
    server = StandIn()
    try:
        yield server
    finally:
        server.close()
