"""connector/stopping.py: the log is sealed when the process is asked to stop, never inside a
callback, and the process then stops exactly as it would have without us."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.connector.stopping import StopHook


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []

    def seal(self, stop: str) -> bool:
        self.log.append(f"seal {stop}")
        return True

    def close(self) -> None:
        self.log.append("close")


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_stop_signal_seals_then_reaches_the_handler_found(restore_signals: None) -> None:
    calls = Calls()
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    hook = StopHook(calls.seal, calls.close)
    assert hook.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls.log == ["seal SIGTERM"] and seen == [signal.SIGTERM]
    assert hook.stop == "SIGTERM" and hook.sealed
    hook.close()
    assert calls.log == ["seal SIGTERM", "close"]
    # The handler found is back in place: a later signal no longer seals.
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM, signal.SIGTERM] and calls.log[-1] == "close"


def test_ctrl_c_still_raises_keyboardinterrupt(restore_signals: None) -> None:
    """Where Python's own SIGINT handler was in place, the user still gets KeyboardInterrupt,
    after the seal."""
    calls = Calls()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hook = StopHook(calls.seal, calls.close)
    hook.install()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert calls.log == ["seal SIGINT"]
    hook.close()


def test_a_signal_inside_a_callback_seals_when_it_returns(restore_signals: None) -> None:
    """The tracker may be in the middle of applying an event: the seal waits; after a stop,
    every callback's return writes what it recorded."""
    calls = Calls()
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    hook = StopHook(calls.seal, calls.close)
    hook.install()
    with hook:
        with hook:  # nested: a callback calling another
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls.log == []
        assert calls.log == []
    assert calls.log == ["seal SIGTERM"]
    with hook:
        pass
    assert calls.log == ["seal SIGTERM", "seal SIGTERM"]
    hook.close()


def test_a_failing_seal_never_stops_the_stop(restore_signals: None) -> None:
    seen: list[int] = []

    def broken(stop: str) -> bool:
        raise OSError("disk gone")

    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    hook = StopHook(broken, lambda: None)
    hook.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM] and not hook.sealed
    hook.close()


def _child(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from kvledger.connector.stopping import StopHook
        marks = open({str(tmp_path / "marks")!r}, "a")
        def seal(stop):
            marks.write("seal " + stop + "\\n"); marks.flush(); return True
        def close():
            marks.write("close\\n"); marks.flush()
        hook = StopHook(seal, close)
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)


def test_the_default_action_still_ends_the_process(tmp_path: Path) -> None:
    """SIGTERM with no handler of Python's kills the process; with the hook it is sealed
    first, then killed by the same signal (no atexit, as without the hook)."""
    done = _child(
        tmp_path,
        """
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        hook.install()
        os.kill(os.getpid(), signal.SIGTERM)
        marks.write("survived\\n")
        """,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert (tmp_path / "marks").read_text().split("\n")[:-1] == ["seal SIGTERM"]


def test_an_ordinary_exit_closes_a_log_left_open(tmp_path: Path) -> None:
    done = _child(tmp_path, "hook.install()\nsys.exit(0)\n")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "marks").read_text().split("\n")[:-1] == ["close"]


def test_off_the_main_thread_only_the_exit_hook(tmp_path: Path) -> None:
    """Python runs signal handlers on the main thread alone: a connector built on another
    thread (an engine in a user's thread) chains no signal."""
    done = _child(
        tmp_path,
        """
        import threading
        result = []
        t = threading.Thread(target=lambda: result.append(hook.install()))
        t.start(); t.join()
        assert result == [False]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        """,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "marks").read_text().split("\n")[:-1] == ["close"]
