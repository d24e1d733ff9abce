"""A real ``redis-server`` for the remote tier's tests: started on 127.0.0.1 and a free port,
in a temporary directory, without persistence (``--save "" --appendonly no``), and stopped
after. It can be killed and started again on the same port (an outage and a restart).

Where no ``redis-server`` is installed the tests are skipped, except in CI (``CI`` or
``KVLEDGER_REQUIRE_REDIS`` set): there a missing server is a failure, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RedisServer", "redis_server", "require_redis_server"]


def require_redis_server() -> str:
    """The ``redis-server`` binary, or skip (fail in CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        why = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI") or os.environ.get("KVLEDGER_REQUIRE_REDIS"):
            pytest.fail(f"{why}; CI requires it (CI / KVLEDGER_REQUIRE_REDIS is set)")
        pytest.skip(why)
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``url`` carries the password when there is one."""

    def __init__(self, binary: str, directory: Path, password: str | None = None) -> None:
        self.binary = binary
        self.directory = directory
        self.password = password
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_with(self, password: str) -> str:
        return f"redis://:{password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
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
