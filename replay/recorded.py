"""``kvledger check`` of a recorder's log (connector/recorder.py): the rules any connector must
keep, and the differential mode.

A recorder's log holds no kvledger decision to re-derive: what the wrapped connector decided is
recorded as facts (``InnerLookupAnswered``...). :func:`check_recorded_into` therefore judges
the log with the rules of :mod:`tracker.recorded_rules` (and the digests' rules of
:mod:`tracker.digests`, when the log carries digests), each problem a ``violation`` named by
its rule, at the event that shows it.

``differential``: kvledger's own decisions on the recorded vLLM inputs. A fresh ``Tracker``
folds the recorded ``RequestAdded``, ``LookupAsked``, ``Allocated``, ``Scheduled``,
``Preempted`` and ``Finished``, its saves taken as done as soon as planned (the pool holds what
kvledger would have saved) and its loads as done; at each lookup the inner answered, kvledger's
answer is compared with the inner's. The first lookup of each request where they differ is a
``decision`` problem ``LookupAnswered`` holding both answers (the inner's as ``recorded``,
kvledger's as ``derived``) and the facts behind them (the ask, the request's state). After a
request's first difference its later ones are not reported: vLLM acted on the inner's answer,
not on kvledger's, so they are consequences. The pool's geometry comes from the log's header
(``chunk_size``, ``num_slots``; ``--with`` changes them, to match the inner's granularity).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvledger.replay.format import format_event
from kvledger.replay.malformed import detail_text
from kvledger.replay.naming import RequestNotFound
from kvledger.replay.results import CheckResult, Problem
from kvledger.replay.source import LogSource
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import DigestBook
from kvledger.tracker.recorded_rules import RecordedRules

__all__ = ["check_recorded_into"]

# vLLM's facts, as the Tracker folds them; everything else in a recorder's log is the inner's.
_INPUTS = (
    ev.RequestAdded,
    ev.LookupAsked,
    ev.Allocated,
    ev.Scheduled,
    ev.Preempted,
    ev.Finished,
)


def check_recorded_into(
    result: CheckResult,
    source: LogSource,
    config: TrackerConfig,
    *,
    request: str | None,
    max_problems: int,
    differential: bool,
) -> None:
    """Fill ``result`` from the recorder's log ``source``."""
    rules = RecordedRules(config.block_size)
    book = DigestBook()
    diff = _Differential(config) if differential else None
    # One reading of each record (RecordedRules.judge): well-formed first, then the rules, a
    # StepDecoded judged as the Scheduled events it stands for (tracker/recorded_steps.py).
    steady = 0
    index = frames = steps = 0
    last_step: int | None = None
    requests = 0
    by_type: dict[str, int] = {}
    seen_request = False
    wanted = request or None  # an empty id names no request (events about none carry "")
    done = False

    live: set[str] = set()  # requests added and not finished: vLLM's, as the log tells
    peak_live = 0
    for frame in source.frames():
        frames += 1
        if frame.step != last_step:
            steps += 1
            last_step = frame.step
        for e in frame.events:
            name = type(e).__name__
            by_type[name] = by_type.get(name, 0) + 1
            if e.req_id == wanted:
                seen_request = True
            if e.__class__ is ev.RequestAdded:
                requests += 1
                live.add(e.req_id)
                peak_live = max(peak_live, len(live))
            elif e.__class__ is ev.Finished:
                live.discard(e.req_id)
            judged = rules.judge(e)
            if e.__class__ is ev.StepDecoded:
                steady += len(judged) - 1
            elif e.__class__ in (ev.BlockDigested, ev.LoadDigested):
                judged[0][1].extend(book.apply(e))
            for x, violations in judged:
                for v in violations:
                    if result.add(
                        Problem(
                            "violation",
                            v.rule,
                            v.step,
                            v.req_id,
                            x,
                            path=frame.path,
                            offset=frame.offset,
                            seq=frame.seq,
                            index=index,
                            detail=detail_text(v),
                        ),
                        max_problems,
                    ):
                        done = True
                if diff is None:
                    continue
                problem = diff.apply(x)
                if problem is not None and result.add(
                    Problem(
                        "differential",
                        "LookupAnswered",
                        x.step,
                        x.req_id,
                        problem.ask,
                        recorded=(problem.inner,),
                        derived=(problem.kvledger,),
                        before=problem.state,
                        after=problem.state,
                        path=frame.path,
                        offset=frame.offset,
                        seq=frame.seq,
                        index=index,
                        detail=problem.detail,
                    ),
                    max_problems,
                ):
                    done = True
            index += 1
            if done:
                break
        if done:
            result.stopped_early = True
            break
    if request is not None and not seen_request and result.error is None:
        result.error = str(RequestNotFound(request))
    result.read_to(source)
    # vLLM's facts the log holds, a StepDecoded counting as the Scheduled events it stands for.
    inputs = steady + sum(n for t, n in by_type.items() if t in {c.__name__ for c in _INPUTS})
    result.counts = {
        "events": index,
        "inputs": inputs,
        "decisions": 0,
        "frames": frames,
        "steps": steps,
        "requests": requests,
        "peak_live_requests": peak_live,
        "steady_decode_steps": steady,
        "by_type": by_type,
        "recorded": {
            **rules.counts,
            **({"differential": diff.counts} if diff is not None else {}),
        },
        "digests": book.stats.to_dict(),
    }


