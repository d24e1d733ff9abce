"""RequestState and the fold: ``fold(state, event, config) -> (state, violations)``.

Rule of this module: everything that changes a request's state lives here, in one handler per
event type, chosen by the table ``_HANDLERS``. The fold is total and pure: it reads only the
state, the event and the configuration; any event in any order gives a state and a (possibly
empty) tuple of ``Violation``s; it never raises on bad input and never silently accepts a
state it cannot prove right. A violation sets ``recompute_only``: from then on the request is
never loaded or saved, and vLLM recomputes it.

The rules, each one a bug that shipped elsewhere (see docs/design-notes.md):

- Admission (new, resumed, or "new" again under Model Runner V2) **replaces** the block table
  and rebuilds the token list from the full token ids; nothing from the old admission leaks.
- After every ``Scheduled``, ``num_tokens == num_computed + num_scheduled``. Under async
  scheduling the newest input tokens may not be sampled yet, so the known token ids may trail
  ``num_tokens`` by at most ``max_async_lag``; after a rollback (failed load, rejected draft
  tokens) vLLM's count is behind ours and we truncate to it.
- ``num_tokens`` never exceeds the block table's capacity.
- Admission-scoped values (lookup, accepted external tokens, load, save progress) are reset on
  preemption; lifetime values (first hits, preemption count, totals) are kept apart.
- The saved watermark moves only when the worker confirms a save (or the pool already held
  the chunk); it is the start of the first unconfirmed chunk.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import chunk_keys, packed_chunk_keys, root_key, tokens_bytes
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.seq import Seq
from kvledger.tracker.violation import Violation

__all__ = [
    "Lifetime",
    "LoadProgress",
    "LookupResult",
    "Phase",
    "RequestState",
    "SaveProgress",
    "advance_decoded",
    "fold",
    "new_state",
    "steady_decode",
    "steady_limit",
]


class Phase(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class LookupResult(NamedTuple):
    """The last lookup answered while the request waited (admission-scoped)."""

    local_hit: int
    hit: int
    external: int
    num_tokens: int


class LoadProgress(NamedTuple):
    """The admission's load: tokens ``[start, end)`` from ``keys`` (pinned in the index)."""

    start: int
    end: int
    keys: tuple[bytes, ...]
    done: bool


class SaveProgress(NamedTuple):
    """Saves of the current admission. ``cursor``: where the next plan starts;
    ``pending``: planned, unconfirmed chunks as (key, start) in token order."""

    cursor: int
    pending: tuple[tuple[bytes, int], ...]

    @property
    def saved(self) -> int:
        """The confirmed watermark: the start of the first unconfirmed chunk."""
        if self.pending:
            return min(self.cursor, min(start for _, start in self.pending))
        return self.cursor


_NO_SAVES = SaveProgress(0, ())


class Lifetime(NamedTuple):
    """Values that belong to the request's whole life, never reset by preemption."""

    num_preemptions: int = 0
    first_local_hit: int = -1
    first_external: int = -1
    tokens_loaded: int = 0
    tokens_saved: int = 0
    finish_reason: str = ""


class RequestState(NamedTuple):
    """One request as the fold sees it. Immutable; every event makes a new one.

    ``token_ids`` are the known token ids (prompt, then outputs as they are learned);
    ``num_tokens`` the tokens whose KV exists or is being computed in the current step;
    ``num_computed`` vLLM's count before the last scheduled step; ``keys`` the chunk keys of
    the full chunks of ``token_ids``; ``prefill_end`` the tokens known at admission (chunks
    below it are prefill chunks, saved whatever ``save_decode_cache`` says).
    """

    req_id: str
    prompt_len: int
    root: bytes
    phase: Phase
    token_ids: Seq[int]
    num_tokens: int
    num_computed: int
    block_ids: Seq[int]
    keys: Seq[bytes]
    prefill_end: int
    lookup: LookupResult | None
    accepted: int
    allocated: bool
    load: LoadProgress | None
    save: SaveProgress
    recompute_only: bool
    life: Lifetime

    @property
    def preempted(self) -> bool:
        return self.phase is Phase.PREEMPTED

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def saved(self) -> int:
        return self.save.saved

    def block_capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size

    def summary(self) -> dict[str, Any]:
        """Plain values for logs, reports and ``kvledger show``."""
        return {
            "phase": self.phase.name.lower(),
            "tokens_known": len(self.token_ids),
            "num_tokens": self.num_tokens,
            "num_computed": self.num_computed,
            "blocks": len(self.block_ids),
            "saved": self.saved,
            "save_cursor": self.save.cursor,
            "saves_in_flight": len(self.save.pending),
            "load": None if self.load is None else [self.load.start, self.load.end],
            "accepted": self.accepted,
            "preemptions": self.life.num_preemptions,
            "recompute_only": self.recompute_only,
        }


