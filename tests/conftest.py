"""Test-wide settings.

Hypothesis runs without per-example deadlines: CI machines are shared and a slow example is
not a failure (no test here is about timing; benchmarks live in bench/). ``print_blob`` makes
any failure reproducible from CI's output alone.
"""

from __future__ import annotations

import os
import sys

from hypothesis import settings

# The tests import their helpers (fakes.py, _replay_logs.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("kvledger", deadline=None, print_blob=True)
settings.load_profile("kvledger")
