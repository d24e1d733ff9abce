"""``export --format perfetto``: a log as a Chrome trace (JSON), for ui.perfetto.dev.

Built from the tidy tables (``replay.tables``), so the trace shows what ``kvledger sql`` and
``kvledger stats`` count:

- one track (thread) per request life, named by its id, in the order the requests arrived;
- on it, one slice per phase: ``waiting`` (added, not admitted yet), ``running`` (one per
  admission), ``preempted`` (until the re-admission), ``finished, saves in flight``; inside a
  phase, ``loading`` and ``saving`` while a load or a save of the request is in flight (one
  slice per stretch, named by what is in flight, so slices nest as the format demands);
- a flow arrow from the save of a chunk to each later load of it by another admission;
- an instant for each problem ``kvledger check`` reports, on its request's track;
- an instant for each admission whose lookup missed tokens, at its admission, named by the
  reasons (``kvledger explain``'s, from the ``misses`` table), each span in its arguments;
- counters: requests running / waiting / preempted, pool chunks stored / being written.

Time is the log's wall clock (each frame's ``wall_ns``), in microseconds since the first
frame; every step gets a distinct time (a step written in the same microsecond as the one
before is moved 1 µs later), and each event's arguments carry its step.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
from collections import Counter, defaultdict
from typing import Any

from kvledger.replay.partial import PARTIAL_KEY, partial_reason, publish
from kvledger.replay.results import ExportResult
from kvledger.replay.source import LogPath
from kvledger.replay.tables import Row, TableRows, collect

__all__ = ["trace", "write_trace"]

_PID = 1
_TABLES = ("requests", "admissions", "saves", "steps", "problems", "ev_load_planned", "misses")


class _Clock:
    """Step -> whole microseconds since the first frame, strictly increasing (integers: a
    slice's end, ts + dur, is then exactly the next slice's start, as nesting needs)."""

    def __init__(self, steps: list[Row]) -> None:
        self.steps: list[int] = []
        self.us: list[int] = []
        first = steps[0]["wall_ns"] if steps else 0
        last = -1
        for s in sorted(steps, key=lambda s: s["step"]):
            t = max((s["wall_ns"] - first) // 1000, last + 1)
            self.steps.append(s["step"])
            self.us.append(t)
            last = t

    def __call__(self, step: int) -> int:
        i = bisect.bisect_left(self.steps, step)
        if i < len(self.steps) and self.steps[i] == step:
            return self.us[i]
        if not self.us:
            return max(step, 0)
        if i >= len(self.us):  # after the last frame: one step per µs
            return self.us[-1] + (step - self.steps[-1])
        return max(self.us[i] - 1, 0)  # a step with no frame: just before the next one

    @property
    def end(self) -> int:
        return self.us[-1] + 1 if self.us else 1


Interval = tuple[float, float, str, dict[str, Any]]


def _segments(
    phases: list[Interval], transfers: list[tuple[float, float, str]]
) -> list[tuple[float, float, str, list[str]]]:
    """The nested level: each phase cut where a transfer starts or ends; each piece named by
    what is in flight over it; neighbours with the same name merged. Pieces never cross a
    phase boundary, so they nest."""
    out: list[tuple[float, float, str, list[str]]] = []
    for p0, p1, _, _ in phases:
        inside = [(max(t0, p0), min(t1, p1), what) for t0, t1, what in transfers]
        inside = [t for t in inside if t[0] < t[1]]
        if not inside:
            continue
        cuts = sorted({p0, p1, *(t[0] for t in inside), *(t[1] for t in inside)})
        first = len(out)  # this phase's pieces start here: merge none across the boundary
        for a, b in itertools.pairwise(cuts):
            active = [what for t0, t1, what in inside if t0 <= a and t1 >= b]
            if not active:
                continue
            kinds = [k for k in ("loading", "saving") if any(w.startswith(k) for w in active)]
            name = ", ".join(kinds)
            if len(out) > first and out[-1][1] == a and out[-1][2] == name:
                prev = out[-1]
                out[-1] = (prev[0], b, name, prev[3] + [w for w in active if w not in prev[3]])
            else:
                out.append((a, b, name, active))
    return out


def trace(log: LogPath, *, problems: bool = True) -> dict[str, Any]:
    """The log as a Chrome trace event document (``{"traceEvents": [...], ...}``)."""
    return _build(log, problems)[0]


def _build(log: LogPath, problems: bool) -> tuple[dict[str, Any], TableRows]:
    rows, info = collect(log, _TABLES, problems=problems)
    clock = _Clock(rows["steps"])
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"kvledger {log}"}}
    ]
    requests = sorted(rows["requests"], key=lambda r: (r["added_step"], r["request"]))
    tids = {r["request"]: i for i, r in enumerate(requests, 1)}
    admissions: dict[str, list[Row]] = defaultdict(list)
    for a in sorted(rows["admissions"], key=lambda a: (a["request"], a["admission"])):
        admissions[a["request"]].append(a)
    saves: dict[str, list[Row]] = defaultdict(list)
    for s in rows["saves"]:
        saves[s["request"]].append(s)
    last_step = max((s["step"] for s in rows["steps"]), default=0)

    for r in requests:
        name, tid = r["request"], tids[r["request"]]
        events.append(
            {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "pid": _PID,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": tid},
            }
        )
        phases = _phases(r, admissions[name], saves[name], clock, last_step)
        transfers = _transfers(admissions[name], saves[name], clock, last_step)
        slices = [
            _slice(tid, t0, t1, what, args)
            for t0, t1, what, args in phases
            if t1 > t0  # admitted in the step it arrived: no waiting to show
        ]
        slices += [
            _slice(tid, t0, t1, what, {"in flight": active})
            for t0, t1, what, active in _segments(phases, transfers)
        ]
        # A parent before its children, also where they start together (a load starts with
        # its admission): importers that sort by time alone keep this order.
        events += sorted(slices, key=lambda e: (e["ts"], -e["dur"]))

    events += _flows(rows, tids, clock)
    for p in rows["problems"]:
        problem_tid = tids.get(p["request"] or "")
        instant: dict[str, Any] = {
            "ph": "i",
            "pid": _PID,
            "ts": clock(p["step"]),
            "name": f"{p['kind']}: {p['name']}",
            "cat": "problem",
            "s": "t" if problem_tid is not None else "p",
            "args": {
                k: p[k]
                for k in ("step", "req_id", "event", "headline", "detail")
                if p[k] is not None
            },
        }
        if problem_tid is not None:
            instant["tid"] = problem_tid
        events.append(instant)
    events += _misses(rows["misses"], tids, clock)
    events += _counters(rows["steps"], clock)
    partial = partial_reason(info.damage, info.missing)
    if partial is not None:  # on the timeline itself, where the log's reading stopped
        events.append(
            {
                "ph": "i",
                "pid": _PID,
                "ts": clock(last_step),
                "name": f"the log was read only to here: {partial}",
                "cat": "partial",
                "s": "g",
            }
        )
    other: dict[str, Any] = {
        "log": os.fspath(log) if isinstance(log, (str, os.PathLike)) else str(log),
        "clock": "the log's wall clock, microseconds since its first frame",
        "damage": None if info.damage is None else info.damage.describe(),
        "check_error": info.check_error,
    }
    if partial is not None:
        other[PARTIAL_KEY] = partial
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    return doc, info


def _slice(tid: int, t0: float, t1: float, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "X",
        "pid": _PID,
        "tid": tid,
        "ts": t0,
        "dur": max(t1 - t0, 0),
        "name": name,
        "cat": "request",
        "args": args,
    }


def _phases(
    r: Row, admissions: list[Row], saves: list[Row], clock: _Clock, last_step: int
) -> list[tuple[float, float, str, dict[str, Any]]]:
    """The request's phases, one after another: waiting, running, preempted, ..."""
    end = r["finished_step"] if r["finished_step"] is not None else None
    out: list[tuple[float, float, str, dict[str, Any]]] = []
    start, what, args = r["added_step"], "waiting", {"step": r["added_step"]}
    for a in admissions:
        out.append((clock(start), clock(a["step"]), what, args))
        run_args = {
            k: a[k]
            for k in ("admission", "step", "how", "asked", "hit", "offered", "accepted", "loaded")
        }
        if a["ended_by"] is None:
            out.append((clock(a["step"]), clock.end, "running", run_args))
            return _drain(out, r, saves, clock, last_step)
        out.append((clock(a["step"]), clock(a["end_step"]), "running", run_args))
        if a["ended_by"] == "finished":
            return _drain(out, r, saves, clock, last_step)
        start, what, args = a["end_step"], "preempted", {"step": a["end_step"]}
    out.append((clock(start), clock(end) if end is not None else clock.end, what, args))
    return _drain(out, r, saves, clock, last_step)


