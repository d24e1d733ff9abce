"""A structure-aware fuzz: events of every tag, with field values shaped by the codec's schema
(valid-looking and impossible ones: negative, 64-bit edges, empty, long, mismatched lengths),
written into real log files by ``LogWriter``, through every ``kvledger`` command.

Each example is either a log made of generated events only, or the real log of vLLM's
scheduler (``tests/data/replay-clean.kvlog``) with a few events inserted, changed or
removed; half of them carry a recorder's header (judged by the recorded rules). For every
command: no traceback, an exit status in the documented set, output bounded by the log's
size (not by its widest value). ``check`` names every event that ``tracker.wellformed``
refuses, at that event's position, and no other event by those rules.

Seeded (derandomized) and bounded for CI: ``KVLEDGER_FUZZ_EXAMPLES`` (default 24) sets the
number of examples; ``KVLEDGER_FUZZ_EXAMPLES=500`` is the run docs/reliability.md reports.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import typing
from collections.abc import Callable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.source import open_log
from kvledger.tracker import codec
from kvledger.tracker import events as ev
from kvledger.tracker.wellformed import RULES, malformed

SEED = Path(__file__).resolve().parent / "data" / "replay-clean.kvlog"
# Its first 80 steps (admissions, loads, saves, preemptions: a third of the run), under its
# own configuration: without mutations, the log checks clean.
SEED_FRAMES: list[tuple[int, list[ev.Event]]] = [
    (f.step, list(f.events)) for f in open_log(SEED).frames()
][:80]
SEED_CONFIG: dict[str, Any] = dict(open_log(SEED).header["config"])

EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "24"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same examples on every run: CI sees no flake, a failure replays
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --- values shaped by the schema ---------------------------------------------------------------

_EDGES = [-1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1]
_INT = st.one_of(st.integers(0, 40), st.integers(-3, 600), st.sampled_from(_EDGES))
_TEXT = st.one_of(
    st.sampled_from(["", "stopped", "aborted", "worker", "scheduler", "adapter_error", "r"]),
    st.text(max_size=12),
    st.text(alphabet="xyz", min_size=2000, max_size=20_000),  # wide: elided in tables
)
_KEY = st.one_of(st.binary(min_size=16, max_size=16), st.just(b""), st.binary(max_size=40))


def _ints(element: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(
        st.lists(element, max_size=8), st.lists(st.integers(0, 9), min_size=60, max_size=300)
    ).map(tuple)


def _of(hint: Any) -> st.SearchStrategy[Any]:
    """Values for a field of type ``hint`` (the codec's kinds: int, bool, str, bytes, an
    IntEnum, arrays of int or of bytes)."""
    if hint is bool:
        return st.booleans()
    if hint is int:
        return _INT
    if hint is str:
        return _TEXT
    if hint is bytes:
        return _KEY
    if isinstance(hint, type) and issubclass(hint, ev.Admission):
        return st.sampled_from(list(hint))
    if typing.get_origin(hint) is tuple:
        element = typing.get_args(hint)[0]
        if element is bytes:
            return st.lists(_KEY, max_size=5).map(tuple)
        return _ints(st.one_of(st.integers(0, 40), _INT))
    raise TypeError(f"no strategy for {hint!r}")


def _fields(cls: type[ev.Event]) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in attrs.fields(cls)][2:]


# The seed's busiest requests, and two of the fuzz's own.
_REQ = st.sampled_from(["", "a", "b", "req-3", "req-4"])


def _event(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    global_only = cls in (ev.ChunkStored, ev.ChunkEvicted, ev.StepDecoded, ev.RemoteOutage)
    rid = st.one_of(st.just(""), _REQ) if global_only else _REQ
    return st.builds(cls, st.just(0), rid, *(_of(hint) for _, hint in _fields(cls)))


TAGS = sorted(codec.schemas())
EVENTS = st.one_of(*(_event(cls) for cls in ev.EVENT_TYPES))


def test_every_tag_has_a_strategy() -> None:
    """The fuzz covers every record type the codec writes."""
    assert sorted(cls.TAG for cls in ev.EVENT_TYPES) == TAGS
    for cls in ev.EVENT_TYPES:
        _event(cls).example()


@st.composite
def logs(draw: st.DrawFn) -> list[tuple[int, list[ev.Event]]]:
    """Frames as (step, events): generated from scratch, or the seed log mutated."""
    if draw(st.booleans()):
        frames = draw(st.lists(st.lists(EVENTS, max_size=6), min_size=1, max_size=10))
        return list(enumerate(frames))
    frames = [(step, list(events)) for step, events in SEED_FRAMES]
    for _ in range(draw(st.integers(1, 6))):
        _, events = frames[draw(st.integers(0, len(frames) - 1))]
        how = draw(st.sampled_from(["insert", "change", "remove"]))
        if how == "insert" or not events:
            events.insert(draw(st.integers(0, len(events))), draw(EVENTS))
        elif how == "remove":
            del events[draw(st.integers(0, len(events) - 1))]
        else:
            i = draw(st.integers(0, len(events) - 1))
            e = events[i]
            fields = _fields(type(e))
            if fields:
                name, hint = draw(st.sampled_from(fields))
                events[i] = attrs.evolve(e, **{name: draw(_of(hint))})
    return frames


def _write(
    path: Path, frames: Sequence[tuple[int, list[ev.Event]]], recorder: bool
) -> list[ev.Event]:
    """Write the frames as a log; the events written, in order (one whose value msgpack
    cannot carry, a delta past 64 bits, is refused by the writer: it cannot be in a log)."""
    header = dict(SEED_CONFIG)
    if recorder:
        header["recorder"] = {"format": 1, "inner": "Fuzz", "inner_class": "t.Fuzz"}
    written = []
    with LogWriter(path, header, fsync="never") as w:
        for step, events in frames:
            for e in events:
                e = e if e.step == step else attrs.evolve(e, step=step)
                try:
                    w.append(e)
                except codec.EncodeError:
                    continue
                written.append(e)
            w.end_step(step)
    return written


# --- every command -----------------------------------------------------------------------------

Argv = Callable[[Path, Path], list[str]]
# (argv, the exit statuses its documentation allows, whether it prints JSON)
COMMANDS: dict[str, tuple[Argv, set[int], bool]] = {
    "check": (lambda log, tmp: ["check", str(log)], {0, 1, 2, 3}, False),
    "check --json": (lambda log, tmp: ["check", "--json", str(log)], {0, 1, 2, 3}, True),
    "show": (lambda log, tmp: ["show", str(log), "-r", "a"], {0, 2}, False),
    "show req-3": (
        lambda log, tmp: ["show", str(log), "-r", "req-3", "--no-collapse"],
        {0, 2},
        False,
    ),
    "stats": (lambda log, tmp: ["stats", str(log)], {0, 2}, False),
    "stats --json": (lambda log, tmp: ["stats", "--json", str(log)], {0, 2}, True),
    "diff": (lambda log, tmp: ["diff", str(SEED), str(log)], {0, 1, 2}, False),
    "export jsonl": (
        lambda log, tmp: ["export", str(log), "-o", str(tmp / "jsonl"), "--format", "jsonl"],
        {0, 2},
        False,
    ),
    "export parquet": (lambda log, tmp: ["export", str(log), "-o", str(tmp / "pq")], {0, 2}, False),
    "export perfetto": (
        lambda log, tmp: ["export", str(log), "-o", str(tmp / "trace.json")],
        {0, 2},
        False,
    ),
    "sql": (
        lambda log, tmp: ["sql", str(log), "SELECT * FROM problems, requests LIMIT 40"],
        {0, 2},
        False,
    ),
    "sql over the export": (
        lambda log, tmp: ["sql", str(tmp / "pq"), "SELECT * FROM events LIMIT 40"],
        {0, 2},
        False,
    ),
    "timeline": (
        lambda log, tmp: ["timeline", str(log), "-o", str(tmp / "t.html")],
        {0, 2},
        False,
    ),
    "tail --once": (lambda log, tmp: ["tail", str(log), "--once"], {0, 2}, False),
    "whatif": (lambda log, tmp: ["whatif", str(log), "--with", "num_slots=2"], {0, 2}, False),
    "whatif --sweep --json": (
        lambda log, tmp: ["whatif", str(log), "--sweep", "num_slots=1,4", "--json"],
        {0, 2},
        True,
    ),
}

# What a command may print per event of the log, beyond a fixed allowance: each event is at
# most a row or a problem of a few lines, each value in them elided to replay.format.WIDE.
PER_EVENT = 4096
ALLOWANCE = 64 << 10


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse only
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _named(problems: list[dict[str, Any]]) -> dict[int, set[str]]:
    """check's problems by tracker.wellformed's rules: event position -> rules."""
    out: dict[int, set[str]] = {}
    for p in problems:
        if p["kind"] == "violation" and p["name"] in RULES:
            out.setdefault(p["index"], set()).add(p["name"])
    return out


_STATEFUL = {"remote_outage_twice", "remote_restored_twice"}


@FUZZ
@given(frames=logs(), recorder=st.booleans())
def test_every_command_on_events_of_every_tag(
    frames: list[tuple[int, list[ev.Event]]], recorder: bool
) -> None:
    with tempfile.TemporaryDirectory(prefix="kvledger-fuzz-") as where:
        tmp = Path(where)
        log = tmp / "fuzz.kvlog"
        flat = _write(log, frames, recorder)
        bound = ALLOWANCE + PER_EVENT * len(flat)
        failures = []
        for name, (argv, exits, is_json) in COMMANDS.items():
            try:
                code, out, err = _run(argv(log, tmp))
            except Exception as e:  # the defect this test exists for
                failures.append(f"{name}: raised {type(e).__name__}: {e}"[:500])
                continue
            if code not in exits:
                failures.append(f"{name}: exit {code} ({err.strip()[:300]})")
            if "Traceback" in out + err:
                failures.append(f"{name}: a traceback")
            if not is_json and len(out) + len(err) > bound:
                failures.append(f"{name}: printed {len(out) + len(err):,} > {bound:,}")
            if name == "check --json":
                result = json.loads(out)
                errors = [p["headline"] for p in result["problems"] if p["kind"] == "error"]
                if errors:
                    failures.append(f"check: the tracker raised: {errors[:3]}")
                expected = {i: {v.rule for v in malformed(e)} for i, e in enumerate(flat)}
                expected = {i: rules for i, rules in expected.items() if rules}
                named = _named(result["problems"])
                for i, rules in named.items():
                    rules -= _STATEFUL
                    if rules != expected.get(i, set()):
                        failures.append(f"check names {rules} at event {i}: {flat[i]!r}"[:400])
                missing = sorted(set(expected) - set(named))
                if missing and result["stop"] is None:
                    failures.append(
                        f"check does not name event {missing[0]}: {flat[missing[0]]!r}"[:400]
                    )
        assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("recorder", [False, True], ids=["connector", "recorder"])
def test_the_seed_log_names_nothing_malformed(recorder: bool, tmp_path: Path) -> None:
    """No false alarm: vLLM's real scheduler's log breaks no rule of tracker.wellformed."""
    log = tmp_path / "seed.kvlog"
    _write(log, SEED_FRAMES, recorder)
    _, out, _ = _run(["check", "--json", str(log)])
    assert _named(json.loads(out)["problems"]) == {}
    assert not [e for _, frame in SEED_FRAMES for e in frame if malformed(e)]
