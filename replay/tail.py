"""``tail``: follow a log while the engine writes it, a line per step that did something.

Each step says what the connector did in it: lookups answered and the tokens offered to vLLM
from the pool, loads and saves planned (and their tokens), loads and chunk saves the workers
confirmed or failed, and the violations recorded in it (new ones only: each is recorded once).
Steps with none of these (steady decode) are not shown unless asked for.

The log is read by :class:`replay.logreader.LogFollower` as it grows, rotation included,
through the validator every reader uses (what ``check`` refuses, ``tail`` refuses); a frame the
writer is still writing is read once it is whole. A path naming one segment of a rotated log
is followed from the log's first segment there (``replay.source.log_files``). A step the writer
split over several frames (it does so only past its frame size limit) may show as two lines.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from kvledger.replay.counts import StepCounts
from kvledger.replay.logreader import LogFollower
from kvledger.replay.source import log_files
from kvledger.tracker.framing import Frame, StopInfo

__all__ = ["StepNews", "TailEnd", "follow", "news"]


@attrs.define
class StepNews:
    """What one step did, as ``tail`` says it (``replay.counts.StepCounts``, under the names of
    its ``--json`` lines)."""

    step: int
    lookups: int = 0  # answered
    hit_tokens: int = 0  # offered to vLLM from the pool (LookupAnswered.external)
    loads: int = 0
    load_tokens: int = 0
    saves: int = 0
    save_tokens: int = 0
    loads_done: int = 0
    chunks_saved: int = 0  # confirmed (SaveDone)
    load_failures: int = 0
    save_failures: int = 0  # chunks (SaveFailed)
    violations: list[tuple[str, str]] = attrs.field(factory=list)  # (rule, request)

    @classmethod
    def of(cls, c: StepCounts) -> StepNews:
        return cls(
            c.step,
            lookups=c.answers,
            hit_tokens=c.tokens_offered,
            loads=c.loads,
            load_tokens=c.tokens_loaded,
            saves=c.saves,
            save_tokens=c.tokens_saved,
            loads_done=c.loads_done,
            chunks_saved=c.chunks_confirmed,
            load_failures=c.load_failures,
            save_failures=c.chunks_failed,
            violations=c.violations,
        )

    @property
    def quiet(self) -> bool:
        return not (
            self.lookups or self.loads or self.saves or self.loads_done or self.chunks_saved
        ) and not (self.load_failures or self.save_failures or self.violations)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["violations"] = [{"rule": r, "request": q} for r, q in self.violations]
        return d

    def describe(self) -> str:
        """``step 12: lookups 2 (32 tokens offered), loads 1 (32 tokens), saves 1 (32 tokens),
        confirmed 1 load 1 chunk saved, violations +1: accepted_equals_answer req-3``."""
        parts: list[str] = []
        if self.lookups:
            parts.append(f"lookups {self.lookups} ({self.hit_tokens} tokens offered)")
        if self.loads:
            parts.append(f"loads {self.loads} ({self.load_tokens} tokens)")
        if self.saves:
            parts.append(f"saves {self.saves} ({self.save_tokens} tokens)")
        done = _n(self.loads_done, "load") + _n(self.chunks_saved, "chunk saved")
        if done:
            parts.append("confirmed " + " ".join(done))
        failed = _n(self.load_failures, "load") + _n(self.save_failures, "chunk save")
        if failed:
            parts.append("FAILED " + " ".join(failed))
        if self.violations:
            named = ", ".join(f"{rule} {req or '-'}" for rule, req in self.violations)
            parts.append(f"violations +{len(self.violations)}: {named}")
        return f"step {self.step}: " + (", ".join(parts) if parts else "-")


def _n(count: int, what: str) -> list[str]:
    """``["2 loads"]``; nothing for none."""
    if not count:
        return []
    if count == 1:
        return [f"1 {what}"]
    head, _, rest = what.partition(" ")
    return [f"{count} {head}s" + (f" {rest}" if rest else "")]


def news(frames: Iterable[Frame]) -> Iterator[StepNews]:
    """A :class:`StepNews` per step of ``frames`` (consecutive frames of one step merged)."""
    current: StepCounts | None = None
    for frame in frames:
        if current is not None and frame.step != current.step:
            yield StepNews.of(current)
            current = None
        if current is None:
            current = StepCounts(frame.step)
        add = current.add
        for e in frame.events:
            add(e)
    if current is not None:
        yield StepNews.of(current)


@attrs.frozen
class TailEnd:
    """How :func:`follow` ended: ``"closed"`` (the writer closed the log), ``"caught_up"``
    (``once``: everything written so far was read), ``"damage"`` (``stop`` says where),
    ``"interrupted"`` (Ctrl-C), ``"no_log"`` (``once`` and no log there yet).
    ``missing_start``: the number of the first segment there, when the log's start (segment 0)
    is not there: what was followed is not the whole log, as ``check`` would say."""

    how: str
    steps: int  # steps read
    log: str | None
    stop: StopInfo | None = None
    missing_start: int | None = None


def follow(
    source: str | os.PathLike[str],
    emit: Callable[[StepNews], None],
    *,
    once: bool = False,
    interval: float = 0.5,
    quiet_steps: bool = False,
    on_start: Callable[[LogFollower], None] | None = None,
) -> TailEnd:
    """Read the log at ``source`` (a log directory: its newest log; or a file of the log: a
    path naming any segment follows the whole log, from its first segment there) as it
    grows, calling ``emit`` for each step that did something (every step with
    ``quiet_steps``). Returns when the writer closes the log, at damage, on Ctrl-C, or with
    ``once`` when it has read what is written so far. ``on_start`` is called once the log's
    header is read."""
    if os.path.isfile(source):
        source = log_files(source)[0]
    follower = LogFollower(source)
    steps = 0
    started = False
    try:
        while True:
            frames = follower.poll()
            if not started and follower.header is not None:
                started = True
                if on_start is not None:
                    on_start(follower)
            for item in news(frames):
                steps += 1
                if quiet_steps or not item.quiet:
                    emit(item)
            name = None if follower.first is None else str(follower.first)
            missing = follower.missing_start
            if follower.stop is not None:
                return TailEnd("damage", steps, name, follower.stop, missing)
            if follower.ending == "closed":
                return TailEnd("closed", steps, name, None, missing)
            if once:
                return TailEnd("caught_up" if started else "no_log", steps, name, None, missing)
            if not frames:
                time.sleep(interval)
    except KeyboardInterrupt:
        name = None if follower.first is None else str(follower.first)
        return TailEnd("interrupted", steps, name, None, follower.missing_start)
    finally:
        follower.close()
