"""The recorder's scheduler-side recording: vLLM's facts and the inner connector's answers in,
events out, into the log.

``SchedulerRecorder`` is what ``KVLedgerRecorder`` (connector/recorder.py) hands the facts of
each scheduler callback to, with the inner's answer where it has one; it reads vLLM's objects
by duck typing and writes each fact as the event a reader of the log (``kvledger check``)
folds. Every step of a recorded run goes through ``scheduled``, so its common case, a steady
decode step, has a path of its own (``_Batch``: one ``StepDecoded``, checked with a few list
comparisons, not request by request).

Kept apart from the class vLLM loads because the two have different jobs and rules: the
recorder class is the vLLM-facing wrapper (forwarding, the three promises of its docstring,
the digests' hooks, the class methods vLLM calls) and gets vLLM through connector/edge.py;
this module is the bookkeeping, imports no vLLM and not the edge (the one edge helper it
reads, ``token_list``, is handed in), and is driven in tests with no connector around it.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

from kvledger.connector.logsafe import safe_logger
from kvledger.connector.scheduler import first_group, status_name
from kvledger.tracker import events as ev
from kvledger.tracker.codec import EncodeError, describe_exception, escaped
from kvledger.tracker.recorded_steps import Life, RecordedSteps
from kvledger.tracker.tracker import close_log, seal_log

__all__ = ["RECORDER_FORMAT", "SchedulerRecorder"]

_log = safe_logger("kvledger.recorder")

# Stats are recorded as JSON cut to this many characters.
_STATS_CHARS = 4096
# The recorder's log format: bumped when what a recorder writes changes meaning. 2: steady
# decode steps may come as StepDecoded entries (tracker/recorded_steps.py).
RECORDER_FORMAT = 2


def _error_text(exc: BaseException) -> str:
    return describe_exception(exc, 500)


def _stats_text(stats: Any) -> str:
    """An inner's stats object as JSON (its ``data`` when it has one), cut short."""
    data = getattr(stats, "data", stats)
    try:
        text = json.dumps(data, default=repr, sort_keys=True)
    except Exception:
        text = repr(data)
    return text[:_STATS_CHARS]


def _params_text(params: Any) -> str:
    if params is None:
        return ""
    if isinstance(params, Mapping):
        return ",".join(sorted(str(k) for k in params))
    return type(params).__name__


_NUM_TOKENS = operator.attrgetter("num_tokens")
_KNOWN = operator.attrgetter("known")


