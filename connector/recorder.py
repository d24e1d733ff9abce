"""``KVLedgerRecorder``: wrap any vLLM v1 KV connector and record what it was told and what
it answered, in kvledger's log format, for ``kvledger check`` to judge offline.

Load it the way ``KVLedgerConnector`` is loaded, naming the connector it wraps::

    --kv-transfer-config '{"kv_connector": "KVLedgerRecorder",
                           "kv_connector_module_path": "connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "inner": "LMCacheConnectorV1",
                               "inner_extra_config": {},
                               "log_dir": "/var/log/kvledger"}}'

``inner`` is a name in vLLM's connector registry or ``module:Class``; ``inner_extra_config``
becomes the inner's own ``kv_connector_extra_config`` (it sees a copy of the vLLM config whose
``kv_transfer_config`` carries it, under its own name). ``log_dir`` (or ``KVLEDGER_LOG_DIR``)
is where the log goes, and the other log keys (``log_rotate_bytes``, ``log_fsync``,
``log_background``, ``log_queue_bytes``, ``log_required``) mean what they mean for
``KVLedgerConnector``: both classes read their settings through connector/config.py and open
the log through connector/logfile.py. ``digests`` (``off``, ``sampled``, ``full``) turns on the
KV-content digests of the worker side; ``steady_decode`` (default true) batches steady decode
steps into ``StepDecoded`` records (``SchedulerRecorder``).

Three promises, in this order:

1. What the inner returns reaches vLLM unchanged, and an exception the inner raises reaches
   vLLM unchanged (it is recorded as ``InnerRaised`` on the way).
2. A failure of the recording itself never reaches vLLM: it costs the record being written,
   which is replaced by a ``RecordLost`` naming the callback and the error.
3. Facts are copied at the moment of the callback (token ids, block ids), never read later
   (a request's token ids are read from vLLM's list of them at ``build_connector_meta``, as
   ``connector.scheduler`` reads them).

Where the inner lacks a method, the base class's default runs on the inner, which is exactly
what vLLM does for that connector unwrapped. Every method and property of the installed
vLLM's ``KVConnectorBase_V1`` is forwarded (the ones not written out below are generated at
import from the base class, so a method a later vLLM adds is forwarded too).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import importlib
import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from connector.config import ConnectorConfigError, RecorderConfig
from connector.edge import (
    VLLM_VERSION,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    base_args,
    build_connector,
    connector_registry,
    token_list,
)
from connector.logfile import open_log
from connector.scheduler import first_group, status_name
from connector.stopping import NO_HOOK, StopHook
from tracker import events as ev
from tracker.codec import EncodeError
from tracker.config import TrackerConfig
from tracker.recorded_steps import Life, RecordedSteps

__all__ = [
    "RECORDER_KEYS",
    "KVLedgerRecorder",
    "RecorderMetadata",
    "RecorderWorkerMetadata",
    "resolve_inner",
]

_log = structlog.get_logger("kvledger.recorder")

# The recorder's own extra-config keys (everything else is refused: a typo fails at startup).
RECORDER_KEYS = frozenset(f.name for f in RecorderConfig.__attrs_attrs__)
# Stats are recorded as JSON cut to this many characters.
_STATS_CHARS = 4096
# The recorder's log format: bumped when what a recorder writes changes meaning. 2: steady
# decode steps may come as StepDecoded entries (tracker/recorded_steps.py).
RECORDER_FORMAT = 2


# --- resolving and building the inner connector ------------------------------------------


def resolve_inner(name: str) -> Any:
    """The inner connector's class: ``module:Class``, or a name in vLLM's registry."""
    if not isinstance(name, str) or not name:
        raise ConnectorConfigError(
            f"inner must name a connector (a vLLM registry name or module:Class), got {name!r}"
        )
    if ":" in name:
        module_name, _, cls_name = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConnectorConfigError(f"inner {name!r}: cannot import {module_name}: {e}") from e
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            raise ConnectorConfigError(f"inner {name!r}: {module_name} has no class {cls_name}")
        return cls
    registry = connector_registry()
    if name not in registry:
        known = ", ".join(sorted(registry))
        raise ConnectorConfigError(
            f"inner {name!r} is not in vLLM's connector registry (known: {known}); "
            "or name it as module:Class"
        )
    cls = registry[name]()
    if cls.__name__ == "KVLedgerRecorder":
        raise ConnectorConfigError("inner cannot be KVLedgerRecorder itself")
    return cls


def recorder_config(kv_transfer_config: Any) -> RecorderConfig:
    """The recorder's settings from vLLM's ``kv_transfer_config``: every key validated as
    ``KVLedgerConnector`` validates it (connector/config.py)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    return RecorderConfig.from_extra_config(extra)


