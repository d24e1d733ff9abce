"""``KVLedgerRecorder``: wrap any vLLM v1 KV connector and record what it was told and what
it answered, in kvledger's log format, for ``kvledger check`` to judge offline.

Load it the way ``KVLedgerConnector`` is loaded, naming the connector it wraps::

    --kv-transfer-config '{"kv_connector": "KVLedgerRecorder",
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
steps into ``StepDecoded`` records (``SchedulerRecorder``, connector/recording.py: what the
scheduler side writes, and its steady decode fast path; this module is the class vLLM loads).

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
from collections.abc import Callable
from typing import Any

from kvledger.connector.config import ConnectorConfigError, RecorderConfig, connector_name
from kvledger.connector.edge import (
    VLLM_VERSION,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    base_args,
    build_connector,
    connector_registry,
    is_scheduler,
    token_list,
)
from kvledger.connector.logfile import open_log
from kvledger.connector.logsafe import safe_logger
from kvledger.connector.recording import RECORDER_FORMAT, SchedulerRecorder
from kvledger.connector.scheduler import first_group
from kvledger.connector.stopping import NO_HOOK, StopHook
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.digests import DIGEST_LOSS

__all__ = [
    "KVLedgerRecorder",
    "RecorderMetadata",
    "RecorderWorkerMetadata",
    "resolve_inner",
]

_log = safe_logger("kvledger.recorder")


# --- resolving and building the inner connector ------------------------------------------


def resolve_inner(name: str) -> Any:
    """The inner connector's class: ``module:Class``, or a name in vLLM's registry."""
    connector_name("inner", name)
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
        if is_scheduler(role):
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
        return SchedulerRecorder(log, steady=config.steady_decode, token_list=token_list)

    def _make_digest_hooks(self, vllm_config: Any, kv_cache_config: Any, role: Any) -> None:
        """The digests' planner (scheduler) or digester (worker), when digests are on."""
        if self.digests == "off":
            return
        from kvledger.connector.digests import (  # torch: only when asked
            RecorderDigests,
            WorkerDigests,
        )

        if is_scheduler(role):
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
            try:
                _optional(self._inner, "on_new_request", None, request)
            except BaseException as exc:
                self._raised("on_new_request", exc, _req_id(request))
                raise

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
                    self._record_lost(DIGEST_LOSS + "plan", exc, None)
            if rec is not None:
                # Every step: inline, where _suppressed costs two calls.
                try:  # noqa: SIM105
                    rec.end_step()
                except Exception:
                    pass
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
            rec = self.recording
            if rec is not None and rec.log is not None:
                try:
                    rec.connector_output(connector_output)
                except Exception as exc:  # a failure costs that record only
                    with _suppressed():
                        rec.lost("update_connector_output", exc)
            if self._digest_planner is not None:  # every output: it counts the steps
                try:
                    digested = self._digest_planner.report(reports)
                    if digested:
                        self.recording_write(*digested)
                except Exception as exc:
                    self._record_lost(DIGEST_LOSS + "report", exc, None)
            try:
                return _optional(self._inner, "update_connector_output", None, connector_output)
            except BaseException as exc:
                self._raised("update_connector_output", exc)
                raise

    def recording_write(self, *events: ev.Event) -> None:
        """Write events (the digests' own) into this step of the log."""
        if self.recording is not None:
            self.recording.write(*events)

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

    def take_events(self) -> Any:
        """The inner's KV events (vLLM collects them every step, published or not), passed on
        as a list and recorded as facts (``InnerStored``, ``InnerRemoved``): what the inner
        stored and dropped is what ``explain`` splits ``not_offered`` by."""
        try:
            events = list(_optional(self._inner, "take_events", ()) or ())
        except BaseException as exc:
            self._raised("take_events", exc)
            raise
        if events:
            self._record("take_events", self._inner_events, events)
        return events

    def _inner_events(self, events: list[Any]) -> None:
        assert self.recording is not None
        self.recording.inner_events(events)

    def get_kv_connector_stats(self) -> Any:
        try:
            stats = _optional(self._inner, "get_kv_connector_stats", None)
        except BaseException as exc:
            self._raised("get_kv_connector_stats", exc)
            raise
        if stats is not None and self.recording is not None:
            self._record("get_kv_connector_stats", self._scheduler_stats, stats)
        return stats

    def _scheduler_stats(self, stats: Any) -> None:
        assert self.recording is not None
        self.recording.inner_stats("scheduler", stats)

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
