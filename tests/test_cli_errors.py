"""Rough edges of the command line that used to give silent wrong answers or tracebacks: each
now gives a clear message on stderr naming what was wrong, exit 2 (and a JSON error with
``--json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvledger.replay.cli import main
from kvledger.replay.replayer import check

DATA = Path(__file__).resolve().parent / "data"
LOG = DATA / "replay-clean.kvlog"


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_check_of_a_request_not_in_the_log_is_not_clean(capsys: Any) -> None:
    result = check(LOG, request="nosuch")
    assert result.exit_code == 2 and result.error == "no request 'nosuch' in the log"
    code, out, err = _run(capsys, "check", str(LOG), "--request", "nosuch")
    assert code == 2 and "ERROR     no request 'nosuch' in the log" in out
    # the verdict names the cause (it said "the log could not be read to its end"), and
    # stderr says it too, as for every exit 2
    assert out.endswith("result: no request 'nosuch' in the log (exit 2)\n")
    assert err == "kvledger check: no request 'nosuch' in the log\n"
    assert check(LOG, request="req-1").exit_code == 0


def test_export_takes_the_format_from_the_extension(capsys: Any, tmp_path: Path) -> None:
    argv = ["export", str(LOG), "--table", "events", "-o"]
    code, _, _ = _run(capsys, *argv, str(tmp_path / "rows.jsonl"))
    assert code == 0 and (tmp_path / "rows.jsonl").read_text().startswith("{")
    # .parquet is parquet (or a clear "install the extra"), never JSON lines in a .parquet file
    code, _, err = _run(capsys, *argv, str(tmp_path / "rows.parquet"))
    assert (tmp_path / "rows.parquet").exists() == (code == 0)
    if code:
        assert code == 2 and "pip install kvledger[parquet]" in err
    else:
        assert (tmp_path / "rows.parquet").read_bytes()[:4] == b"PAR1"
    code, _, err = _run(capsys, *argv, str(tmp_path / "x.parquet"), "--format", "jsonl")
    assert code == 2 and "names parquet, but the format asked for is jsonl" in err
    assert not (tmp_path / "x.parquet").exists()
    code, _, err = _run(capsys, *argv, str(tmp_path / "rows.txt"))
    assert code == 2 and "cannot tell the format" in err


@pytest.mark.parametrize("command", ["export", "timeline"])
def test_an_output_that_cannot_be_written_is_a_clear_error(
    capsys: Any, tmp_path: Path, command: str
) -> None:
    ext = "jsonl" if command == "export" else "html"
    table = ["--table", "events"] if command == "export" else []
    for out in (tmp_path / "missing-dir" / f"x.{ext}", tmp_path):
        code, _, err = _run(capsys, command, str(LOG), *table, "-o", str(out))
        assert code == 2 and err.startswith("kvledger: ") and str(out) in err


def test_timeline_names_every_format_it_writes(capsys: Any, tmp_path: Path) -> None:
    code, _, err = _run(capsys, "timeline", str(LOG), "-o", str(tmp_path / "x.jpg"))
    assert code == 2 and ".html, .png, .svg or .pdf" in err


@pytest.mark.parametrize("argv", [["stats"], ["show", "-r", "req-1"]])
def test_json_commands_print_a_json_error(capsys: Any, tmp_path: Path, argv: list[str]) -> None:
    missing = tmp_path / "missing.kvlog"
    code, out, err = _run(capsys, argv[0], str(missing), *argv[1:], "--json")
    assert code == 2 and "no such file" in err
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and "no such file" in doc["error"]


@pytest.mark.parametrize(
    "argv",
    [
        ["check"],
        ["stats"],
        ["show", "-r", "req-1"],
        ["export", "--table", "events", "-o", "out.jsonl"],
        ["diff", "B"],
    ],
)
def test_an_empty_file_is_called_empty(capsys: Any, tmp_path: Path, argv: list[str]) -> None:
    # It read "unreadable header: ...: offset 0: torn_tail: the data ends inside the preamble
    # (0 bytes)": damage to investigate, when nothing was ever written.
    empty = tmp_path / "empty.kvlog"
    empty.write_bytes(b"")
    rest = [str(LOG) if a == "B" else str(tmp_path / a) if a == "out.jsonl" else a for a in argv]
    code, out, err = _run(capsys, rest[0], str(empty), *rest[1:])
    assert code == 2
    assert f"{empty}: empty file (0 bytes)" in err
    assert "torn_tail" not in out + err and "header" not in out + err


SHORT = DATA / "replay-short-load.kvlog"


def test_a_negative_limit_is_a_usage_error(capsys: Any) -> None:
    # problems[:-1] printed all but one and then "... 1 more problems", even on a clean log
    with pytest.raises(SystemExit) as e:
        main(["check", str(LOG), "--limit", "-1"])
    assert e.value.code == 2 and "--limit: expects 0 or more, got -1" in capsys.readouterr().err
    code, out, _ = _run(capsys, "check", str(SHORT), "--limit", "0")
    assert code == 1 and "problem 1:" not in out and "... 6 more problems" in out


def test_a_what_if_the_log_refuses_is_a_bad_option(capsys: Any) -> None:
    code, out, err = _run(capsys, "check", str(LOG), "--with", "chunk_size=250")
    assert code == 2 and out == ""
    assert err == "kvledger check: --with: chunk_size (250) must be a multiple of block_size (16)\n"
    assert "unreadable" not in out + err
    code, out, _ = _run(capsys, "check", str(LOG), "--with", "chunk_size=250", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["bad_option"].startswith("chunk_size (250)")


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["check", str(SHORT)], 1),
        (["check", str(LOG)], 0),
        (["check", str(SHORT), "--json"], 1),
        (["diff", str(LOG), str(SHORT)], 1),
        (["stats", str(SHORT)], 0),
        (["show", str(SHORT), "-r", "req-2"], 0),
    ],
)
def test_a_reader_that_goes_away_keeps_the_exit_status(argv: list[str], code: int) -> None:
    # `kvledger check LOG | head -1`: the pipe breaks while the report is written; the exit
    # status is still the verdict, and no traceback or "Exception ignored" reaches stderr.
    import subprocess
    import sys

    script = "import sys; from kvledger.replay.cli import main; sys.exit(main(sys.argv[1:]))"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: the break is certain
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *argv], stdout=write_end, stderr=subprocess.PIPE
        )
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken" not in err


def _subcommands() -> dict[str, Any]:
    import argparse

    from kvledger.replay.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_takes_json() -> None:
    # debugging.md: "every command takes --json"; timeline, export and demo did not.
    lacking = [
        name
        for name, sub in _subcommands().items()
        if not any("--json" in a.option_strings for a in sub._actions)
    ]
    assert lacking == []


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "--json"],  # LOG missing
        ["check", str(LOG), "--limit", "-1", "--json"],
        ["show", "--json"],  # LOG missing
        ["demo", "--blocks", "2", "--json"],  # refused before vLLM is imported
    ],
)
def test_a_usage_error_under_json_is_a_json_error(capsys: Any, argv: list[str]) -> None:
    # argparse's errors went to stderr only: a script reading --json's stdout got nothing.
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and doc["error"].startswith(f"kvledger {argv[0]}")
    assert doc["error"].split(": ", 1)[1] in err


def test_an_unwritable_output_is_named_as_asked(capsys: Any, tmp_path: Path) -> None:
    # It named only the writer's temporary file (/proc/.kvledger-export-xxxx), never -o's.
    out = "/proc/kvledger-test.jsonl"  # /proc takes no new files, even for root
    code, _, err = _run(capsys, "export", str(LOG), "--table", "events", "-o", out)
    assert code == 2 and err.startswith(f"kvledger: cannot write {out}")


@pytest.mark.parametrize("interval", ["inf", "1e308", "nan", "0", "-inf"])
def test_tail_takes_a_finite_interval(capsys: Any, interval: str) -> None:
    # inf and 1e308 ended in time.sleep's OverflowError (a traceback); nan in "Invalid value
    # NaN (not a number)" after the steps were printed.
    code, out, err = _run(capsys, "tail", str(LOG), "--once", f"--interval={interval}")
    assert code == 2 and out == ""
    assert err.startswith("kvledger: --interval must be a finite number of seconds > 0")
    assert err.rstrip().endswith(f"got {float(interval)}")


def test_an_empty_request_names_no_request(capsys: Any, tmp_path: Path) -> None:
    # check --request '' matched the events about no request (req_id "") and called a log
    # with a problem clean (exit 0); show and explain called '' ambiguous.
    said = "no request '' in the log: an empty id names no request"
    assert check(SHORT, request="").exit_code == 2 and check(SHORT, request="").error == said
    code, out, err = _run(capsys, "check", str(SHORT), "--request", "")
    assert code == 2 and out.endswith(f"result: {said} (exit 2)\n")
    assert err == f"kvledger check: {said}\n"
    code, out, _ = _run(capsys, "check", str(SHORT), "--request", "", "--json")
    assert code == 2 and json.loads(out)["error"] == said
    for argv in (["show", "-r", ""], ["explain", "-r", ""]):
        code, _, err = _run(capsys, argv[0], str(SHORT), *argv[1:])
        assert (code, err) == (2, f"kvledger: {said}\n"), argv
    code, _, err = _run(capsys, "timeline", str(SHORT), "-r", "", "-o", str(tmp_path / "t.html"))
    assert code == 2 and "--request takes request ids (none given)" in err


def test_check_replicas_says_why_a_log_could_not_be_checked(capsys: Any, tmp_path: Path) -> None:
    # It printed "kvledger check: cannot check B" and the reason on stdout only, nothing on
    # stderr, then "result: consistent across the replicas (exit 2)".
    missing = tmp_path / "missing.kvlog"
    code, out, err = _run(capsys, "check", "--replicas", str(LOG), str(missing))
    assert code == 2
    assert err == f"kvledger check: {missing}: no such file or directory\n"
    assert out.endswith(
        "result: consistent across the replicas; 1 of the 2 logs could not be checked (exit 2)\n"
    )
    code, out, err = _run(capsys, "check", "--replicas", str(LOG), str(missing), "--json")
    assert code == 2 and json.loads(out)["exit_code"] == 2
    assert err == f"kvledger check: {missing}: no such file or directory\n"


@pytest.mark.parametrize(
    "argv", [["stats"], ["check"], ["show", "-r", "req-1"], ["tail", "--once"], ["tail"]]
)
def test_a_log_that_is_not_a_regular_file_is_refused(tmp_path: Path, argv: list[str]) -> None:
    # A pipe (`kvledger stats <(cat run.kvlog)`) read as "cannot write the output: Illegal
    # seek"; a FIFO with no writer hung every command. Run as a user runs it: a hang fails.
    import subprocess
    import sys

    script = "import sys; from kvledger.replay.cli import main; sys.exit(main(sys.argv[1:]))"
    fifo = tmp_path / "run.kvlog"
    os.mkfifo(fifo)
    read_end, write_end = os.pipe()
    os.write(write_end, LOG.read_bytes()[:4096])  # what <(cat run.kvlog) holds, in part
    os.close(write_end)
    try:
        for log in (str(fifo), f"/dev/fd/{read_end}"):
            proc = subprocess.run(
                [sys.executable, "-c", script, argv[0], log, *argv[1:]],
                pass_fds=(read_end,),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert f"{log}: not a regular file (a pipe or FIFO): a log must be a regular file" in (
                proc.stderr
            )
            assert "cannot write" not in proc.stderr
    finally:
        os.close(read_end)


def test_an_error_reading_is_not_called_an_output_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A command that writes no file and meets an OSError met it reading (a disk error under
    the log): said as a read, naming the file; a command with an output names its output."""
    import argparse
    import errno

    from kvledger.replay.commands.common import guard

    @guard
    def reads(args: argparse.Namespace) -> int:
        raise OSError(errno.EIO, "Input/output error", "run.kvlog")

    assert reads(argparse.Namespace(json=False)) == 2
    assert capsys.readouterr().err == "kvledger: cannot read run.kvlog: Input/output error\n"
    assert reads(argparse.Namespace(json=False, out="t.html")) == 2
    assert capsys.readouterr().err == (
        "kvledger: cannot write t.html: run.kvlog: Input/output error\n"
    )


