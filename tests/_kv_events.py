"""What the KV-event tests share (tests/test_pool_events.py under vLLM's real scheduler,
tests/engine/test_engine_kv_events.py on its real engine): the pool's history read from a
log's recorded facts alone, and the checks of a KV-event stream against it and against vLLM's
own (medium ``GPU``) events; and a router's side of vLLM's ZMQ stream."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from _verdicts import events_of

from kvledger.replay.source import open_log
from kvledger.tracker import events as ev


def _pool_from_log(path: str) -> tuple[list[tuple[bool, bytes]], dict[bytes, tuple[int, ...]]]:
    """The pool's history as the log's facts tell it: (stored, key) for each key stored (True)
    or evicted (False), in the log's order, and each key's tokens (a request's tokens are its
    prompt and what its lookups and steps carried). The run has no failed load and no pool
    event from outside the plans (asserted), so a SaveDone stores each key not already stored,
    and a SavePlanned's ``evicted`` are the only evictions."""
    tokens_of: dict[str, list[int]] = {}
    chunk_of: dict[bytes, tuple[str, int, int]] = {}  # key -> (its saver, its tokens' range)
    tokens: dict[bytes, tuple[int, ...]] = {}
    stored: set[bytes] = set()
    history: list[tuple[bool, bytes]] = []
    source = open_log(path)
    chunk = int(source.tracker_config["chunk_size"])
    block = int(source.tracker_config["block_size"])
    for event in (e for frame in source.frames() for e in frame.events):
        assert not isinstance(event, (ev.LoadFailed, ev.ChunkEvicted, ev.ChunkStored))
        if isinstance(event, ev.RequestAdded):
            tokens_of[event.req_id] = list(event.prompt_token_ids)
        elif isinstance(event, (ev.LookupAsked, ev.Scheduled)) and event.token_ids:
            known = tokens_of[event.req_id]
            at = event.token_start
            known[at : at + len(event.token_ids)] = event.token_ids
        elif isinstance(event, ev.SavePlanned):
            for key in event.evicted:
                stored.discard(key)
                history.append((False, key))
            first = event.start // chunk
            for i, key in enumerate(event.keys):
                # A chunk the prompt ends inside is saved as its whole blocks, a key of its own.
                at = (first + i) * chunk
                chunk_of[key] = (event.req_id, at, min(at + chunk, event.end))
        elif isinstance(event, ev.SaveDone):
            for key in event.keys:
                if key not in stored:
                    stored.add(key)
                    history.append((True, key))
    # Read at the end: a steady decode step's tokens are carried by a later event.
    for key in {key for _, key in history}:
        req_id, at, end = chunk_of[key]
        tokens[key] = tuple(tokens_of[req_id][at:end])
        assert len(tokens[key]) == end - at and (end - at) % block == 0, "whole blocks"
    return history, tokens


def remote_from_log(path: str) -> list[bytes]:
    """The keys this engine's remote writes confirmed, first confirmation of each, in order."""
    done = (key for e in events_of(path) if isinstance(e, ev.RemoteSaveDone) for key in e.keys)
    return list(dict.fromkeys(done))


