"""The served tests' turns (tests/engine/_turns.py): two workers at once, and during a stop
nothing of the other worker's runs. Each ``Turns`` here opens the lock file itself, as each
pytest-xdist worker does (flock locks belong to an open file, so two opens in one process
contend as two processes do); the "servers" are real process groups that write the time."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine._turns import Turns

# A process that appends the monotonic clock to a file every millisecond, for ever.
TICKER = """
import sys, time
with open(sys.argv[1], "a", buffering=1) as f:
    while True:
        f.write(f"{time.monotonic()}\\n")
        time.sleep(0.001)
"""
MARGIN = 0.02  # SIGSTOP reaches a process running on the other core within this


def _spawn(turns: Turns, ticks: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", TICKER, str(ticks)], start_new_session=True)
    turns.spawned(proc.pid)
    return proc


def _ticks(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()]


def _wait_ticking(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not (path.exists() and len(_ticks(path)) > 5):
        assert time.monotonic() < deadline, "the ticker never started"
        time.sleep(0.01)


Workers = tuple[Turns, Turns, list[subprocess.Popen[bytes]]]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Two workers' turns over one directory, and the tickers they start (killed after)."""
    a, b = Turns(tmp_path), Turns(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    yield a, b, procs
    for p in procs:
        p.kill()
        p.wait()
    a.close()
    b.close()


def test_another_workers_groups_are_frozen_during_a_stop_and_its_own_are_not(
    workers: Workers, tmp_path: Path
) -> None:
    a, b, procs = workers
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    procs += [_spawn(b, theirs), _spawn(a, mine)]
    _wait_ticking(theirs)
    _wait_ticking(mine)
    with a.alone():
        t0 = time.monotonic()
        time.sleep(0.3)
        t1 = time.monotonic()
    deadline = time.monotonic() + 30
    while _ticks(theirs)[-1] < t1:  # thawed after the stop
        assert time.monotonic() < deadline, "the other worker's group stayed frozen"
        time.sleep(0.01)
    inside = [t for t in _ticks(theirs) if t0 + MARGIN < t < t1]
    assert not inside, f"the other worker's group ran {len(inside)} times during the stop"
    assert len([t for t in _ticks(mine) if t0 < t < t1]) > 50, "its own group kept running"


def test_a_group_spawned_during_a_stop_waits_for_its_end(workers: Workers, tmp_path: Path) -> None:
    a, b, procs = workers
    ticks = tmp_path / "late"
    with a.alone():
        spawner = threading.Thread(target=lambda: procs.append(_spawn(b, ticks)))
        spawner.start()
        time.sleep(0.5)  # a Python process starts and ticks well within this
        t1 = time.monotonic()
        assert spawner.is_alive(), "spawned() returned while the stop held the lock"
    spawner.join(10)
    _wait_ticking(ticks)
    assert min(_ticks(ticks)) > t1 - MARGIN, "the late group ran during the stop"


def test_stops_take_turns(tmp_path: Path) -> None:
    spans: list[tuple[int, float, float]] = []

    def stops(who: int) -> None:
        turns = Turns(tmp_path)
        try:
            for _ in range(30):
                with turns.alone():
                    t0 = time.monotonic()
                    time.sleep(0.002)
                    spans.append((who, t0, time.monotonic()))
        finally:
            turns.close()

    threads = [threading.Thread(target=stops, args=(who,), daemon=True) for who in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stop waits for ever"
    assert len(spans) == 90
    spans.sort(key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(spans)), "two stops at once"
