"""Duck-typed stand-ins for vLLM's scheduler-side objects, and ``FakeEngine``, which plays
vLLM's callback order around a ``SchedulerSide`` (and, when given, a worker: a
``connector.testing.faults.FaultyWorkerSide`` over CPU paged caches owned by the KV-content
oracle).

Nothing here imports vLLM. The shapes follow vLLM 0.33's
``vllm/v1/core/sched/output.py`` (``NewRequestData``, ``CachedRequestData``, ``SchedulerOutput``):

* ``NewRequestData``: ``req_id, prompt_token_ids, block_ids: tuple[list[int], ...],
  num_computed_tokens`` (+ ``prefill_token_ids`` under Model Runner V2);
* ``CachedRequestData`` (vLLM >= 0.11.1): ``resumed_req_ids: set``, ``all_token_ids: dict``,
  ``new_block_ids: list[tuple[list[int], ...] | None]``, ``num_computed_tokens: list``;
* ``LegacyCachedRequestData`` (0.9.2 - 0.11.0): ``resumed_from_preemption: list[bool]`` and no
  ``resumed_req_ids`` attribute;
* ``SchedulerOutput`` (>= 0.12: ``preempted_req_ids: set | None``) and
  ``LegacySchedulerOutput`` (no ``preempted_req_ids`` attribute at all).

``FakeEngine.step`` runs one engine step in vLLM's order::

    build_connector_meta(SchedulerOutput)            # scheduler
    handle_preemptions -> bind -> start_load_kv      # worker (when given)
    fake forward: the oracle writes every scheduled token's KV
    wait_for_save -> get_finished -> get_block_ids_with_load_errors -> build_report
    vLLM: num_computed_tokens += scheduled; load errors roll it back (recompute policy)
    sample one token for every request whose prefill is complete
    request_finished(...) for the requests finishing in this step
    update_connector_output(KVConnectorOutput)

With ``defer_finalize`` (vLLM with a drafter: speculative decoding) the worker part runs in
vLLM 0.33's deferred order instead: the fake target forward writes every layer but the last,
then ``get_finished -> get_block_ids_with_load_errors -> build_report``, then the fake draft
forward writes the last layer (standing for the drafter's own layer), then
``wait_for_save -> clear``.

and admissions (``get_num_new_matched_tokens -> allocate -> update_state_after_alloc``) happen
before it through ``FakeEngine.admit`` / ``FakeEngine.lookup``. Under async scheduling the
output of step N (sampled tokens, finishes, connector output) is applied after step N+1 was
built, as vLLM's ``step_with_batch_queue`` does.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvledger.connector.messages import StepPlan, WorkerReport
from kvledger.connector.scheduler import SchedulerSide

__all__ = [
    "PREEMPT_SIGNALS",
    "SHAPES",
    "CachedRequestData",
    "FakeBlocks",
    "FakeEngine",
    "FakeRequest",
    "KVConnectorOutput",
    "LegacyCachedRequestData",
    "LegacySchedulerOutput",
    "ManualEvent",
    "NewRequestData",
    "RequestStatus",
    "SchedulerOutput",
    "StepRecord",
    "WorkerMeta",
    "hold_saves",
    "token_at",
]


class RequestStatus(enum.IntEnum):
    """vLLM's ``RequestStatus`` names (the connector reads ``.name`` only)."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6


def token_at(req_id: str, position: int) -> int:
    """The fake sampler: a deterministic token id per (request, position), so that the forward
    pass knows a token before it is appended (async scheduling) and a resumed request samples
    the same tokens again."""
    h = 0
    for ch in req_id:
        h = (h * 131 + ord(ch)) % 1_000_003
    return 3 + (h * 7919 + position * 104729) % 30000


