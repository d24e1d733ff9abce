"""``timeline``: a picture that shows the bug. Per request (one lane each): waiting, running and
preempted told apart; what vLLM accepted from the pool beside what was loaded at each
admission (a short load is visibly short); tokens computed and the saved watermark; the
problems ``kvledger check`` finds marked where they happened; the tokens each admission's lookup
missed, with their reasons (``kvledger explain``'s). Over the run: requests running,
waiting and preempted, pool occupancy, hit rate per step.

Read off the tidy tables (``replay.tables``: requests, admissions, steps, misses, problems), so the
picture shows what ``kvledger sql`` and ``kvledger stats`` count; the per-request token curves
are the recording Tracker's own states (``tracker.history.walk``). ``.html`` is one
self-contained page (the data as JSON, drawn by inline script into SVG: wheel zooms, drag pans,
double click resets; nothing fetched); ``.png``, ``.svg`` and ``.pdf`` are drawn by matplotlib
(the ``timeline`` extra) from the same data.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from kvledger.replay.extras import pyplot, write_atomic
from kvledger.replay.format import printable
from kvledger.replay.misses import Miss
from kvledger.replay.naming import resolve
from kvledger.replay.source import LogPath, LogSource, open_log
from kvledger.replay.steps import StepRange, ordered, range_text
from kvledger.replay.tables import Row, collect
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.framing import Frame, StopInfo
from kvledger.tracker.history import walk
from kvledger.tracker.state import RequestState

__all__ = [
    "FORMATS",
    "Admission",
    "Mark",
    "RunPanels",
    "Series",
    "TimelineResult",
    "timeline",
]

PathLike = str | os.PathLike[str]

FORMATS = ("html", "png", "svg", "pdf")
_SUFFIXES = {"html": "html", "htm": "html", "png": "png", "svg": "svg", "pdf": "pdf"}

# One colour per meaning, shared by the page and matplotlib. The problem colour is used for
# nothing else (the browser test looks for it in the screenshot).
COLORS = {
    "computed": "#1f77b4",
    "saved": "#9467bd",
    "waiting": "#d9d9d9",
    "running": "#c6dbef",
    "preempted": "#fdae6b",
    "accepted": "#7f7f7f",
    "loaded": "#2ca02c",
    "short": "#d62728",
    "refused": "#bdbdbd",
    "load_failed": "#006400",
    "problem": "#e7298a",
    "finished": "#555555",
    "pool_used": "#8c564b",
    "pool_stored": "#c49c94",
    "hit": "#17becf",
    "missed": "#f4a582",
}


@attrs.frozen
class Admission:
    """One admission of a request (a row of the ``admissions`` table, the columns drawn)."""

    step: int
    how: str  # new or resumed
    preempted_before: bool
    offered: int
    accepted: int  # tokens vLLM accepted from the pool
    local_hit: int  # tokens in vLLM's own prefix cache (the accepted ones follow them)
    load_start: int | None
    load_end: int | None
    loaded: int  # tokens the load plan loads
    refused: int  # of the accepted tokens, the ones the plan refused (whole blocks)
    load_result: str | None
    asked: int = 0  # tokens the admission's lookup asked about
    # What it missed (the misses table): (start, end, reason, the reason's facts in words).
    misses: tuple[tuple[int, int, str, str], ...] = ()

    @property
    def short(self) -> int:
        """Accepted tokens neither loaded nor refused: the load is short by this much."""
        return max(0, self.accepted - self.loaded - self.refused)


@attrs.frozen
class Mark:
    """A problem ``check`` found, where it found it."""

    step: int
    name: str  # the rule, or the decision type that differs
    kind: str  # decision, violation, unexplained, error
    headline: str
    detail: str  # the numbers, or recorded / derived decisions


@attrs.define
class Series:
    """One request life's lane: its phases, admissions, token curves and problems."""

    label: str
    req_id: str = ""
    steps: list[int] = attrs.field(factory=list)
    computed: list[int] = attrs.field(factory=list)  # num_tokens: KV existing or computing
    saved: list[int] = attrs.field(factory=list)  # confirmed saved watermark
    loads: list[tuple[int, int, int]] = attrs.field(factory=list)  # (step, start, end)
    load_failures: list[int] = attrs.field(factory=list)  # steps of LoadFailed
    preemptions: list[int] = attrs.field(factory=list)  # steps
    violations: list[tuple[int, str]] = attrs.field(factory=list)  # recorded: (step, rule)
    finished: int | None = None
    phases: list[tuple[int, int, str]] = attrs.field(factory=list)  # (from, to, phase)
    admissions: list[Admission] = attrs.field(factory=list)
    problems: list[Mark] = attrs.field(factory=list)


