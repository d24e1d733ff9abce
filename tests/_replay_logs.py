"""Logs for the replay tests; conftest.py's ``synthetic_log`` and ``real_logs`` fixtures are
built here.

``write_log`` writes a synthetic log with a real ``Tracker`` and ``LogWriter`` (no vLLM): a small
engine loop drives the tracker's callback helpers through prefills, decodes, a preemption and
resumption with a load from the pool, a prefix hit on a repeated prompt, and one violation
(vLLM accepting more external tokens than offered). Hooks perturb it at known places.

``real_run_logs`` runs vLLM's real scheduler (``connector.testing.run``) once per session for a few
specs. ``copy_log`` rewrites a log, edited, rotated, slowly or left open.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

BLOCK = 16
NEW, RESUMED, RUNNING = ev.Admission.NEW, ev.Admission.RESUMED, ev.Admission.RUNNING

Alter = Callable[[ev.Event], "ev.Event | None"]
# What copy_log writes in an event's place: nothing (None), the event changed, or several.
Edit = Callable[[ev.Event], "ev.Event | Sequence[ev.Event] | None"]


def token(rid: str, pos: int) -> int:
    """The token a fake model samples at ``pos`` (deterministic; independent of the id's
    suffix, so renamed requests generate the same tokens)."""
    stem = rid.split("-")[1] if rid.count("-") >= 1 else rid
    return (sum(map(ord, stem)) * 131 + pos * 17) % 1000 + 10


def prompt(n: int, seed: int, shared: int = 0) -> list[int]:
    base = [(i * 7 + 3) % 900 + 10 for i in range(shared)]
    return (base + [(i * 13 + seed * 101) % 900 + 10 for i in range(n)])[:n]


class _Sink:
    """Between the Tracker and the LogWriter: renames ids and alters events on their way."""

    def __init__(self, writer: LogWriter, rename: Callable[[str], str], alter: Alter | None):
        self.writer = writer
        self.rename = rename
        self.alter = alter

    def append(self, event: ev.Event) -> None:
        if event.req_id:
            event = attrs.evolve(event, req_id=self.rename(event.req_id))
        if self.alter is not None:
            changed = self.alter(event)
            if changed is None:
                return
            event = changed
        self.writer.append(event)

    def end_step(self, step: int) -> None:
        self.writer.end_step(step)


class Sim:
    """A toy engine over a Tracker: owns token lists, block tables and worker results."""

    def __init__(self, tracker: Tracker, fast: bool = True) -> None:
        self.t = tracker
        self.fast = fast
        self.steady: list[int] = []  # this step's steady decodes (request numbers)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_block = 1
        self.results: list[tuple[str, str, Any]] = []  # delivered at the next step

    def _alloc(self, rid: str, upto: int) -> list[int]:
        have = self.blocks.setdefault(rid, [])
        new: list[int] = []
        while len(have) * BLOCK < upto:
            have.append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def _decisions(self, rid: str, decisions: Iterable[ev.DecisionEvent]) -> None:
        for d in decisions:
            if isinstance(d, ev.SavePlanned) and d.keys:
                self.results.append(("save", rid, d.keys))
            elif isinstance(d, ev.LoadPlanned) and d.keys:
                self.results.append(("load", rid, None))

    def deliver(self) -> None:
        results, self.results = self.results, []
        for kind, rid, keys in results:
            if kind == "save":
                self.t.save_done(rid, keys)
            else:
                self.t.load_done(rid)

    def add(self, rid: str, tokens: Sequence[int]) -> None:
        self.tokens[rid] = list(tokens)
        self.t.add_request(rid, tokens)

    def admit(
        self,
        rid: str,
        *,
        local: int = 0,
        admission: ev.Admission = NEW,
        preempted: bool = False,
        accept_extra: int = 0,
    ) -> None:
        tokens = self.tokens[rid]
        external = self.t.lookup(rid, local, tokens, preempted=preempted) + accept_extra
        self.blocks[rid] = []
        self._alloc(rid, len(tokens))
        self.t.allocated(rid, self.blocks[rid], external)
        done = local + external
        out = self.t.scheduled(
            rid,
            num_computed=done,
            num_scheduled=len(tokens) - done,
            all_token_ids=tokens,
            block_ids=list(self.blocks[rid]),
            admission=admission,
        )
        self._decisions(rid, out)
        self.computed[rid] = len(tokens)

    def decode(self, rid: str) -> None:
        tokens = self.tokens[rid]
        tokens.append(token(rid, len(tokens)))
        n = self.computed[rid]
        new = self._alloc(rid, n + 1)
        if self.fast and not new:
            # The connector's hot path: one StepDecoded record for the step's steady decodes.
            num = self.t.decode_step_ok(rid, n)
            if num is not None:
                self.steady.append(num)
                self.computed[rid] = n + 1
                return
        out = self.t.scheduled(
            rid, num_computed=n, num_scheduled=1, all_token_ids=tokens, block_ids=new
        )
        self._decisions(rid, out)
        self.computed[rid] = n + 1

    def preempt(self, rid: str) -> None:
        self.t.preempted(rid)
        self.blocks[rid] = []
        self.computed[rid] = 0

    def waiting_lookup(self, rid: str) -> None:
        self.t.lookup(rid, 0, self.tokens[rid], preempted=True)

    def finish(self, rid: str) -> None:
        self.t.finished(rid, "length")

    def end_step(self) -> None:
        self.t.decoded(self.steady)
        self.steady = []
        self.t.end_step()


def write_log(
    path: str | os.PathLike[str],
    *,
    chunk_size: int = 32,
    rename: Callable[[str], str] = lambda rid: rid,
    alter: Alter | None = None,
    prompt_change: str | None = None,
    rotate_bytes: int | None = None,
    violation: bool = True,
    fast: bool = True,
) -> Tracker:
    """The synthetic workload; returns the Tracker (its ``counts`` and ``violations``).
    ``fast``: steady decode steps go through the connector's hot path (``StepDecoded``).

    Steps: 0 prefill a (40 tokens) and b (70, sharing 32 with a); 1..3 decode; 3 b preempted;
    4 b waits (lookup); 5 b resumed with a load from the pool; 6 a finishes; 7 c (a's prompt
    again: loads its first chunk) admitted, d admitted accepting more than offered (a violation);
    8..9 decode; 10 everything finishes.
    """
    config = TrackerConfig(block_size=BLOCK, chunk_size=chunk_size, num_slots=64)
    writer = LogWriter(path, config.to_dict(), fsync="never", rotate_bytes=rotate_bytes)
    tracker = Tracker(config, log=_Sink(writer, rename, alter))
    sim = Sim(tracker, fast)
    pa = prompt(40, 1, shared=32)
    pb = prompt(70, 2, shared=32)
    if prompt_change == "req-b":
        pb[50] += 1
    # step 0
    sim.add("req-a", pa)
    sim.add("req-b", pb)
    sim.admit("req-a")
    sim.admit("req-b")
    sim.end_step()
    for step in range(1, 11):
        sim.deliver()
        if step == 3:
            sim.preempt("req-b")
        if step == 4:
            sim.waiting_lookup("req-b")
        if step == 5:
            sim.admit("req-b", admission=RESUMED, preempted=True)
        if step == 6:
            sim.finish("req-a")
        if step == 7:
            sim.add("req-c", pa)
            sim.admit("req-c")
            sim.add("req-d", prompt(20, 4))
            sim.admit("req-d", accept_extra=16 if violation else 0)
        for rid in ("req-a", "req-b", "req-c", "req-d"):
            if rid not in sim.computed or sim.computed[rid] == 0:
                continue
            if (rid == "req-a" and step >= 6) or step == 10:
                continue
            if rid == "req-b" and step in (3, 4, 5):
                continue
            if rid in ("req-c", "req-d") and step == 7:
                continue
            sim.decode(rid)
        if step == 10:
            for rid in ("req-b", "req-c", "req-d"):
                sim.finish(rid)
        sim.end_step()
    sim.deliver()
    tracker.end_step()
    tracker.close()
    writer.close()
    return tracker


def copy_log(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    edit: Edit | None = None,
    *,
    rotate_bytes: int | None = None,
    pause: float = 0.0,
    close: bool = True,
) -> LogWriter:
    """Rewrite a log frame by frame into a new one at ``dst``, with ``src``'s configuration:
    ``edit(event)`` gives what is written in its place (None drops it, an event replaces it, a
    list may add some); ``rotate_bytes`` writes segments of that size; ``pause`` seconds pass
    after each step (a log being written); without ``close`` the log is left open (no end
    record), as by a writer still running or killed. Returns the writer (``paths``: its
    segments)."""
    reader = LogReader(src)
    header = reader.header
    assert header is not None
    writer = LogWriter(dst, header["config"], fsync="never", rotate_bytes=rotate_bytes)
    for frame in reader:
        for e in frame.events:
            out = e if edit is None else edit(e)
            for kept in () if out is None else (out,) if isinstance(out, ev.Event) else out:
                writer.append(kept)
        writer.end_step(frame.step)
        if pause:
            time.sleep(pause)
    assert reader.stop is None
    if close:
        writer.close()
    return writer


def suffixed(suffix: str) -> Callable[[str], str]:
    """vLLM-style ids: ``req-0`` -> ``req-0-<suffix>`` (8 hex digits)."""
    return lambda rid: f"{rid}-{suffix}" if rid else rid


# --- vLLM's real scheduler ------------------------------------------------------------------


SMALL = dict(num_requests=4, num_gpu_blocks=12, prompt_len=(20, 50), max_tokens=(20, 40))


@functools.cache
def _real_runs(root: str) -> dict[str, Path]:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvledger.connector.testing.run import RunSpec, run

    specs = {
        "base": RunSpec(**SMALL),
        "again": RunSpec(**SMALL),
        "chunk16": RunSpec(**SMALL, extra_config={"chunk_size": 16}),
        "loads": RunSpec(**SMALL, enable_prefix_caching=False),
    }
    out: dict[str, Path] = {}
    for name, spec in specs.items():
        d = Path(root) / name
        report = run(spec, log_dir=str(d))
        assert report.ok, report
        assert report.log_path is not None
        out[name] = d
    return out


def real_run_logs(tmp_path_factory: Any) -> dict[str, Path]:
    """Directories holding the logs of small real runs: ``base``, ``again`` (the same spec),
    ``chunk16`` (chunk size 16), ``loads`` (vLLM's prefix cache off: loads from the pool); the
    test is skipped where vLLM's scheduler is not usable. The ``real_logs`` fixture
    (conftest.py)."""
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        import pytest

        pytest.skip(f"vLLM's scheduler is not usable: {reason}")
    return _real_runs(str(tmp_path_factory.getbasetemp() / "replay-real-logs"))
