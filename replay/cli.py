"""The ``kvledger`` command: the one command-line entry point.

``demo`` runs vLLM's real scheduler with the connector (the test rigs); ``check``, ``diff``,
``show``, ``stats``, ``timeline``, ``export`` and ``sql`` read captured logs. Every subcommand parses its
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
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from replay import charts, demo, lives, summary, tail
from replay.divergence import ORDERS, DiffResult, EventAt, diff
from replay.extras import MissingExtra, Output, progress_bar
from replay.format import WIDE, elide, event_fields, format_event
from replay.logreader import newest_log
from replay.naming import RequestNotFound
from replay.source import LogUnreadable, MissingSegments, take_opened, watch_opened
from replay.steps import parse_steps
from tracker.config import ConfigError
from tracker.framing import StopInfo

if TYPE_CHECKING:  # imported when ``check`` runs: the Tracker (and structlog) cost startup
    from replay.replayer import CheckResult, Problem

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_UNREADABLE = 2
EXIT_INCOMPLETE = 3  # read without damage, but not the whole log (check's 3)


def version() -> str:
    """The installed kvledger's version (the ``pyproject.toml`` beside the packages when it
    is not installed), and which files answer to its three packages (a distribution of the
    same import name installed beside it would show here)."""
    import importlib.metadata
    import importlib.util

    try:
        number = importlib.metadata.version("kvledger")
    except importlib.metadata.PackageNotFoundError:
        number = _pyproject_version() or "unknown"
    places = []
    for name in ("tracker", "connector", "replay"):  # found, not imported (no torch, no vLLM)
        spec = importlib.util.find_spec(name)
        found = list(spec.submodule_search_locations or ()) if spec is not None else []
        places.append(f"{name} from {found[0] if found else '?'}")
    where = ", ".join(places)
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
            _json({"error": f"{self.prog}: {message}", "exit_code": EXIT_UNREADABLE})
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
    p = sub.add_parser(
        "demo", help="run vLLM's real scheduler with the connector, proven by the oracle"
    )
    demo.add_arguments(p)
    p.set_defaults(handler=_demo)
    p = sub.add_parser(
        "check",
        help="replay a log through this code: re-derive every decision, check every rule",
        description="Re-fold a captured log, re-derive every decision, run every invariant, "
        "and report each step where this code disagrees with what the run recorded.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_check_arguments(p)
    p.set_defaults(handler=run_check)
    _add_views(sub)
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


def _demo(args: argparse.Namespace) -> int:
    if args.engine:
        from replay import demo_engine  # vLLM's engine on CPU: loaded only for --engine

        return demo_engine.main(args)
    return demo.main(args)


# --- check ----------------------------------------------------------------------------------

_EPILOG = """\
exit status: 0 clean, 1 problems, 2 the log could not be read to its end,
  3 incomplete (no end record: the engine is still writing it or died; steps dropped)
examples:
  kvledger check kvledger-1234.kvlog
  kvledger check logs/ --first                  # a directory holding one log's segments
  kvledger check run.kvlog --request req-7 --json
  kvledger check run.kvlog --with chunk_size=512 --with save_decode_cache=true   # what-if
  kvledger check recorded.kvlog --differential   # a recorder's log: where kvledger differs
"""


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="a log file, the segment files of one log in order, or a directory holding them",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no prose")
    p.add_argument("--request", metavar="ID", help="report only this request's problems")
    p.add_argument("--first", action="store_true", help="stop at the first problem")
    p.add_argument(
        "--differential",
        action="store_true",
        help="on a recorder's log (KVLedgerRecorder): name each request's first lookup where "
        "the wrapped connector answered differently from kvledger on the same inputs",
    )
    p.add_argument(
        "--with",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="what-if: replay under a changed tracker config and compare the plans "
        "(chunk_size=512, save_decode_cache=true, ...; repeat --with for several)",
    )
    p.add_argument(
        "--limit",
        type=_count,
        default=20,
        metavar="N",
        help="print at most N problems in full (default 20; the summary counts all)",
    )


def _count(text: str) -> int:
    """A non-negative integer argument (argparse turns the ValueError into exit 2)."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expects 0 or more, got {n}")
    return n