@attrs.define
class RunPanels:
    """The run-wide curves, one sample per step (the ``steps`` table), and the hit rate per
    step over the admissions of that step (``sum(hit) / sum(asked)``, as docs/sql.md)."""

    steps: list[int] = attrs.field(factory=list)
    running: list[int] = attrs.field(factory=list)
    waiting: list[int] = attrs.field(factory=list)
    preempted: list[int] = attrs.field(factory=list)
    pool_used: list[int] = attrs.field(factory=list)
    pool_stored: list[int] = attrs.field(factory=list)
    pool_slots: int = 0
    hits: list[tuple[int, int, int]] = attrs.field(factory=list)  # (step, asked, hit)
    problems: list[Mark] = attrs.field(factory=list)  # about no one request


@attrs.frozen
class TimelineResult:
    out: str
    format: str
    series: tuple[Series, ...]
    requests: int  # request lives in the log
    damage: StopInfo | None
    steps: tuple[int, int] = (0, 0)  # the step range drawn
    run: RunPanels = attrs.field(factory=RunPanels)
    problems_total: int = 0  # every problem check found, drawn or not
    check_error: str | None = None

    @property
    def problems_drawn(self) -> int:
        return sum(len(s.problems) for s in self.series) + len(self.run.problems)

    def short_loads(self) -> list[tuple[str, Admission]]:
        return [(s.label, a) for s in self.series for a in s.admissions if a.short]

    def to_dict(self) -> dict[str, Any]:
        """What was drawn, as ``kvledger timeline --json`` prints it."""
        return {
            "out": self.out,
            "format": self.format,
            "steps": list(self.steps),
            "requests_in_log": self.requests,
            "requests": [
                {
                    "request": s.label,
                    "req_id": s.req_id,
                    "phases": [list(p) for p in s.phases],
                    "admissions": [
                        {
                            "step": a.step,
                            "how": a.how,
                            "accepted": a.accepted,
                            "loaded": a.loaded,
                            "refused": a.refused,
                            "short": a.short,
                            "missed": _reasons(a.misses),
                        }
                        for a in s.admissions
                    ],
                    "problems": [{"step": m.step, "name": m.name} for m in s.problems],
                    "recorded_violations": [
                        {"step": step, "rule": rule} for step, rule in _recorded_only(s)
                    ],
                    "finished": s.finished,
                }
                for s in self.series
            ],
            "run_problems": [{"step": m.step, "name": m.name} for m in self.run.problems],
            "problems_drawn": self.problems_drawn,
            "problems_total": self.problems_total,
            "short_loads": [
                {"request": label, "step": a.step, "accepted": a.accepted, "loaded": a.loaded}
                for label, a in self.short_loads()
            ],
            "damage": None if self.damage is None else self.damage.describe(),
            "check_error": self.check_error,
        }


def _check_output(out: str) -> str:
    """The format ``out`` names; a ValueError before anything is read when it cannot be
    written (an unknown suffix, a directory, a missing directory)."""
    if os.path.isdir(out):
        raise ValueError(f"{out} is a directory: name the file to write (.html, .png, ...)")
    fmt = _SUFFIXES.get(Path(out).suffix.lower().lstrip("."))
    if fmt is None:
        raise ValueError(f"timeline output must end in .html, .png, .svg or .pdf (got {out!r})")
    parent = os.path.dirname(out) or "."
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {out}: no directory {parent}")
    return fmt


