"""``kvledger diff | show | stats | timeline | export``: thin commands over
:mod:`replay.diff` and :mod:`replay.views`.

Tables are drawn with rich on a terminal and as plain text when the output is piped (or rich
is not installed); ``--json`` gives the same result as one JSON document. Read damage (a torn
tail, a corrupt frame) is reported on standard error, and the command still shows everything
before it.

Exit status, as for ``kvledger check``: 2 when a log could not be read, wholly or to its end
(its readable part is still shown), when the request is not in the log, or when an optional
extra is missing; otherwise ``diff`` 0 identical, 1 different, and the others 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from replay import views
from replay.diff import DiffResult, diff
from tracker.log import StopInfo

__all__ = ["main", "register"]

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_UNREADABLE = 2

Handler = Callable[[argparse.Namespace], int]


def register(sub: Any) -> None:
    """Add ``diff``, ``show``, ``stats``, ``timeline`` and ``export`` to an argparse
    subparsers object; each sets ``handler`` (``args -> exit status``)."""
    p = sub.add_parser(
        "diff",
        help="first divergence between two logs, overall and per request",
        description="Compare two logs request by request (aligned by id, else by prompt and "
        "arrival order) and show the first event where each request's history differs. "
        "Exit status: 0 identical, 1 different, 2 a log could not be read (to its end).",
    )
    p.add_argument("a", metavar="A", help="a log file, or a directory of one log's segments")
    p.add_argument("b", metavar="B", help="the log to compare it with")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_diff)

    p = sub.add_parser(
        "show",
        help="one request's life: each event and the request's state after it",
        description="Fold the recorded events of one request and print, for each, the state "
        "after it: tokens known / num_tokens, blocks, saved watermark, loaded range, "
        "preempted, recompute_only.",
    )
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")
    p.add_argument(
        "--request", "-r", required=True, metavar="ID", help="the request id (or part of one)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_show)

    p = sub.add_parser(
        "stats",
        help="what a log holds: requests, steps, events, hits, loads, saves, violations",
    )
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(handler=_stats)

    p = sub.add_parser(
        "timeline",
        help="picture of the top requests over steps (.html, or .png with kvledger[timeline])",
        description="Draw tokens computed, saved watermark and loads of the most telling "
        "requests (violations first, then preempted, then by tokens computed) over the "
        "steps, preemptions and violations marked. .html needs nothing extra; .png needs "
        "matplotlib (pip install kvledger[timeline]).",
    )
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="FILE.html or FILE.png")
    p.add_argument("--top", type=int, default=8, metavar="N", help="requests to draw (8)")
    p.set_defaults(handler=_timeline)

    p = sub.add_parser(
        "export",
        help="one row per event, as JSON lines or parquet, for DuckDB or pandas",
        description="Write one row per event: index, seq, step, wall_ns, type, kind, request "
        "and the event's fields (bytes as hex). parquet needs pyarrow "
        "(pip install kvledger[parquet]).",
    )
    p.add_argument("log", metavar="LOG", help="a log file, or a directory of one log's segments")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument(
        "-o", "--out", required=True, metavar="OUT", help="output file ('-': stdout, jsonl only)"
    )
    p.set_defaults(handler=_export)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one of these commands without the rest of ``kvledger`` (tests, ``python -m``)."""
    parser = argparse.ArgumentParser(prog="kvledger")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register(sub)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


# --- output ---------------------------------------------------------------------------------


