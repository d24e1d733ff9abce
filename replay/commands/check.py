"""``kvledger check``: its arguments, the run, and the report (the problems, the what-if
comparison, the summary, the verdict)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

from kvledger.replay.commands.common import LINE, non_negative, print_json, warn_damage
from kvledger.replay.extras import reading_progress
from kvledger.replay.format import elide, format_event
from kvledger.replay.results import CheckResult, Problem
from kvledger.tracker.config import ConfigError

__all__ = ["add_check", "render", "render_problem", "run_check"]

_EPILOG = """\
exit status: 0 clean, 1 problems, 2 the log could not be read to its end (a torn tail,
  a corrupt frame), 3 incomplete (no end record: the engine is still writing it or died
  between two writes; steps dropped)
examples:
  kvledger check kvledger-1234.kvlog
  kvledger check logs/ --first                  # a directory holding one log's segments
  kvledger check run.kvlog --request req-7 --json
  kvledger check run.kvlog --with chunk_size=512 --with save_decode_cache=true   # what-if
  kvledger check recorded.kvlog --differential   # a recorder's log: where kvledger differs
"""


def add_check(sub: Any) -> None:
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


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="a log file, the segment files of one log in order, or a directory holding them",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no prose")
    p.add_argument(
        "--replicas",
        action="store_true",
        help="each LOG is another engine's log (a file or a directory) and they shared one "
        "remote tier: check each, then judge what each loaded against the digests every "
        "engine computed (digests on: catches values forged on the tier)",
    )
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
        type=non_negative,
        default=20,
        metavar="N",
        help="print at most N problems in full (default 20; the summary counts all)",
    )


def run_check(args: argparse.Namespace) -> int:
    from kvledger.replay.replayer import check, parse_overrides

    try:
        overrides = parse_overrides(args.overrides)
    except ConfigError as e:
        print(f"kvledger check: --with: {e}", file=sys.stderr)
        return 2
    if getattr(args, "replicas", False):
        if overrides or args.differential:
            print(
                "kvledger check: --replicas takes neither --with nor --differential",
                file=sys.stderr,
            )
            return 2
        return _run_replicas(args)
    paths = args.logs[0] if len(args.logs) == 1 else list(args.logs)
    with reading_progress("check", quiet=args.json) as progress:
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
        print_json(result.to_dict())
    elif result.bad_option is None:
        render(result, sys.stdout, limit=args.limit)
    if result.bad_option is None:
        # Exit 2 says on stderr why, as every command does (the report says it on stdout,
        # which a script may have sent to a file).
        if result.error is not None:
            print(f"kvledger check: {result.error}", file=sys.stderr)
        elif result.stop is not None:
            warn_damage(_files(args.logs), result.stop)
    return result.exit_code


def _run_replicas(args: argparse.Namespace) -> int:
    """``check --replicas``: each log checked alone, then the logs judged together
    (replay/replicas.py). The exit code is the worst of them."""
    from kvledger.replay.replayer import check
    from kvledger.replay.replicas import cross_check

    results = []
    for path in args.logs:
        result = check(path, request=args.request, first=args.first)
        results.append(result)
        if not args.json:
            print(f"== {path}")
            render(result, sys.stdout, limit=args.limit)
            print()
        # Why a log is exit 2, on stderr, as check of one log says it (it said nothing).
        if result.error is not None:
            said = result.error if result.error.startswith(path) else f"{path}: {result.error}"
            print(f"kvledger check: {said}", file=sys.stderr)
        elif result.stop is not None:
            warn_damage(path, result.stop)
    readable = [p for p, r in zip(args.logs, results, strict=True) if r.error is None]
    cross = cross_check(readable)
    code = max([r.exit_code for r in results] + [1 if cross.problems else 0])
    if args.json:
        out = {
            "logs": [r.to_dict() for r in results],
            "replicas": cross.to_dict(),
            "exit_code": code,
        }
        print_json(out)
        return code
    print(f"== the {len(readable)} logs together (one remote tier)")
    print(
        f"  remote    {_n(cross.remote_loaded)} chunks loaded from the tier, "
        f"{_n(cross.saved_elsewhere)} of them saved there by another of these logs"
    )
    print(
        f"  digests   {_n(cross.judged)} loaded or carried block digests judged against what "
        f"the replicas computed; {_n(cross.unjudged)} not computed by any of them"
    )
    for n, p in enumerate(cross.problems[: args.limit], 1):
        print(f"problem {n}: {elide(p.describe(), LINE)}")
        print(f"  {elide(p.detail, LINE)}")
        print(f"  at {p.path}")
    more = len(cross.problems) - args.limit
    if more > 0:
        print(f"  ... and {more} more")
    verdict = f"{len(cross.problems)} problems" if cross.problems else "consistent"
    verdict += " across the replicas"
    left_out = len(args.logs) - len(readable)
    if left_out:
        verdict += f"; {left_out} of the {len(args.logs)} logs could not be checked"
    print(f"result: {verdict} (exit {code})")
    return code


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


def render_problem(n: int, p: Problem, out: TextIO, label: str = "problem") -> None:
    w = out.write
    w(f"{label} {n}: step {p.step}, request {elide(p.req_id) or '-'}: {elide(p.headline())}\n")
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
        w(f"  detail    {elide(p.detail, LINE)}\n")
    w(f"  before    {_state_line(p.before)}\n")
    w(f"  after     {_state_change(p.before, p.after)}\n")


def _n(x: int) -> str:
    return f"{x:,}"


def _files(paths: Sequence[str]) -> str:
    """A log's files for one line of the report: each named when there are at most three,
    else how many and the first and the last (a thousand segments made a 60 KB line). The
    JSON output's ``paths`` lists every one."""
    if len(paths) <= 3:
        return ", ".join(elide(p) for p in paths)
    return f"{_n(len(paths))} segments: {elide(paths[0])} ... {elide(paths[-1])}"