def timeline(
    path: LogPath | LogSource,
    out: PathLike,
    top: int = 8,
    *,
    requests: Sequence[str] | None = None,
    steps: StepRange | None = None,
) -> TimelineResult:
    """Draw the ``top`` most telling requests (with problems first, then preempted ones, then
    by tokens computed; ties by arrival), or the ``requests`` named (a life label, or a
    request id: all its lives), over ``steps`` (``(first, last)``, both included, None for an
    open end). ``out``'s suffix picks the form: ``.html`` (nothing extra needed), ``.png``,
    ``.svg``, ``.pdf`` (matplotlib: the ``timeline`` extra)."""
    out_s = os.fspath(out)
    fmt = _check_output(out_s)
    plt = None
    if fmt != "html":
        plt = pyplot(f"a .{fmt} timeline (or write .html instead)")  # missing: say so first
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    src = open_log(path)
    config = src.config()
    rows, info = collect(src, ("requests", "admissions", "steps", "misses", "problems"))
    all_steps = sorted(r["step"] for r in rows["steps"])
    if not all_steps:
        raise ValueError(f"{src.name}: the log holds no steps to draw")
    lo, hi = _step_range(steps, all_steps)
    chosen = _choose(rows, requests, top, lo, hi)
    by_label = {r["request"]: r for r in rows["requests"]}
    series = _collect(src, config, [(label, by_label[label]["req_id"]) for label in chosen])
    _fill(series, rows, config, all_steps[-1], recorded=src.recorded)
    for s in series:
        _clip_series(s, lo, hi)
    run = _run_panels(rows, lo, hi)
    # A problem about no request, or about one the log never added (no lane can hold it), is
    # marked on the run-wide panel.
    run.problems = [
        _mark(p) for p in rows["problems"] if p["request"] not in by_label and lo <= p["step"] <= hi
    ]
    result = TimelineResult(
        out_s,
        fmt,
        tuple(series),
        len(rows["requests"]),
        src.damage,
        (lo, hi),
        run,
        len(rows["problems"]),
        info.check_error,
    )
    # A file name that is not UTF-8 is drawn with its bytes escaped: a picture's text and a
    # page's bytes are UTF-8, which a name's undecodable bytes (lone surrogates) are not.
    title = (
        f"{printable(src.name)}: {len(series)} of {len(rows['requests'])} requests, "
        f"steps {lo}..{hi}"
    )
    if fmt == "html":
        write_atomic(out_s, _html(result, title).encode())
    else:
        assert plt is not None
        _matplotlib(plt, result, title, out_s)
    return result


def _step_range(steps: StepRange | None, all_steps: list[int]) -> tuple[int, int]:
    first, last = all_steps[0], all_steps[-1]
    if steps is None:
        return first, last
    lo, hi = ordered(steps)
    lo = first if lo is None else lo
    hi = last if hi is None else hi
    if hi < first or lo > last:
        raise ValueError(
            f"--steps {range_text(steps)}: no step of the log is in it "
            f"(the log has steps {first}..{last})"
        )
    return max(lo, first), min(hi, last)


def _lifespan(r: Row) -> tuple[int, int]:
    end = r["finished_step"] if r["finished_step"] is not None else r["last_step"]
    return r["added_step"], end


def _choose(
    rows: dict[str, list[Row]], wanted: Sequence[str] | None, top: int, lo: int, hi: int
) -> list[str]:
    """The lives to draw: the ones named (in the order named), or the top ranked among the
    lives that overlap the step range."""
    reqs = rows["requests"]
    if wanted:
        lives = {
            r["request"]: r["req_id"]
            for r in sorted(reqs, key=lambda r: (r["added_step"], r["request"]))
        }
        chosen: dict[str, None] = {}
        for name in wanted:
            chosen.update(dict.fromkeys(resolve(name, lives)))
        return list(chosen)
    problems = Counter(p["request"] for p in rows["problems"] if p["request"] is not None)
    live = [r for r in reqs if _lifespan(r)[0] <= hi and _lifespan(r)[1] >= lo]
    live.sort(
        key=lambda r: (
            -(problems[r["request"]] + r["violations"]),
            -r["preemptions"],
            -r["tokens_computed"],
            r["added_step"],
            r["request"],
        )
    )
    return [r["request"] for r in live[:top]]


def _collect(
    src: LogSource, config: TrackerConfig, chosen: Sequence[tuple[str, str]]
) -> list[Series]:
    """The chosen lives' token curves and marks, from the recording Tracker's states (a
    sample after each step the life had events in)."""
    wanted = {label: Series(label, rid) for label, rid in chosen}
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

    for item in walk(src.frames(), config, ids.__contains__, recorded=src.recorded):
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