def _drain(
    out: list[tuple[float, float, str, dict[str, Any]]],
    r: Row,
    saves: list[Row],
    clock: _Clock,
    last_step: int,
) -> list[tuple[float, float, str, dict[str, Any]]]:
    """After ``Finished``: saves still in flight hold the request's blocks."""
    if r["finished_step"] is None:
        return out
    finished = r["finished_step"]
    pending = [s["result_step"] if s["result_step"] is not None else last_step + 1 for s in saves]
    later = max((p for p in pending if p > finished), default=None)
    if later is not None:
        t1 = clock(later) if later <= last_step else clock.end
        out.append((clock(finished), t1, "finished, saves in flight", {"step": finished}))
    return out


def _transfers(
    admissions: list[Row], saves: list[Row], clock: _Clock, last_step: int
) -> list[tuple[float, float, str]]:
    out: list[tuple[float, float, str]] = []
    for a in admissions:
        if a["loaded"]:
            end = a["load_result_step"]
            if end is None:
                end = a["end_step"]
            t1 = clock(end) if end is not None else clock.end
            accepted = f" of {a['accepted']} accepted" if a["accepted"] != a["loaded"] else ""
            out.append(
                (clock(a["step"]), t1, f"loading [{a['load_start']}, {a['load_end']}){accepted}")
            )
    for s in saves:
        t1 = clock(s["result_step"]) if s["result_step"] is not None else clock.end
        out.append((clock(s["step"]), t1, f"saving chunk {s['key'][:8]} at {s['start']}"))
    return out


