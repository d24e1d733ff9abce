"""``kv_connector_extra_config``: every key, its default, and its validation, for both
connector classes vLLM loads.

An unknown key or a bad value is an error at construction that names the key and what is
accepted, so a typo in ``--kv-transfer-config`` fails at startup instead of silently running
with defaults. A key means the same in ``KVLedgerConnector`` (:class:`ConnectorConfig`) and
``KVLedgerRecorder`` (:class:`RecorderConfig`): each key has one validator (:data:`_CHECKS`),
so a bad value gets the same error from both; the event log's keys are declared once
(:class:`LogSettings`, which both classes' settings extend).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs

from tracker.digests import DIGEST_MODES

__all__ = [
    "ENV_LOG_DIR",
    "ConnectorConfig",
    "ConnectorConfigError",
    "LogSettings",
    "RecorderConfig",
    "check_chunk_size",
]

# Turns the event log on without touching the serving command line.
ENV_LOG_DIR = "KVLEDGER_LOG_DIR"

# The recorder's default chunk size for `check --differential` (when not given, the largest
# multiple of vLLM's block size not above it).
DEFAULT_CHUNK_SIZE = 256


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` key is unknown or its value is out of range."""


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConnectorConfigError(f"{name} must be true or false, got {value!r}")


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConnectorConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _redis_url(value: Any) -> str:
    """A Redis URL redis-py accepts, checked without importing it (the password is never
    echoed back)."""
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"remote_url must be a Redis URL string, got {value!r}")
    parts = urlsplit(value)
    shown = value if parts.password is None else value.replace(parts.password, "***")
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConnectorConfigError(
            f"remote_url must start with redis://, rediss:// or unix://, got {shown!r}"
        )
    try:
        port = parts.port
    except ValueError:
        raise ConnectorConfigError(f"remote_url has a bad port: {shown!r}") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ConnectorConfigError(f"remote_url names no socket path: {shown!r}")
    elif not parts.hostname:
        raise ConnectorConfigError(f"remote_url names no host: {shown!r}")
    db = parts.path.lstrip("/") if parts.scheme != "unix" else ""
    if db and not db.isdigit():
        raise ConnectorConfigError(
            f"remote_url's database must be a number (redis://host:{port or 6379}/0), got {shown!r}"
        )
    return value


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConnectorConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _fsync_mode(name: str, value: Any) -> str:
    if value not in ("close", "step", "never"):
        raise ConnectorConfigError(f"{name} must be 'close', 'step' or 'never', got {value!r}")
    return str(value)


