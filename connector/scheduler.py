"""The scheduler side: vLLM's callbacks in, tracker events out, plans to the worker.

This module does not import vLLM. It reads vLLM's objects by duck typing (the field names
listed in docs/using-with-vllm.md), copies the facts it needs at the moment of the callback,
and hands them to the tracker. It keeps one reference to each live vLLM ``Request``, and reads
exactly one thing from it: ``all_token_ids`` during ``build_connector_meta``, copying only the
tail the tracker does not know. Counts (``num_computed_tokens``) always come from the
``SchedulerOutput`` of the step, never from the mutable request.

Nothing here may crash the engine: an unexpected object shape is recorded as a violation for
the request concerned, logged, and the request falls back to recompute.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

import attrs

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.logfile import open_log
from kvledger.connector.logsafe import safe_logger
from kvledger.connector.messages import StepPlan, TransferPlan, WorkerReport
from kvledger.connector.metrics import Counters
from kvledger.connector.pool_events import PoolEvent, PoolEvents
from kvledger.connector.tiers import UNAVAILABLE, Tier, down_reason, open_tier, serving
from kvledger.tracker import events as ev
from kvledger.tracker.codec import describe_exception, escaped
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import DIGEST_LOSS, DigestPlanner
from kvledger.tracker.plans import blocks_covering, transfer_plan
from kvledger.tracker.remote import lookup_keys
from kvledger.tracker.tracker import Tracker

__all__ = ["SchedulerSide", "carries_reports", "first_group", "status_name"]

_log = safe_logger("kvledger.connector")
# The Tracker's violations and log failures, under the name they always had.
_violations = safe_logger("kvledger")
T = TypeVar("T")


class _Ack:
    """Which ranks reported a transfer done or failed; forgotten once all ranks reported."""

    __slots__ = ("done", "failed")

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.failed: set[int] = set()

    def settle(self, table: dict[Any, _Ack], key: Any, world: int) -> None:
        if len(self.done | self.failed) >= world:
            del table[key]


def first_group(block_ids: Any) -> tuple[int, ...]:
    """Block ids of KV-cache group 0, from any shape vLLM has used: ``tuple[list[int], ...]``,
    a flat list, a ``KVCacheBlocks`` (``get_block_ids()``), or None (no new blocks)."""
    if block_ids is None:
        return ()
    getter = getattr(block_ids, "get_block_ids", None)
    if getter is not None:
        block_ids = getter()
    if (
        isinstance(block_ids, (tuple, list))
        and block_ids
        and isinstance(block_ids[0], (list, tuple))
    ):
        return tuple(block_ids[0])
    return tuple(block_ids)


def carries_reports(connector_output: Any) -> bool:
    """Whether vLLM's ``KVConnectorOutput`` has where our worker's reports ride: the worker
    metadata, or, on a vLLM without it, the connector stats (what
    ``SchedulerSide._reports_of`` reads). Most steps it has neither: nothing to apply."""
    return (
        getattr(connector_output, "kv_connector_worker_meta", None) is not None
        or getattr(connector_output, "kv_connector_stats", None) is not None
    )


def resumed_markers(cached: Any) -> tuple[Any, Any]:
    """How vLLM's ``CachedRequestData`` says which requests resumed from preemption: a set of
    ids (``resumed_req_ids``), or, in the releases before it, a flag per position
    (``resumed_from_preemption``); (ids, None) or (None, flags or None)."""
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    if resumed_ids is not None:
        return resumed_ids, None
    return None, getattr(cached, "resumed_from_preemption", None)


# A steady step counted as a batch (Tracker.decode_batch): the positions that take the full
# path, the numbers counted and their (number, block) pairs.
_Batch = tuple[list[int], Sequence[int], list[tuple[int, int]]]


def _guarded(default: Callable[[], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Never let bookkeeping crash the engine: log, count, return a safe default.

    Strict mode (tests) re-raises so that a bug is seen at once.
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(self: SchedulerSide, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self._adapter_error(fn.__name__, exc)
                return default()

        return inner

    return wrap


def _free_now() -> tuple[bool, dict[str, Any] | None]:
    """``request_finished``'s safe answer: vLLM may free the blocks at once."""
    return False, None


def status_name(request: Any) -> str:
    """A request's status in lower case (``preempted``, ``finished_aborted``...): an enum
    member's name, or what the object holds."""
    status = getattr(request, "status", None)
    return str(getattr(status, "name", status) or "").lower()


# Reads one entry of a report field whole: (request id, its items), or raises.
_Reader = Callable[[Any], tuple[str, tuple[Any, ...]]]


def _read_req_id(entry: Any) -> tuple[str, tuple[()]]:
    """A ``loads_done`` entry: the request id alone."""
    if not isinstance(entry, str):
        raise TypeError(f"expected a request id, got {entry!r}")
    return entry, ()


def _read_pair(entry: Any) -> tuple[str, tuple[Any, ...]]:
    req_id, items = entry
    if not isinstance(req_id, str):
        raise TypeError(f"expected a request id, got {req_id!r}")
    if isinstance(items, (str, bytes)) or not isinstance(items, (tuple, list)):
        raise TypeError(f"expected a sequence for {req_id!r}, got {items!r}")
    return req_id, tuple(items)


