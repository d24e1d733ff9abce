"""``kvledger whatif``: what would have hit under other settings, forecast from one log.

The run's requests are run again through the tracker's own rules (``tracker.Tracker``: the
lookup's answer, the load and save plans, the pool's LRU index, block hits, partial chunks,
the remote tier's facts) under the settings asked, and the forecast run is explained as
``kvledger explain`` explains a real one (``replay.explain.explain_frames``). The report puts
its tokens hit, by source, and its reasons for what would still miss beside the run's own.

What is kept from the run (the forecast's model of vLLM):

- the requests: the same arrivals, in the same steps and order, the same prompts and
  outputs, the same preemptions and finishes;
- vLLM's own prefix cache: each lookup's ``local_hit`` is the run's;
- vLLM's schedule: each request computes, step by step, at least what it computed in the
  run. A request offered more than in the run loads it and computes as many tokens past it
  as the run scheduled for it in that step (a chunked prefill ends sooner); one offered less
  computes what it no longer loads in that step too. vLLM would also accept every token
  offered (as it does when it has the blocks), and every load and save succeeds (a failure
  in the run is not repeated);
- the worker: every load and save planned in a step is done as many steps later as the
  run's were (one with a synchronous worker, two under async scheduling), first in that step,
  as the run's worker reported them.

What changes is the pool's content, hence every lookup's answer: a forecast, not a verdict.
Where the real scheduler would have differed (a prefill that loads more leaves budget to
other requests, which may then run earlier) the forecast keeps the run's order; the docs
(docs/whatif.md) give its error against real runs.

On a recorder's log (``KVLedgerRecorder`` around another connector: LMCache, vLLM's own) the
run's figures are the wrapped connector's (``inner``), and the forecast is what kvledger's own
pool would have hit on the same run: the inputs are the same vLLM callbacks, and the offers
vLLM acted on are replaced by the forecast's.

A question the log cannot answer is refused, naming why (:class:`Unanswerable`): decode
chunks (``save_decode_cache=true``) need the token ids of steady decode steps, which
kvledger's own log does not carry (a recorder's log does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import attrs

from kvledger.replay.explain import Explanation, explain, explain_frames
from kvledger.replay.replayer import Progress, ReadProgress, parse_overrides
from kvledger.replay.source import LogPath, LogSource, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex, RemoteKeys
from kvledger.tracker.config import MAX_ASYNC_LAG, ConfigError, TrackerConfig
from kvledger.tracker.digests import digests_only
from kvledger.tracker.framing import Frame, StopInfo
from kvledger.tracker.plans import answer_lookup
from kvledger.tracker.remote import REMOTE_TYPES
from kvledger.tracker.state import RequestState
from kvledger.tracker.tracker import Tracker

__all__ = [
    "SETTINGS",
    "Curve",
    "Forecast",
    "Unanswerable",
    "parse_settings",
    "sweep",
    "whatif",
]

# The settings a what-if may change: the tracker's, and whether the remote tier is there.
TRACKER_SETTINGS = (
    "num_slots",
    "chunk_size",
    "save_decode_cache",
    "discard_partial_chunks",
    "block_hits",
)
SETTINGS = (*TRACKER_SETTINGS, "remote")

# What the forecast keeps from the run, said with every report.
APPROXIMATIONS = (
    "the run's requests, arrivals, prompts, outputs, preemptions and finishes, in its order",
    "vLLM's prefix cache hit (local) of each lookup is the run's",
    "each request computes at least what it computed in the run, step by step; offered more, "
    "it computes as many tokens past its load as the run scheduled for it, offered less, the "
    "difference too, in that step",
    "vLLM accepts every token offered; every load and save succeeds, as many steps after its "
    "plan as the run's did",
)


DECODE_IDS = (
    "save_decode_cache=true cannot be answered from this log: a decode chunk's key is a hash "
    "of its token ids, and this log's steady decode steps carry none (kvledger's own log "
    "learns them only when a step needs them, and this run's steps never needed them at "
    "those boundaries). A run with save_decode_cache=true and the same chunk_size can answer it"
)


class Unanswerable(ValueError):
    """A what-if this log cannot answer, or a setting that is not one: the message says
    which, and why."""


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``["num_slots=4", "remote=off"]`` -> typed values. Raises :class:`Unanswerable`
    naming a key that is not a what-if setting, or a value of the wrong type."""
    tracker_items: list[str] = []
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if key == "remote":
            value = text.strip().lower()
            if value not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
                raise Unanswerable(f"remote expects on or off, got {text.strip()!r}")
            out["remote"] = value in ("on", "true", "1", "yes")
            continue
        if sep and key and key not in TRACKER_SETTINGS:
            raise Unanswerable(f"{key!r} is not a what-if setting; accepted: {', '.join(SETTINGS)}")
        tracker_items.append(item)
    try:
        out.update(parse_overrides(tracker_items))
    except ConfigError as e:
        raise Unanswerable(str(e)) from None
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_T = TypeVar("_T")


