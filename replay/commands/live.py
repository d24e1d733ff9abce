"""The commands about a running engine: ``demo`` runs one (vLLM's scheduler, or with
``--engine`` vLLM's engine on CPU) and checks its log; ``tail`` follows the log one is writing."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvledger.replay import demo, tail
from kvledger.replay.commands.common import EXIT_OK, EXIT_UNREADABLE, LINE, guard, json_text
from kvledger.replay.format import elide
from kvledger.replay.logreader import newest_log
from kvledger.replay.source import MissingSegments, not_a_file

__all__ = ["add_demo", "add_tail"]


def add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="run vLLM's real scheduler with the connector, proven by the oracle"
    )
    demo.add_arguments(p)
    p.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.engine:
        from kvledger.replay import demo_engine  # vLLM's engine on CPU: loaded only for --engine

        return demo_engine.main(args)
    return demo.main(args)


def add_tail(sub: Any) -> None:
    p = sub.add_parser(
        "tail",
        help="follow a live log: per step hits, loads, saves and new violations",
        description="Follow the log an engine is writing (rotation included): a line per step "
        "that looked up, loaded, saved, had a transfer confirmed or failed, or broke a rule. "
        "Stops when the engine closes the log, or on Ctrl-C (exit 0). "
        "Exit status: 0, or 2 when the log is damaged or (with --once) not there.",
    )
    p.add_argument(
        "log",
        metavar="LOG_DIR",
        help="a log directory (its newest log; waits for one to appear), or a log's first file",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--follow",
        action="store_false",
        dest="once",
        help="keep reading as the log grows, until it is closed or Ctrl-C (the default)",
    )
    when.add_argument("--once", action="store_true", help="print what is written so far, then exit")
    p.add_argument(
        "--all", action="store_true", help="show quiet steps too (steady decode, nothing else)"
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between reads while the log is idle (0.5; at most a day)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line: each step, then the end"
    )
    p.set_defaults(handler=_tail, once=False)


# --- tail -----------------------------------------------------------------------------------

# The longest --interval: a day between reads of an idle log (time.sleep refuses much more).
_MAX_INTERVAL = 86400.0


@guard
def _tail(args: argparse.Namespace) -> int:
    if not os.path.exists(args.log):
        raise ValueError(f"{args.log}: no such file or directory")
    why = not_a_file(args.log)
    if why is not None:  # a FIFO: opening it waited for ever for a writer
        raise ValueError(why)
    if not 0 < args.interval <= _MAX_INTERVAL:  # also nan; inf overflowed time.sleep
        raise ValueError(
            f"--interval must be a finite number of seconds > 0 and at most {_MAX_INTERVAL:g} "
            f"(a day), got {args.interval}"
        )

    def emit(item: tail.StepNews) -> None:
        if args.json:
            print(json_text(item.to_dict()), flush=True)
        else:
            print(elide(item.describe(), 4 * LINE), flush=True)

    def started(follower: Any) -> None:
        run = elide(str((follower.header or {}).get("run_id", "?")))
        print(f"kvledger: following {follower.first} (run {run})", file=sys.stderr, flush=True)
        if follower.missing_start is not None:  # what check says: exit 2 at the end
            why = MissingSegments(str(follower.first), 0, before=follower.missing_start).why()
            print(
                f"kvledger: {follower.first}: not all of the log is there: {why}", file=sys.stderr
            )

    if os.path.isdir(args.log) and not args.once and newest_log(args.log) is None:
        print(f"kvledger: waiting for a log in {args.log}", file=sys.stderr, flush=True)
    end = tail.follow(
        args.log,
        emit,
        once=args.once,
        interval=args.interval,
        quiet_steps=args.all,
        on_start=started,
    )
    code = EXIT_UNREADABLE if end.how in ("damage", "no_log") else EXIT_OK
    if end.missing_start is not None:
        code = EXIT_UNREADABLE
    if end.how == "damage" and end.stop is not None:
        print(f"kvledger: {end.log}: {end.stop.describe()}", file=sys.stderr)
    elif end.how == "no_log":
        print(f"kvledger: no kvledger log in {args.log} yet", file=sys.stderr)
    if args.json:
        print(json_text({"end": end.how, "steps": end.steps, "log": end.log}), flush=True)
    else:
        print(f"end: {end.how.replace('_', ' ')} after {end.steps} steps", flush=True)
    return code
