"""Two served tests at once, each stop alone on the machine.

A served test spends most of its time starting vLLM's server: three processes, one after the
other, each importing vLLM on one core for about 7 s. Two tests at once use both cores of the
2-vCPU machine for that. A stop is different. vLLM kills its engine core a moment after the
stop signal, and whether the connector's handler seals the log first is a race that a second
engine's load can decide (docs/using-with-vllm.md, how the engine stopped). So a stop must
have the machine to itself.

Every pytest-xdist worker makes a ``Turns`` over one directory they share. Each server's
process group is registered when it is spawned. ``alone()`` takes the stop lock and freezes
(SIGSTOP) every group the other workers registered until the stop is over (SIGCONT): their
servers, starting or serving, wait where they are, and nobody waits for them. A group spawned
while a stop holds the lock freezes itself until the stop is over. The other worker's pytest
process itself runs on: what it does between servers (reading a log, a `kvledger check` of a
few tenths of a second) may share the machine with a stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Turns"]


class Turns:
    def __init__(self, directory: Path) -> None:
        self._groups = directory / "served-groups"
        self._groups.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(directory / "served-stops.lock", os.O_RDWR | os.O_CREAT)
        self._mine: set[int] = set()
        self._alone = False

    def close(self) -> None:
        for pgid in list(self._mine):
            self.ended(pgid)
        os.close(self._lock)

    def spawned(self, pgid: int) -> None:
        """A process group this worker has just started: frozen during the other workers'
        stops from now until :meth:`ended`."""
        # Not inside alone(): flock on this open file would turn its exclusive lock shared.
        assert not self._alone, "a group spawned during this worker's own stop"
        (self._groups / str(pgid)).touch()
        self._mine.add(pgid)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            # A stop holds the lock, and may have listed the groups before this one. A group
            # already gone (a server that failed at once) is for its own test to report.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGSTOP)
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
        fcntl.flock(self._lock, fcntl.LOCK_UN)

    def ended(self, pgid: int) -> None:
        self._mine.discard(pgid)
        (self._groups / str(pgid)).unlink(missing_ok=True)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The machine to this worker: one stop at a time, every other worker's registered
        group frozen meanwhile."""
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._alone = True
        frozen: list[int] = []
        try:
            for entry in os.listdir(self._groups):
                pgid = int(entry)
                if pgid in self._mine:
                    continue
                try:
                    os.killpg(pgid, signal.SIGSTOP)
                except ProcessLookupError:  # its worker ended it and is about to say so
                    continue
                frozen.append(pgid)
            yield
        finally:
            for pgid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGCONT)
            self._alone = False
            fcntl.flock(self._lock, fcntl.LOCK_UN)
