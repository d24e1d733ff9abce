"""What the tests that drive the rigs (connector/testing: run.py, recorded.py) share: the
preempting workload, and vLLM's ExampleConnector under the recorder rig as the recorder's
tests set it up (by this vLLM's registry name and cache layout, its files in a directory of
the test's own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# A pool small enough that long decodes preempt (RunSpec's fields); a shared prefix gives
# prefix hits.
PREEMPTING: dict[str, Any] = dict(
    num_gpu_blocks=12,
    max_num_seqs=4,
    prompt_len=(20, 70),
    max_tokens=(40, 100),
    shared_prefix=16,
    num_requests=6,
)
# Eight requests decoding up to 120 tokens on a pool that preempts: mostly steady decode
# steps, with saves, loads, preemptions and finishes between them.
DECODING: dict[str, Any] = dict(
    num_gpu_blocks=40,
    max_num_seqs=8,
    num_requests=8,
    prompt_len=(20, 90),
    max_tokens=(60, 120),
    shared_prefix=16,
)
# The same, every reuse from the connector (no prefix cache), prompts prefilled in one step
# (ExampleConnector saves a prompt whole in the step that first schedules it).
PREEMPTING_RECORDED: dict[str, Any] = dict(
    PREEMPTING, enable_prefix_caching=False, max_num_batched_tokens=1024
)


def example_spec(store: Path, **kw: Any) -> Any:
    """A ``WrappedSpec`` of ``kw`` whose inner is vLLM's ExampleConnector, saving under
    ``store``; the test is skipped where this vLLM's ExampleConnector cannot load on a CPU."""
    from kvledger.connector.testing.recorded import (
        WrappedSpec,
        example_connector,
        example_connector_cpu_problem,
        example_connector_layout,
    )

    problem = example_connector_cpu_problem()
    if problem is not None:
        pytest.skip(problem)
    kw.setdefault("layout", example_connector_layout())
    extra = {"shared_storage_path": str(store), **kw.pop("extra_config", {})}
    return WrappedSpec(inner=example_connector(), extra_config=extra, **kw)


def assert_clean(report: Any) -> None:
    """A rig's run (connector/testing/run.py's report) that went right: the KV-content oracle
    found no mismatch, no rule was broken, nothing leaked, every request finished."""
    assert [m.describe() for m in report.mismatches] == []
    assert report.violations == ()
    assert report.leaks == ()
    assert report.adapter_errors == 0
    assert report.finished == report.requests


def check_clean(log_path: str) -> None:
    """``kvledger check`` of the run's log exits 0."""
    from kvledger.replay.replayer import check

    result = check(log_path)
    assert result.exit_code == 0, [p.describe() for p in result.problems[:5]]
