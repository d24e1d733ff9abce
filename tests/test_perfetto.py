"""``kvledger export --format perfetto``: a valid Chrome trace event document, one track per
request, phase slices that nest as the format demands, flows from each chunk's save to its
loads, an instant per problem ``kvledger check`` reports.

The trace is validated here by structure, against the tidy tables it is built from (and
through them against ``stats`` and ``check``). Perfetto's own ``trace_processor`` (the
``perfetto`` PyPI package) downloads its binary from get.perfetto.dev on first use, which a
machine without the network cannot do: :func:`test_trace_processor_loads_it` runs only when a
``trace_processor_shell`` binary is named by ``KVLEDGER_TRACE_PROCESSOR``.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import replay
from kvledger.replay.cli import main
from kvledger.replay.perfetto import _segments, trace
from kvledger.replay.replayer import check
from kvledger.replay.tables import collect

DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "replay-clean.kvlog"
SHORT = DATA / "replay-short-load.kvlog"
PHASES = ("waiting", "running", "preempted", "finished, saves in flight")


def assert_nested(slices: list[dict[str, Any]]) -> None:
    """Slices of one track: any two are disjoint or one holds the other (the format's rule
    for complete events on one thread; Perfetto truncates what breaks it)."""
    order = sorted(slices, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[dict[str, Any]] = []
    for e in order:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        if stack:
            top = stack[-1]
            assert e["ts"] + e["dur"] <= top["ts"] + top["dur"], (top, e)
        stack.append(e)


def validate(doc: dict[str, Any], log: Any) -> dict[str, Any]:
    """Check ``doc`` against the Chrome trace event format and against the log's tables."""
    json.loads(json.dumps(doc))  # plain JSON values only
    assert set(doc) >= {"traceEvents", "displayTimeUnit"}
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in {"M", "X", "s", "f", "i", "C"}, e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g")
    rows, _ = collect(log)
    # One track per request, named by its id, in arrival order.
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(r["request"] for r in rows["requests"])
    tid_of = {name: tid for tid, name in names.items()}
    by_tid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_tid[e["tid"]].append(e)
    assert set(by_tid) <= set(names)
    for slices in by_tid.values():
        assert_nested(slices)
        # In the file, each parent comes before its children (same start: longer first).
        assert slices == sorted(slices, key=lambda e: (e["ts"], -e["dur"]))
    # The phases: one running slice per admission, a preempted one after each preemption.
    admissions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in rows["admissions"]:
        admissions[a["request"]].append(a)
    for r in rows["requests"]:
        mine = by_tid[tid_of[r["request"]]]
        phases = sorted((e for e in mine if e["name"] in PHASES), key=lambda e: e["ts"])
        running = [e for e in phases if e["name"] == "running"]
        assert len(running) == len(admissions[r["request"]]) == r["admissions"]
        preempted = [a for a in admissions[r["request"]] if a["ended_by"] == "preempted"]
        assert sum(e["name"] == "preempted" for e in phases) == len(preempted)
        for a0, a1 in itertools.pairwise(phases):  # one after another, no overlap
            assert a0["ts"] + a0["dur"] <= a1["ts"]
        # Inside the phases: a loading slice for each load, naming its range.
        flight = [w for e in mine if e["name"] not in PHASES for w in e["args"]["in flight"]]
        for a in admissions[r["request"]]:
            if a["loaded"]:
                assert any(
                    w.startswith(f"loading [{a['load_start']}, {a['load_end']})") for w in flight
                )
        assert all(
            e["name"] in ("loading", "saving", "loading, saving")
            for e in mine
            if e["name"] not in PHASES
        )
    # Flows: pairs, forward in time, into the track of a request that loaded the chunk.
    flows: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e["ph"] in "sf":
            assert e["ph"] not in flows[e["id"]]
            flows[e["id"]][e["ph"]] = e
    loaded_keys = defaultdict(set)
    for load in rows["ev_load_planned"]:
        loaded_keys[load["request"]].update(load["keys"])
    for pair in flows.values():
        assert set(pair) == {"s", "f"}
        assert pair["s"]["ts"] <= pair["f"]["ts"] and pair["f"]["bp"] == "e"
        assert pair["f"]["args"]["key"] in loaded_keys[names[pair["f"]["tid"]]]
    # Instants: exactly check's problems, each on its request's track...
    instants = [e for e in events if e["ph"] == "i" and e["cat"] == "problem"]
    problems = check(log).problems
    assert [i["args"]["headline"] for i in instants] == [p.headline() for p in problems]
    for i, p in zip(instants, problems, strict=True):
        if p.req_id in tid_of:  # on its request's track; else (a request never added) global
            assert (i["s"], i["tid"]) == ("t", tid_of[p.req_id])
        else:
            assert i["s"] == "p" and "tid" not in i
    # ... and one per admission that missed tokens, its reasons those of the misses table.
    missed: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    for m in rows["misses"]:
        missed[(m["request"], m["admission"])][m["reason"]] += m["tokens"]
    marks = [e for e in events if e["ph"] == "i" and e["cat"] == "miss"]
    assert {(names[e["tid"]], e["args"]["admission"]): e["args"]["reasons"] for e in marks} == {
        k: dict(v) for k, v in missed.items()
    }
    for e in marks:
        assert e["name"].startswith(f"missed {sum(e['args']['reasons'].values())}: ")
    assert {e["cat"] for e in events if e["ph"] == "i"} <= {"problem", "miss"}
    # Counters: the last values are the last step's counts.
    last = {e["name"]: e["args"] for e in events if e["ph"] == "C"}
    if rows["steps"]:
        final = max(rows["steps"], key=lambda s: s["step"])
        assert last["requests"] == {k: final[k] for k in ("running", "waiting", "preempted")}
    return {"flows": len(flows), "instants": len(instants), "tracks": len(names)}


