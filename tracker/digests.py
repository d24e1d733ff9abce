"""KV-content digests: which blocks to digest, and the rule that judges the digests.

What a connector claims to have loaded is only true if the blocks hold the right KV. The
worker digests blocks (``connector/digests.py``: a deterministic function of a block's bytes,
computed with torch on the cache's device); this module, pure, decides which blocks and judges
what comes back.

- **Keys.** A block's key names its token prefix: a hash chain over the token ids of every full
  block up to and including it (:func:`block_keys`, the chain of ``tracker.chunks`` with one
  block per link), the same for every request with that prefix, under any connector.
- **The plan** (:class:`DigestPlanner`, folded from the scheduler's facts, one
  :class:`DigestPlan` per step): ``full`` are the blocks that became full in this step's
  forward (digested after it); ``before`` and ``verify`` the blocks vLLM accepted as external
  (loaded by the connector), digested before the load is issued and after it completed: a
  synchronous load in the step that schedules it, an asynchronous one once the request was
  reported in ``finished_recving``.
- **The book** (:class:`DigestBook`): key -> the digests recorded for it (every one: two
  requests that computed the same prefix in different batches may differ in the last bits).
  A loaded block is judged against it: verified when its digest after the load is one of the
  key's (even if the load left it as it was: a block vLLM reallocates may already hold that
  very KV); otherwise ``load_unchanged`` when the load left it as it was (``after ==
  before``: nothing was written), ``digest_mismatch`` when it changed it; a key with no digest recorded is *unverifiable*, counted, not a
  violation (the prefix was computed before the log began, or by another engine).

Under tensor or pipeline parallelism each rank digests its own share, so the book is keyed by
(rank, key). Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import operator
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import attrs

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import chunk_keys, root_key
from kvledger.tracker.recorded_steps import RecordedSteps
from kvledger.tracker.violation import Violation
from kvledger.tracker.wellformed import malformed

__all__ = [
    "DIGEST_LOSS",
    "DIGEST_MODES",
    "DIGEST_RULES",
    "DIGEST_TYPES",
    "BookStats",
    "DigestBlock",
    "DigestBook",
    "DigestPlan",
    "DigestPlanner",
    "DigestReport",
    "block_keys",
    "digests_only",
]

# `off`: nothing digested; `sampled`: every planned block, one layer of it (chosen by its key,
# so the saving and the loading side digest the same layer); `full`: every layer.
DIGEST_MODES = ("off", "sampled", "full")
DIGEST_RULES = frozenset({"digest_mismatch", "load_unchanged"})
DIGEST_TYPES: tuple[type[ev.Event], ...] = (ev.BlockDigested, ev.LoadDigested)
_DIGEST_EVENT_NAMES = frozenset(t.__name__ for t in DIGEST_TYPES)

# The root of the digest keys' chain: its own, so a block key never equals a chunk key.
_ROOT = root_key("kvledger-digest")
# Keys the book remembers (least recently recorded forgotten first: then unverifiable), and
# digests per key (distinct ones; more than a few means the computation is not deterministic).
BOOK_KEYS = 1 << 20
DIGESTS_PER_KEY = 8
_MASK = (1 << 64) - 1


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str = "",
    *,
    prev: bytes | None = None,
    first: int = 0,
) -> tuple[bytes, ...]:
    """Keys of the full blocks of ``token_ids`` (from block ``first`` on, chained from
    ``prev``, the key of block ``first - 1``; by default from the start of the prompt)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if prev is None:
        if first:
            raise ValueError("block_keys from a block other than 0 needs the previous key")
        prev = _ROOT if not cache_salt else root_key("kvledger-digest", cache_salt)
    return tuple(chunk_keys(prev, token_ids, block_size, first))


class DigestBlock(NamedTuple):
    """One block to digest: block ``block_index`` of ``req_id``'s table is vLLM block ``block_id``."""

    req_id: str
    block_index: int
    block_id: int
    key: bytes