def _mark(p: Row) -> Mark:
    detail = p["detail"] or ""
    if p["recorded"] or p["derived"]:
        detail = f"recorded {p['recorded'] or 'nothing'}; derived {p['derived'] or 'nothing'}"
    return Mark(p["step"], p["rule"] or p["name"], p["kind"], p["headline"], detail)


def _fill(
    series: list[Series],
    rows: dict[str, list[Row]],
    config: TrackerConfig,
    last: int,
    *,
    recorded: bool = False,
) -> None:
    """Each lane's phases, admissions and problems, from the tables. ``recorded``: a
    recorder's log (connector/recorder.py), where no load plan is recorded (the wrapped
    connector's loads are not observable): an accepted load is drawn as loaded, and only
    check's problems (digests, rules) say otherwise."""
    by_label = {s.label: s for s in series}
    reqs = {r["request"]: r for r in rows["requests"] if r["request"] in by_label}
    adms: dict[str, list[Row]] = defaultdict(list)
    for a in rows["admissions"]:
        if a["request"] in by_label:
            adms[a["request"]].append(a)
    for p in rows["problems"]:
        s = by_label.get(p["request"]) if p["request"] is not None else None
        if s is not None:
            s.problems.append(_mark(p))
    missed: dict[tuple[str, int], list[tuple[int, int, str, str]]] = defaultdict(list)
    for m in rows.get("misses", ()):
        if m["request"] in by_label:
            missed[(m["request"], m["admission"])].append(_missed(m))
    for label, s in by_label.items():
        r = reqs[label]
        s.req_id = r["req_id"]
        s.finished = r["finished_step"]
        end_of_life = r["finished_step"] if r["finished_step"] is not None else last
        phase, since = "waiting", r["added_step"]
        for a in sorted(adms[label], key=lambda a: a["admission"]):
            if a["step"] > a["waiting_since"]:
                s.phases.append((a["waiting_since"], a["step"], phase))
            end = a["end_step"] if a["end_step"] is not None else end_of_life
            s.phases.append((a["step"], end, "running"))
            phase, since = ("preempted" if a["ended_by"] == "preempted" else ""), end
            s.admissions.append(
                Admission(
                    step=a["step"],
                    how=a["how"],
                    preempted_before=bool(a["preempted_before"]),
                    offered=a["offered"] or 0,
                    accepted=a["accepted"] or 0,
                    local_hit=max(0, a["local_hit"] or 0),
                    load_start=a["load_start"],
                    load_end=a["load_end"],
                    loaded=(a["accepted"] if recorded else a["loaded"]) or 0,
                    refused=(a["refused_blocks"] or 0) * config.block_size,
                    load_result=a["load_result"],
                    asked=a["asked"] or 0,
                    misses=tuple(sorted(missed.get((label, a["admission"]), ()))),
                )
            )
        if phase and end_of_life > since:
            s.phases.append((since, end_of_life, phase))
        s.problems.sort(key=lambda m: m.step)


