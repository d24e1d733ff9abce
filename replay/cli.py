"""The ``kvledger`` command: the one command-line entry point.

``demo`` runs vLLM's real scheduler with the connector (the test rigs); ``check``, ``diff``,
``show``, ``stats``, ``explain``, ``whatif``, ``timeline``, ``export`` and ``sql`` read
captured logs. Every subcommand parses its
arguments, calls one function of the library (``replay.check``, ``replay.diff``,
``replay.lives.show``, ...), and turns its result into text: tables with rich on a terminal
(the ``cli`` extra, through ``replay.extras``), plain text when piped, one JSON document with
``--json``.

Exit status: ``check`` 0 clean, 1 problems, 2 the log could not be read (to its end);
``diff`` 0 identical, 1 different, 2 a log could not be read (to its end); the others 0, or 2
when a log could not be read, wholly or to its end (its readable part is still shown), when
the request is not in the log, or when an optional extra is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn

from kvledger.replay.commands import check, exports, live, views, whatif
from kvledger.replay.commands.common import EXIT_OK, EXIT_UNREADABLE, Handler, print_json

__all__ = ["build_parser", "main"]


def version() -> str:
    """The installed kvledger's version (the ``pyproject.toml`` beside the packages when it
    is not installed), and which folder answers to the import name ``kvledger`` (a
    distribution of the same import name installed beside it would show here)."""
    import importlib.metadata
    import importlib.util

    try:
        number = importlib.metadata.version("kvledger")
    except importlib.metadata.PackageNotFoundError:
        number = _pyproject_version() or "unknown"
    spec = importlib.util.find_spec("kvledger")  # found, not imported (no torch, no vLLM)
    found = list(spec.submodule_search_locations or ()) if spec is not None else []
    where = f"from {found[0] if found else '?'}"
    return f"kvledger {number} ({where})"


def _pyproject_version() -> str | None:
    """``version`` of the ``[project]`` table of the source checkout's ``pyproject.toml``
    (read with the standard library's TOML parser; None on Python 3.10, which has none)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None
    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            version = tomllib.load(f).get("project", {}).get("version")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return version if isinstance(version, str) else None


# Whether the command line being parsed asks for --json (set by main around parse_args).
_JSON_ERRORS: ContextVar[bool] = ContextVar("kvledger_json_errors", default=False)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands are of the same class), whose usage errors come
    also as a JSON document on stdout when the command line asks for ``--json``: a script
    reading stdout gets its error in every case (exit 2 and the message on stderr, as ever)."""

    def error(self, message: str) -> NoReturn:
        if _JSON_ERRORS.get():
            print_json({"error": f"{self.prog}: {message}", "exit_code": EXIT_UNREADABLE})
        super().error(message)


class _Version(argparse.Action):
    """``--version``, printed as it is (argparse's own action rewraps it)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvledger",
        description="Event-sourced KV-cache request tracking for vLLM: run the demo, or check, "
        "diff and inspect captured logs.",
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="print the version and where it runs from"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # In the order `kvledger --help` lists them; each sets its handler (args -> exit status).
    for add in (
        live.add_demo,
        check.add_check,
        views.add_diff,
        views.add_show,
        views.add_stats,
        views.add_explain,
        whatif.add_whatif,
        exports.add_timeline,
        exports.add_export,
        exports.add_sql,
        live.add_tail,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    token = _JSON_ERRORS.set("--json" in argv)
    try:
        args = parser.parse_args(argv)
    finally:
        _JSON_ERRORS.reset(token)
    handler: Handler = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # a reader that went away is seen here, not at interpreter exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvledger check ... | head -1`: the reader has what it wanted
        # Python would report the unflushed rest at exit; point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # The verdict was decided before the output was written: keep it (check's 1 stays 1).
        return int(getattr(args, "exit_code", EXIT_OK))


if __name__ == "__main__":
    sys.exit(main())