def _quick_replace(cls: Any) -> None:
    """Give the NamedTuple ``cls`` a ``_replace`` that copies the tuple once and sets the
    named fields by position: the fold makes a new state for every event, and the generic
    ``_replace`` pops every field from the keywords (twice the time, a tenth of a replay)."""
    index = {name: i for i, name in enumerate(cls._fields)}
    new = tuple.__new__

    def _replace(self: Any, /, **changes: Any) -> Any:
        values = list(self)
        for name, value in changes.items():
            i = index.get(name)
            if i is None:
                raise TypeError(f"Got unexpected field names: {list(changes)!r}")
            values[i] = value
        return new(cls, values)

    cls._replace = _replace


for _cls in (LookupResult, LoadProgress, SaveProgress, Lifetime, RequestState):
    _quick_replace(_cls)


def new_state(
    req_id: str,
    prompt: Sequence[int],
    config: TrackerConfig,
    cache_salt: str = "",
    packed: bytes | None = None,
) -> RequestState:
    """A new request's state; ``packed``: ``tokens_bytes(prompt)``, when the caller has it
    (the fold packs a prompt to validate it: packed twice, it cost a fifth of the fold's
    ``RequestAdded``)."""
    root = root_key(config.salt, cache_salt)
    tokens = Seq(prompt)
    data = tokens_bytes(prompt) if packed is None else packed
    return RequestState(
        req_id=req_id,
        prompt_len=len(tokens),
        root=root,
        phase=Phase.WAITING,
        token_ids=tokens,
        num_tokens=0,
        num_computed=0,
        block_ids=Seq(),
        keys=Seq(packed_chunk_keys(root, data, config.chunk_size)),
        prefill_end=len(tokens),
        lookup=None,
        accepted=0,
        allocated=False,
        load=None,
        save=_NO_SAVES,
        recompute_only=False,
        life=Lifetime(),
    )


Result = tuple["RequestState | None", tuple[Violation, ...]]
_NONE: tuple[Violation, ...] = ()


def _violation(rule: str, event: ev.Event, **detail: Any) -> Violation:
    return Violation(rule, event.step, event.req_id, type(event).__name__, detail)


def _packed(tokens: Sequence[int]) -> bytes | None:
    """``tokens`` as the keys encode them, or None when they are not all uint32 (the chunk
    keys encode them so). Anything else would make a plan raise when it hashes a partial
    chunk, long after the fold accepted it."""
    try:
        return tokens_bytes(tokens)
    except (struct.error, TypeError):
        return None


def _valid_tokens(tokens: Sequence[int]) -> bool:
    return _packed(tokens) is not None


def starts_life(e: ev.RequestAdded) -> bool:
    """Whether the fold can give ``e``'s request a state: not when its prompt's token ids are
    not uint32 (``token_ids_valid``). A request the fold gives no state takes no number in a
    log the ``Tracker`` wrote (``tracker.numbering``)."""
    return _valid_tokens(e.prompt_token_ids)