def render(result: CheckResult, out: TextIO, *, limit: int = 20) -> None:
    """The human report of a CheckResult."""
    w = out.write
    if result.error is not None and not result.counts:
        w(f"kvledger check: cannot check {_files(result.paths)}\n")
        w(f"  error     {elide(result.error, LINE)}\n")
        if result.stop is not None:
            w(f"  at        {result.stop.path}: byte offset {result.stop.offset}\n")
        w("result: unreadable (exit 2)\n")
        return
    # Under --with, a rule broken is where the run's recorded schedule meets this config's
    # plans: vLLM would have scheduled otherwise. Not a problem of the run.
    label = "problem" if result.what_if is None else "what-if rule break"
    for i, p in enumerate(result.problems[:limit], 1):
        render_problem(i, p, out, label)
        w("\n")
    if len(result.problems) > limit:
        w(f"... {len(result.problems) - limit} more {label}s (--limit N, or --json)\n\n")
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
    w(f"  log       {_files(result.paths)} ({', '.join(made)})\n")
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
    lost = (c.get("by_type") or {}).get("RecordLost", 0)
    if lost:
        w(
            f"  lost      {_n(lost)} records the run could not make (RecordLost: what they "
            "would have shown is not judged; kvledger sql LOG 'select * from ev_record_lost' "
            "says which and why)\n"
        )
    if result.recorded_violations:
        rules = Counter(v.rule for v in result.recorded_violations)
        w(
            "  recorded violations (facts of the run, applied as recorded): "
            + ", ".join(f"{elide(r)} x{n}" for r, n in rules.items())
            + "\n"
        )
        for v in result.recorded_violations[:limit]:
            w(f"            {elide(v.describe(), LINE)}\n")
    if result.request is not None:
        w(f"  request   only {elide(result.request) or repr('')}'s problems are reported")
        w(f" ({result.problems_elsewhere} elsewhere)\n" if result.problems_elsewhere else "\n")
    if result.problems_total:
        names = Counter(f"{p.name}" for p in result.problems)
        w(
            ("  problems  " if result.what_if is None else "  breaks    ")
            + f"{result.problems_total}: "
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
        w(f"  ERROR     {elide(result.error, LINE)}\n")
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
    elif code == 1 and result.what_if is not None:
        n = result.problems_total
        verdict = (
            f"{n} rule break{'s' if n != 1 else ''} where the run's recorded schedule meets this "
            "config's plans (not problems of the run: vLLM would have scheduled otherwise; "
            "kvledger whatif forecasts what would have hit)"
        )
    elif code == 1:
        verdict = f"{result.problems_total} problem{'s' if result.problems_total != 1 else ''}"
    elif code == 3:
        verdict = "incomplete: no problem in what the log holds, but it is not the whole run"
    elif result.stop is None and result.error is not None:
        # Read to its end, yet not checkable as asked (--request ...).
        verdict = elide(result.error, LINE)
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
    asked = " ".join(f"--with {k}={v}" for k, v in wi.overrides.items())
    w(
        f"  what would have hit, with the schedule fitted to this config's offers: "
        f"kvledger whatif LOG {asked}\n"
    )
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
