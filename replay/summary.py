"""``stats``: what a log holds, counted in one pass: requests, steps, events by type,
preemptions, lookup hit rates, tokens loaded and saved, missed tokens by reason (counted by
``replay.explain``'s one ``Explainer``, as ``kvledger explain`` counts them), violations by
rule, events that say something impossible by rule (``tracker.wellformed``), bytes per
event."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from kvledger.replay.counts import COUNTERS, SUMMED, StepCounts
from kvledger.replay.explainer import Explainer
from kvledger.replay.misses import Tally
from kvledger.replay.source import LogPath, LogSource, damage_dict, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.digests import DigestBook
from kvledger.tracker.framing import Frame, StopInfo
from kvledger.tracker.history import walk
from kvledger.tracker.state import RequestState
from kvledger.tracker.wellformed import Wellformed

__all__ = ["LookupStats", "Stats", "stats"]


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@attrs.define
class LookupStats:
    """Lookups at admission: what vLLM asked (``tokens``), what the pool held (``hit``),
    what vLLM's own prefix cache covered (``local``), what it accepted from us (``external``)."""

    admissions: int = 0
    tokens: int = 0
    hit: int = 0
    local: int = 0
    external: int = 0
    without_lookup: int = 0

    @property
    def hit_rate(self) -> float | None:
        return _share(self.hit, self.tokens)

    @property
    def local_rate(self) -> float | None:
        return _share(self.local, self.tokens)

    @property
    def external_rate(self) -> float | None:
        return _share(self.external, self.tokens)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d.update(hit_rate=self.hit_rate, local_rate=self.local_rate)
        d["external_rate"] = self.external_rate
        return d


@attrs.define
class Stats:
    """What a log holds, counted in one pass. See :func:`stats`."""

    log: str
    files: list[str]
    file_bytes: int = 0
    frames: int = 0
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    seconds: float | None = None  # wall time from the first frame to the last
    events: int = 0
    # Events counting a StepDecoded once per request it names: what the log would hold
    # without the hot path's one-record-per-step encoding.
    logical_events: int = 0
    input_events: int = 0
    decision_events: int = 0
    events_by_type: dict[str, int] = attrs.field(factory=dict)
    requests: int = 0  # request lives (an id reused after it finished counts again)
    finished: int = 0
    finish_reasons: dict[str, int] = attrs.field(factory=dict)
    preemptions: int = 0  # signalled or inferred at re-admission
    readmissions: int = 0
    first_lookup: LookupStats = attrs.field(factory=LookupStats)
    all_lookups: LookupStats = attrs.field(factory=LookupStats)
    loads: int = 0
    tokens_loaded: int = 0
    loads_refused: int = 0
    load_failures: int = 0
    saves: int = 0
    tokens_saved: int = 0
    chunks_saved: int = 0
    chunks_confirmed: int = 0
    chunks_failed: int = 0
    violations: dict[str, int] = attrs.field(factory=dict)
    # Every admission's lookup explained (replay.explain): tokens asked, hit by part, missed
    # by reason, as `kvledger explain` totals them.
    misses: dict[str, Any] = attrs.field(factory=dict)
    # Events that say something impossible, by the rule of tracker/wellformed.py they break
    # (a ViolationRecorded of the run names them too, when it recorded them).
    malformed: dict[str, int] = attrs.field(factory=dict)
    # KV-content digests (tracker/digests.py): blocks digested, loaded blocks judged, verified,
    # mismatched, unchanged, unverifiable.
    digests: dict[str, int] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)
    library_version: str = ""
    format_version: str = ""
    run_id: str = ""
    # A recorder's log (connector/recorder.py): the lookups are the wrapped connector's, whose
    # own hits are not in the log; only vLLM's prefix cache and what vLLM accepted are.
    recorded: bool = False
    damage: StopInfo | None = None

    @property
    def bytes_per_event(self) -> float | None:
        return _share(self.file_bytes, self.events)

    @property
    def bytes_per_logical_event(self) -> float | None:
        return _share(self.file_bytes, self.logical_events)

    @property
    def violations_total(self) -> int:
        return sum(self.violations.values())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in attrs.fields(Stats):
            value = getattr(self, f.name)
            if isinstance(value, LookupStats):
                value = value.to_dict()
            elif isinstance(value, StopInfo):
                value = damage_dict(value)
            d[f.name] = value
        d["bytes_per_event"] = self.bytes_per_event
        d["bytes_per_logical_event"] = self.bytes_per_logical_event
        return d


