"""``explain``: why each lookup missed what it missed, every token, from the log alone.

At each admission, the lookup vLLM acted on (the last one before the request was scheduled)
asked about ``N`` tokens. They split into tokens **hit**:

- ``local``: vLLM's own prefix cache (``LookupAsked.local_hit``);
- ``pool`` and ``remote``: loaded from the host pool or the remote tier (the admission's
  ``LoadPlanned``, chunk by chunk, less what a failed load left vLLM to recompute); on a
  recorder's log ``inner``, the tokens the wrapped connector loaded (its tiers are its own);
- ``last_token``: the last token of a prompt the cache held whole. vLLM computes it anyway,
  for its logits (``external = hit - local - 1``): a rule, not a miss, so it counts as hit;

and tokens **missed**, each attributed to exactly one reason (:data:`REASONS`). A reason is
derived by the tracker's own rules, called here, never written again:
``tracker.plans.lookup_spans`` (the units a lookup reads, and their keys) and ``span_tier``
(where the lookup finds one), ``save_policy_end`` (which chunks the save policy leaves out),
``transfer_plan`` (which tier each loaded token came from), ``tracker.index_fold`` (the
pool's index, folded from the recorded events as the recording Tracker folded them) and
``tracker.history.walk`` (each request's state, as the Tracker held it).

For a unit the lookup missed, in this order: what the remote tier's recorded facts say (down,
or no longer holding it); what happened to its chunk in the pool (a save in flight, failed,
evicted by another request's save, dropped after a failed load); else what was computed
before under the same prefix (a trie of token sequences by parent key): nothing (a new
prefix), the same tokens up to token ``k`` (the prefix diverges), the same tokens in full
(never saved: by policy, after a violation, for want of a slot, or not yet), or the same tokens
under another chain root (another cache salt). A unit the pool holds after one it does not
is missed for the reason of that earlier one (a hit is a prefix).

Logs of earlier runs (``explain(..., earlier=[...])``, ``--earlier``) are read first, each as a
new engine (its own pool and requests): what they computed is history, so a prefix another
engine computed is ``earlier_run``, and one computed under another model or layout salt is
``different_salt``; the remote tier's recorded facts carry over (it is shared).

On a recorder's log (``connector/recorder.py``) no pool decision is recorded: explain shows
what the log can show (what vLLM was offered against what this run computed before) and names
the rest ``not_offered``: the wrapped connector's private store is not in the log.

Memory follows the distinct token sequences computed (bounded by ``history_tokens``; beyond
it the oldest are forgotten and counted in ``forgotten``), plus a few numbers per request.
"""

from __future__ import annotations

import bisect
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from replay.naming import resolve
from replay.recorded import is_recorded
from replay.source import LogPath, LogSource, open_log
from tracker import events as ev
from tracker.chunks import ChunkIndex
from tracker.config import TrackerConfig
from tracker.framing import StopInfo
from tracker.history import RETIRED_MEMORY, Folded, retires, walk
from tracker.index_fold import apply_recorded
from tracker.plans import (
    Span,
    block_hit,
    lookup_spans,
    save_policy_end,
    saved_tail,
    span_tier,
    transfer_plan,
)
from tracker.state import RequestState
from tracker.tiers import POOL, tier_of_slot

__all__ = [
    "HITS",
    "REASONS",
    "AdmissionMisses",
    "Explainer",
    "Explanation",
    "Miss",
    "RequestMisses",
    "Tally",
    "explain",
]

