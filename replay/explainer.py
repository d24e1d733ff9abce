"""The walk of ``kvledger explain``: :class:`Explainer` follows one log's walk
(``tracker.history.walk``), folds the pool's index as the recording Tracker did
(``tracker.index_fold.apply_recorded``), keeps what each request computed (``replay.computed``)
and what became of each chunk, and at each admission splits the lookup vLLM acted on into
tokens hit and tokens missed, each span with its reason (``replay.misses``). The method, reason
by reason, is ``replay.explain``'s docstring.

``stats``, the tables, the timeline, the Perfetto trace, the OpenTelemetry spans and ``explain``
itself count misses through this one class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvledger.replay.computed import ANY_ROOT, Computed, History
from kvledger.replay.misses import AdmissionMisses, Miss, zero_hits
from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.history import RETIRED_MEMORY, Folded, retires
from kvledger.tracker.index_fold import apply_recorded
from kvledger.tracker.inner_store import InnerStore
from kvledger.tracker.plans import (
    Span,
    block_hit,
    lookup_spans,
    save_policy_end,
    saved_tail,
    span_tier,
    transfer_plan,
)
from kvledger.tracker.remote import foreign
from kvledger.tracker.state import RequestState
from kvledger.tracker.tiers import POOL, tier_of_slot

__all__ = ["FATES_MEMORY", "HISTORY_TOKENS", "Explainer", "OnAdmission"]

# The history kept by default: token ids of the distinct sequences computed (4 bytes each).
HISTORY_TOKENS = 1 << 24
# Chunk keys whose fate in the pool (or on the remote store) is remembered, at most.
FATES_MEMORY = 1 << 20


# The reasons a computation in the lookup's own step overrides (Explainer._in_flight): what the
# lookup could not know yet, since vLLM records a step's schedule after its lookups.
_IN_FLIGHT_OVER = frozenset({"new_prefix", "earlier_run"})


def _retell(
    pieces: list[Miss],
    start: int,
    end: int,
    why: Miss,
    over: frozenset[str] | None = _IN_FLIGHT_OVER,
) -> None:
    """Give the pieces' tokens in ``[start, end)`` missed for a reason in ``over`` (None: any)
    the reason and facts of ``why``, in place, splitting pieces at the bounds."""
    out: list[Miss] = []
    for m in pieces:
        if (over is not None and m.reason not in over) or m.end <= start or m.start >= end:
            out.append(m)
            continue
        a, b = max(m.start, start), min(m.end, end)
        if m.start < a:
            out.append(m._replace(end=a))
        out.append(why._replace(start=a, end=b))
        if b < m.end:
            out.append(m._replace(start=b))
    pieces[:] = out


def _moved(m: Miss, start: int, end: int) -> Miss:
    return m._replace(start=start, end=end)


def _past(pieces: list[Miss], held: int) -> list[Miss]:
    """The pieces of a unit's misses past token ``held``: the whole blocks before it were a hit
    (block hits: tracker.plans.block_hit), so only the rest of the unit is missed."""
    return [_moved(m, max(m.start, held), m.end) for m in pieces if m.end > held]


# --- the facts about one chunk key ------------------------------------------------------------


class _Fate(NamedTuple):
    kind: str  # writing, stored, failed, cancelled, evicted, dropped
    step: int
    by: str | None
    detail: str = ""


_FATE_REASON = {
    "writing": "save_in_flight",
    "failed": "save_failed",
    "cancelled": "save_failed",
    "evicted": "evicted",
    "dropped": "dropped",
}


# --- per request and per admission, while walking ---------------------------------------------


class _Lookup(NamedTuple):
    step: int
    pieces: list[Miss]  # why each token past the units the index held (a prefix) missed
    recompute_only: bool


class _Open:
    """An admission being followed until its load's result (or the request's end)."""

    __slots__ = (
        "accepted",
        "admission",
        "asked",
        "blocks",
        "ext_end",
        "fail_at",
        "fail_step",
        "hit",
        "load",
        "load_end_ns",
        "load_ns",
        "load_result",
        "local",
        "lookup",
        "num_computed",
        "refused",
        "rule",
        "step",
        "tiers",
        "wall_ns",
    )

    def __init__(
        self,
        admission: int,
        step: int,
        wall_ns: int,
        lookup: _Lookup,
        asked: int,
        local: int,
        accepted: int,
        hit: int,
        rule: int,
        num_computed: int,
    ) -> None:
        self.admission = admission
        self.step = step
        self.wall_ns = wall_ns
        self.lookup = lookup
        self.asked = asked
        self.local = local  # vLLM's prefix cache hit
        self.accepted = accepted  # external tokens vLLM accepted
        self.hit = hit  # the lookup's recorded pool hit
        self.rule = rule  # 1: the last token, held, recomputed by rule
        # The tokens vLLM skips computing: its prefix cache, then what it accepted.
        self.ext_end = max(local, min(local + accepted, asked - rule))
        self.num_computed = num_computed
        self.load: tuple[int, int] | None = None
        self.tiers: list[tuple[int, int, str]] = []  # (start, end, pool|remote) loaded
        self.refused = False
        self.fail_at: int | None = None
        self.fail_step: int | None = None
        self.load_result: str | None = None
        self.load_ns: int | None = None
        self.load_end_ns: int | None = None
        # A recorder's log: the block table at the admission, to place a load error's blocks.
        self.blocks: tuple[int, ...] = ()


class _Life:
    __slots__ = (
        "admissions",
        "current",
        "foreign",
        "hw",
        "lookup",
        "pool_full_step",
        "recompute_only",
        "reg_end",
        "reg_full",
        "req_id",
        "salt",
    )

    def __init__(self, req_id: str, salt: str) -> None:
        self.req_id = req_id
        self.salt = salt
        self.hw = 0  # the most tokens it ever had computed or computing
        self.reg_full = 0  # its full units up to here are in the history
        self.reg_end = 0  # its tokens up to here are (a partial piece past reg_full)
        self.lookup: _Lookup | None = None
        self.current: _Open | None = None
        self.admissions = 0
        self.recompute_only = False
        self.pool_full_step: int | None = None
        # The last value its load read from the remote tier that was not its chunk's
        # (tracker.remote.foreign): (step, reason).
        self.foreign: tuple[int, str] | None = None


OnAdmission = Callable[[AdmissionMisses], None]


class Explainer:
    """Follows one log's walk (``tracker.history.walk`` items, fed in order with
    :meth:`feed`) and hands each admission's :class:`AdmissionMisses` to ``on_admission`` once
    it is final (its load's result is in, or the request ended), and the rest at
    :meth:`finish`. ``recorded``: a recorder's log. ``stats``, the tables and ``explain``
    itself all count misses through this one class."""

    def __init__(
        self,
        config: TrackerConfig,
        on_admission: OnAdmission,
        *,
        recorded: bool = False,
        history_tokens: int = HISTORY_TOKENS,
    ) -> None:
        self.config = config
        self.on_admission = on_admission
        self.recorded = recorded
        self.history = History(history_tokens)
        # What the remote store was seen holding, and losing: shared by every run that used it.
        self.remote_seen: dict[bytes, int] = {}  # key -> step it was last seen on the store
        self.remote_lost: dict[bytes, tuple[int, str]] = {}
        # Keys whose value a load found foreign, until this engine wrote them: (step, reason).
        # The tracker does not count them when a lookup finds them (tracker/remote.py).
        self.remote_foreign: dict[bytes, tuple[int, str]] = {}
        self.run = ""  # the log being fed ("": the one explained; else an earlier run's name)
        self.new_run("", config)

    def new_run(self, name: str, config: TrackerConfig) -> None:
        """Start feeding another log (``explain --earlier``): a new engine, so a new pool and
        new requests; what was computed before stays in the history, tagged with ``name``.
        The admissions of a run with a name are not handed out."""
        self.run = name
        self.config = config
        self._last_pos = -1
        # Asked whether a chunk is held by its own key, which can be another chunk's alias
        # (a partial chunk's key names the same prefix): every alias hashed when stored.
        self.index = ChunkIndex(config.num_slots, hash_on_store=True)
        self.lives: dict[str, _Life] = {}
        # Retired requests that explain others' misses: label -> (recompute_only, pool full).
        self.retired: dict[str, tuple[bool, int | None]] = {}
        self.fates: dict[bytes, _Fate] = {}
        self.remote_down: tuple[int, str] | None = None
        # This step's lookups whose units no one had computed yet, by parent key: a request
        # that computes them later in the same step (vLLM records a step's schedule after its
        # lookups) was computing them when the lookup asked (_in_flight).
        self._waiting: dict[bytes, list[tuple[str, _Lookup, int, bytes, tuple[int, ...]]]] = {}
        self._waiting_step = -1
        self.without_lookup = 0  # admissions with no lookup before them (nothing acted on)
        # A recorder's log: requests that ended with a load's result unheard, retired once
        # their step is over (_inner_load_errors may still name their blocks).
        self._retiring: list[str] = []
        self._retiring_step = -1
        # A recorder's log: what the wrapped connector's KV events say it stored and dropped.
        self.inner = InnerStore()
        self._reading: list[bytes] = []  # the chunks a failing load read, still stored

    # --- the walk ------------------------------------------------------------------------

    def feed(self, item: Folded) -> None:
        e = item.event
        cls = e.__class__
        if cls is ev.StepDecoded:
            return  # no index effect; its token counts reach the next state read here
        if item.pos == self._last_pos:
            return
        self._last_pos = item.pos
        if self._retiring and e.step > self._retiring_step:
            for label in self._retiring:
                self._retire(label)
            self._retiring = []
        before, after = item.before, item.after
        handler = _BEFORE.get(cls)
        if handler is not None:
            handler(self, item)
        apply_recorded(self.index, e, before, after, self.config)
        handler = _AFTER.get(cls)
        if handler is not None:
            handler(self, item)
        if after is not None and retires(after):
            life = self.lives.get(item.life)
            adm = None if life is None else life.current
            if self.recorded and adm is not None and adm.ext_end > adm.local:
                # vLLM may end a request whose load failed (kv_load_failure_policy "fail")
                # before the recorder hears the worker's load errors, later in the step.
                self._retiring.append(item.life)
                self._retiring_step = e.step
            else:
                self._retire(item.life)

    def _retire(self, label: str) -> None:
        """The walk forgets a retired request: so does this, but for what explains another's
        miss (it fell back to recompute, or found the pool full)."""
        life = self.lives.pop(label, None)
        if life is None:
            return
        if life.current is not None:
            self._close(label, life)
        if life.recompute_only or life.pool_full_step is not None:
            self.retired[label] = (life.recompute_only, life.pool_full_step)
            if len(self.retired) > RETIRED_MEMORY:
                del self.retired[next(iter(self.retired))]

    def _held(self, key: bytes) -> bool:
        """Whether the pool holds a chunk under its own ``key``, as a lookup finds a unit
        (``span_tier``). Not an alias: a block prefix of another chunk with the same tokens
        is that chunk's, and its fate is not this key's (a write cancelled over a failed load
        would pass for stored, and the tail it names, missed later, for unexplained)."""
        return self.index.slot_of(key) is not None

    def _fate(self, key: bytes, fate: _Fate) -> None:
        fates = self.fates
        fates.pop(key, None)
        fates[key] = fate
        if len(fates) > FATES_MEMORY:
            del fates[next(iter(fates))]

    def finish(self) -> None:
        """The admissions still open at the end of the log."""
        for label in self._retiring:
            self._retire(label)
        self._retiring = []
        for label, life in self.lives.items():
            if life.current is not None:
                self._close(label, life)

    # --- handlers: before the index applies the event -----------------------------------------

    def _save_planned(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.SavePlanned)
        for key in e.evicted:
            if self._held(key):
                self._fate(key, _Fate("evicted", e.step, item.life))

    def _load_failed_before(self, item: Folded) -> None:
        before = item.before
        if before is not None and before.load is not None and not before.load.done:
            self._reading = [k for k in before.load.keys if self._held(k)]
        else:
            self._reading = []

    def _chunk_evicted(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.ChunkEvicted)
        if self._held(e.key):
            self._fate(e.key, _Fate("evicted", e.step, None, "outside the plans"))

    # --- handlers: after ---------------------------------------------------------------------

    def _added(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RequestAdded)
        if item.new or item.life not in self.lives:
            self.lives[item.life] = _Life(e.req_id, e.cache_salt)

    def _lookup_asked(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        before, after = item.before, item.after
        if life is None or after is None:
            return
        e = item.event
        assert isinstance(e, ev.LookupAsked)
        if before is not None:
            self._computed(life, item.life, before, e.step)  # a preemption inferred here
        self._computed(life, item.life, after, e.step)
        life.recompute_only = after.recompute_only
        life.lookup = self._look(item.life, after, e.num_tokens, e.step)

    def _scheduled(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        e, before, after = item.event, item.before, item.after
        assert isinstance(e, ev.Scheduled)
        if life is None or after is None:
            return
        if e.admission is not ev.Admission.RUNNING and before is not None:
            self._computed(life, item.life, before, e.step)
            self._admit(item, life, before)
        elif before is not None and e.num_computed < before.num_tokens:
            # vLLM went back (a failed load under the recompute policy): what a load was to
            # serve past this point, vLLM computes.
            adm = life.current
            if adm is not None and e.num_computed < adm.ext_end and adm.fail_at is None:
                adm.fail_at, adm.fail_step = e.num_computed, e.step
                adm.load_result = "failed"
        life.recompute_only = after.recompute_only
        life.hw = max(life.hw, after.num_tokens)
        self._computed(life, item.life, after, e.step)
        if not self.recorded and not after.recompute_only and not self.index.choose_slots(1)[0]:
            life.pool_full_step = e.step

    def _load_planned(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        e, after = item.event, item.after
        assert isinstance(e, ev.LoadPlanned)
        if life is None or life.current is None:
            return
        adm = life.current
        if not e.keys:
            adm.refused = True  # vLLM counted tokens as loaded that no plan loads
            return
        if after is None:
            return
        adm.load = (e.start, max(e.start, e.end))
        adm.load_ns = item.frame.wall_ns
        if len(e.keys) != len(e.slots):
            return  # malformed (a hostile log): no tier can be told; check reports it
        plan = transfer_plan(e, after, self.config)
        if plan is not None:
            adm.tiers = [
                (ch.token_start, ch.token_end, tier_of_slot(ch.slot) or POOL) for ch in plan.chunks
            ]

    def _load_result(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        e, after = item.event, item.after
        if isinstance(e, ev.LoadFailed):
            for key in self._reading:
                if not self._held(key):
                    self._fate(key, _Fate("dropped", e.step, item.life, "a load of it failed"))
        if life is None or life.current is None:
            return
        adm = life.current
        if adm.load is None or adm.load_result is not None:
            return  # no load of this admission in flight (a late result: the fold ignores it)
        adm.load_end_ns = item.frame.wall_ns
        if isinstance(e, ev.LoadFailed):
            adm.load_result = "failed"
            adm.fail_step = e.step
            if after is not None and after.num_tokens < adm.load[1]:
                adm.fail_at = after.num_tokens  # the fold rolled back to the first failed block
        else:
            adm.load_result = "done"

    def _save_result(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, (ev.SaveDone, ev.SaveFailed))
        failed = isinstance(e, ev.SaveFailed)
        for key in e.keys:
            if failed:
                self._fate(key, _Fate("failed", e.step, item.life))
            elif self._held(key):
                self._fate(key, _Fate("stored", e.step, item.life))
            else:
                fate = self.fates.get(key)
                if fate is not None and fate.kind == "writing":
                    self._fate(
                        key, _Fate("cancelled", e.step, item.life, "computed over a failed load")
                    )

    def _save_planned_after(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.SavePlanned)
        for key in e.keys:
            self._fate(key, _Fate("writing", e.step, item.life))

    def _chunk_stored(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.ChunkStored)
        if self._held(e.key):
            self._fate(e.key, _Fate("stored", e.step, None, "outside the plans"))

    def _ended(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        if life is not None and item.before is not None:
            life.hw = max(life.hw, item.before.num_tokens)
            self._computed(life, item.life, item.before, item.event.step)

    def _violation(self, item: Folded) -> None:
        life = self.lives.get(item.life)
        if life is not None:
            life.recompute_only = True

    def _remote_found(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RemoteFound)
        for key, found in zip(e.keys, e.found, strict=False):
            if found:
                self.remote_seen[key] = e.step
                self.remote_lost.pop(key, None)
            elif key in self.remote_seen:
                self.remote_lost[key] = (e.step, "a lookup found it gone")

    def _remote_saved(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RemoteSaveDone)
        for key in e.keys:
            self.remote_seen[key] = e.step
            self.remote_lost.pop(key, None)
            self.remote_foreign.pop(key, None)

    def _remote_load_failed(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RemoteLoadFailed)
        if foreign(e.reason):
            life = self.lives.get(item.life)
            if life is not None:
                life.foreign = (e.step, e.reason)
            for key in e.keys:
                self.remote_foreign[key] = (e.step, e.reason)
        for key in e.keys:
            if key in self.remote_seen:
                self.remote_lost[key] = (e.step, f"a load found it {e.reason or 'gone'}")

    def _inner_event(self, item: Folded) -> None:
        self.inner.apply(item.event)

    def _remote_outage(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RemoteOutage)
        self.remote_down = (e.step, e.error)

    def _remote_restored(self, item: Folded) -> None:
        if self.remote_down is not None:
            step = self.remote_down[0]
            for key in self.remote_seen:
                self.remote_lost.setdefault(key, (step, "forgotten at the outage"))
        self.remote_down = None

    # --- what was computed -------------------------------------------------------------------

    def _computed(self, life: _Life, label: str, state: RequestState, step: int) -> None:
        """Put the request's computed tokens not yet in the history there: its units, by the
        unit before each (the lookup's own chain, tracker.plans.lookup_spans)."""
        life.hw = max(life.hw, state.num_tokens)
        upto = min(life.hw, len(state.token_ids))
        if upto <= life.reg_end:
            return
        policy = save_policy_end(state, self.config)
        tokens = state.token_ids
        for span in lookup_spans(state, self.config, upto, life.reg_full):
            seq = tokens[span.start : span.end]
            fact = Computed(
                None if span.partial else span.key,
                label,
                step,
                span.end > policy,
                state.root,
                life.salt,
                self.run,
                self.config.salt,
            )
            self.history.add(span.parent, seq, fact)
            if span.start == 0:
                self.history.add(ANY_ROOT, seq, fact)
            if self._waiting and step == self._waiting_step:
                self._in_flight(label, step, span.parent, seq)
            if not span.partial:
                life.reg_full = span.end
        life.reg_end = upto

    # --- a lookup, evaluated when vLLM asked it -----------------------------------------------

    def _look(self, label: str, state: RequestState, num_tokens: int, step: int) -> _Lookup:
        """Why each token past the units the index holds (a prefix) misses, at this lookup."""
        pieces: list[Miss] = []
        waiting: list[tuple[bytes, int, tuple[int, ...]]] = []
        broken: Miss | None = None
        life = self.lives.get(label)
        salt = "" if life is None else life.salt
        chain: bytes | None = None  # another root's unit matching so far (different_salt)
        end = 0
        config = self.config
        for span in lookup_spans(state, config, num_tokens):
            end = span.end
            if not self.recorded and span_tier(self.index, span) is not None:
                if broken is not None:  # held after a unit that is not: missed for its reason
                    pieces.append(_moved(broken, span.start, span.end))
                continue
            why, chain = self._why(span, state, salt, chain)
            if self.recorded and self.inner.with_tokens:
                # What the wrapped connector's own events say of these tokens comes first.
                for fact in self._inner_facts(state, span.start, span.end):
                    _retell(why, fact.start, fact.end, fact, over=None)
            if any(m.reason in _IN_FLIGHT_OVER for m in why):
                waiting.append(
                    (span.parent, span.start, tuple(state.token_ids[span.start : span.end]))
                )
            if not self.recorded:
                # A prompt's tail is saved as its whole blocks: what became of those, and the
                # partial block past them by policy.
                tail = saved_tail(state, config, span)
                if tail is not None and broken is not None and span_tier(self.index, tail):
                    # Held, after a unit that is not: missed for that unit's reason.
                    why = [_moved(broken, tail.start, tail.end), *_past(why, tail.end)]
                elif tail is not None:
                    fate = self._remote_why(tail) or self._pool_why(tail)
                    if fate is not None:
                        why = [fate, *_past(why, fate.end)]
                if broken is None and config.block_hits:
                    # The first unit not held whole: its whole blocks a stored chunk holds hit.
                    chunk = span.start // config.chunk_size
                    held = block_hit(state, self.index, config, chunk, num_tokens)
                    why = _past(why, span.start + held)
            pieces.extend(why)
            if broken is None and why:
                broken = why[-1]
        if end < num_tokens:
            pieces.append(
                Miss(end, num_tokens, "unexplained", detail="the token ids are not in the log")
            )
        snap = _Lookup(step, pieces, state.recompute_only)
        if waiting:
            if step != self._waiting_step:
                self._waiting, self._waiting_step = {}, step
            for parent, start, tokens in waiting:
                self._waiting.setdefault(parent, []).append((label, snap, start, parent, tokens))
        return snap

    def _in_flight(self, label: str, step: int, parent: bytes, seq: Sequence[int]) -> None:
        """``label`` computes ``seq`` (the unit after ``parent``) in this step: every lookup
        of another request in this step that missed those tokens as never computed (or as an
        earlier run's) missed them because this one was computing them. Facts of this run come
        before an earlier run's, and this is the fact: it names the request and the step."""
        for who, snap, start, _, tokens in self._waiting.get(parent, ()):
            if who == label:
                continue
            shared = 0
            for a, b in zip(tokens, seq, strict=False):
                if a != b:
                    break
                shared += 1
            if shared:
                _retell(
                    snap.pieces, start, start + shared, Miss(0, 0, "being_computed", step, label)
                )

    def _why(
        self, span: Span, state: RequestState, salt: str, chain: bytes | None
    ) -> tuple[list[Miss], bytes | None]:
        s, e = span.start, span.end
        if not self.recorded:
            fact = self._remote_why(span) or self._pool_why(span)
            if fact is not None:
                return [fact], None
        tokens = state.token_ids[s:e]
        shared, computed, ended = self.history.nearest(span.parent, tokens, state.root)
        if span.start == 0:
            # The same tokens under another chain root (another cache salt)?
            other, fact2, _ = self.history.nearest(ANY_ROOT, tokens, state.root, other=True)
            if fact2 is not None and other > shared:
                return self._salted(s, e, other, fact2, salt)
        elif computed is None and chain is not None:
            other, fact2, _ = self.history.nearest(chain, tokens)
            if fact2 is not None and other > 0:
                return self._salted(s, e, other, fact2, salt)
        if computed is not None and computed.run != self.run and shared > 0:
            # Computed by another engine's run: its host pool was never this one's.
            k, by, step = s + shared, computed.request, computed.step
            out = [Miss(s, k, "earlier_run", step, by, detail=f"in {computed.run}")]
            if k < e:
                out.append(Miss(k, e, "new_prefix"))
            return out, None
        if computed is not None and shared >= e - s:
            if self.recorded:
                return self._not_offered(s, e, computed.step, computed.request), None
            return [self._never_saved(span, computed)], None
        out = []
        if computed is not None and shared > 0:
            k, by, step = s + shared, computed.request, computed.step
            if ended and self.recorded:  # computed up to k, no further
                out += self._not_offered(s, k, step, by)
            elif ended:  # computed up to k, no further: a piece shorter than the unit asked
                detail = f"computed only up to token {k}, in a chunk never completed"
                out.append(Miss(s, k, "partial_chunk", step, by, detail=detail))
            else:
                out.append(Miss(s, k, "prefix_diverged", step, by, k))
        out.append(Miss(s + shared, e, "new_prefix"))
        return out, None

    def _salted(
        self, s: int, e: int, shared: int, fact: Computed, salt: str
    ) -> tuple[list[Miss], bytes | None]:
        salts = f"computed under cache salt {fact.salt!r}, this request's is {salt!r}"
        if fact.model != self.config.salt:
            salts = (
                f"computed{f' in {fact.run}' if fact.run else ''} under model/layout salt "
                f"{fact.model!r}, this run's is {self.config.salt!r}"
            )
        out = [Miss(s, s + shared, "different_salt", fact.step, fact.request, detail=salts)]
        if s + shared < e:
            out.append(Miss(s + shared, e, "new_prefix"))
            return out, None
        return out, fact.key

    def _remote_why(self, span: Span) -> Miss | None:
        key = span.key
        distrusted = self.remote_foreign.get(key)
        if distrusted is not None:
            return Miss(span.start, span.end, "foreign_value", distrusted[0], detail=distrusted[1])
        if key not in self.remote_seen:
            return None
        if self.remote_down is not None:
            step, error = self.remote_down
            return Miss(span.start, span.end, "remote_down", step, detail=error)
        lost = self.remote_lost.get(key)
        if lost is not None:
            return Miss(span.start, span.end, "remote_evicted", lost[0], detail=lost[1])
        return None

    def _pool_why(self, span: Span) -> Miss | None:
        fate = self.fates.get(span.key)
        if fate is None:
            return None
        reason = _FATE_REASON.get(fate.kind)
        if reason is None:  # stored, yet not held: the fold and the log disagree
            return Miss(span.start, span.end, "unexplained", fate.step, fate.by, None, "stored")
        return Miss(span.start, span.end, reason, fate.step, fate.by, None, fate.detail)

    def _not_offered(self, s: int, e: int, step: int, by: str) -> list[Miss]:
        """A recorder's log: tokens ``[s, e)`` computed before in this run (by ``by`` at
        ``step``), not offered by the wrapped connector. Where it publishes KV events with
        their tokens, what they cover is told by :meth:`_inner_facts`; the rest it never
        stored."""
        inner = self.inner
        if inner.with_tokens and not inner.unplaced:
            return [Miss(s, e, "inner_never_stored", step, by)]
        detail = ""
        if inner.unplaced:
            detail = f"{inner.unplaced} of its stores name a parent it never stored: unplaced"
        return [Miss(s, e, "not_offered", step, by, detail=detail)]

    def _inner_facts(self, state: RequestState, s: int, e: int) -> list[Miss]:
        """What the wrapped connector's KV events say of tokens ``[s, e)``: held (it did not
        offer them), dropped (or a key before them was: a hit is a prefix), or held only as
        a prompt's tail key (which a longer prompt does not look up)."""
        inner = self.inner
        out: list[Miss] = []
        dropped: int | None = None
        for piece in inner.cover(state.token_ids[:e]):
            if dropped is None:
                dropped = piece.removed
            if piece.end <= s:
                continue
            a, b = max(s, piece.start), min(e, piece.end)
            if dropped is not None:
                out.append(Miss(a, b, "inner_evicted", dropped))
            elif piece.end - piece.start in inner.whole_sizes:
                unsaid = "" if inner.removals else "it publishes no removals: a drop is unsaid"
                out.append(Miss(a, b, "inner_not_offered", piece.stored, detail=unsaid))
            else:
                detail = "stored only as a prompt's tail, a key no other continues"
                out.append(Miss(a, b, "not_offered", piece.stored, detail=detail))
        return out

    def _never_saved(self, span: Span, computed: Computed) -> Miss:
        """Computed before in full, never saved: why not, by the computing request's rules."""
        s, e, by, step = span.start, span.end, computed.request, computed.step
        if span.partial:
            if not self.config.discard_partial_chunks:
                detail = "they lie inside a longer chunk; only a prefill's own tail is saved"
            elif self.config.block_hits:
                detail = "a partial block is not saved (discard_partial_chunks)"
            else:
                detail = "partial chunks are not saved (discard_partial_chunks)"
            return Miss(s, e, "partial_chunk", step, by, detail=detail)
        if computed.decode:
            return Miss(s, e, "decode_not_saved", step, by)
        computer = self.lives.get(by)
        recompute, full = (
            (computer.recompute_only, computer.pool_full_step)
            if computer is not None
            else self.retired.get(by, (False, None))
        )
        if recompute:
            return Miss(s, e, "recompute_only", step, by, detail="the request that computed it")
        if full is not None and full >= step:
            return Miss(s, e, "pool_full", full, by)
        return Miss(s, e, "save_in_flight", step, by, detail="its save not planned yet")

    # --- admissions ---------------------------------------------------------------------------

    def _admit(self, item: Folded, life: _Life, before: RequestState) -> None:
        if life.current is not None:
            self._close(item.life, life)
        life.admissions += 1
        e = item.event
        assert isinstance(e, ev.Scheduled)
        lookup = before.lookup
        if lookup is None or lookup.num_tokens <= 0:
            self.without_lookup += lookup is None
            life.lookup = None
            return
        n = lookup.num_tokens
        snap = life.lookup
        if snap is None:  # a lookup whose event the log lacks: judged now
            snap = self._look(item.life, before, n, e.step)
        local = max(0, min(lookup.local_hit, n))
        hit = lookup.hit if not self.recorded else 0
        if self.recorded:  # the inner's hit is not in the log: all it may offer, offered
            rule = 1 if before.accepted and local + before.accepted >= n - 1 else 0
        else:
            rule = 1 if hit >= n and local < n else 0
        adm = _Open(
            life.admissions,
            e.step,
            item.frame.wall_ns,
            snap,
            n,
            local,
            before.accepted,
            hit,
            rule,
            e.num_computed,
        )
        if self.recorded and item.after is not None:
            adm.blocks = tuple(item.after.block_ids)
        life.lookup = None
        life.current = adm

    def _inner_load_errors(self, item: Folded) -> None:
        """A recorder's log: the worker reported blocks whose load failed. An open admission
        whose accepted tokens lie in one of them failed from that block on, whatever vLLM
        did next (recompute from there, or end the request with an error)."""
        e = item.event
        assert isinstance(e, ev.InnerLoadErrors)
        failed, bs = set(e.block_ids), self.config.block_size
        for life in self.lives.values():
            adm = life.current
            if adm is None or adm.fail_at is not None or adm.ext_end <= adm.local:
                continue
            for i, block in enumerate(adm.blocks):
                start = i * bs
                if start >= adm.ext_end:
                    break
                if block in failed and start + bs > adm.local:
                    adm.fail_at, adm.fail_step = max(start, adm.local), e.step
                    adm.load_result = "failed"
                    break

    @staticmethod
    def _load_failed(life: _Life, start: int, end: int, step: int | None) -> Miss:
        """Tokens whose load failed: ``foreign_value`` when the load failed because the
        remote tier served a value that was not its chunk's (the one fact a user acts on:
        someone writes to the tier), else ``load_failed``."""
        if life.foreign is not None and life.foreign[0] == step:
            return Miss(start, end, "foreign_value", step, detail=life.foreign[1])
        return Miss(start, end, "load_failed", step)

    def _close(self, label: str, life: _Life) -> None:
        adm = life.current
        life.current = None
        if adm is None:
            return
        n, local, ext_end, rule = adm.asked, adm.local, adm.ext_end, adm.rule
        snap = adm.lookup
        misses: list[Miss] = []
        hits = zero_hits()
        hits["local"] = local
        hits["last_token"] = rule
        if self.recorded:
            ok_end = max(local, min(ext_end, adm.num_computed))
            if adm.fail_at is not None:
                ok_end = max(local, min(ok_end, adm.fail_at))
            hits["inner"] = ok_end - local
            if ok_end < ext_end:
                misses.append(Miss(ok_end, ext_end, "load_failed", adm.fail_step))
        else:
            if adm.refused:
                ok_end = local
                if ext_end > local:
                    misses.append(Miss(local, ext_end, "load_refused"))
            elif adm.load is None:
                ok_end = local
                if ext_end > local:
                    misses.append(
                        Miss(local, ext_end, "unexplained", detail="accepted, no load plan")
                    )
            else:
                ok_end = ext_end
                if adm.fail_at is not None:
                    ok_end = max(local, min(ext_end, adm.fail_at))
                    if ok_end < ext_end:
                        misses.append(self._load_failed(life, ok_end, ext_end, adm.fail_step))
            for lo, hi, tier in adm.tiers:
                hits[tier] += max(0, min(hi, ok_end) - max(lo, local))
            served = local + hits["pool"] + hits["remote"]
            if served < ok_end:  # a load plan that does not cover what vLLM skipped
                misses.append(Miss(served, ok_end, "unexplained", detail="not in the load plan"))
            held_stop = min(max(adm.hit, ext_end), n - rule)
            if ext_end < held_stop:
                why = "recompute_only" if snap.recompute_only else "not_accepted"
                misses.append(Miss(ext_end, held_stop, why))
            ext_end = max(ext_end, held_stop)
        lo, hi = ext_end, n - rule
        at = lo
        for m in snap.pieces:
            a, b = max(m.start, at), min(m.end, hi)
            if a < b:
                if a > at:
                    misses.append(Miss(at, a, "unexplained", detail="no unit of the lookup"))
                misses.append(_moved(m, a, b))
                at = b
        if at < hi:
            misses.append(Miss(at, hi, "unexplained", detail="held, yet not loaded"))
        misses = _merged(misses)
        seconds = None
        if adm.load_ns is not None and adm.load_end_ns is not None:
            seconds = max(0, adm.load_end_ns - adm.load_ns) / 1e9
        if self.run:
            return  # an earlier run's admission: history only
        result = AdmissionMisses(
            request=label,
            req_id=life.req_id,
            admission=adm.admission,
            step=adm.step,
            lookup_step=snap.step,
            asked=n,
            hit=hits,
            misses=misses,
            accepted=adm.accepted,
            loaded=0 if adm.load is None else adm.load[1] - adm.load[0],
            load_result=adm.load_result,
            load_seconds=seconds,
            wall_ns=adm.wall_ns,
        )
        self.on_admission(result)


def _merged(misses: list[Miss]) -> list[Miss]:
    """Neighbours with the same reason and facts as one span."""
    out: list[Miss] = []
    for m in sorted(misses, key=lambda m: m.start):
        if out and out[-1].end == m.start and out[-1][2:] == m[2:]:
            out[-1] = _moved(out[-1], out[-1].start, m.end)
        else:
            out.append(m)
    return out


_BEFORE: dict[type[ev.Event], Callable[[Explainer, Folded], None]] = {
    ev.SavePlanned: Explainer._save_planned,
    ev.LoadFailed: Explainer._load_failed_before,
    ev.ChunkEvicted: Explainer._chunk_evicted,
}
_AFTER: dict[type[ev.Event], Callable[[Explainer, Folded], None]] = {
    ev.RequestAdded: Explainer._added,
    ev.LookupAsked: Explainer._lookup_asked,
    ev.Scheduled: Explainer._scheduled,
    ev.LoadPlanned: Explainer._load_planned,
    ev.LoadDone: Explainer._load_result,
    ev.LoadFailed: Explainer._load_result,
    ev.SavePlanned: Explainer._save_planned_after,
    ev.SaveDone: Explainer._save_result,
    ev.SaveFailed: Explainer._save_result,
    ev.ChunkStored: Explainer._chunk_stored,
    ev.Preempted: Explainer._ended,
    ev.Finished: Explainer._ended,
    ev.ViolationRecorded: Explainer._violation,
    ev.RemoteFound: Explainer._remote_found,
    ev.RemoteSaveDone: Explainer._remote_saved,
    ev.RemoteLoadFailed: Explainer._remote_load_failed,
    ev.RemoteOutage: Explainer._remote_outage,
    ev.RemoteRestored: Explainer._remote_restored,
    ev.InnerLoadErrors: Explainer._inner_load_errors,
    ev.InnerStored: Explainer._inner_event,
    ev.InnerRemoved: Explainer._inner_event,
}