def stats(path: LogPath | LogSource) -> Stats:
    """Count what a log holds: requests, steps, events by type, preemptions, lookup hit rates
    at first admission and at every admission, tokens loaded and saved, violations by rule,
    bytes per event (file size / events; also per logical event, a ``StepDecoded`` counting
    once per request it names), the header's configuration, and read damage."""
    src = open_log(path)
    config = src.config()
    h = src.header
    st = Stats(
        log=src.name,
        files=[str(p) for p in src.paths],
        file_bytes=src.file_bytes(),
        config=dict(h.get("config") or {}),
        library_version=str(h.get("library_version", "")),
        format_version=f"{h.get('major', '?')}.{h.get('minor', '?')}",
        run_id=str(h.get("run_id", "")),
        recorded=src.recorded,
    )
    by_type: Counter[type[ev.Event]] = Counter()
    reasons: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    last_frame: Frame | None = None
    first_wall: int | None = None
    prev_step: int | None = None
    # What each step did (replay.counts: the counts tail and the tables read), summed into the
    # totals at the end of each step.
    counts = StepCounts()
    count_of = COUNTERS.get
    running = ev.Admission.RUNNING
    # Preemption happens only in these folds (signalled, inferred from a lookup of a running
    # request, or from a re-admission); checking only them keeps the decode path cheap.
    may_preempt = (ev.Preempted, ev.LookupAsked)
    last_pos = -1
    decoded = 0
    book = DigestBook()
    tally = Tally()
    explainer = Explainer(config, tally.add, recorded=src.recorded)
    wellformed = Wellformed()
    malformed: Counter[str] = Counter()
    for item in walk(src.frames(), config, recorded=src.recorded):
        explainer.feed(item)
        pos = item.pos
        if pos == last_pos:
            continue  # StepDecoded again, for one of its requests: counted once
        last_pos = pos
        frame, e, new, before, after = item.frame, item.event, item.new, item.before, item.after
        if frame is not last_frame:
            last_frame = frame
            st.frames += 1
            if first_wall is None:
                first_wall = frame.wall_ns
                st.first_step = frame.step
            if frame.step != prev_step:
                st.steps += 1
                prev_step = frame.step
                _add_step(st, counts, rules)
                counts = StepCounts(frame.step)
        cls = e.__class__
        by_type[cls] += 1
        bad = wellformed.check(e)
        if bad:
            malformed.update(v.rule for v in bad)
        count = count_of(cls)
        if count is not None:
            count(counts, e)
        if cls is ev.Scheduled:
            if e.admission is running:  # type: ignore[attr-defined]
                continue  # the hot path: nothing to count beyond the type
            if before is not None:
                _count_lookup(st.all_lookups, before)
                if before.life.first_local_hit < 0:
                    _count_lookup(st.first_lookup, before)
                else:
                    st.readmissions += 1
        elif cls is ev.RequestAdded:
            if new:
                st.requests += 1
        elif cls is ev.Finished:
            if before is not None and not before.finished:
                st.finished += 1
                reasons[e.reason] += 1  # type: ignore[attr-defined]
        elif cls is ev.StepDecoded:
            decoded += len(e.nums)  # type: ignore[attr-defined]
        elif cls is ev.BlockDigested or cls is ev.LoadDigested:
            book.apply(e)
        if (
            (cls is ev.Scheduled or cls in may_preempt)
            and before is not None
            and after is not None
            and after.life.num_preemptions > before.life.num_preemptions
        ):
            st.preemptions += 1
    _add_step(st, counts, rules)
    if last_frame is not None:
        st.last_step = last_frame.step
        if first_wall is not None:
            st.seconds = (last_frame.wall_ns - first_wall) / 1e9
    st.events = sum(by_type.values())
    st.logical_events = st.events - by_type[ev.StepDecoded] + decoded
    st.decision_events = sum(n for cls, n in by_type.items() if cls.KIND == "decision")
    st.input_events = st.events - st.decision_events
    st.events_by_type = {cls.__name__: n for cls, n in by_type.most_common()}
    st.finish_reasons = dict(reasons.most_common())
    st.violations = dict(rules.most_common())
    st.malformed = dict(malformed.most_common())
    st.digests = book.stats.to_dict()
    explainer.finish()
    st.misses = tally.to_dict()
    st.damage = src.damage
    return st


def _add_step(st: Stats, counts: StepCounts, rules: Counter[str]) -> None:
    """A step's counts, summed into the log's."""
    for name in SUMMED:
        setattr(st, name, getattr(st, name) + getattr(counts, name))
    rules.update(rule for rule, _ in counts.violations)


def _count_lookup(bucket: LookupStats, before: RequestState) -> None:
    bucket.admissions += 1
    lookup = before.lookup
    if lookup is None:
        bucket.without_lookup += 1
        return
    bucket.tokens += lookup.num_tokens
    bucket.hit += lookup.hit
    bucket.local += lookup.local_hit
    bucket.external += before.accepted