def _learn_tokens(
    state: RequestState, start: int, tokens: Sequence[int], event: ev.Event, config: TrackerConfig
) -> tuple[RequestState, tuple[Violation, ...]]:
    """Merge ``all_token_ids[start:start+len(tokens)]`` into the known tokens.

    Overlapping tokens must match what we know (content, not just length); a start past the
    end of what we know would leave a hole and is refused.
    """
    known = state.token_ids
    n_known = len(known)
    if start < 0:
        return state, (_violation("token_range", event, token_start=start),)
    if start > n_known:
        return state, (_violation("token_gap", event, token_start=start, tokens_known=n_known),)
    overlap = min(n_known - start, len(tokens))
    if overlap > 0 and known[start : start + overlap] != list(tokens[:overlap]):
        first = next(
            i for i in range(overlap) if known[start + i] != tokens[i]
        )  # the first position that differs, for the report
        return state, (
            _violation(
                "token_content_matches",
                event,
                position=start + first,
                known=known[start + first],
                got=tokens[first],
            ),
        )
    new = tokens[overlap:]
    if not new:
        return state, _NONE
    if not _valid_tokens(new):
        return state, (_violation("token_ids_valid", event, token_start=start + overlap),)
    token_ids = known.extended(new)
    keys = state.keys
    c = config.chunk_size
    if len(token_ids) // c > len(keys):
        prev = keys[-1] if len(keys) else state.root
        keys = keys.extended(chunk_keys(prev, token_ids, c, first_chunk=len(keys)))
    return state._replace(token_ids=token_ids, keys=keys), _NONE


def _reset_admission(state: RequestState) -> RequestState:
    """Forget everything that belonged to the previous admission (blocks are revoked)."""
    return state._replace(
        num_tokens=0,
        num_computed=0,
        block_ids=Seq(),
        lookup=None,
        accepted=0,
        allocated=False,
        load=None,
        save=SaveProgress(0, state.save.pending),
    )


def _preempt(state: RequestState) -> RequestState:
    state = _reset_admission(state)
    life = state.life._replace(num_preemptions=state.life.num_preemptions + 1)
    return state._replace(phase=Phase.PREEMPTED, life=life)


# --- handlers: one per event type -----------------------------------------------------------


def _on_request_added(
    state: RequestState | None, e: ev.RequestAdded, config: TrackerConfig
) -> Result:
    packed = _packed(e.prompt_token_ids)  # what starts_life asks, kept for the keys
    if packed is None:
        return state, (_violation("token_ids_valid", e, prompt_len=len(e.prompt_token_ids)),)
    if state is not None:
        if state.phase is Phase.FINISHED:
            # vLLM may reuse an id after the old request finished: a fresh life.
            return new_state(e.req_id, e.prompt_token_ids, config, e.cache_salt, packed), _NONE
        if list(e.prompt_token_ids) == state.token_ids[: state.prompt_len]:
            return state, _NONE  # told twice (on_new_request, then first sight): same fact
        return state._replace(recompute_only=True), (
            _violation("duplicate_request", e, prompt_len=len(e.prompt_token_ids)),
        )
    return new_state(e.req_id, e.prompt_token_ids, config, e.cache_salt, packed), _NONE


def _on_lookup_asked(state: RequestState, e: ev.LookupAsked, config: TrackerConfig) -> Result:
    vs: tuple[Violation, ...] = _NONE
    if state.phase is Phase.RUNNING:
        # No preempted_req_ids (older vLLM: connector/edge.py): asked again, it was preempted.
        state = _preempt(state)
    state, vs = _learn_tokens(state, e.token_start, e.token_ids, e, config)
    # Remember what was asked; the answer (a decision event) fills in hit and external.
    state = state._replace(lookup=LookupResult(e.local_hit, 0, 0, e.num_tokens))
    if not vs and len(state.token_ids) < e.num_tokens:
        vs = (
            _violation(
                "lookup_tokens_known",
                e,
                num_tokens=e.num_tokens,
                tokens_known=len(state.token_ids),
            ),
        )
    return state, vs


def _on_lookup_answered(state: RequestState, e: ev.LookupAnswered, config: TrackerConfig) -> Result:
    # Idempotent by construction: asked again with the same pool, the same values are written.
    lookup = LookupResult(
        local_hit=state.lookup.local_hit if state.lookup else 0,
        hit=e.hit,
        external=e.external,
        num_tokens=state.lookup.num_tokens if state.lookup else len(state.token_ids),
    )
    return state._replace(lookup=lookup), _NONE


