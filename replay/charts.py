"""``timeline``: a picture of the most telling requests over the steps, as a self-contained
HTML page with inline SVG, or (the ``timeline`` extra) a matplotlib figure."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import attrs

from replay.extras import pyplot, write_atomic
from replay.source import LogPath, LogSource, open_log
from tracker import events as ev
from tracker.config import TrackerConfig
from tracker.history import POOL, walk
from tracker.log import Frame, StopInfo
from tracker.state import RequestState

__all__ = ["Series", "TimelineResult", "timeline"]

PathLike = str | os.PathLike[str]


@attrs.define
class Series:
    """One request's curves over steps (a sample after each step it had events in)."""

    label: str
    steps: list[int] = attrs.field(factory=list)
    computed: list[int] = attrs.field(factory=list)  # num_tokens: KV existing or computing
    saved: list[int] = attrs.field(factory=list)  # confirmed saved watermark
    loads: list[tuple[int, int, int]] = attrs.field(factory=list)  # (step, start, end)
    load_failures: list[int] = attrs.field(factory=list)  # steps of LoadFailed
    preemptions: list[int] = attrs.field(factory=list)  # steps
    violations: list[tuple[int, str]] = attrs.field(factory=list)  # (step, rule)
    finished: int | None = None


@attrs.frozen
class TimelineResult:
    out: str
    format: str
    series: tuple[Series, ...]
    requests: int
    damage: StopInfo | None


class _Score:
    """How telling one request life is: its violations, preemptions and tokens scheduled."""

    __slots__ = ("arrival", "preemptions", "req_id", "tokens", "violations")

    def __init__(self, req_id: str, arrival: int) -> None:
        self.req_id = req_id
        self.arrival = arrival  # lives seen before it
        self.violations = 0
        self.preemptions = 0
        self.tokens = 0

    def rank(self) -> tuple[int, int, int, int]:
        return (-self.violations, -self.preemptions, -self.tokens, self.arrival)


def _rank(src: LogSource, config: TrackerConfig) -> tuple[list[tuple[str, str]], int]:
    """The requests worth a picture first: with violations, then preempted ones, then by
    tokens computed; ties by arrival. Returns ((label, req_id) in that order, request lives)."""
    scores: dict[str, _Score] = {}  # by life label
    scheduled, decoded = ev.Scheduled, ev.StepDecoded
    for item in walk(src.frames(), config):
        e, rid, label, before, after = item.event, item.req_id, item.life, item.before, item.after
        if label is POOL and not rid:
            continue
        score = scores.get(label)
        if score is None:
            score = scores[label] = _Score(rid, len(scores))
        cls = e.__class__
        if cls is scheduled:
            score.tokens += e.num_scheduled  # type: ignore[attr-defined]
        elif cls is decoded:
            score.tokens += 1
        elif cls is ev.ViolationRecorded:
            score.violations += 1
        if (
            before is not None
            and after is not None
            and after.life.num_preemptions > before.life.num_preemptions
        ):
            score.preemptions += 1
    ranked = sorted(scores, key=lambda label: scores[label].rank())
    return [(label, scores[label].req_id) for label in ranked], len(scores)