# --- values read from a log reach the terminal escaped ----------------------------------------

_HOSTILE = {
    # an OSC that sets the window title, a screen clear, a carriage return
    "escapes": ("\x1b]0;pwned\x07\x1b[2J", "\r", "\\x1b]0;pwned\\x07\\x1b[2J", "\\r"),
    # a newline broke show's table into rows of nothing
    "newline": ("", "\nX", "", "\\nX"),
}


def _raw_controls(text: str) -> list[str]:
    """The control characters of ``text`` (C0, DEL, C1) but the newlines ending its lines."""
    return [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0)]


@pytest.mark.parametrize("kind", sorted(_HOSTILE))
def test_control_characters_from_a_log_are_printed_escaped(
    capsys: Any, tmp_path: Path, kind: str
) -> None:
    from _replay_logs import write_log

    head, tail, shown_head, shown_tail = _HOSTILE[kind]
    log = str(tmp_path / "run.kvlog")
    write_log(log, rename=lambda rid: f"{head}{rid}{tail}")
    raw, shown = f"{head}req-d{tail}", f"{shown_head}req-d{shown_tail}"
    html = str(tmp_path / "t.html")
    for argv in (
        ["check", log],
        ["check", log, "--request", "q-d"],
        ["show", log],
        ["show", log, "-r", "q-d"],
        ["explain", log],
        ["explain", log, "-r", "q-d"],
        ["stats", log],
        ["tail", "--once", log],
        ["timeline", log, "-o", html],
        ["show", log, "-r", "req"],  # ambiguous: the message names the ids
    ):
        _, out, err = _run(capsys, *argv)
        assert not _raw_controls(out + err) and raw not in out + err, argv
        assert shown in out + err or argv[0] in ("stats", "timeline"), argv
    # the table keeps one line per request
    _, out, _ = _run(capsys, "show", log)
    assert [line.split()[0] for line in out.splitlines()[2:6]] == [
        f"{shown_head}req-{c}{shown_tail}" for c in "abcd"
    ]
    # --json keeps every value exact: JSON escapes what it must
    _, out, _ = _run(capsys, "show", log, "--json")
    assert [r["request"] for r in json.loads(out)["requests"]][3] == raw