def _partition(items: list[_T], due: Callable[[_T], bool]) -> tuple[list[_T], list[_T]]:
    """(the items ``due`` takes, the others), each in order."""
    taken: list[_T] = []
    kept: list[_T] = []
    for item in items:
        (taken if due(item) else kept).append(item)
    return taken, kept


# More tokens than any request holds (vLLM's longest contexts are a few million): a record
# claiming more is damaged or forged (kvledger check names it), and its request is not forecast
# from it (a block table that long could not be allocated).
_MAX_TOKENS = 1 << 28


class _Unforecastable(Exception):
    """A record the forecast cannot follow (:data:`_MAX_TOKENS`)."""


class _Frames:
    """The forecast Tracker's log sink: each step's events become one frame, handed to the
    explainer as they come (nothing is written anywhere)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[ev.Event] = []
        self.ready: list[Frame] = []
        self.seq = 0
        self.wall_ns = 0

    def append(self, event: ev.Event) -> None:
        self.events.append(event)

    def end_step(self, step: int) -> None:
        if self.events:
            self.ready.append(Frame(self.seq, step, self.wall_ns, tuple(self.events), 0, self.name))
            self.seq += 1
            self.events = []


class _Forecaster:
    """Runs the log's inputs again through a Tracker under ``config``, keeping the run's
    schedule (the module docstring), one recorded frame at a time."""

    def __init__(
        self,
        config: TrackerConfig,
        *,
        remote: bool | None,
        name: str,
        same_keys: bool = True,
        decode_ids_needed: bool = False,
        curve: _Curve | None = None,
    ) -> None:
        self.config = config
        self.sink = _Frames(name)
        self.t = Tracker(config, log=self.sink)
        # None: the remote tier as the run had it (its facts are replayed when the keys are
        # the run's, and this engine's saves are written to it once the log shows one).
        self.remote = remote
        self.remote_seen = remote is True
        # The run's chunk keys are the forecast's (the same chunk size): its facts about the
        # pool and the store apply.
        self.same_keys = same_keys
        self.run_rules: Counter[str] = Counter()  # the rule breaks the run recorded
        # Decode chunks to save that the run never saved: their token ids are needed.
        self.decode_ids_needed = decode_ids_needed
        self.tokens: dict[str, list[int]] = {}  # the token ids the run knew, per request
        self.ran: dict[str, int] = {}  # tokens the run had computed or scheduled
        self.done: dict[str, int] = {}  # ... and the forecast
        self.tables: dict[str, list[int]] = {}  # the forecast's block table
        self.offered: dict[str, int] = {}  # the forecast's answer to the latest lookup
        # The forecast's plans waiting for their results: (step planned, req id, keys).
        self.saves: list[tuple[int, str, tuple[bytes, ...]]] = []
        self.loads: list[tuple[int, str]] = []
        # The run's worker: how many steps after its plan a result came (1 with a
        # synchronous worker; 2 under async scheduling, or a deferred save), learned from the
        # run's own plans and results as they come.
        self.lag = {"save": 1, "load": 1}
        self.run_saves: dict[bytes, int] = {}  # chunk key -> the step the run planned it
        self.run_loads: dict[str, int] = {}  # req id -> the step its load was planned
        self.next_block = 0
        self.lost_records = 0
        self.unforecastable = 0  # records claiming more tokens than any request holds
        # The hit curve's stack, when one is asked for (sweep).
        self.curve = curve

    # --- frames -------------------------------------------------------------------------

    def frame(self, frame: Any) -> list[Frame]:
        t = self.t
        while t.step < frame.step:
            t.end_step()  # the frames of earlier steps keep the time they were read at
        self.sink.wall_ns = frame.wall_ns
        self._results()
        handlers = _HANDLERS
        for e in frame.events:
            handler = handlers.get(e.__class__)
            try:
                if handler is not None:
                    handler(self, e)
                elif e.__class__ in REMOTE_TYPES:
                    self._remote_fact(e)
            except _Unforecastable:
                self.unforecastable += 1
        out, self.sink.ready = self.sink.ready, []
        return out

    def run(self, frames: Iterable[Any]) -> Iterator[Frame]:
        """The forecast run's frames, made as the run's ``frames`` are read (memory follows
        the live requests; a curve's stack grows with the distinct chunks of the log)."""
        for frame in frames:
            yield from self.frame(frame)
        yield from self.finish()

    def finish(self) -> list[Frame]:
        self.t.end_step()
        self._results(every=True)
        self.t.end_step()
        out, self.sink.ready = self.sink.ready, []
        return out

    def _results(self, *, every: bool = False) -> None:
        """The results of the forecast's plans that the run did not make too, as many steps
        after them as the run's results came (``every``: all, at the end of the log). A
        plan the run made too is done where the run's was, in its order (``_run_result``)."""
        t = self.t
        due_save = t.step - self.lag["save"]
        due_load = t.step - self.lag["load"]
        run_saves, run_loads = self.run_saves, self.run_loads
        saves, self.saves = _partition(
            self.saves,
            lambda s: every or (s[0] <= due_save and not any(k in run_saves for k in s[2])),
        )
        loads, self.loads = _partition(
            self.loads, lambda s: every or (s[0] <= due_load and s[1] not in run_loads)
        )
        self._saved(saves)
        self._loaded(loads)

    def _saved(self, saves: Sequence[tuple[int, str, tuple[bytes, ...]]]) -> None:
        t = self.t
        for _, req_id, keys in saves:
            self._take(t.apply(ev.SaveDone(t.step, req_id, keys)))
            if self.curve is not None:
                self.curve.referenced(t.index, keys)
            if self.remote_seen:
                t.apply(ev.RemoteSaveDone(t.step, req_id, keys))

    def _loaded(self, loads: Sequence[tuple[int, str]]) -> None:
        for _, req_id in loads:
            self._take(self.t.apply(ev.LoadDone(self.t.step, req_id)))

    def own_violations(self) -> list[str]:
        """The rules the forecast broke that the run did not record breaking itself."""
        return sorted((Counter(v.rule for v in self.t.violations) - self.run_rules).elements())

    def _run_plan(self, e: ev.Event) -> None:
        """The run's own plan: what the forecast's same plan waits for."""
        if isinstance(e, ev.SavePlanned):
            for key in e.keys:
                self.run_saves[key] = e.step
        elif isinstance(e, ev.LoadPlanned) and e.keys:
            self.run_loads[e.req_id] = e.step

    def _run_result(self, e: ev.Event) -> None:
        """The run's worker reported a plan done (or failed: the forecast's succeeds): the
        forecast's same plan is done now, and the lag is learned for the others."""
        step = None
        if isinstance(e, (ev.SaveDone, ev.SaveFailed)):
            keys = set(e.keys)
            for key in e.keys:
                step = self.run_saves.pop(key, step)
            if step is not None:
                self.lag["save"] = max(1, e.step - step)
            mine, self.saves = _partition(self.saves, lambda s: bool(keys.intersection(s[2])))
            self._saved(mine)
        elif isinstance(e, (ev.LoadDone, ev.LoadFailed)):
            step = self.run_loads.pop(e.req_id, None)
            if step is not None:
                self.lag["load"] = max(1, e.step - step)
            done, self.loads = _partition(self.loads, lambda s: s[1] == e.req_id)
            self._loaded(done)

    def _take(self, decisions: Sequence[ev.DecisionEvent]) -> None:
        for d in decisions:
            if isinstance(d, ev.SavePlanned) and d.keys:
                self.saves.append((d.step, d.req_id, d.keys))
            elif isinstance(d, ev.LoadPlanned) and d.keys:
                self.loads.append((d.step, d.req_id))
                if self.curve is not None:
                    self.curve.referenced(self.t.index, d.keys)

    # --- what the run knew --------------------------------------------------------------

    def _learn(self, req_id: str, start: int, ids: Sequence[int]) -> list[int]:
        toks = self.tokens.setdefault(req_id, [])
        if ids and start <= len(toks):
            toks[start : start + len(ids)] = ids
        return toks

    def _table(self, req_id: str, tokens: int) -> tuple[list[int], list[int]]:
        """The forecast's block table grown to hold ``tokens``: (table, blocks added). Its
        block ids are its own (nothing is moved; they only have to be distinct)."""
        if tokens > _MAX_TOKENS:
            raise _Unforecastable(tokens)
        table = self.tables.setdefault(req_id, [])
        need = _cdiv(tokens, self.config.block_size) - len(table)
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        table.extend(new)
        return table, new

    # --- the run's inputs, one handler per type -------------------------------------------

    def _added(self, e: ev.RequestAdded) -> None:
        self.tokens[e.req_id] = list(e.prompt_token_ids)
        self.ran[e.req_id] = self.done[e.req_id] = 0
        self._take(self.t.apply(e))

    def _lookup(self, e: ev.LookupAsked) -> None:
        toks = self._learn(e.req_id, e.token_start, e.token_ids)
        state = self.t.state(e.req_id)
        known = len(state.token_ids) if state is not None else 0
        start = min(known, e.num_tokens, len(toks))
        ids = ev.int_tuple(toks[start : e.num_tokens])
        asked = ev.LookupAsked(e.step, e.req_id, e.local_hit, e.num_tokens, start, ids, e.preempted)
        self.offered[e.req_id] = 0
        for d in self.t.apply(asked):
            if isinstance(d, ev.LookupAnswered):
                self.offered[e.req_id] = d.external

    def _allocated(self, e: ev.Allocated) -> None:
        state = self.t.state(e.req_id)
        if state is not None and state.allocated:
            # The second call, after an asynchronous load: the table, nothing to decide.
            self._take(
                self.t.apply(
                    ev.Allocated(e.step, e.req_id, tuple(self.tables.get(e.req_id, ())), 0)
                )
            )
            return
        external = self.offered.pop(e.req_id, 0)
        local = state.lookup.local_hit if state is not None and state.lookup else 0
        if self.curve is not None and state is not None and state.lookup is not None:
            self.curve.admitted(state, self.t.config)  # the lookup vLLM acts on
        self.tables[e.req_id] = []
        table, _ = self._table(
            e.req_id, max(len(e.block_ids) * self.config.block_size, local + external + 1)
        )
        self._take(self.t.apply(ev.Allocated(e.step, e.req_id, tuple(table), external)))

    def _scheduled(self, e: ev.Scheduled) -> None:
        req_id = e.req_id
        toks = self._learn(req_id, e.token_start, e.token_ids)
        end = e.num_computed + e.num_scheduled
        ran = self.ran.get(req_id, 0)
        self.ran[req_id] = end
        t = self.t
        if e.admission is not ev.Admission.RUNNING:
            state = t.state(req_id)
            if state is None:
                return
            lookup = state.lookup
            computed = (lookup.local_hit if lookup else e.num_computed) + state.accepted
            # Offered more than in the run: it computes as many tokens as the run scheduled
            # for it in this step, past what it loads (a chunked prefill ends sooner; vLLM's
            # budget for it is the run's). Offered less: the difference, in this step too.
            mine = max(end, min(max(len(toks), end), computed + e.num_scheduled))
            if req_id not in self.tables or not state.allocated:
                self.tables[req_id] = []
            blocks, _ = self._table(req_id, mine)  # an admission gives the whole table
        else:
            done = self.done.get(req_id, 0)
            if done == ran:  # in step with the run: its very step, rollbacks included
                computed, mine = e.num_computed, end
            else:  # ahead of it (it loaded more): computes what the run has not caught up on
                computed, mine = done, max(end, done)
            if mine <= computed:
                return
            _, blocks = self._table(req_id, mine)  # a running request: the blocks added
        self.done[req_id] = mine
        self._take(
            t.scheduled(
                req_id,
                num_computed=computed,
                num_scheduled=mine - computed,
                all_token_ids=toks,
                block_ids=blocks,
                admission=e.admission,
            )
        )

    def _decoded(self, e: ev.StepDecoded) -> None:
        t, b = self.t, self.config.block_size
        steady: list[int] = []
        grown: list[tuple[int, int]] = []
        found = t.entries_of(e)[0]  # an unknown number: kvledger check names it
        if found and found[0].token is None and self.decode_ids_needed:
            raise Unanswerable(DECODE_IDS)
        for _, req_id, _, token in found:
            toks = self.tokens.setdefault(req_id, [])
            ran = self.ran.get(req_id, 0)
            self.ran[req_id] = ran + 1
            if token is not None:
                toks.append(token)
            done = self.done.get(req_id, 0)
            if done != ran:
                continue  # ahead of the run: this token is already computed
            table = self.tables.setdefault(req_id, [])
            block = None
            if done + 1 > len(table) * b:
                _, new = self._table(req_id, done + 1)
                block = new[0]
            self.done[req_id] = done + 1
            number = t.decode_step_ok(req_id, done, block)
            if number is not None:
                steady.append(number)
                if block is not None:
                    grown.append((number, block))
                continue
            self._take(
                t.scheduled(
                    req_id,
                    num_computed=done,
                    num_scheduled=1,
                    all_token_ids=toks,
                    block_ids=() if block is None else (block,),
                )
            )
        t.decoded(steady, grown)

    def _preempted(self, e: ev.Preempted) -> None:
        self._take(self.t.apply(e))

    def _finished(self, e: ev.Finished) -> None:
        self._take(self.t.apply(e))
        for d in (self.tokens, self.ran, self.done, self.tables, self.offered):
            d.pop(e.req_id, None)

    def _chunk_fact(self, e: ev.Event) -> None:
        # A warm pool's chunk stored or evicted outside any plan: a fact about the pool,
        # by the run's chunk keys (under another chunk size no lookup could find it).
        if self.same_keys:
            self._take(self.t.apply(e))
            if self.curve is not None and isinstance(e, ev.ChunkStored):
                self.curve.referenced(self.t.index, (e.key,))

    def _run_violation(self, e: ev.ViolationRecorded) -> None:
        self.run_rules[e.rule] += 1

    def _lost(self, e: ev.RecordLost) -> None:
        if not digests_only(e):  # a digest lost is no scheduler fact missing
            self.lost_records += 1

    def _remote_fact(self, e: ev.Event) -> None:
        """The remote tier's facts. What the store held (found, down, back) is replayed when
        the remote tier is not turned off and the chunk keys are the run's; the run's own
        writes and failed reads are not (the forecast writes and reads its own)."""
        if self.remote is not False:
            self.remote_seen = True
        held = isinstance(e, (ev.RemoteFound, ev.RemoteOutage, ev.RemoteRestored))
        if held and self.remote is not False and self.same_keys:
            self._take(self.t.apply(e))


_HANDLERS: dict[type, Callable[[_Forecaster, Any], None]] = {
    ev.RequestAdded: _Forecaster._added,
    ev.LookupAsked: _Forecaster._lookup,
    ev.Allocated: _Forecaster._allocated,
    ev.Scheduled: _Forecaster._scheduled,
    ev.StepDecoded: _Forecaster._decoded,
    ev.Preempted: _Forecaster._preempted,
    ev.Finished: _Forecaster._finished,
    ev.ChunkStored: _Forecaster._chunk_fact,
    ev.ChunkEvicted: _Forecaster._chunk_fact,
    ev.RecordLost: _Forecaster._lost,
    ev.ViolationRecorded: _Forecaster._run_violation,
    ev.SavePlanned: _Forecaster._run_plan,
    ev.LoadPlanned: _Forecaster._run_plan,
    ev.SaveDone: _Forecaster._run_result,
    ev.SaveFailed: _Forecaster._run_result,
    ev.LoadDone: _Forecaster._run_result,
    ev.LoadFailed: _Forecaster._run_result,
}


# --- the forecast -----------------------------------------------------------------------------


@attrs.define
class Forecast:
    """The run's own figures (``actual``) and the forecast's (``forecast``), both as
    ``kvledger explain`` counts them."""

    log: str
    changes: dict[str, Any]
    recorded_config: TrackerConfig
    config: TrackerConfig
    remote: str  # "as recorded", "on" or "off"
    actual: Explanation
    forecast: Explanation
    # Rules the forecast broke beyond those the run recorded breaking (``run_violations``):
    # 0 expected. A log that breaks a rule kvledger check derives (not recorded) repeats it.
    violations: list[str] = attrs.field(factory=list)
    run_violations: list[str] = attrs.field(factory=list)
    lost_records: int = 0
    unforecastable: int = 0
    # A recorder's log: the wrapped connector's name (the run's figures are its own).
    inner: str | None = None

    def notes(self) -> list[str]:
        notes = [f"kept from the run: {a}" for a in APPROXIMATIONS]
        if self.lost_records:
            notes.append(
                f"{self.lost_records} records of the run were lost (RecordLost): the forecast "
                "runs without them"
            )
        if self.unforecastable:
            notes.append(
                f"{self.unforecastable} records claim more tokens than any request holds "
                "(kvledger check names them): the forecast skipped them"
            )
        if self.violations:
            notes.append(
                f"the forecast met {len(self.violations)} rule breaks the run did not record "
                f"({', '.join(sorted(set(self.violations)))}): if kvledger check finds them "
                "in the run too, the forecast repeats the run's; else they are the forecast's"
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        actual = {r.request: r for r in self.actual.requests}
        requests = []
        for r in self.forecast.requests:
            was = actual.get(r.request)
            requests.append(
                {
                    "request": r.request,
                    "req_id": r.req_id,
                    "actual": _figures(was.totals()) if was is not None else None,
                    "forecast": _figures(r.totals()),
                }
            )
        return {
            "log": self.log,
            "inner": self.inner,
            "with": dict(self.changes),
            "remote": self.remote,
            "recorded_config": _settings(self.recorded_config),
            "config": _settings(self.config),
            "actual": _figures(self.actual.totals()),
            "forecast": _figures(self.forecast.totals()),
            "requests": requests,
            "violations": list(self.violations),
            "run_violations": list(self.run_violations),
            "notes": self.notes(),
        }


def _settings(c: TrackerConfig) -> dict[str, Any]:
    return {k: getattr(c, k) for k in TRACKER_SETTINGS}


def _figures(totals: dict[str, Any]) -> dict[str, Any]:
    """explain's sums, in explain's vocabulary."""
    keys = ("admissions", "tokens_asked", "tokens_hit", "missed_tokens", "hit", "reasons")
    return {k: totals[k] for k in keys}


class _Setup(NamedTuple):
    source: LogSource
    recorded: TrackerConfig
    config: TrackerConfig  # the what-if's settings
    run_config: TrackerConfig  # ... as the forecast's Tracker runs them
    options: dict[str, Any]  # the _Forecaster's keyword arguments


def _setup(path: LogPath, changes: dict[str, Any]) -> _Setup:
    unknown = sorted(set(changes) - set(SETTINGS))
    if unknown:
        raise Unanswerable(f"not what-if settings: {unknown}; accepted: {', '.join(SETTINGS)}")
    src = open_log(path)
    recorded = src.config()
    tracker_changes = {k: v for k, v in changes.items() if k in TRACKER_SETTINGS}
    try:
        config = recorded.with_changes(**tracker_changes)
    except (ConfigError, TypeError) as e:
        raise Unanswerable(str(e)) from None
    # Steady decode steps learn their token ids later, in bulk; a forecast step that is not
    # steady goes through Scheduled without them.
    run_config = config.with_changes(max_async_lag=MAX_ASYNC_LAG, strict=False)
    keyed = config.chunk_size == recorded.chunk_size
    options = {
        "remote": changes.get("remote"),
        "same_keys": keyed,
        "decode_ids_needed": config.save_decode_cache
        and not (recorded.save_decode_cache and keyed),
        "name": f"{src.name} (forecast)",
    }
    return _Setup(src, recorded, config, run_config, options)


def _remote_text(remote: bool | None) -> str:
    return "as recorded" if remote is None else ("on" if remote else "off")


def _read(setup: _Setup, progress: Progress | None) -> Iterator[Any]:
    """The run's frames, with ``progress(bytes done, bytes total)`` a few times a second."""
    if progress is None:
        yield from setup.source.frames()
        return
    report = ReadProgress(progress, setup.source.paths)
    for frame in setup.source.frames():
        report.at(frame)
        yield frame
    report.end()


def whatif(
    path: LogPath,
    changes: dict[str, Any],
    *,
    progress: Progress | None = None,
    actual: Explanation | None = None,
) -> Forecast:
    """Forecast what the run of the log at ``path`` would have hit under ``changes`` (keys
    of :data:`SETTINGS`). Raises :class:`Unanswerable` for a setting that is not one, or a
    question this log cannot answer; ``LogFormatError`` / ``OSError`` for a log that cannot
    be read. ``progress(bytes done, bytes total)``: the forecast's reading of the log.
    ``actual``: the run's own explanation, when the caller has it (a sweep of several
    forecasts of one log explains the run once)."""
    setup = _setup(path, changes)
    f = _Forecaster(setup.run_config, **setup.options)
    forecast = explain_frames(
        f.run(_read(setup, progress)), setup.run_config, name=setup.options["name"]
    )
    return Forecast(
        log=setup.source.name,
        changes=dict(changes),
        recorded_config=setup.recorded,
        config=setup.config,
        remote=_remote_text(changes.get("remote")),
        actual=explain(path) if actual is None else actual,
        forecast=forecast,
        violations=f.own_violations(),
        run_violations=sorted(f.run_rules.elements()),
        lost_records=f.lost_records,
        unforecastable=f.unforecastable,
        inner=_inner(setup.source),
    )


def _inner(source: LogSource) -> str | None:
    """The connector a recorder's log wrapped (None: kvledger's own log)."""
    if not source.recorded:
        return None
    recorder = source.run_info.get("recorder")
    name = recorder.get("inner") if isinstance(recorder, dict) else None
    return str(name) if name else "the wrapped connector"


@attrs.define
class Curve:
    """Tokens the pool would have offered at each size (``sizes``, in slots), from one pass;
    ``actual``: what the run's own pool offered (its ``num_slots``)."""

    log: str
    changes: dict[str, Any]
    config: TrackerConfig  # the other settings (num_slots: the run's)
    sizes: list[int]
    offered: list[int]
    admissions: int
    tokens_asked: int
    actual: int
    violations: list[str] = attrs.field(factory=list)
    damage: StopInfo | None = None  # where reading the log stopped early

    def to_dict(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "with": dict(self.changes),
            "config": _settings(self.config),
            "admissions": self.admissions,
            "tokens_asked": self.tokens_asked,
            "actual": {"num_slots": self.config.num_slots, "pool": self.actual},
            "curve": [
                {"num_slots": n, "pool": hit}
                for n, hit in zip(self.sizes, self.offered, strict=True)
            ],
            "violations": list(self.violations),
        }


def sweep(
    path: LogPath,
    sizes: Sequence[int],
    changes: dict[str, Any] | None = None,
    *,
    progress: Progress | None = None,
) -> Curve:
    """The hit curve over pool ``sizes`` (slots) under ``changes`` (any setting but
    ``num_slots``), from one forecast pass at the largest size: Mattson's stack distances
    (:class:`_Recency`) answer every size at once."""
    changes = dict(changes or {})
    if "num_slots" in changes:
        raise Unanswerable("--sweep num_slots=... sets the pool sizes: drop --with num_slots")
    if not sizes or min(sizes) < 1:
        raise Unanswerable(f"pool sizes must be positive slot counts, got {list(sizes)}")
    setup = _setup(path, {**changes, "num_slots": max(sizes)})
    curve = _Curve(sizes)
    f = _Forecaster(setup.run_config, curve=curve, **setup.options)
    for _ in f.run(_read(setup, progress)):
        pass
    explained = explain(path)
    actual = explained.totals()
    return Curve(
        log=setup.source.name,
        changes=changes,
        config=setup.config.with_changes(num_slots=setup.recorded.num_slots),
        sizes=curve.sizes,
        offered=curve.offered,
        admissions=curve.admissions,
        tokens_asked=actual["tokens_asked"],
        actual=actual["hit"]["pool"],
        violations=f.own_violations(),
        damage=explained.damage,
    )


# --- the hit curve: every pool size in one pass (Mattson's stack distances) ------------------


class _Recency:
    """An LRU stack over chunk keys, as Mattson et al. (1970) use it: a key's *distance* is
    how many distinct keys were referenced since it was, itself included. An LRU pool of
    ``n`` slots holds exactly the keys at distance <= n, for every ``n`` at once.

    A Fenwick tree over reference times counts the keys whose last reference is at or after
    a time: O(log references) per reference and per question."""

    def __init__(self) -> None:
        self.last: dict[bytes, int] = {}  # key -> the time of its last reference
        self.tree = [0] * 1025  # 1-based Fenwick tree over times 1..len-1
        self.now = 0
        self.live = 0  # keys referenced at least once

    def _add(self, i: int, delta: int) -> None:
        tree = self.tree
        n = len(tree)
        while i < n:
            tree[i] += delta
            i += i & -i

    def _before(self, i: int) -> int:
        """How many keys were last referenced at a time <= i."""
        total, tree = 0, self.tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def touch(self, key: bytes) -> int:
        """Reference ``key`` now; returns its time."""
        self.now += 1
        if self.now >= len(self.tree):
            self._grow()
        old = self.last.get(key)
        if old is None:
            self.live += 1
        else:
            self._add(old, -1)
        self.last[key] = self.now
        self._add(self.now, 1)
        return self.now

    def _grow(self) -> None:
        times = sorted(self.last.values())
        self.tree = [0] * (2 * len(self.tree) - 1)
        for t in times:
            self._add(t, 1)

    def distance_at(self, time: int | None) -> int | None:
        """The distance of the key last referenced at ``time`` (None: never referenced)."""
        if time is None:
            return None
        return self.live - self._before(time - 1)


class _StackView:
    """What :func:`tracker.plans.answer_lookup` asks of a pool, answered for an LRU pool of
    ``slots`` slots from the recency stack: the tracker's own lookup rule, run against every
    pool size of the curve."""

    __slots__ = ("alias_distance", "distance", "remote", "slots")

    def __init__(self, slots: int, distance: Callable[[bytes], int | None],
                 alias_distance: Callable[[bytes], int | None], remote: Any) -> None:  # fmt: skip
        self.slots = slots
        self.distance = distance  # of a chunk's own key
        self.alias_distance = alias_distance  # of the latest chunk found under an alias
        self.remote = remote

    def _held(self, d: int | None) -> bool:
        return d is not None and d <= self.slots

    def slot_of(self, key: bytes) -> int | None:
        return 0 if self._held(self.distance(key)) else None

    def __contains__(self, key: object) -> bool:
        assert isinstance(key, bytes)
        return self._held(self.distance(key)) or self._held(self.alias_distance(key))

    def hash_aliases(self, group: bytes) -> None:
        """Nothing to do: every alias's time was taken when its chunk was referenced
        (``ChunkIndex.aliases``)."""


class _Curve:
    """The tokens each pool size would have offered from the pool, summed over the lookups
    vLLM acted on, from one forecast pass (at the largest size): every chunk the pass loads
    or stores is a reference to the recency stack, and each acted-on lookup is answered by
    the tracker's rule (``answer_lookup``) against every size's view of that stack."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = sorted(set(sizes))
        self.stack = _Recency()
        self.alias_time: dict[bytes, int] = {}  # alias -> its latest chunk's reference time
        self.offered = [0] * len(self.sizes)
        self.admissions = 0
        self.no_remote = RemoteKeys()  # the curve is the pool's alone
        self.views = [
            _StackView(n, self._distance, self._alias_distance, self.no_remote) for n in self.sizes
        ]

    def _distance(self, key: bytes) -> int | None:
        return self.stack.distance_at(self.stack.last.get(key))

    def _alias_distance(self, key: bytes) -> int | None:
        return self.stack.distance_at(self.alias_time.get(key))

    def referenced(self, index: ChunkIndex, keys: Sequence[bytes]) -> None:
        for key in keys:
            if index.slot_of(key) is None:
                continue  # read from the remote tier, or not stored after all
            time = self.stack.touch(key)
            for alias in index.aliases(key):
                self.alias_time[alias] = time

    def admitted(self, state: RequestState, config: TrackerConfig) -> None:
        lookup = state.lookup
        assert lookup is not None
        self.admissions += 1
        for i, view in enumerate(self.views):
            _, external = answer_lookup(state, view, config, lookup.local_hit, lookup.num_tokens)
            self.offered[i] += external