class _Batch:
    """The cached requests of the last step that was steady whole: every one an entry of one
    ``StepDecoded``, each token read from its list (connector/edge.py, ``token_list``), each
    with the token at its count the next to record (synchronous scheduling). While vLLM
    schedules exactly these again, in the same order, each one token at the count the log gave
    it, with at most one new block, the step is checked with a few list comparisons and maps
    (loops in C) and the lives advance by one shared counter (``RecordedSteps.defer``) instead
    of request by request: the decode step of a steady batch, the common case. It writes
    exactly what the request-by-request path would; anything else in a step, and that path
    decides."""

    __slots__ = (
        "changes",
        "last",
        "lists",
        "lives",
        "nums",
        "one_each",
        "req_ids",
        "scheduled_of",
    )

    def __init__(
        self,
        req_ids: list[str],
        lives: list[Life],
        nums: list[int],
        lists: dict[str, Any],
        steps: RecordedSteps,
    ) -> None:
        self.req_ids = list(req_ids)
        self.lives = lives
        self.nums = tuple(nums)
        self.lists = [lists[r] for r in req_ids]
        # Each life's count at the last step, one less than the log gives it now: vLLM's
        # counts of the next step are these plus one each.
        self.last = [n - 1 for n in map(_NUM_TOKENS, lives)]
        self.changes = steps.changes
        # The tokens vLLM scheduled for each, read in one call (a tuple, or the one value),
        # and what they are in a steady step: one each.
        self.scheduled_of = operator.itemgetter(*req_ids)
        self.one_each = (1,) * len(req_ids) if len(req_ids) > 1 else 1

    def step(self, rec: SchedulerRecorder, cached: Any, scheduled: Any, resumed: Any) -> bool:
        """Write this step of the batch (True), or leave it to the request-by-request path."""
        req_ids, lives, steps = cached.req_ids, self.lives, rec.steps
        if resumed or req_ids != self.req_ids:
            return False
        if steps.changes != self.changes:  # the log took other facts since: read the lives
            steps.settle()
            counts = list(map(_NUM_TOKENS, lives))
            if list(map(_KNOWN, lives)) != counts or list(map(rec._lives.get, req_ids)) != lives:
                return False
            self.last, self.changes = [n - 1 for n in counts], steps.changes
        counts, n = cached.num_computed_tokens, len(lives)
        # Each "all one" below counts the ones in a list (each item's identity tested first:
        # 1 is one object), where a set of the items hashed every one.
        if (
            len(counts) != n
            or [*map(operator.sub, counts, self.last)].count(1) != n
            # every one scheduled one token: vLLM's counts all 1 and no more of them than
            # these (its keys are the new and the cached requests), which reads no request
            # id; else each one's (KeyError if not scheduled)
            or (
                (len(scheduled) != n or [*scheduled.values()].count(1) != n)
                and self.scheduled_of(scheduled) != self.one_each
            )
        ):
            return False
        grown: list[Any] = []
        new_block_ids = cached.new_block_ids
        if new_block_ids.count(None) != len(new_block_ids):
            if len(new_block_ids) != len(lives):
                return False
            # Only the requests whose table grew (vLLM gives None for the others): a few.
            for i in itertools.compress(range(len(lives)), new_block_ids):
                group = new_block_ids[i][0]
                if len(group) > 1:
                    return False
                if group:
                    grown += (lives[i].num, group[0])
        try:
            tokens = tuple(map(operator.getitem, self.lists, counts))
        except (IndexError, TypeError):  # a token not known yet; a count that is no index
            return False
        if not rec._decoded(lives, self.nums, tokens, grown, batch=True):
            return False
        self.last = list(counts)  # a copy: vLLM's list is vLLM's
        return True


