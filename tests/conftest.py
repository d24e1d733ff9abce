"""Test-wide settings, and the logs the replay tests share.

Hypothesis runs without per-example deadlines: CI machines are shared and a slow example is
not a failure (no test here is about timing; benchmarks live in bench/). ``print_blob`` makes
any failure reproducible from CI's output alone.

``synthetic_log``: the synthetic workload of ``_replay_logs.write_log`` (a real Tracker and
LogWriter, no vLLM: prefills, a preemption and a load from the pool, a prefix hit, one
violation), written afresh for each test. ``real_logs``: the logs of a few small runs of vLLM's
real scheduler, run once a session (skipped where it cannot run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# The tests import their helpers (fakes.py, _replay_logs.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("kvledger", deadline=None, print_blob=True)
settings.load_profile("kvledger")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every pytest-xdist worker of this run sees (each worker's own base
    directory sits in it): where one worker leaves what the others read."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture
def synthetic_log(tmp_path: Path) -> Path:
    from _replay_logs import write_log

    path = tmp_path / "run.kvlog"
    write_log(path)
    return path


@pytest.fixture(scope="session")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from _replay_logs import real_run_logs

    return real_run_logs(tmp_path_factory)
