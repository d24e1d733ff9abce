"""What the library's commands return: ``check``'s result and its problems, ``export``'s result.

They have a room of their own because several modules build them: ``check``'s result is filled
by the replay of a connector's log (``replay.replayer``) and by the judge of a recorder's log
(``replay.recorded``); ``export``'s by the table writers (``replay.writers``), the Perfetto
trace (``replay.perfetto``) and the OpenTelemetry spans (``replay.otlp``). Were a result kept in
one of its builders, the others would import that builder back (an import loop), or repeat it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from kvledger.replay.format import event_dict, jsonable
from kvledger.tracker import events as ev
from kvledger.tracker.framing import StopInfo

if TYPE_CHECKING:
    from kvledger.replay.source import LogSource

__all__ = ["CheckResult", "ExportResult", "Problem", "RecordedViolation", "WhatIf"]


# --- check --------------------------------------------------------------------------------


@attrs.frozen
class Problem:
    """One disagreement between the recorded run and this code.

    ``kind``:

    - ``"decision"``: a decision of type ``name`` (``LookupAnswered``, ``LoadPlanned``,
      ``SavePlanned``) differs: ``recorded`` and ``derived`` hold that type's decisions.
    - ``"violation"``: this code finds rule ``name`` broken after ``event``;
      ``recorded_too`` says whether the run recorded it as well.
    - ``"unexplained"``: the run recorded a decision (or a violation of rule ``name``) that
      this code does not derive here, or one that follows no input event at all.
    - ``"differential"``: on a recorder's log (``check --differential``), the wrapped
      connector's answer (``recorded``) differs from kvledger's on the same inputs
      (``derived``).
    - ``"error"``: the tracker raised on this event (a bug in ``tracker/``: the fold must be
      total); ``detail`` holds the exception.

    ``before`` / ``after``: the request's ``RequestState.summary()`` before the event and
    after this code applied it (``None``: unknown yet, or retired: finished with nothing in
    flight). ``path``, ``offset``, ``seq``: the frame the event was read from; ``index``: the
    event's number in the log (0-based, all events counted).
    """

    kind: str
    name: str
    step: int
    req_id: str
    event: ev.Event | None
    recorded: tuple[ev.DecisionEvent, ...] = ()
    derived: tuple[ev.DecisionEvent, ...] = ()
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    path: str = ""
    offset: int = -1
    seq: int = -1
    index: int = -1
    recorded_too: bool = False
    detail: str = ""

    @property
    def rule(self) -> str | None:
        """The rule name for a violation (else None)."""
        return self.name if self.kind == "violation" else None

    def headline(self) -> str:
        if self.kind == "decision":
            what = f"{self.name} differs from the recorded one"
        elif self.kind == "violation":
            event = type(self.event).__name__ if self.event is not None else "?"
            seen = "recorded by the run too" if self.recorded_too else "not recorded by the run"
            if self.event is not None and self.event.KIND == "decision":
                seen = "in a decision the run recorded"  # tracker/wellformed.py's rules
            what = f"rule {self.name} broken at {event} ({seen})"
        elif self.kind == "differential":
            what = f"the wrapped connector's {self.name} differs from kvledger's"
        elif self.kind == "unexplained":
            what = f"the run recorded {self.name} here; this code does not derive it"
        else:
            what = f"the tracker raised: {self.detail}"
        return what

    def describe(self) -> str:
        return f"step {self.step} {self.req_id or '-'}: {self.headline()}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "rule": self.rule,
            "step": self.step,
            "req_id": self.req_id,
            "headline": self.headline(),
            "event": event_dict(self.event),
            "recorded": [event_dict(d) for d in self.recorded],
            "derived": [event_dict(d) for d in self.derived],
            "recorded_too": self.recorded_too,
            "before": jsonable(self.before),
            "after": jsonable(self.after),
            "path": self.path,
            "offset": self.offset,
            "seq": self.seq,
            "index": self.index,
            "detail": self.detail,
        }


@attrs.frozen
class RecordedViolation:
    """A ``ViolationRecorded`` of the run that the replay applied as a fact (its rule is
    outside the fold: ``adapter_error``)."""

    step: int
    req_id: str
    rule: str
    event: str
    detail: str
    path: str
    offset: int
    index: int

    def describe(self) -> str:
        tail = f" ({self.detail})" if self.detail else ""
        return f"step {self.step} {self.req_id or '-'}: {self.rule} at {self.event}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class WhatIf:
    """How the plans differ under the what-if configuration (see the module docstring)."""

    overrides: dict[str, Any]
    recorded_config: dict[str, Any]
    config: dict[str, Any]
    # {"loaded": [recorded, what_if], "saved": [recorded, what_if]} per request id
    per_request: dict[str, dict[str, list[int]]] = attrs.field(factory=dict)
    divergent_admissions: int = 0
    worker_results_replaced: int = 0
    recorded_failures_ignored: int = 0
    # Steady decode steps of the run that are not steady under this config, whose token
    # ids the log does not hold (the run never needed them): chunks over them cannot be
    # planned, so the saved totals are a lower bound when this is not 0.
    steps_without_token_ids: int = 0

    def totals(self) -> dict[str, list[int]]:
        loaded = [0, 0]
        saved = [0, 0]
        for r in self.per_request.values():
            loaded[0] += r["loaded"][0]
            loaded[1] += r["loaded"][1]
            saved[0] += r["saved"][0]
            saved[1] += r["saved"][1]
        return {"loaded": loaded, "saved": saved}

    def to_dict(self) -> dict[str, Any]:
        return {
            "overrides": self.overrides,
            "recorded_config": self.recorded_config,
            "config": self.config,
            "totals": self.totals(),
            "per_request": self.per_request,
            "divergent_admissions": self.divergent_admissions,
            "worker_results_replaced": self.worker_results_replaced,
            "recorded_failures_ignored": self.recorded_failures_ignored,
            "steps_without_token_ids": self.steps_without_token_ids,
        }


def _zero_totals() -> dict[str, int]:
    return {"tokens_loaded": 0, "loads": 0, "tokens_saved": 0, "saves": 0}


@attrs.define
class CheckResult:
    """What :func:`check` found.

    - :attr:`problems`: the disagreements, in log order (at most ``max_problems`` are kept;
      :attr:`problems_total` counts them all). With ``request`` set, only that request's.
    - :attr:`recorded_violations`: violations of the run applied as facts (``adapter_error``).
    - :attr:`stop`: where and why reading stopped before the end (``None``: read to the end).
    - :attr:`error`: why the log could not be checked at all (not a log, unknown major
      version, unreadable header, bad configuration), else ``None``.
    - :attr:`counts`: events, input events, decisions, frames, steps, requests, peak live
      requests, and ``by_type`` (events per type).
    - :attr:`totals`: tokens loaded and saved (and the number of plans), ``recorded`` in the
      log and ``derived`` by this code.
    - :attr:`what_if`: the plan comparison under a changed configuration, else ``None``.

    :attr:`exit_code`: 0 clean, 1 problems, 2 the log could not be read to its end (damage or
    an error; whatever was readable was still checked and reported), 3 no problem in what the
    log holds, but it is not the whole run (:attr:`incomplete` says why).
    """

    paths: list[str]
    request: str | None = None
    first: bool = False
    config: dict[str, Any] = attrs.field(factory=dict)
    run_info: dict[str, Any] = attrs.field(factory=dict)
    problems: list[Problem] = attrs.field(factory=list)
    problems_total: int = 0
    problems_elsewhere: int = 0
    recorded_violations: list[RecordedViolation] = attrs.field(factory=list)
    stop: StopInfo | None = None
    error: str | None = None
    # A --with value this log's configuration refuses (chunk_size=250 with 16-token blocks):
    # the option is wrong, not the log (exit 2 as a usage error; ``error`` says it too).
    bad_option: str | None = None
    # Why the log is not the whole run, when it was read without damage: no end record (the
    # engine still writing it, or dead), a segment missing after a rotation, a gap of steps
    # the writer dropped. None: complete (or too old to tell: ``ending`` is "unknown").
    incomplete: str | None = None
    ending: str | None = None
    # A log sealed when the engine was asked to stop: the signal (connector/stopping.py).
    stopped_by: str | None = None
    stopped_early: bool = False
    counts: dict[str, Any] = attrs.field(factory=dict)
    totals: dict[str, dict[str, int]] = attrs.field(
        factory=lambda: {"recorded": _zero_totals(), "derived": _zero_totals()}
    )
    what_if: WhatIf | None = None
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        """No problem, and the whole log, complete, was read."""
        return (
            self.problems_total == 0
            and self.stop is None
            and self.error is None
            and self.incomplete is None
        )

    @property
    def exit_code(self) -> int:
        if self.error is not None or self.stop is not None:
            return 2
        if self.problems_total:
            return 1
        return 3 if self.incomplete is not None else 0

    def add(self, problem: Problem, limit: int) -> bool:
        """Count ``problem`` (with :attr:`request` set, only that request's: the others count
        in :attr:`problems_elsewhere`) and keep it among the first ``limit``; True when the
        check stops here (:attr:`first`)."""
        if self.request is not None and problem.req_id != self.request:
            self.problems_elsewhere += 1
            return False
        self.problems_total += 1
        if len(self.problems) < limit:
            self.problems.append(problem)
        return self.first

    def read_to(self, source: LogSource) -> None:
        """How reading ``source`` ended: its damage, its ending, the signal that sealed it, and
        why it is not the whole run when its writer never closed it."""
        self.stop = source.stop
        self.ending = source.ending
        self.stopped_by = source.stopped_by
        if self.incomplete is None and source.ending in ("open", "rotated"):
            self.incomplete = source.describe_ending()

    def to_dict(self) -> dict[str, Any]:
        return {
            "paths": self.paths,
            "exit_code": self.exit_code,
            "clean": self.clean,
            "error": self.error,
            "bad_option": self.bad_option,
            "stop": None if self.stop is None else attrs.asdict(self.stop),
            "ending": self.ending,
            "stopped_by": self.stopped_by,
            "incomplete": self.incomplete,
            "request": self.request,
            "first": self.first,
            "stopped_early": self.stopped_early,
            "config": self.config,
            "run_info": jsonable(self.run_info),
            "counts": self.counts,
            "totals": self.totals,
            "problems_total": self.problems_total,
            "problems_elsewhere": self.problems_elsewhere,
            "problems": [p.to_dict() for p in self.problems],
            "recorded_violations": [v.to_dict() for v in self.recorded_violations],
            "what_if": None if self.what_if is None else self.what_if.to_dict(),
            "seconds": round(self.seconds, 3),
        }


# --- export -------------------------------------------------------------------------------


@attrs.frozen
class ExportResult:
    """What ``export`` wrote: where (``out``: the file written, whose name is marked when
    ``partial``; the directory or the tree), ``rows`` per table (a trace: its events per phase
    type; spans: traces, spans and miss events), the logs' damage, the runs of a tree, why the
    problems table is incomplete (``check_error``), and why the files hold the log only in
    part (``partial``: ``replay.partial``; a tree's, run by run), None when whole."""

    out: str
    format: str
    form: str  # directory, file, stdout, tree, trace, otlp
    rows: dict[str, int]
    damage: list[StopInfo] = attrs.field(factory=list)
    runs: tuple[str, ...] = ()
    check_error: str | None = None
    partial: str | None = None

    @property
    def total(self) -> int:
        return sum(self.rows.values())