@attrs.frozen
class DigestPlan:
    """What the worker digests in one step (scheduler -> worker, in the connector metadata).

    ``before``: digested in ``start_load_kv`` before any load is issued; ``full`` and
    ``verify``: after the forward pass (``wait_for_save``). A ``verify`` block of a synchronous
    load is in ``before`` of the same step; one of an asynchronous load was in ``before`` of
    the step that issued it."""

    step: int
    full: tuple[DigestBlock, ...] = ()
    before: tuple[DigestBlock, ...] = ()
    verify: tuple[DigestBlock, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.full or self.before or self.verify)


# The callbacks of a RecordLost that lost digests only (the worker's, a plan's, a report's:
# digest_plan, digest_report, digest_before_load, digest_after_forward): every scheduler fact
# of the run is in the log, only the content check of some blocks is not.
DIGEST_LOSS = "digest_"


def digests_only(e: ev.RecordLost) -> bool:
    """Whether this lost record is digests only (a replay of the scheduler's facts, such as
    ``kvledger whatif``, misses nothing): a digest failure, or a digest event the log could
    not hold."""
    return e.callback.startswith(DIGEST_LOSS) or e.callback in _DIGEST_EVENT_NAMES


@attrs.frozen
class DigestReport:
    """What one worker rank digested (worker -> scheduler): ``blocks`` as
    (req id, block index, key, digest), ``loads`` as (req id, block index, key, before,
    after, step), ``step`` that of the plan that digested the block after the load (the
    report reaches the scheduler a step later: a verdict is stamped with the load's step).
    Digests are 64-bit, as signed ints (what Arrow and SQL hold)."""

    blocks: tuple[tuple[str, int, bytes, int], ...] = ()
    loads: tuple[tuple[str, int, bytes, int, int, int], ...] = ()
    rank: int = 0
    # Digests that came with values loaded from the remote tier (req id, block index, key,
    # digest): the saving engine's (connector/values.py).
    carried: tuple[tuple[str, int, bytes, int], ...] = ()
    # Where the rank's digests failed since its last report, (where, error): torch raised, a
    # block id out of range. Those digests are missing; each becomes a RecordLost, so the log
    # says so and why, not only the worker's own log (connector/digests.py says which
    # failures are reported).
    errors: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blocks or self.loads or self.carried or self.errors)

    def merged(self, other: DigestReport) -> DigestReport:
        return DigestReport(
            self.blocks + other.blocks,
            self.loads + other.loads,
            self.rank,
            self.carried + other.carried,
            self.errors + other.errors,
        )

    def to_plain(self) -> list[Any]:
        return [
            [list(b) for b in self.blocks],
            [list(x) for x in self.loads],
            self.rank,
            [list(c) for c in self.carried],
            [list(e) for e in self.errors],
        ]

    @classmethod
    def from_plain(cls, data: Any) -> DigestReport:
        blocks, loads, rank, *rest = data
        carried = rest[0] if rest else ()
        errors = rest[1] if len(rest) > 1 else ()
        return cls(
            tuple((str(r), int(i), bytes(k), int(d)) for r, i, k, d in blocks),
            tuple((str(r), int(i), bytes(k), int(b), int(a), int(s)) for r, i, k, b, a, s in loads),
            int(rank),
            tuple((str(r), int(i), bytes(k), int(d)) for r, i, k, d in carried),
            tuple((str(where), str(error)) for where, error in errors),
        )

    def without(self, req_ids: Collection[str]) -> DigestReport:
        """The report less the blocks these requests digested (their loads stay)."""
        if not req_ids:
            return self
        return attrs.evolve(self, blocks=tuple(b for b in self.blocks if b[0] not in req_ids))

    def events(self, step: int) -> list[ev.Event]:
        """The report as log events: one ``BlockDigested`` / ``LoadDigested`` per run of
        consecutive blocks of one request, in report order; the carried digests first, so
        that the loads they came with are judged by them; then a ``RecordLost`` for each
        error (callback ``digest_<where>``, the rank in its text)."""
        out: list[ev.Event] = []
        for rows_of, carried in ((self.carried, True), (self.blocks, False)):
            for req_id, start, rows in _runs(rows_of):
                out.append(
                    ev.BlockDigested(
                        step,
                        req_id,
                        start,
                        tuple(r[2] for r in rows),
                        tuple(r[3] for r in rows),
                        self.rank,
                        carried,
                    )
                )
        for req_id, start, lrows in _runs(self.loads, by_step=True):
            out.append(
                ev.LoadDigested(
                    step,
                    req_id,
                    start,
                    tuple(r[2] for r in lrows),
                    tuple(r[3] for r in lrows),
                    tuple(r[4] for r in lrows),
                    self.rank,
                    lrows[0][5],
                )
            )
        for where, error in self.errors:
            out.append(ev.RecordLost(step, "", DIGEST_LOSS + where, f"rank {self.rank}: {error}"))
        return out


