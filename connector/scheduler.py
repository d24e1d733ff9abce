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

import functools
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import structlog

from connector.config import ConnectorConfig, ConnectorConfigError
from connector.messages import StepPlan, TransferPlan, WorkerReport
from tracker import events as ev
from tracker.config import TrackerConfig
from tracker.log import LogWriteError
from tracker.plans import blocks_covering, transfer_plan
from tracker.tracker import Tracker

__all__ = ["SchedulerSide", "first_group"]

_log = structlog.get_logger("kvledger.connector")
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


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return str(getattr(status, "name", status) or "").lower()


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
    ) -> None:
        config.check_block_size(block_size)
        self.config = config
        self.tracker_config = TrackerConfig(
            block_size=block_size,
            chunk_size=config.chunk_size,
            num_slots=num_slots,
            discard_partial_chunks=config.discard_partial_chunks,
            save_decode_cache=config.save_decode_cache,
            salt=salt,
            max_async_lag=max_async_lag,
            strict=config.strict,
        )
        self.log_path: str | None = None
        writer = None
        log_error: str | None = None
        if config.log_dir:
            try:
                writer = self._open_log(config.log_dir, log_header or {})
            except (OSError, LogWriteError) as e:
                # The documented policy (docs/using-with-vllm.md): the engine serves without a
                # log, said loudly, unless the log is required.
                log_error = f"log_dir {config.log_dir!r} cannot be written: {e}"
                if config.log_required:
                    raise ConnectorConfigError(f"{log_error} (log_required is set)") from None
                self.log_path = None
        self.tracker = Tracker(self.tracker_config, log=writer, logger=logger)
        if log_error is not None:
            self.tracker.log_error = log_error
            (logger or structlog.get_logger("kvledger")).error(
                "kvledger.log_unavailable", error=log_error
            )
        self.adapter_errors = 0
        # What the loads were for: resumed requests, and hits covering the whole prompt.
        self.load_stats = {"tokens_loaded_on_resume": 0, "full_hits": 0}
        self._requests: dict[str, Any] = {}
        self._delayed_free: list[str] = []
        self._allocated_this_step: set[str] = set()
        # Worker ranks that must confirm every transfer (tensor x pipeline parallel size).
        self.world_size = max(1, int(world_size))
        self._save_acks: dict[tuple[str, bytes], _Ack] = {}
        self._load_acks: dict[str, _Ack] = {}

    def _open_log(self, log_dir: str, extra: dict[str, Any]) -> Any:
        from tracker.log import LogWriter  # the only file I/O, and only when asked for

        os.makedirs(log_dir, exist_ok=True)
        # One log per connector: time, pid and a random suffix, so a second connector in the
        # same process (an engine restarted in place) never collides with the first.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(log_dir, f"kvledger-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:6]}.kvlog")
        self.log_path = path
        header = {**self.tracker_config.to_dict(), **extra}
        return LogWriter(
            path,
            header,
            rotate_bytes=self.config.log_rotate_bytes,
            fsync=self.config.log_fsync,  # type: ignore[arg-type]  # checked by ConnectorConfig
            background=self.config.log_background,
            max_queue_bytes=self.config.log_queue_bytes,
        )

    # --- callbacks ------------------------------------------------------------------------

    @_guarded(lambda: None)
    def on_new_request(self, request: Any) -> None:
        self._see(request)

    def _see(self, request: Any) -> str:
        req_id = str(request.request_id)
        if req_id not in self._requests or self._requests[req_id] is not request:
            self._requests[req_id] = request
            prompt = getattr(request, "prompt_token_ids", None) or ()
            salt = getattr(request, "cache_salt", None) or ""
            self.tracker.add_request(req_id, prompt, str(salt))
        return req_id

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Pure with respect to the pool: asked again, answers the same."""
        return self._lookup(request, num_computed_tokens)

    @_guarded(lambda: (0, False))
    def _lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = self._see(request)
        external = self.tracker.lookup(
            req_id,
            int(num_computed_tokens),
            request.all_token_ids,
            preempted=_status_name(request) == "preempted",
        )
        return external, False

    @_guarded(lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = self._see(request)
        self._allocated_this_step.add(req_id)
        self.tracker.allocated(req_id, first_group(blocks), int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """Fold the step into the tracker and return the worker's plan. Whatever fails, the
        decisions already made are still planned (a load vLLM already counts must run or be
        refused), and admissions that could not be processed are refused."""
        tracker = self.tracker
        step = tracker.step
        decisions: list[ev.DecisionEvent] = []
        preempted: tuple[str, ...] = ()
        steady: list[int] = []
        grown: list[tuple[int, int]] = []
        try:
            preempted = tuple(sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
            for req_id in preempted:
                tracker.preempted(req_id)
            for req_id, read in self._scheduled_requests(scheduler_output, steady, grown):
                decisions += self._scheduled_one(req_id, read)
        except Exception as exc:
            self._adapter_error("build_connector_meta", exc)
        tracker.decoded(steady, grown)
        plan = self._plan(step, decisions, preempted)
        tracker.end_step()
        return plan

    def _scheduled_requests(
        self, out: Any, steady: list[int], grown: list[tuple[int, int]]
    ) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
        """(req id, a reader of its facts) per scheduled request. Reading happens inside the
        per-request guard, so one malformed entry costs one request, not the step.

        The hot path: a running request decoding one token with at most one new block, at the count
        the tracker expects, is only numbered into ``steady`` (one ``StepDecoded`` record for
        the whole step); its token ids are learned later, in bulk, when a decision needs
        them. Anything unusual about it takes the full path."""
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
        cached = out.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        resumed_flags = (
            None if resumed_ids is not None else getattr(cached, "resumed_from_preemption", None)
        )
        cached_all = getattr(cached, "all_token_ids", None) or {}
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

            def read_cached(i: int = i, req_id: str = req_id) -> dict[str, Any]:
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

            yield str(req_id), read_cached

    def _scheduled_one(
        self, req_id: str, read: Callable[[], dict[str, Any]]
    ) -> list[ev.DecisionEvent]:
        try:
            facts = read()
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
        self, step: int, decisions: Iterable[ev.DecisionEvent], preempted: tuple[str, ...]
    ) -> StepPlan:
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
        refused.extend(self._refuse_unprocessed_admissions())
        delayed, self._delayed_free = tuple(self._delayed_free), []
        return StepPlan(step, tuple(loads), tuple(saves), tuple(refused), preempted, delayed)

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
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        reports = getattr(meta, "reports", None)
        if reports is None and meta is not None:  # a single report, bare or wrapped
            reports = (getattr(meta, "report", meta),)
        if reports is None:
            # vLLM < 0.18 has no worker metadata: the reports ride in the connector stats.
            stats = getattr(connector_output, "kv_connector_stats", None)
            plain = getattr(stats, "data", None)
            if isinstance(plain, dict) and "kvledger_reports" in plain:
                reports = tuple(WorkerReport.from_plain(r) for r in plain["kvledger_reports"])
        for report in reports or ():
            if isinstance(report, WorkerReport):
                self.apply_report(report)

    def apply_report(self, report: WorkerReport) -> None:
        """One rank's results. A failure on any rank wins at once; a success counts only once
        every rank reported it (each rank holds its share of every chunk's bytes)."""
        tracker, world = self.tracker, self.world_size
        for req_id, blocks in report.loads_failed:
            ack = self._load_acks.setdefault(req_id, _Ack())
            if not ack.failed:
                tracker.load_failed(req_id, blocks)
            ack.failed.add(report.rank)
            ack.settle(self._load_acks, req_id, world)
        for req_id in report.loads_done:
            ack = self._load_acks.setdefault(req_id, _Ack())
            ack.done.add(report.rank)
            if len(ack.done) == world and not ack.failed:
                tracker.load_done(req_id)
            ack.settle(self._load_acks, req_id, world)
        for req_id, keys in report.saves_failed:
            first: list[bytes] = []
            for key in keys:
                sack = self._save_acks.setdefault((req_id, key), _Ack())
                if not sack.failed:
                    first.append(key)
                sack.failed.add(report.rank)
                sack.settle(self._save_acks, (req_id, key), world)
            if first:
                tracker.save_failed(req_id, first)
        for req_id, keys in report.saves_done:
            confirmed: list[bytes] = []
            for key in keys:
                sack = self._save_acks.setdefault((req_id, key), _Ack())
                sack.done.add(report.rank)
                if len(sack.done) == world and not sack.failed:
                    confirmed.append(key)
                sack.settle(self._save_acks, (req_id, key), world)
            if confirmed:
                tracker.save_done(req_id, confirmed)

    @_guarded(_free_now)
    def request_finished(
        self, request: Any, block_ids: Any = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while a save still reads the request's blocks: vLLM keeps them until the worker
        reports the request in ``finished_sending``."""
        req_id = str(request.request_id)
        self._requests.pop(req_id, None)
        delay = self.tracker.finished(req_id, _status_name(request) or "finished")
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
        if req_id is not None:
            self.tracker.mark_violation(req_id, "adapter_error", "Scheduled", error=repr(exc))
        else:
            _log.error("kvledger.adapter_error", callback=callback, error=repr(exc), exc_info=exc)

    def shutdown(self) -> None:
        self.tracker.close()

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
