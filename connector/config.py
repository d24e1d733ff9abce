"""``kv_connector_extra_config``: every key, its default, and its validation.

An unknown key or a bad value is an error at construction that names the key and what is
accepted, so a typo in ``--kv-transfer-config`` fails at startup instead of silently running
with defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

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


@attrs.frozen
class ConnectorConfig:
    """The connector's settings (see docs/using-with-vllm.md for each one)."""

    chunk_size: int = 256
    host_pool_bytes: int = 4 << 30
    save_decode_cache: bool = False
    discard_partial_chunks: bool = True
    log_dir: str | None = None
    log_rotate_bytes: int = 256 << 20
    strict: bool = False

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
        for name in ("chunk_size", "host_pool_bytes", "log_rotate_bytes"):
            if name in extra:
                values[name] = _pos_int(name, extra[name])
        for name in ("save_decode_cache", "discard_partial_chunks", "strict"):
            if name in extra:
                values[name] = _bool(name, extra[name])
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
