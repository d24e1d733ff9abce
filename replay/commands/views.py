"""The commands that print what a log holds: ``diff`` (two logs, their first divergence),
``show`` (the requests, or one request's life), ``stats`` (what a log holds, counted) and
``explain`` (why each lookup missed)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvledger.replay import lives, malformed, summary
from kvledger.replay.commands.common import (
    EXIT_DIFFER,
    EXIT_OK,
    EXIT_UNREADABLE,
    LINE,
    guard,
    log_argument,
    non_negative,
    print_json,
    warn_damage,
    worse,
)
from kvledger.replay.divergence import ORDERS, DiffResult, EventAt, diff
from kvledger.replay.extras import Output
from kvledger.replay.format import elide, event_fields
from kvledger.replay.steps import parse_steps

__all__ = ["add_diff", "add_explain", "add_show", "add_stats"]


def add_diff(sub: Any) -> None:
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


def add_show(sub: Any) -> None:
    p = sub.add_parser(
        "show",
        help="the requests of a log, or one request's life: each event and its state after it",
        description="Without --request: every request of the log, one line each (admissions, "
        "preemptions, tokens asked, hit in vLLM's cache, loaded from the pool, missed, check's "
        "problems, how it ended). With --request: fold the recorded events of that request "
        "and print, for each, the state after it: tokens known / num_tokens, blocks, saved "
        "watermark, loaded range, preempted, recompute_only.",
    )
    log_argument(p)
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


def add_stats(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="what a log holds: requests, steps, events, hits, loads, saves, violations",
    )
    log_argument(p)
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(handler=_stats)


def add_explain(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="why each prompt missed: every missed token of every lookup, with its reason",
        description="At each admission, the lookup vLLM acted on: tokens asked, tokens hit "
        "(vLLM's prefix cache, the host pool, the remote tier) and tokens missed, each with one "
        "reason derived by the tracker's rules (new prefix, diverging prefix, partial chunk, "
        "evicted, save failed or in flight, load failed, ...: docs/why-missed.md).",
    )
    log_argument(p)
    p.add_argument(
        "--request",
        "-r",
        metavar="ID",
        help="only this request (a life like id#2, or an id: all its lives): each admission "
        "and its missed spans",
    )
    p.add_argument(
        "--limit",
        type=non_negative,
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


# --- diff -----------------------------------------------------------------------------------


@guard
def _diff(args: argparse.Namespace) -> int:
    ignore = [f.strip() for arg in args.ignore or () for f in arg.split(",") if f.strip()]
    result = diff(args.a, args.b, ignore=ignore, order=args.order)
    read = worse(warn_damage("A", result.damage_a), warn_damage("B", result.damage_b))
    # As check: unreadable (2) first, then a difference (1), then a log not whole (3).
    code = read if read == EXIT_UNREADABLE or result.identical else EXIT_DIFFER
    args.exit_code = code  # kept if the reader of stdout goes away (main)
    if args.json:
        print_json(result.to_dict())
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
        out.line(elide(text, LINE))
    if first.context:
        out.line("  before it, both logs agree on:")
        for c in first.context:
            out.line(f"     {elide(c.describe(), LINE)}")
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


@guard
def _show(args: argparse.Namespace) -> int:
    if args.request is None:
        return _show_requests(args)
    types = lives.parse_types(args.type) if args.type else None
    steps = parse_steps(args.steps) if args.steps is not None else None
    life = lives.show(args.log, args.request)
    status = args.exit_code = warn_damage(args.log, life.damage)
    chosen = lives.select(life, types, steps)
    fold = args.collapse if args.collapse is not None else not args.json  # JSON: every row
    entries: list[lives.Entry] = lives.collapse(chosen) if fold else list(chosen)
    if args.json:
        doc = life.to_dict()
        doc["rows"] = [e.to_dict() for e in entries]
        print_json(doc)
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
    status = args.exit_code = warn_damage(args.log, damage)
    found = malformed.read(args.log)
    if args.json:
        print_json(
            {
                "log": str(args.log),
                "requests": [r.to_dict() for r in lines],
                "malformed": found.to_dict(),
            }
        )
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
    _print_malformed(out, found, _LISTED, "--json")
    if lines:
        out.line(f"one request's life: kvledger show {args.log} --request {lines[0].request}")
    return status


# The malformed records show's list of requests prints (--json: every one kept).
_LISTED = 20


def _blocks(ids: Sequence[int]) -> str:
    if not ids:
        return "0"
    if len(ids) <= 6:
        return f"{len(ids)} [{' '.join(map(str, ids))}]"
    return f"{len(ids)} [{' '.join(map(str, ids[:4]))} … {ids[-1]}]"


# --- stats ----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


@guard
def _stats(args: argparse.Namespace) -> int:
    st = summary.stats(args.log)
    status = args.exit_code = warn_damage(args.log, st.damage)
    if args.json:
        print_json(st.to_dict())
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


def _tops(reasons: dict[str, int], n: int = 3) -> str:
    top = sorted(reasons.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{r} {t}" for r, t in top[:n])
    return text + (f", +{len(top) - n} more" if len(top) > n else "")


@guard
def _explain(args: argparse.Namespace) -> int:
    from kvledger.replay import explain as ex

    result = ex.explain(args.log, request=args.request, earlier=args.earlier)
    # An earlier log read in part is history the reasons did not see: said, and exit 2.
    status = EXIT_OK
    for log, damage in result.earlier_damage:
        status = worse(status, warn_damage(log, damage))
    status = args.exit_code = worse(status, warn_damage(args.log, result.damage))
    if args.json:
        print_json(result.to_dict())
        return status
    out = Output()
    c = result.config
    kind = "a recorder's log" if result.recorded else "a kvledger log"
    unit = "block" if c.block_hits else "chunk"
    partial = f"partial {unit}s discarded" if c.discard_partial_chunks else "partial chunks kept"
    out.line(
        f"explain {result.log} ({kind}; block_size {c.block_size}, chunk_size {c.chunk_size}, "
        f"{c.num_slots} slots, hits by {unit}, {partial})"
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
    _print_malformed(out, result.malformed, args.limit, "--limit N, or --json")
    for note in result.notes():
        out.line(f"note: {note}")
    return status


def _print_malformed(out: Output, found: malformed.MalformedRecords, limit: int, more: str) -> None:
    """The log's records that say something impossible (``replay.malformed``), a row per rule
    broken, as ``kvledger check`` names them: the first ``limit``, and how many more (``more``:
    the options that show them)."""
    total = found.total
    if not total:
        return
    out.line()
    rules = ", ".join(f"{rule} {n}" for rule, n in found.by_rule.most_common())
    out.line(
        f"malformed records: {total} rule{'s' if total != 1 else ''} broken ({rules}); "
        "kvledger check names each, at the same step"
    )
    out.table(
        ["step", "#", "event", "request", "rule", "detail"],
        [
            [m.step, m.index, m.event, m.request or "-", m.rule, m.detail]
            for m in found.records[:limit]
        ],
        right=("step", "#"),
    )
    if total > limit:
        out.line(f"... {total - limit} more ({more})")