def _collect(
    src: LogSource, config: TrackerConfig, chosen: Sequence[tuple[str, str]]
) -> list[Series]:
    wanted = {label: Series(label) for label, _ in chosen}
    ids = {rid for _, rid in chosen}
    touched: dict[str, RequestState] = {}
    frame: Frame | None = None

    def flush(step: int) -> None:
        for label, state in touched.items():
            series = wanted[label]
            if series.steps and series.steps[-1] == step:
                series.computed[-1], series.saved[-1] = state.num_tokens, state.saved
                continue
            series.steps.append(step)
            series.computed.append(state.num_tokens)
            series.saved.append(state.saved)
        touched.clear()

    for item in walk(src.frames(), config, ids.__contains__):
        at, e, label, before, after = item.frame, item.event, item.life, item.before, item.after
        if at is not frame:
            if frame is not None:
                flush(frame.step)
            frame = at
        series = wanted.get(label)
        if series is None or after is None:
            continue
        touched[label] = after
        if isinstance(e, ev.LoadPlanned) and e.end > e.start:
            series.loads.append((e.step, e.start, e.end))
        elif isinstance(e, ev.LoadFailed):
            series.load_failures.append(e.step)
        elif isinstance(e, ev.ViolationRecorded):
            series.violations.append((e.step, e.rule))
        elif isinstance(e, ev.Finished) and series.finished is None:
            series.finished = e.step
        if before is not None and after.life.num_preemptions > before.life.num_preemptions:
            series.preemptions.append(e.step)
    if frame is not None:
        flush(frame.step)
    return [wanted[label] for label, _ in chosen]


def timeline(path: LogPath | LogSource, out: PathLike, top: int = 8) -> TimelineResult:
    """A picture of the ``top`` most telling requests over the steps: tokens computed (KV
    existing or being computed), saved watermark, loads (the loaded token range at its step),
    preemptions and violations marked. ``out`` ending in ``.html`` gives a self-contained page
    with inline SVG (no extra needed); ``.png`` (or ``.svg``, ``.pdf``) uses matplotlib (the
    ``timeline`` extra). Requests are ranked: with violations first, then preempted ones, then
    by tokens computed."""
    out_s = os.fspath(out)
    fmt = Path(out_s).suffix.lower().lstrip(".")
    if fmt not in ("html", "htm", "png", "svg", "pdf"):
        raise ValueError(f"timeline output must end in .html, .png, .svg or .pdf (got {out_s!r})")
    if os.path.isdir(out_s):
        raise ValueError(f"{out_s} is a directory: name the file to write")
    if fmt != "html" and fmt != "htm":
        plt = pyplot(f"a .{fmt} timeline (or write .html instead)")  # missing: say so first
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    src = open_log(path)
    config, _ = src.lenient_config()
    ranked, n = _rank(src, config)
    chosen = ranked[:top]
    series = _collect(src, config, chosen)
    title = f"{src.name}: {len(chosen)} of {n} requests"
    if fmt in ("html", "htm"):
        write_atomic(out_s, _timeline_html(series, title, src.damage).encode())
    else:
        _timeline_matplotlib(plt, series, title, src.damage, out_s)
    return TimelineResult(out_s, fmt, tuple(series), n, src.damage)


_COLORS = {"computed": "#1f77b4", "saved": "#ff7f0e", "loaded": "#2ca02c", "bad": "#d62728"}


