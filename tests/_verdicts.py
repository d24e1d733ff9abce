"""What ``kvledger check`` says of a recorder's log, in a form two logs can be compared by, and
a log's events with its ``StepDecoded`` entries expanded back (tracker/recorded_steps.py):
the tests that prove a steady-decode log is judged as the same run's log written in full. And
a recorder's log written event by event (``write_recorded``), for the recorder's rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

from kvledger.tracker import events as ev
from kvledger.tracker.recorded_steps import RecordedSteps


def check_replicas(*logs: str) -> tuple[int, dict[str, Any]]:
    """``kvledger check --replicas --json LOG...`` as a user runs it: its exit status and its
    JSON (whose ``exit_code`` says the same)."""
    done = subprocess.run(
        [sys.executable, "-m", "replay", "check", "--replicas", "--json", *logs],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out: dict[str, Any] = json.loads(done.stdout)
    assert out["exit_code"] == done.returncode, done.stderr
    return done.returncode, out


def write_recorded(
    path: str | os.PathLike[str],
    events: Iterable[ev.Event],
    *,
    block_size: int = 16,
    recorder_format: int | None = 2,
) -> str:
    """A log of ``events`` (a frame per step), chunks of one block; its header a recorder's
    wrapping a connector "Test" (``recorder_format`` None: kvledger's own log)."""
    from kvledger.connector.logwriter import LogWriter
    from kvledger.tracker.config import TrackerConfig

    header: dict[str, Any] = TrackerConfig(block_size=block_size, chunk_size=block_size).to_dict()
    if recorder_format is not None:
        header["recorder"] = {"format": recorder_format, "inner": "Test", "inner_class": "t.Test"}
    with LogWriter(str(path), header, fsync="never") as w:
        step = 0
        for e in events:
            if e.step != step:
                w.end_step(step)
                step = e.step
            w.append(e)
        w.end_step(step)
    return str(path)


def events_of(path: str) -> list[ev.Event]:
    from kvledger.replay.source import open_log

    return [e for frame in open_log(path).frames() for e in frame.events]


def digests_by_key(events: list[ev.Event]) -> dict[bytes, set[int]]:
    """Every digest the ``BlockDigested`` events recorded, by key (a run whose bytes are
    exact records one per key)."""
    out: dict[bytes, set[int]] = {}
    for e in events:
        if isinstance(e, ev.BlockDigested):
            for key, digest in zip(e.keys, e.digests, strict=True):
                out.setdefault(key, set()).add(digest)
    return out


def expanded(events: list[ev.Event]) -> list[ev.Event]:
    """The events, each ``StepDecoded`` replaced by the ``Scheduled`` events it stands for
    (an entry that stands for none fails the test)."""
    steps = RecordedSteps()
    out: list[ev.Event] = []
    for e in events:
        if isinstance(e, ev.StepDecoded):
            scheduled, bad = steps.expand(e)
            assert bad == [], bad
            out += scheduled
        else:
            steps.follow(e)
            out.append(e)
    return out


def verdicts(path: str, **kw: Any) -> dict[str, Any]:
    """Every problem ``check`` finds (what it names, where, and the events and states it
    shows), its exit code, and the counts that do not depend on how steps were written."""
    from kvledger.replay.replayer import check

    result = check(path, **kw)
    counts = result.counts
    return {
        "exit": result.exit_code,
        "problems": [
            (
                p.kind,
                p.name,
                p.step,
                p.req_id,
                p.detail,
                p.event,
                p.recorded,
                p.derived,
                p.before,
                p.after,
            )
            for p in result.problems
        ],
        "inputs": counts["inputs"],
        "requests": counts["requests"],
        "recorded": counts["recorded"],
        "digests": counts["digests"],
    }


def steady_entries(path: str) -> int:
    return sum(len(e.nums) for e in events_of(path) if isinstance(e, ev.StepDecoded))
