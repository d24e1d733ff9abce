"""The rules any connector must keep, judged on a recorder's log (connector/recorder.py).

Pure: events in, violations out; no I/O. A recorder's log holds vLLM's facts (``RequestAdded``,
``LookupAsked``, ``Allocated``, ``Scheduled``, ``Preempted``, ``Finished``) and the wrapped
connector's answers (``InnerLookupAnswered``, ``InnerFinishedAnswered``, ``InnerSendDone``,
``InnerRecvDone``, ``InnerLoadErrors``). :class:`RecordedRules` walks them once, in log order,
keeping per request only what the rules need, and names every broken rule with the request,
the step and the numbers involved.

The rules, each judged only on what the log shows (a connector's private state is not in it):

- ``lookup_unstable``: asked again with the same tokens and the same local hit while nothing
  it could depend on changed (no forward pass ran, no transfer result came back, no request
  finished or was allocated), the connector answered differently. vLLM asks a waiting request
  again every step; the answer must be a function of the facts.
- ``accepted_beyond_offer``: vLLM's ``update_state_after_alloc`` counts more external tokens
  than the connector's last answer offered (or it answered ``None``).
- ``accepted_beyond_allocation``: the local hit plus the external tokens exceed the blocks
  vLLM allocated: the load would write past the request's block table.
- ``full_hit_no_last_token``: the connector offered every token of the request (local hit plus
  external equals the token count): vLLM must compute at least the last token to sample.
- ``load_not_finished``: an asynchronous load's request computed before the worker reported it
  in ``finished_recving``; or a load error about the blocks of a synchronous load arrived after
  the request had computed past them (at its second later step: one step of slack for async
  scheduling, whose output of a step arrives after the next one was scheduled).
- ``load_during_save``: a load was issued for a request id whose saves are still in flight (its
  ``request_finished`` kept the blocks and no ``finished_sending`` named it yet) -- the
  OffloadingConnector crash of vLLM issue #46014, as far as the API shows it.
- ``freed_while_saving``: a block kept for a save in flight appears in another request's block
  table before ``finished_sending`` named the save's request; or ``finished_sending`` names a
  request whose ``request_finished`` let vLLM free its blocks at once (the save was reading
  blocks vLLM had already given away).
- ``readmission_cached_below_external``: at a (re-)admission with external tokens, vLLM's
  computed-token count is below what it accepted from the connector (vLLM PR #36752).
- ``stale_completion``: ``finished_sending`` names a request id whose current life has no save
  in flight (it is still running, or its save already completed), or ``finished_recving`` one
  with no asynchronous load outstanding. vLLM's API allows a finished send only for a request
  whose ``request_finished`` kept its blocks, and a finished receive only for an asynchronous
  load it accepted; anything else is a completion of another life of the id (vLLM #51637:
  store-job accounting keyed by a reused request id). vLLM 0.33 asserts on it; an older vLLM
  frees the blocks of whatever request holds the id now. Judged only for ids this log saw.
- ``finished_without_blocks``: ``request_finished`` came with an empty block list for a request
  that computed tokens and was not aborted, and the connector handed its KV off anyway
  (returned ``kv_transfer_params``): the hand-off names no block holding that KV (vLLM #50297:
  a prefill preempted in its last step under async scheduling still completes). A best-effort
  cache that returns no parameters is not judged: vLLM lets such a request finish without its
  blocks by design (``requires_kv_delivery`` False), and a dropped save is only a future miss.
- ``connector_raised``: a scheduler-side callback of the connector raised (recorded as
  ``InnerRaised``): vLLM's engine core does not survive it.
- ``stored_not_offered``: the connector's own KV events (``InnerStored``, ``InnerRemoved``:
  tracker/inner_store.py) say it stored the request's tokens up to ``k`` as whole keys and
  still held every one of them, yet it offered less than ``k`` (vLLM's local hit plus its
  answer): a silently shortened hit, named with the store that proves it. ``k`` stops short of
  the request's last token (vLLM computes that one). Judged only once the connector has
  published a removal in this log: one that never publishes removals may have dropped a key
  without saying so. Lookups whose tokens the log does not hold in full (a resumed request's
  output, recorded step by step) are not judged.

``digest_mismatch`` and ``load_unchanged`` are the digests' (tracker/digests.py), folded by the
Tracker from ``BlockDigested``/``LoadDigested``.

Every event is first asked what it says that is impossible (``tracker.wellformed``: a
negative count, lengths that do not pair up, ...); such an event is named by those rules and
judged by none of the rules above, which would only draw conclusions from it.

A recorder's ``StepDecoded`` (its steady decode steps, tracker/recorded_steps.py) is judged as
the ``Scheduled`` events it stands for: :meth:`RecordedRules.apply` expands it, so every rule
sees the same events whether the recorder batched those steps or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.tracker import events as ev
from kvledger.tracker.inner_store import InnerStore
from kvledger.tracker.recorded_steps import RecordedSteps
from kvledger.tracker.violation import Violation
from kvledger.tracker.wellformed import Wellformed

__all__ = ["RECORDED_RULES", "RecordedRules", "check_recorded"]

RECORDED_RULES: dict[str, str] = {
    "lookup_unstable": "the same lookup, nothing changed, a different answer",
    "accepted_beyond_offer": "vLLM accepted more external tokens than the connector offered",
    "accepted_beyond_allocation": "local hit plus external tokens exceed the allocated blocks",
    "full_hit_no_last_token": "the connector offered every token: none left to compute",
    "load_not_finished": "the request computed past a load not reported finished or failed",
    "load_during_save": "a load issued while saves of the same request are in flight (#46014)",
    "freed_while_saving": "blocks freed (or reused) while a save still reads them",
    "readmission_cached_below_external": "re-admitted with fewer computed tokens than accepted",
    "stale_completion": "a transfer completion for a request id with none outstanding (#51637)",
    "finished_without_blocks": "a hand-off of a request finished with no blocks (#50297)",
    "connector_raised": "a scheduler-side callback of the connector raised",
    "stored_not_offered": "the connector's KV events say it held more than it offered",
}


class _Req:
    """What the rules keep about one live request."""

    __slots__ = (
        "accepted",
        "ask",
        "ask_epoch",
        "asked",
        "async_load",
        "computed",
        "earlier_finish",
        "external",
        "finish_reason",
        "load_blocks",
        "load_steps",
        "preempted",
        "prompt",
        "tokens",
        "waiting_recv",
    )

    def __init__(self) -> None:
        self.ask: tuple[int, int] | None = None  # (num_tokens, local_hit) of the last ask
        self.ask_epoch = -1  # the world's epoch at that ask
        self.asked: LookupSeen | None = None  # the last ask and its answer
        self.external: int | None = None  # the last answer's external tokens (None: None)
        self.async_load = False  # the last answer's load_async
        self.waiting_recv = False  # an async load accepted, no finished_recving yet
        self.prompt: tuple[int, ...] = ()
        # The last ask's tokens, where the log holds them all and the connector publishes
        # what it stores (stored_not_offered); else None.
        self.tokens: tuple[int, ...] | None = None
        self.load_blocks: frozenset[int] = frozenset()  # blocks of the last sync load
        self.load_steps = -1  # Scheduled steps since that load's admission (-1: none)
        self.preempted = False
        self.accepted = 0  # external tokens of the allocation not yet seen scheduled
        self.computed = False  # vLLM scheduled tokens of this life (a preemption keeps it)
        self.finish_reason = ""  # the Finished record's reason, until the inner's answer
        self.earlier_finish = -1  # the step an earlier life of the id finished (-1: none)


class LookupSeen:
    __slots__ = ("answer", "local_hit", "num_tokens", "step")

    def __init__(self, step: int, local_hit: int, num_tokens: int) -> None:
        self.step = step
        self.local_hit = local_hit
        self.num_tokens = num_tokens
        self.answer: tuple[int, bool] | None = None


class RecordedRules:
    """Feed a recorder's events in log order (:meth:`apply`); each call returns the violations
    that event reveals."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._reqs: dict[str, _Req] = {}
        # Bumped by anything a lookup answer may depend on: a forward pass, a transfer result,
        # a finished or allocated request.
        self._epoch = 0
        # Saves in flight of finished requests: req id -> blocks vLLM keeps for them.
        self._saving: dict[str, frozenset[int]] = {}
        # Finished requests whose blocks vLLM freed at once (delay False), for the late
        # finished_sending; bounded by forgetting at the next RequestAdded of the id.
        self._freed: set[str] = set()
        # Accepted asynchronous loads not yet reported in finished_recving (a request aborted
        # while loading still gets its report).
        self._recv_pending: set[str] = set()
        # Request ids finished in this log -> the step (moved into the next life of the id at
        # its RequestAdded): a completion for an id the log never saw is not judged.
        self._finished_at: dict[str, int] = {}
        # Ids a RecordLost named: the record that would explain a completion may be the lost one.
        self._lost: set[str] = set()
        self.counts = {"lookups": 0, "loads": 0, "async_loads": 0}
        self._wellformed = Wellformed()
        # What a StepDecoded leaves out, to judge it as the Scheduled events it stands for.
        self._steps = RecordedSteps()
        # What the connector says it stored and dropped (its KV events).
        self.inner_store = InnerStore()

    # --- the walk -----------------------------------------------------------------------

    def apply(self, e: ev.Event) -> list[Violation]:
        """The violations of ``e`` (:meth:`judge`'s, all together)."""
        return [v for _, found in self.judge(e) for v in found]

    def judge(self, e: ev.Event) -> list[tuple[ev.Event, list[Violation]]]:
        """``e`` judged, as the one reading of a recorder's log: first what it says that is
        impossible (``tracker.wellformed``, the Tracker's rule names), then the rules. A
        ``StepDecoded`` is judged as the ``Scheduled`` events it stands for, each with its
        own violations after the record's (an entry that stands for none is named on the
        record). A malformed ``StepDecoded`` advances no request, as in the Tracker; any other
        malformed event is still followed (it is a fact about its request's number)."""
        found = self._wellformed.check(e)
        if e.__class__ is ev.StepDecoded:
            assert isinstance(e, ev.StepDecoded)
            if found:
                return [(e, found)]
            scheduled, bad = self._steps.expand(e)
            on_scheduled = _HANDLERS[ev.Scheduled]
            return [(e, bad)] + [(s, on_scheduled(self, s)) for s in scheduled]
        self._steps.follow(e)
        if found:
            return [(e, found)]
        handler = _HANDLERS.get(e.__class__)
        return [(e, handler(self, e) if handler is not None else [])]

    def _req(self, req_id: str) -> _Req:
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Req()
        return r

    def _added(self, e: ev.RequestAdded) -> list[Violation]:
        r = self._reqs[e.req_id] = _Req()
        r.prompt = e.prompt_token_ids
        r.earlier_finish = self._finished_at.pop(e.req_id, -1)
        self._freed.discard(e.req_id)
        return []

    def _asked(self, e: ev.LookupAsked) -> list[Violation]:
        r = self._req(e.req_id)
        r.asked = LookupSeen(e.step, e.local_hit, e.num_tokens)
        r.tokens = None
        if self.inner_store.with_tokens and e.token_start <= len(r.prompt):
            r.tokens = r.prompt[: e.token_start] + e.token_ids
        return []

    def _answered(self, e: ev.InnerLookupAnswered) -> list[Violation]:
        self.counts["lookups"] += 1
        r = self._req(e.req_id)
        seen = r.asked
        out: list[Violation] = []
        answer = (e.external, e.load_async)
        if seen is None:
            return out
        ask = (seen.num_tokens, seen.local_hit)
        if r.ask == ask and r.ask_epoch == self._epoch and r.external is not None:
            before = (r.external, r.async_load)
            if e.external >= 0 and before != answer:
                out.append(
                    Violation(
                        "lookup_unstable",
                        e.step,
                        e.req_id,
                        "InnerLookupAnswered",
                        {
                            "num_tokens": seen.num_tokens,
                            "local_hit": seen.local_hit,
                            "before": before[0],
                            "before_async": before[1],
                            "now": e.external,
                            "now_async": e.load_async,
                        },
                    )
                )
        if e.external >= 0 and seen.local_hit + e.external >= seen.num_tokens > 0:
            out.append(
                Violation(
                    "full_hit_no_last_token",
                    e.step,
                    e.req_id,
                    "InnerLookupAnswered",
                    {
                        "num_tokens": seen.num_tokens,
                        "local_hit": seen.local_hit,
                        "external": e.external,
                    },
                )
            )
        if e.external >= 0 and r.tokens is not None and self.inner_store.removals:
            out += self._shortened(e, seen, r.tokens)
        seen.answer = answer
        r.ask, r.ask_epoch = ask, self._epoch
        r.external = None if e.external < 0 else e.external
        r.async_load = e.load_async
        return out

    def _shortened(
        self, e: ev.InnerLookupAnswered, seen: LookupSeen, tokens: tuple[int, ...]
    ) -> list[Violation]:
        """stored_not_offered: the connector held whole keys past what it offered."""
        offered = seen.local_hit + e.external
        held = self.inner_store.held_whole(tokens[: seen.num_tokens], seen.num_tokens - 1)
        if held is None or held.end <= offered:
            return []
        detail = {
            "num_tokens": seen.num_tokens,
            "local_hit": seen.local_hit,
            "external": e.external,
            "held": held.end,
            "stored_at": held.stored,
        }
        return [Violation("stored_not_offered", e.step, e.req_id, "InnerLookupAnswered", detail)]

    def _inner_event(self, e: ev.Event) -> list[Violation]:
        self.inner_store.apply(e)
        return []

    def _allocated(self, e: ev.Allocated) -> list[Violation]:
        self._epoch += 1
        r = self._req(e.req_id)
        out: list[Violation] = []
        n = e.num_external
        if n <= 0:
            return out
        self.counts["loads"] += 1
        offered = r.external
        if offered is None or n > offered:
            out.append(
                Violation(
                    "accepted_beyond_offer",
                    e.step,
                    e.req_id,
                    "Allocated",
                    {"accepted": n, "offered": "None" if offered is None else offered},
                )
            )
        local = r.asked.local_hit if r.asked is not None else 0
        capacity = len(e.block_ids) * self.block_size
        if local + n > capacity:
            out.append(
                Violation(
                    "accepted_beyond_allocation",
                    e.step,
                    e.req_id,
                    "Allocated",
                    {"local_hit": local, "accepted": n, "allocated_tokens": capacity},
                )
            )
        if e.req_id in self._saving:
            out.append(
                Violation(
                    "load_during_save",
                    e.step,
                    e.req_id,
                    "Allocated",
                    {"accepted": n, "saving_blocks": len(self._saving[e.req_id])},
                )
            )
        first = local // self.block_size
        last = -(-(local + n) // self.block_size)
        blocks = frozenset(e.block_ids[first:last])
        if r.async_load:
            self.counts["async_loads"] += 1
            r.waiting_recv = True
            self._recv_pending.add(e.req_id)
        else:
            r.load_blocks = blocks
            r.load_steps = 0
        out += self._reused(e, e.block_ids)
        r.accepted = n
        return out

    def _reused(self, e: ev.Event, block_ids: tuple[int, ...]) -> list[Violation]:
        if not self._saving:
            return []
        out: list[Violation] = []
        mine = set(block_ids)
        for owner, kept in self._saving.items():
            if owner != e.req_id and kept & mine:
                out.append(
                    Violation(
                        "freed_while_saving",
                        e.step,
                        e.req_id,
                        type(e).__name__,
                        {"saving": owner, "blocks": ",".join(map(str, sorted(kept & mine)))},
                    )
                )
        return out

    def _scheduled(self, e: ev.Scheduled) -> list[Violation]:
        r = self._req(e.req_id)
        if e.num_scheduled > 0:
            self._epoch += 1
            r.computed = True
        out: list[Violation] = []
        if r.waiting_recv and e.num_scheduled > 0:
            out.append(
                Violation(
                    "load_not_finished",
                    e.step,
                    e.req_id,
                    "Scheduled",
                    {"load": "async", "num_computed": e.num_computed},
                )
            )
            r.waiting_recv = False
        accepted = r.accepted
        if e.admission is not ev.Admission.RUNNING and accepted > 0:
            if e.num_computed < accepted:
                out.append(
                    Violation(
                        "readmission_cached_below_external",
                        e.step,
                        e.req_id,
                        "Scheduled",
                        {"num_computed": e.num_computed, "accepted": accepted},
                    )
                )
            r.accepted = 0
        elif r.load_steps >= 0:
            r.load_steps += 1
        if e.admission is not ev.Admission.RUNNING:
            out += self._reused(e, e.block_ids)
        return out

    def _preempted(self, e: ev.Preempted) -> list[Violation]:
        self._epoch += 1
        r = self._req(e.req_id)
        r.preempted = True
        r.load_steps = -1
        r.load_blocks = frozenset()
        return []

    def _finished(self, e: ev.Finished) -> list[Violation]:
        self._epoch += 1
        self._req(e.req_id).finish_reason = e.reason
        return []

    def _finished_answer(self, e: ev.InnerFinishedAnswered) -> list[Violation]:
        r = self._reqs.pop(e.req_id, None)
        self._finished_at[e.req_id] = e.step
        if e.delay:
            self._saving[e.req_id] = frozenset(e.block_ids)
        else:
            self._freed.add(e.req_id)
        if (
            r is not None
            and r.computed
            and not e.block_ids
            and e.params
            and "abort" not in r.finish_reason
            and e.req_id not in self._lost
        ):
            return [
                Violation(
                    "finished_without_blocks",
                    e.step,
                    e.req_id,
                    "InnerFinishedAnswered",
                    {
                        "reason": r.finish_reason or "?",
                        "preempted": r.preempted,
                        "params": e.params.replace(",", " "),
                    },
                )
            ]
        return []

    def _send_done(self, e: ev.InnerSendDone) -> list[Violation]:
        self._epoch += 1
        if self._saving.pop(e.req_id, None) is not None:
            return []
        if e.req_id in self._freed:
            self._freed.discard(e.req_id)
            return [
                Violation(
                    "freed_while_saving",
                    e.step,
                    e.req_id,
                    "InnerSendDone",
                    {"request_finished": "delay=False"},
                )
            ]
        return self._stale(e, "finished_sending")

    def _recv_done(self, e: ev.InnerRecvDone) -> list[Violation]:
        self._epoch += 1
        r = self._reqs.get(e.req_id)
        if r is not None:
            r.waiting_recv = False
        if e.req_id in self._recv_pending:
            self._recv_pending.discard(e.req_id)
            return []
        return self._stale(e, "finished_recving")

    def _stale(self, e: ev.Event, completion: str) -> list[Violation]:
        """A completion with nothing outstanding for it: say which life of the id it reached."""
        if e.req_id in self._lost:
            return []
        r = self._reqs.get(e.req_id)
        if r is not None:
            now = "running (request_finished not called)"
            earlier = r.earlier_finish
        elif e.req_id in self._finished_at:
            now = f"finished at step {self._finished_at[e.req_id]}, nothing outstanding"
            earlier = -1
        else:
            return []  # an id this log never saw (it began later): not judged
        detail: dict[str, Any] = {"completion": completion, "request": now}
        if earlier >= 0:
            detail["earlier_life_finished"] = earlier
        return [Violation("stale_completion", e.step, e.req_id, type(e).__name__, detail)]

    def _raised(self, e: ev.InnerRaised) -> list[Violation]:
        return [
            Violation(
                "connector_raised",
                e.step,
                e.req_id,
                "InnerRaised",
                {"callback": e.callback, "error": e.error.replace(",", ";")[:200]},
            )
        ]

    def _record_lost(self, e: ev.RecordLost) -> list[Violation]:
        if e.req_id:
            self._lost.add(e.req_id)
        return []

    def _load_errors(self, e: ev.InnerLoadErrors) -> list[Violation]:
        self._epoch += 1
        bad = set(e.block_ids)
        out: list[Violation] = []
        for req_id, r in self._reqs.items():
            if r.load_steps >= 2 and r.load_blocks & bad:
                out.append(
                    Violation(
                        "load_not_finished",
                        e.step,
                        req_id,
                        "InnerLoadErrors",
                        {
                            "load": "sync",
                            "late_by_steps": r.load_steps,
                            "blocks": ",".join(map(str, sorted(r.load_blocks & bad))),
                        },
                    )
                )
                r.load_blocks = frozenset()
        return out


_HANDLERS: dict[type[ev.Event], Callable[[RecordedRules, Any], list[Violation]]] = {
    ev.RequestAdded: RecordedRules._added,
    ev.LookupAsked: RecordedRules._asked,
    ev.InnerLookupAnswered: RecordedRules._answered,
    ev.Allocated: RecordedRules._allocated,
    ev.Scheduled: RecordedRules._scheduled,
    ev.Preempted: RecordedRules._preempted,
    ev.Finished: RecordedRules._finished,
    ev.InnerFinishedAnswered: RecordedRules._finished_answer,
    ev.InnerSendDone: RecordedRules._send_done,
    ev.InnerRecvDone: RecordedRules._recv_done,
    ev.InnerLoadErrors: RecordedRules._load_errors,
    ev.InnerRaised: RecordedRules._raised,
    ev.RecordLost: RecordedRules._record_lost,
    ev.InnerStored: RecordedRules._inner_event,
    ev.InnerRemoved: RecordedRules._inner_event,
}


def check_recorded(events: Any, block_size: int) -> list[Violation]:
    """Every violation in a sequence of recorded events (tests, small logs)."""
    rules = RecordedRules(block_size)
    out: list[Violation] = []
    for e in events:
        out += rules.apply(e)
    return out
