"""The remote tier's store (``connector/remote.py``) against a real ``redis-server``; its
configuration; and the remote facts' fold (``tracker/remote.py``) and the two-tier lookup.
The value format is tests/test_values.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _redis import RedisServer, redis_server, require_redis_server

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.connector.remote import MISSING, RemoteStore, remote_key
from kvledger.connector.values import PIECE_BYTES, Sealed, ValueSeal
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tiers import REMOTE_SLOT
from kvledger.tracker.tracker import Tracker

__all__ = ["redis_server"]  # the fixture, imported for pytest


def _store(url: str, **kw: object) -> RemoteStore:
    return RemoteStore(url, timeout_s=2.0, retry_s=0.05, **kw)  # type: ignore[arg-type]


def _seal(rank: int = 0) -> ValueSeal:
    return ValueSeal(rank=rank, layout=b"L" * 16)


def _sealed(key: bytes, payload: bytes, rank: int = 0) -> tuple[bytes, Sealed]:
    return key, _seal(rank).seal(key, memoryview(payload))


def _opened(keys: list[bytes], got: list[object], size: int, rank: int = 0) -> list[object]:
    """What the worker makes of each value ``get`` returned: its bytes, or why not."""
    out: list[object] = []
    for key, value in zip(keys, got, strict=True):
        if isinstance(value, str):
            out.append(value)
            continue
        opened = _seal(rank).open(key, value, size)  # type: ignore[arg-type]
        out.append(opened if isinstance(opened, str) else bytes(opened.payload))
    return out


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["remote_timeout_ms", "remote_lookup_timeout_ms", "remote_ttl_s"])
def test_a_bad_remote_bound_is_a_startup_error_naming_the_key(key: str) -> None:
    with pytest.raises(ConnectorConfigError, match=key):
        ConnectorConfig.from_extra_config({key: -1}, environ={})


def test_a_chunk_larger_than_the_server_takes_refuses_to_start() -> None:
    """The worker asks its tier whether it holds a chunk of the caches' size; Redis's answer
    is ``remote_max_chunk_bytes`` (the server's proto-max-bulk-len)."""
    from kvledger.connector.testing.oracle import KVOracle
    from kvledger.connector.worker import WorkerSide

    oracle = KVOracle(["layer.0"], num_blocks=8, block_size=16, num_kv_heads=2, head_size=4)
    extra = {"chunk_size": 32, "remote_url": "redis://127.0.0.1:1/0"}  # down: served around
    for limit, refused in ((1024, True), (1 << 20, False)):
        config = ConnectorConfig.from_extra_config(
            {**extra, "remote_max_chunk_bytes": limit}, environ={}
        )
        worker = WorkerSide(config, num_slots=2)
        if refused:
            with pytest.raises(
                ConnectorConfigError,
                match=r"remote_max_chunk_bytes \(1024\) is smaller than one chunk \(2048 bytes\)",
            ):
                worker.register_kv_caches(oracle.caches)
        else:
            worker.register_kv_caches(oracle.caches)
            assert worker.pool is not None and worker.pool.slot_bytes == 2048
        worker.shutdown()


def test_no_remote_url_means_no_remote_tier() -> None:
    from kvledger.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig(chunk_size=32), block_size=16, num_slots=4)
    assert side.remote is None
    assert len(side.tracker.index.remote) == 0


# --- the store, on a real server -----------------------------------------------------------------


@pytest.mark.redis
def test_put_exists_get_round_trip(redis_server: RedisServer) -> None:
    store = _store(redis_server.url, rank=1)
    assert store.check() is None
    a, b = os.urandom(1000), os.urandom(1000)
    store.put([_sealed(b"k" * 16, a, 1), _sealed(b"j" * 16, b, 1)])
    assert store.exists([b"k" * 16, b"x" * 16, b"j" * 16]) == [1, 0, 1]
    keys = [b"j" * 16, b"x" * 16, b"k" * 16]
    assert _opened(keys, store.get(keys), 1000, rank=1) == [b, MISSING, a]
    # Keyed by rank: another rank's share is another key.
    assert _store(redis_server.url, rank=0).exists([b"k" * 16]) == [0]
    assert redis_server.client().exists(remote_key(b"k" * 16, 1)) == 1