def _reasons(misses: Sequence[tuple[int, int, str, str]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for start, end, reason, _ in misses:
        out[reason] += end - start
    return dict(out.most_common())


def _missed(m: Row) -> tuple[int, int, str, str]:
    """A misses row as drawn: its span, its reason, and the reason's facts in words."""
    miss = Miss(m["start"], m["end"], m["reason"], m["at_step"], m["by_request"], m["diverged_at"])
    return m["start"], m["end"], m["reason"], miss._replace(detail=m["detail"] or "").describe()


def _clip_series(s: Series, lo: int, hi: int) -> None:
    """Keep what falls in [lo, hi]: the curves' samples in it and the last one before it (the
    value held into the range)."""
    keep = [i for i, st in enumerate(s.steps) if lo <= st <= hi]
    before = [i for i, st in enumerate(s.steps) if st < lo]
    if before:
        keep.insert(0, before[-1])
    s.steps = [s.steps[i] for i in keep]
    s.computed = [s.computed[i] for i in keep]
    s.saved = [s.saved[i] for i in keep]
    s.loads = [x for x in s.loads if lo <= x[0] <= hi]
    s.load_failures = [x for x in s.load_failures if lo <= x <= hi]
    s.preemptions = [x for x in s.preemptions if lo <= x <= hi]
    s.violations = [x for x in s.violations if lo <= x[0] <= hi]
    s.phases = [(max(a, lo), min(b, hi), p) for a, b, p in s.phases if b >= lo and a <= hi]
    s.admissions = [a for a in s.admissions if lo <= a.step <= hi]
    s.problems = [m for m in s.problems if lo <= m.step <= hi]


def _run_panels(rows: dict[str, list[Row]], lo: int, hi: int) -> RunPanels:
    run = RunPanels()
    for r in sorted(rows["steps"], key=lambda r: r["step"]):
        if lo <= r["step"] <= hi:
            run.steps.append(r["step"])
            run.running.append(r["running"])
            run.waiting.append(r["waiting"])
            run.preempted.append(r["preempted"])
            run.pool_used.append(r["pool_used"])
            run.pool_stored.append(r["pool_stored"])
            run.pool_slots = r["pool_slots"]
    asked: Counter[int] = Counter()
    hit: Counter[int] = Counter()
    for a in rows["admissions"]:
        if a["asked"] is not None and lo <= a["step"] <= hi:
            asked[a["step"]] += a["asked"]
            hit[a["step"]] += a["hit"] or 0
    run.hits = [(st, asked[st], hit[st]) for st in sorted(asked)]
    return run


# --- the page -------------------------------------------------------------------------------


def _page_data(result: TimelineResult, title: str) -> dict[str, Any]:
    run = result.run
    return {
        "title": title,
        "steps": list(result.steps),
        "colors": COLORS,
        "damage": _damage_text(result),
        "check_error": None if result.check_error is None else printable(result.check_error),
        "problems_total": result.problems_total,
        "run": {
            "steps": run.steps,
            "running": run.running,
            "waiting": run.waiting,
            "preempted": run.preempted,
            "pool_used": run.pool_used,
            "pool_stored": run.pool_stored,
            "pool_slots": run.pool_slots,
            "hits": run.hits,
            "problems": [attrs.asdict(m) for m in run.problems],
        },
        "lanes": [
            {
                "label": s.label,
                "req_id": s.req_id,
                "steps": s.steps,
                "computed": s.computed,
                "saved": s.saved,
                "phases": s.phases,
                "admissions": [attrs.asdict(a) | {"short": a.short} for a in s.admissions],
                "load_failures": s.load_failures,
                "preemptions": s.preemptions,
                "problems": [attrs.asdict(m) for m in s.problems],
                "recorded": _recorded_only(s),
                "finished": s.finished,
            }
            for s in result.series
        ],
    }


def _recorded_only(s: Series) -> list[tuple[int, str]]:
    """The violations the run recorded that check does not report as problems (the
    connector's adapter_error, say): drawn too, as a smaller mark."""
    found = {(m.step, m.name) for m in s.problems}
    return [(step, rule) for step, rule in s.violations if (step, rule) not in found]


def _script_json(obj: Any) -> str:
    """JSON safe inside a <script> element (no '</' to close it early)."""
    return json.dumps(obj, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")


_JS = Path(__file__).with_name("timeline.js")


def _damage_text(result: TimelineResult) -> str | None:
    """Where and why reading stopped, as the page shows it (the file named printably)."""
    return None if result.damage is None else printable(result.damage.describe())


def _html(result: TimelineResult, title: str) -> str:
    note = ""
    damage = _damage_text(result)
    if damage is not None:
        note = (
            f'<p class="damage">Read stopped early: {html.escape(damage)}. '
            "Everything before it is shown.</p>"
        )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style></head>\n<body>\n"
        f"<h3>{html.escape(title)}</h3>\n{note}\n"
        '<p class="help">Wheel: zoom the steps; drag: pan; double click: show every step. '
        "Hover a mark for its step and detail.</p>\n"
        '<div id="legend"></div>\n<div id="chart"></div>\n<pre id="errors"></pre>\n'
        "<noscript>This page draws its timeline with script; allow it, or write .svg "
        "instead.</noscript>\n"
        f'<script id="timeline-data" type="application/json">{_script_json(_page_data(result, title))}'
        "</script>\n"
        f"<script>\n{_JS.read_text()}\n</script>\n</body></html>\n"
    )


_CSS = (
    "body{font-family:sans-serif;margin:12px;color:#222}h3{margin:0 0 4px}"
    ".help{color:#666;font-size:12px;margin:2px 0 6px}"
    "#legend{font-size:12px;margin-bottom:4px}#legend span{margin-right:14px;white-space:nowrap}"
    "#legend i{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}"
    "#chart svg{user-select:none;cursor:grab}#errors{color:#b00}#errors:empty{display:none}"
    ".damage{color:#b00}"
)


# --- matplotlib -----------------------------------------------------------------------------


def _lane_top(s: Series) -> int:
    tops = [*s.computed, *s.saved, 1]
    for a in s.admissions:
        tops.append(a.local_hit + a.accepted)
        tops.extend(m[1] for m in a.misses)
        if a.load_end is not None:
            tops.append(a.load_end)
    return max(tops)


def _matplotlib(plt: ModuleType, result: TimelineResult, title: str, out: str) -> None:
    from matplotlib.patches import Patch, Rectangle

    series, run = result.series, result.run
    lo, hi = result.steps
    span = max(1, hi - lo)
    bar_w = span / 250  # a bar's width in steps: about 4 pixels at this size
    n = len(series)
    height = 1.2 + 3 * 0.9 + 1.1 * n
    fig, axes = plt.subplots(
        3 + n,
        1,
        sharex=True,
        figsize=(12, height),
        squeeze=False,
        gridspec_kw={"height_ratios": [0.8, 0.8, 0.8] + [1.0] * n},
    )
    ax_req, ax_pool, ax_hit = axes[0, 0], axes[1, 0], axes[2, 0]
    for name, values, color in (
        ("running", run.running, COLORS["computed"]),
        ("waiting", run.waiting, "#888888"),
        ("preempted", run.preempted, COLORS["preempted"]),
    ):
        ax_req.step(run.steps, values, where="post", color=color, lw=1.2, label=name)
    ax_req.set_ylabel("requests", fontsize=8)
    ax_req.legend(fontsize=7, loc="upper right", ncol=3, frameon=False)
    ax_pool.fill_between(run.steps, run.pool_used, step="post", color=COLORS["pool_stored"])
    ax_pool.step(run.steps, run.pool_used, where="post", color=COLORS["pool_used"], lw=1.2)
    if run.pool_slots:
        ax_pool.axhline(run.pool_slots, color="#444", ls=":", lw=1)
        ax_pool.set_ylim(0, run.pool_slots * 1.1)
    ax_pool.set_ylabel(f"pool\n(of {run.pool_slots})", fontsize=8)
    if run.hits:
        xs = [st for st, _, _ in run.hits]
        ys = [100.0 * h / a if a else 0.0 for _, a, h in run.hits]
        ax_hit.bar(xs, ys, width=max(bar_w, 0.8), color=COLORS["hit"])
    ax_hit.set_ylim(0, 105)
    ax_hit.set_ylabel("hit %", fontsize=8)
    for m in run.problems:
        ax_req.plot([m.step], [0], marker="D", color=COLORS["problem"], ms=7, clip_on=False)
    for ax, s in zip(axes[3:, 0], series, strict=True):
        top = _lane_top(s)
        band = top * 0.08
        for p0, p1, phase in s.phases:
            ax.add_patch(
                Rectangle(
                    (p0, -band * 1.6), max(p1 - p0, bar_w / 2), band, color=COLORS[phase], lw=0
                )
            )
        ax.step(s.steps, s.computed, where="post", color=COLORS["computed"], lw=1.3)
        ax.step(s.steps, s.saved, where="post", color=COLORS["saved"], lw=1.3)
        for adm in s.admissions:
            if adm.misses:
                for start, end, _, _ in adm.misses:
                    ax.add_patch(
                        Rectangle(
                            (adm.step - bar_w * 1.1, start),
                            bar_w,
                            end - start,
                            color=COLORS["missed"],
                            hatch="///",
                            lw=0,
                        )
                    )
                most = max(_reasons(adm.misses).items(), key=lambda kv: kv[1])[0]
                ax.annotate(
                    most,
                    (adm.step - bar_w * 1.2, adm.misses[-1][1]),
                    fontsize=6,
                    ha="right",
                    color="#b35806",
                )
            if not (adm.accepted or adm.loaded):
                continue
            x = adm.step
            ax.add_patch(
                Rectangle(
                    (x - bar_w * 1.1, adm.local_hit), bar_w, adm.accepted, color=COLORS["accepted"]
                )
            )
            if adm.load_end is not None and adm.load_start is not None:
                ax.add_patch(
                    Rectangle(
                        (x + bar_w * 0.1, adm.load_start),
                        bar_w,
                        adm.load_end - adm.load_start,
                        color=COLORS["loaded"],
                    )
                )
            if adm.short:
                start = adm.local_hit + adm.loaded + adm.refused
                ax.add_patch(
                    Rectangle(
                        (x + bar_w * 0.1, start),
                        bar_w,
                        adm.short,
                        fill=False,
                        edgecolor=COLORS["short"],
                        lw=1.5,
                    )
                )
                ax.annotate(
                    f"loaded {adm.loaded} of {adm.accepted}",
                    (x + bar_w * 1.5, start),
                    fontsize=7,
                    color=COLORS["short"],
                )
        for st in s.load_failures:
            ax.plot([st], [0], marker="v", color=COLORS["load_failed"], ms=6)
        for st in s.preemptions:
            ax.axvline(st, color=COLORS["preempted"], ls="--", lw=1)
        for step, rule in _recorded_only(s):
            ax.plot([step], [top * 1.08], marker="x", color=COLORS["problem"], ms=6, mew=1.5)
            ax.annotate(
                f"{rule} (recorded)",
                (step, top * 1.08),
                xytext=(6, -3),
                textcoords="offset points",
                fontsize=7,
                color=COLORS["problem"],
            )
        for m in s.problems:
            ax.plot([m.step], [top * 1.08], marker="D", color=COLORS["problem"], ms=7)
            ax.annotate(
                m.name,
                (m.step, top * 1.08),
                xytext=(6, -3),
                textcoords="offset points",
                fontsize=7,
                color=COLORS["problem"],
            )
        if s.finished is not None and lo <= s.finished <= hi:
            ax.plot([s.finished], [0], marker="o", color=COLORS["finished"], ms=4)
        ax.set_ylim(-band * 1.8, top * 1.2)
        ax.set_title(s.label, loc="left", fontsize=9, pad=2)
        ax.set_ylabel("tokens", fontsize=8)
    for ax in axes[:, 0]:
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="#eee")
    axes[-1, 0].set_xlim(lo - span * 0.01, hi + span * 0.01)
    axes[-1, 0].set_xlabel("step")
    Line2D = plt.Line2D
    handles = [
        Patch(color=COLORS["waiting"], label="waiting"),
        Patch(color=COLORS["running"], label="running"),
        Patch(color=COLORS["preempted"], label="preempted"),
        Line2D([], [], color=COLORS["computed"], lw=1.5, label="tokens computed"),
        Line2D([], [], color=COLORS["saved"], lw=1.5, label="saved"),
        Patch(color=COLORS["accepted"], label="accepted by vLLM"),
        Patch(color=COLORS["loaded"], label="loaded"),
        Patch(fill=False, edgecolor=COLORS["short"], label="short load"),
        Patch(color=COLORS["missed"], hatch="///", label="missed (kvledger explain)"),
    ]
    if result.problems_drawn:
        handles.append(
            Line2D([], [], color=COLORS["problem"], marker="D", ls="", label="problem (check)")
        )
    suptitle = (
        title if result.damage is None else f"{title} (read stopped early: {result.damage.kind})"
    )
    fig.text(0.01, 1 - 0.12 / height, suptitle, fontsize=10, va="top", ha="left")
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, 1 - 0.38 / height),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
    )
    fig.subplots_adjust(
        left=0.07, right=0.99, top=1 - 0.8 / height, bottom=0.5 / height, hspace=0.5
    )
    tmp = out + ".tmp"
    try:
        fig.savefig(tmp, dpi=110, format=Path(out).suffix.lstrip(".").lower())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):  # never a half-drawn picture left aside
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
