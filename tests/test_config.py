"""TrackerConfig refuses, by name, every value that would size something without bound or that
has the wrong type: a log header is input like any other (a hostile or damaged one included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _memory import traced_peak

from kvledger.connector.logwriter import LogWriter
from kvledger.tracker.config import ConfigError, TrackerConfig

BAD = [
    ({"num_slots": 2**64 - 1}, "num_slots"),
    ({"num_slots": 0}, "num_slots"),
    ({"block_size": 2**40, "chunk_size": 2**40}, "block_size"),
    ({"chunk_size": 2**40}, "chunk_size"),
    ({"max_async_lag": -1}, "max_async_lag"),
    ({"max_async_lag": 2**62}, "max_async_lag"),
    ({"discard_partial_chunks": "no"}, "discard_partial_chunks"),
    ({"save_decode_cache": 1}, "save_decode_cache"),
    ({"strict": "false"}, "strict"),
    ({"salt": 5}, "salt"),
    ({"num_slots": True}, "num_slots"),
]


@pytest.mark.parametrize(("values", "name"), BAD)
def test_a_bad_value_is_refused_by_name(values: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TrackerConfig(**values)  # type: ignore[arg-type]


def test_the_largest_accepted_pool_costs_nothing_to_build() -> None:
    from kvledger.tracker.tracker import Tracker

    with traced_peak() as traced:
        Tracker(TrackerConfig(num_slots=2**32))
    assert traced.bytes < 1 << 20, traced.bytes


@pytest.mark.parametrize(("values", "name"), [BAD[0], BAD[6], BAD[9]])
def test_kvledger_check_refuses_a_hostile_header_with_exit_2(
    tmp_path: Path, values: dict[str, object], name: str
) -> None:
    path = tmp_path / "hostile.kvlog"
    writer = LogWriter(path, {**TrackerConfig().to_dict(), **values}, fsync="never")
    writer.end_step(0)
    writer.close()
    proc = subprocess.run(
        [sys.executable, "-m", "replay", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert name in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