class _Difference:
    __slots__ = ("ask", "detail", "inner", "kvledger", "state")

    def __init__(
        self,
        ask: ev.LookupAsked,
        inner: ev.LookupAnswered,
        kvledger: ev.LookupAnswered,
        state: dict[str, Any] | None,
        detail: str,
    ) -> None:
        self.ask = ask
        self.inner = inner
        self.kvledger = kvledger
        self.state = state
        self.detail = detail


class _Differential:
    """kvledger's decisions on the recorded inputs (see the module docstring)."""

    def __init__(self, config: TrackerConfig) -> None:
        from kvledger.tracker.tracker import Tracker  # loaded only for --differential

        # kvledger's decisions here are a comparison, not a run: given no logger, it says
        # nothing of its violations.
        self.tracker = Tracker(config.with_changes(strict=False))
        self._asked: dict[str, ev.LookupAsked] = {}
        self._answer: dict[str, ev.LookupAnswered] = {}
        self._diverged: set[str] = set()
        # External tokens vLLM accepted beyond kvledger's offer, per diverged admission.
        self._shift: dict[str, int] = {}
        self.counts = {"lookups_compared": 0, "lookups_differing": 0, "requests_differing": 0}

    def apply(self, e: ev.Event) -> _Difference | None:
        cls = e.__class__
        if cls in _INPUTS:
            self._fold(e)
            return None
        if cls is ev.InnerLookupAnswered:
            assert isinstance(e, ev.InnerLookupAnswered)
            return self._compare(e)
        return None

    def _fold(self, e: ev.Event) -> None:
        tracker = self.tracker
        tracker.step = e.step
        if e.__class__ is ev.Allocated and e.req_id in self._diverged:
            # vLLM accepted the inner's count; kvledger would not have offered it. Fold what
            # kvledger offered (and, at the admission, the tokens vLLM then computes instead of
            # loading), so that kvledger's state stays its own: what it would save, it saves.
            assert isinstance(e, ev.Allocated)
            mine = self._answer.get(e.req_id)
            if mine is not None and e.num_external > mine.external:
                self._shift[e.req_id] = e.num_external - mine.external
                e = ev.Allocated(e.step, e.req_id, e.block_ids, mine.external)
        elif e.__class__ is ev.Scheduled and e.req_id in self._shift:
            assert isinstance(e, ev.Scheduled)
            if e.admission is not ev.Admission.RUNNING:
                shift = min(self._shift.pop(e.req_id), e.num_computed)
                e = attrs.evolve(
                    e, num_computed=e.num_computed - shift, num_scheduled=e.num_scheduled + shift
                )
        decisions = tracker.apply(e)
        if e.__class__ is ev.RequestAdded:
            self._diverged.discard(e.req_id)
        for d in decisions:
            if d.__class__ is ev.LookupAnswered:
                assert isinstance(d, ev.LookupAnswered)
                self._answer[d.req_id] = d
                assert isinstance(e, ev.LookupAsked)
                self._asked[d.req_id] = e
            elif isinstance(d, ev.SavePlanned) and d.keys:
                tracker.apply(ev.SaveDone(e.step, d.req_id, d.keys))
            elif isinstance(d, ev.LoadPlanned) and d.keys:
                tracker.apply(ev.LoadDone(e.step, d.req_id))

    def _compare(self, e: ev.InnerLookupAnswered) -> _Difference | None:
        asked = self._asked.pop(e.req_id, None)
        mine = self._answer.get(e.req_id)
        if asked is None or mine is None or asked.step != e.step or e.external < 0:
            return None
        self.counts["lookups_compared"] += 1
        if mine.external == e.external:
            return None
        self.counts["lookups_differing"] += 1
        if e.req_id in self._diverged:
            return None
        self._diverged.add(e.req_id)
        self.counts["requests_differing"] += 1
        inner = ev.LookupAnswered(e.step, e.req_id, asked.local_hit + e.external, e.external)
        state = self.tracker.state(e.req_id)
        config = self.tracker.config
        detail = (
            f"asked: {asked.num_tokens} tokens, vLLM's local hit {asked.local_hit}; "
            f"the wrapped connector offered {e.external} external tokens"
            f"{' (async)' if e.load_async else ''}, kvledger would offer {mine.external} "
            f"(its pool holds {mine.hit} tokens of this prefix, chunks of "
            f"{config.chunk_size}, {config.num_slots} slots); "
            f"ask: {format_event(asked)}"
        )
        return _Difference(
            asked, inner, mine, state.summary() if state is not None else None, detail
        )