def _on_allocated(state: RequestState, e: ev.Allocated, config: TrackerConfig) -> Result:
    if state.phase is Phase.RUNNING:
        # vLLM allocates through update_state_after_alloc only for waiting requests: a
        # running request's table grows through Scheduled, never here.
        return state, (_violation("allocated_while_running", e, blocks=len(e.block_ids)),)
    if state.allocated and e.num_external == 0:
        # The second call after an async load completes: the full table, nothing to decide.
        return state._replace(block_ids=Seq(e.block_ids)), _NONE
    offered = state.lookup.external if state.lookup else 0
    vs = _NONE
    if e.num_external != offered and not state.recompute_only:
        vs = (_violation("accepted_equals_answer", e, accepted=e.num_external, answered=offered),)
    return state._replace(block_ids=Seq(e.block_ids), accepted=e.num_external, allocated=True), vs


def _on_scheduled(state: RequestState, e: ev.Scheduled, config: TrackerConfig) -> Result:
    vs: list[Violation] = []
    if e.admission is not ev.Admission.RUNNING:
        if state.phase is Phase.RUNNING:
            # Re-admitted without a preemption signal (older vLLM, MRV2): infer it.
            state = _preempt(state)
        lookup, accepted = state.lookup, state.accepted
        state = state._replace(
            phase=Phase.RUNNING,
            block_ids=Seq(e.block_ids),  # replaced, never extended
        )
        state, tv = _learn_tokens(state, e.token_start, e.token_ids, e, config)
        vs.extend(tv)
        expected = (lookup.local_hit if lookup else e.num_computed) + accepted
        if e.num_computed != expected and not state.recompute_only:
            vs.append(
                _violation(
                    "admission_matches_lookup",
                    e,
                    num_computed=e.num_computed,
                    local_hit=lookup.local_hit if lookup else -1,
                    accepted=accepted,
                )
            )
        life = state.life
        if life.first_local_hit < 0:
            life = life._replace(
                first_local_hit=lookup.local_hit if lookup else e.num_computed,
                first_external=accepted,
            )
        state = state._replace(
            num_computed=e.num_computed,
            num_tokens=e.num_computed + e.num_scheduled,
            prefill_end=max(len(state.token_ids), e.num_computed + e.num_scheduled),
            save=SaveProgress(0, state.save.pending),
            life=life,
        )
    else:
        if state.phase is not Phase.RUNNING:
            vs.append(_violation("scheduled_while_not_running", e, phase=state.phase.name))
            state = state._replace(phase=Phase.RUNNING, recompute_only=True)
        if e.num_computed > state.num_tokens:
            # vLLM counts tokens we never saw scheduled: our view has a hole.
            vs.append(
                _violation(
                    "tokens_match_schedule",
                    e,
                    num_computed=e.num_computed,
                    tracker_tokens=state.num_tokens,
                )
            )
        elif e.num_computed < state.num_tokens:
            # Rollback (failed load under the recompute policy, rejected draft tokens): vLLM
            # will recompute from num_computed, so forget what lies beyond it.
            state = _rollback(state, e.num_computed, config)
        if e.block_ids:
            state = state._replace(block_ids=state.block_ids.extended(e.block_ids))
        if e.token_ids:
            state, tv = _learn_tokens(state, e.token_start, e.token_ids, e, config)
            vs.extend(tv)
        state = state._replace(
            num_computed=e.num_computed, num_tokens=e.num_computed + e.num_scheduled
        )
    return state, tuple(vs)


def _rollback(state: RequestState, to: int, config: TrackerConfig) -> RequestState:
    c = config.chunk_size
    floor = to // c * c
    save = state.save
    if save.cursor > floor:
        save = SaveProgress(floor, save.pending)
    return state._replace(num_tokens=to, save=save)


def advance_decoded(state: RequestState, steps: int, blocks: Sequence[int] = ()) -> RequestState:
    """The state after ``steps`` steady single-token decode steps (``StepDecoded``) that
    appended ``blocks``: the same as folding that many ``Scheduled(num_computed=num_tokens,
    num_scheduled=1)`` events whose token ids are learned later, in bulk."""
    if steps <= 0:
        return state
    return state._replace(
        num_computed=state.num_tokens + steps - 1,
        num_tokens=state.num_tokens + steps,
        block_ids=state.block_ids.extended(blocks) if blocks else state.block_ids,
    )


def learn_decoded(
    state: RequestState, token: int, e: ev.Event, config: TrackerConfig
) -> RequestState:
    """The state after a recorder's steady step made ``token`` known (``StepDecoded.tokens``,
    tracker/recorded_steps.py): appended to the known ids, as its ``Scheduled`` would have."""
    return _learn_tokens(state, len(state.token_ids), (token,), e, config)[0]