class SchedulerRecorder:
    """The scheduler role's recording: vLLM's facts in, events out. It reads vLLM's objects
    by duck typing, as ``connector.scheduler`` does, and writes straight to the log (no fold:
    nothing here decides anything, and nothing here may cost the engine more than a copy).

    Steady decode steps (``steady``, the default) are batched: the running requests that
    decoded one token the plainest way go into one ``StepDecoded`` per run of them, each entry
    standing for exactly the ``Scheduled`` it replaces (tracker/recorded_steps.py, whose
    ``RecordedSteps`` follows every event the log took, as every reader follows it). After the
    log dropped a step (a disk that fell behind), every step is written in full: a reader
    cannot resolve request numbers across a gap."""

    def __init__(
        self,
        log: Any,
        *,
        logger: Any = None,
        steady: bool = True,
        token_list: Callable[[Any], list[int] | None] = lambda request: None,
    ) -> None:
        self.log = log  # a LogSink, or None (recording off: the engine runs as unwrapped)
        # A sink that takes a steady step's parts (LogWriter.append_decoded), or None.
        self._append_decoded: Callable[..., None] | None = getattr(log, "append_decoded", None)
        self.step = 0
        self.records_lost = 0
        self.log_error: str | None = None
        self.steady = steady
        self._logger = logger if logger is not None else _log
        # What the log says of each live request (its number, count and known token ids),
        # followed as each event is taken; and the request objects, read for all_token_ids
        # at build_connector_meta.
        self.steps = RecordedSteps()
        self._lives = self.steps.lives
        self._follow = self.steps.follow
        self._requests: dict[str, Any] = {}
        # The list each request's all_token_ids views (connector/edge.py, token_list), read by
        # the hot path; taken again at every Scheduled written in full (an admission, a
        # resumption), so it is never older than the request's current admission. The
        # recorder class hands the edge's reader in (only the classes vLLM loads import the
        # edge); without it every view is read as it is, and no step is steady whole.
        self._token_list = token_list
        self._token_lists: dict[str, list[int] | None] = {}
        # The running requests of the last step that was steady whole (see _Batch).
        self._batch: _Batch | None = None
        # Told of every event before the log takes it (the digests' planner: connector/digests.py).
        self.observe: Callable[[ev.Event], None] | None = None

    # --- writing ------------------------------------------------------------------------

    def write(self, *events: ev.Event) -> None:
        if self.log is None:
            return
        if self.observe is not None:
            self.observe(*events)
        for e in events:
            try:
                self.log.append(e)
            except EncodeError as exc:
                self.lost(type(e).__name__, exc, e.req_id if isinstance(e.req_id, str) else "")
                continue
            except Exception as exc:
                self._log_failed(exc)
                return
            self._follow(e)

    def lost(self, callback: str, exc: BaseException, req_id: str = "") -> None:
        """A record could not be made: say so, count it, and put a ``RecordLost`` in its place."""
        self.records_lost += 1
        self._logger.error(
            "kvledger.record_lost", callback=callback, req_id=req_id, error=_error_text(exc)
        )
        if self.log is None:
            return
        try:
            # The id escaped: the record it could not hold is often lost for its own id.
            self.log.append(ev.RecordLost(self.step, escaped(req_id), callback, _error_text(exc)))
        except Exception as exc2:
            self._log_failed(exc2)

    def _log_failed(self, exc: BaseException) -> None:
        if self.log_error is None:
            self.log_error = _error_text(exc)
            self._logger.error("kvledger.log_failed", step=self.step, error=self.log_error)
        self.log = None

    def end_step(self) -> None:
        if self.log is not None:
            try:
                self.log.end_step(self.step)
            except Exception as exc:
                self._log_failed(exc)
        self.step += 1

    def close(self) -> None:
        close_log(self.log, self._log_failed)

    def seal(self, stop: str) -> bool:
        """The engine was asked to stop (``stop``: how): make the log complete as of now
        (connector/stopping.py; ``LogWriter.seal``)."""
        return seal_log(self.log, stop, self._log_failed)

    def _known(self, req_id: str) -> int:
        """How many of the request's token ids the log holds (0 for a request it lacks)."""
        self.steps.settle()
        life = self._lives.get(req_id)
        return life.known if life is not None else 0

    # --- facts ----------------------------------------------------------------------------

    def see(self, request: Any) -> str:
        """``RequestAdded`` the first time a request object is seen (no ``on_new_request`` on
        older vLLM: connector/edge.py; a reused id is a new object, so a new life)."""
        req_id = str(request.request_id)
        if self._requests.get(req_id) is not request:
            self._requests[req_id] = request
            self._token_lists[req_id] = self._token_list(request)
            prompt = ev.int_tuple(getattr(request, "prompt_token_ids", None) or ())
            salt = str(getattr(request, "cache_salt", None) or "")
            self.write(ev.RequestAdded(self.step, req_id, prompt, salt))
        return req_id

    def lookup(self, request: Any, local_hit: int, answer: Any) -> None:
        req_id = self.see(request)
        tokens = request.all_token_ids
        start = min(self._known(req_id), len(tokens))
        external, load_async = answer
        self.write(
            ev.LookupAsked(
                self.step,
                req_id,
                int(local_hit),
                len(tokens),
                start,
                ev.int_tuple(tokens[start:]),
                status_name(request) == "preempted",
            ),
            ev.InnerLookupAnswered(
                self.step, req_id, -1 if external is None else int(external), bool(load_async)
            ),
        )

    def allocated(self, request: Any, block_ids: tuple[int, ...], num_external: int) -> None:
        req_id = str(request.request_id)
        if req_id not in self._requests:
            self.see(request)
        self.write(ev.Allocated(self.step, req_id, block_ids, int(num_external)))

    def scheduled(self, out: Any) -> None:
        """One ``build_connector_meta``: preemptions first, then every scheduled request; the
        steady ones in ``StepDecoded`` runs (see the class docstring)."""
        preempted = getattr(out, "preempted_req_ids", None)
        if preempted:
            for req_id in sorted(preempted):
                self.write(ev.Preempted(self.step, str(req_id)))
        num_scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            self._guarded_one(
                str(new.req_id),
                ev.Admission.NEW,
                new.num_computed_tokens,
                num_scheduled.get(new.req_id, 0),
                first_group(new.block_ids),
                getattr(new, "prefill_token_ids", None) or new.prompt_token_ids,
            )
        cached = out.scheduled_cached_reqs
        req_ids = cached.req_ids
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        if resumed_ids is None:  # older vLLM: one flag per request (connector/edge.py)
            flags = getattr(cached, "resumed_from_preemption", None) or ()
            resumed_ids = {rid for rid, flag in zip(req_ids, flags, strict=False) if flag}
        # The hot path (a few reads and comparisons per request): a running request that
        # decodes one token at the count the log last gave it, with at most one new block and
        # exactly one new token id, is an entry of a StepDecoded. The log's loss of a step
        # turns it off for good (class docstring).
        steady = self.steady and not getattr(self.log, "lost_frames", 0)
        batch, self._batch = self._batch, None
        if steady and batch is not None:
            try:
                if batch.step(self, cached, num_scheduled, resumed_ids):
                    self._batch = batch
                    return
            except Exception:  # anything unexpected: decided request by request below
                pass
        self.steps.settle()  # the lives, read directly below
        cached_all = getattr(cached, "all_token_ids", None) or {}
        whole = steady  # every cached request an entry, its token read from its list
        scheduled_tokens = num_scheduled.get
        lives, lists = self._lives, self._token_lists
        run: list[Life] = []
        nums: list[int] = []
        tokens: list[Any] = []
        grown: list[Any] = []
        for req_id, nc, blocks in zip(
            req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            if steady:
                try:
                    life = lives.get(req_id)
                    if (
                        life is not None
                        and nc == life.num_tokens
                        and scheduled_tokens(req_id) == 1
                        and req_id not in resumed_ids
                    ):
                        group = blocks[0] if blocks else ()  # one list per KV-cache group
                        known = life.known
                        ids = lists.get(req_id)
                        if ids is None:
                            ids = self._requests[req_id].all_token_ids
                            whole = False
                        # Exactly one id to record: the next one (a synchronous step knows
                        # the one at nc; under async scheduling the last is still unknown).
                        if len(group) <= 1 and (
                            known == nc or (known < nc and len(ids) == known + 1)
                        ):
                            tokens.append(ids[known])  # raises if it is not known yet
                            nums.append(life.num)
                            run.append(life)
                            if group:
                                grown += (life.num, group[0])
                            continue
                except Exception:  # malformed: the full path below records it, or its loss
                    pass
            whole = False
            if run:
                self._decoded(run, nums, tokens, grown)
                run, nums, tokens, grown = [], [], [], []
            self._guarded_one(
                str(req_id),
                ev.Admission.RESUMED if req_id in resumed_ids else ev.Admission.RUNNING,
                nc,
                num_scheduled.get(req_id, 0),
                first_group(blocks),
                cached_all.get(req_id),
            )
        if run and self._decoded(run, nums, tokens, grown) and whole:
            self._batch = _Batch(req_ids, run, nums, lists, self.steps)

    def _decoded(
        self, run: list[Life], nums: Any, tokens: Any, grown: list[Any], batch: bool = False
    ) -> bool:
        """One run of steady steps, as one ``StepDecoded``; its requests advance once the log
        took it (as a reader's ``RecordedSteps.follow`` advances them; a batch's lazily).
        False: lost."""
        if self.log is None:
            return False
        observe = self.observe
        try:
            # The token ids are vLLM's; the writer makes them ints, or says the record is
            # lost (connector/logwriter.py, _packed), off this thread, where it also builds
            # the event (append_decoded). An observer gets them as ints here.
            if observe is None and self._append_decoded is not None:
                self._append_decoded(self.step, nums, ev.int_tuple(grown) if grown else (), tokens)
            else:
                event = ev.StepDecoded(
                    self.step,
                    "",
                    tuple(nums),
                    ev.int_tuple(grown) if grown else (),
                    tokens if observe is None else ev.int_tuple(tokens),
                )
                if observe is not None:
                    observe(event)
                self.log.append(event)
        except EncodeError as exc:  # a token id the log cannot hold: those steps are lost
            self.lost("StepDecoded", exc)
            return False
        except TypeError as exc:  # not an integer
            self.lost("build_connector_meta", exc)
            return False
        except Exception as exc:
            self._log_failed(exc)
            return False
        if batch:
            self.steps.defer(run)
        else:
            self.steps.advance(run)
        return True

    def _guarded_one(
        self,
        req_id: str,
        admission: ev.Admission,
        num_computed: Any,
        num_scheduled: Any,
        block_ids: tuple[int, ...],
        fallback: Any,
    ) -> None:
        try:
            request = self._requests.get(req_id)
            if request is not None:
                self._token_lists[req_id] = self._token_list(request)
            tokens = request.all_token_ids if request is not None else (fallback or ())
            nc, ns = int(num_computed), int(num_scheduled)
            start = min(self._known(req_id), len(tokens))
            end = (
                len(tokens) if admission is not ev.Admission.RUNNING else min(len(tokens), nc + ns)
            )
            ids = ev.int_tuple(tokens[start:end]) if end > start else ()
            self.write(
                ev.Scheduled(
                    self.step, req_id, nc, ns, start, ids, ev.int_tuple(block_ids), admission
                )
            )
        except Exception as exc:
            self.lost("build_connector_meta", exc, req_id)

    def finished(self, request: Any, block_ids: Any, answer: Any) -> None:
        req_id = str(request.request_id)
        self._requests.pop(req_id, None)
        self._token_lists.pop(req_id, None)
        delay, params = answer
        self.write(
            ev.Finished(self.step, req_id, status_name(request) or "finished"),
            ev.InnerFinishedAnswered(
                self.step, req_id, bool(delay), first_group(block_ids), _params_text(params)
            ),
        )

    def connector_output(self, output: Any) -> None:
        """The worker's results of a step, as vLLM hands them to ``update_connector_output``."""
        recving = getattr(output, "finished_recving", None) or ()
        failed = getattr(output, "failed_recving", None) or ()
        sending = getattr(output, "finished_sending", None) or ()
        invalid = getattr(output, "invalid_block_ids", None)
        stats = getattr(output, "kv_connector_stats", None)
        if not (recving or failed or sending or invalid) and stats is None:
            return  # most steps: nothing to record
        failed = set(failed)
        for req_id in sorted(recving):
            self.write(ev.InnerRecvDone(self.step, str(req_id), req_id in failed))
        for req_id in sorted(failed - set(recving)):
            self.write(ev.InnerRecvDone(self.step, str(req_id), True))
        for req_id in sorted(sending):
            self.write(ev.InnerSendDone(self.step, str(req_id)))
        if invalid:
            self.write(ev.InnerLoadErrors(self.step, "", tuple(sorted(int(b) for b in invalid))))
        self.inner_stats("worker", stats)

    def inner_stats(self, side: str, stats: Any) -> None:
        """The inner's stats object of ``side`` (``worker``: in the connector output;
        ``scheduler``: from ``get_kv_connector_stats``), as JSON, unless it is empty."""
        if stats is not None and not _empty_stats(stats):
            self.write(ev.InnerStats(self.step, "", side, _stats_text(stats)))

    def inner_events(self, events: list[Any]) -> None:
        """The inner's KV events of this step (vLLM's ``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``, told apart by name: their fields grew release by release), as
        ``InnerStored`` / ``InnerRemoved``; any other kind is not the pool's and is skipped."""
        for e in events:
            kind = type(e).__name__
            medium = str(getattr(e, "medium", None) or "")
            if kind == "BlockStored":
                parent = getattr(e, "parent_block_hash", None)
                self.write(
                    ev.InnerStored(
                        self.step,
                        "",
                        tuple(_event_key(h) for h in e.block_hashes),
                        b"" if parent is None else _event_key(parent),
                        tuple(int(t) for t in getattr(e, "token_ids", None) or ()),
                        int(getattr(e, "block_size", 0) or 0),
                        medium,
                    )
                )
            elif kind == "BlockRemoved":
                keys = tuple(_event_key(h) for h in e.block_hashes)
                self.write(ev.InnerRemoved(self.step, "", keys, medium))
            elif kind == "AllBlocksCleared":
                self.write(ev.InnerRemoved(self.step, "", (), medium))

    def raised(self, callback: str, exc: BaseException, req_id: str = "") -> None:
        self.write(ev.InnerRaised(self.step, req_id, callback, _error_text(exc)))


def _event_key(h: Any) -> bytes:
    """A KV event's block hash as the log keeps it: vLLM's ``ExternalBlockHash`` is bytes or
    an int (LMCache's chunk hashes are ints of any size): an int becomes ``b"#"`` and its
    decimal digits, so the two kinds never collide."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    return b"#" + str(int(h)).encode()


def _empty_stats(stats: Any) -> bool:
    is_empty = getattr(stats, "is_empty", None)
    try:
        return bool(is_empty()) if callable(is_empty) else False
    except Exception:
        return False