@dataclass(eq=False)
class FakeRequest:
    """vLLM's ``Request``: ``all_token_ids`` is a list the engine appends sampled tokens to."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    cache_salt: str | None = None
    num_computed_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeBlocks:
    """``KVCacheBlocks``: one list of block ids per KV-cache group (one group here)."""

    blocks: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.blocks),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None  # MRV2: all tokens of a re-admitted request


@dataclass
class CachedRequestData:
    """vLLM >= 0.11.1."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        num_computed: int,
        new_blocks: Sequence[int] | None,
        *,
        resumed: bool = False,
        all_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.req_ids.append(req_id)
        if resumed:
            self.resumed_req_ids.add(req_id)
        self.new_token_ids.append([])
        if all_token_ids is not None:
            self.all_token_ids[req_id] = list(all_token_ids)
        self.new_block_ids.append(None if new_blocks is None else (list(new_blocks),))
        self.num_computed_tokens.append(num_computed)
        self.num_output_tokens.append(0)


@dataclass
class LegacyCachedRequestData:
    """vLLM 0.9.2 - 0.11.0: a resumed flag per request, no ``resumed_req_ids``."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        num_computed: int,
        new_blocks: Sequence[int] | None,
        *,
        resumed: bool = False,
        all_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_token_ids.append([])
        self.new_block_ids.append(None if new_blocks is None else (list(new_blocks),))
        self.num_computed_tokens.append(num_computed)


@dataclass
class SchedulerOutput:
    """vLLM >= 0.12 (``preempted_req_ids`` may be None)."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: Any = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class LegacySchedulerOutput:
    """vLLM < 0.12: no ``preempted_req_ids`` attribute."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: Any = field(default_factory=LegacyCachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


@dataclass
class WorkerMeta:
    """``KVLedgerWorkerMetadata``: the scheduler side reads ``.report``."""

    report: WorkerReport


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_worker_meta: Any = None


# --- the engine -------------------------------------------------------------------------------

# "v0.11.1": resumed via CachedRequestData.resumed_req_ids;
# "v0.9.2": resumed via LegacyCachedRequestData.resumed_from_preemption;
# "mrv2": a resumed request comes back in scheduled_new_reqs (prefill_token_ids set).
SHAPES = ("v0.11.1", "v0.9.2", "mrv2")
# How preemption is signalled in the SchedulerOutput of the step that preempts.
PREEMPT_SIGNALS = ("set", "none", "absent")


@dataclass
class StepRecord:
    """What one ``FakeEngine.step`` did."""

    step: int
    output: Any
    plan: StepPlan
    report: WorkerReport | None = None
    finished_sending: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    finished: dict[str, tuple[bool, Any]] = field(default_factory=dict)

    def load_of(self, req_id: str) -> Any:
        return next((p for p in self.plan.loads if p.req_id == req_id), None)

    def saves_of(self, req_id: str) -> list[Any]:
        return [p for p in self.plan.saves if p.req_id == req_id]

    def saved_ranges(self, req_id: str) -> list[tuple[int, int]]:
        return [(c.token_start, c.token_end) for p in self.saves_of(req_id) for c in p.chunks]

    def loaded_ranges(self, req_id: str) -> list[tuple[int, int]]:
        load = self.load_of(req_id)
        return [] if load is None else [(c.token_start, c.token_end) for c in load.chunks]


@dataclass
class _Pending:
    """A step's output not yet applied (async scheduling applies it one step late)."""

    record: StepRecord
    sampled: dict[str, int]
    finish: list[str]
    invalid: set[int]


