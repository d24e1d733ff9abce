"""``kvledger check``: the command-line face of :func:`replay.check`.

    kvledger check LOG... [--json] [--request ID] [--first] [--with KEY=VALUE]... [--limit N]

Exit status: 0 clean, 1 problems found, 2 the log could not be read to its end (a torn tail,
a corrupt frame, not a log, an unknown format version; what was readable was still checked and
is reported). ``register(sub)`` also adds the inspection commands of ``replay.views_cli``
(``show``, ``stats``, ``diff``, ``timeline``, ``export``) when that module is present.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections import Counter
from contextlib import nullcontext
from typing import Any, TextIO

import attrs

__all__ = ["add_check_arguments", "format_event", "register", "render", "run_check"]

_EPILOG = """\
exit status: 0 clean, 1 problems, 2 the log could not be read to its end
examples:
  kvledger check kvledger-1234.kvlog
  kvledger check logs/ --first                  # a directory holding one log's segments
  kvledger check run.kvlog --request req-7 --json
  kvledger check run.kvlog --with chunk_size=512 --with save_decode_cache=true   # what-if
"""


def register(sub: Any) -> None:
    """Add ``check`` (and the commands of ``replay.views_cli`` when present) to the
    ``kvledger`` subparsers."""
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
    try:
        from replay import views_cli
    except ImportError:
        return
    views_cli.register(sub)


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
        type=int,
        default=20,
        metavar="N",
        help="print at most N problems in full (default 20; the summary counts all)",
    )


def run_check(args: argparse.Namespace) -> int:
    from replay.replayer import check, parse_overrides
    from tracker.config import ConfigError

    try:
        overrides = parse_overrides(args.overrides)
    except ConfigError as e:
        print(f"kvledger check: --with: {e}", file=sys.stderr)
        return 2
    paths = args.logs[0] if len(args.logs) == 1 else list(args.logs)
    bar = None if args.json else _progress_bar(sys.stderr)
    with bar if bar is not None else nullcontext():
        progress = None
        if bar is not None:
            task = bar.add_task("check", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

        result = check(
            paths, request=args.request, first=args.first, progress=progress, **overrides
        )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, sys.stdout, limit=args.limit)
    return result.exit_code


def _progress_bar(stream: TextIO) -> Any:
    """A rich progress bar on a terminal; None when piped (or rich is missing)."""
    if not stream.isatty():
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    except ImportError:
        return None
    return Progress(
        TextColumn("[bold]check"),
        BarColumn(),
        DownloadColumn(),
        console=Console(file=stream),
        transient=True,
    )


# --- human output -------------------------------------------------------------------------


def _value(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        return v.hex()[:8]
    if isinstance(v, enum.Enum):
        return v.name.lower()
    if isinstance(v, tuple):
        if name in ("prompt_token_ids", "token_ids") and len(v) > 8:
            return f"({len(v)} ids: {', '.join(map(str, v[:4]))}, ...)"
        items = [_value(name, x) for x in v[:12]]
        more = f", ... ({len(v)} in all)" if len(v) > 12 else ""
        return "[" + ", ".join(items) + more + "]"
    return repr(v) if isinstance(v, str) else str(v)


def _is_default(field: Any, value: Any) -> bool:
    default = field.default
    if default is attrs.NOTHING:
        return False
    if field.converter is not None and callable(field.converter):
        default = field.converter(default)
    return bool(value == default) and type(value) is type(default)


def format_event(event: Any) -> str:
    """``Scheduled num_computed=0 num_scheduled=49 ... admission=resumed``: the fields but
    ``step``, ``req_id`` and those at their default; chunk keys as their first 8 hex digits,
    long token lists cut."""
    if event is None:
        return "-"
    fields = [
        f"{f.name}={_value(f.name, getattr(event, f.name))}"
        for f in attrs.fields(type(event))
        if f.name not in ("step", "req_id") and not _is_default(f, getattr(event, f.name))
    ]
    return " ".join([type(event).__name__, *fields])


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


def _fmt_decisions(ds: tuple[Any, ...]) -> list[str]:
    return [format_event(d) for d in ds] or ["(nothing)"]


def render_problem(n: int, p: Any, out: TextIO) -> None:
    w = out.write
    w(f"problem {n}: step {p.step}, request {p.req_id or '-'}: {p.headline()}\n")
    if p.event is not None:
        w(f"  event     {format_event(p.event)}\n")
    if p.offset >= 0:
        w(f"            (event #{p.index}, frame seq {p.seq} at byte {p.offset} of {p.path})\n")
    if p.kind in ("decision", "unexplained") or p.recorded:
        lines = _fmt_decisions(p.recorded)
        w(f"  recorded  {lines[0]}\n")
        for line in lines[1:]:
            w(f"            {line}\n")
    if p.kind in ("decision", "violation") or p.derived:
        lines = _fmt_decisions(p.derived)
        w(f"  derived   {lines[0]}\n")
        for line in lines[1:]:
            w(f"            {line}\n")
    if p.detail and p.kind != "error":
        w(f"  detail    {p.detail}\n")
    w(f"  before    {_state_line(p.before)}\n")
    w(f"  after     {_state_change(p.before, p.after)}\n")


def _n(x: int) -> str:
    return f"{x:,}"


def render(result: Any, out: TextIO, *, limit: int = 20) -> None:
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
    made = [f"format {info.get('major', '?')}.{info.get('minor', '?')}"]
    if "library_version" in info:
        made.append(f"kvledger {info['library_version']}")
    if "vllm_version" in info:
        made.append(f"vLLM {info['vllm_version']}")
    w("summary\n")
    w(f"  log       {', '.join(result.paths)} ({', '.join(made)})\n")
    cfg = {k: v for k, v in result.config.items() if k not in ("salt", "strict")}
    w(f"  config    {' '.join(f'{k}={v}' for k, v in cfg.items())}\n")
    w(
        f"  read      {_n(c.get('events', 0))} events ({_n(c.get('inputs', 0))} inputs, "
        f"{_n(c.get('decisions', 0))} decisions) in {_n(c.get('steps', 0))} steps, "
        f"{_n(c.get('requests', 0))} requests (at most {c.get('peak_live_requests', 0)} live)"
        f" in {result.seconds:.2f}s\n"
    )
    rec, der = result.totals["recorded"], result.totals["derived"]
    for label, key, plans in (
        ("loads", "tokens_loaded", "loads"),
        ("saves", "tokens_saved", "saves"),
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
    if result.recorded_violations:
        rules = Counter(v.rule for v in result.recorded_violations)
        w(
            "  recorded violations (facts of the run, applied as recorded): "
            + ", ".join(f"{r} x{n}" for r, n in rules.items())
            + "\n"
        )
        for v in result.recorded_violations[:limit]:
            w(f"            {v.describe()}\n")
    if result.request is not None:
        w(f"  request   only {result.request}'s problems are reported")
        w(f" ({result.problems_elsewhere} elsewhere)\n" if result.problems_elsewhere else "\n")
    if result.problems_total:
        names = Counter(f"{p.name}" for p in result.problems)
        w(
            f"  problems  {result.problems_total}: "
            + ", ".join(f"{k} x{n}" for k, n in names.most_common())
            + "\n"
        )
        first = result.problems[0]
        w(f"  first     step {first.step}, request {first.req_id or '-'}: {first.headline()}\n")
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
        w(f"  ERROR     {result.error}\n")
    code = result.exit_code
    if code == 0 and result.what_if is not None:
        verdict = "what-if replayed: no rule broken under the changed config"
    elif code == 0:
        verdict = "clean: every decision re-derived identically, no rule broken"
    elif code == 1:
        verdict = f"{result.problems_total} problem{'s' if result.problems_total != 1 else ''}"
    else:
        verdict = "the log could not be read to its end" + (
            f"; {result.problems_total} problems before that" if result.problems_total else ""
        )
    w(f"result: {verdict} (exit {code})\n")


def _render_what_if(result: Any, out: TextIO, limit: int) -> None:
    wi = result.what_if
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
