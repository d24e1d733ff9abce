"""The pool's KV events on vLLM's real engine, read as a KV-aware router reads them: a ZMQ
subscriber decoding vLLM's published ``KVEventBatch`` stream (``--kv-events-config`` with the
zmq publisher), while the engine runs with prefix caching on and KVLedgerConnector's pool too
small for the workload, so chunks are stored, evicted and stored again.

Against the run's own log (read here from its recorded facts alone, not by the connector's
code): every chunk the pool stored has one ``BlockStored`` (medium ``CPU``) with the chunk's
tokens, in the order the log stored them; every eviction one ``BlockRemoved`` of the same
hashes. Against vLLM's own events (medium ``GPU``, its prefix cache): every block hash the
pool announces is the hash vLLM announced for the same tokens, and every parent hash is the
hash of the block before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _kv_events import Subscriber, assert_matches_log, assert_vllms_own_hashes

from kvledger.connector.testing.engine import EngineSpec
from kvledger.connector.testing.served import free_port

from .conftest import prompts

BLOCK = 32
# The tiny model keeps 2 layers x 2 KV heads x 64 x fp32 x (K, V): 2048 bytes a token, so a
# chunk of one block takes 64 KiB and the pool holds 4.
SLOTS = 4
CONNECTOR = {"chunk_size": BLOCK, "host_pool_bytes": SLOTS * BLOCK * 2048}
TOPIC = "kvledger-test"


@pytest.fixture(scope="module")
def run(tiny_model: str) -> Iterator[dict[str, Any]]:
    from kvledger.connector.testing.engine import Engine

    port, replay = free_port(), free_port()
    # Before the engine: a SUB may connect before the PUB binds. What it misses while it joins
    # it reads from the replay endpoint, as a router does.
    subscriber = Subscriber(port, TOPIC, replay)
    spec = EngineSpec(
        model=tiny_model,
        num_blocks=8,
        block_size=BLOCK,
        max_model_len=160,
        prefix_caching=True,
        extra_config=CONNECTOR,
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": TOPIC,
        },
    )
    first = prompts(tiny_model, 31, [70, 96, 100, 72, 90, 128])
    try:
        with Engine(spec) as engine:
            engine.generate(first, 8)
            engine.generate(first[:3], 8)  # back from the pool, or computed again
            log_path = engine.log_path
        subscriber.wait_quiet()  # the publisher drains its queue at shutdown
    finally:
        subscriber.close()
    assert log_path is not None
    yield {"events": subscriber.events, "seqs": subscriber.seqs, "log": log_path}


def test_every_stored_chunk_and_every_eviction_is_on_the_stream(run: dict[str, Any]) -> None:
    assert run["seqs"] == list(range(len(run["seqs"]))), "a batch of the stream is missing"
    stored, _ = assert_matches_log(run["events"], run["log"], "CPU")
    assert len(stored) > SLOTS, "the workload must fill the pool and evict"


def test_the_pool_announces_vllms_own_hashes(run: dict[str, Any]) -> None:
    assert_vllms_own_hashes(run["events"], BLOCK)
