"""Digests that travel with the value, and ``kvledger check --replicas`` (issue 30), under
vLLM's real scheduler with the KV-content oracle, two engines sharing a ``file://`` tier with
``digests: sampled``.

- The saving engine stores its digests of a chunk's blocks in the value; the loading
  engine's log judges its loads from the tier by them, without the saver's log.
- A forger who can write to the tier and knows the format (no shared secret) rewrites every
  value with other KV under its right key, rank and layout. Without the secret the loading
  engine serves it (the oracle sees the wrong KV): what must not happen is that the logs
  say nothing. Keeping the saver's digests, the loader's own log names it; stripping them,
  its log alone cannot, and ``check --replicas`` of both logs does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _rigs import assert_clean
from _verdicts import check_replicas, events_of

from kvledger.connector.testing.harness import skip_reason
from kvledger.connector.values import _FIXED, ValueSeal
from kvledger.replay.replayer import check
from kvledger.replay.replicas import RULE, cross_check
from kvledger.tracker import events as ev

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=8, prompt_len=(48, 160), max_tokens=(8, 48), seed=0
)


def _run(directory: Path, log_dir: Path) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    extra = {"chunk_size": 32, "remote_url": directory.as_uri(), "digests": "sampled"}
    return run(RunSpec(**{**WORKLOAD, "extra_config": extra}), log_dir=str(log_dir))


def _forge(directory: Path, *, keep_digests: bool) -> int:
    """Rewrite every value with other KV, sealed right for its key, rank and layout (read
    off its header, as anyone who knows the format can), and the saver's digests kept or
    dropped."""
    forged = 0
    for name in sorted(os.listdir(directory)):
        path = directory / name
        value = path.read_bytes()
        (_, _, _mode, count, rank, key, layout, length, _, pieces) = _FIXED.unpack_from(value)
        start = _FIXED.size + 4 * pieces
        digests = [
            (
                value[start + 24 * i : start + 24 * i + 16],
                int.from_bytes(
                    value[start + 24 * i + 16 : start + 24 * i + 24], "little", signed=True
                ),
            )
            for i in range(count)
        ]
        # Other KV: bytes of another value (a digest rule that only sees "unchanged" blocks
        # would catch zeros by chance).
        payload = bytearray(value[-length:])
        payload.reverse()
        seal = ValueSeal(rank=rank, layout=layout, digests="sampled" if keep_digests else "off")
        path.write_bytes(seal.seal(key, memoryview(bytes(payload)), digests).to_bytes())
        forged += 1
    return forged


def test_the_savers_digests_travel_with_the_value_and_judge_the_load(tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    first = _run(chunks, tmp_path / "a")
    assert_clean(first)
    second = _run(chunks, tmp_path / "b")
    assert_clean(second)
    carried = [
        e for e in events_of(second.log_path) if isinstance(e, ev.BlockDigested) and e.carried
    ]
    assert carried, "no value carried the saver's digests"
    result = check(second.log_path)
    assert result.exit_code == 0
    digests = result.counts["digests"]
    # Every block loaded from the tier is judged by the digests that came with it.
    assert digests["carried"] > 0 and digests["unverifiable"] == 0 and digests["verified"] > 0
    together = cross_check([first.log_path, second.log_path])
    assert together.problems == [] and together.judged > 0
    assert together.remote_loaded > 0 and together.saved_elsewhere == together.remote_loaded


def test_a_forged_value_keeping_the_savers_digests_is_named_by_the_loaders_log(
    tmp_path: Path,
) -> None:
    chunks = tmp_path / "chunks"
    assert_clean(_run(chunks, tmp_path / "a"))
    assert _forge(chunks, keep_digests=True) >= 4
    second = _run(chunks, tmp_path / "b")
    assert second.mismatches, "the forged KV was not served: the forgery is not one"
    result = check(second.log_path)
    assert result.exit_code == 1
    assert "digest_mismatch" in {p.name for p in result.problems}


def test_a_forged_value_without_digests_is_caught_by_the_replicas_logs_together(
    tmp_path: Path,
) -> None:
    chunks = tmp_path / "chunks"
    first = _run(chunks, tmp_path / "a")
    assert_clean(first)
    assert _forge(chunks, keep_digests=False) >= 4
    second = _run(chunks, tmp_path / "b")
    assert second.mismatches, "the forged KV was not served: the forgery is not one"
    # Alone, the loader's log cannot tell: nothing it holds knows those blocks.
    alone = check(second.log_path)
    assert alone.exit_code == 0, [(p.describe(), p.detail) for p in alone.problems]
    assert alone.counts["digests"]["unverifiable"] > 0
    # Together with the saver's log, every forged load is named.
    code, out = check_replicas(first.log_path, second.log_path)
    assert code == 1
    problems = out["replicas"]["problems"]
    assert problems and {p["name"] for p in problems} == {RULE}
    # Named at each load of forged KV: from the tier, and from the host pool it went to.
    loaders = {e.req_id for e in events_of(second.log_path) if isinstance(e, ev.LoadPlanned)}
    assert {p["req_id"] for p in problems} <= loaders
    # The untampered pair is consistent (the saver against itself and the first run).
    assert check_replicas(first.log_path, first.log_path)[0] == 0
