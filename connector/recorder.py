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
is where the log goes; ``digests`` (``off``, ``sampled``, ``full``) turns on the KV-content
digests of the worker side.

Three promises, in this order:

1. What the inner returns reaches vLLM unchanged, and an exception the inner raises reaches
   vLLM unchanged (it is recorded as ``InnerRaised`` on the way).
2. A failure of the recording itself never reaches vLLM: it costs the record being written,
   which is replaced by a ``RecordLost`` naming the callback and the error.
3. Facts are copied at the moment of the callback (token ids, block ids), never read later.

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
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connector.config import ENV_LOG_DIR, ConnectorConfigError
from connector.scheduler import first_group
from tracker import events as ev
from tracker.codec import EncodeError
from tracker.config import TrackerConfig

try:  # vLLM >= 0.18: the worker -> scheduler channel
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]
try:  # vLLM >= 0.17 (HMA connectors get request_finished_all_groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    SupportsHMA = None  # type: ignore[assignment,misc]

__all__ = [
    "RECORDER_KEYS",
    "KVLedgerRecorder",
    "RecorderMetadata",
    "RecorderWorkerMetadata",
    "resolve_inner",
]

_log = structlog.get_logger("kvledger.recorder")

# The recorder's own extra-config keys (everything else is refused: a typo fails at startup).
RECORDER_KEYS = frozenset(
    {"inner", "inner_extra_config", "log_dir", "digests", "chunk_size", "log_background"}
)
DIGEST_MODES = ("off", "sampled", "full")
# Stats are recorded as JSON cut to this many characters.
_STATS_CHARS = 4096
# The recorder's log format: bumped when what a recorder writes changes meaning.
RECORDER_FORMAT = 1

_BASE_TAKES_KV_CACHE_CONFIG = "kv_cache_config" in KVConnectorBase_V1.__init__.__code__.co_varnames


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
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
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


def _recorder_extra(kv_transfer_config: Any) -> dict[str, Any]:
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, Mapping):
        raise ConnectorConfigError(f"kv_connector_extra_config must be a map, got {extra!r}")
    unknown = set(extra) - RECORDER_KEYS
    if unknown:
        raise ConnectorConfigError(
            f"KVLedgerRecorder: unknown extra config key(s) {sorted(unknown)}; the recorder "
            f"takes {sorted(RECORDER_KEYS)} (the inner's own keys go in inner_extra_config)"
        )
    if "inner" not in extra:
        raise ConnectorConfigError("KVLedgerRecorder needs `inner`: the connector it wraps")
    inner_extra = extra.get("inner_extra_config", {}) or {}
    if not isinstance(inner_extra, Mapping):
        raise ConnectorConfigError(f"inner_extra_config must be a map, got {inner_extra!r}")
    digests = extra.get("digests", "off")
    if digests not in DIGEST_MODES:
        raise ConnectorConfigError(f"digests must be one of {DIGEST_MODES}, got {digests!r}")
    return dict(extra)


