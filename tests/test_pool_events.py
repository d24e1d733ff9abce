"""connector/pool_events.py: KV events for the pool, under vLLM's real scheduler.

vLLM's scheduler runs with KV cache events on (its null publisher, whose ``publish`` this
test reads) and collects ``take_events()`` from KVLedgerConnector every step, as it does on a
served engine; the KV-content oracle checks every byte loaded. The stream is judged against
the run's log, read from its recorded facts alone (tests/_kv_events.py), and against vLLM's own
prefix-cache events for the same tokens. tests/engine/test_engine_kv_events.py does the same on
vLLM's real engine, through a real ZMQ subscriber.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _kv_events import assert_matches_log, assert_vllms_own_hashes
from _rigs import assert_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.connector.pool_events import MEDIUM_CPU, MEDIUM_REMOTE, PoolEvents

BLOCK = 16
# The harness model keeps 2 layers x 2 KV heads x 16 x fp32 x (K, V): 512 bytes a token.
SLOTS = 6


def _published(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every event vLLM's scheduler hands its (null) publisher."""
    from vllm.distributed.kv_events import NullEventPublisher

    events: list[Any] = []
    monkeypatch.setattr(
        NullEventPublisher, "publish", lambda self, batch: events.extend(batch.events)
    )
    return events


def _run(tmp_path: Path, kv_events: bool, **extra: Any) -> Any:
    from kvledger.connector.testing.harness import skip_reason
    from kvledger.connector.testing.run import RunSpec, run

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    spec = RunSpec(
        block_size=BLOCK,
        num_requests=10,
        prompt_len=(40, 120),
        max_tokens=(4, 24),
        enable_prefix_caching=True,
        kv_events=kv_events,
        extra_config={
            "chunk_size": 2 * BLOCK,
            "host_pool_bytes": SLOTS * 2 * BLOCK * 512,
            **extra,
        },
    )
    report = run(spec, log_dir=str(tmp_path / "logs"))
    assert_clean(report)
    assert report.log_path is not None
    return report


@pytest.mark.vllm
def test_the_stream_tells_the_pool_as_the_log_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _published(monkeypatch)
    report = _run(tmp_path, kv_events=True)
    stored, removed = assert_matches_log(events, report.log_path, MEDIUM_CPU)
    assert len(stored) > SLOTS and removed, "the workload must fill the pool and evict"
    # Chunks of two blocks; where a prompt ends inside one, its whole blocks.
    assert {len(e.block_hashes) for e in stored} == {1, 2}
    assert all(len(e.token_ids) == BLOCK * len(e.block_hashes) for e in stored)
    assert_vllms_own_hashes(events, BLOCK)


@pytest.mark.vllm
def test_the_remote_tier_has_a_medium_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _published(monkeypatch)
    store = tmp_path / "tier"
    report = _run(tmp_path, kv_events=True, remote_url=f"file://{store}")
    remote, _ = assert_matches_log(events, report.log_path, MEDIUM_REMOTE)
    assert remote and all(getattr(e, "locality", "REMOTE") == "REMOTE" for e in remote)
    assert_matches_log(events, report.log_path, MEDIUM_CPU)
    assert_vllms_own_hashes(events, BLOCK)


@pytest.mark.vllm
def test_with_events_off_nothing_is_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM still calls take_events every step; with its KV events off the connector keeps no
    description, the index no watcher, and nothing reaches the publisher."""
    from kvledger.connector.scheduler import SchedulerSide

    events = _published(monkeypatch)
    built: list[SchedulerSide] = []
    original = SchedulerSide.__init__

    def keep(self: SchedulerSide, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(SchedulerSide, "__init__", keep)
    _run(tmp_path, kv_events=False)
    assert events == []
    [side] = built
    assert side.pool_events is None and side.tracker.index.watch is None


# --- the bookkeeping alone, over any order of facts -----------------------------------------


class _Request:
    def __init__(self, n: int) -> None:
        self.all_token_ids = list(range(1000 + n * 100, 1000 + n * 100 + 4 * BLOCK))
        self.block_hashes = [bytes([n, j]) for j in range(4)]


_facts = st.lists(
    st.tuples(
        st.sampled_from(["plan", "store", "evict", "settle", "remote", "gone"]),
        st.integers(0, 5),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_facts)
def test_each_medium_announces_a_chunk_once_and_removes_only_what_it_announced(
    facts: list[tuple[str, int]],
) -> None:
    """Whatever order plans, confirmations and removals come in: a BlockRemoved names exactly
    the hashes of a BlockStored still standing on its medium, a chunk is never announced twice
    on one medium without a removal between, and nothing is announced without a plan."""
    pool = PoolEvents(BLOCK, num_slots=2)
    standing: dict[tuple[str, bytes], tuple[Any, ...]] = {}
    planned: set[bytes] = set()
    for what, n in facts:
        key = bytes([n])
        if what == "plan":
            pool.planned(_Request(n), key, 0, 4 * BLOCK)
            planned.add(key)
        elif what == "store":
            pool.pool_changed(key, True)
        elif what == "evict":
            pool.pool_changed(key, False)
        elif what == "settle":
            pool.settled([key])
        elif what == "remote":
            pool.remote_stored([key])
        else:
            pool.remote_gone([key])
        for e in pool.take():
            at = (e.medium, e.block_hashes)
            if e.stored:
                assert key in planned
                assert (e.medium, key) not in standing
                assert e.block_hashes == tuple(_Request(n).block_hashes)
                assert e.token_ids == tuple(_Request(n).all_token_ids)
                standing[(e.medium, key)] = e.block_hashes
            else:
                assert standing.pop((e.medium, key)) == at[1]