def test_the_short_load_trace(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "short.perfetto.json"
    assert main(["export", str(SHORT), "-o", str(out)]) == 0
    assert "13 requests, 57 slices, 8 flows, 6 problems" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    seen = validate(doc, SHORT)
    assert seen == {"flows": 8, "instants": 6, "tracks": 13}
    # The injected fault, where it happened: req-2's second admission loads 16 of the 32
    # tokens vLLM accepted, and check's problem sits on its track at that step.
    events = doc["traceEvents"]
    tid = next(
        e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == "req-2"
    )
    mine = [e for e in events if e.get("tid") == tid]
    assert [e["name"] for e in mine if e["ph"] == "X" and e["name"] in PHASES] == [
        "running",
        "preempted",
        "running",
    ]
    assert any("loading [0, 16) of 32 accepted" in e["args"].get("in flight", []) for e in mine)
    (problem,) = [e for e in mine if e["ph"] == "i" and e["cat"] == "problem"]
    assert problem["name"] == "decision: LoadPlanned" and problem["args"]["step"] == 31
    assert problem["ts"] == next(
        e["ts"] for e in mine if e["name"] == "running" and e["args"]["step"] == 31
    )


def test_the_clean_trace_and_the_format_choices(tmp_path: Path, capsys: Any) -> None:
    assert main(["export", str(CLEAN), "--format", "perfetto", "-o", str(tmp_path / "t.json")]) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert validate(doc, CLEAN)["instants"] == 0
    assert doc == trace(CLEAN)
    capsys.readouterr()
    assert main(["export", str(CLEAN), "--format", "perfetto", "-o", str(tmp_path / "t")]) == 2
    assert "a Perfetto trace is one file" in capsys.readouterr().err


def test_a_trace_of_a_log_about_requests_it_never_added() -> None:
    log = DATA / "finished_v1.kvlog"
    assert validate(trace(log), log) == {"flows": 0, "instants": 1, "tracks": 0}


def test_a_synthetic_trace(synthetic_log: Path) -> None:
    log = synthetic_log
    seen = validate(trace(log), log)
    assert seen["tracks"] == replay.stats(log).requests and seen["flows"] >= 2  # b and c load


@pytest.mark.vllm
def test_traces_of_vllms_scheduler(real_logs: dict[str, Path]) -> None:
    for log in real_logs.values():
        validate(trace(log), log)


# --- the nesting of transfers inside phases, for any intervals ---------------------------------


@st.composite
def _layout(draw: Any) -> tuple[list[Any], list[Any]]:
    cuts = sorted(set(draw(st.lists(st.integers(0, 40), min_size=2, max_size=8))))
    phases = [(float(a), float(b), "p", {}) for a, b in itertools.pairwise(cuts)]
    transfers = [
        (float(min(a, b)), float(max(a, b)), draw(st.sampled_from(["loading x", "saving y"])))
        for a, b in draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=6))
    ]
    return phases, transfers


