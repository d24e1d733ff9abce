"""A path naming one segment of a rotated log (``run.kvlog``, ``run.000001.kvlog``, ...) names
the whole log: every command reads every segment of it that is there (replay/source.py's
``log_files``). When some are not there (the log's start, or the segment its last one was
rotated into), every command says so on standard error and exits as ``check`` does: 2 for a
missing start, 3 for a missing end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _replay_logs import write_log

from kvledger.replay import cli
from kvledger.replay.logreader import LogReader
from kvledger.replay.source import log_files, open_log

SEGMENTS = 11  # write_log's 11 steps at rotate_bytes=600: one step a segment


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rotated log, ``run``, beside another log in the same directory (which no command on
    a path of ``run`` may read)."""
    where = tmp_path_factory.mktemp("segments")
    write_log(where / "run.kvlog", rotate_bytes=600, violation=False)
    write_log(where / "other.kvlog", violation=False, chunk_size=16)
    whole = where / "whole"  # the same log, alone in a directory of its own
    whole.mkdir()
    for p in _segments(where):
        shutil.copy(p, whole / p.name)
    return where


def _segments(where: Path, stem: str = "run") -> list[Path]:
    return sorted(where.glob(f"{stem}*.kvlog"), key=lambda p: (len(p.name), p.name))


def _events(paths: list[Path]) -> int:
    return sum(len(f.events) for f in LogReader(paths))


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _count_rows(path: Path) -> int:
    return len(path.read_text().splitlines())


def _every_command(named: Path, against: Path, out: Path, capsys) -> dict[str, tuple]:
    """Each command on ``named`` (``diff``: against ``against``): (exit status, what it
    counted, standard error)."""
    got: dict[str, tuple] = {}
    code, text, err = _run(capsys, "check", str(named), "--json")
    got["check"] = (code, json.loads(text)["counts"].get("events"), err)
    code, text, err = _run(capsys, "stats", str(named), "--json")
    got["stats"] = (code, json.loads(text)["events"], err)
    code, text, err = _run(capsys, "show", str(named), "--request", "req-b", "--json")
    got["show"] = (code, len(json.loads(text)["rows"]) if code != 2 or text else None, err)
    table = out / f"events-{named.name}.jsonl"
    code, text, err = _run(
        capsys, "export", str(named), "--table", "events", "-o", str(table), "--json"
    )
    # A log not all there is written marked partial (replay.partial): named so, and said.
    written = Path(json.loads(text)["out"])
    assert (written != table) == (json.loads(text)["partial"] is not None)
    got["export"] = (code, _count_rows(written), err, written.name)
    code, text, err = _run(capsys, "sql", str(named), "SELECT count(*) AS n FROM events", "--json")
    got["sql"] = (code, json.loads(text)[0]["n"], err)
    page = out / f"timeline-{named.name}.html"
    code, text, err = _run(capsys, "timeline", str(named), "-o", str(page), "--json")
    got["timeline"] = (code, json.loads(text)["steps"], err)
    code, text, err = _run(capsys, "tail", str(named), "--once", "--all", "--json")
    *steps, end = [json.loads(x) for x in text.splitlines()]
    got["tail"] = (code, (len(steps), end["log"]), err)
    code, text, err = _run(capsys, "diff", str(named), str(against), "--json")
    got["diff"] = (code, json.loads(text)["identical"], err)
    return got


@pytest.mark.parametrize("which", [0, 1, 5, SEGMENTS - 1])
def test_a_segment_path_reads_the_whole_log(logs: Path, tmp_path: Path, which: int, capsys) -> None:
    run = _segments(logs)
    assert len(run) == SEGMENTS
    named = run[which]
    assert log_files(named) == run  # every segment of run, none of other
    assert open_log(named).paths == run
    total = _events(run)
    req_b = sum(1 for f in LogReader(run) for e in f.events if e.req_id == "req-b")
    got = _every_command(named, logs / "whole", tmp_path, capsys)
    assert got["check"][:2] == (0, total)
    assert got["stats"][:2] == (0, total)
    assert got["show"][0] == 0 and got["show"][1] >= req_b  # (rows may add derived steps)
    assert got["export"][:2] == (0, total)
    assert got["sql"][:2] == (0, total)
    assert got["timeline"][:2] == (0, [0, SEGMENTS - 1])
    assert got["tail"][:2] == (0, (SEGMENTS, str(run[0])))  # followed from the first segment
    assert got["diff"][:2] == (0, True)
    for command, (_, _, err, *_) in got.items():
        assert "not all of it" not in err and "Traceback" not in err, command


def test_show_reads_the_same_rows_on_any_segment_path(logs: Path, capsys) -> None:
    run = _segments(logs)
    rows = set()
    for named in (run[0], run[6]):
        code, text, _ = _run(capsys, "show", str(named), "--request", "req-b", "--json")
        assert code == 0
        rows.add(json.dumps(json.loads(text)["rows"]))
    assert len(rows) == 1