def _runs(rows: Sequence[Any], by_step: bool = False) -> Iterable[tuple[str, int, list[Any]]]:
    """Runs of consecutive blocks of one request (of one load step: ``by_step``)."""
    run: list[Any] = []
    for row in rows:
        if run and (
            row[0] != run[-1][0] or row[1] != run[-1][1] + 1 or (by_step and row[5] != run[-1][5])
        ):
            yield run[0][0], run[0][1], run
            run = []
        run.append(row)
    if run:
        yield run[0][0], run[0][1], run


# --- the plan -----------------------------------------------------------------------------

_NEXT = (1).__add__
_LOAD = operator.attrgetter("load")
_NEXT_FULL = operator.attrgetter("next_full")


# A block index no request reaches: where a lost request's next full block is (lose()).
_NEVER_DUE = 1 << 62


class _Req:
    __slots__ = ("async_load", "blocks", "keys", "load", "next_full", "salt")

    def __init__(self, salt: str) -> None:
        self.salt = salt
        self.blocks: list[int] = []
        self.keys: list[bytes] = []
        # The external tokens vLLM accepted for a synchronous load (planned when the request
        # is scheduled); an asynchronous load's blocks, once issued, until verified.
        self.load: int | None = None
        self.async_load: tuple[DigestBlock, ...] = ()
        # Blocks below this were planned as full (or loaded); a block that filled before its
        # token ids were known (async scheduling samples the last one a step later) waits
        # here until they are.
        self.next_full = 0


