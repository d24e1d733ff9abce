"""Output is bounded on any input: a log holding 5 MB values (a request id, a cache salt, a
finish reason, a rule name and its detail, an error, a chunk key, a long block table) prints
a bounded amount through every command. Tables elide a wide cell (its head, then how long it
was); ``--json`` keeps the full value.

Before this was built, ``kvledger show`` of such a log printed hundreds of megabytes: every
row of its table was padded to the widest cell (issue 19, point 7).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.format import WIDE
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig

MB5 = 5 << 20
# What every command may print for these small logs, whatever their values hold.
BOUND = 256 << 10

WIDE_ID = "wide-" + "i" * MB5


def _wide_log(path: Path, *, recorder: bool = False) -> Path:
    """A short, otherwise ordinary life of two requests, with a 5 MB value in every text
    field an event has (and a 5 MB chunk key, and a table of 300,000 blocks)."""
    header = TrackerConfig(block_size=16, chunk_size=32, num_slots=8).to_dict()
    if recorder:
        header["recorder"] = {"format": 1, "inner": "Test", "inner_class": "t.Test"}
    prompt = tuple(range(100, 140))
    steps: list[list[ev.Event]] = [
        [ev.RequestAdded(0, "r", prompt, "s" * MB5), ev.RequestAdded(0, WIDE_ID, prompt)],
        [ev.LookupAsked(1, "r", 0, 40), ev.LookupAnswered(1, "r", 0, 0)],
        [ev.Allocated(2, "r", tuple(range(300_000)), 0)],
        [ev.ViolationRecorded(3, "r", "rule-" + "v" * MB5, "Allocated", "d" * MB5)],
        [ev.SaveDone(4, "r", (b"k" * MB5,))],
        [ev.RemoteOutage(5, "", "e" * MB5), ev.InnerRaised(5, "", "cb", "x" * MB5)],
        [ev.InnerStats(6, "", "worker", "{" + "t" * MB5)],
        [ev.Finished(7, "r", "f" * MB5), ev.Finished(7, WIDE_ID, "stopped")],
    ]
    with LogWriter(path, header, fsync="never") as w:
        for step, events in enumerate(steps):
            for e in events:
                w.append(e)
            w.end_step(step)
    return path


COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "check": lambda log, tmp: ["check", str(log)],
    "show": lambda log, tmp: ["show", str(log), "-r", "r"],
    "show --no-collapse": lambda log, tmp: ["show", str(log), "-r", "r", "--no-collapse"],
    "show, the wide id": lambda log, tmp: ["show", str(log), "-r", "wide-"],
    "show, an ambiguous part": lambda log, tmp: ["show", str(log), "-r", "i"],
    "stats": lambda log, tmp: ["stats", str(log)],
    "diff": lambda log, tmp: ["diff", str(log), str(log.with_name("other.kvlog"))],
    "timeline": lambda log, tmp: ["timeline", str(log), "-o", str(tmp / "t.html")],
    "export": lambda log, tmp: ["export", str(log), "-o", str(tmp / "tables"), "--format", "jsonl"],
    "export perfetto": lambda log, tmp: ["export", str(log), "-o", str(tmp / "trace.json")],
    "sql": lambda log, tmp: ["sql", str(log), "SELECT * FROM requests"],
    "sql, the wide columns": lambda log, tmp: [
        "sql",
        str(log),
        "SELECT * FROM ev_violation_recorded, ev_finished, ev_remote_outage, events",
    ],
    "tail --once": lambda log, tmp: ["tail", str(log), "--once"],
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(scope="module", params=[False, True], ids=["connector", "recorder"])
def wide_log(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide log of a connector or of a recorder, written once for every command (each
    is 47 MB: written per test, the file's tests wrote 2.4 GB), beside ``other.kvlog``: the
    same, one value changed, so that diff prints its divergence. No command writes to them."""
    home = tmp_path_factory.mktemp("wide")
    log = _wide_log(home / "wide.kvlog", recorder=request.param)
    (home / "other.kvlog").write_bytes(log.read_bytes().replace(b"s" * 100, b"S" * 100, 1))
    return log


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_prints_a_bounded_amount(
    command: str, wide_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(COMMANDS[command](wide_log, tmp_path), capsys)
    assert code in (0, 1, 2, 3)
    assert len(out) + len(err) < BOUND, f"{command} printed {len(out) + len(err):,} characters"


def test_a_wide_cell_says_how_wide_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _wide_log(tmp_path / "wide.kvlog")
    code, out, _ = _run(["show", str(log), "-r", "r", "--type", "RequestAdded"], capsys)
    assert code == 0
    text = "prompt 40 tokens salt=" + "s" * MB5
    said = f"… ({len(text):,} chars)"
    # The cell's head and its length, WIDE characters in all, then the next column.
    assert f"  {text[: WIDE - len(said)]}{said}  waiting  " in out, out


def test_json_keeps_the_full_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _wide_log(tmp_path / "wide.kvlog")
    code, out, _ = _run(["show", str(log), "-r", "r", "--json"], capsys)
    rows = json.loads(out)["rows"]
    assert code == 0 and any(r["detail"].endswith("s" * 1000) for r in rows)
    assert rows[[r["event"] for r in rows].index("Allocated")]["blocks"] == 300_000
    code, out, _ = _run(["check", str(log), "--json"], capsys)
    problems = json.loads(out)["problems"]
    assert code == 1 and any(p["detail"] == "d" * MB5 for p in problems)
    code, out, _ = _run(["stats", str(log), "--json"], capsys)
    assert code == 0 and json.loads(out)["finish_reasons"] == {"f" * MB5: 1, "stopped": 1}
    code, out, _ = _run(
        ["sql", str(log), "SELECT detail FROM ev_violation_recorded", "--json"], capsys
    )
    assert code == 0 and json.loads(out) == [{"detail": "d" * MB5}]