class FakeEngine:
    """vLLM's scheduler bookkeeping, reduced to what a connector observes.

    Tests decide the schedule (which request, how many tokens, which blocks); the engine turns
    it into the objects vLLM would pass, in the order vLLM would pass them. Without a worker,
    an ideal worker is assumed: every planned save and load is reported done.
    """

    def __init__(
        self,
        scheduler: SchedulerSide,
        *,
        worker: Any = None,
        oracle: Any = None,
        shape: str = "v0.11.1",
        preempt_signal: str = "set",
        async_scheduling: bool = False,
        announce: bool = True,
        sampler: Callable[[str, int], int] = token_at,
        defer_finalize: bool = False,
    ) -> None:
        assert shape in SHAPES and preempt_signal in PREEMPT_SIGNALS
        self.scheduler = scheduler
        self.worker = worker
        self.oracle = oracle
        self.defer_finalize = defer_finalize
        self.shape = shape
        self.preempt_signal = preempt_signal
        self.async_scheduling = async_scheduling
        self.announce = announce
        self.sampler = sampler
        self.block_size = scheduler.tracker_config.block_size
        self.requests: dict[str, FakeRequest] = {}
        self.tables: dict[str, list[int]] = {}
        self._admitted: dict[str, str] = {}  # req_id -> "new" | "resumed", until scheduled
        self._preempted_now: set[str] = set()
        self._finished_prev: set[str] = set()
        self.delayed_free: set[str] = set()  # request_finished returned True; blocks held
        self.freed: list[str] = []
        self.step_no = 0
        self.records: list[StepRecord] = []
        self._pending: _Pending | None = None
        self.poisoned: set[str] = set()  # forward ran over a wrong prefix in the last step

    # --- requests ------------------------------------------------------------------------

    def add(self, req_id: str, prompt: Sequence[int], cache_salt: str | None = None) -> FakeRequest:
        req = FakeRequest(req_id, list(prompt), cache_salt=cache_salt)
        self.requests[req_id] = req
        if self.announce:
            self.scheduler.on_new_request(req)
        return req

    def tokens(self, req_id: str, upto: int) -> list[int]:
        """The request's token ids up to ``upto``, sampling ahead where needed."""
        req = self.requests[req_id]
        out = list(req.all_token_ids[:upto])
        while len(out) < upto:
            out.append(self.sampler(req_id, len(out)))
        return out

    def lookup(self, req: FakeRequest, local_hit: int = 0) -> int:
        """``get_num_new_matched_tokens``: the request is waiting; allocation may still fail."""
        external, load_async = self.scheduler.get_num_new_matched_tokens(req, local_hit)
        assert load_async is False
        return external

    def admit(
        self,
        req: FakeRequest,
        blocks: Sequence[int],
        local_hit: int = 0,
        *,
        external: int | None = None,
        lookup: bool = True,
        notify: bool = True,
    ) -> int:
        """GNMT (unless ``lookup=False``) -> allocation succeeds -> USAA (unless
        ``notify=False``); vLLM then counts ``local_hit + external`` tokens as computed.
        ``external`` overrides the answer vLLM accepts. Returns ``external``."""
        if lookup:
            answered = self.lookup(req, local_hit)
            external = answered if external is None else external
        external = external or 0
        if notify:
            self.scheduler.update_state_after_alloc(req, FakeBlocks(list(blocks)), external)
        req.num_computed_tokens = local_hit + external
        self._admitted[req.request_id] = (
            "resumed" if req.status is RequestStatus.PREEMPTED else "new"
        )
        req.status = RequestStatus.RUNNING
        self.tables[req.request_id] = list(blocks)
        return external

    def preempt(self, req: FakeRequest) -> None:
        """No connector call: blocks freed, count reset, signalled in the next output."""
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.tables.pop(req.request_id, None)
        self._preempted_now.add(req.request_id)

    # --- one step ------------------------------------------------------------------------

    def build_output(
        self,
        scheduled: Mapping[str, int],
        new_blocks: Mapping[str, Sequence[int] | None],
    ) -> Any:
        legacy = self.shape == "v0.9.2"
        cached = LegacyCachedRequestData() if legacy else CachedRequestData()
        new_reqs: list[NewRequestData] = []
        for req_id in scheduled:
            req = self.requests[req_id]
            nc = req.num_computed_tokens
            kind = self._admitted.pop(req_id, None)
            table = self.tables[req_id]
            if kind == "new" or (kind == "resumed" and self.shape == "mrv2"):
                new_reqs.append(
                    NewRequestData(
                        req_id,
                        list(req.prompt_token_ids),
                        (list(table),),
                        nc,
                        prefill_token_ids=(
                            list(req.all_token_ids) if self.shape == "mrv2" else None
                        ),
                    )
                )
            elif kind == "resumed":
                blocks = new_blocks.get(req_id, table)
                cached.add(req_id, nc, blocks, resumed=True, all_token_ids=list(req.all_token_ids))
            else:
                blocks = new_blocks.get(req_id)
                if blocks:
                    table.extend(blocks)
                cached.add(req_id, nc, blocks)
        out_cls = LegacySchedulerOutput if self.preempt_signal == "absent" else SchedulerOutput
        out = out_cls(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(scheduled),
            finished_req_ids=set(self._finished_prev),
        )
        if self.preempt_signal == "set":
            out.preempted_req_ids = set(self._preempted_now)
        self._preempted_now.clear()
        self._finished_prev.clear()
        return out

    def step(
        self,
        scheduled: Mapping[str, int],
        *,
        new_blocks: Mapping[str, Sequence[int] | None] | None = None,
        finish: Iterable[str] = (),
        sample: bool = True,
        before_forward: Callable[[StepPlan], None] | None = None,
        tamper: Callable[[Any], None] | None = None,
    ) -> StepRecord:
        """One engine step. ``scheduled``: req id -> tokens to compute; ``new_blocks``: blocks
        appended to a running request (or, for a resumed one, its block table; None is
        allowed); ``finish``: requests that stop after this step's token; ``tamper`` may
        corrupt the SchedulerOutput before the connector sees it; ``before_forward`` runs
        after the loads, before the fake forward pass writes KV."""
        out = self.build_output(scheduled, new_blocks or {})
        if tamper is not None:
            tamper(out)
        plan = self.scheduler.build_connector_meta(out)
        record = StepRecord(self.step_no, out, plan)
        self.step_no += 1
        invalid: set[int] = set()
        if self.worker is not None:
            invalid = self._run_worker(out, plan, record, before_forward)
        else:
            record.report = self._ideal_report(plan)
            record.finished_sending = set(plan.delayed_free)
        # vLLM advances num_computed_tokens when it schedules.
        for req_id, n in scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        sampled: dict[str, int] = {}
        if sample:
            for req_id in scheduled:
                req = self.requests[req_id]
                pending = self._pending.sampled.get(req_id) if self._pending else None
                known = req.num_tokens + (1 if pending is not None else 0)
                if req.num_computed_tokens >= known:
                    sampled[req_id] = self.sampler(req_id, known)
        pending_now = _Pending(record, sampled, list(finish), invalid)
        if self.async_scheduling:
            previous, self._pending = self._pending, pending_now
            if previous is not None:
                self._apply(previous)
        else:
            self._apply(pending_now)
        self.records.append(record)
        return record

    def drain(self) -> None:
        """Async scheduling: apply the last step's output."""
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._apply(previous)

    def _apply(self, pending: _Pending) -> None:
        """``update_from_output``: roll back failed loads, append sampled tokens, finish
        requests (request_finished), then update_connector_output."""
        record = pending.record
        rolled_back: set[str] = set()
        if pending.invalid:
            bs = self.block_size
            for req_id, table in self.tables.items():
                bad = [i for i, b in enumerate(table) if b in pending.invalid]
                if bad:
                    req = self.requests[req_id]
                    req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * bs)
                    rolled_back.add(req_id)
        for req_id, token in pending.sampled.items():
            if req_id not in rolled_back and self.requests[req_id].status is RequestStatus.RUNNING:
                self.requests[req_id].all_token_ids.append(token)
        for req_id in pending.finish:
            record.finished[req_id] = self.finish(req_id)
        self.scheduler.update_connector_output(
            KVConnectorOutput(
                finished_sending=record.finished_sending or None,
                invalid_block_ids=set(pending.invalid),
                kv_connector_worker_meta=WorkerMeta(record.report or WorkerReport()),
            )
        )
        for req_id in record.finished_sending:
            assert req_id in self.delayed_free, f"{req_id} reported sent but never delayed"
            self.delayed_free.discard(req_id)
            self.freed.append(req_id)

    def finish(
        self, req_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED
    ) -> tuple[bool, Any]:
        """``request_finished`` (called once, before vLLM frees the blocks)."""
        req = self.requests[req_id]
        req.status = status
        result = self.scheduler.request_finished(req, list(self.tables.get(req_id, [])))
        delay, _ = result
        self.tables.pop(req_id, None)
        if delay:
            self.delayed_free.add(req_id)
        else:
            self.freed.append(req_id)
        self._finished_prev.add(req_id)
        return result

    @staticmethod
    def _ideal_report(plan: StepPlan) -> WorkerReport:
        return WorkerReport(
            saves_done=tuple((p.req_id, tuple(c.key for c in p.chunks)) for p in plan.saves),
            loads_done=tuple(p.req_id for p in plan.loads),
        )

    def _run_worker(
        self,
        out: Any,
        plan: StepPlan,
        record: StepRecord,
        before_forward: Callable[[StepPlan], None] | None,
    ) -> set[int]:
        worker = self.worker
        worker.handle_preemptions(plan)
        worker.bind(plan)
        worker.start_load_kv()
        if before_forward is not None:
            before_forward(plan)
        bad = worker.failed_load_requests()
        refused = set(plan.refused_blocks)
        writes: list[tuple[str, list[int], list[int], int, int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = req.num_computed_tokens
            table = self.tables[req_id]
            if refused & set(table):
                bad.add(req_id)
            if self.oracle is not None:
                writes.append((req_id, self.tokens(req_id, start + n), table, start, start + n))
        self.poisoned = bad

        def forward(layers: Sequence[int] | None) -> None:
            for req_id, tokens, table, start, end in writes:
                self.oracle.write(
                    req_id, tokens, table, start, end, poisoned=req_id in bad, layers=layers
                )

        if self.defer_finalize:
            num_layers = len(self.oracle.caches) if self.oracle is not None else 1
            forward(range(num_layers - 1))  # the target model
            sending, _ = worker.get_finished(set(out.finished_req_ids))
            errors = worker.get_block_ids_with_load_errors()
            record.report = worker.build_report()
            forward([num_layers - 1])  # the drafter, after the connector output
            worker.wait_for_save()
        else:
            forward(None)
            worker.wait_for_save()
            sending, _ = worker.get_finished(set(out.finished_req_ids))
            errors = worker.get_block_ids_with_load_errors()
            record.report = worker.build_report()
        worker.clear()
        record.finished_sending = set(sending or ())
        record.load_errors = set(errors)
        return set(errors)

    # --- checks --------------------------------------------------------------------------

    def verify(self, req_id: str, upto: int | None = None) -> Any:
        """The oracle's first wrong token among the request's computed tokens, or None."""
        req = self.requests[req_id]
        n = req.num_computed_tokens if upto is None else upto
        return self.oracle.verify(req_id, self.tokens(req_id, n), self.tables[req_id], n)

    def state(self, req_id: str) -> Any:
        return self.scheduler.tracker.state(req_id)

    @property
    def violations(self) -> list[Any]:
        return self.scheduler.tracker.violations

    def rules(self) -> list[str]:
        return [v.rule for v in self.scheduler.tracker.violations]


# --- saves that stay in flight -----------------------------------------------------------------


class ManualEvent:
    """A transfer-completion event the test completes by hand (CPU copies finish at once, so an
    asynchronous save is simulated: the bytes are copied, completion is reported later)."""

    def __init__(self) -> None:
        self.completed = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.synchronized += 1
        self.completed = True

    def wait(self, stream: Any = None) -> None:
        pass


def hold_saves(worker: Any, monkeypatch: Any) -> list[ManualEvent]:
    """Make every later save of ``worker`` stay in flight until its event is completed (or
    synchronized by a blocking wait). Returns the events, in issue order."""
    from kvledger.connector.transfer import TransferHandle

    events: list[ManualEvent] = []
    real_save = worker.backend.save

    def save(*args: Any, **kwargs: Any) -> Any:
        real_save(*args, **kwargs)
        event = ManualEvent()
        events.append(event)
        return TransferHandle(event)

    monkeypatch.setattr(worker.backend, "save", save)
    return events
