"""``kvledger demo --engine``: the user's first look at the connector on vLLM's real engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvledger.replay.cli import main


def test_demo_engine_prints_identical_continuations_and_a_clean_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--engine", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    without = re.findall(r"without connector: (.*)", out)
    with_kv = re.findall(r"with connector: +(.*)", out)
    assert len(without) == 3 and with_kv == without, out
    assert all(text.strip() for text in without)
    assert "second round (the same prompts again): identical" in out
    counts = dict(re.findall(r"^ +(\S[^\n]*?)  +(\S.*)$", out, re.M))
    assert int(counts["tokens loaded"]) > 0
    assert int(counts["of which on resume"]) > 0
    assert re.match(r"[1-9]\d* without, [1-9]\d* with the connector", counts["preemptions"])
    assert counts["log replay problems"] == "0"
    assert out.rstrip().splitlines()[-2].startswith("OK: ")
    assert list(tmp_path.glob("*.kvlog"))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--blocks", "3"], "--blocks must be at least 4"),
        (["--chunk-size", "48"], "--chunk-size must be a multiple of 32"),
        (["--async-scheduling"], "--async-scheduling is not available"),
    ],
)
def test_demo_engine_refuses_bad_options_up_front(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--engine", *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert says in captured.err
    assert json.loads(captured.out)["exit_code"] == 2
