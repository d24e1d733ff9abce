"""The run of docs/why-missed.md: vLLM's real scheduler with the connector, a host pool of five
chunks, prompts that share 40 tokens (a chunk and a half), three of them asked again, and one
failed load. ``python tests/_miss_run.py DIR`` writes its log to DIR."""

from __future__ import annotations

import sys
from typing import Any

SPEC: dict[str, Any] = dict(
    num_requests=6,
    num_gpu_blocks=40,
    prompt_len=(66, 90),
    max_tokens=(6, 12),
    shared_prefix=40,
    repeat_prompts=3,
    enable_prefix_caching=False,
    extra_config={"chunk_size": 32, "host_pool_bytes": 5 * 16384},
)


def failing_load(req_id: str, chunk: Any) -> bool:
    """The load of again-req-1's first chunk fails: vLLM recomputes from there."""
    return req_id == "again-req-1" and chunk.token_start == 0


def make(log_dir: str) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    report = run(RunSpec(**SPEC), load_fault=failing_load, log_dir=log_dir)
    assert report.ok, report
    return report


if __name__ == "__main__":
    make(sys.argv[1])