# Every reason a missed token can have, in the order reports list them, and what it means.
REASONS: dict[str, str] = {
    "new_prefix": "never computed by any earlier request in this log",
    "prefix_diverged": "computed before under the same prefix, up to token k where this prompt "
    "differs: the chunk holding them is keyed by all of its tokens",
    "different_salt": "the same tokens were computed under another salt (the request's "
    "cache_salt, or an earlier run's model or layout): chunk keys differ",
    "earlier_run": "computed by an earlier run (--earlier LOG): that engine's host pool is not "
    "this one's, and no shared tier was seen holding it",
    "partial_chunk": "the tokens asked end inside a block (or chunk): partial ones are not saved "
    "(discard_partial_chunks), or these tokens lie inside a longer chunk",
    "decode_not_saved": "computed as decode output, which is not saved (save_decode_cache off)",
    "save_failed": "its save failed (or was cancelled: computed over a failed load)",
    "save_in_flight": "its save was planned, or due, and not confirmed when the lookup asked",
    "evicted": "evicted from the host pool: its slot went to another request's save (or it "
    "left outside the plans, reset_cache)",
    "dropped": "dropped from the host pool after a load of it failed",
    "pool_full": "never saved: the pool had no free slot and every stored chunk was pinned",
    "remote_down": "the remote tier, which held it, was down at the lookup",
    "remote_evicted": "the remote tier held it once and did not any more (evicted, expired, "
    "restarted empty)",
    "load_failed": "vLLM accepted it, its load failed, and vLLM recomputed from there",
    "load_refused": "vLLM counted it as loaded; the tracker refused the load (a violation) and "
    "vLLM recomputed it",
    "recompute_only": "the pool held it (or could have), but a violation had made the request "
    "(or the one that computed it) fall back to recompute: no load, no save",
    "not_accepted": "offered to vLLM, which accepted fewer tokens",
    "not_offered": "computed before in this run but not offered by the wrapped connector: "
    "why is in its private store, which a recorder's log cannot show",
    "unexplained": "the log does not say: the recorded answer and the fold disagree, or the "
    "token ids are not in the log",
}

# The parts of the tokens hit, in order.
HITS: dict[str, str] = {
    "local": "vLLM's own prefix cache",
    "pool": "loaded from the host pool",
    "remote": "loaded from the remote tier",
    "inner": "loaded by the wrapped connector (a recorder's log: its tiers are its own)",
    "last_token": "the last token of a prompt the cache held whole: vLLM computes it for its "
    "logits (a rule, not a miss)",
}

NOTES = (
    "tokens asked: the prompt, and on a re-admission the output so far, at the lookup vLLM "
    "acted on (the last one before the admission)",
    "vLLM's own prefix cache counts as hit (local); the pool's hits count from there on",
    "the last token of a prompt the cache held whole is recomputed by vLLM for its logits: "
    "it counts as hit (last_token), by rule, not as a miss",
)
RECORDED_NOTE = (
    "a recorder's log holds what vLLM was offered, not the wrapped connector's store: a "
    "token computed before in this run but not offered is not_offered, and why is not in "
    "the log"
)

# The history kept by default: token ids of the distinct sequences computed (4 bytes each).
HISTORY_TOKENS = 1 << 24
# Chunk keys whose fate in the pool (or on the remote store) is remembered, at most.
FATES_MEMORY = 1 << 20
_ANY_ROOT = b""  # the parent under which every chain's first unit is also kept


class Miss(NamedTuple):
    """Tokens ``[start, end)`` of an admission's lookup, missed for ``reason``."""

    start: int
    end: int
    reason: str
    step: int | None = None  # when the fact that explains it happened
    by: str | None = None  # the request involved: the evicting one, the one that computed it
    at_token: int | None = None  # prefix_diverged: the first token that differs
    detail: str = ""

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        d = self._asdict()
        d["tokens"] = self.tokens
        return d

    def describe(self) -> str:
        """The reason with its facts, in words."""
        by, step, detail = self.by, self.step, self.detail
        text = _FACTS.get(self.reason, "")
        if self.reason == "evicted" and by is None:
            text = "evicted at step {step}"
        if ("{by}" in text and by is None) or ("{step}" in text and step is None):
            text = ""
        text = text.format(by=by, step=step, at=self.at_token)
        if detail:
            text = f"{text}: {detail}" if text else detail
        return f"{self.reason} ({text})" if text else self.reason