def assert_matches_log(events: list[Any], log: str, medium: str) -> tuple[list[Any], list[Any]]:
    """The stream's events of ``medium`` against the log: for ``CPU`` one ``BlockStored`` per
    chunk the pool stored, with its tokens, in the log's order, and for each eviction one
    ``BlockRemoved`` of the hashes its chunk's ``BlockStored`` announced that no chunk the pool
    still held contains (none at all when every one is still held); for ``REMOTE`` one
    ``BlockStored`` per key whose remote write was confirmed. Returns (stored, removed)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    history, tokens = _pool_from_log(log)
    if medium == "REMOTE":
        history = [(True, key) for key in remote_from_log(log)]
    mine = [e for e in events if getattr(e, "medium", None) == medium]
    stored = [e for e in mine if isinstance(e, BlockStored)]
    removed = [e for e in mine if isinstance(e, BlockRemoved)]
    order = [key for was_stored, key in history if was_stored]
    assert order, f"the log stored nothing on {medium}"
    assert [tuple(e.token_ids) for e in stored] == [tokens[k] for k in order]
    hashes_of = {k: tuple(e.block_hashes) for k, e in zip(order, stored, strict=True)}
    holders: Counter[Any] = Counter()
    expected: list[tuple[Any, ...]] = []
    for was_stored, key in history:
        if was_stored:
            holders.update(hashes_of[key])
            continue
        holders.subtract(hashes_of[key])
        gone = tuple(h for h in hashes_of[key] if holders[h] == 0)
        if gone:
            expected.append(gone)
    assert [tuple(e.block_hashes) for e in removed] == expected
    return stored, removed


def assert_vllms_own_hashes(events: list[Any], block_size: int) -> None:
    """Every block hash the pool announces (any medium but ``GPU``) is the one vLLM's prefix
    cache announced for the same tokens, and its parent hash is the one vLLM gave that block."""
    from vllm.distributed.kv_events import BlockStored

    gpu: dict[Any, tuple[int, ...]] = {}
    parent_of: dict[Any, Any] = {}  # each hash vLLM announced -> the hash of the block before
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            for j, h in enumerate(e.block_hashes):
                gpu[h] = tuple(e.token_ids[j * e.block_size : (j + 1) * e.block_size])
                parent_of[h] = e.block_hashes[j - 1] if j else e.parent_block_hash
    ours = [e for e in events if isinstance(e, BlockStored) and e.medium != "GPU"]
    assert ours and gpu
    for e in ours:
        assert e.block_size == block_size
        for j, h in enumerate(e.block_hashes):
            assert gpu.get(h) == tuple(e.token_ids[j * block_size : (j + 1) * block_size]), h
        assert e.parent_block_hash == parent_of[e.block_hashes[0]]


class Subscriber:
    """A router's side of vLLM's stream: SUB on the publisher's endpoint, each message
    ``(topic, seq, payload)`` decoded as vLLM's ``KVEventBatch``. With ``replay_port`` (the
    publisher's ``replay_endpoint``), batches the SUB missed are asked for there, as a router
    does: a SUB that joins while the PUB is binding misses its first messages (ZMQ's slow
    joiner), and an engine that starts fast publishes before the SUB has joined."""

    def __init__(self, port: int, topic: str, replay_port: int | None = None) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._topic = topic
        self._socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._replay = None if replay_port is None else f"tcp://127.0.0.1:{replay_port}"
        self.events: list[Any] = []
        self.seqs: list[int] = []
        self.replayed = 0  # batches the SUB missed, read from the replay endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            topic, seq, payload = self._socket.recv_multipart()
            assert topic.decode() == self._topic
            n = int.from_bytes(seq, "big", signed=True)
            missed_from = self.seqs[-1] + 1 if self.seqs else 0
            if n > missed_from and self._replay is not None:
                self._missed(missed_from, n)
            self._take(n, payload)

    def _take(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        self.events.extend(self._decoder.decode(payload).events)

    def _missed(self, start: int, end: int) -> None:
        """Batches ``start`` to ``end`` (excluded), from the publisher's replay endpoint (a
        ROUTER: ask with the first seq wanted, read batches up to its end marker, seq -1)."""
        import zmq

        assert self._replay is not None
        ask = zmq.Context.instance().socket(zmq.DEALER)
        ask.connect(self._replay)
        try:
            ask.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert ask.poll(10_000), f"no replay of batches {start} to {end} in 10 s"
                _, _, seq, payload = ask.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n < 0:
                    return
                if start <= n < end:
                    self._take(n, payload)
                    self.replayed += 1
        finally:
            ask.close(linger=0)

    def wait_quiet(self, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
        """Until nothing arrived for ``quiet_s`` (the stream's last batches are in)."""
        deadline = time.monotonic() + limit_s
        seen = -1
        while time.monotonic() < deadline and seen != len(self.events):
            seen = len(self.events)
            time.sleep(quiet_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._socket.close(linger=0)