def _copy(paths: list[Path], where: Path) -> Path:
    where.mkdir()
    for p in paths:
        shutil.copy(p, where / p.name)
    return where


def test_a_log_missing_its_last_segments_is_said_and_is_incomplete(
    logs: Path, tmp_path: Path, capsys
) -> None:
    """Segments 0 to 4 only (say, copied off a server mid-run): each command reads them, says
    it read 5 segments and not the rest, and exits 3, as check does for an incomplete log."""
    run = _segments(logs)
    part = _copy(run[:5], tmp_path / "part")
    got = _every_command(part / "run.kvlog", part / "run.kvlog", tmp_path, capsys)
    total = _events(run[:5])
    said = f"read 5 segments of this log, not all of it: the last one was rotated into {part}/run.000005.kvlog, which is not there"
    assert got["check"][:2] == (3, total) and "INCOMPLETE" not in got["check"][2]
    for command in ("stats", "show", "export", "sql", "timeline", "diff"):
        code, _, err, *_ = got[command]
        assert code == 3, (command, err)
        assert err.count(said) == 1, (command, err)  # once, though diff reads it twice
    assert got["stats"][1] == got["export"][1] == got["sql"][1] == total
    assert got["export"][3] == "events-run.kvlog.partial.jsonl"
    # tail follows a live log: the rotation's next segment may still come, so it waits; with
    # --once it says what it read.
    assert got["tail"][:2] == (0, (5, str(part / "run.kvlog")))


def test_a_log_missing_its_start_is_said_and_exits_2(logs: Path, tmp_path: Path, capsys) -> None:
    """Segments 6 to 10 only (old segments deleted): what is there is read, each command says
    the start is missing, and exits 2, as check does (a replay needs the log from its start)."""
    run = _segments(logs)
    part = _copy(run[6:], tmp_path / "part")
    named = part / "run.000008.kvlog"
    got = _every_command(named, named, tmp_path, capsys)
    said = "read 5 segments of this log, not all of it: segments 0 to 5 (the log's start) not there"
    assert got["check"][0] == 2
    for command in ("stats", "show", "export", "sql", "timeline", "diff"):
        code, _, err, *_ = got[command]
        assert code == 2, (command, err)
        assert said in err, (command, err)
    assert got["stats"][1] == got["export"][1] == got["sql"][1] == _events(run[6:])
    assert got["export"][3] == "events-run.000008.kvlog.partial.jsonl"
    code, (steps, first), err = got["tail"]
    assert (code, steps, first) == (2, 5, str(part / "run.000006.kvlog"))
    assert "not all of the log is there: segments 0 to 5 (the log's start) not there" in err


@pytest.mark.parametrize("once", [True, False])
def test_tail_of_a_directory_whose_log_lacks_its_start(
    logs: Path, tmp_path: Path, once: bool
) -> None:
    """The log's directory named, not one of its files: tail said "no kvledger log in ...
    yet" (and without --once waited for ever) though check and stats read the log there. It
    follows it from its first segment there, says the start is missing, and exits 2."""
    import subprocess
    import sys

    part = _copy(_segments(logs)[6:], tmp_path / "part")
    script = "import sys; from kvledger.replay.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["tail", str(part), "--all", "--json", *(["--once"] if once else [])]
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60
    )
    *steps, end = [json.loads(x) for x in proc.stdout.splitlines()]
    assert proc.returncode == 2, proc.stderr
    assert (end["end"], len(steps), end["log"]) == ("closed", 5, str(part / "run.000006.kvlog"))
    assert "not all of the log is there: segments 0 to 5 (the log's start) not there" in (
        proc.stderr
    )
    assert "no kvledger log" not in proc.stderr and "waiting" not in proc.stderr


def test_a_list_of_files_is_read_as_given(logs: Path) -> None:
    """Naming the files is choosing them: a list is never widened."""
    run = _segments(logs)
    src = open_log([run[0]])
    assert src.paths == [run[0]]
    list(src.frames())
    assert src.ending == "rotated"
    missing = src.missing_segments()
    assert missing is not None and missing.before is None and missing.after is not None
    assert Path(missing.after).name == "run.000001.kvlog"


def test_a_file_that_is_not_named_as_a_segment_is_read_alone(logs: Path, tmp_path: Path) -> None:
    """A copy under another name is a file of its own, beside the log it was copied from."""
    run = _segments(logs)
    for p in run[:3]:
        shutil.copy(p, tmp_path / p.name)
    copy = tmp_path / "run.kvlog.bak"
    shutil.copy(run[0], copy)
    assert log_files(copy) == [copy]
    assert open_log(copy).paths == [copy]
    assert log_files(tmp_path / "run.kvlog") == [tmp_path / p.name for p in run[:3]]
