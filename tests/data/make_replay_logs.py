"""Regenerate the real logs that tests/test_replay_check.py replays: ``python
tests/data/make_replay_logs.py`` (needs vLLM's scheduler: ``make setup-vllm``).

Both logs come from ``connector.testing.run``: vLLM's real scheduler (CPU) with
KVLedgerConnector loaded by module path, the worker side moving bytes through a CPU paged cache,
the KV-content oracle checked after every step. Same workload, same seed, two versions of the code:

- ``replay-clean.kvlog``: this code. ``kvledger check`` must find nothing.
- ``replay-short-load.kvlog``: a deliberately wrong planning rule injected in-process (the
  tracker's ``plan_load`` monkeypatched): every load of more than one block is planned one
  block short, the off-by-one a slice taken from the wrong base produces (the last loaded
  block keeps stale KV while vLLM counts it computed; the oracle sees it). ``kvledger check`` must point at the first load
  it shortened. ``replay-short-load.json`` says which: the step, the request, the decision
  type, and the recorded and correct load ranges, as seen by the injected code at the moment
  it changed the plan. It also holds the run's own summary (the oracle's mismatches).

The host pool is kept small (24 chunk slots) so that the logs also carry LRU evictions.
Each log is a few tens of KB. The bytes differ between runs (run ids, wall clocks); the
events do not.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

SLOT_BYTES = 16384  # the harness's tiny model: bytes of one 32-token chunk
SPEC: dict[str, Any] = dict(
    num_requests=10,
    num_gpu_blocks=16,
    prompt_len=(20, 90),
    max_tokens=(30, 80),
    shared_prefix=16,
    repeat_prompts=3,
    enable_prefix_caching=False,
    extra_config={
        "chunk_size": 32,
        "discard_partial_chunks": False,
        "host_pool_bytes": 24 * SLOT_BYTES,
    },
    seed=3,
)


def _run(name: str, log_dir: str) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    report = run(RunSpec(**SPEC), log_dir=log_dir)
    produced = [p for p in os.listdir(log_dir) if p.endswith(".kvlog")]
    if len(produced) != 1:
        raise SystemExit(f"{name}: expected one log file in {log_dir}, got {produced}")
    target = HERE / name
    target.unlink(missing_ok=True)
    shutil.move(os.path.join(log_dir, produced[0]), target)
    return report


def _summary(report: Any) -> dict[str, Any]:
    return {
        "requests": report.requests,
        "steps": report.steps,
        "preemptions": report.preemptions,
        "tokens_loaded": report.tokens_loaded,
        "tokens_saved": report.tokens_saved,
        "violations": list(report.violations),
        "oracle_mismatches": len(report.mismatches),
        "first_oracle_mismatch": report.mismatches[0].describe() if report.mismatches else None,
    }


def make_clean() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report = _run("replay-clean.kvlog", tmp)
    if not report.ok:
        raise SystemExit(f"the clean run is not clean: {_summary(report)}")
    return _summary(report)


def make_short_load() -> dict[str, Any]:
    import attrs

    import kvledger.tracker.tracker as tracker_module

    real = tracker_module.plan_load
    # (step, req_id) -> what was changed. The tracker may plan a load more than once for one
    # admission (a reservation at Allocated, the plan at Scheduled): one entry each.
    changed: dict[tuple[int, str], dict[str, Any]] = {}

    def short_by_one_block(state, index, config, step):  # type: ignore[no-untyped-def]
        decision, violations = real(state, index, config, step)
        if decision is not None and decision.end - decision.start > config.block_size:
            wrong = attrs.evolve(decision, end=decision.end - config.block_size)
            changed[step, state.req_id] = {
                "step": step,
                "req_id": state.req_id,
                "decision": "LoadPlanned",
                "recorded": [wrong.start, wrong.end],
                "correct": [decision.start, decision.end],
            }
            decision = wrong
        return decision, violations

    tracker_module.plan_load = short_by_one_block
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = _run("replay-short-load.kvlog", tmp)
    finally:
        tracker_module.plan_load = real
    if not changed:
        raise SystemExit("the injected rule never changed a load: pick another workload")
    sidecar = {
        "bug": "LoadPlanned one block short (a load slice off by one block)",
        "first_bad": next(iter(changed.values())),
        "loads_changed": len(changed),
        "requests_changed": sorted({req_id for _, req_id in changed}),
        "run": _summary(report),
    }
    (HERE / "replay-short-load.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    return sidecar


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    clean = make_clean()
    (HERE / "replay-clean.json").write_text(json.dumps({"run": clean}, indent=2) + "\n")
    short = make_short_load()
    for name in ("replay-clean.kvlog", "replay-short-load.kvlog"):
        print(f"{name}: {(HERE / name).stat().st_size} bytes")
    print(json.dumps(short["first_bad"]))


if __name__ == "__main__":
    main()