@pytest.mark.redis
def test_a_multi_piece_value_with_a_ttl_is_stored_whole_with_its_header(
    redis_server: RedisServer,
) -> None:
    # put() sends a zeroed header and the payload, then writes the header once the CRCs of
    # its pieces are known: the stored value is exactly the sealed value, header and payload.
    store = _store(redis_server.url, ttl_s=100)
    payload = os.urandom(2 * PIECE_BYTES + 12345)  # three pieces, the last one short
    m, n = _sealed(b"m" * 16, payload), _sealed(b"n" * 16, payload[:7])
    store.put([m, n])
    raw = redis_server.client()
    name = remote_key(b"m" * 16, 0)
    assert raw.get(name) == m[1].to_bytes()
    assert 0 < raw.ttl(name) <= 100
    keys = [b"n" * 16, b"m" * 16]
    # A 7-byte value read as a chunk of the other size; the other one whole.
    assert _opened(keys, store.get(keys), len(payload)) == ["length", payload]
    # The connection went back to the pool clean: the next command reads its own reply.
    assert store.exists([b"m" * 16, b"n" * 16]) == [1, 1]
    # Published by RENAME: no temporary key is left; without a TTL the value keeps none.
    _store(redis_server.url).put([_sealed(b"o" * 16, payload[:100])])
    assert raw.ttl(remote_key(b"o" * 16, 0)) == -1
    assert sorted(raw.keys()) == sorted(remote_key(k * 16, 0) for k in (b"m", b"n", b"o"))


@pytest.mark.redis
def test_wrong_length_and_wrong_bytes_in_the_server_are_refused(redis_server: RedisServer) -> None:
    store = _store(redis_server.url)
    payload = os.urandom(4096)
    keys = [bytes([i]) * 16 for i in range(3)]
    store.put([_sealed(k, payload) for k in keys])
    raw = redis_server.client()
    value = raw.get(remote_key(keys[0], 0))
    raw.set(remote_key(keys[0], 0), value[:-1])  # short
    raw.setrange(remote_key(keys[1], 0), len(value) - 100, b"\x00garbage")  # wrong bytes
    assert _opened(keys, store.get(keys), 4096) == ["length", "checksum", payload]


@pytest.mark.redis
def test_a_password_is_honoured_and_a_wrong_one_is_a_clear_startup_error(tmp_path: Path) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    server = RedisServer(require_redis_server(), tmp_path, password="s3cret-pw")
    server.start()
    try:
        assert _store(server.url).check() is None
        _store(server.url).put([_sealed(b"p" * 16, b"xyz")])
        assert server.client().exists(remote_key(b"p" * 16, 0)) == 1
        for url in (server.url_with("wrong-pw"), f"redis://127.0.0.1:{server.port}/0"):
            config = ConnectorConfig.from_extra_config({"remote_url": url, "chunk_size": 32})
            with pytest.raises(ConnectorConfigError, match="remote_url") as info:
                SchedulerSide(config, block_size=16, num_slots=4)
            assert "refused the credentials" in str(info.value)
            assert "wrong-pw" not in str(info.value) and "s3cret" not in str(info.value)
    finally:
        server.stop()


@pytest.mark.redis
def test_a_server_down_backs_off_and_is_not_fatal(tmp_path: Path) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    server = RedisServer(require_redis_server(), tmp_path)  # never started: refused
    config = ConnectorConfig.from_extra_config({"remote_url": server.url, "chunk_size": 32})
    side = SchedulerSide(config, block_size=16, num_slots=4)  # no crash
    assert side.remote is not None and not side.remote.available()  # backing off
    assert not side.tracker.index.remote.up  # the outage is a folded fact
    side.build_connector_meta(_EmptyStep())  # probes again only after the back-off


class _EmptyStep:
    preempted_req_ids: tuple[str, ...] = ()
    scheduled_new_reqs: tuple[object, ...] = ()
    num_scheduled_tokens: dict[str, int] = {}  # noqa: RUF012

    class scheduled_cached_reqs:
        req_ids: tuple[str, ...] = ()
        num_computed_tokens: tuple[int, ...] = ()
        new_block_ids: tuple[object, ...] = ()


# --- the fold: remote facts and the two-tier lookup ----------------------------------------------


def _tracker() -> Tracker:
    return Tracker(TrackerConfig(block_size=16, chunk_size=32, num_slots=8))