def _read_keys(entry: Any) -> tuple[str, tuple[bytes, ...]]:
    """A ``saves_done``/``saves_failed`` entry: (request id, chunk keys), checked whole."""
    req_id, keys = _read_pair(entry)
    if not all(isinstance(k, bytes) for k in keys):
        raise TypeError(f"chunk keys of {req_id!r} must be bytes, got {keys!r}")
    return req_id, keys


def _read_blocks(entry: Any) -> tuple[str, tuple[int, ...]]:
    """A ``loads_failed`` entry: (request id, block ids), checked whole."""
    req_id, blocks = _read_pair(entry)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise TypeError(f"block ids of {req_id!r} must be ints, got {blocks!r}")
    return req_id, blocks


def _named_req_id(entry: Any) -> str | None:
    """The request an unreadable entry still names, if any."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and entry and isinstance(entry[0], str):
        return entry[0]
    return None


class SchedulerSide:
    """Owns the Tracker; one instance per engine, called on the engine-core thread."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        block_size: int,
        num_slots: int,
        salt: str = "",
        world_size: int = 1,
        max_async_lag: int = 1,
        log_header: dict[str, Any] | None = None,
        logger: Any = None,
        kv_events: bool = False,
    ) -> None:
        config.check_block_size(block_size)
        self.config = config
        self.tracker_config = TrackerConfig(
            block_size=block_size,
            chunk_size=config.chunk_size,
            num_slots=num_slots,
            discard_partial_chunks=config.discard_partial_chunks,
            save_decode_cache=config.save_decode_cache,
            block_hits=config.block_hits,
            salt=salt,
            max_async_lag=max_async_lag,
            strict=config.strict,
        )
        # The documented policy (docs/using-with-vllm.md, connector/logfile.py): a log_dir
        # that cannot be written costs the log, said loudly, unless the log is required.
        writer, self.log_path, log_error = open_log(
            config,
            {**self.tracker_config.to_dict(), **(log_header or {})},
            kind="connector",
            logger=logger,
        )
        # The core writes nowhere; the connector wants its violations said (tracker/tracker.py).
        self.tracker = Tracker(
            self.tracker_config, log=writer, logger=logger if logger is not None else _violations
        )
        if log_error is not None:
            self.tracker.log_error = log_error
        self.adapter_errors = 0
        # Running totals for vLLM's connector metrics (connector/metrics.py).
        self.counters = Counters()
        # Whether anything a metric reads may have changed since metrics() last looked: set by
        # every callback but a steady step's, so that vLLM's question after each steady step
        # costs one attribute (missed, a change is only reported a step later: since() sends
        # what changed since the last report).
        self._moved = True
        # What the loads were for: resumed requests, and hits covering the whole prompt.
        self.load_stats = {"tokens_loaded_on_resume": 0, "full_hits": 0}
        self._requests: dict[str, Any] = {}
        self._delayed_free: list[str] = []
        self._allocated_this_step: set[str] = set()
        # Allocations of requests the tracker does not know: external tokens vLLM counts as
        # loaded, refused in this step's plan (vLLM schedules a sync-load admission in the
        # step that allocates it). Emptied at every step's end.
        self._unlooked: dict[str, int] = {}
        self._unlooked_refused: list[int] = []
        # Worker ranks that must confirm every transfer (tensor x pipeline parallel size).
        self.world_size = max(1, int(world_size))
        self._save_acks: dict[tuple[str, bytes], _Ack] = {}
        self._load_acks: dict[str, _Ack] = {}
        # The remote tier (connector/tiers.py: Redis, or any registered Tier): every answer it
        # gives is recorded as a fact before the tracker counts on it; a write counts once
        # every rank confirmed it.
        # KV-content digests (tracker/digests.py): which blocks the worker digests each step.
        self.digests: DigestPlanner | None = None
        if config.digests != "off":
            self.digests = DigestPlanner(block_size)
        # KV events for the pool (connector/pool_events.py), only when vLLM publishes KV cache
        # events: otherwise nothing is described and the index has no watcher.
        self.pool_events: PoolEvents | None = None
        if kv_events:
            self.pool_events = PoolEvents(block_size, num_slots)
            self.tracker.index.watch = self.pool_events.pool_changed
        self._remote_down = False
        self._remote_acks: dict[bytes, _Ack] = {}
        self.remote: Tier | None = open_tier(config, scheduler=True)
        if self.remote is not None:
            # A tier that refuses the configuration (a server refusing the credentials, say)
            # raises ConnectorConfigError; one down is an outage, recorded.
            down = self.remote.check(startup=True)
            if down is not None:
                self._remote_outage(down)

    # --- callbacks ------------------------------------------------------------------------

    @_guarded(lambda: None)
    def on_new_request(self, request: Any) -> None:
        self._moved = True
        self._see(request)

    def _see(self, request: Any) -> str:
        req_id = str(request.request_id)
        if req_id not in self._requests or self._requests[req_id] is not request:
            self._requests[req_id] = request
            prompt = getattr(request, "prompt_token_ids", None) or ()
            salt = getattr(request, "cache_salt", None) or ""
            self.tracker.add_request(req_id, prompt, str(salt))
            if self.digests is not None:
                self.digests.added(req_id, str(salt))
        return req_id

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Pure with respect to the pool: asked again, answers the same."""
        self._moved = True
        return self._lookup(request, num_computed_tokens)

    @_guarded(lambda: (0, False))
    def _lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = self._see(request)
        if self.remote is not None:
            self._ask_remote(req_id, request.all_token_ids)
        external = self.tracker.lookup(
            req_id,
            int(num_computed_tokens),
            request.all_token_ids,
            preempted=status_name(request) == "preempted",
        )
        self.counters.lookups += 1
        self.counters.hit_tokens += external
        return external, False

    def _ask_remote(self, req_id: str, all_token_ids: Any) -> None:
        """Ask the remote tier which of the chunks the host pool misses it holds, and record
        the answer (``RemoteFound``) for the lookup to count on. Bounded by
        ``remote_lookup_timeout_ms``; while the tier is down (backing off) nothing is asked
        and nothing remote is offered."""
        assert self.remote is not None
        state = self.tracker.state(req_id)
        if state is None or not serving(self.remote):
            return
        c = self.tracker_config.chunk_size
        keys = lookup_keys(state, all_token_ids, len(all_token_ids), c)
        local = self.tracker.index.prefix_hit(keys)
        ask = tuple(keys[local:])
        if not ask:
            return
        try:
            found = tuple(self.remote.exists(ask))
        except Exception as exc:  # the tier's boundary: TierUnavailable, or unforeseen
            self._remote_outage(self._remote_error(exc))
            return
        self._remote_back()
        self.tracker.apply(ev.RemoteFound(self.tracker.step, req_id, ask, found))

    def _probe_remote(self) -> None:
        """Once per step while the tier is down, when its back-off allows: one bounded
        ``check`` (Redis: a PING), so that the tier comes back even when no lookup needs it."""
        assert self.remote is not None
        if not serving(self.remote):
            return
        try:
            down = self.remote.check()  # refused credentials, now, are an outage like any
        except Exception as exc:  # the tier's boundary: nothing unforeseen reaches vLLM
            down = self._remote_error(exc)
        if down is None:
            self._remote_back()

    def _remote_error(self, exc: Exception) -> str:
        assert self.remote is not None
        return down_reason(self.remote, exc)

    def _remote_back(self) -> None:
        if self._remote_down:
            self._remote_down = False
            self.tracker.apply(ev.RemoteRestored(self.tracker.step, ""))
            _log.warning("kvledger.remote_restored")

    def _remote_outage(self, error: str) -> None:
        """The tier stopped answering: recorded once, until a lookup gets an answer."""
        if self._remote_down:
            return
        self._remote_down = True
        self.tracker.apply(ev.RemoteOutage(self.tracker.step, "", error))
        _log.warning("kvledger.remote_outage", error=error)

    @_guarded(lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and counts ``num_external_tokens`` as ours to
        load. A request the tracker does not know (never added, or already retired) is not
        taken in here: the tracker records ``unknown_request`` and keeps nothing, and the
        external tokens, which nobody looked up, are refused when vLLM schedules it."""
        self._moved = True
        req_id = str(request.request_id)
        num_external = int(num_external_tokens)
        block_ids = first_group(blocks)
        if self.tracker.state(req_id) is None:
            self.tracker.allocated(req_id, block_ids, num_external)  # recorded; nothing kept
            if num_external > 0:
                self._unlooked[req_id] = num_external
            return
        self._see(request)
        self._allocated_this_step.add(req_id)
        self.tracker.allocated(req_id, block_ids, num_external)
        if self.digests is not None:
            self.digests.allocated(req_id, block_ids, num_external)  # our loads are synchronous

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """Fold the step into the tracker and return the worker's plan. Whatever fails, the
        decisions already made are still planned (a load vLLM already counts must run or be
        refused), and admissions that could not be processed are refused."""
        tracker = self.tracker
        step = tracker.step
        if self._remote_down:
            self._probe_remote()
        decisions: list[ev.DecisionEvent] = []
        preempted: tuple[str, ...] = ()
        # The running requests counted as a batch (_steady_batch); None: one by one, the steady
        # ones numbered into ``steady`` and ``grown`` (_cached_requests).
        batch: _Batch | None = None
        steady: list[int] = []
        grown: list[tuple[int, int]] = []
        full = 0  # requests that took the full path
        try:
            listed = getattr(scheduler_output, "preempted_req_ids", None)
            preempted = tuple(sorted(listed)) if listed else ()
            for req_id in preempted:
                tracker.preempted(req_id)
            if scheduler_output.scheduled_new_reqs:
                for req_id, read in self._new_requests(scheduler_output):
                    full += 1
                    decisions += self._scheduled_one(req_id, read)
            batch = self._steady_batch(scheduler_output)
            # A decode step, every request steady, ends here: no request takes the full path.
            if batch is None or batch[0]:
                for req_id, read in self._cached_requests(scheduler_output, batch, steady, grown):
                    full += 1
                    decisions += self._scheduled_one(req_id, read)
        except Exception as exc:
            self._adapter_error("build_connector_meta", exc)
        if batch is not None:
            tracker.record_decoded(batch[1], batch[2])
        else:
            tracker.decoded(steady, grown)
        if full or preempted or batch is None:
            self._moved = True
        plan = self._plan(step, decisions, preempted)
        if self.digests is not None:
            plan = plan._replace(digests=self._plan_digests(step, scheduler_output, preempted))
        tracker.end_step()
        return plan

    def _new_requests(self, out: Any) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
        """(req id, a reader of its facts) per new request. Reading happens inside the
        per-request guard, so one malformed entry costs one request, not the step."""
        num_scheduled: dict[str, int] = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:

            def read_new(new: Any = new) -> dict[str, Any]:
                tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ()
                return {
                    "admission": ev.Admission.NEW,
                    "num_computed": int(new.num_computed_tokens),
                    "num_scheduled": int(num_scheduled.get(new.req_id, 0)),
                    "block_ids": first_group(new.block_ids),
                    "fallback_tokens": tokens,
                }

            yield str(new.req_id), read_new

    def _cached_requests(
        self, out: Any, batch: _Batch | None, steady: list[int], grown: list[tuple[int, int]]
    ) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
        """(req id, a reader of its facts) per running or resumed request that takes the full
        path: with a ``batch``, those it left out; without, any that is not steady.

        The hot path: a running request decoding one token with at most one new block, at the
        count the tracker expects, is only numbered into ``steady`` (one ``StepDecoded``
        record for the whole step); its token ids are learned later, in bulk, when a decision
        needs them. Anything unusual about it takes the full path."""
        num_scheduled: dict[str, int] = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        resumed_ids, resumed_flags = resumed_markers(cached)
        cached_all = getattr(cached, "all_token_ids", None) or {}

        def read_cached(i: int, req_id: str) -> dict[str, Any]:
            if resumed_ids is not None:
                resumed = req_id in resumed_ids
            else:
                resumed = bool(resumed_flags[i]) if resumed_flags is not None else False
            return {
                "admission": ev.Admission.RESUMED if resumed else ev.Admission.RUNNING,
                "num_computed": int(cached.num_computed_tokens[i]),
                "num_scheduled": int(num_scheduled.get(req_id, 0)),
                "block_ids": first_group(cached.new_block_ids[i]),
                "fallback_tokens": cached_all.get(req_id),
            }

        if batch is not None:
            ids = cached.req_ids
            for i in batch[0]:
                yield str(ids[i]), functools.partial(read_cached, i, ids[i])
            return
        decode_step_ok = self.tracker.decode_step_ok
        num_computed = cached.num_computed_tokens
        new_block_ids = cached.new_block_ids
        resumed_set = resumed_ids if resumed_ids is not None else ()
        scheduled_tokens = num_scheduled.get
        append = steady.append
        for i, req_id in enumerate(cached.req_ids):
            try:
                if scheduled_tokens(req_id) == 1:
                    blocks = new_block_ids[i]  # None, or one list per KV-cache group
                    group = blocks[0] if blocks else ()
                    if (
                        len(group) <= 1
                        and req_id not in resumed_set
                        and (resumed_flags is None or not resumed_flags[i])
                    ):
                        new_block = int(group[0]) if group else None
                        num = decode_step_ok(req_id, num_computed[i], new_block)
                        if num is not None:
                            append(num)
                            if new_block is not None:
                                grown.append((num, new_block))
                            continue
            except Exception:  # malformed: the full path below reports it
                pass
            yield str(req_id), functools.partial(read_cached, i, req_id)

    def _steady_batch(self, out: Any) -> _Batch | None:
        """The running requests of a step in which each was scheduled exactly one token and
        none was resumed, counted as a batch (``Tracker.decode_batch``: no Python per steady
        request): the positions that take the full path, and the numbers and (number, block)
        pairs counted. None: not such a step, or something about it is not as vLLM gives it
        (checked request by request instead)."""
        try:
            cached = out.scheduled_cached_reqs
            ids = cached.req_ids
            resumed_ids, resumed_flags = resumed_markers(cached)
            if not ids or resumed_ids or (resumed_flags is not None and any(resumed_flags)):
                return None
            num_scheduled = out.num_scheduled_tokens
            # One token for every request: vLLM's counts all 1 and no more of them than cached
            # requests (its keys are the new and the cached requests), which reads no request
            # id; with new requests beside them, the cached ones' counts one by one. ("All 1":
            # the ones counted, each item's identity tested first, where a set hashed each.)
            n = len(ids)
            if not (len(num_scheduled) == n and [*num_scheduled.values()].count(1) == n) and (
                [*map(num_scheduled.get, ids)].count(1) != n
            ):
                return None
            new_block_ids = cached.new_block_ids
            grown: dict[int, int] = {}
            # Only the requests whose table grew (None for the others since vLLM 0.10).
            for i in itertools.compress(range(len(ids)), new_block_ids):
                group = first_group(new_block_ids[i])
                if len(group) > 1:
                    return None
                if group:
                    grown[i] = int(group[0])
            num_computed = cached.num_computed_tokens
            if len(num_computed) != len(ids) or len(new_block_ids) != len(ids):
                return None
        except Exception:  # malformed: request by request, where the full path reports it
            return None
        return self.tracker.decode_batch(ids, num_computed, grown)

    def _scheduled_one(
        self, req_id: str, read: Callable[[], dict[str, Any]]
    ) -> list[ev.DecisionEvent]:
        try:
            facts = read()
            external = self._unlooked.pop(req_id, 0)
            if external:
                # Nobody looked these tokens up, so nobody loads them: vLLM must recompute.
                nc = facts["num_computed"]
                self._unlooked_refused += blocks_covering(
                    facts["block_ids"], self.tracker_config.block_size, max(0, nc - external), nc
                )
            request = self._requests.get(req_id)
            fallback = facts.pop("fallback_tokens")
            tokens = request.all_token_ids if request is not None else (fallback or ())
            decisions = self.tracker.scheduled(req_id, all_token_ids=tokens, **facts)
            self._allocated_this_step.discard(req_id)
            return decisions
        except Exception as exc:
            self._adapter_error("build_connector_meta", exc, req_id=req_id)
            return []

    def _plan(
        self, step: int, decisions: list[ev.DecisionEvent], preempted: tuple[str, ...]
    ) -> StepPlan:
        if not (
            decisions
            or self._allocated_this_step
            or self._unlooked
            or self._unlooked_refused
            or self._delayed_free
        ):
            # A steady step plans nothing. Built by tuple.__new__ in one C call: the named
            # tuple's own __new__ is a Python function, 2 to 4 us more on the scheduler's
            # cold caches (docs/performance.md); tests/test_steady_step.py holds this to
            # StepPlan(step, preempted=preempted).
            return tuple.__new__(StepPlan, (step, (), (), (), preempted, (), None))
        loads: list[TransferPlan] = []
        saves: list[TransferPlan] = []
        refused: list[int] = []
        for d in decisions:
            if isinstance(d, (ev.LoadPlanned, ev.SavePlanned)):
                state = self.tracker.state(d.req_id)
                if isinstance(d, ev.LoadPlanned) and d.refused_blocks:
                    refused.extend(d.refused_blocks)
                if state is None:
                    continue
                if isinstance(d, ev.LoadPlanned) and d.keys:
                    if state.life.num_preemptions:
                        self.load_stats["tokens_loaded_on_resume"] += d.end - d.start
                    if state.lookup is not None and d.end == state.lookup.num_tokens - 1:
                        self.load_stats["full_hits"] += 1
                plan = transfer_plan(d, state, self.tracker_config)
                if plan is not None:
                    (loads if plan.kind == "load" else saves).append(plan)
                    self._count_plan(plan)
                    if self.pool_events is not None and plan.kind == "save":
                        self._describe(plan)
        refused.extend(self._refuse_unprocessed_admissions())
        refused.extend(self._unlooked_refused)
        self._unlooked_refused = []
        self._unlooked.clear()
        delayed, self._delayed_free = tuple(self._delayed_free), []
        return StepPlan(step, tuple(loads), tuple(saves), tuple(refused), preempted, delayed)

    def _describe(self, plan: TransferPlan) -> None:
        """The saved chunks, described for their KV events while vLLM's request exists. A
        request whose hashes or tokens cannot be read (an adapter error) leaves its chunks
        undescribed: they are stored and served as planned, and never published
        half-described (``PoolEvents.undescribed``)."""
        assert self.pool_events is not None
        request = self._requests.get(plan.req_id)
        if request is None:
            return
        try:
            for c in plan.chunks:
                self.pool_events.planned(request, c.key, c.chunk_start, c.token_end)
        except Exception as exc:  # vLLM's request, read by duck typing; the plan stands
            self._adapter_error("build_connector_meta", exc)

    def take_events(self, publish: Callable[[list[PoolEvent]], list[Any]]) -> list[Any]:
        """The pool's KV events since the last call, as ``publish`` makes them vLLM's; an empty
        list with KV events off. If they cannot be made (a vLLM whose event classes want what
        we do not give), the pool's events stop for good, said once as an adapter error: a
        stream with holes in it would mislead a router more than none (strict mode raises)."""
        events = self.pool_events
        if events is None:
            return []
        records = events.take()
        if not records:
            return []
        try:
            return publish(records)
        except Exception as exc:
            self.pool_events = None
            self.tracker.index.watch = None
            self._adapter_error("take_events", exc)
            return []

    def _count_plan(self, plan: TransferPlan) -> None:
        c = self.counters
        if plan.kind == "load":
            c.loads += 1
            c.load_tokens += plan.num_tokens
        else:
            c.saves += 1
            c.save_tokens += plan.num_tokens

    def metrics(self) -> dict[str, int] | None:
        """What changed in the counters and the pool since the previous call, for vLLM's
        connector stats (connector/metrics.py); None when nothing did."""
        if not self._moved:
            return None  # steady steps only since the last call: nothing a metric reads moved
        self._moved = False
        c, t = self.counters, self.tracker
        c.violations = len(t.violations)
        c.adapter_errors = self.adapter_errors
        num_slots = self.tracker_config.num_slots
        return c.since({"pool_used_slots": num_slots - t.index.free_slots, "pool_slots": num_slots})

    def _plan_digests(self, step: int, out: Any, preempted: tuple[str, ...]) -> Any:
        """This step's digest plan: every scheduled request's blocks that become full, and
        the blocks of this step's loads. Its own guard: digests never cost a step."""
        planner = self.digests
        assert planner is not None
        try:
            for req_id in preempted:
                planner.preempted(req_id)
            num_scheduled = out.num_scheduled_tokens
            requests = self._requests
            for new in out.scheduled_new_reqs:
                rid = str(new.req_id)
                request = requests.get(rid)
                try:
                    planner.scheduled(
                        rid,
                        replace=True,
                        block_ids=first_group(new.block_ids),
                        num_computed=int(new.num_computed_tokens),
                        num_scheduled=int(num_scheduled.get(rid, 0)),
                        token_ids=request.all_token_ids if request is not None else (),
                    )
                except Exception as exc:  # this request's facts: it alone goes undigested
                    self._digests_lost(planner, step, exc, rid)
            cached = out.scheduled_cached_reqs
            resumed_ids, flags = resumed_markers(cached)
            bs = planner.block_size
            deferred = planner.deferred
            computed = cached.num_computed_tokens
            new_blocks = cached.new_block_ids
            for i, rid in enumerate(cached.req_ids):
                try:
                    nc, ns = int(computed[i]), int(num_scheduled.get(rid, 0))
                    blocks = new_blocks[i]
                    resumed = (
                        rid in resumed_ids if resumed_ids is not None else bool(flags and flags[i])
                    )
                    if (
                        not resumed
                        and (nc + ns) // bs == nc // bs
                        and not (blocks and any(blocks))
                        and rid not in deferred
                    ):
                        continue  # the hot path: no block appended, none filled
                    request = requests.get(rid)
                    planner.scheduled(
                        rid,
                        replace=resumed,
                        block_ids=first_group(blocks),
                        num_computed=nc,
                        num_scheduled=ns,
                        token_ids=request.all_token_ids if request is not None else (),
                    )
                except Exception as exc:  # this request's facts: it alone goes undigested
                    self._digests_lost(planner, step, exc, str(rid))
            plan = planner.plan(step)
            if plan is not None and plan.full:
                # A request that fell back to recompute (a refused load, a broken rule) may
                # have computed this step over blocks vLLM recomputes: its blocks are not
                # recorded as their keys' digests, and it is never saved again. (A load that
                # failed on the worker does not set it: the worker leaves that step's and the
                # next one's blocks out itself, and _computed_over_failed those of every
                # request holding a failed block.)
                recomputing = self.tracker.recomputing
                full = tuple(b for b in plan.full if not recomputing(b.req_id))
                if len(full) != len(plan.full):
                    plan = attrs.evolve(plan, full=full)
            return plan
        except Exception as exc:
            # What the step did to every table is unknown: no request is digested until vLLM
            # gives its whole table again; what was half planned is dropped.
            self._digests_lost(planner, step, exc)
            planner.plan(step)
            return None

    def _digests_lost(
        self, planner: DigestPlanner, step: int, exc: Exception, req_id: str | None = None
    ) -> None:
        planner.lose(None if req_id is None else (req_id,))
        error = describe_exception(exc, 500)
        _log.warning("kvledger.digest_plan_failed", step=step, req_id=req_id, error=error)
        # The log says which digests are missing and why. The request is named in the text,
        # not as the record's request: a record of a request is folded into its state, and a
        # digest must never change what is decided for it.
        text = error if req_id is None else f"{escaped(req_id)}: {error}"
        try:
            self.tracker.apply(ev.RecordLost(step, "", DIGEST_LOSS + "plan", text))
        except Exception as exc2:  # a strict Tracker's raise: the digests never cost a step
            _log.warning("kvledger.digest_loss_unrecorded", step=step, error=repr(exc2))

    def _refuse_unprocessed_admissions(self) -> list[int]:
        """vLLM counts the external tokens of every allocated admission as computed. One whose
        Scheduled we could not process gets no load: refuse its blocks so vLLM recomputes."""
        refused: list[int] = []
        for req_id in sorted(self._allocated_this_step):
            state = self.tracker.state(req_id)
            if state is None or state.accepted <= 0 or state.lookup is None:
                continue
            start = state.lookup.local_hit
            refused += blocks_covering(
                state.block_ids, self.tracker_config.block_size, start, start + state.accepted
            )
            self.tracker.mark_violation(req_id, "admission_not_processed", "Scheduled")
        self._allocated_this_step.clear()
        return refused

    @_guarded(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        """Apply every worker report of the step. Each report, and each entry of a report, is
        judged on its own: one that cannot be read is a recorded violation (``adapter_error``,
        about the request it names, else about no request) and costs only itself."""
        reports = self._reports_of(connector_output)
        skipped = self._computed_over_failed(reports)
        for report in reports:
            if isinstance(report, WorkerReport):
                self.apply_report(report, skipped)
            else:
                self._unreadable_result(
                    None, "WorkerReport", TypeError(f"not a report: {report!r}")
                )

    def _reports_of(self, connector_output: Any) -> list[Any]:
        """The worker reports in vLLM's ``KVConnectorOutput``: our worker metadata (one report
        per rank, or a bare or wrapped single report), else (no worker metadata) the plain reports in
        the connector stats (``carries_reports``). Anything else there is not ours and is
        ignored."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        reports = getattr(meta, "reports", None)
        if reports is not None:
            return list(reports)
        if meta is not None:  # a single report, bare or wrapped; not ours unless a report
            single = getattr(meta, "report", meta)
            return [single] if isinstance(single, WorkerReport) else []
        # No worker metadata (connector/edge.py): the reports ride in the connector stats.
        stats = getattr(connector_output, "kv_connector_stats", None)
        plain = getattr(stats, "data", None)
        if not isinstance(plain, dict) or "kvledger_reports" not in plain:
            return []
        parsed: list[Any] = []
        for item in plain["kvledger_reports"]:
            try:
                parsed.append(WorkerReport.from_plain(item))
            except Exception as exc:
                self._unreadable_result(None, "WorkerReport", exc)
        return parsed

    def _computed_over_failed(self, reports: list[Any]) -> set[str]:
        """With digests on, the requests whose blocks digested in this output's step are not
        recorded as their keys' (``DigestPlanner.computed_over_failed``): those holding a
        block whose load failed, the request whose load it was and any that vLLM's prefix
        cache shares it with (the worker leaves out the first; it cannot see the others).
        Unreadable entries are the reports' to record."""
        if self.digests is None:
            return set()
        failed: set[int] = set()
        for report in reports:
            for entry in getattr(report, "loads_failed", None) or ():
                with contextlib.suppress(Exception):
                    failed.update(_read_blocks(entry)[1])
        try:
            return self.digests.computed_over_failed(failed)
        except Exception as exc:
            self._adapter_error("update_connector_output", exc)
            return set()

    def apply_report(self, report: WorkerReport, skip_digests: Collection[str] = ()) -> None:
        """One rank's results. A failure on any rank wins at once; a success counts only once
        every rank reported it (each rank holds its share of every chunk's bytes). The
        digests of ``skip_digests``' blocks are not recorded (:meth:`_computed_over_failed`).

        Each entry is read whole before anything is applied; one that cannot be read is a
        recorded violation, and the request it names gives up its transfers on this rank (its
        load, if one is in flight, and its pending saves fail), so that nothing it holds waits
        for a result that will never come. Every other entry is applied."""
        self._moved = True
        rank = report.rank
        unreadable: list[str] = []
        # (field, its event, the reader of one entry, what applies it), in the order applied.
        fields: tuple[tuple[str, str, _Reader, Callable[[str, Any, int], None]], ...] = (
            ("loads_failed", "LoadFailed", _read_blocks, self._load_failed),
            ("loads_done", "LoadDone", _read_req_id, self._load_done),
            ("saves_failed", "SaveFailed", _read_keys, self._save_failed),
            ("saves_done", "SaveDone", _read_keys, self._save_done),
        )
        for field, event, read, apply in fields:
            try:
                entries = tuple(getattr(report, field))
            except Exception as exc:
                self._unreadable_result(None, event, exc)
                continue
            for entry in entries:
                try:
                    req_id, items = read(entry)
                except Exception as exc:
                    named = _named_req_id(entry)
                    self._unreadable_result(named, event, exc)
                    if named is not None:
                        unreadable.append(named)
                    continue
                apply(req_id, items, rank)
        for req_id in unreadable:
            self._give_up_transfers(req_id, rank)
        if report.digests is not None:
            try:
                digests = report.digests.without(skip_digests)
                for digested in digests.events(self.tracker.step):
                    self.tracker.apply(digested)
            except Exception as exc:
                self._unreadable_result(None, "BlockDigested", exc)
        try:
            remote = tuple(report.remote)
        except Exception as exc:
            self._unreadable_result(None, "RemoteSaveDone", exc)
            remote = ()
        for entry in remote:
            try:
                self._remote_result(entry, rank)
            except Exception as exc:
                self._unreadable_result(_named_req_id(entry[1:]), "RemoteSaveDone", exc)

    def _remote_result(self, entry: Any, rank: int) -> None:
        """One remote result of one rank: a confirmed write counts once every rank confirmed
        it; a failed read or write counts at once."""
        what, req_id, keys, why = entry
        keys = _read_keys((req_id, keys))[1]
        step = self.tracker.step
        if what == "load_failed":
            self.tracker.apply(ev.RemoteLoadFailed(step, req_id, keys, str(why)))
            if self.pool_events is not None and not str(why).startswith(UNAVAILABLE):
                self.pool_events.remote_gone(keys)  # gone, short, corrupt or foreign
        elif what == "save_failed":
            for key in keys:
                self._remote_acks.setdefault(key, _Ack()).failed.add(rank)
                self._remote_acks[key].settle(self._remote_acks, key, self.world_size)
            self.tracker.apply(ev.RemoteSaveFailed(step, req_id, keys, str(why)))
        elif what == "saved":
            confirmed: list[bytes] = []
            for key in keys:
                ack = self._remote_acks.setdefault(key, _Ack())
                ack.done.add(rank)
                if len(ack.done) == self.world_size and not ack.failed:
                    confirmed.append(key)
                ack.settle(self._remote_acks, key, self.world_size)
            if confirmed:
                self.tracker.apply(ev.RemoteSaveDone(step, req_id, tuple(confirmed)))
                if self.pool_events is not None:
                    self.pool_events.remote_stored(confirmed)
        else:
            raise TypeError(f"unknown remote result {what!r}")
        if str(why).startswith(UNAVAILABLE):  # "unavailable", or "unavailable: <error>"
            self._remote_outage(f"worker rank {rank}: {why}")

    def _load_failed(self, req_id: str, blocks: tuple[int, ...], rank: int) -> None:
        ack = self._load_acks.setdefault(req_id, _Ack())
        if not ack.failed:
            self.counters.load_failures += 1
            self.tracker.load_failed(req_id, blocks)
        ack.failed.add(rank)
        ack.settle(self._load_acks, req_id, self.world_size)

    def _load_done(self, req_id: str, _: tuple[()], rank: int) -> None:
        ack = self._load_acks.setdefault(req_id, _Ack())
        ack.done.add(rank)
        if len(ack.done) == self.world_size and not ack.failed:
            self.counters.loads_done += 1
            self.tracker.load_done(req_id)
        ack.settle(self._load_acks, req_id, self.world_size)

    def _save_failed(self, req_id: str, keys: tuple[bytes, ...], rank: int) -> None:
        first: list[bytes] = []
        for key in keys:
            sack = self._save_acks.setdefault((req_id, key), _Ack())
            if not sack.failed:
                first.append(key)
            sack.failed.add(rank)
            sack.settle(self._save_acks, (req_id, key), self.world_size)
        if first:
            self.counters.save_failures += len(first)
            self.tracker.save_failed(req_id, first)
            if self.pool_events is not None:
                self.pool_events.settled(first)

    def _save_done(self, req_id: str, keys: tuple[bytes, ...], rank: int) -> None:
        confirmed: list[bytes] = []
        for key in keys:
            sack = self._save_acks.setdefault((req_id, key), _Ack())
            sack.done.add(rank)
            if len(sack.done) == self.world_size and not sack.failed:
                confirmed.append(key)
            sack.settle(self._save_acks, (req_id, key), self.world_size)
        if confirmed:
            self.counters.chunks_saved += len(confirmed)
            self.tracker.save_done(req_id, confirmed)
            if self.pool_events is not None:
                self.pool_events.settled(confirmed)

    def _give_up_transfers(self, req_id: str, rank: int) -> None:
        """A result of ``req_id`` from ``rank`` could not be read: count its transfers still
        in flight as failed on that rank (a failure on any rank wins at once)."""
        state = self.tracker.state(req_id)
        if state is None:
            return
        if state.load is not None and not state.load.done:
            self._load_failed(req_id, (), rank)
            state = self.tracker.state(req_id)
        if state is not None and state.save.pending:
            self._save_failed(req_id, tuple(key for key, _ in state.save.pending), rank)

    def _unreadable_result(self, req_id: str | None, event: str, exc: Exception) -> None:
        """A worker result that cannot be read: strict mode raises; otherwise it is counted and
        recorded as the violation ``adapter_error`` about the request it names (which falls
        back to recompute), or about no request (an empty id) when it names none."""
        if self.config.strict:
            raise exc
        self.adapter_errors += 1
        self._moved = True
        _log.error("kvledger.unreadable_report", req_id=req_id, event_type=event, error=repr(exc))
        self.tracker.mark_violation(req_id or "", "adapter_error", event, error=repr(exc))

    @_guarded(_free_now)
    def request_finished(
        self, request: Any, block_ids: Any = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while a save still reads the request's blocks: vLLM keeps them until the worker
        reports the request in ``finished_sending``."""
        self._moved = True
        req_id = str(request.request_id)
        self._requests.pop(req_id, None)
        if self.digests is not None:
            self.digests.finished(req_id)
        delay = self.tracker.finished(req_id, status_name(request) or "finished")
        if delay:
            self._delayed_free.append(req_id)
        return delay, None

    def _adapter_error(self, callback: str, exc: Exception, req_id: str | None = None) -> None:
        """A vLLM object we could not read: strict mode (tests) raises at once; otherwise it is
        counted and logged, and when it concerns one request, that request falls back to
        recompute through a recorded violation."""
        if self.config.strict:
            raise exc
        self.adapter_errors += 1
        self._moved = True
        if req_id is not None:
            self.tracker.mark_violation(req_id, "adapter_error", "Scheduled", error=repr(exc))
        else:
            _log.error("kvledger.adapter_error", callback=callback, error=repr(exc), exc_info=exc)

    def seal(self, stop: str) -> bool:
        """The engine was asked to stop (``stop``: how): make the log complete as of now
        (connector/stopping.py)."""
        return self.tracker.seal(stop)

    def shutdown(self) -> None:
        self.tracker.close()
        if self.remote is not None:
            self.remote.close()

    def summary(self) -> dict[str, Any]:
        t = self.tracker
        return {
            **t.counts,
            "steps": t.step,
            "violations": len(t.violations),
            "adapter_errors": self.adapter_errors,
            **self.load_stats,
            "live_requests": len(t.states),
            "pool": t.index.stats(),
        }
