"""What every command shares: exit statuses, the guard that turns any error into a message and
exit 2, damage and missing segments reported after a command, JSON output, argument types.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kvledger.replay.extras import MissingExtra
from kvledger.replay.format import WIDE, json_text
from kvledger.replay.naming import RequestNotFound
from kvledger.replay.source import LogUnreadable, take_opened, watch_opened
from kvledger.tracker.framing import StopInfo

__all__ = [
    "EXIT_DIFFER",
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "EXIT_UNREADABLE",
    "LINE",
    "Handler",
    "fail",
    "guard",
    "json_text",
    "log_argument",
    "non_negative",
    "print_json",
    "warn_damage",
    "worse",
]

Handler = Callable[[argparse.Namespace], int]

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_UNREADABLE = 2
EXIT_INCOMPLETE = 3  # read without damage, but not the whole log (check's 3)


# The widest line of prose a value from a log (an error, a problem's detail) may make.
LINE = 2 * WIDE


def non_negative(text: str) -> int:
    """A non-negative integer argument (argparse turns the ValueError into exit 2)."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expects 0 or more, got {n}")
    return n


def log_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")


def warn_damage(name: str, *damages: StopInfo | None) -> int:
    """Report read damage on stderr, and the logs read so far that lacked segment files
    (``LogSource.missing_segments``: a path naming one segment reads the whole log that is
    there); the exit status, as check's: 2 when a log could not be read to its end or lacks
    its start (what was read is still shown), 3 when it lacks the segment its last one was
    rotated into, else 0."""
    status = EXIT_OK
    for damage in damages:
        if damage is not None:
            print(
                f"kvledger: {name}: read stopped early: {damage.describe()}; "
                "everything before it was used",
                file=sys.stderr,
            )
            status = EXIT_UNREADABLE
    said: set[tuple[str, ...]] = set()
    for src in take_opened():
        missing = src.missing_segments()
        key = tuple(map(str, src.paths))
        if missing is None or key in said:
            continue
        said.add(key)
        print(f"kvledger: {missing.log}: {missing.describe()}", file=sys.stderr)
        status = worse(status, EXIT_UNREADABLE if missing.before is not None else EXIT_INCOMPLETE)
    return status


def worse(a: int, b: int) -> int:
    """The exit status that says more is wrong: 2 (unreadable) over 3 (incomplete) over 0."""
    return EXIT_UNREADABLE if EXIT_UNREADABLE in (a, b) else max(a, b)


def fail(message: str) -> int:
    print(f"kvledger: {message}", file=sys.stderr)
    return EXIT_UNREADABLE


def print_json(obj: Any) -> None:
    sys.stdout.write(json_text(obj, indent=2) + "\n")


def guard(fn: Callable[[argparse.Namespace], int]) -> Handler:
    """Every error a command can meet: a message on stderr naming what was wrong, exit 2, no
    traceback; with ``--json``, the same error as a JSON document on stdout too."""

    def run(args: argparse.Namespace) -> int:
        try:
            with watch_opened():  # for warn_damage: which logs lacked segment files
                return fn(args)
        except BrokenPipeError:  # the reader went away; not an output error (replay.cli.main)
            raise
        except LogUnreadable as e:
            message = f"cannot read the log: {e}"
        except (RequestNotFound, MissingExtra, ValueError) as e:
            message = str(e)
        except OSError as e:
            out, failed = getattr(args, "out", None), e.filename
            if not out:  # a command that writes no file: what failed was read
                message = f"cannot read {failed or 'the log'}: {e.strerror or e}"
            else:  # an output path that cannot be written (no such directory, ...)
                # Name the output asked for: the file that failed may be a writer's temporary
                # one.
                where = f"{out}: {failed}" if failed and str(failed) != str(out) else out
                message = f"cannot write {where}: {e.strerror or e}"
        if getattr(args, "json", False):
            print_json({"error": message, "exit_code": EXIT_UNREADABLE})
        return fail(message)

    run.__name__ = fn.__name__
    return run
