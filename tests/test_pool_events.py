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
from _rigs import assert_clean, check_clean
from hypothesis import example, given, settings
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


def _sides(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every SchedulerSide the run builds, as it builds it."""
    from kvledger.connector.scheduler import SchedulerSide

    built: list[SchedulerSide] = []
    original = SchedulerSide.__init__

    def keep(self: SchedulerSide, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(SchedulerSide, "__init__", keep)
    return built


def _run(tmp_path: Path, kv_events: bool, *, clean: bool = True, **extra: Any) -> Any:
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
    if clean:
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
    events = _published(monkeypatch)
    built = _sides(monkeypatch)
    _run(tmp_path, kv_events=False)
    assert events == []
    [side] = built
    assert side.pool_events is None and side.tracker.index.watch is None


@pytest.mark.vllm
def test_a_request_whose_hashes_cannot_be_read_costs_its_events_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks a save plans are described from vLLM's request (its block hashes and
    tokens), read by duck typing. When they cannot be read, that is an adapter error of the
    step's build_connector_meta, counted and logged, and the chunks go undescribed: the plan
    stands (the KV-content oracle holds at every step, the log checks clean), and nothing is
    published half-described."""
    from kvledger.connector.pool_events import PoolEvents as Events

    events = _published(monkeypatch)
    built = _sides(monkeypatch)

    def unreadable(self: Events, request: Any, *_: Any) -> None:
        raise TypeError("'int' object is not subscriptable")  # block_hashes of another shape

    monkeypatch.setattr(Events, "planned", unreadable)
    report = _run(tmp_path, kv_events=True, clean=False)
    assert [m.describe() for m in report.mismatches] == [] and report.violations == ()
    assert report.finished == report.requests and report.chunks_saved > 0
    assert report.adapter_errors > 0
    [side] = built
    assert side.pool_events is not None and side.pool_events.undescribed > 0
    assert not [e for e in events if type(e).__name__ == "BlockStored" and e.medium == MEDIUM_CPU]
    check_clean(report.log_path)


# --- the bookkeeping alone, over any order of facts -----------------------------------------


class _Request:
    """Chunk ``n``'s request: four blocks whose hashes overlap the next chunks' (a partial
    chunk and a whole one holding the same blocks)."""

    def __init__(self, n: int) -> None:
        self.all_token_ids = list(range(1000 + n * 100, 1000 + n * 100 + 4 * BLOCK))
        self.block_hashes = [bytes([j]) for j in range(n % 3, n % 3 + 4)]


_facts = st.lists(
    st.tuples(
        st.sampled_from(["plan", "store", "evict", "settle", "remote", "gone"]),
        st.integers(0, 3),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(_facts)
# Chunks 0 and 3 hold the same blocks: the first to leave the pool takes none of them away.
@example([("plan", 0), ("store", 0), ("plan", 3), ("store", 3), ("evict", 0)])
def test_a_hash_is_removed_only_when_no_chunk_on_its_medium_still_holds_it(
    facts: list[tuple[str, int]],
) -> None:
    """Against a model of the tiers, whatever order plans, confirmations and removals come in:
    a chunk is announced once per medium until it leaves, only if its plan described it, with
    its request's hashes and tokens; when it leaves, its BlockRemoved names exactly its hashes
    that no chunk still on that medium holds, and there is no event when every one is."""
    pool = PoolEvents(BLOCK, num_slots=2)
    planned: set[bytes] = set()  # described, not yet stored in the pool nor settled
    held: dict[str, dict[bytes, tuple[Any, ...]]] = {MEDIUM_CPU: {}, MEDIUM_REMOTE: {}}

    def hashes(n: int) -> tuple[Any, ...]:
        return tuple(_Request(n).block_hashes)

    for what, n in facts:
        key = bytes([n])
        expected: list[tuple[bool, str, tuple[Any, ...]]] = []
        medium = MEDIUM_REMOTE if what in ("remote", "gone") else MEDIUM_CPU
        chunks = held[medium]
        if what == "plan":
            pool.planned(_Request(n), key, 0, 4 * BLOCK)
            if key not in held[MEDIUM_CPU]:
                planned.add(key)
        elif what == "settle":
            pool.settled([key])
            planned.discard(key)
        elif what in ("store", "remote"):
            if what == "store":
                pool.pool_changed(key, True)
            else:
                pool.remote_stored([key])
            described = key in planned or key in held[MEDIUM_CPU]
            if key not in chunks and described:
                chunks[key] = hashes(n)
                expected.append((True, medium, hashes(n)))
            if what == "store":
                planned.discard(key)
        else:
            if what == "evict":
                pool.pool_changed(key, False)
            else:
                pool.remote_gone([key])
            left = chunks.pop(key, None)
            if left is not None:
                still = {h for other in chunks.values() for h in other}
                gone = tuple(h for h in left if h not in still)
                if gone:
                    expected.append((False, medium, gone))
        got = pool.take()
        assert [(e.stored, e.medium, e.block_hashes) for e in got] == expected
        for e in got:
            if e.stored:
                assert e.token_ids == tuple(_Request(n).all_token_ids)