def _flows(rows: dict[str, list[Row]], tids: dict[str, int], clock: _Clock) -> list[dict[str, Any]]:
    """An arrow from each chunk's save to every later load that reads it."""
    saved: dict[str, list[Row]] = defaultdict(list)
    for s in sorted(rows["saves"], key=lambda s: s["step"]):
        if s["result"] == "done":
            saved[s["key"]].append(s)
    out: list[dict[str, Any]] = []
    n = 0
    for load in sorted(rows["ev_load_planned"], key=lambda e: e["event"]):
        tid = tids.get(load["request"] or "")
        if tid is None:
            continue
        for key in load["keys"]:
            # The save that stored it last before this load.
            source = None
            for s in saved.get(key, ()):
                if s["result_step"] <= load["step"]:
                    source = s
            if source is None or source["request"] not in tids:
                continue
            n += 1
            common = {"pid": _PID, "name": "chunk", "cat": "chunk", "id": n}
            out.append(
                {**common, "ph": "s", "tid": tids[source["request"]], "ts": clock(source["step"])}
            )
            out.append(
                {
                    **common,
                    "ph": "f",
                    "bp": "e",
                    "tid": tid,
                    "ts": clock(load["step"]),
                    "args": {"key": key},
                }
            )
    return out


def _misses(misses: list[Row], tids: dict[str, int], clock: _Clock) -> list[dict[str, Any]]:
    """An instant per admission that missed tokens: "missed N: reason n, ...", and its spans."""
    by_admission: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for m in misses:
        by_admission[(m["request"], m["admission"])].append(m)
    out: list[dict[str, Any]] = []
    for (request, admission), spans in sorted(by_admission.items()):
        tid = tids.get(request)
        if tid is None:
            continue
        spans.sort(key=lambda m: m["start"])
        reasons: Counter[str] = Counter()
        for m in spans:
            reasons[m["reason"]] += m["tokens"]
        named = ", ".join(f"{r} {n}" for r, n in reasons.most_common())
        out.append(
            {
                "ph": "i",
                "pid": _PID,
                "tid": tid,
                "ts": clock(spans[0]["step"]),
                "s": "t",
                "name": f"missed {sum(reasons.values())}: {named}",
                "cat": "miss",
                "args": {
                    "admission": admission,
                    "step": spans[0]["step"],
                    "lookup_step": spans[0]["lookup_step"],
                    "reasons": dict(reasons.most_common()),
                    "spans": [{k: m[k] for k in _MISS_ARGS if m[k] is not None} for m in spans],
                },
            }
        )
    return out


_MISS_ARGS = ("start", "end", "tokens", "reason", "at_step", "by_request", "diverged_at", "detail")


def _counters(steps: list[Row], clock: _Clock) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    series = {
        "requests": ("running", "waiting", "preempted"),
        "pool chunks": ("pool_stored", "pool_writing"),
    }
    last: dict[str, tuple[int, ...]] = {}
    for s in sorted(steps, key=lambda s: s["step"]):
        for name, columns in series.items():
            values = tuple(s[c] for c in columns)
            if last.get(name) != values:
                last[name] = values
                out.append(
                    {
                        "ph": "C",
                        "pid": _PID,
                        "name": name,
                        "ts": clock(s["step"]),
                        "args": dict(zip(columns, values, strict=True)),
                    }
                )
    return out


def write_trace(log: LogPath, out: str, *, problems: bool = True) -> ExportResult:
    """Write :func:`trace` of ``log`` to ``out`` (whole or not at all; a log read only in
    part to ``out``'s partial name: ``replay.partial``)."""
    doc, info = _build(log, problems)
    partial = doc["otherData"].get(PARTIAL_KEY)
    tmp = out + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        out = publish(tmp, out, partial)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    phs = Counter(e["ph"] for e in doc["traceEvents"])
    counts = {
        "requests": sum(1 for e in doc["traceEvents"] if e.get("name") == "thread_name"),
        "slices": phs["X"],
        "flows": phs["s"],
        "problems": sum(1 for e in doc["traceEvents"] if e.get("cat") == "problem"),
        "misses": sum(1 for e in doc["traceEvents"] if e.get("cat") == "miss"),
        "counter values": phs["C"],
    }
    damage = [] if info.damage is None else [info.damage]
    return ExportResult(out, "perfetto", "trace", counts, damage, (), info.check_error, partial)
