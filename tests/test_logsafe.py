"""The connector's log lines never raise: a request id the output cannot encode (a lone
surrogate from a JSON ``request_id``; any non-ASCII character on an ASCII stream) is written
escaped, and the bookkeeping that was logging goes on (connector/logsafe.py)."""

from __future__ import annotations

import io

import pytest
import structlog
from _replay_logs import Sim, prompt

from kvledger.connector.logsafe import SafeLogger
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker


def _ascii_stream() -> tuple[io.BytesIO, io.TextIOWrapper]:
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)


@pytest.mark.parametrize("req_id", ["bad-\ud800", "请求-1"])
def test_a_violation_about_an_id_the_stream_cannot_encode_is_logged_escaped(req_id: str) -> None:
    raw, stream = _ascii_stream()
    plain = structlog.wrap_logger(structlog.PrintLogger(stream))
    with pytest.raises(UnicodeEncodeError):  # what structlog alone does with such a line
        plain.warning("kvledger.violation", req_id=req_id)
    cfg = TrackerConfig(block_size=16, chunk_size=32, num_slots=64)
    t = Tracker(cfg, logger=SafeLogger(plain))
    sim = Sim(t)
    sim.add(req_id, prompt(40, 2))
    sim.admit(req_id)
    sim.end_step()
    t.mark_violation(req_id, "adapter_error", "Scheduled", error="x")
    state = t.state(req_id)
    assert state is not None and state.recompute_only  # the fallback went through
    assert [v.rule for v in t.violations] == ["adapter_error"]
    written = raw.getvalue().decode("ascii")
    assert "kvledger.violation" in written
    assert req_id.encode("ascii", "backslashreplace").decode("ascii") in written


def test_a_line_that_cannot_be_written_at_all_is_dropped() -> None:
    class Broken:
        def error(self, *args: object, **kw: object) -> None:
            raise OSError("the terminal went away")

    SafeLogger(Broken()).error("kvledger.adapter_error", callback="build_connector_meta")


def test_the_loggers_answer_no_attribute_they_do_not_have() -> None:
    """vLLM's engine start scans every module's globals and reads ``vars(value)`` of each that
    has a ``__dict__``: a logger that answered any attribute handed it a function there."""
    import sys

    import kvledger.connector.scheduler  # noqa: F401  (its loggers among the globals)

    for name, module in list(sys.modules.items()):
        if not name.startswith("kvledger.connector"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, SafeLogger):
                assert not hasattr(value, "__dict__")
                assert not hasattr(value, "kernel")
                with pytest.raises(TypeError):
                    vars(value)