def inner_kv_transfer_config(kv_transfer_config: Any, inner_cls: Any) -> Any:
    """A copy of vLLM's ``kv_transfer_config`` as the inner would see it unwrapped: its own
    name, module path and extra config; every other field (role, engine id...) unchanged."""
    extra = _recorder_extra(kv_transfer_config)
    inner = copy.copy(kv_transfer_config)
    name = extra["inner"]
    fields = {
        "kv_connector": inner_cls.__name__ if ":" in name else name,
        "kv_connector_module_path": inner_cls.__module__ if ":" in name else None,
        "kv_connector_extra_config": dict(extra.get("inner_extra_config") or {}),
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


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return str(getattr(status, "name", status) or "").lower()


class SchedulerRecorder:
    """The scheduler role's recording: vLLM's facts in, events out. It reads vLLM's objects
    by duck typing, as ``connector.scheduler`` does, and writes straight to the log (no fold:
    nothing here decides anything, and nothing here may cost the engine more than a copy)."""

    def __init__(self, log: Any, *, logger: Any = None) -> None:
        self.log = log  # a LogSink, or None (recording off: the engine runs as unwrapped)
        self.step = 0
        self.records_lost = 0
        self.log_error: str | None = None
        self._logger = logger if logger is not None else _log
        # Token ids recorded per live request (the fold's state.token_ids, kept as a count),
        # and the request objects, read for all_token_ids at build_connector_meta.
        self._known: dict[str, int] = {}
        self._requests: dict[str, Any] = {}

    # --- writing ------------------------------------------------------------------------

    def write(self, *events: ev.Event) -> None:
        if self.log is None:
            return
        for e in events:
            try:
                self.log.append(e)
            except EncodeError as exc:
                self.lost(type(e).__name__, exc, e.req_id if isinstance(e.req_id, str) else "")
            except Exception as exc:
                self._log_failed(exc)
                return

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

    # --- facts ----------------------------------------------------------------------------

    def see(self, request: Any) -> str:
        """``RequestAdded`` the first time a request object is seen (vLLM < 0.22 has no
        ``on_new_request``; a reused id is a new object, so a new life)."""
        req_id = str(request.request_id)
        if self._requests.get(req_id) is not request:
            self._requests[req_id] = request
            prompt = ev.int_tuple(getattr(request, "prompt_token_ids", None) or ())
            salt = str(getattr(request, "cache_salt", None) or "")
            self._known[req_id] = len(prompt)
            self.write(ev.RequestAdded(self.step, req_id, prompt, salt))
        return req_id

    def lookup(self, request: Any, local_hit: int, answer: Any) -> None:
        req_id = self.see(request)
        tokens = request.all_token_ids
        start = min(self._known.get(req_id, 0), len(tokens))
        self._known[req_id] = max(self._known.get(req_id, 0), len(tokens))
        external, load_async = answer
        self.write(
            ev.LookupAsked(
                self.step,
                req_id,
                int(local_hit),
                len(tokens),
                start,
                ev.int_tuple(tokens[start:]),
                _status_name(request) == "preempted",
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
        """One ``build_connector_meta``: preemptions first, then every scheduled request."""
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
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        cached_all = getattr(cached, "all_token_ids", None) or {}
        for i, req_id in enumerate(cached.req_ids):
            if resumed_ids is not None:
                resumed = req_id in resumed_ids
            else:
                resumed = bool(resumed_flags[i]) if resumed_flags is not None else False
            self._guarded_one(
                str(req_id),
                ev.Admission.RESUMED if resumed else ev.Admission.RUNNING,
                cached.num_computed_tokens[i],
                num_scheduled.get(req_id, 0),
                first_group(cached.new_block_ids[i]),
                cached_all.get(req_id),
            )

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
            tokens = request.all_token_ids if request is not None else (fallback or ())
            nc, ns = int(num_computed), int(num_scheduled)
            known = self._known.get(req_id, 0)
            start = min(known, len(tokens))
            end = (
                len(tokens) if admission is not ev.Admission.RUNNING else min(len(tokens), nc + ns)
            )
            ids = ev.int_tuple(tokens[start:end]) if end > start else ()
            self._known[req_id] = max(known, end)
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
        self._known.pop(req_id, None)
        delay, params = answer
        self.write(
            ev.Finished(self.step, req_id, _status_name(request) or "finished"),
            ev.InnerFinishedAnswered(
                self.step, req_id, bool(delay), first_group(block_ids), _params_text(params)
            ),
        )

    def connector_output(self, output: Any) -> None:
        """The worker's results of a step, as vLLM hands them to ``update_connector_output``."""
        failed = set(getattr(output, "failed_recving", None) or ())
        for req_id in sorted(getattr(output, "finished_recving", None) or ()):
            self.write(ev.InnerRecvDone(self.step, str(req_id), req_id in failed))
        for req_id in sorted(failed - set(getattr(output, "finished_recving", None) or ())):
            self.write(ev.InnerRecvDone(self.step, str(req_id), True))
        for req_id in sorted(getattr(output, "finished_sending", None) or ()):
            self.write(ev.InnerSendDone(self.step, str(req_id)))
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            self.write(ev.InnerLoadErrors(self.step, "", tuple(sorted(int(b) for b in invalid))))
        stats = getattr(output, "kv_connector_stats", None)
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


def _open_log(log_dir: str, header: dict[str, Any], background: bool) -> tuple[Any, str]:
    from connector.logwriter import LogWriter  # file I/O only when asked for

    os.makedirs(log_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(log_dir, f"kvledger-rec-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:6]}.kvlog")
    return LogWriter(path, header, background=background), path


# --- the connector vLLM loads ---------------------------------------------------------------


class KVLedgerRecorder(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """vLLM's entry point; see the module docstring."""

    # The last inner class built in this process: vLLM calls a few class methods
    # (build_kv_connector_stats) with no config to find the inner by.
    _last_inner_cls: Any = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - vLLM <= 0.11.0
            super().__init__(vllm_config, role)  # type: ignore[call-arg, unused-ignore]
        extra = _recorder_extra(vllm_config.kv_transfer_config)
        self.recorder_config = extra
        self.inner_cls = resolve_inner(extra["inner"])
        KVLedgerRecorder._last_inner_cls = self.inner_cls
        self.inner_vllm_config = inner_vllm_config(vllm_config, self.inner_cls)
        if _BASE_TAKES_KV_CACHE_CONFIG:
            self._inner = self.inner_cls(self.inner_vllm_config, role, kv_cache_config)
        else:  # pragma: no cover
            self._inner = self.inner_cls(self.inner_vllm_config, role)
        if hasattr(self._inner, "_cache_hit_source"):  # a metrics label vLLM reads
            self._cache_hit_source = self._inner._cache_hit_source
        if SupportsHMA is not None and isinstance(self._inner, SupportsHMA):
            # vLLM calls request_finished_all_groups on an HMA connector (an isinstance test
            # at each call): be one exactly when the inner is.
            self.__class__ = _hma_variant()
        self.digests = str(extra.get("digests", "off"))
        # The digests' hooks (connector/digests.py fills them; None: digests off).
        self._digest_planner: Any = None
        self._digester: Any = None
        self.recording: SchedulerRecorder | None = None
        self.log_path: str | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.recording = self._start_recording(vllm_config, extra)
        self._make_digest_hooks(vllm_config, kv_cache_config, role)

    def _start_recording(self, vllm_config: Any, extra: dict[str, Any]) -> SchedulerRecorder:
        log_dir = extra.get("log_dir") or os.environ.get(ENV_LOG_DIR)
        log = None
        if log_dir:
            import vllm

            block_size = int(vllm_config.cache_config.block_size)
            chunk = int(extra.get("chunk_size", 256))
            if chunk % block_size:
                chunk = max(block_size, chunk // block_size * block_size)
            tracker_config = TrackerConfig(block_size=block_size, chunk_size=chunk)
            header = {
                **tracker_config.to_dict(),
                "vllm_version": getattr(vllm, "__version__", "?"),
                "recorder": {
                    "format": RECORDER_FORMAT,
                    "inner": str(extra["inner"]),
                    "inner_class": f"{self.inner_cls.__module__}.{self.inner_cls.__qualname__}",
                    "digests": str(extra.get("digests", "off")),
                    "kv_role": str(getattr(vllm_config.kv_transfer_config, "kv_role", "")),
                },
            }
            try:
                log, self.log_path = _open_log(
                    str(log_dir), header, bool(extra.get("log_background", True))
                )
            except Exception as exc:  # serve without a record, said loudly
                _log.error("kvledger.log_unavailable", log_dir=str(log_dir), error=repr(exc))
        return SchedulerRecorder(log)

    def _make_digest_hooks(self, vllm_config: Any, kv_cache_config: Any, role: Any) -> None:
        """The digests' planner (scheduler) or digester (worker), when digests are on and
        ``connector.digests`` provides them; the recorder works without them."""
        if self.digests == "off":
            return
        try:
            from connector import digests  # type: ignore[attr-defined, unused-ignore]
        except ImportError:
            _log.warning("kvledger.digests_unavailable", mode=self.digests)
            return
        make = getattr(digests, "make_recorder_hooks", None)
        if make is None:
            _log.warning("kvledger.digests_unavailable", mode=self.digests)
            return
        hooks = make(self, vllm_config, kv_cache_config, role)
        if role == KVConnectorRole.SCHEDULER:
            self._digest_planner = hooks
        else:
            self._digester = hooks

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
        # vLLM < 0.30 has no such property (and never asks): False, a best-effort cache.
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
        self._record("on_new_request", self._see, request)
        _optional(self._inner, "on_new_request", None, request)

    def _see(self, request: Any) -> None:
        assert self.recording is not None
        self.recording.see(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
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
            if self.recording is not None:
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
        inner_cls = resolve_inner(_recorder_extra(vllm_config.kv_transfer_config)["inner"])
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
        inner_cls = resolve_inner(_recorder_extra(kv_transfer_config)["inner"])
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
        inner_cls = resolve_inner(_recorder_extra(vllm_config.kv_transfer_config)["inner"])
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
