"""The connector's own log lines (structlog), which never raise.

A line names what vLLM handed us: a request id, an error's text. A request id can hold what the
output cannot encode: a lone surrogate, which a JSON ``request_id`` carries into vLLM, or any
non-ASCII character on a stream whose encoding is ASCII. structlog's default logger prints to
standard output, and the print raised ``UnicodeEncodeError`` inside the callback that was
logging, after the tracker had applied half of the event. A line that cannot be written as it
is goes out once more with its text values escaped (``\\ud800``, ``\\u8bf7``); one that still
cannot is dropped. Bookkeeping never stops because a line could not be said.
"""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

__all__ = ["SafeLogger", "safe_logger"]


def _escaped(value: Any) -> Any:
    """A text value as ASCII, what any stream encodes (other values as they are: structlog
    renders them with ``repr``, which escapes what it must)."""
    if isinstance(value, str):
        return value.encode("ascii", "backslashreplace").decode("ascii")
    return value


class SafeLogger:
    """``logger``'s level methods, each returning None instead of raising: see the module
    docstring. Only these are forwarded: a proxy that answered any attribute (``__dict__``
    included) misled vLLM's scan of every module's globals at engine start."""

    __slots__ = ("_logger",)

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def _say(self, level: str, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        method = getattr(self._logger, level)
        try:
            method(*args, **kw)
        except Exception:
            # Nothing of the line can be written even escaped: the bookkeeping goes on.
            with contextlib.suppress(Exception):
                method(*map(_escaped, args), **{k: _escaped(v) for k, v in kw.items()})

    def debug(self, *args: Any, **kw: Any) -> None:
        self._say("debug", args, kw)

    def info(self, *args: Any, **kw: Any) -> None:
        self._say("info", args, kw)

    def warning(self, *args: Any, **kw: Any) -> None:
        self._say("warning", args, kw)

    def error(self, *args: Any, **kw: Any) -> None:
        self._say("error", args, kw)

    def critical(self, *args: Any, **kw: Any) -> None:
        self._say("critical", args, kw)

    def exception(self, *args: Any, **kw: Any) -> None:
        self._say("exception", args, kw)


def safe_logger(name: str) -> SafeLogger:
    """``structlog.get_logger(name)``, whose lines never raise."""
    return SafeLogger(structlog.get_logger(name))