def _timeline_html(series: Sequence[Series], title: str, damage: StopInfo | None) -> str:
    width, left, right, panel, gap, top_pad = 1000, 150, 20, 70, 18, 30
    steps = [st for s in series for st in s.steps] + [st for s in series for st, _, _ in s.loads]
    x0 = min(steps, default=0)
    x1 = max(steps, default=1)
    if x1 == x0:
        x1 = x0 + 1
    plot_w = width - left - right
    height = top_pad + len(series) * (panel + gap) + 30

    def x(step: float) -> float:
        return left + (step - x0) / (x1 - x0) * plot_w

    out: list[str] = []
    w = out.append
    w(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    )
    legend = [
        ("computed", "tokens computed"),
        ("saved", "saved watermark"),
        ("loaded", "loaded range (v: load failed)"),
        ("bad", "preemption (dashed) / violation (x)"),
    ]
    lx = left
    for key, text in legend:
        w(f'<rect x="{lx}" y="8" width="12" height="4" fill="{_COLORS[key]}"/>')
        w(f'<text x="{lx + 16}" y="14">{html.escape(text)}</text>')
        lx += 30 + 7 * len(text)
    for i, s in enumerate(series):
        y_top = top_pad + i * (panel + gap)
        y_bot = y_top + panel
        ymax = max([*s.computed, *s.saved, *(end for _, _, end in s.loads), 1])

        def y(v: float, y_bot: float = y_bot, ymax: int = ymax) -> float:
            return y_bot - v / ymax * panel

        label = html.escape(s.label)
        w(f'<g class="request" data-request="{label}">')
        w(f"<title>{label}</title>")
        w(
            f'<rect x="{left}" y="{y_top}" width="{plot_w}" height="{panel}" fill="none" '
            'stroke="#ccc"/>'
        )
        w(f'<text x="{left - 8}" y="{y_top + panel / 2 + 4}" text-anchor="end">{label}</text>')
        w(f'<text x="{left - 8}" y="{y_top + 10}" text-anchor="end" fill="#888">{ymax}</text>')
        for key, values in (("computed", s.computed), ("saved", s.saved)):
            pts = _step_points(s.steps, values, x, y)
            if pts:
                w(
                    f'<polyline class="{key}" fill="none" stroke="{_COLORS[key]}" '
                    f'stroke-width="1.5" points="{pts}"/>'
                )
        for step, start, end in s.loads:
            w(
                f'<line class="loaded" x1="{x(step):.1f}" x2="{x(step):.1f}" '
                f'y1="{y(start):.1f}" y2="{y(end):.1f}" stroke="{_COLORS["loaded"]}" '
                f'stroke-width="5"><title>step {step}: loaded [{start}, {end})</title></line>'
            )
        for step in s.load_failures:
            cx = x(step)
            w(
                f'<path class="load-failed" d="M{cx - 4:.1f},{y_bot - 9:.1f} L{cx + 4:.1f},'
                f'{y_bot - 9:.1f} L{cx:.1f},{y_bot - 1:.1f} Z" fill="#006400">'
                f"<title>step {step}: load failed</title></path>"
            )
        for step in s.preemptions:
            w(
                f'<line class="preempted" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{y_top}" '
                f'y2="{y_bot}" stroke="{_COLORS["bad"]}" stroke-dasharray="4 3">'
                f"<title>step {step}: preempted</title></line>"
            )
        for step, rule in s.violations:
            cx, cy = x(step), y_top + 6
            w(
                f'<path class="violation" d="M{cx - 4:.1f},{cy - 4:.1f} L{cx + 4:.1f},'
                f'{cy + 4:.1f} M{cx - 4:.1f},{cy + 4:.1f} L{cx + 4:.1f},{cy - 4:.1f}" '
                f'stroke="{_COLORS["bad"]}" stroke-width="2">'
                f"<title>step {step}: {html.escape(rule)}</title></path>"
            )
        if s.finished is not None:
            w(
                f'<circle class="finished" cx="{x(s.finished):.1f}" cy="{y_bot}" r="3" '
                f'fill="#555"><title>step {s.finished}: finished</title></circle>'
            )
        w("</g>")
    axis_y = top_pad + len(series) * (panel + gap) + 2
    for tick in _ticks(x0, x1):
        w(f'<text x="{x(tick):.1f}" y="{axis_y + 10}" text-anchor="middle">{tick}</text>')
    w(f'<text x="{left + plot_w / 2}" y="{axis_y + 24}" text-anchor="middle">step</text>')
    w("</svg>")
    note = ""
    if damage is not None:
        note = (
            f'<p class="damage">Read stopped early: {html.escape(damage.describe())}. '
            "Everything before it is shown.</p>"
        )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f'<title>{html.escape(title)}</title></head>\n<body style="font-family:sans-serif">\n'
        f"<h3>{html.escape(title)}</h3>\n{note}\n" + "\n".join(out) + "\n</body></html>\n"
    )


