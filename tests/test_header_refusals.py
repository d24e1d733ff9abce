"""A log header this kvledger cannot use is refused, never guessed at, by every command that
would need it: a schema table that declares a tag under another type's name (its records are
never decoded as this reader's type for the tag), and a tracker config that cannot be used
(never replaced by the defaults: every state, plan and miss reason would be another run's).
Real command lines, in process, over the replay fixture with its header rewritten."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvledger.replay.cli import main
from kvledger.replay.replayer import check
from kvledger.replay.source import ConfigUnusable, open_log
from kvledger.tracker.framing import frame_bytes

DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "replay-clean.kvlog"  # one segment, 13 requests (req-0 ... req-12)


def rewrite_header(dst: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """The fixture with its header frame changed by ``change`` (the frames after it as they
    are: a one-segment log has no chain to keep)."""
    data = CLEAN.read_bytes()
    n = struct.unpack_from("<I", data, 12)[0]  # the header frame's length, after the preamble
    header = msgpack.unpackb(data[20 : 20 + n], strict_map_key=False)
    change(header)
    packed = frame_bytes(msgpack.packb(header, use_bin_type=True))
    dst.write_bytes(data[:12] + packed + data[20 + n + 4 :])
    return dst


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- a tag declared under another type's name ---------------------------------------------


def _declare_tag_4_as(name: str) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header["schemas"][4][0] = name  # Scheduled's tag, fields as they are

    return change


@pytest.mark.parametrize("name", ["Nope", "Finished"])
def test_check_refuses_a_tag_declared_under_another_types_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    log = rewrite_header(tmp_path / "renamed.kvlog", _declare_tag_4_as(name))
    reason = f"tag 4 is declared as {name} v1 in the header; this kvledger's tag 4 is Scheduled"
    code, out, err = run(capsys, "check", str(log))
    assert code == 2
    assert "DAMAGED" in out and reason in out
    assert "clean" not in out.splitlines()[-1]
    code, out, _ = run(capsys, "check", "--json", str(log))
    doc = json.loads(out)
    assert code == doc["exit_code"] == 2
    assert doc["stop"]["kind"] == "corrupt" and reason in doc["stop"]["reason"]
    # Every reader of the log stops at the same record: no view decodes it as Scheduled.
    for command in (["stats"], ["show"], ["explain"]):
        code, _, err = run(capsys, *command, str(log))
        assert code == 2 and reason in err, (command, err)


def test_a_declared_name_that_matches_reads_as_ever(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = rewrite_header(tmp_path / "same.kvlog", _declare_tag_4_as("Scheduled"))
    assert run(capsys, "check", str(log))[0] == 0
    # A tag declared under another name that the log never uses reads too, as an unknown tag
    # the log never uses does: the error comes with a record of the tag.
    log = rewrite_header(tmp_path / "unused.kvlog", lambda h: h["schemas"][23].__setitem__(0, "X"))
    assert run(capsys, "check", str(log))[0] == 0


# --- a tracker config that cannot be used -------------------------------------------------

BAD_CONFIGS = [
    ({"chunk_size": 0}, "chunk_size must be an integer from 1 to 16777216, got 0"),
    ({"chunk_size": 17}, "chunk_size (17) must be a multiple of block_size (16)"),
    ({"chunk_size": "32"}, "chunk_size must be an integer from 1 to 16777216, got '32'"),
    ({"chunk_size": None}, "chunk_size must be an integer from 1 to 16777216, got None"),
    ({"num_slots": 0}, "num_slots must be an integer from 1 to 4294967296, got 0"),
    ({"salt": 5}, "salt must be a str, got 5"),
]
PROBLEM = "the log header's tracker config cannot be used: "


def _bad_config(tmp_path: Path, values: dict[str, Any]) -> Path:
    return rewrite_header(tmp_path / "badcfg.kvlog", lambda h: h["config"].update(values))


@pytest.mark.parametrize(("values", "reason"), BAD_CONFIGS)
def test_one_refusal_for_check_and_every_reader_of_the_config(
    tmp_path: Path, values: dict[str, Any], reason: str
) -> None:
    log = _bad_config(tmp_path, values)
    with pytest.raises(ConfigUnusable) as info:
        open_log(log).config()
    assert info.value.problem == PROBLEM + reason
    assert str(info.value) == f"{log}: {PROBLEM}{reason}"
    result = check(log)
    assert result.exit_code == 2 and result.error == info.value.problem


OUT = "{tmp}/out"  # an output path: the refusal writes nothing there

COMMANDS: dict[str, list[str]] = {
    "stats": ["stats", "{log}"],
    "explain": ["explain", "{log}"],
    "explain --earlier": ["explain", "--earlier", "{log}", str(CLEAN)],
    "show": ["show", "{log}"],
    "show --request": ["show", "-r", "req-0", "{log}"],
    "whatif": ["whatif", "{log}"],
    "whatif --with": ["whatif", "--with", "num_slots=8", "{log}"],
    "diff, as A": ["diff", "{log}", str(CLEAN)],
    "diff, as B": ["diff", str(CLEAN), "{log}"],
    "timeline": ["timeline", "-o", OUT + ".html", "{log}"],
    "export jsonl": ["export", "--format", "jsonl", "-o", OUT, "{log}"],
    "export runs": [
        "export",
        "--format",
        "jsonl",
        "--partition",
        "run",
        "-o",
        OUT,
        str(CLEAN),
        "{log}",
    ],
    "export perfetto": ["export", "-o", OUT + ".json", "{log}"],
    "export otlp": ["export", "--format", "otlp", "-o", OUT + ".otlp.json", "{log}"],
    "sql": ["sql", "{log}", "SELECT count(*) FROM steps"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_that_needs_the_config_refuses_as_check_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    if command == "sql":
        pytest.importorskip("duckdb")
    values, reason = BAD_CONFIGS[0]
    log = _bad_config(tmp_path, values)
    argv = [a.format(log=log, tmp=tmp_path) for a in COMMANDS[command]]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err == f"kvledger: {log}: {PROBLEM}{reason}\n"
    assert out == ""  # nothing shown under a configuration that is not the run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["badcfg.kvlog"]  # nothing written
    if command.split()[0] in ("stats", "explain", "show", "whatif", "diff"):
        code, out, _ = run(capsys, *argv[:1], "--json", *argv[1:])
        assert code == 2
        assert json.loads(out) == {"error": f"{log}: {PROBLEM}{reason}", "exit_code": 2}
    code, out, err = run(capsys, "check", str(log))  # check's words for the same refusal
    assert code == 2
    assert f"  error     {PROBLEM}{reason}\n" in out
    assert err == f"kvledger check: {PROBLEM}{reason}\n"


def test_tail_needs_no_config_and_shows_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values, _ = BAD_CONFIGS[0]
    log = _bad_config(tmp_path, values)
    code, out, err = run(capsys, "tail", "--once", str(log))
    assert code == 0, err
    assert out.startswith("step 0: ") and out.endswith("end: caught up after 302 steps\n")
    assert "chunk_size" not in out + err and "config" not in out