# How each reason's facts read (Miss.describe).
_FACTS = {
    "prefix_diverged": "differs at token {at} from what {by} computed at step {step}",
    "different_salt": "computed by {by} at step {step}",
    "partial_chunk": "computed by {by} at step {step}",
    "decode_not_saved": "decode output of {by} at step {step}",
    "save_failed": "{by}'s save failed at step {step}",
    "save_in_flight": "saved by {by} from step {step}",
    "evicted": "evicted at step {step} to make room for {by}",
    "dropped": "dropped at step {step}: {by}'s load of it failed",
    "pool_full": "{by} found no slot at step {step}",
    "remote_down": "down since step {step}",
    "remote_evicted": "since step {step}",
    "load_failed": "failed at step {step}; vLLM recomputed",
    "recompute_only": "{by}, at step {step}",
    "not_offered": "computed by {by} at step {step}",
}


def _moved(m: Miss, start: int, end: int) -> Miss:
    return m._replace(start=start, end=end)


def _past(pieces: list[Miss], held: int) -> list[Miss]:
    """The pieces of a unit's misses past token ``held``: the whole blocks before it were a hit
    (block hits: tracker.plans.block_hit), so only the rest of the unit is missed."""
    return [_moved(m, max(m.start, held), m.end) for m in pieces if m.end > held]


@attrs.define
class AdmissionMisses:
    """One admission: its lookup's tokens, hit and missed (see the module docstring)."""

    request: str
    req_id: str
    admission: int  # 1 for the first, 2 after a preemption, ... (the admissions table's)
    step: int
    lookup_step: int | None
    asked: int
    hit: dict[str, int]  # HITS -> tokens
    misses: list[Miss]
    accepted: int = 0
    loaded: int = 0  # tokens the load plan loads (before any failure)
    load_result: str | None = None
    load_seconds: float | None = None
    wall_ns: int = 0

    @property
    def tokens_hit(self) -> int:
        return sum(self.hit.values())

    @property
    def missed_tokens(self) -> int:
        return sum(m.tokens for m in self.misses)

    def reasons(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for m in self.misses:
            out[m.reason] += m.tokens
        return _ordered(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "req_id": self.req_id,
            "admission": self.admission,
            "step": self.step,
            "lookup_step": self.lookup_step,
            "tokens_asked": self.asked,
            "tokens_hit": self.tokens_hit,
            "missed_tokens": self.missed_tokens,
            "hit": dict(self.hit),
            "reasons": self.reasons(),
            "misses": [m.to_dict() for m in self.misses],
            "accepted": self.accepted,
            "loaded": self.loaded,
            "load_result": self.load_result,
            "load_seconds": self.load_seconds,
        }


def _ordered(counts: Counter[str]) -> dict[str, int]:
    return {r: counts[r] for r in REASONS if counts.get(r)}


def _zero_hits() -> dict[str, int]:
    return dict.fromkeys(HITS, 0)


@attrs.define
class RequestMisses:
    """One request life's admissions, and their sums."""

    request: str
    req_id: str
    admissions: list[AdmissionMisses] = attrs.field(factory=list)

    def totals(self) -> dict[str, Any]:
        return _totals(self.admissions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "req_id": self.req_id,
            **self.totals(),
            "admissions": [a.to_dict() for a in self.admissions],
        }


class Tally:
    """Sums over admissions: tokens asked, hit by part, missed by reason."""

    def __init__(self) -> None:
        self.admissions = 0
        self.asked = 0
        self.hits = _zero_hits()
        self.reasons: Counter[str] = Counter()

    def add(self, a: AdmissionMisses) -> None:
        self.admissions += 1
        self.asked += a.asked
        for k, v in a.hit.items():
            self.hits[k] += v
        for m in a.misses:
            self.reasons[m.reason] += m.tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "admissions": self.admissions,
            "tokens_asked": self.asked,
            "tokens_hit": sum(self.hits.values()),
            "missed_tokens": sum(self.reasons.values()),
            "hit": dict(self.hits),
            "reasons": _ordered(self.reasons),
        }


def _totals(admissions: Iterable[AdmissionMisses]) -> dict[str, Any]:
    tally = Tally()
    for a in admissions:
        tally.add(a)
    return tally.to_dict()


# --- what was computed before: token sequences by parent key ----------------------------------