def test_sql_text_output_escapes_control_characters(capsys: Any, tmp_path: Path) -> None:
    pytest.importorskip("duckdb")
    from _replay_logs import write_log

    log = str(tmp_path / "run.kvlog")
    write_log(log, rename=lambda rid: f"\x1b[2J{rid}\n")
    query = "SELECT request FROM requests ORDER BY request"
    code, out, _ = _run(capsys, "sql", log, query)
    assert code == 0 and not _raw_controls(out)
    assert out.splitlines() == ["request", *(f"\\x1b[2Jreq-{c}\\n" for c in "abcd")]
    code, out, _ = _run(capsys, "sql", log, query, "--json")
    assert code == 0 and json.loads(out)[0] == {"request": "\x1b[2Jreq-a\n"}


# --- check --request names a request as show, explain and timeline do -------------------------


def test_check_request_takes_a_part_of_one_id(capsys: Any, tmp_path: Path) -> None:
    # check said "no request 'q-d' in the log" where show, explain and timeline found req-d.
    from _replay_logs import write_log

    log = str(tmp_path / "run.kvlog")
    write_log(log)  # req-a .. req-d; req-d accepts more than offered (a problem)
    result = check(log, request="q-d")
    assert (result.exit_code, result.request, result.error) == (1, "req-d", None)
    assert [p.req_id for p in result.problems] == ["req-d"]
    code, out, err = _run(capsys, "check", log, "--request=q-d")
    assert code == 1 and err == "" and "step 7, request req-d: rule accepted_equals_answer" in out
    code, out, _ = _run(capsys, "check", log, "--request=q-d", "--json")
    assert code == 1 and json.loads(out)["request"] == "req-d"
    assert check(log, request="q-a").exit_code == 0  # req-a's problems: none
    # several ids contain it, or none: exit 2, the ids that contain it or the nearest
    ambiguous = "request 'req' is ambiguous: req-a, req-b, req-c, req-d"
    code, out, err = _run(capsys, "check", log, "--request=req")
    assert code == 2 and err == f"kvledger check: {ambiguous}\n"
    assert out.endswith(f"result: {ambiguous} (exit 2)\n")
    code, out, _ = _run(capsys, "check", log, "--request=req", "--json")
    assert code == 2 and json.loads(out)["error"] == ambiguous
    code, _, err = _run(capsys, "check", log, "--request=rex-d")
    assert code == 2 and err.startswith(
        "kvledger check: no request 'rex-d' in the log; nearest: req-d"
    )
    # the same rule as show's
    code, _, err = _run(capsys, "show", log, "-r", "req")
    assert code == 2 and err == f"kvledger: {ambiguous}\n"


def test_check_request_on_a_recorders_log_takes_a_part_of_one_id(
    capsys: Any, tmp_path: Path
) -> None:
    from test_check_malformed import PROMPT
    from test_check_malformed import _write as write_steps

    from kvledger.tracker import events as ev

    added = [ev.RequestAdded(0, rid, PROMPT) for rid in ("req-alpha", "req-beta")]
    log = str(write_steps(tmp_path / "rec.kvlog", [added], recorder=True))
    result = check(log, request="alpha")
    assert (result.exit_code, result.request, result.error) == (0, "req-alpha", None)
    code, out, _ = _run(capsys, "check", log, "--request", "beta", "--json")
    assert code == 0 and json.loads(out)["request"] == "req-beta"
    ambiguous = "request 'req' is ambiguous: req-alpha, req-beta"
    code, _, err = _run(capsys, "check", log, "--request", "req")
    assert code == 2 and err == f"kvledger check: {ambiguous}\n"
    code, _, err = _run(capsys, "check", log, "--request", "")
    assert code == 2 and "an empty id names no request" in err
