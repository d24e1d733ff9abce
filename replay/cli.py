"""The ``kvledger`` command: ``demo`` and the offline tools over captured logs.

A thin layer: every subcommand parses its arguments and calls one function of the Python API
(``replay.check``, ``replay.diff``, ... or ``replay.demo.main``), which does the work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="Event-sourced KV-cache request tracking for vLLM: run the demo, or check, "
        "diff and inspect captured logs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from replay import demo

    p = sub.add_parser(
        "demo", help="run vLLM's real scheduler with the connector, proven by the oracle"
    )
    demo.add_arguments(p)
    p.set_defaults(handler=demo.main)

    _add_replay_commands(sub)
    return parser


def _add_replay_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """check, diff, show, stats, timeline, export (replay/commands.py, when present)."""
    try:
        from replay import commands
    except ImportError:
        return
    commands.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvledger show ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
