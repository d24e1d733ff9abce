"""An unwritable log directory at startup: the documented policy (docs/using-with-vllm.md,
"When the log cannot be written"). By default the engine serves without a log and says so
loudly; with ``log_required`` the connector refuses to start, naming the directory. Either
way no empty or header-less file is left behind, and nothing raises from deep inside."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

pytest.importorskip("torch")
from kvledger.connector import logwriter
from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.connector.logwriter import LogWriteError, LogWriter
from kvledger.connector.scheduler import SchedulerSide
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev


def _side(log_dir: str, **extra: object) -> SchedulerSide:
    config = ConnectorConfig.from_extra_config({"log_dir": log_dir, **extra})
    return SchedulerSide(config, block_size=16, num_slots=4)


class _Logger:
    def __init__(self) -> None:
        self.errors: list[tuple[str, dict[str, object]]] = []

    def error(self, event: str, **kw: object) -> None:
        self.errors.append((event, kw))

    def warning(self, event: str, **kw: object) -> None:
        pass


def test_a_log_dir_that_cannot_exist_serves_without_a_log(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    logger = _Logger()
    config = ConnectorConfig.from_extra_config({"log_dir": str(blocker / "logs")})
    side = SchedulerSide(config, block_size=16, num_slots=4, logger=logger)
    assert side.log_path is None
    assert side.tracker.log_error is not None and str(blocker / "logs") in side.tracker.log_error
    assert [e for e, _ in logger.errors] == ["kvledger.log_unavailable"]
    side.tracker.add_request("r", [1, 2, 3])  # the bookkeeping goes on
    assert side.tracker.state("r") is not None
    with pytest.raises(ConnectorConfigError, match=r"cannot be written.*log_required is set"):
        _side(str(blocker / "logs"), log_required=True)


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_at_startup_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    def full(self: object, *args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(logwriter._DirectOutput, "write", full)
    monkeypatch.setattr(logwriter._BackgroundOutput, "_do", full)
    with pytest.raises(LogWriteError, match="No space left"):
        LogWriter(tmp_path / "run.kvlog", {}, background=background)
    assert list(tmp_path.iterdir()) == []  # no 0-byte file
    logger = _Logger()
    config = ConnectorConfig.from_extra_config(
        {"log_dir": str(tmp_path / "logs"), "log_background": background}
    )
    side = SchedulerSide(config, block_size=16, num_slots=4, logger=logger)
    assert side.log_path is None and list((tmp_path / "logs").iterdir()) == []
    assert "No space left" in (side.tracker.log_error or "")


def test_an_existing_file_is_never_overwritten_nor_removed(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="never overwritten"):
        LogWriter(path, {})
    assert path.read_bytes() == b"someone else's"


def test_the_durability_settings_reach_the_writer(tmp_path: Path) -> None:
    side = _side(str(tmp_path), log_fsync="step", log_background=False, log_queue_bytes=4096)
    writer = side.tracker._log
    assert isinstance(writer, LogWriter) and writer.fsync == "step"
    side.tracker.apply(ev.RequestAdded(0, "r", (1, 2)))
    side.tracker.end_step()
    side.shutdown()
    reader = LogReader(side.log_path)  # type: ignore[arg-type]
    assert [type(e).__name__ for f in reader for e in f.events] == ["RequestAdded"]
    assert reader.ending == "closed"
    with pytest.raises(ConnectorConfigError, match="log_fsync must be"):
        _side(str(tmp_path), log_fsync="sometimes")