def _digest_mode(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in DIGEST_MODES:
        raise ConnectorConfigError(
            f"{name} must be one of {', '.join(map(repr, DIGEST_MODES))}, got {value!r}"
        )
    return value


def _path(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConnectorConfigError(f"{name} must be a path string, got {value!r}")
    return value


def _connector_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(
            f"{name} must name a connector (a vLLM registry name or module:Class), got {value!r}"
        )
    return value


def _map(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConnectorConfigError(f"{name} must be a map, got {value!r}")
    return dict(value)


# One validator per key, for both classes. (remote_url has its own: ConnectorConfig.)
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(
        (
            "chunk_size",
            "host_pool_bytes",
            "log_rotate_bytes",
            "log_queue_bytes",
            "remote_timeout_ms",
            "remote_lookup_timeout_ms",
            "remote_retry_ms",
            "remote_max_chunk_bytes",
        ),
        _pos_int,
    ),
    **dict.fromkeys(
        (
            "save_decode_cache",
            "discard_partial_chunks",
            "strict",
            "log_background",
            "log_required",
            "steady_decode",
        ),
        _bool,
    ),
    "remote_ttl_s": _nonneg_int,
    "log_fsync": _fsync_mode,
    "digests": _digest_mode,
    "log_dir": _path,
    "inner": _connector_name,
    "inner_extra_config": _map,
}


def _read(
    cls: type, extra: Any, environ: Mapping[str, str] | None, *, hint: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the validated values of ``extra``'s keys, ``extra`` as a dict): an unknown key or a
    bad value raises :class:`ConnectorConfigError` naming it. ``log_dir`` falls back on the
    environment (:data:`ENV_LOG_DIR`)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConnectorConfigError(f"kv_connector_extra_config must be a map, got {extra!r}")
    extra = dict(extra)
    environ = os.environ if environ is None else environ
    known = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; accepted keys: "
            f"{sorted(known)}{hint}"
        )
    values = {name: _CHECKS[name](name, extra[name]) for name in extra if name in _CHECKS}
    values["log_dir"] = _path("log_dir", extra.get("log_dir", environ.get(ENV_LOG_DIR) or None))
    return values, extra


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """A chunk is whole blocks of vLLM's: the rule of both classes."""
    if chunk_size % block_size:
        raise ConnectorConfigError(
            f"chunk_size ({chunk_size}) must be a multiple of vLLM's block_size "
            f"({block_size}); for example {block_size * max(1, chunk_size // block_size)}"
        )


@attrs.frozen
class LogSettings:
    """The event log's settings: the same keys, defaults and meaning for both classes
    (connector/logfile.py opens the log by them)."""

    log_dir: str | None = None
    log_rotate_bytes: int = 256 << 20
    # Durability of the log, like SQLite's `synchronous`: "close" fsyncs at each rotation and
    # at close, "step" after every step too, "never" leaves it to the OS.
    log_fsync: str = "close"
    # Write the log on a thread of its own, so a slow or hung disk never stalls the scheduler:
    # past log_queue_bytes waiting, steps are dropped and the gap recorded.
    log_background: bool = True
    log_queue_bytes: int = 64 << 20
    # A log_dir that cannot be written: by default a loud error and the engine serves without
    # a log; with log_required, the connector refuses to start, naming the directory.
    log_required: bool = False


@attrs.frozen
class ConnectorConfig(LogSettings):
    """``KVLedgerConnector``'s settings (see docs/using-with-vllm.md for each one)."""

    chunk_size: int = 256
    host_pool_bytes: int = 4 << 30
    save_decode_cache: bool = False
    discard_partial_chunks: bool = True
    strict: bool = False
    # The remote chunk tier (connector/remote.py, docs/remote.md): a Redis URL
    # (redis://[user:password@]host:port/db, rediss:// for TLS, unix://); None: no remote tier.
    remote_url: str | None = None
    # Bounds: every command of the worker's client; every lookup on the scheduler thread (a
    # lookup that waits longer counts the server as down); the first back-off after a failure
    # (doubling, at most 30 s); a chunk larger than remote_max_chunk_bytes refuses to start.
    remote_timeout_ms: int = 2000
    remote_lookup_timeout_ms: int = 50
    remote_retry_ms: int = 500
    remote_ttl_s: int = 0  # expire chunks after this long (0: never; the server's policy)
    remote_max_chunk_bytes: int = 512 << 20  # Redis's default proto-max-bulk-len
    # KV-content digests (connector/digests.py, tracker/digests.py): "off", "sampled" (one layer
    # of each block, chosen by its key) or "full" (every layer). Off by default: opt in per
    # deployment once its cost is measured (docs/performance.md).
    digests: str = "off"

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        values, extra = _read(cls, extra, environ)
        if extra.get("remote_url") is not None:
            values["remote_url"] = _redis_url(extra["remote_url"])
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        check_chunk_size(self.chunk_size, block_size)


@attrs.frozen
class RecorderConfig(LogSettings):
    """``KVLedgerRecorder``'s settings (docs/recording.md): the connector it wraps and that
    connector's own extra config, the chunk size ``check --differential`` gives kvledger's
    pool by default (None: :data:`DEFAULT_CHUNK_SIZE`, rounded down to whole blocks), the
    digests, whether steady decode steps are batched, and the event log's settings, as
    ``KVLedgerConnector`` takes them."""

    inner: str = ""
    inner_extra_config: dict[str, Any] = attrs.field(factory=dict)
    chunk_size: int | None = None
    digests: str = "off"
    # Steady decode steps batched into one StepDecoded record per run (tracker/recorded_steps.py);
    # false: every scheduled request its own Scheduled record, as before the batching.
    steady_decode: bool = True

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> RecorderConfig:
        values, extra = _read(
            cls, extra, environ, hint=" (the inner's own keys go in inner_extra_config)"
        )
        if "inner" not in extra:
            raise ConnectorConfigError("KVLedgerRecorder needs `inner`: the connector it wraps")
        return cls(**values)

    def chunk_size_for(self, block_size: int) -> int:
        """The chunk size for vLLM's ``block_size``: the one given, which must be whole blocks
        (as for ``KVLedgerConnector``), else the default in whole blocks."""
        if self.chunk_size is None:
            return max(block_size, DEFAULT_CHUNK_SIZE // block_size * block_size)
        check_chunk_size(self.chunk_size, block_size)
        return self.chunk_size
