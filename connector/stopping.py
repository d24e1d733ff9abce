"""Ending the log on the engine's own way out, where vLLM never calls ``shutdown()``.

vLLM's engine core calls the connector's ``shutdown()`` last. Asked to stop (SIGINT or
SIGTERM), it leaves its busy loop, resets both signals to their default action, stops its
workers, and only then calls ``scheduler.shutdown()``. Meanwhile the front end's process manager
sends it SIGTERM and, once ``--shutdown-timeout`` has passed (0 s by default), SIGKILL. On
Ctrl-C, on SIGTERM, at the end of an offline script, the engine core is usually killed before
``shutdown()``, and a log closed only there would end without its end record (``kvledger
check``: incomplete). Read from vLLM 0.32/0.33: ``EngineCoreProc.run_engine_core`` and
``vllm.v1.utils.shutdown``.

So the log is ended when the stop is *asked for*. :class:`StopHook` chains the process's
SIGINT and SIGTERM handlers, calling the one it found, so vLLM stops exactly as before. When a
stop signal arrives it seals the log (``LogWriter.seal``): what the tracker holds is written, and
the file ends with a closed end record naming the signal, within a bounded moment. The steps
the engine still runs while it drains (``--shutdown-timeout``) or aborts its requests are
written as they come, each callback leaving the file complete. At interpreter exit, a log still
open is closed. A SIGKILL or a crash with no stop signal before it still leaves the log open;
``kvledger check`` then says up to which step it is consistent (docs/using-with-vllm.md, "How the
log ends").

The seal never runs inside a callback: Python runs a signal handler on the main thread between
two bytecodes, possibly while the tracker is applying an event, so the hook counts the callbacks
in progress (``with hook:``) and a seal asked for inside one waits for it to return.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from kvledger.connector.logsafe import safe_logger

__all__ = ["NO_HOOK", "STOP_SIGNALS", "StopHook"]

_log = safe_logger("kvledger")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Every hook whose log is not closed yet, for the exit hook (weakly: a hook never keeps a
# connector alive).
_LIVE: weakref.WeakSet[StopHook] = weakref.WeakSet()


class StopHook:
    """Seals the log when the process is asked to stop; closes it at interpreter exit.

    ``seal(stop)`` makes the log complete as of now (the tracker's ``seal``); ``close()``
    closes it. Use the hook as a context manager around every callback that writes to the log.
    """

    def __init__(self, seal: Callable[[str], object], close: Callable[[], object]) -> None:
        self._seal = seal
        self._close = close
        self._depth = 0  # callbacks in progress
        self.stop: str | None = None  # the signal that asked the process to stop
        self.sealed = False
        self._previous: dict[int, Any] = {}
        self.closed = False

    def install(self) -> bool:
        """Chain SIGINT and SIGTERM, and close the log at interpreter exit. The signals only
        from the main thread, where Python runs signal handlers and where vLLM's engine core
        calls the connector; from another thread (an engine run in a thread of the user's),
        only the exit hook. Returns whether the signals were chained."""
        _LIVE.add(self)
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return True

    def uninstall(self) -> None:
        """Give the signals back to the handlers found, where ours is still the one installed
        (a handler chained on top of ours keeps calling ours, which then only forwards)."""
        _LIVE.discard(self)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal and previous is not None:
                signal.signal(sig, previous)

    def close(self) -> None:
        """Close the log (idempotent) and give the signals back."""
        if self.closed:
            return
        self.closed = True
        self.uninstall()
        self._close()

    # --- callbacks --------------------------------------------------------------------------

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self.stop is not None and self._depth == 0:
            self._seal_now()  # asked to stop: what this callback recorded is written at once

    # --- the stop ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(Exception):  # the stop goes on whatever the log does
            self.asked_to_stop(signal.Signals(signum).name)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # vLLM's handler, or Python's (KeyboardInterrupt)
        elif previous == signal.SIG_DFL:
            # The default action, as before us: the process ends by this signal.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def asked_to_stop(self, stop: str) -> None:
        """The process was asked to stop (``stop``: how): seal the log now, or at the end of
        the callback in progress."""
        if self.closed:
            return
        if self.stop is None:
            self.stop = stop
        if self._depth == 0:
            self._seal_now()

    def _seal_now(self) -> None:
        if self.closed:
            return
        try:
            sealed = bool(self._seal(self.stop or "stop"))
        except Exception as exc:
            _log.error("kvledger.log_seal_failed", stop=self.stop, error=repr(exc))
            return
        if sealed and not self.sealed:
            self.sealed = True
            _log.info("kvledger.log_sealed", stop=self.stop)


class _NoHook:
    """The hook of a connector without a log: callbacks pass through."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NO_HOOK = _NoHook()


@atexit.register
def _close_at_exit() -> None:
    # A normal interpreter exit where vLLM never called shutdown() (an engine left to the
    # garbage collector): the log gets its end record.
    for hook in list(_LIVE):
        with contextlib.suppress(Exception):
            hook.close()