class DigestPlanner:
    """Folds the scheduler's facts into one :class:`DigestPlan` per step (see the module
    docstring). The caller tells it, in vLLM's order: :meth:`allocated`
    (``update_state_after_alloc``), :meth:`scheduled` for every scheduled request
    (``build_connector_meta``), :meth:`finished_recving` (``update_connector_output``),
    :meth:`finished` (``request_finished``); :meth:`plan` ends the step. Memory: the live
    requests' block tables and keys."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._reqs: dict[str, _Req] = {}
        # Requests with a full block whose token ids were not known yet: the caller must call
        # scheduled() for them even in a step that fills no block.
        self.deferred: set[str] = set()
        # Synchronous loads allocated this step: vLLM schedules them in the same step; one it
        # did not is forgotten at the step's end (never verified against a later admission).
        self._allocated_now: set[str] = set()
        self._full: list[DigestBlock] = []
        self._before: list[DigestBlock] = []
        self._verify: list[DigestBlock] = []
        # observe() only: the token ids learned from the events, and the last lookup's local
        # hit and async flag (for the allocation that follows it).
        self._tokens: dict[str, list[int]] = {}
        self._lookups: dict[str, tuple[int, bool]] = {}
        # Requests whose block table is not known any more (lose()): none of their blocks is
        # paired with a key until vLLM gives their whole table again.
        self._lost: set[str] = set()
        # The holders of the last output's failed blocks (computed_over_failed).
        self._failed_before: set[str] = set()

    def _req(self, req_id: str, cache_salt: str = "") -> _Req:
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Req(cache_salt)
        return r

    def added(self, req_id: str, cache_salt: str = "") -> None:
        """A new request (its cache salt starts its keys' chain)."""
        self._reqs[req_id] = _Req(cache_salt)

    def _keys(self, r: _Req, token_ids: Sequence[int], upto: int) -> list[bytes]:
        """The keys of blocks ``[0, upto)`` (fewer if the token ids known do not reach)."""
        have = len(r.keys)
        if have < upto:
            bs = self.block_size
            end = min(upto, len(token_ids) // bs)
            if end > have:
                prev = r.keys[-1] if r.keys else None
                tokens = list(token_ids[: end * bs])
                r.keys.extend(block_keys(tokens, bs, r.salt, prev=prev, first=have))
        return r.keys

    def allocated(
        self,
        req_id: str,
        block_ids: Sequence[int],
        num_external: int,
        *,
        load_async: bool = False,
        local_hit: int = 0,
        token_ids: Sequence[int] = (),
    ) -> None:
        """vLLM accepted ``num_external`` tokens into ``block_ids`` (the request's whole
        table). A synchronous load fills ``[num_computed - num_external, num_computed)`` of
        the step that schedules the request, planned then. An asynchronous one fills
        ``[local_hit, local_hit + num_external)`` (``local_hit``: vLLM's prefix-cache hit, the
        lookup's ``num_computed_tokens``): digested ``before`` now, verified once the request
        is in ``finished_recving`` (``token_ids`` name its keys)."""
        r = self._req(req_id)
        r.load = None
        if num_external <= 0:
            return
        if not load_async:
            r.load = num_external
            self._allocated_now.add(req_id)
            return
        self._lost.discard(req_id)  # the whole table again
        r.blocks = list(block_ids)
        r.async_load = self._loaded_blocks(
            req_id, r, local_hit, local_hit + num_external, token_ids
        )
        self._before.extend(r.async_load)

    def _loaded_blocks(
        self, req_id: str, r: _Req, start: int, end: int, token_ids: Sequence[int]
    ) -> tuple[DigestBlock, ...]:
        """The whole blocks of ``[start, end)``: a block the load fills only in part also
        holds tokens computed here, and has no key to judge it by."""
        bs = self.block_size
        first, last = -(-start // bs), end // bs
        keys = self._keys(r, token_ids, last)
        table = r.blocks
        return tuple(
            DigestBlock(req_id, i, table[i], keys[i])
            for i in range(first, min(last, len(keys), len(table)))
        )

    def scheduled(
        self,
        req_id: str,
        *,
        replace: bool,
        block_ids: Sequence[int],
        num_computed: int,
        num_scheduled: int,
        token_ids: Sequence[int],
    ) -> None:
        """vLLM scheduled ``num_scheduled`` tokens after ``num_computed``; ``block_ids`` are
        the request's whole table (``replace``: a new or resumed admission) or the blocks
        appended to it. ``token_ids``: the request's token ids known now (blocks whose tokens
        are not all known yet, under async scheduling, are not digested)."""
        if req_id in self._lost:
            if not replace:
                return  # blocks appended to a table not known: nothing to pair them with
            self._lost.discard(req_id)
        r = self._req(req_id)
        if replace:
            r.blocks = list(block_ids)
        else:
            r.blocks.extend(block_ids)
        bs = self.block_size
        load, r.load = r.load, None
        if load is not None and replace:
            # A synchronous load fills [num_computed - external, num_computed) in this step.
            start = max(0, num_computed - load)
            blocks = self._loaded_blocks(req_id, r, start, num_computed, token_ids)
            self._before.extend(blocks)
            self._verify.extend(blocks)
        if replace:
            r.next_full = num_computed // bs
        # From the first block not planned yet (a rewind, vLLM recomputing after a load
        # error, starts lower) to the last this step fills.
        first = min(r.next_full, num_computed // bs)
        last = (num_computed + num_scheduled) // bs
        if last <= first:
            self.deferred.discard(req_id)
            return
        keys = self._keys(r, token_ids, last)
        table = r.blocks
        end = min(last, len(keys), len(table))
        self._full.extend(DigestBlock(req_id, i, table[i], keys[i]) for i in range(first, end))
        r.next_full = max(first, end)
        if r.next_full < last:
            self.deferred.add(req_id)
        else:
            self.deferred.discard(req_id)

    def finished_recving(self, req_ids: Iterable[str]) -> None:
        """These requests' asynchronous loads completed: their blocks are verified in the
        next step's plan."""
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None and r.async_load:
                self._verify.extend(r.async_load)
                r.async_load = ()

    def holding(self, block_ids: Collection[int]) -> set[str]:
        """The live requests whose block table holds one of ``block_ids``: the request whose
        load they were, and any other that shares them through vLLM's prefix cache."""
        ids = set(block_ids)
        return {rid for rid, r in self._reqs.items() if not ids.isdisjoint(r.blocks)}

    def computed_over_failed(self, block_ids: Collection[int]) -> set[str]:
        """Told once per step's output the blocks whose load failed in that step: the
        requests none of whose blocks digested in it may be recorded as their keys'. Those
        that hold one of the blocks (:meth:`holding`) ran the step's forward over KV that was
        never loaded, and so did the holders of the step before's (under async scheduling,
        this step was scheduled before vLLM heard of it). Recorded, such a digest would
        verify a later load of the same wrong bytes; vLLM recomputes the blocks, and the
        recomputed digests are recorded."""
        failed = self.holding(block_ids) if block_ids else set()
        skipped, self._failed_before = failed | self._failed_before, failed
        return skipped

    def finished(self, req_id: str) -> None:
        """The request finished: its blocks may be freed (its pending checks are dropped)."""
        self._reqs.pop(req_id, None)
        self._lost.discard(req_id)
        self.deferred.discard(req_id)

    def lose(self, req_ids: Iterable[str] | None = None) -> None:
        """What vLLM did to these requests' block tables this step could not be read (None:
        to every request's): none of their blocks is digested again until vLLM gives a whole
        table (a resumption, an asynchronous load's allocation). A table a block short would
        pair each key with the next block's bytes: wrong digests, recorded as the keys'."""
        for req_id in list(self._reqs) if req_ids is None else req_ids:
            self._lost.add(req_id)  # one never told of yet too: no table of it is known
            r = self._reqs.get(req_id)
            if r is None:
                continue
            r.blocks = []
            r.load = None
            r.async_load = ()
            # Nothing of it is due until a whole table resets this (scheduled with replace):
            # a lost request never asks to be told of its steps (decoded_columns).
            r.next_full = _NEVER_DUE
            self.deferred.discard(req_id)

    def preempted(self, req_id: str) -> None:
        """Preempted: vLLM frees its blocks; a resumption brings a whole new table."""
        r = self._reqs.get(req_id)
        if r is not None:
            r.blocks = []
            r.async_load = ()
        self.deferred.discard(req_id)

    # --- from recorded events (a recorder's log: connector/recorder.py) --------------------

    def observe(self, e: ev.Event) -> None:
        """Fold one recorded fact of vLLM's (or of the wrapped connector's answers) into the
        plan: what the calls above are told directly, read off the events a recorder writes.
        The request's token ids are learned from the events too."""
        cls = type(e)
        rid = e.req_id
        if cls is ev.RequestAdded:
            assert isinstance(e, ev.RequestAdded)
            self.added(rid, e.cache_salt)
            self._tokens[rid] = list(e.prompt_token_ids)
        elif cls is ev.LookupAsked:
            assert isinstance(e, ev.LookupAsked)
            self._learn(rid, e.token_start, e.token_ids)
            self._lookups[rid] = (e.local_hit, False)
        elif cls is ev.InnerLookupAnswered:
            assert isinstance(e, ev.InnerLookupAnswered)
            local = self._lookups.get(rid, (0, False))[0]
            self._lookups[rid] = (local, e.load_async)
        elif cls is ev.Allocated:
            assert isinstance(e, ev.Allocated)
            local, load_async = self._lookups.pop(rid, (0, False))
            self.allocated(
                rid,
                e.block_ids,
                e.num_external,
                load_async=load_async,
                local_hit=local,
                token_ids=self._tokens.get(rid, ()),
            )
        elif cls is ev.Scheduled:
            assert isinstance(e, ev.Scheduled)
            tokens = self._learn(rid, e.token_start, e.token_ids)
            self.scheduled(
                rid,
                replace=e.admission is not ev.Admission.RUNNING,
                block_ids=e.block_ids,
                num_computed=e.num_computed,
                num_scheduled=e.num_scheduled,
                token_ids=tokens,
            )
        elif cls is ev.Preempted:
            self.preempted(rid)
        elif cls is ev.Finished:
            self.finished(rid)
            self._tokens.pop(rid, None)
            self._lookups.pop(rid, None)
        elif cls is ev.InnerRecvDone:
            assert isinstance(e, ev.InnerRecvDone)
            if e.failed:  # nothing was loaded: nothing to verify
                r = self._reqs.get(rid)
                if r is not None:
                    r.async_load = ()
            else:
                self.finished_recving((rid,))

    def observe_decoded(self, e: ev.StepDecoded, steps: RecordedSteps) -> None:
        """A recorder's ``StepDecoded``, observed as the ``Scheduled`` events it stands for
        (``steps``: the recorder's view of its log, before it takes ``e``)."""
        columns = steps.columns(e)
        if columns is None:  # not plain: entry by entry
            self.decoded(steps.entries(e)[0])
            return
        rids, counts, starts = columns
        grown = e.new_blocks() or {}
        by_rid = {rids[e.nums.index(num)]: block for num, block in grown.items()}
        self.decoded_columns(rids, counts, starts, e.tokens, by_rid)

    def decoded_columns(
        self,
        rids: list[str],
        counts: list[int],
        starts: list[int],
        tokens: Sequence[int],
        grown: dict[str, int],
    ) -> None:
        """:meth:`decoded` for a ``StepDecoded``'s plain entries as columns
        (``RecordedSteps.columns``; ``grown``: req id -> new block): the tokens are learned
        and the entries that can plan nothing are told apart with loops in C; the rest go
        through :meth:`scheduled`, in the entries' order, as :meth:`decoded` would send them."""
        bs = self.block_size
        known = list(map(self._tokens.get, rids))
        reqs = list(map(self._reqs.get, rids))
        if None in known or None in reqs or list(map(len, known)) != starts:  # type: ignore[arg-type]
            self.decoded(zip(rids, counts, starts, tokens, map(grown.get, rids), strict=True))
            return
        deque(map(list.append, known, tokens), maxlen=0)  # type: ignore[arg-type]
        floors = list(map(operator.floordiv, counts, repeat(bs)))
        # Each entry fills no block, appends none, has no load and no block waiting: it plans
        # nothing (scheduled() would return at once). The others go through scheduled().
        special = set(grown)
        special.update(self.deferred.intersection(rids))
        fills = list(map(operator.floordiv, map(_NEXT, counts), repeat(bs)))
        if fills != floors:
            special.update(r for r, f, c in zip(rids, fills, floors, strict=True) if f != c)
        if list(map(_LOAD, reqs)).count(None) != len(reqs):
            special.update(r for r, q in zip(rids, reqs, strict=True) if q.load is not None)  # type: ignore[union-attr]
        if any(map(operator.lt, map(_NEXT_FULL, reqs), floors)):
            special.update(
                r
                for r, q, f in zip(rids, reqs, floors, strict=True)
                if q.next_full < f  # type: ignore[union-attr]
            )
        if not special:
            return
        for rid, nc, ids in zip(rids, counts, known, strict=True):
            if rid in special:
                block = grown.get(rid)
                self.scheduled(
                    rid,
                    replace=False,
                    block_ids=() if block is None else (block,),
                    num_computed=nc,
                    num_scheduled=1,
                    token_ids=ids,  # type: ignore[arg-type]
                )

    def decoded(self, entries: Iterable[tuple[str, int, int, int, int | None]]) -> None:
        """A recorder's steady entries (``RecordedSteps.entries``: req id, num_computed,
        token_start, token id, new block or None), each observed as the one-token ``Scheduled``
        of a running request it stands for, without building it. A step that fills no block
        and appends none (most of them) only learns its token."""
        bs = self.block_size
        reqs = self._reqs
        for rid, nc, start, token, block in entries:
            tokens = self._learn(rid, start, (token,))
            r = reqs.get(rid)
            if (
                r is not None
                and block is None
                and r.load is None
                and (nc + 1) // bs <= min(r.next_full, nc // bs)
            ):
                self.deferred.discard(rid)  # what scheduled() does for such a step
                continue
            self.scheduled(
                rid,
                replace=False,
                block_ids=() if block is None else (block,),
                num_computed=nc,
                num_scheduled=1,
                token_ids=tokens,
            )

    def _learn(self, rid: str, start: int, token_ids: Sequence[int]) -> list[int]:
        tokens = self._tokens.setdefault(rid, [])
        if token_ids and start <= len(tokens):
            del tokens[start:]
            tokens.extend(token_ids)
        return tokens

    def plan(self, step: int) -> DigestPlan | None:
        """This step's plan (None when there is nothing to digest); starts the next step."""
        live = self._reqs
        full = tuple(b for b in self._full if b.req_id in live)
        before = tuple(b for b in self._before if b.req_id in live)
        verify = tuple(b for b in self._verify if b.req_id in live)
        self._full, self._before, self._verify = [], [], []
        for req_id in self._allocated_now:
            r = live.get(req_id)
            if r is not None:
                r.load = None
        self._allocated_now.clear()
        if not (full or before or verify):
            return None
        return DigestPlan(step, full, before, verify)


# --- the book and its rules ---------------------------------------------------------------


@attrs.define
class BookStats:
    """What the book saw: blocks digested (after a forward), digests carried by values loaded
    from the remote tier (the saving engine's), loaded blocks checked, of which verified (a
    recorded digest matched), mismatched, unchanged, and unverifiable (no digest recorded for
    the key)."""

    digested: int = 0
    carried: int = 0  # digests that came with values loaded from the remote tier
    loaded: int = 0
    verified: int = 0
    mismatched: int = 0
    unchanged: int = 0
    unverifiable: int = 0

    def to_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


class DigestBook:
    """The recorded digests, (rank, key) -> the distinct digests seen, and the rules that
    judge a load against them. ``apply(event)`` takes any event and returns the violations it
    shows (only ``LoadDigested`` can show any). A malformed digest event (keys and digests of
    different lengths, ...: ``tracker.wellformed``, whose reader names it) is neither
    recorded nor judged."""

    def __init__(self, max_keys: int = BOOK_KEYS) -> None:
        self.max_keys = max_keys
        self._book: OrderedDict[tuple[int, bytes], tuple[int, ...]] = OrderedDict()
        self.stats = BookStats()

    def digests_of(self, key: bytes, rank: int = 0) -> tuple[int, ...]:
        return self._book.get((rank, key), ())

    def apply(self, event: ev.Event) -> list[Violation]:
        if not isinstance(event, (ev.BlockDigested, ev.LoadDigested)) or malformed(event):
            return []
        if isinstance(event, ev.BlockDigested):
            self._record(event)
            return []
        return self._judge(event)

    def _record(self, e: ev.BlockDigested) -> None:
        book = self._book
        stats = self.stats
        for key, digest in zip(e.keys, e.digests, strict=True):
            if e.carried:
                stats.carried += 1
            else:
                stats.digested += 1
            k = (e.rank, key)
            seen = book.get(k, ())
            if digest not in seen and len(seen) < DIGESTS_PER_KEY:
                book[k] = (*seen, digest)
            else:
                book[k] = seen
            book.move_to_end(k)
        while len(book) > self.max_keys:
            book.popitem(last=False)

    def _judge(self, e: ev.LoadDigested) -> list[Violation]:
        """The violations of a load, stamped with the step of the load (``judged_step``), not
        the later step whose output carried the report."""
        out: list[Violation] = []
        stats = self.stats
        step = e.judged_step
        for i, (key, before, after) in enumerate(zip(e.keys, e.before, e.after, strict=True)):
            stats.loaded += 1
            block = e.start + i
            expected = self._book.get((e.rank, key))
            if expected and after in expected:
                # Right, whatever the load did: a block vLLM reallocated may already hold
                # exactly this KV (the same tokens computed into it before it was freed).
                stats.verified += 1
                continue
            if after == before:
                stats.unchanged += 1
                out.append(
                    Violation(
                        "load_unchanged",
                        step,
                        e.req_id,
                        "LoadDigested",
                        {"block": block, "key": key.hex(), "digest": _hex(after)},
                    )
                )
                continue
            if not expected:
                stats.unverifiable += 1
                continue
            stats.mismatched += 1
            out.append(
                Violation(
                    "digest_mismatch",
                    step,
                    e.req_id,
                    "LoadDigested",
                    {
                        "block": block,
                        "key": key.hex(),
                        "expected": "|".join(map(_hex, expected)),
                        "found": _hex(after),
                        **({"rank": e.rank} if e.rank else {}),
                    },
                )
            )
        return out


def _hex(digest: int) -> str:
    return f"{digest & _MASK:016x}"