def test_a_lookup_counts_only_what_the_store_was_seen_holding() -> None:
    t = _tracker()
    prompt = list(range(100, 200))  # 3 full chunks and a tail
    t.add_request("a", prompt)
    keys = t.state("a").keys[:3]  # type: ignore[union-attr]
    assert t.lookup("a", 0, prompt) == 0
    t.apply(ev.RemoteFound(t.step, "a", tuple(keys), (1, 1, 0)))
    assert t.lookup("a", 0, prompt) == 64  # the first two chunks; the third was not there
    t.apply(ev.RemoteLoadFailed(t.step, "a", (keys[1],), "missing"))
    assert t.lookup("a", 0, prompt) == 32  # the key is gone from our index
    t.apply(ev.RemoteOutage(t.step, "", "refused"))
    assert t.lookup("a", 0, prompt) == 0  # a store down offers nothing
    t.apply(ev.RemoteRestored(t.step, ""))
    assert t.lookup("a", 0, prompt) == 0  # and what it held before is not assumed back
    t.apply(ev.RemoteSaveDone(t.step, "", tuple(keys)))
    assert t.lookup("a", 0, prompt) == 96


def test_a_key_whose_value_was_foreign_is_counted_again_only_once_written_here() -> None:
    t = _tracker()
    prompt = list(range(100, 200))
    t.add_request("a", prompt)
    keys = t.state("a").keys[:3]  # type: ignore[union-attr]
    t.apply(ev.RemoteFound(t.step, "a", tuple(keys), (1, 1, 1)))
    assert t.lookup("a", 0, prompt) == 96
    t.apply(ev.RemoteLoadFailed(t.step, "a", (keys[1],), "misplaced: the value of chunk 00"))
    t.apply(ev.RemoteFound(t.step, "a", tuple(keys), (1, 1, 1)))
    assert t.lookup("a", 0, prompt) == 32  # the store holds a value, not this chunk's
    t.apply(ev.RemoteLoadFailed(t.step, "a", (keys[2],), "checksum"))  # damage: not distrust
    t.apply(ev.RemoteFound(t.step, "a", (keys[2],), (1,)))
    t.apply(ev.RemoteSaveDone(t.step, "", (keys[1],)))  # this engine wrote the right value
    assert t.lookup("a", 0, prompt) == 96
    assert [v.rule for v in t.violations] == ["foreign_value"]


def _counted_remote(t: Tracker, prompt: list[int]) -> list[bytes]:
    """Request "a": a lookup that counts its 3 full chunks from the server, then allocated."""
    t.add_request("a", prompt)
    keys = t.state("a").keys[:3]  # type: ignore[union-attr]
    t.apply(ev.RemoteFound(t.step, "a", tuple(keys), (1, 1, 1)))
    assert t.lookup("a", 0, prompt) == 96
    t.allocated("a", tuple(range(1, 8)), 96)
    return keys


def _load_plan(t: Tracker, prompt: list[int]) -> ev.LoadPlanned:
    """Request "a" admitted at 96 computed tokens: its load plan."""
    decisions = t.scheduled(
        "a",
        num_computed=96,
        num_scheduled=4,
        block_ids=tuple(range(1, 8)),
        admission=ev.Admission.NEW,
        all_token_ids=prompt,
    )
    return next(d for d in decisions if isinstance(d, ev.LoadPlanned))


def test_a_load_plan_names_remote_chunks_by_the_remote_slot() -> None:
    t = _tracker()
    prompt = list(range(100, 200))
    _counted_remote(t, prompt)
    load = _load_plan(t, prompt)
    assert (load.start, load.end, load.slots) == (0, 96, (REMOTE_SLOT,) * 3)


@pytest.mark.parametrize("restored", [False, True])
def test_an_outage_between_a_lookup_and_its_load_plan_is_no_broken_rule(restored: bool) -> None:
    """Another request's lookup times out after this one counted remote chunks, in the same
    step (and the probe may even see the server back before the step's plans): the load is
    still planned from the server, whose read then fails or not; no lookup after the outage
    offers what the server held before it."""
    t = _tracker()
    prompt = list(range(100, 200))
    keys = _counted_remote(t, prompt)
    t.apply(ev.RemoteOutage(t.step, "", "TimeoutError: Timeout reading from socket"))
    if restored:
        t.apply(ev.RemoteRestored(t.step, ""))
    t.add_request("b", prompt)
    assert t.lookup("b", 0, prompt) == 0  # nothing is offered from before the outage
    load = _load_plan(t, prompt)
    assert (load.start, load.end, load.slots) == (0, 96, (REMOTE_SLOT,) * 3)
    assert t.violations == []
    # A key a load then found gone is not loadable any more.
    t.apply(ev.RemoteLoadFailed(t.step, "a", (keys[0],), "unavailable"))
    assert not t.index.remote.loadable(keys[0]) and t.index.remote.loadable(keys[1])