class _Computed(NamedTuple):
    key: bytes | None  # the unit's key (None: a partial piece)
    request: str
    step: int
    decode: bool  # past the computing admission's save policy (a decode chunk)
    root: bytes  # the chain's root (the request's model/layout/cache salt)
    salt: str  # the request's cache salt
    run: str  # the log it was computed in ("": the one explained)
    model: str  # that run's model/layout salt (TrackerConfig.salt)


class _Children:
    """The token sequences computed under one parent key, packed (4 bytes a token, big-endian,
    so byte order is token order) and sorted: the one sharing the longest prefix with a query
    sorts next to it."""

    __slots__ = ("info", "seqs")

    def __init__(self) -> None:
        self.seqs: list[bytes] = []
        self.info: dict[bytes, dict[bytes, _Computed]] = {}  # seq -> root -> fact


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(tokens)}I", *tokens)


def _common(a: bytes, b: bytes) -> int:
    """Tokens two packed sequences share from their start."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // 4
    lo, hi = 0, n  # bisect on the longest equal prefix: slices compare in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // 4


class _History:
    """What was computed, keyed by the unit before it (so equal prefixes meet), bounded by
    ``budget`` tokens: past it, the parents least recently added to are forgotten."""

    def __init__(self, budget: int) -> None:
        self.by_parent: OrderedDict[bytes, _Children] = OrderedDict()
        self.budget = budget
        self.tokens = 0
        self.forgotten = 0

    def add(self, parent: bytes, tokens: Sequence[int], fact: _Computed) -> None:
        seq = _pack(tokens)
        ch = self.by_parent.get(parent)
        if ch is None:
            ch = self.by_parent[parent] = _Children()
        else:
            self.by_parent.move_to_end(parent)
        facts = ch.info.get(seq)
        if facts is None:
            bisect.insort(ch.seqs, seq)
            facts = ch.info[seq] = {}
            self.tokens += len(seq) // 4
        facts[fact.root] = fact
        while self.tokens > self.budget and len(self.by_parent) > 1:
            _, old = self.by_parent.popitem(last=False)
            self.tokens -= sum(len(s) for s in old.seqs) // 4
            self.forgotten += len(old.seqs)

    def nearest(
        self, parent: bytes, query: Sequence[int], root: bytes | None = None, other: bool = False
    ) -> tuple[int, _Computed | None, bool]:
        """(tokens of ``query`` shared with the closest sequence computed under ``parent``, its
        fact, whether that sequence ended there: it is a shorter piece, not a different one).
        ``root`` with ``other``: only facts of another root."""
        ch = self.by_parent.get(parent)
        if ch is None or not ch.seqs:
            return 0, None, False
        q = _pack(query)
        i = bisect.bisect_left(ch.seqs, q)
        best, fact, ended = 0, None, False
        for j in (i - 1, i, i + 1):
            if 0 <= j < len(ch.seqs):
                seq = ch.seqs[j]
                pick = _pick(ch.info[seq], root, other)
                if pick is None:
                    continue
                n = _common(q, seq)
                full = n * 4 == len(seq)
                if n > best or (n == best and (fact is None or full)):
                    best, fact, ended = n, pick, full and len(seq) < len(q)
        return best, fact, ended


def _pick(facts: dict[bytes, _Computed], root: bytes | None, other: bool) -> _Computed | None:
    if root is None:
        return max(facts.values(), key=lambda f: f.step, default=None)
    if other:
        return max((f for r, f in facts.items() if r != root), key=lambda f: f.step, default=None)
    return facts.get(root)


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


class _Life:
    __slots__ = (
        "admissions",
        "current",
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
        self.history = _History(history_tokens)
        # What the remote store was seen holding, and losing: shared by every run that used it.
        self.remote_seen: dict[bytes, int] = {}  # key -> step it was last seen on the store
        self.remote_lost: dict[bytes, tuple[int, str]] = {}
        self.run = ""  # the log being fed ("": the one explained; else an earlier run's name)
        self.new_run("", config)

    def new_run(self, name: str, config: TrackerConfig) -> None:
        """Start feeding another log (``explain --earlier``): a new engine, so a new pool and
        new requests; what was computed before stays in the history, tagged with ``name``.
        The admissions of a run with a name are not handed out."""
        self.run = name
        self.config = config
        self._last_pos = -1
        self.index = ChunkIndex(config.num_slots)
        self.lives: dict[str, _Life] = {}
        # Retired requests that explain others' misses: label -> (recompute_only, pool full).
        self.retired: dict[str, tuple[bool, int | None]] = {}
        self.fates: dict[bytes, _Fate] = {}
        self.remote_down: tuple[int, str] | None = None
        self.without_lookup = 0  # admissions with no lookup before them (nothing acted on)
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
        before, after = item.before, item.after
        handler = _BEFORE.get(cls)
        if handler is not None:
            handler(self, item)
        apply_recorded(self.index, e, before, after, self.config)
        handler = _AFTER.get(cls)
        if handler is not None:
            handler(self, item)
        if after is not None and retires(after):
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

    def _fate(self, key: bytes, fate: _Fate) -> None:
        fates = self.fates
        fates.pop(key, None)
        fates[key] = fate
        if len(fates) > FATES_MEMORY:
            del fates[next(iter(fates))]

    def finish(self) -> None:
        """The admissions still open at the end of the log."""
        for label, life in self.lives.items():
            if life.current is not None:
                self._close(label, life)

    # --- handlers: before the index applies the event -----------------------------------------

    def _save_planned(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.SavePlanned)
        for key in e.evicted:
            if key in self.index:
                self._fate(key, _Fate("evicted", e.step, item.life))

    def _load_failed_before(self, item: Folded) -> None:
        before = item.before
        if before is not None and before.load is not None and not before.load.done:
            self._reading = [k for k in before.load.keys if k in self.index]
        else:
            self._reading = []

    def _chunk_evicted(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.ChunkEvicted)
        if e.key in self.index:
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
                if key not in self.index:
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
            elif key in self.index:
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
        if e.key in self.index:
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

    def _remote_load_failed(self, item: Folded) -> None:
        e = item.event
        assert isinstance(e, ev.RemoteLoadFailed)
        for key in e.keys:
            if key in self.remote_seen:
                self.remote_lost[key] = (e.step, f"a load found it {e.reason or 'gone'}")

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
            fact = _Computed(
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
                self.history.add(_ANY_ROOT, seq, fact)
            if not span.partial:
                life.reg_full = span.end
        life.reg_end = upto

    # --- a lookup, evaluated when vLLM asked it -----------------------------------------------

    def _look(self, label: str, state: RequestState, num_tokens: int, step: int) -> _Lookup:
        """Why each token past the units the index holds (a prefix) misses, at this lookup."""
        pieces: list[Miss] = []
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
        return _Lookup(step, pieces, state.recompute_only)

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
            other, fact2, _ = self.history.nearest(_ANY_ROOT, tokens, state.root, other=True)
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
            return [self._never_saved(span, computed)], None
        out = []
        if computed is not None and shared > 0:
            k, by, step = s + shared, computed.request, computed.step
            if ended:  # computed up to k, no further: a piece shorter than the unit asked
                why = "partial_chunk" if not self.recorded else "not_offered"
                detail = f"computed only up to token {k}, in a chunk never completed"
                out.append(Miss(s, k, why, step, by, detail=detail))
            else:
                out.append(Miss(s, k, "prefix_diverged", step, by, k))
        out.append(Miss(s + shared, e, "new_prefix"))
        return out, None

    def _salted(
        self, s: int, e: int, shared: int, fact: _Computed, salt: str
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

    def _never_saved(self, span: Span, computed: _Computed) -> Miss:
        """Computed before in full, never saved: why not, by the computing request's rules."""
        s, e, by, step = span.start, span.end, computed.request, computed.step
        if self.recorded:
            return Miss(s, e, "not_offered", step, by)
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
        life.lookup = None
        life.current = adm

    def _close(self, label: str, life: _Life) -> None:
        adm = life.current
        life.current = None
        if adm is None:
            return
        n, local, ext_end, rule = adm.asked, adm.local, adm.ext_end, adm.rule
        snap = adm.lookup
        misses: list[Miss] = []
        hits = _zero_hits()
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
                        misses.append(Miss(ok_end, ext_end, "load_failed", adm.fail_step))
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
}