def run_check(args: argparse.Namespace) -> int:
    from replay.replayer import check, parse_overrides

    try:
        overrides = parse_overrides(args.overrides)
    except ConfigError as e:
        print(f"kvledger check: --with: {e}", file=sys.stderr)
        return 2
    paths = args.logs[0] if len(args.logs) == 1 else list(args.logs)
    bar = None if args.json else progress_bar(sys.stderr, "check", unit="bytes")
    with bar if bar is not None else nullcontext():
        progress = None
        if bar is not None:
            task = bar.add_task("check", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

        result = check(
            paths,
            request=args.request,
            first=args.first,
            progress=progress,
            differential=args.differential,
            **overrides,
        )
    args.exit_code = result.exit_code  # kept if the reader of stdout goes away (main)
    if result.bad_option is not None:
        # Not the log's fault: the --with value cannot apply to this log's configuration.
        print(f"kvledger check: --with: {result.bad_option}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif result.bad_option is None:
        render(result, sys.stdout, limit=args.limit)
    if result.bad_option is None:
        # Exit 2 says on stderr why, as every command does (the report says it on stdout,
        # which a script may have sent to a file).
        if result.error is not None:
            print(f"kvledger check: {result.error}", file=sys.stderr)
        elif result.stop is not None:
            _warn_damage(", ".join(args.logs), result.stop)
    return result.exit_code


# --- check's report -------------------------------------------------------------------------


def _state_line(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "(no state: unknown yet, or finished and retired)"
    return " ".join(f"{k}={v}" for k, v in summary.items())


def _state_change(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    if after is None:
        return "(no state: finished and retired, or never added)"
    if before is None:
        return _state_line(after)
    changed = [f"{k}={v} (was {before.get(k)})" for k, v in after.items() if before.get(k) != v]
    return ", ".join(changed) if changed else "(unchanged)"


def _fmt_decisions(ds: Sequence[Any]) -> list[str]:
    return [format_event(d) for d in ds] or ["(nothing)"]


def render_problem(n: int, p: Problem, out: TextIO) -> None:
    w = out.write
    w(f"problem {n}: step {p.step}, request {elide(p.req_id) or '-'}: {elide(p.headline())}\n")
    if p.event is not None:
        w(f"  event     {format_event(p.event)}\n")
    if p.offset >= 0:
        w(f"            (event #{p.index}, frame seq {p.seq} at byte {p.offset} of {p.path})\n")
    # On a recorder's log (--differential), "recorded" is what the wrapped connector
    # answered, "derived" what kvledger answers on the same inputs.
    said, would = ("inner   ", "kvledger") if p.kind == "differential" else ("recorded", "derived ")
    if p.kind in ("decision", "unexplained") or p.recorded:
        lines = _fmt_decisions(p.recorded)
        w(f"  {said}  {lines[0]}\n")
        for line in lines[1:]:
            w(f"            {line}\n")
    if p.kind in ("decision", "violation") or p.derived:
        lines = _fmt_decisions(p.derived)
        w(f"  {would}  {lines[0]}\n")
        for line in lines[1:]:
            w(f"            {line}\n")
    if p.detail and p.kind != "error":
        w(f"  detail    {elide(p.detail, _LINE)}\n")
    w(f"  before    {_state_line(p.before)}\n")
    w(f"  after     {_state_change(p.before, p.after)}\n")


def _n(x: int) -> str:
    return f"{x:,}"


# The widest line of prose a value from a log (an error, a problem's detail) may make.
_LINE = 2 * WIDE


def render(result: CheckResult, out: TextIO, *, limit: int = 20) -> None:
    """The human report of a CheckResult."""
    w = out.write
    if result.error is not None and not result.counts:
        w(f"kvledger check: cannot check {', '.join(result.paths)}\n")
        w(f"  error     {result.error}\n")
        if result.stop is not None:
            w(f"  at        {result.stop.path}: byte offset {result.stop.offset}\n")
        w("result: unreadable (exit 2)\n")
        return
    for i, p in enumerate(result.problems[:limit], 1):
        render_problem(i, p, out)
        w("\n")
    if len(result.problems) > limit:
        w(f"... {len(result.problems) - limit} more problems (--limit N, or --json)\n\n")
    if result.what_if is not None:
        _render_what_if(result, out, limit)
    c = result.counts
    info = result.run_info
    made = [elide(f"format {info.get('major', '?')}.{info.get('minor', '?')}")]
    if "library_version" in info:
        made.append(f"kvledger {elide(str(info['library_version']))}")
    if "vllm_version" in info:
        made.append(f"vLLM {elide(str(info['vllm_version']))}")
    w("summary\n")
    w(f"  log       {', '.join(result.paths)} ({', '.join(made)})\n")
    cfg = {k: v for k, v in result.config.items() if k not in ("salt", "strict")}
    which = "   (kvledger's, for --differential)" if "recorded" in c else ""
    w(f"  config    {' '.join(f'{k}={v}' for k, v in cfg.items())}{which}\n")
    w(
        f"  read      {_n(c.get('events', 0))} events ({_n(c.get('inputs', 0))} inputs, "
        f"{_n(c.get('decisions', 0))} decisions) in {_n(c.get('steps', 0))} steps, "
        f"{_n(c.get('requests', 0))} requests (at most {c.get('peak_live_requests', 0)} live)"
        f" in {result.seconds:.2f}s\n"
    )
    rec, der = result.totals["recorded"], result.totals["derived"]
    recorder = c.get("recorded")
    if recorder is not None:  # a recorder's log: the wrapped connector's answers, judged
        inner = elide(str((result.run_info.get("recorder") or {}).get("inner", "?")))
        w(
            f"  recorder  wrapping {inner}: {_n(recorder['lookups'])} lookups answered, "
            f"{_n(recorder['loads'])} loads accepted by vLLM ({recorder['async_loads']} async)\n"
        )
        d = recorder.get("differential")
        if d is not None:
            w(
                f"  differential  {_n(d['lookups_compared'])} lookups compared with kvledger's "
                f"answer: {_n(d['lookups_differing'])} differ, in "
                f"{d['requests_differing']} requests (the first of each is reported)\n"
            )
    for label, key, plans in (
        ()
        if recorder is not None
        else (
            ("loads", "tokens_loaded", "loads"),
            ("saves", "tokens_saved", "saves"),
        )
    ):
        w(
            f"  {label}     recorded {_n(rec[key])} tokens in {rec[plans]} plans, "
            f"derived {_n(der[key])} tokens in {der[plans]} plans"
            + (
                ""
                if result.what_if is not None or (rec[key], rec[plans]) == (der[key], der[plans])
                else "  <- differs"
            )
            + "\n"
        )
    dg = c.get("digests") or {}
    if dg.get("digested") or dg.get("loaded"):
        w(
            f"  digests   {_n(dg['digested'])} blocks digested; {_n(dg['loaded'])} loaded blocks: "
            f"{_n(dg['verified'])} verified, {_n(dg['mismatched'])} mismatched, "
            f"{_n(dg['unchanged'])} unchanged, {_n(dg['unverifiable'])} unverifiable\n"
        )
    if result.recorded_violations:
        rules = Counter(v.rule for v in result.recorded_violations)
        w(
            "  recorded violations (facts of the run, applied as recorded): "
            + ", ".join(f"{elide(r)} x{n}" for r, n in rules.items())
            + "\n"
        )
        for v in result.recorded_violations[:limit]:
            w(f"            {elide(v.describe(), _LINE)}\n")
    if result.request is not None:
        w(f"  request   only {result.request}'s problems are reported")
        w(f" ({result.problems_elsewhere} elsewhere)\n" if result.problems_elsewhere else "\n")
    if result.problems_total:
        names = Counter(f"{p.name}" for p in result.problems)
        w(
            f"  problems  {result.problems_total}: "
            + ", ".join(f"{elide(k)} x{n}" for k, n in names.most_common())
            + "\n"
        )
        first = result.problems[0]
        w(
            f"  first     step {first.step}, request {elide(first.req_id) or '-'}: "
            f"{elide(first.headline())}\n"
        )
        if result.stopped_early:
            w("            (stopped there: --first)\n")
        elif result.problems_total > 1:
            w("            (later problems may be consequences of the first)\n")
    if result.stop is not None:
        s = result.stop
        w(
            f"  DAMAGED   {s.path}: byte offset {s.offset}: {s.kind}: {s.reason}\n"
            f"            every complete frame before it was checked\n"
        )
    if result.error is not None:
        w(f"  ERROR     {elide(result.error, _LINE)}\n")
    if result.incomplete is not None:
        w(f"  INCOMPLETE {result.incomplete}\n")
    elif result.stopped_by is not None:
        w(f"  ended     on {result.stopped_by}: the log was sealed when the engine was asked to "
          "stop (docs/using-with-vllm.md, How the log ends)\n")  # fmt: skip
    elif result.ending == "unknown":
        w("  ending    written before end records existed (format 1.0): whether the log is "
          "complete cannot be told\n")  # fmt: skip
    code = result.exit_code
    if code == 0 and result.what_if is not None:
        verdict = "what-if replayed: no rule broken under the changed config"
    elif code == 0 and "recorded" in result.counts:
        verdict = "clean: no rule broken by the wrapped connector"
    elif code == 0:
        verdict = "clean: every decision re-derived identically, no rule broken"
    elif code == 1:
        verdict = f"{result.problems_total} problem{'s' if result.problems_total != 1 else ''}"
    elif code == 3:
        verdict = "incomplete: no problem in what the log holds, but it is not the whole run"
    elif result.stop is None and result.error is not None:
        # Read to its end, yet not checkable as asked (--request ...).
        verdict = elide(result.error, _LINE)
    else:
        verdict = "the log could not be read to its end" + (
            f"; {result.problems_total} problems before that" if result.problems_total else ""
        )
    w(f"result: {verdict} (exit {code})\n")


def _render_what_if(result: CheckResult, out: TextIO, limit: int) -> None:
    wi = result.what_if
    assert wi is not None
    w = out.write
    changes = ", ".join(
        f"{k} {wi.recorded_config.get(k)} -> {v}"
        for k, v in wi.overrides.items()
        if wi.recorded_config.get(k) != v
    )
    w(f"what-if: {changes or 'no change'}\n")
    w("  an estimate of the plans under this config; vLLM's schedule stays as recorded\n")
    rows = sorted(wi.per_request.items())
    if result.request is not None:
        rows = [(r, v) for r, v in rows if r == result.request]
    differing = [
        (r, v)
        for r, v in rows
        if v["loaded"][0] != v["loaded"][1] or v["saved"][0] != v["saved"][1]
    ]
    differing = [(elide(r), v) for r, v in differing]
    width = max([len("request"), *(len(r) for r, _ in differing[:limit])])
    w(
        f"  {'request':<{width}}  {'loaded: recorded -> what-if':>28}  {'saved: recorded -> what-if':>27}\n"
    )
    for r, v in differing[:limit]:
        lo = f"{_n(v['loaded'][0])} -> {_n(v['loaded'][1])}"
        sa = f"{_n(v['saved'][0])} -> {_n(v['saved'][1])}"
        w(f"  {r:<{width}}  {lo:>28}  {sa:>27}\n")
    if len(differing) > limit:
        w(f"  ... {len(differing) - limit} more requests differ\n")
    same = len(rows) - len(differing)
    if same:
        w(f"  ({same} request{'s' if same != 1 else ''} with the same plans not shown)\n")
    t = wi.totals()
    lo = f"{_n(t['loaded'][0])} -> {_n(t['loaded'][1])}"
    sa = f"{_n(t['saved'][0])} -> {_n(t['saved'][1])}"
    w(f"  {'total':<{width}}  {lo:>28}  {sa:>27}\n")
    w(
        f"  divergent admissions: {wi.divergent_admissions} (vLLM accepted what the run offered;"
        " this config offers otherwise)\n"
    )
    w(
        f"  worker results replaced: {wi.worker_results_replaced} (every what-if transfer is "
        f"assumed to succeed; {wi.recorded_failures_ignored} recorded failures ignored)\n"
    )
    if wi.steps_without_token_ids:
        w(
            f"  steps without token ids: {wi.steps_without_token_ids} (steady decode steps of "
            "the run, not steady under this config;\n    their token ids are not in the log, "
            "so no chunk over them can be planned: saved is a lower bound)\n"
        )
    w("\n")


# --- diff, show, stats, timeline, export ----------------------------------------------------


def _log_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")


def _add_views(sub: Any) -> None:
    """``diff``, ``show``, ``stats``, ``timeline`` and ``export``; each sets ``handler``
    (``args -> exit status``)."""
    p = sub.add_parser(
        "diff",
        help="first divergence between two logs, overall and per request",
        description="Compare two logs request by request (aligned by id, else by prompt and "
        "arrival order) and show the first event where each request's history differs. "
        "Exit status: 0 identical, 1 different, 2 a log could not be read (to its end).",
    )
    p.add_argument("a", metavar="A", help="a log file, or a directory of one log's segments")
    p.add_argument("b", metavar="B", help="the log to compare it with")
    p.add_argument(
        "--ignore",
        action="append",
        metavar="FIELD[,FIELD]",
        help="leave these event fields out of the comparison, e.g. block_ids,slots (a comma "
        "list; the option repeats)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="strict",
        help="strict (default): every event in its order; async: a run under async scheduling "
        "against a sync one: the worker's reports compared apart from the request's progress, "
        "a lookup repeated while waiting counted once (docs/replay-commands.md)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_diff)

    p = sub.add_parser(
        "show",
        help="the requests of a log, or one request's life: each event and its state after it",
        description="Without --request: every request of the log, one line each (admissions, "
        "preemptions, tokens asked, hit in vLLM's cache, loaded from the pool, missed, check's "
        "problems, how it ended). With --request: fold the recorded events of that request "
        "and print, for each, the state after it: tokens known / num_tokens, blocks, saved "
        "watermark, loaded range, preempted, recompute_only.",
    )
    _log_argument(p)
    p.add_argument(
        "--request",
        "-r",
        metavar="ID",
        help="the request id (or part of one); without it, the list of requests",
    )
    p.add_argument(
        "--collapse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fold a lookup asked again every step with the same answer, and steady decode "
        "steps, into one row with the count and the steps (the default for text; --json "
        "gives every row unless --collapse)",
    )
    p.add_argument(
        "--type",
        action="append",
        metavar="TYPE[,TYPE]",
        help="only these event types (a comma list; the option repeats)",
    )
    p.add_argument(
        "--steps", metavar="A:B", help="only these steps: A:B (both included), A:, :B or N"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_show)

    p = sub.add_parser(
        "stats",
        help="what a log holds: requests, steps, events, hits, loads, saves, violations",
    )
    _log_argument(p)
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(handler=_stats)
    _add_explain(sub)

    p = sub.add_parser(
        "timeline",
        help="a picture that shows the bug: requests over the steps, check's problems marked "
        "(.html; .png, .svg, .pdf with kvledger[timeline])",
        description="Draw, one lane per request, waiting / running / preempted, what vLLM "
        "accepted from the pool beside what was loaded (a short load is visibly short), "
        "tokens computed and saved, and the problems kvledger check finds; above them, "
        "requests running / waiting / preempted, pool occupancy and hit rate per step. "
        "Without --request: the most telling requests (with problems first, then preempted, "
        "then by tokens computed). .html (zoom: wheel, pan: drag) needs nothing extra; "
        ".png, .svg and .pdf need matplotlib (pip install kvledger[timeline]).",
    )
    _log_argument(p)
    p.add_argument(
        "-o", "--out", required=True, metavar="FILE", help="FILE.html, .png, .svg or .pdf"
    )
    p.add_argument("--top", type=int, default=8, metavar="N", help="requests to draw (8)")
    p.add_argument(
        "--request",
        "-r",
        action="append",
        metavar="ID",
        help="draw this request (a life like id#2, or an id: all its lives); repeat it, or "
        "give a comma list",
    )
    p.add_argument("--steps", metavar="A:B", help="only steps A to B (both included; A:, :B or N)")
    p.add_argument("--json", action="store_true", help="print what was drawn as JSON")
    p.set_defaults(handler=_timeline)

    p = sub.add_parser(
        "export",
        help="the tidy tables (parquet or JSON lines), a Hive tree of many logs, or a "
        "Perfetto trace",
        description="Write the log's tidy tables (requests, admissions, saves, steps, events "
        "and one table per event type, problems: docs/sql.md), one file per table, into "
        "a directory; one table (--table) into one file; the tables of several logs into one "
        "Hive-partitioned tree (--partition run); or a Chrome / Perfetto trace (.json). "
        "The format follows the output: a directory holds parquet unless --format jsonl; "
        "OUT.parquet, OUT.jsonl, OUT.json name theirs, and --format must agree. parquet "
        "needs pyarrow (pip install kvledger[parquet]).",
        epilog=_EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="a log file, or a directory of one log's segments; several with --partition run",
    )
    p.add_argument(
        "--format",
        choices=("parquet", "jsonl", "perfetto", "otlp"),
        default=None,
        help="default: from the output (a directory: parquet; .parquet, .jsonl, .json; "
        ".otlp.json and .binpb: OpenTelemetry spans)",
    )
    p.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="OUT",
        help="DIR, TABLE.parquet / TABLE.jsonl with --table ('-': standard output), "
        "TRACE.json, or TREE with --partition run",
    )
    p.add_argument("--table", metavar="NAME", help="write only this table, to one file")
    p.add_argument(
        "--partition",
        choices=("run",),
        help="one Hive-partitioned tree for many logs: TREE/<table>/run=<name>/",
    )
    p.add_argument(
        "--no-problems",
        dest="problems",
        action="store_false",
        help="leave the problems table empty (it costs a replay, as kvledger check does)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(handler=_export)

    p = sub.add_parser(
        "sql",
        help="run SQL (DuckDB) over the tidy tables of logs, an export or a Hive tree",
        description="Run one SQL query with DuckDB, embedded, over the tidy tables (views "
        "named requests, admissions, saves, steps, events, ev_<type>, problems: docs/sql.md). "
        "SOURCE is a log, several logs (a run column is added), an export directory, or a "
        "Hive tree (kvledger export ... --partition run). Needs duckdb and pyarrow "
        "(pip install kvledger[sql]).",
        epilog=_SQL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a log, an export directory or a tree (one or more), then the query",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument(
        "--tables", action="store_true", help="list the tables and their columns (no query)"
    )
    p.add_argument(
        "--allow-files",
        action="store_true",
        help="let the query read and write files, attach databases and load extensions "
        "(DuckDB's defaults); without it a query reads the tables and nothing else",
    )
    p.set_defaults(handler=_sql)

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
        help="seconds between reads while the log is idle (0.5)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line: each step, then the end"
    )
    p.set_defaults(handler=_tail, once=False)


_EXPORT_EPILOG = """\
examples:
  kvledger export run.kvlog -o tables/                      # tables/requests.parquet, ...
  kvledger export run.kvlog -o tables/ --format jsonl       # tables/requests.jsonl, ...
  kvledger export run.kvlog --table admissions -o admissions.parquet
  kvledger export run.kvlog --table events -o -             # JSON lines on standard output
  kvledger export a.kvlog b.kvlog -o fleet/ --partition run # fleet/requests/run=a/part-0.parquet
  kvledger export run.kvlog -o run.perfetto.json            # open in ui.perfetto.dev
  kvledger export run.kvlog -o run.otlp.json                # OpenTelemetry spans (OTLP/JSON)
"""

_SQL_EPILOG = """\
examples:
  kvledger sql run.kvlog "SELECT step, sum(hit) / sum(asked) AS hit_rate
                          FROM admissions GROUP BY step ORDER BY step"
  kvledger sql fleet/ "SELECT run, count(*) FROM requests GROUP BY run" --json
  kvledger sql run.kvlog --tables
"""


# --- output ---------------------------------------------------------------------------------


def _warn_damage(name: str, *damages: StopInfo | None) -> int:
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
        status = _worse(status, EXIT_UNREADABLE if missing.before is not None else EXIT_INCOMPLETE)
    return status


def _worse(a: int, b: int) -> int:
    """The exit status that says more is wrong: 2 (unreadable) over 3 (incomplete) over 0."""
    return EXIT_UNREADABLE if EXIT_UNREADABLE in (a, b) else max(a, b)


def _fail(message: str) -> int:
    print(f"kvledger: {message}", file=sys.stderr)
    return EXIT_UNREADABLE


def _json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _guard(fn: Callable[[argparse.Namespace], int]) -> Handler:
    """Every error a command can meet: a message on stderr naming what was wrong, exit 2, no
    traceback; with ``--json``, the same error as a JSON document on stdout too."""

    def run(args: argparse.Namespace) -> int:
        try:
            with watch_opened():  # for _warn_damage: which logs lacked segment files
                return fn(args)
        except BrokenPipeError:  # the reader went away; not an output error (see main)
            raise
        except LogUnreadable as e:
            message = f"cannot read the log: {e}"
        except (RequestNotFound, MissingExtra, ValueError) as e:
            message = str(e)
        except OSError as e:  # an output path that cannot be written (no such directory, ...)
            # Name the output asked for: the file that failed may be a writer's temporary one.
            out, failed = getattr(args, "out", None), e.filename
            where = (
                f"{out}: {failed}" if out and failed and str(failed) != str(out) else out or failed
            )
            message = f"cannot write {where or 'the output'}: {e.strerror or e}"
        if getattr(args, "json", False):
            _json({"error": message, "exit_code": EXIT_UNREADABLE})
        return _fail(message)

    run.__name__ = fn.__name__
    return run


# --- tail -----------------------------------------------------------------------------------


@_guard
def _tail(args: argparse.Namespace) -> int:
    if not os.path.exists(args.log):
        raise ValueError(f"{args.log}: no such file or directory")
    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0, got {args.interval}")

    def emit(item: tail.StepNews) -> None:
        if args.json:
            print(json.dumps(item.to_dict()), flush=True)
        else:
            print(elide(item.describe(), 4 * _LINE), flush=True)

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
        print(json.dumps({"end": end.how, "steps": end.steps, "log": end.log}), flush=True)
    else:
        print(f"end: {end.how.replace('_', ' ')} after {end.steps} steps", flush=True)
    return code


# --- diff -----------------------------------------------------------------------------------


@_guard
def _diff(args: argparse.Namespace) -> int:
    ignore = [f.strip() for arg in args.ignore or () for f in arg.split(",") if f.strip()]
    result = diff(args.a, args.b, ignore=ignore, order=args.order)
    read = _worse(_warn_damage("A", result.damage_a), _warn_damage("B", result.damage_b))
    # As check: unreadable (2) first, then a difference (1), then a log not whole (3).
    code = read if read == EXIT_UNREADABLE or result.identical else EXIT_DIFFER
    args.exit_code = code  # kept if the reader of stdout goes away (main)
    if args.json:
        _json(result.to_dict())
    else:
        _print_diff(result, Output())
    return code


def _print_diff(r: DiffResult, out: Output) -> None:
    out.line(f"A: {r.a} ({r.events_a} events)")
    out.line(f"B: {r.b} ({r.events_b} events)")
    for key, (va, vb) in r.config_changes.items():
        out.line(f"config {elide(key)}: {elide(repr(va))} -> {elide(repr(vb))}", style="yellow")
    how = ", ".join(f"{n} by {k}" for k, n in r.aligned_by.items() if n)
    out.line(
        f"requests: {len(r.matched)} matched ({how or 'none'}), "
        f"{len(r.unmatched_a)} only in A, {len(r.unmatched_b)} only in B"
    )
    if r.ignored or r.order != "strict":
        out.line(f"compared: {r.order} order, ignoring {', '.join(r.ignored) or 'no field'}")
    if r.identical:
        same = (
            "the same events in the same order"
            if r.order == "strict"
            else "the same progress and the same reports (async order)"
        )
        out.line(f"identical: every request has {same}", style="green")
        return
    for side, names in (("A", r.unmatched_a), ("B", r.unmatched_b)):
        if names:
            shown = ", ".join(map(elide, names[:10])) + (
                f" (+{len(names) - 10} more)" if len(names) > 10 else ""
            )
            out.line(f"only in {side}: {shown}", style="yellow")
    first = r.first
    if first is None:
        return
    out.line()
    what = {
        "differ": f"{', '.join(first.fields)} differ",
        "missing": "B lacks A's events from here",
        "extra": "B has events A lacks from here",
    }[first.kind]
    of = "the request" if first.stream == "events" else f"its {first.stream}"
    out.line(
        f"first divergence: step {first.step}, request {elide(first.request)}, "
        f"event {first.position} of {of}: {what}",
        style="bold red",
    )
    for text in first.describe().splitlines()[1:]:
        out.line(elide(text, _LINE))
    if first.context:
        out.line("  before it, both logs agree on:")
        for c in first.context:
            out.line(f"     {elide(c.describe(), _LINE)}")
    out.line()
    renamed = any(d.request_a != d.request_b for d in r.per_request.values())
    columns = ["request", *(["in B"] if renamed else []), "kind", "event #", "step A", "step B"]
    columns += ["A", "B"]
    rows = []
    for d in r.per_request.values():
        row: list[Any] = [d.request_a, *([d.request_b] if renamed else []), d.kind, d.position]
        row += [d.step_a, d.step_b]
        row += [_brief(d.a, d.fields), _brief(d.b, d.fields)]
        rows.append(row)
    out.table(
        columns,
        rows,
        title=f"{len(r.per_request)} of {len(r.matched)} matched requests differ (earliest first)",
        right=("event #", "step A", "step B"),
    )


def _brief(at: EventAt | None, fields: Sequence[str]) -> str:
    if at is None:
        return "-"
    e = at.event
    name = type(e).__name__
    if not fields or fields == ("type",):
        return name
    parts = []
    for f in fields:
        value = event_fields(e)[f]
        text = json.dumps(value)
        parts.append(f"{f}={text if len(text) <= 24 else text[:21] + '...'}")
    return f"{name} {' '.join(parts)}"


# --- show -----------------------------------------------------------------------------------


@_guard
def _show(args: argparse.Namespace) -> int:
    if args.request is None:
        return _show_requests(args)
    types = lives.parse_types(args.type) if args.type else None
    steps = parse_steps(args.steps) if args.steps is not None else None
    life = lives.show(args.log, args.request)
    status = args.exit_code = _warn_damage(args.log, life.damage)
    chosen = lives.select(life, types, steps)
    fold = args.collapse if args.collapse is not None else not args.json  # JSON: every row
    entries: list[lives.Entry] = lives.collapse(chosen) if fold else list(chosen)
    if args.json:
        doc = life.to_dict()
        doc["rows"] = [e.to_dict() for e in entries]
        _json(doc)
        return status
    out = Output()
    c = life.config
    shown = "" if len(chosen) == len(life) else f" ({len(chosen)} shown)"
    out.line(
        f"{elide(life.request)}: {len(life)} events{shown} in {life.log} "
        f"(block_size {c.block_size}, chunk_size {c.chunk_size})"
    )
    rows = []
    styles = []
    for e in entries:
        if isinstance(e, lives.Fold):
            r = e.last
            step: Any = f"{e.first.step}-{r.step}"
            index: Any = f"{e.first.index}-{r.index}"
            event, detail = f"{e.event} x{e.steps}", e.summary()
        else:
            r = e
            step, index, event, detail = r.step, r.index, r.event, r.detail
        rows.append(
            [
                step,
                index,
                event if r.life == life.request else f"{event} ({r.life})",
                detail,
                r.phase,
                f"{r.tokens_known}/{r.num_tokens}",
                _blocks(r.block_ids),
                r.saved,
                "-"
                if r.load is None
                else f"[{r.load[0]},{r.load[1]})" + ("" if r.load_done else "*"),
                "yes" if r.preempted else "",
                "yes" if r.recompute_only else "",
            ]
        )
        styles.append("red" if r.violation else ("yellow" if r.preempted else ""))
    out.table(
        [
            "step",
            "#",
            "event",
            "detail",
            "phase",
            "known/num",
            "blocks",
            "saved",
            "load",
            "preempted",
            "recompute_only",
        ],
        rows,
        right=("step", "#", "saved", "known/num"),
        styles=styles,
    )
    out.line(
        "known/num: token ids known / tokens whose KV exists or is computing; load *: not done"
    )
    if any(isinstance(e, lives.Fold) for e in entries):
        out.line("x N: N like steps folded into one row, the state after the last (--no-collapse)")
    return status


def _show_requests(args: argparse.Namespace) -> int:
    """``show LOG``: every request, one line each, and how to see one."""
    lines, damage = lives.request_lines(args.log)
    status = args.exit_code = _warn_damage(args.log, damage)
    if args.json:
        _json({"log": str(args.log), "requests": [r.to_dict() for r in lines]})
        return status
    out = Output()
    out.line(f"{len(lines)} request{'s' if len(lines) != 1 else ''} in {args.log}")
    out.table(
        ["request", "admissions", "preempted", "prompt", "asked", "local", "loaded", "missed",
         "problems", "end"],
        [
            [r.request, r.admissions, r.preemptions, r.prompt, r.asked, r.local, r.loaded,
             r.missed, r.problems, r.end]
            for r in lines
        ],
        right=("admissions", "preempted", "prompt", "asked", "local", "loaded", "missed",
               "problems"),
        styles=["red" if r.problems else ("yellow" if r.preemptions else "") for r in lines],
    )  # fmt: skip
    out.line(
        "asked: tokens the admissions' lookups asked about; local: of them in vLLM's prefix "
        "cache; loaded: from the pool; missed: kvledger explain's; problems: kvledger check's"
    )
    if lines:
        out.line(f"one request's life: kvledger show {args.log} --request {lines[0].request}")
    return status


def _blocks(ids: Sequence[int]) -> str:
    if not ids:
        return "0"
    if len(ids) <= 6:
        return f"{len(ids)} [{' '.join(map(str, ids))}]"
    return f"{len(ids)} [{' '.join(map(str, ids[:4]))} … {ids[-1]}]"


# --- stats ----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@_guard
def _stats(args: argparse.Namespace) -> int:
    st = summary.stats(args.log)
    status = args.exit_code = _warn_damage(args.log, st.damage)
    if args.json:
        _json(st.to_dict())
        return status
    out = Output()
    files = len(st.files)
    bpe = "-" if st.bytes_per_event is None else f"{st.bytes_per_event:.1f}"
    if st.bytes_per_logical_event is not None and st.logical_events != st.events:
        bpe += (
            f" ({st.bytes_per_logical_event:.1f} per logical event: {st.logical_events}, "
            "a StepDecoded counted once per request)"
        )
    rows: list[list[Any]] = [
        ["log", f"{st.log} ({files} segment{'s' if files != 1 else ''}, {st.file_bytes} bytes)"],
        ["format", f"{st.format_version}, written by kvledger {st.library_version}"],
        ["run", st.run_id],
        ["steps", f"{st.steps} ({st.first_step}..{st.last_step}), {st.frames} frames"],
        ["wall time", "-" if st.seconds is None else f"{st.seconds:.3f} s"],
        ["events", f"{st.events} ({st.input_events} input, {st.decision_events} decisions)"],
        ["bytes per event", bpe],
        ["requests", f"{st.requests} ({st.finished} finished)"],
        ["preemptions", f"{st.preemptions} ({st.readmissions} re-admissions)"],
    ]
    for name, lk in (("first admission", st.first_lookup), ("every admission", st.all_lookups)):
        asked = f"{lk.admissions} admissions, {lk.tokens} tokens asked: "
        local = f"vLLM prefix cache {lk.local} ({_pct(lk.local_rate)})"
        accepted = f"{lk.external} ({_pct(lk.external_rate)})"
        if st.recorded:  # the wrapped connector's own hits are not in the log
            line = f"{asked}{local}, accepted from the wrapped connector {accepted}"
        else:
            pool = f"pool hit {lk.hit} ({_pct(lk.hit_rate)})"
            line = f"{asked}{pool}, {local}, loaded from the pool {accepted}"
        rows.append([f"lookups, {name}", line])
    rows += [
        [
            "loads",
            f"{st.loads} ({st.tokens_loaded} tokens), {st.loads_refused} refused, "
            f"{st.load_failures} failed",
        ],
        [
            "saves",
            f"{st.saves} ({st.tokens_saved} tokens, {st.chunks_saved} chunks), "
            f"{st.chunks_confirmed} chunks confirmed, {st.chunks_failed} failed",
        ],
        ["violations", str(st.violations_total)],
    ]
    if st.malformed:
        rows.append(
            [
                "malformed",
                f"{sum(st.malformed.values())} (events that say something impossible: "
                + ", ".join(f"{k} x{n}" for k, n in st.malformed.items())
                + ")",
            ]
        )
    dg = st.digests
    if dg.get("digested") or dg.get("loaded"):
        rows.insert(
            -1,
            [
                "digests",
                f"{dg['digested']} blocks digested; {dg['loaded']} loaded blocks: "
                f"{dg['verified']} verified, {dg['mismatched']} mismatched, "
                f"{dg['unchanged']} unchanged, {dg['unverifiable']} unverifiable",
            ],
        )
    if st.damage is not None:
        rows.append(["damage", st.damage.describe()])
    if st.config_problem:
        rows.append(["config problem", st.config_problem])
    out.table(["", "value"], rows)
    out.line()
    out.table(
        ["event", "count"],
        [[k, v] for k, v in st.events_by_type.items()],
        right=("count",),
    )
    misses = st.misses
    if misses.get("reasons"):
        out.line()
        asked = misses["tokens_asked"]
        out.table(
            ["missed tokens by reason", "tokens", "of asked"],
            [
                [r, n, _pct(n / asked if asked else None)]
                for r, n in sorted(misses["reasons"].items(), key=lambda kv: -kv[1])
            ]
            + [
                [
                    f"missed, of {asked} asked",
                    misses["missed_tokens"],
                    _pct(misses["missed_tokens"] / asked if asked else None),
                ]
            ],
            right=("tokens", "of asked"),
        )
    if st.violations:
        out.line()
        out.table(["rule", "count"], [[k, v] for k, v in st.violations.items()], right=("count",))
    if st.finish_reasons:
        out.line()
        out.table(
            ["finish reason", "count"],
            [[k, v] for k, v in st.finish_reasons.items()],
            right=("count",),
        )
    out.line()
    out.table(["config", "value"], [[k, _short(v)] for k, v in st.config.items()])
    return status


# --- explain --------------------------------------------------------------------------------


def _add_explain(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="why each prompt missed: every missed token of every lookup, with its reason",
        description="At each admission, the lookup vLLM acted on: tokens asked, tokens hit "
        "(vLLM's prefix cache, the host pool, the remote tier) and tokens missed, each with one "
        "reason derived by the tracker's rules (new prefix, diverging prefix, partial chunk, "
        "evicted, save failed or in flight, load failed, ...: docs/why-missed.md).",
    )
    _log_argument(p)
    p.add_argument(
        "--request",
        "-r",
        metavar="ID",
        help="only this request (a life like id#2, or an id: all its lives): each admission "
        "and its missed spans",
    )
    p.add_argument(
        "--limit",
        type=_count,
        default=20,
        metavar="N",
        help="requests listed in the table (default 20; --json has them all)",
    )
    p.add_argument(
        "--earlier",
        action="append",
        default=[],
        metavar="LOG",
        help="the log of an earlier run (the engine before a restart, another replica or "
        "model), read first: what it computed counts as history; repeat for several, oldest "
        "first",
    )
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.set_defaults(handler=_explain)


def _tops(reasons: dict[str, int], n: int = 3) -> str:
    top = sorted(reasons.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{r} {t}" for r, t in top[:n])
    return text + (f", +{len(top) - n} more" if len(top) > n else "")


@_guard
def _explain(args: argparse.Namespace) -> int:
    from replay import explain as ex

    result = ex.explain(args.log, request=args.request, earlier=args.earlier)
    status = args.exit_code = _warn_damage(args.log, result.damage)
    if args.json:
        _json(result.to_dict())
        return status
    out = Output()
    c = result.config
    kind = "a recorder's log" if result.recorded else "a kvledger log"
    partial = "discarded" if c.discard_partial_chunks else "kept"
    out.line(
        f"explain {result.log} ({kind}; block_size {c.block_size}, chunk_size {c.chunk_size}, "
        f"{c.num_slots} slots, partial chunks {partial})"
    )
    hits = [h for h in ex.HITS if h != ("pool" if result.recorded else "inner")]
    if result.recorded:
        hits = [h for h in hits if h != "remote"]
    if args.request is not None:
        for r in result.requests:
            for a in r.admissions:
                out.line()
                got = ", ".join(f"{h} {a.hit[h]}" for h in hits if a.hit[h])
                out.line(
                    f"{a.request} admission {a.admission} at step {a.step} (lookup at step "
                    f"{a.lookup_step}): asked {a.asked}, hit {a.tokens_hit}"
                    f"{f' ({got})' if got else ''}, missed {a.missed_tokens}"
                )
                rows = [[f"[{m.start}, {m.end})", m.tokens, m.describe()] for m in a.misses]
                if rows:
                    out.table(["tokens", "count", "why"], rows, right=("count",))
    else:
        rows = []
        for r in result.requests[: args.limit]:
            t = r.totals()
            row = [r.request, t["admissions"], t["tokens_asked"]]
            row += [t["hit"][h] for h in hits]
            row += [t["missed_tokens"], _tops(t["reasons"])]
            rows.append(row)
        columns = ["request", "adm", "asked", *(h.replace("_token", "") for h in hits)]
        columns += ["missed", "why missed (tokens)"]
        out.line()
        out.table(columns, rows, right=columns[1:-1])
        if len(result.requests) > args.limit:
            more = len(result.requests) - args.limit
            out.line(f"... {more} more requests (--limit N, --request ID, or --json)")
    t = result.totals()
    missed = t["missed_tokens"]
    if t["reasons"]:
        out.line()
        out.table(
            ["reason", "tokens", "of missed", "what it means"],
            [
                [r, n, _pct(n / missed), ex.REASONS[r]]
                for r, n in sorted(t["reasons"].items(), key=lambda kv: -kv[1])
            ],
            title="missed tokens by reason",
            right=("tokens", "of missed"),
        )
    out.line()
    asked = t["tokens_asked"]
    got = ", ".join(f"{h.replace('_', ' ')} {t['hit'][h]}" for h in hits)
    out.line(
        f"total: {asked} tokens asked at {t['admissions']} admission"
        f"{'s' if t['admissions'] != 1 else ''}: {t['tokens_hit']} hit "
        f"({got}), {missed} missed ({_pct(missed / asked if asked else None)})"
    )
    for note in result.notes():
        out.line(f"note: {note}")
    return status


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- timeline, export -----------------------------------------------------------------------


@_guard
def _timeline(args: argparse.Namespace) -> int:
    steps = None if args.steps is None else parse_steps(args.steps)
    wanted = [r.strip() for arg in args.request or () for r in arg.split(",") if r.strip()]
    if args.request is not None and not wanted:
        raise ValueError("--request takes request ids (none given)")
    result = charts.timeline(args.log, args.out, top=args.top, requests=wanted, steps=steps)
    status = _warn_damage(args.log, result.damage)
    if result.check_error:
        print(
            f"kvledger: timeline: problems incomplete: {elide(result.check_error, _LINE)}",
            file=sys.stderr,
        )
    if args.json:
        _json(result.to_dict() | {"exit_code": status})
        return status
    names = ", ".join(elide(s.label) for s in result.series)
    lo, hi = result.steps
    print(
        f"wrote {result.out}: {len(result.series)} of {result.requests} requests"
        f"{f' ({names})' if names else ''}, steps {lo}..{hi}"
    )
    names_count = Counter(m.name for s in result.series for m in s.problems)
    names_count.update(m.name for m in result.run.problems)
    marked = ", ".join(f"{elide(name)} x{n}" for name, n in names_count.most_common())
    print(
        f"problems: {result.problems_drawn} marked ({marked or 'none'}) of "
        f"{result.problems_total} check found"
    )
    for label, a in result.short_loads():
        print(
            f"short load: {elide(label)} at step {a.step}: loaded {a.loaded} of {a.accepted} "
            "accepted"
        )
    return status


@_guard
def _export(args: argparse.Namespace) -> int:
    from replay import writers

    if args.partition is not None:
        result = writers.export_runs(args.logs, args.out, args.format, problems=args.problems)
    elif len(args.logs) > 1:
        return _fail(
            "export: several logs go into one tree: add --partition run (the segments of one "
            "log: pass their directory)"
        )
    else:
        try:
            result = writers.export(
                args.logs[0], args.out, args.format, table=args.table, problems=args.problems
            )
        except BrokenPipeError:  # `kvledger export LOG --table events -o - | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
    status = _warn_damage(", ".join(args.logs), *result.damage)
    if result.check_error:
        print(f"kvledger: export: problems table incomplete: {result.check_error}", file=sys.stderr)
    where = "standard output" if result.form == "stdout" else result.out
    if args.json:
        _json(
            {
                "out": result.out,
                "format": result.format,
                "form": result.form,
                "rows": result.rows,
                "runs": list(result.runs),
                "damage": [d.describe() for d in result.damage],
                "check_error": result.check_error,
                "exit_code": status,
            }
        )
    elif result.form == "trace":
        shown = ", ".join(f"{n} {k}" for k, n in result.rows.items())
        print(f"wrote {where} (a Chrome trace, for ui.perfetto.dev): {shown}", file=sys.stderr)
    elif result.form == "otlp":
        shown = ", ".join(f"{n} {k}" for k, n in result.rows.items())
        what = "protobuf" if result.out.lower().endswith((".binpb", ".pb")) else "OTLP/JSON"
        print(f"wrote {where} (OpenTelemetry spans, {what}): {shown}", file=sys.stderr)
    else:
        what = f"{len(result.rows)} tables" if len(result.rows) > 1 else "1 table"
        runs = f", runs {', '.join(result.runs)}" if result.runs else ""
        print(
            f"wrote {result.total} rows in {what} to {where} ({result.format}{runs})",
            file=sys.stderr,
        )
    return status


@_guard
def _sql(args: argparse.Namespace) -> int:
    from replay import sql

    if args.tables:
        return _print_tables(args)
    if len(args.sources) < 2:
        return _fail('sql: give a source and a query: kvledger sql LOG "SELECT ..."')
    *sources, query = args.sources
    result = sql.query(sources, query, allow_files=args.allow_files)
    status = _warn_damage(", ".join(sources), *result.damage)
    if args.json:
        _json(result.to_dicts())
        return status
    numeric = ("INTEGER", "BIGINT", "DOUBLE", "FLOAT", "HUGEINT", "DECIMAL", "SMALLINT")
    right = [c for c, t in zip(result.columns, result.types, strict=True) if t.startswith(numeric)]
    rows = [[_cell(v) for v in row] for row in result.rows]
    Output().table(result.columns, rows, right=right)
    return status


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.6g}"
    return value


def _print_tables(args: argparse.Namespace) -> int:
    from replay.tables import TABLES

    if args.json:
        _json({t: [c._asdict() for c in cols] for t, cols in TABLES.items()})
        return EXIT_OK
    out = Output()
    for table, columns in TABLES.items():
        out.table(["column", "type", "meaning"], [list(c) for c in columns], title=table)
        out.line()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