class _Out:
    """Tables and lines: rich on a terminal, plain text otherwise."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.console: Any = None
        if self.stream.isatty():
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                self.console = Console(file=self.stream, highlight=False, soft_wrap=True)

    def line(self, text: str = "", style: str = "") -> None:
        if self.console is not None:
            from rich.text import Text

            self.console.print(Text(text, style=style))
        else:
            self.stream.write(text + "\n")

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        title: str = "",
        right: Sequence[str] = (),
        styles: Sequence[str] | None = None,
    ) -> None:
        cells = [["" if v is None else str(v) for v in row] for row in rows]
        if self.console is not None:
            from rich.table import Table

            t = Table(title=title or None, title_justify="left", header_style="bold")
            for c in columns:
                t.add_column(c, justify="right" if c in right else "left", overflow="fold")
            for i, row in enumerate(cells):
                t.add_row(*row, style=(styles[i] if styles else None) or None)
            self.console.print(t)
            return
        if title:
            self.stream.write(title + "\n")
        widths = [len(c) for c in columns]
        for row in cells:
            widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]

        def fmt(values: Sequence[str]) -> str:
            parts = [
                v.rjust(w) if c in right else v.ljust(w)
                for c, v, w in zip(columns, values, widths, strict=True)
            ]
            return "  ".join(parts).rstrip()

        self.stream.write(fmt(list(columns)) + "\n")
        for row in cells:
            self.stream.write(fmt(row) + "\n")


def _warn_damage(name: str, *damages: StopInfo | None) -> int:
    """Report read damage on stderr; the exit status: 2 when a log could not be read to its
    end (what was read is still shown), else 0."""
    status = EXIT_OK
    for damage in damages:
        if damage is not None:
            print(
                f"kvledger: {name}: read stopped early: {damage.describe()}; "
                "everything before it was used",
                file=sys.stderr,
            )
            status = EXIT_UNREADABLE
    return status


def _fail(message: str) -> int:
    print(f"kvledger: {message}", file=sys.stderr)
    return EXIT_UNREADABLE


def _json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _guard(fn: Callable[[argparse.Namespace], int]) -> Handler:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except views.LogUnreadable as e:
            return _fail(f"cannot read the log: {e}")
        except views.RequestNotFound as e:
            return _fail(str(e))
        except views.MissingExtra as e:
            return _fail(str(e))
        except ValueError as e:
            return _fail(str(e))

    run.__name__ = fn.__name__
    return run


# --- diff -----------------------------------------------------------------------------------


@_guard
def _diff(args: argparse.Namespace) -> int:
    result = diff(args.a, args.b)
    damaged = _warn_damage("A", result.damage_a) | _warn_damage("B", result.damage_b)
    if args.json:
        _json(result.to_dict())
    else:
        _print_diff(result, _Out())
    if damaged:
        return EXIT_UNREADABLE
    return EXIT_OK if result.identical else EXIT_DIFFER


def _print_diff(r: DiffResult, out: _Out) -> None:
    out.line(f"A: {r.a} ({r.events_a} events)")
    out.line(f"B: {r.b} ({r.events_b} events)")
    for key, (va, vb) in r.config_changes.items():
        out.line(f"config {key}: {va!r} -> {vb!r}", style="yellow")
    how = ", ".join(f"{n} by {k}" for k, n in r.aligned_by.items() if n)
    out.line(
        f"requests: {len(r.matched)} matched ({how or 'none'}), "
        f"{len(r.unmatched_a)} only in A, {len(r.unmatched_b)} only in B"
    )
    if r.identical:
        out.line("identical: every request has the same events in the same order", style="green")
        return
    for side, names in (("A", r.unmatched_a), ("B", r.unmatched_b)):
        if names:
            shown = ", ".join(names[:10]) + (
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
    out.line(
        f"first divergence: step {first.step}, request {first.request}, "
        f"event {first.position} of the request: {what}",
        style="bold red",
    )
    for text in first.describe().splitlines()[1:]:
        out.line(text)
    if first.context:
        out.line("  before it, both logs agree on:")
        for c in first.context:
            out.line(f"     {c.describe()}")
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


def _brief(at: Any, fields: Sequence[str]) -> str:
    if at is None:
        return "-"
    e = at.event
    name = type(e).__name__
    if not fields or fields == ("type",):
        return name
    parts = []
    for f in fields:
        value = views.event_fields(e)[f]
        text = json.dumps(value)
        parts.append(f"{f}={text if len(text) <= 24 else text[:21] + '...'}")
    return f"{name} {' '.join(parts)}"


# --- show -----------------------------------------------------------------------------------


@_guard
def _show(args: argparse.Namespace) -> int:
    life = views.show(args.log, args.request)
    status = _warn_damage(args.log, life.damage)
    if args.json:
        _json(life.to_dict())
        return status
    out = _Out()
    c = life.config
    out.line(
        f"{life.request}: {len(life)} events in {life.log} "
        f"(block_size {c.block_size}, chunk_size {c.chunk_size})"
    )
    rows = []
    styles = []
    for r in life:
        rows.append(
            [
                r.step,
                r.index,
                r.event if r.life == life.request else f"{r.event} ({r.life})",
                r.detail,
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
    st = views.stats(args.log)
    status = _warn_damage(args.log, st.damage)
    if args.json:
        _json(st.to_dict())
        return status
    out = _Out()
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
        rows.append(
            [
                f"lookups, {name}",
                f"{lk.admissions} admissions, {lk.tokens} tokens asked: pool hit {lk.hit} "
                f"({_pct(lk.hit_rate)}), vLLM prefix cache {lk.local} ({_pct(lk.local_rate)}), "
                f"loaded from pool {lk.external} ({_pct(lk.external_rate)})",
            ]
        )
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


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- timeline, export -----------------------------------------------------------------------


@_guard
def _timeline(args: argparse.Namespace) -> int:
    result = views.timeline(args.log, args.out, top=args.top)
    status = _warn_damage(args.log, result.damage)
    names = ", ".join(s.label for s in result.series)
    print(f"wrote {result.out}: {len(result.series)} of {result.requests} requests ({names})")
    return status


@_guard
def _export(args: argparse.Namespace) -> int:
    if args.out == "-" and args.format != "jsonl":
        return _fail("--out - (standard output) is for --format jsonl only")
    result = views.export(args.log, args.out, args.format)
    status = _warn_damage(args.log, result.damage)
    where = "standard output" if args.out == "-" else result.out
    print(f"wrote {result.rows} rows to {where} ({result.format})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