_UNBOUNDED = 1 << 62


def steady_limit(state: RequestState, config: TrackerConfig) -> int:
    """The highest ``num_tokens`` that steady single-token decode steps (``StepDecoded``) may
    reach from this state, blocks aside: past it, a step needs a decision (a load still
    running, a save that may be due), so it must be a ``Scheduled``. -1 when no steady step
    is allowed at all. The block table's capacity is the other bound (``steady_decode``)."""
    if state.phase is not Phase.RUNNING or (state.load is not None and not state.load.done):
        return -1
    if state.recompute_only:
        return _UNBOUNDED  # no plans for it anyway
    limit = _UNBOUNDED
    c = config.chunk_size
    cursor = state.save.cursor
    next_chunk_end = (cursor // c + 1) * c
    if config.save_decode_cache or state.prefill_end >= next_chunk_end:
        limit = next_chunk_end - 1  # a full chunk could be saved: plan_save decides
    # The prefill's partial chunk may be due (whole, or its whole blocks: saved_tail_end).
    if cursor < config.saved_tail_end(state.prefill_end):
        limit = min(limit, state.prefill_end - 1)
    return limit


def steady_decode(
    state: RequestState, config: TrackerConfig, pending: int, pending_blocks: int = 0
) -> bool:
    """Whether one more single-token step of a running request (with ``pending`` steady steps
    and ``pending_blocks`` appended blocks not folded yet, this step's included) can be
    folded as ``StepDecoded``: within ``steady_limit`` and within the blocks (else
    ``tokens_within_blocks`` must judge it). The same bounds guard the connector's fast path
    and validate a recorded ``StepDecoded`` on replay."""
    after = state.num_tokens + pending + 1
    capacity = (len(state.block_ids) + pending_blocks) * config.block_size
    return after <= capacity and after <= steady_limit(state, config)


def _on_preempted(state: RequestState, e: ev.Preempted, config: TrackerConfig) -> Result:
    if state.phase is Phase.PREEMPTED:
        return state, _NONE  # told twice (signal, then inferred): same fact
    if state.phase is not Phase.RUNNING:
        return state, (_violation("preempted_while_not_running", e, phase=state.phase.name),)
    return _preempt(state), _NONE


def _on_finished(state: RequestState, e: ev.Finished, config: TrackerConfig) -> Result:
    life = state.life._replace(finish_reason=e.reason)
    return state._replace(phase=Phase.FINISHED, life=life, lookup=None), _NONE


def _on_load_planned(state: RequestState, e: ev.LoadPlanned, config: TrackerConfig) -> Result:
    if e.end <= e.start:
        return state._replace(load=None), _NONE
    life = state.life._replace(tokens_loaded=state.life.tokens_loaded + (e.end - e.start))
    return state._replace(load=LoadProgress(e.start, e.end, e.keys, False), life=life), _NONE


def _late_load_result(state: RequestState) -> bool:
    """A load result for a request with no load in flight whose earlier admission planned
    one: the result of a load revoked by a preemption. Under async scheduling it arrives one
    step late, after the preemption that revoked it; there is nothing left to apply."""
    return state.load is None and state.life.tokens_loaded > 0


def _on_load_done(state: RequestState, e: ev.LoadDone, config: TrackerConfig) -> Result:
    if _late_load_result(state):
        return state, _NONE
    if state.load is None:
        return state, (_violation("load_result_without_load", e),)
    return state._replace(load=state.load._replace(done=True)), _NONE


def _on_load_failed(state: RequestState, e: ev.LoadFailed, config: TrackerConfig) -> Result:
    if _late_load_result(state):
        return state, _NONE
    if state.load is None:
        return state, (_violation("load_result_without_load", e, blocks=len(e.block_ids)),)
    if state.load.done:
        # A failure after the load was confirmed contradicts that confirmation (each load
        # gets one result, all ranks together): the worker's word on this KV is not reliable.
        foreign = len(set(e.block_ids).difference(state.block_ids))
        return state, (_violation("load_result_twice", e, foreign_blocks=foreign),)
    # vLLM rolls back to the first failed block; saves planned from there on would store KV
    # computed over a wrong prefix, so the tracker cancels them (see Tracker).
    first = _first_failed_token(state, e.block_ids, config.block_size)
    state = state._replace(load=state.load._replace(done=True))
    if first is not None:
        state = _rollback(state, min(state.num_tokens, first), config)
    return state, _NONE


def _first_failed_token(state: RequestState, failed: Sequence[int], block_size: int) -> int | None:
    failed_set = set(failed)
    for i, block in enumerate(state.block_ids):
        if block in failed_set:
            return i * block_size
    return None


def _on_save_planned(state: RequestState, e: ev.SavePlanned, config: TrackerConfig) -> Result:
    save = state.save
    cursor = max(save.cursor, e.skip_to)
    pending = save.pending
    if e.keys:
        c = config.chunk_size
        starts = range(e.start, e.end, c)
        pending = pending + tuple(zip(e.keys, starts, strict=False))
        cursor = max(cursor, e.end)
        life = state.life._replace(tokens_saved=state.life.tokens_saved + (e.end - e.start))
        state = state._replace(life=life)
    return state._replace(save=SaveProgress(cursor, pending)), _NONE


def _on_save_result(
    state: RequestState, e: ev.SaveDone | ev.SaveFailed, config: TrackerConfig
) -> Result:
    done = set(e.keys)
    mine = {key for key, _ in state.save.pending}
    unknown = done - mine
    pending = tuple(p for p in state.save.pending if p[0] not in done)
    cursor = state.save.cursor
    if isinstance(e, ev.SaveFailed):
        failed_starts = [start for key, start in state.save.pending if key in done]
        if failed_starts and state.phase is Phase.RUNNING:
            cursor = min(cursor, min(failed_starts))  # replanned while the blocks hold the KV
    state = state._replace(save=SaveProgress(cursor, pending))
    if unknown:
        return state, (_violation("save_result_planned", e, unplanned=len(unknown)),)
    return state, _NONE


def _on_violation_recorded(
    state: RequestState, e: ev.ViolationRecorded, config: TrackerConfig
) -> Result:
    return state._replace(recompute_only=True), _NONE


_Handler = Callable[[Any, Any, TrackerConfig], Result]

# Event type -> handler. Events about the pool (ChunkStored, ChunkEvicted) change no request.
_HANDLERS: dict[type[ev.Event], _Handler] = {
    ev.RequestAdded: _on_request_added,
    ev.LookupAsked: _on_lookup_asked,
    ev.LookupAnswered: _on_lookup_answered,
    ev.Allocated: _on_allocated,
    ev.Scheduled: _on_scheduled,
    ev.Preempted: _on_preempted,
    ev.Finished: _on_finished,
    ev.LoadPlanned: _on_load_planned,
    ev.LoadDone: _on_load_done,
    ev.LoadFailed: _on_load_failed,
    ev.SavePlanned: _on_save_planned,
    ev.SaveDone: _on_save_result,
    ev.SaveFailed: _on_save_result,
    ev.ViolationRecorded: _on_violation_recorded,
}

# Results of work already in flight may arrive after the request finished; anything else
# about a finished request is a violation.
_AFTER_FINISH_OK = (ev.SaveDone, ev.SaveFailed, ev.LoadDone, ev.LoadFailed, ev.Finished)


def fold(state: RequestState | None, event: ev.Event, config: TrackerConfig) -> Result:
    """Apply one event to one request's state. Total: never raises for any event."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return state, _NONE
    if state is None and not isinstance(event, ev.RequestAdded):
        if isinstance(event, ev.Finished):
            # A request aborted before the connector ever saw it (no on_new_request on older
            # vLLM: connector/edge.py; LMCache #3337): nothing to forget, nothing wrong.
            return None, ()
        return None, (_violation("unknown_request", event),)
    if state is not None and state.phase is Phase.FINISHED:
        if not isinstance(event, (ev.RequestAdded, *_AFTER_FINISH_OK)):
            return state, (_violation("event_after_finish", event),)
        if isinstance(event, ev.Finished):
            return state, (_violation("finished_twice", event),)
    try:
        return handler(state, event, config)
    except Exception as exc:
        return state, (_violation("fold_error", event, error=f"{type(exc).__name__}: {exc}"),)
