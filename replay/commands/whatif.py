"""``kvledger whatif``: what the run would have hit under other settings (replay/whatif.py).

A forecast, not a verdict: exit 0 with a forecast, 2 when the log cannot be read or cannot
answer the question (the reason on stderr, and in the JSON document with ``--json``).
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path
from typing import Any

from kvledger.replay.commands.common import (
    guard,
    log_argument,
    print_json,
    warn_damage,
)
from kvledger.replay.extras import Output, pyplot, reading_progress, write_atomic

__all__ = ["add_whatif"]

EXAMPLES = """\
examples:
  kvledger whatif run.kvlog --with num_slots=8                 # a smaller host pool
  kvledger whatif run.kvlog --with chunk_size=16 --json        # another chunk size
  kvledger whatif run.kvlog --with remote=off                  # without the remote tier
  kvledger whatif run.kvlog --sweep num_slots=1,2,4,8,16,32 --plot curve.png
  kvledger whatif run.kvlog --sweep chunk_size=16,32,64
"""


def add_whatif(sub: Any) -> None:
    p = sub.add_parser(
        "whatif",
        help="what the run would have hit under other settings: pool size, chunk size, "
        "decode saving, partial chunks, the remote tier; a hit curve over pool sizes",
        description="Run the log's requests again (same arrivals, order, prompts and outputs) "
        "through the tracker's own rules under other settings, and report what would have "
        "hit, by source, and why the rest would still miss, beside the run's own figures "
        "(kvledger explain's vocabulary). A forecast, not a verdict: docs/whatif.md says what "
        "it keeps from the run and its error against real runs.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    log_argument(p)
    p.add_argument(
        "--with",
        dest="changes",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting to change: num_slots, chunk_size, save_decode_cache, "
        "discard_partial_chunks, block_hits (true/false) or remote (on/off); repeat for several",
    )
    p.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="a hit curve: num_slots (every size from one pass over the log, by stack "
        "distances) or chunk_size (one forecast per size)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="with --sweep: draw the curve (PNG or SVG)")
    p.add_argument("--json", action="store_true", help="print the forecast as JSON")
    p.set_defaults(handler=_whatif)


def _sweep_values(text: str) -> tuple[str, list[int]]:
    from kvledger.replay.whatif import Unanswerable

    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in ("num_slots", "chunk_size"):
        raise Unanswerable(f"--sweep expects num_slots=... or chunk_size=..., got {text!r}")
    try:
        out = sorted({int(v) for v in values.split(",") if v.strip()})
    except ValueError:
        raise Unanswerable(
            f"--sweep {key} expects integers separated by commas, got {values!r}"
        ) from None
    if not out or out[0] < 1:
        raise Unanswerable(f"--sweep {key} expects positive integers, got {values!r}")
    return key, out


@guard
def _whatif(args: argparse.Namespace) -> int:
    with reading_progress("whatif", quiet=args.json) as progress:
        return _answer(args, progress)


def _answer(args: argparse.Namespace, progress: Any) -> int:
    from kvledger.replay import whatif as wi

    changes = wi.parse_settings(args.changes)
    if args.plot and not args.sweep:
        raise wi.Unanswerable("--plot draws a curve: give --sweep too")
    if args.plot:
        _check_plot_path(args.plot)
    if args.sweep:
        key, values = _sweep_values(args.sweep)
        if key in changes:
            raise wi.Unanswerable(f"--sweep {key} and --with {key} both set it: keep one")
        if key == "num_slots":
            curve = wi.sweep(args.log, values, changes, progress=progress)
            points = list(zip(curve.sizes, curve.offered, strict=True))
            doc = curve.to_dict()
            actual = (curve.config.num_slots, curve.actual)
            asked = curve.tokens_asked
            damage = curve.damage
        else:
            first = wi.whatif(args.log, {**changes, key: values[0]}, progress=progress)
            runs = [first] + [
                wi.whatif(args.log, {**changes, key: v}, progress=progress, actual=first.actual)
                for v in values[1:]
            ]
            points = [
                (v, f.forecast.totals()["hit"]["pool"]) for v, f in zip(values, runs, strict=True)
            ]
            actual = (getattr(runs[0].recorded_config, key), runs[0].actual.totals()["hit"]["pool"])
            asked = runs[0].actual.totals()["tokens_asked"]
            damage = runs[0].actual.damage
            doc = {
                "log": runs[0].log,
                "with": changes,
                "sweep": key,
                "actual": {key: actual[0], "pool": actual[1]},
                "curve": [
                    {key: v, "pool": hit, "forecast": f.to_dict()["forecast"]}
                    for (v, hit), f in zip(points, runs, strict=True)
                ],
            }
        if args.plot:
            _plot(args.plot, key, points, actual, asked, str(args.log))
        status = args.exit_code = warn_damage(args.log, damage)
        if args.json:
            print_json(doc)
            return status
        _print_curve(key, points, actual, asked, args)
        return status
    forecast = wi.whatif(args.log, changes, progress=progress)
    status = args.exit_code = warn_damage(args.log, forecast.actual.damage)
    if args.json:
        print_json(forecast.to_dict())
        return status
    _print_forecast(forecast)
    return status


def _check_plot_path(out: str) -> None:
    if Path(out).suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"--plot {out}: the picture's name must end in .png or .svg")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"--plot {out}: no directory {parent}")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _print_curve(
    key: str, points: list[tuple[int, int]], actual: tuple[int, int], asked: int, args: Any
) -> None:
    out = Output()
    how = "one pass, stack distances" if key == "num_slots" else "one forecast per size"
    out.line(f"whatif {args.log}: pool hits by {key} ({how})")
    rows = [[v, hit, _pct(hit, asked), "the run" if v == actual[0] else ""] for v, hit in points]
    out.line()
    out.table([key, "pool tokens", "of asked", ""], rows, right=(key, "pool tokens", "of asked"))
    out.line()
    out.line(
        f"the run: {key} {actual[0]}, {actual[1]} tokens from the pool of {asked} asked "
        f"({_pct(actual[1], asked)})"
    )
    if args.plot:
        out.line(f"plot: {args.plot}")
    out.line("note: a forecast, not a verdict (docs/whatif.md: what it keeps from the run)")


def _print_forecast(f: Any) -> None:
    out = Output()
    changed = ", ".join(f"{k}={v}" for k, v in f.changes.items()) or "nothing changed"
    was = ", ".join(
        f"{k} {getattr(f.recorded_config, k)}" for k in f.changes if hasattr(f.recorded_config, k)
    )
    if f.inner is not None:
        # A recorder's log: the run's pool was the wrapped connector's, not kvledger's.
        out.line(
            f"whatif {f.log}: kvledger's own pool ({changed}) against the run's {f.inner} "
            "(recorded by KVLedgerRecorder)"
        )
    else:
        out.line(f"whatif {f.log}: {changed}{f' (the run: {was})' if was else ''}")
    d = f.to_dict()
    a, w = d["actual"], d["forecast"]
    rows: list[list[Any]] = [["tokens asked", a["tokens_asked"], w["tokens_asked"], ""]]
    for source in ("local", "inner", "pool", "remote", "last_token"):
        x, y = a["hit"].get(source, 0), w["hit"].get(source, 0)
        if x or y:
            rows.append([f"hit: {source.replace('_', ' ')}", x, y, f"{y - x:+d}"])
    rows.append(
        ["hit", a["tokens_hit"], w["tokens_hit"], f"{w['tokens_hit'] - a['tokens_hit']:+d}"]
    )
    rows.append(
        [
            "missed",
            a["missed_tokens"],
            w["missed_tokens"],
            f"{w['missed_tokens'] - a['missed_tokens']:+d}",
        ]
    )
    reasons = sorted(
        set(a["reasons"]) | set(w["reasons"]),
        key=lambda r: (-w["reasons"].get(r, 0), -a["reasons"].get(r, 0), r),
    )
    for r in reasons:
        x, y = a["reasons"].get(r, 0), w["reasons"].get(r, 0)
        rows.append([f"  missed: {r}", x, y, f"{y - x:+d}"])
    out.line()
    out.table(
        ["tokens", "the run", "forecast", "change"], rows, right=("the run", "forecast", "change")
    )
    moved = [r for r in d["requests"] if r["actual"] and r["actual"]["hit"] != r["forecast"]["hit"]]
    out.line()
    out.line(
        f"{len(moved)} of {len(d['requests'])} requests would have hit differently "
        "(--json lists every request, run and forecast)"
    )
    for note in f.notes():
        out.line(f"note: {note}")


def _plot(
    out: str,
    key: str,
    points: list[tuple[int, int]],
    actual: tuple[int, int],
    asked: int,
    log: str,
) -> None:
    plt = pyplot("a what-if curve")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = [x for x, _ in points]
    ys = [100 * y / asked if asked else 0 for _, y in points]
    ax.plot(xs, ys, marker="o", label="forecast")
    ax.plot(
        [actual[0]],
        [100 * actual[1] / asked if asked else 0],
        marker="*",
        markersize=14,
        linestyle="none",
        label="the run",
    )
    if key == "num_slots" and max(xs) / max(min(xs), 1) >= 16:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("host pool size (chunk slots)" if key == "num_slots" else "chunk size (tokens)")
    ax.set_ylabel("tokens loaded from the pool (% of asked)")
    ax.set_title(f"kvledger whatif: {os.path.basename(log)}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    picture = io.BytesIO()
    fig.savefig(picture, dpi=110, format=Path(out).suffix.lstrip(".").lower())
    plt.close(fig)
    write_atomic(out, picture.getvalue())