def inner_kv_transfer_config(kv_transfer_config: Any, inner_cls: Any) -> Any:
    """A copy of vLLM's ``kv_transfer_config`` as the inner would see it unwrapped: its own
    name, module path and extra config; every other field (role, engine id...) unchanged."""
    config = recorder_config(kv_transfer_config)
    inner = copy.copy(kv_transfer_config)
    name = config.inner
    fields = {
        "kv_connector": inner_cls.__name__ if ":" in name else name,
        "kv_connector_module_path": inner_cls.__module__ if ":" in name else None,
        "kv_connector_extra_config": dict(config.inner_extra_config),
    }
    for key, value in fields.items():
        object.__setattr__(inner, key, value)  # a frozen or validating dataclass: no checks
    return inner


def inner_vllm_config(vllm_config: Any, inner_cls: Any) -> Any:
    """A shallow copy of ``vllm_config`` carrying the inner's ``kv_transfer_config``."""
    ktc = inner_kv_transfer_config(vllm_config.kv_transfer_config, inner_cls)
    config = copy.copy(vllm_config)
    object.__setattr__(config, "kv_transfer_config", ktc)
    return config


# --- the metadata the recorder wraps ------------------------------------------------------


class RecorderMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler -> worker: the inner's metadata, untouched, and the digests' plan (None
    when digests are off)."""

    def __init__(self, inner: Any, digest_plan: Any = None) -> None:
        self.inner = inner
        self.digest_plan = digest_plan


class RecorderWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc, unused-ignore]
    """Worker -> scheduler: the inner's worker metadata, untouched, and the digests' reports
    (one per rank). ``aggregate`` aggregates the inner's with the inner's own method."""

    def __init__(self, inner: Any, digest_reports: tuple[Any, ...] = ()) -> None:
        self.inner = inner
        self.digest_reports = digest_reports

    def aggregate(self, other: Any) -> RecorderWorkerMetadata:
        if not isinstance(other, RecorderWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with RecorderWorkerMetadata")
        if self.inner is None:
            inner = other.inner
        elif other.inner is None:
            inner = self.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return RecorderWorkerMetadata(inner, self.digest_reports + other.digest_reports)


# --- what the scheduler side writes ------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


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
_NEXT = (1).__add__


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

    __slots__ = ("changes", "counts", "lists", "lives", "nums", "req_ids")

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
        self.counts = list(map(_NUM_TOKENS, lives))  # each life's count, as the log gives it
        self.changes = steps.changes

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
            self.counts, self.changes = counts, steps.changes
        counts = self.counts
        if (
            cached.num_computed_tokens != counts
            # every one scheduled (KeyError if not) one token (each at least one: the sum)
            or sum(map(scheduled.__getitem__, req_ids)) != len(req_ids)
        ):
            return False
        grown: list[Any] = []
        new_block_ids = cached.new_block_ids
        if new_block_ids.count(None) != len(new_block_ids):
            for life, blocks in zip(lives, new_block_ids, strict=True):
                if blocks:
                    group = blocks[0]
                    if len(group) > 1:
                        return False
                    if group:
                        grown += (life.num, group[0])
        try:
            tokens = list(map(operator.getitem, self.lists, counts))
        except IndexError:  # a token not known yet
            return False
        if not rec._decoded(lives, self.nums, tokens, grown, batch=True):
            return False
        self.counts = list(map(_NEXT, counts))
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

    def __init__(self, log: Any, *, logger: Any = None, steady: bool = True) -> None:
        self.log = log  # a LogSink, or None (recording off: the engine runs as unwrapped)
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
        # resumption), so it is never older than the request's current admission.
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
            self.log.append(ev.RecordLost(self.step, req_id, callback, _error_text(exc)))
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
        closer = getattr(self.log, "close", None)
        if closer is not None:
            try:
                closer()
            except Exception as exc:
                self._log_failed(exc)

    def seal(self, stop: str) -> bool:
        """The engine was asked to stop (``stop``: how): make the log complete as of now
        (connector/stopping.py; ``LogWriter.seal``)."""
        sealer = getattr(self.log, "seal", None)
        if sealer is None:
            return False
        try:
            return bool(sealer(stop))
        except Exception as exc:
            self._log_failed(exc)
            return False

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
            self._token_lists[req_id] = token_list(request)
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
        for req_id in sorted(getattr(out, "preempted_req_ids", None) or ()):
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
        cached_all = getattr(cached, "all_token_ids", None) or {}
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
        self, run: list[Life], nums: Any, tokens: list[Any], grown: list[Any], batch: bool = False
    ) -> bool:
        """One run of steady steps, as one ``StepDecoded``; its requests advance once the log
        took it (as a reader's ``RecordedSteps.follow`` advances them; a batch's lazily).
        False: lost."""
        if self.log is None:
            return False
        try:
            event = ev.StepDecoded(
                self.step,
                "",
                tuple(nums),
                ev.int_tuple(grown) if grown else (),
                ev.int_tuple(tokens),
            )
            if self.observe is not None:
                self.observe(event)
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
                self._token_lists[req_id] = token_list(request)
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
        failed = set(getattr(output, "failed_recving", None) or ())
        sending = getattr(output, "finished_sending", None) or ()
        invalid = getattr(output, "invalid_block_ids", None)
        stats = getattr(output, "kv_connector_stats", None)
        if not (recving or failed or sending or invalid) and stats is None:
            return  # most steps: nothing to record
        for req_id in sorted(recving):
            self.write(ev.InnerRecvDone(self.step, str(req_id), req_id in failed))
        for req_id in sorted(failed - set(recving)):
            self.write(ev.InnerRecvDone(self.step, str(req_id), True))
        for req_id in sorted(sending):
            self.write(ev.InnerSendDone(self.step, str(req_id)))
        if invalid:
            self.write(ev.InnerLoadErrors(self.step, "", tuple(sorted(int(b) for b in invalid))))
        if stats is not None and not _empty_stats(stats):
            self.write(ev.InnerStats(self.step, "", "worker", _stats_text(stats)))

    def raised(self, callback: str, exc: BaseException, req_id: str = "") -> None:
        self.write(ev.InnerRaised(self.step, req_id, callback, _error_text(exc)))


def _empty_stats(stats: Any) -> bool:
    is_empty = getattr(stats, "is_empty", None)
    try:
        return bool(is_empty()) if callable(is_empty) else False
    except Exception:
        return False


# --- the connector vLLM loads ---------------------------------------------------------------


class KVLedgerRecorder(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """vLLM's entry point; see the module docstring."""

    # The last inner class built in this process: vLLM calls a few class methods
    # (build_kv_connector_stats) with no config to find the inner by.
    _last_inner_cls: Any = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(*base_args(vllm_config, role, kv_cache_config))
        config = recorder_config(vllm_config.kv_transfer_config)
        self.recorder_config = config
        self.inner_cls = resolve_inner(config.inner)
        KVLedgerRecorder._last_inner_cls = self.inner_cls
        self.inner_vllm_config = inner_vllm_config(vllm_config, self.inner_cls)
        # The chunk size check --differential gives kvledger's pool: refused now, before the
        # inner exists, if it is not whole blocks (as for KVLedgerConnector).
        block_size = int(vllm_config.cache_config.block_size)
        chunk_size = config.chunk_size_for(block_size)
        self._inner = build_connector(self.inner_cls, self.inner_vllm_config, role, kv_cache_config)
        if hasattr(self._inner, "_cache_hit_source"):  # a metrics label vLLM reads
            self._cache_hit_source = self._inner._cache_hit_source
        if SupportsHMA is not None and isinstance(self._inner, SupportsHMA):
            # vLLM calls request_finished_all_groups on an HMA connector (an isinstance test
            # at each call): be one exactly when the inner is.
            self.__class__ = _hma_variant()
        self.digests = config.digests
        # The digests' hooks (connector/digests.py's; None: digests off).
        self._digest_planner: Any = None
        self._digester: Any = None
        self.recording: SchedulerRecorder | None = None
        self.log_path: str | None = None
        # Wraps every scheduler callback that records (connector/stopping.py): the log is
        # sealed when a stop signal arrives, as KVLedgerConnector's is.
        self._stop: StopHook | Any = NO_HOOK
        if role == KVConnectorRole.SCHEDULER:
            self.recording = self._start_recording(vllm_config, config, block_size, chunk_size)
            if self.log_path is not None:
                self._stop = StopHook(self.recording.seal, self.recording.close)
                self._stop.install()
        self._make_digest_hooks(vllm_config, kv_cache_config, role)

    def _start_recording(
        self, vllm_config: Any, config: RecorderConfig, block_size: int, chunk_size: int
    ) -> SchedulerRecorder:
        header = {
            **TrackerConfig(block_size=block_size, chunk_size=chunk_size).to_dict(),
            "vllm_version": VLLM_VERSION,
            "recorder": {
                "format": RECORDER_FORMAT,
                "inner": config.inner,
                "inner_class": f"{self.inner_cls.__module__}.{self.inner_cls.__qualname__}",
                "digests": config.digests,
                "kv_role": str(getattr(vllm_config.kv_transfer_config, "kv_role", "")),
            },
        }
        # The log's settings and its policy for a directory that cannot be written are
        # KVLedgerConnector's (connector/logfile.py): served without a log, said loudly,
        # unless log_required.
        log, self.log_path, _ = open_log(config, header, kind="recorder", logger=_log)
        return SchedulerRecorder(log, steady=config.steady_decode)

    def _make_digest_hooks(self, vllm_config: Any, kv_cache_config: Any, role: Any) -> None:
        """The digests' planner (scheduler) or digester (worker), when digests are on."""
        if self.digests == "off":
            return
        from connector.digests import RecorderDigests, WorkerDigests  # torch: only when asked

        if role == KVConnectorRole.SCHEDULER:
            block_size = int(vllm_config.cache_config.block_size)
            self._digest_planner = RecorderDigests(self.recording, block_size)
        else:
            rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0)
            self._digester = WorkerDigests(self.digests, rank=rank)

    # --- recording helpers ----------------------------------------------------------------

    @property
    def inner(self) -> Any:
        """The wrapped connector."""
        return self._inner

    def _record(self, callback: str, fn: Callable[..., None], *args: Any) -> None:
        """Run one recording step; a failure costs that record only, never the engine."""
        rec = self.recording
        if rec is None or rec.log is None:  # no log (none asked for, or it failed): forward only
            return
        try:
            fn(*args)
        except Exception as exc:
            rid = ""
            request = args[0] if args else None
            with _suppressed():
                rid = str(request.request_id)  # type: ignore[union-attr]
            with _suppressed():
                rec.lost(callback, exc, rid)

    def _raised(self, callback: str, exc: BaseException, req_id: str = "") -> None:
        rec = self.recording
        if rec is not None:
            with _suppressed():
                rec.raised(callback, exc, req_id)

    # --- properties -----------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        # Not asked by older vLLM (connector/edge.py): False, a best-effort cache.
        return bool(getattr(self._inner, "requires_kv_delivery", False))

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(getattr(self._inner, "supports_divergent_local_hybrid_hits", False))

    def __getattr__(self, name: str) -> Any:
        # Attributes vLLM reads off a connector that the base class sets as plain attributes
        # (``_cache_hit_source``...), or that a newer inner has: the inner's. Only reached
        # when normal lookup fails, so never for the recorder's own.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # --- scheduler side: the recorded callbacks ---------------------------------------------

    def on_new_request(self, request: Any) -> None:
        with self._stop:
            self._record("on_new_request", self._see, request)
            _optional(self._inner, "on_new_request", None, request)

    def _see(self, request: Any) -> None:
        assert self.recording is not None
        self.recording.see(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        with self._stop:
            try:
                answer = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
            except BaseException as exc:
                self._record("get_num_new_matched_tokens", self._lookup_raised, request, exc)
                raise
            self._record(
                "get_num_new_matched_tokens", self._lookup, request, num_computed_tokens, answer
            )
            return answer

    def _lookup(self, request: Any, num_computed_tokens: int, answer: Any) -> None:
        assert self.recording is not None
        self.recording.lookup(request, num_computed_tokens, answer)

    def _lookup_raised(self, request: Any, exc: BaseException) -> None:
        assert self.recording is not None
        req_id = self.recording.see(request)
        self.recording.raised("get_num_new_matched_tokens", exc, req_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        with self._stop:
            # Copied before the inner runs: it may not change them, but it could.
            block_ids: tuple[int, ...] = ()
            try:
                block_ids = ev.int_tuple(first_group(blocks))
            except Exception as exc:
                self._record_lost("update_state_after_alloc", exc, request)
            self._record(
                "update_state_after_alloc", self._allocated, request, block_ids, num_external_tokens
            )
            try:
                return self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
            except BaseException as exc:
                self._raised("update_state_after_alloc", exc, _req_id(request))
                raise

    def _allocated(self, request: Any, block_ids: tuple[int, ...], n: int) -> None:
        assert self.recording is not None
        self.recording.allocated(request, block_ids, n)

    def _record_lost(self, callback: str, exc: BaseException, request: Any) -> None:
        if self.recording is not None:
            with _suppressed():
                self.recording.lost(callback, exc, _req_id(request))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        with self._stop:
            rec = self.recording
            if rec is not None and rec.log is not None:
                try:
                    rec.scheduled(scheduler_output)
                except Exception as exc:
                    self._record_lost("build_connector_meta", exc, None)
            try:
                meta = self._inner.build_connector_meta(scheduler_output)
            except BaseException as exc:
                self._raised("build_connector_meta", exc)
                if rec is not None:
                    with _suppressed():
                        rec.end_step()
                raise
            plan = None
            if self._digest_planner is not None:
                try:
                    plan = self._digest_planner.plan(scheduler_output)
                except Exception as exc:
                    self._record_lost("digest_plan", exc, None)
            if rec is not None:
                with _suppressed():
                    rec.end_step()
            return RecorderMetadata(meta, plan)

    def update_connector_output(self, connector_output: Any) -> Any:
        with self._stop:
            reports: tuple[Any, ...] = ()
            wrapped = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(wrapped, RecorderWorkerMetadata):
                reports = wrapped.digest_reports
                connector_output = dataclasses.replace(
                    connector_output, kv_connector_worker_meta=wrapped.inner
                )
            self._record("update_connector_output", self._output, connector_output)
            if reports and self._digest_planner is not None:
                try:
                    self.recording_write(*self._digest_planner.report(reports))
                except Exception as exc:
                    self._record_lost("digest_report", exc, None)
            try:
                return _optional(self._inner, "update_connector_output", None, connector_output)
            except BaseException as exc:
                self._raised("update_connector_output", exc)
                raise

    def recording_write(self, *events: ev.Event) -> None:
        """Write events (the digests' own) into this step of the log."""
        if self.recording is not None:
            self.recording.write(*events)

    def _output(self, connector_output: Any) -> None:
        assert self.recording is not None
        self.recording.connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        with self._stop:
            try:
                answer = self._inner.request_finished(request, block_ids)
            except BaseException as exc:
                self._raised("request_finished", exc, _req_id(request))
                raise
            self._record("request_finished", self._finished, request, block_ids, answer)
            return answer

    def _finished(self, request: Any, block_ids: Any, answer: Any) -> None:
        assert self.recording is not None
        self.recording.finished(request, block_ids, answer)

    def get_kv_connector_stats(self) -> Any:
        stats = _optional(self._inner, "get_kv_connector_stats", None)
        if stats is not None and self.recording is not None:
            self._record("get_kv_connector_stats", self._scheduler_stats, stats)
        return stats

    def _scheduler_stats(self, stats: Any) -> None:
        assert self.recording is not None
        if not _empty_stats(stats):
            self.recording.write(
                ev.InnerStats(self.recording.step, "", "scheduler", _stats_text(stats))
            )

    def shutdown(self) -> Any:
        try:
            return self._inner.shutdown()
        finally:
            if isinstance(self._stop, StopHook):
                self._stop.close()  # closes the log, gives the signals back
            elif self.recording is not None:
                self.recording.close()

    # --- worker side: unwrap the metadata, run the digests' hooks -----------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> Any:
        result = self._inner.register_kv_caches(kv_caches)
        if self._digester is not None:
            try:
                self._digester.register_kv_caches(kv_caches)
            except Exception as exc:
                _log.error("kvledger.digests_failed", where="register_kv_caches", error=repr(exc))
                self._digester = None
        return result

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        inner = _unwrap(connector_metadata)
        self._inner.bind_connector_metadata(inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._inner.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> Any:
        return _optional(self._inner, "handle_preemptions", None, _unwrap(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> Any:
        self._digest_hook("before_load")
        return self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> Any:
        result = self._inner.wait_for_save()
        self._digest_hook("after_forward")
        return result

    def _digest_hook(self, name: str) -> None:
        digester = self._digester
        if digester is None:
            return
        plan = getattr(self._connector_metadata, "digest_plan", None)
        try:
            getattr(digester, name)(plan)
        except Exception as exc:  # a digest is never worth the engine
            _log.error("kvledger.digests_failed", where=name, error=repr(exc))

    def build_connector_worker_meta(self) -> Any:
        inner = _optional(self._inner, "build_connector_worker_meta", None)
        report = None
        if self._digester is not None:
            try:
                report = self._digester.report()
            except Exception as exc:
                _log.error("kvledger.digests_failed", where="report", error=repr(exc))
        if report is None:
            if inner is None:
                return None
            return RecorderWorkerMetadata(inner)
        return RecorderWorkerMetadata(inner, (report,))

    # --- class methods: answered by the inner's class -------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner_cls = resolve_inner(recorder_config(vllm_config.kv_transfer_config).inner)
        result = inner_cls.get_required_kvcache_layout(inner_vllm_config(vllm_config, inner_cls))
        return None if result is None else str(result)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner_cls = resolve_inner((extra_config or {}).get("inner", ""))
        method = getattr(inner_cls, "requires_piecewise_for_cudagraph", None)
        if method is None:
            return False
        return bool(method(dict((extra_config or {}).get("inner_extra_config") or {})))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        inner_cls = resolve_inner(recorder_config(kv_transfer_config).inner)
        method = getattr(inner_cls, "supports_sleep_mode", None)
        if method is None:
            return True
        return bool(method(inner_kv_transfer_config(kv_transfer_config, inner_cls)))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        inner_cls = cls._last_inner_cls
        if inner_cls is None:
            return None
        return inner_cls.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        inner_cls = resolve_inner(recorder_config(vllm_config.kv_transfer_config).inner)
        return inner_cls.build_prom_metrics(
            inner_vllm_config(vllm_config, inner_cls), *args, **kwargs
        )


def _req_id(request: Any) -> str:
    try:
        return str(request.request_id)
    except Exception:
        return ""


def _optional(inner: Any, name: str, default: Any, *args: Any) -> Any:
    """``inner.name(*args)``, or ``default`` where the inner (built on an older vLLM's base
    class) has no such method: what that vLLM does for a connector without it (it never calls
    it). A rig driving an older vLLM's connector in 0.33's order gets the same."""
    method = getattr(inner, name, None)
    return default if method is None else method(*args)


def _unwrap(meta: Any) -> Any:
    return meta.inner if isinstance(meta, RecorderMetadata) else meta


class _suppressed:
    """``contextlib.suppress(Exception)``, without its import-time cost on the hot path."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, Exception)


# The methods of the base class not written out above: forwarded to the inner as they are
# (the base default runs on the inner where it has none: vLLM's behaviour unwrapped).
_WRITTEN = set(vars(KVLedgerRecorder))
_NOT_FORWARDED = {
    # The recorder's own metadata bookkeeping: it binds the wrapper, the inner gets its own.
    "_get_connector_metadata",
    "has_connector_metadata",
    "role",
}


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: KVLedgerRecorder, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    forward.__name__ = name
    forward.__qualname__ = f"KVLedgerRecorder.{name}"
    return forward


def _forward_property(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


FORWARDED: tuple[str, ...] = ()
for _name, _value in list(vars(KVConnectorBase_V1).items()):
    if _name.startswith("__") or _name in _WRITTEN or _name in _NOT_FORWARDED:
        continue
    if isinstance(_value, property):
        setattr(KVLedgerRecorder, _name, _forward_property(_name))
    elif isinstance(_value, (classmethod, staticmethod)):
        continue  # written out above where vLLM calls them; the rest keep the base's
    elif callable(_value):
        setattr(KVLedgerRecorder, _name, _forwarder(_name))
    else:
        continue
    FORWARDED += (_name,)
abc.update_abstractmethods(KVLedgerRecorder)  # type: ignore[type-abstract]  # the forwarders implement the abstract ones


_HMA_CLASS: list[type] = []


def _hma_variant() -> type:
    """``KVLedgerRecorder`` that is also ``SupportsHMA``, forwarding
    ``request_finished_all_groups`` (and recording it like ``request_finished``)."""
    if _HMA_CLASS:
        return _HMA_CLASS[0]
    assert SupportsHMA is not None

    def request_finished_all_groups(self: KVLedgerRecorder, request: Any, block_ids: Any) -> Any:
        with self._stop:
            try:
                answer = self._inner.request_finished_all_groups(request, block_ids)
            except BaseException as exc:
                self._raised("request_finished_all_groups", exc, _req_id(request))
                raise
            self._record("request_finished_all_groups", self._finished, request, block_ids, answer)
            return answer

    cls = type(
        "KVLedgerRecorder",
        (KVLedgerRecorder, SupportsHMA),
        {"request_finished_all_groups": request_finished_all_groups, "__module__": __name__},
    )
    _HMA_CLASS.append(cls)
    return cls