def _step_points(
    steps: Sequence[int],
    values: Sequence[int],
    x: Callable[[float], float],
    y: Callable[[float], float],
) -> str:
    """A step function's polyline, at most four points per pixel column (the first, lowest,
    highest and last value in it), so a request that lived 100,000 steps stays a small page."""
    points: list[tuple[float, float]] = []
    column: list[tuple[float, float]] = []
    prev: int | None = None

    def flush() -> None:
        if len(column) <= 4:
            points.extend(column)
        else:
            lo = min(column, key=lambda p: p[1])
            hi = max(column, key=lambda p: p[1])
            points.extend((column[0], lo, hi, column[-1]))
        column.clear()

    for st, v in zip(steps, values, strict=True):
        px = x(st)
        if column and round(column[-1][0]) != round(px):
            flush()
        if prev is not None:  # hold the previous value up to this step, then move
            column.append((px, y(prev)))
        column.append((px, y(v)))
        prev = v
    flush()
    if len(points) == 1:
        points.append(points[0])
    return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)


def _ticks(x0: int, x1: int, n: int = 8) -> list[int]:
    span = x1 - x0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), 10 * mag)
    step = max(1, int(step))
    first = (x0 + step - 1) // step * step
    return list(range(first, x1 + 1, step))


def _timeline_matplotlib(
    plt: ModuleType, series: Sequence[Series], title: str, damage: StopInfo | None, out: str
) -> None:
    n = max(1, len(series))
    height = 1.0 + 1.35 * n  # inches: title and legend, then one panel per request
    fig, axes = plt.subplots(n, 1, sharex=True, figsize=(11, height), squeeze=False)
    for ax, s in zip(axes[:, 0], series, strict=False):
        ax.step(s.steps, s.computed, where="post", color=_COLORS["computed"], lw=1.5)
        ax.step(s.steps, s.saved, where="post", color=_COLORS["saved"], lw=1.5)
        for step, start, end in s.loads:
            ax.vlines(step, start, end, color=_COLORS["loaded"], lw=5)
        for step in s.load_failures:
            ax.plot([step], [0], marker="v", color="#006400", ms=6, clip_on=False)
        for step in s.preemptions:
            ax.axvline(step, color=_COLORS["bad"], ls="--", lw=1)
        ymax = max([*s.computed, *s.saved, *(end for _, _, end in s.loads), 1])
        for step, _rule in s.violations:
            ax.plot([step], [ymax * 1.05], marker="x", color=_COLORS["bad"], ms=8, mew=2)
        if s.finished is not None:
            ax.plot([s.finished], [0], marker="o", color="#555", ms=4, clip_on=False)
        ax.set_ylim(0, ymax * 1.15)
        ax.set_title(s.label, loc="left", fontsize=9, pad=2)
        ax.set_ylabel("tokens", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="#eee")
    axes[-1, 0].set_xlabel("step")
    Line2D = plt.Line2D
    handles = [
        Line2D([], [], color=_COLORS["computed"], lw=1.5, label="tokens computed"),
        Line2D([], [], color=_COLORS["saved"], lw=1.5, label="saved watermark"),
        Line2D([], [], color=_COLORS["loaded"], lw=5, label="loaded range"),
        Line2D([], [], color="#006400", marker="v", ls="", label="load failed"),
        Line2D([], [], color=_COLORS["bad"], ls="--", label="preemption"),
        Line2D([], [], color=_COLORS["bad"], marker="x", ls="", mew=2, label="violation"),
        Line2D([], [], color="#555", marker="o", ls="", label="finished"),
    ]
    suptitle = title if damage is None else f"{title} (read stopped early: {damage.kind})"
    fig.text(0.01, 1 - 0.12 / height, suptitle, fontsize=10, va="top", ha="left")
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, 1 - 0.38 / height),
        ncol=7,
        fontsize=8,
        frameon=False,
    )
    fig.subplots_adjust(
        left=0.07, right=0.99, top=1 - 0.95 / height, bottom=0.55 / height, hspace=0.45
    )
    tmp = out + ".tmp"
    fig.savefig(tmp, dpi=110, format=Path(out).suffix.lstrip(".").lower())
    plt.close(fig)
    os.replace(tmp, out)