@given(_layout())
def test_segments_nest_in_the_phases_and_cover_the_transfers(layout: Any) -> None:
    phases, transfers = layout
    segments = _segments(phases, transfers)
    for s0, s1, name, active in segments:
        assert s0 < s1
        assert any(p0 <= s0 and s1 <= p1 for p0, p1, _, _ in phases)  # inside one phase
        kinds = {w.split()[0] for w in active}
        assert name == ", ".join(k for k in ("loading", "saving") if k in kinds)
    for a, b in itertools.pairwise(segments):
        assert a[1] <= b[0]  # one after another
    # Every moment a transfer is in flight inside a phase is covered, and no other.
    for t in [x + 0.5 for x in range(41)]:
        inside = any(p0 <= t < p1 for p0, p1, _, _ in phases)
        busy = inside and any(t0 <= t < t1 for t0, t1, _ in transfers)
        assert busy == any(s0 <= t < s1 for s0, s1, _, _ in segments), t


# --- Perfetto itself, where its binary is at hand ---------------------------------------------


def test_trace_processor_loads_it(tmp_path: Path) -> None:
    binary = os.environ.get("KVLEDGER_TRACE_PROCESSOR")
    if not binary:
        pytest.skip("no trace_processor_shell (set KVLEDGER_TRACE_PROCESSOR to its path)")
    tp_api = pytest.importorskip("perfetto.trace_processor")
    out = tmp_path / "short.json"
    replay.export(SHORT, out)
    tp = tp_api.TraceProcessor(trace=str(out), config=tp_api.TraceProcessorConfig(bin_path=binary))
    try:
        threads = [r.name for r in tp.query("SELECT name FROM thread WHERE name IS NOT NULL")]
        assert sorted(threads) == sorted(
            r["request"] for r in collect(SHORT, ["requests"])[0]["requests"]
        )
        slices = Counter(r.name for r in tp.query("SELECT name FROM slice"))
        assert slices["running"] == 21 and slices["preempted"] == 8
        (flows,) = [r.n for r in tp.query("SELECT count(*) AS n FROM flow")]
        assert flows == 8
    finally:
        tp.close()


def test_the_trace_of_a_torn_log_is_marked_partial(tmp_path: Path, capsys: Any) -> None:
    """Named *.partial.perfetto.json, otherData says why, and a global instant on the
    timeline marks where the log was read to."""
    from _logfiles import torn_copy

    torn = torn_copy(SHORT, tmp_path / "torn.kvlog", 200)
    out = tmp_path / "t.perfetto.json"
    assert main(["export", str(torn), "-o", str(out)]) == 2
    assert "t.partial.perfetto.json" in capsys.readouterr().err
    assert not out.exists()
    doc = json.loads((tmp_path / "t.partial.perfetto.json").read_text())
    why = doc["otherData"]["kvledger.partial"]
    assert why.startswith("read stopped early: ") and "torn_tail" in why
    (mark,) = [e for e in doc["traceEvents"] if e.get("cat") == "partial"]
    assert mark["ph"] == "i" and mark["s"] == "g" and why in mark["name"]
    assert mark["ts"] == max(e["ts"] for e in doc["traceEvents"] if "ts" in e)
    assert "kvledger.partial" not in trace(CLEAN)["otherData"]
