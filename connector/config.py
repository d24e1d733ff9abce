"""``kv_connector_extra_config``: every key, its default, and its validation.

An unknown key or a bad value is an error at construction that names the key and what is
accepted, so a typo in ``--kv-transfer-config`` fails at startup instead of silently running
with defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs

from tracker.digests import DIGEST_MODES

__all__ = ["ENV_LOG_DIR", "ConnectorConfig", "ConnectorConfigError"]

# Turns the event log on without touching the serving command line.
ENV_LOG_DIR = "KVLEDGER_LOG_DIR"


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


@attrs.frozen
class ConnectorConfig:
    """The connector's settings (see docs/using-with-vllm.md for each one)."""

    chunk_size: int = 256
    host_pool_bytes: int = 4 << 30
    save_decode_cache: bool = False
    discard_partial_chunks: bool = True
    log_dir: str | None = None
    log_rotate_bytes: int = 256 << 20
    # Hits at block granularity (tracker/config.py, design note 14); false: whole chunks.
    block_hits: bool = True
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
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; accepted keys: "
                f"{sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name in (
            "chunk_size",
            "host_pool_bytes",
            "log_rotate_bytes",
            "log_queue_bytes",
            "remote_timeout_ms",
            "remote_lookup_timeout_ms",
            "remote_retry_ms",
            "remote_max_chunk_bytes",
        ):
            if name in extra:
                values[name] = _pos_int(name, extra[name])
        for name in (
            "save_decode_cache",
            "discard_partial_chunks",
            "block_hits",
            "strict",
            "log_background",
            "log_required",
        ):
            if name in extra:
                values[name] = _bool(name, extra[name])
        if "log_fsync" in extra:
            if extra["log_fsync"] not in ("close", "step", "never"):
                raise ConnectorConfigError(
                    f"log_fsync must be 'close', 'step' or 'never', got {extra['log_fsync']!r}"
                )
            values["log_fsync"] = extra["log_fsync"]
        if "digests" in extra:
            mode = extra["digests"]
            if mode not in DIGEST_MODES:
                raise ConnectorConfigError(
                    f"digests must be one of {', '.join(map(repr, DIGEST_MODES))}, got {mode!r}"
                )
            values["digests"] = mode
        if "remote_ttl_s" in extra:
            ttl = extra["remote_ttl_s"]
            if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
                raise ConnectorConfigError(
                    f"remote_ttl_s must be a non-negative integer, got {ttl!r}"
                )
            values["remote_ttl_s"] = ttl
        if extra.get("remote_url") is not None:
            values["remote_url"] = _redis_url(extra["remote_url"])
        log_dir = extra.get("log_dir", environ.get(ENV_LOG_DIR) or None)
        if log_dir is not None and not isinstance(log_dir, str):
            raise ConnectorConfigError(f"log_dir must be a path string, got {log_dir!r}")
        values["log_dir"] = log_dir
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_size % block_size:
            raise ConnectorConfigError(
                f"chunk_size ({self.chunk_size}) must be a multiple of vLLM's block_size "
                f"({block_size}); for example {block_size * max(1, self.chunk_size // block_size)}"
            )
