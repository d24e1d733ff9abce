"""``kvledger demo``'s ending: a failure says why, a pool too small for the workload is refused
up front, a larger pool still preempts (the batch grows with it), and the ``next:`` command it
prints runs as printed, also when ``.venv/bin`` is not on PATH."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvledger.connector.testing.harness import skip_reason
from kvledger.replay import demo
from kvledger.replay.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _report(**changes: Any) -> Any:
    fields = dict(mismatches=(), violations=(), leaks=(), adapter_errors=0, requests=4, finished=4)
    return SimpleNamespace(**{**fields, **changes})


def test_a_failure_names_its_causes() -> None:
    assert demo._failures(_report(), 0) == []
    why = demo._failures(_report(violations=("v",), finished=3), 2)
    assert why == [
        "1 violations",
        "kvledger check finds 2 problems in the log",
        "1 requests did not finish",
    ]


def test_a_pool_too_small_for_one_request_is_refused(capsys: Any) -> None:
    assert main(["demo", "--blocks", "8"]) == 2
    err = capsys.readouterr().err
    assert "--blocks must be at least 13" in err and "got --blocks 8" in err


def test_the_batch_grows_with_the_pool() -> None:
    assert demo._batch_for(16) == 4  # the default demo, as documented
    assert demo._batch_for(48) * 8 > 48  # 150 requests on 48 blocks ran without preemption


def test_the_next_command_is_runnable_without_the_venv_on_path(
    monkeypatch: Any, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(ROOT)
    name = demo.command_name()
    assert name != "kvledger"
    assert subprocess.run([*shlex.split(name), "--version"], capture_output=True).returncode == 0
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert demo.command_name() == "kvledger"


@pytest.mark.vllm
@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_a_large_pool_preempts_and_the_next_line_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "replay", "demo", "--requests", "20", "--blocks", "48",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    preemptions = int(re.search(r"preemptions\s+(\d+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert preemptions > 0 and "note: no request was preempted" not in proc.stdout
    next_line = proc.stdout.splitlines()[-1]
    assert next_line.startswith("next: ") and next_line.split()[1] != "kvledger"
    again = subprocess.run(shlex.split(next_line[len("next: ") :]), env=env, cwd=ROOT)
    assert again.returncode == 0


def _strict(text: str) -> Any:
    """``text`` parsed as RFC 8259 JSON: NaN and Infinity, which Python's json writes by
    default and jq and browsers refuse, raise."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_the_json_verdict_is_strict_json(capsys: Any) -> None:
    """Either demo's ``--json`` document is the strict JSON every other ``--json`` prints: a
    figure of the run that is not finite (a ratio over nothing) becomes null."""
    args = SimpleNamespace(json=True)
    rows = [("hit rate  ", float("nan")), ("speed-up", float("inf")), ("requests", 4)]
    code = demo.verdict(args, [], rows, {"ratio": -float("inf")}, "/tmp/x.kvlog", "ok")
    doc = _strict(capsys.readouterr().out)
    assert code == 0 and doc["ok"] is True
    assert doc["summary"] == {"hit rate": None, "speed-up": None, "requests": 4}
    assert doc["ratio"] is None and doc["exit_code"] == 0
    assert demo.setup_error(args, "no vLLM", "here") == 2
    assert _strict(capsys.readouterr().out) == {"error": "no vLLM here", "exit_code": 2}