# --- the command's result ---------------------------------------------------------------------


@attrs.define
class Explanation:
    """What :func:`explain` found: every admission's tokens hit and missed, by request."""

    log: str
    recorded: bool
    config: TrackerConfig
    requests: list[RequestMisses]
    without_lookup: int = 0
    forgotten: int = 0
    request: str | None = None  # what --request narrowed it to
    damage: StopInfo | None = None

    def admissions(self) -> list[AdmissionMisses]:
        return [a for r in self.requests for a in r.admissions]

    def totals(self) -> dict[str, Any]:
        return _totals(self.admissions())

    def notes(self) -> list[str]:
        notes = list(NOTES)
        if self.recorded:
            notes.append(RECORDED_NOTE)
        if self.without_lookup:
            notes.append(
                f"{self.without_lookup} admissions had no lookup before them (nothing was "
                "asked): not counted"
            )
        if self.forgotten:
            notes.append(
                f"the history of computed prefixes outgrew its bound: {self.forgotten} "
                "sequences were forgotten (a token they held may read new_prefix)"
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "log": self.log,
            "kind": "recorded" if self.recorded else "kvledger",
            "request": self.request,
            "config": {
                "block_size": c.block_size,
                "chunk_size": c.chunk_size,
                "num_slots": c.num_slots,
                "discard_partial_chunks": c.discard_partial_chunks,
                "save_decode_cache": c.save_decode_cache,
                "block_hits": c.block_hits,
            },
            **self.totals(),
            "requests": [r.to_dict() for r in self.requests],
            "notes": self.notes(),
            "damage": None
            if self.damage is None
            else {
                "file": self.damage.path,
                "offset": self.damage.offset,
                "kind": self.damage.kind,
                "reason": self.damage.reason,
            },
        }


