"""The event log as both connector classes open it: its name, its settings, and what happens
when the directory cannot be written.

``KVLedgerConnector``'s scheduler side and ``KVLedgerRecorder`` call :func:`open_log` with
their :class:`connector.config.LogSettings`, so a log setting means the same in both: the
rotation size, the fsync policy, the background writer and its queue bound, and
``log_required`` (a directory that cannot be written refuses the start, naming it; without it
the engine serves without a log, said loudly).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kvledger.connector.config import ConnectorConfigError, LogSettings
from kvledger.connector.logsafe import safe_logger

__all__ = ["LOG_PREFIXES", "log_path", "open_log"]

_log = safe_logger("kvledger")

# The file name's first word, by who writes the log: a reader tells them apart at a glance.
LOG_PREFIXES = {"connector": "kvledger", "recorder": "kvledger-rec"}


def log_path(log_dir: str, kind: str) -> str:
    """A new log's path in ``log_dir``: the writer, the time, the pid and a random suffix, so
    that a second connector in the same process (an engine restarted in place) never collides
    with the first."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{LOG_PREFIXES[kind]}-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:6]}.kvlog"
    return os.path.join(log_dir, name)


def open_log(
    settings: LogSettings, header: dict[str, Any], *, kind: str, logger: Any = None
) -> tuple[Any, str | None, str | None]:
    """``(writer, path, error)``: a ``LogWriter`` in ``settings.log_dir`` (None, None, None
    without one). A directory that cannot be written gives ``(None, None, error)``, logged, or
    raises :class:`ConnectorConfigError` under ``log_required``."""
    from kvledger.connector.logwriter import (  # file I/O only when asked for
        LogWriteError,
        LogWriter,
    )

    log_dir = settings.log_dir
    if not log_dir:
        return None, None, None
    try:
        os.makedirs(log_dir, exist_ok=True)
        path = log_path(log_dir, kind)
        writer = LogWriter(
            path,
            header,
            rotate_bytes=settings.log_rotate_bytes,
            fsync=settings.log_fsync,  # type: ignore[arg-type]  # checked by the config
            background=settings.log_background,
            max_queue_bytes=settings.log_queue_bytes,
        )
    except (OSError, LogWriteError) as e:
        error = f"log_dir {log_dir!r} cannot be written: {e}"
        if settings.log_required:
            raise ConnectorConfigError(f"{error} (log_required is set)") from None
        (logger or _log).error("kvledger.log_unavailable", error=error)
        return None, None, error
    return writer, path, None