def explain(
    path: LogPath | LogSource,
    *,
    request: str | None = None,
    earlier: Sequence[LogPath] = (),
    history_tokens: int = HISTORY_TOKENS,
) -> Explanation:
    """Explain every admission's lookup of a log (``request``: only that request, a life
    label like ``id#2`` or an id, all its lives; every request is still read, since what one
    computed explains another's misses). ``earlier``: logs of runs before it (the same engine
    before a restart, another replica, another model), read first: what they computed is
    history (``earlier_run``, ``different_salt``). An unknown ``request`` raises
    :class:`RequestNotFound` naming the nearest ids."""
    earlier_sources = [open_log(p) for p in earlier]  # every log readable before any is read
    src = open_log(path)
    config, _ = src.lenient_config()
    recorded = is_recorded(src.run_info)
    by_request: dict[str, RequestMisses] = {}
    labels: dict[str, str] = {}  # every life label -> req_id, in arrival order

    def keep(a: AdmissionMisses) -> None:
        r = by_request.get(a.request)
        if r is None:
            r = by_request[a.request] = RequestMisses(a.request, a.req_id)
        r.admissions.append(a)

    explainer = Explainer(config, keep, recorded=recorded, history_tokens=history_tokens)
    for old in earlier_sources:
        old_config, _ = old.lenient_config()
        explainer.new_run(old.name, old_config)
        for item in walk(old.frames(), old_config):
            explainer.feed(item)
        explainer.finish()
    explainer.new_run("", config)
    for item in walk(src.frames(), config):
        if item.new and item.life:
            labels.setdefault(item.life, item.req_id)
        explainer.feed(item)
    explainer.finish()
    chosen = list(labels)
    if request is not None:
        chosen = resolve(request, labels)
    requests = [by_request[label] for label in chosen if label in by_request]
    for r in requests:
        r.admissions.sort(key=lambda a: a.admission)
    return Explanation(
        log=src.name,
        recorded=recorded,
        config=config,
        requests=requests,
        without_lookup=explainer.without_lookup,
        forgotten=explainer.history.forgotten,
        request=request,
        damage=src.damage,
    )
