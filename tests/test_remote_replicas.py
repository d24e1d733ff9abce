"""Engines sharing one real ``redis-server`` through the remote tier, each under vLLM's real
scheduler with the KV-content oracle checked after every step (``connector.testing.run``).

- sharing: two engines in two processes; the second loads the first one's prefixes from the
  server in its first admissions;
- eviction: a key deleted from the server between the lookup that found it and the load;
- corrupt values: short values and wrong bytes in the server;
- outage: the server killed mid-run, then restarted empty.

Each time: no crash, no oracle mismatch, no violation, the fact in the log, and
``kvledger check`` re-derives every decision of every replica's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _redis import RedisServer, redis_server
from _rigs import assert_clean, check_clean
from _verdicts import events_of

from kvledger.connector.testing.harness import skip_reason
from kvledger.tracker import events as ev
from kvledger.tracker.tiers import REMOTE_SLOT

__all__ = ["redis_server"]  # the fixture, imported for pytest

pytestmark = [
    pytest.mark.redis,
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

# A workload with shared prefixes and preemptions; the same seed gives the same prompts in
# every replica, so a later replica finds an earlier one's chunks.
WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=8, prompt_len=(48, 160), max_tokens=(8, 48), seed=0
)


def _extra(url: str, **more: Any) -> dict[str, Any]:
    return {"chunk_size": 32, "remote_url": url, "remote_retry_ms": 20, **more}


def _run(
    url: str,
    log_dir: Path,
    progress: Callable[[int, int, int], None] | None = None,
    extra: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    spec = RunSpec(**{**WORKLOAD, **kw, "extra_config": _extra(url, **(extra or {}))})
    return run(spec, log_dir=str(log_dir), progress=progress)


def _remote_tokens(events: list[ev.Event]) -> dict[str, int]:
    """Tokens each request's first load read from the remote store."""
    first: dict[str, int] = {}
    for e in events:
        if isinstance(e, ev.LoadPlanned) and e.keys and e.req_id not in first:
            first[e.req_id] = (e.end - e.start) if REMOTE_SLOT in e.slots else 0
    return first


_REPLICA = """
import json, sys
from kvledger.connector.testing.run import RunSpec, run
spec = RunSpec(**json.loads(sys.argv[1]))
r = run(spec, log_dir=sys.argv[2])
print(json.dumps({"mismatches": [m.describe() for m in r.mismatches], "violations": r.violations,
                  "leaks": r.leaks, "adapter_errors": r.adapter_errors, "log": r.log_path,
                  "loaded": r.tokens_loaded, "finished": r.finished, "requests": r.requests}))
"""


def _replica_process(url: str, log_dir: Path) -> dict[str, Any]:
    """One engine in a process of its own."""
    spec = {**WORKLOAD, "prompt_len": list(WORKLOAD["prompt_len"]), "extra_config": _extra(url)}
    spec["max_tokens"] = list(WORKLOAD["max_tokens"])
    done = subprocess.run(
        [sys.executable, "-c", _REPLICA, json.dumps(spec), str(log_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == [] and out["violations"] == [] and out["leaks"] == []
    assert out["adapter_errors"] == 0 and out["finished"] == out["requests"]
    return out


def test_two_replicas_in_two_processes_share_prefixes(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    first = _replica_process(redis_server.url, tmp_path / "a")
    second = _replica_process(redis_server.url, tmp_path / "b")
    a, b = events_of(first["log"]), events_of(second["log"])
    # The first engine found nothing remote and wrote every chunk it saved.
    assert sum(_remote_tokens(a).values()) == 0
    written = {k for e in a if isinstance(e, ev.RemoteSaveDone) for k in e.keys}
    assert written
    # The second one loads the first one's prefixes in its first admissions: its first
    # request's first load, and most of its requests', read from the server.
    loaded = _remote_tokens(b)
    assert loaded["req-0"] > 0
    assert sum(1 for n in loaded.values() if n) >= 4
    found = {
        k
        for e in b
        if isinstance(e, ev.RemoteFound)
        for k, f in zip(e.keys, e.found, strict=True)
        if f
    }
    assert found and found <= written
    # What it read from the server it keeps in its host pool, but does not write back.
    read = {
        k
        for e in b
        if isinstance(e, ev.LoadPlanned)
        for k, slot in zip(e.keys, e.slots, strict=True)
        if slot == REMOTE_SLOT
    }
    rewritten = {k for e in b if isinstance(e, ev.RemoteSaveDone) for k in e.keys}
    assert read and not read & rewritten
    assert second["loaded"] > first["loaded"]
    check_clean(first["log"])
    check_clean(second["log"])


def test_a_key_evicted_between_lookup_and_load_is_recomputed(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvledger.connector.remote import remote_key
    from kvledger.connector.worker import WorkerSide

    assert_clean(_run(redis_server.url, tmp_path / "a"))
    raw = redis_server.client()
    fetch = WorkerSide._fetch_remote
    evicted: list[bytes] = []

    def evict_then_fetch(self: WorkerSide, loads: Any) -> None:
        # The lookup found the chunk; the server loses it before the worker reads it.
        if not evicted:
            for load in loads:
                for chunk in load.chunks:
                    if chunk.slot == REMOTE_SLOT and not evicted:
                        raw.delete(remote_key(chunk.key, 0))
                        evicted.append(chunk.key)
        fetch(self, loads)

    monkeypatch.setattr(WorkerSide, "_fetch_remote", evict_then_fetch)
    report = _run(redis_server.url, tmp_path / "b")
    assert_clean(report)  # recomputed: the oracle holds at every step
    assert evicted and report.load_errors > 0
    events = events_of(report.log_path)
    lost = [e for e in events if isinstance(e, ev.RemoteLoadFailed)]
    assert [(e.keys, e.reason) for e in lost] == [((evicted[0],), "missing")]
    assert any(isinstance(e, ev.LoadFailed) and e.req_id == lost[0].req_id for e in events)
    check_clean(report.log_path)


def test_corrupt_values_become_load_failures_never_wrong_kv(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    assert_clean(_run(redis_server.url, tmp_path / "a"))
    raw = redis_server.client()
    names = sorted(raw.keys(b"kvledger:*"))
    assert len(names) >= 4
    for i, name in enumerate(names):
        value = raw.get(name)
        if i % 2:
            raw.set(name, value[:-7])  # a short value
        else:
            raw.setrange(name, len(value) - 3, b"\xff\x00\xff")  # wrong bytes, right length
    report = _run(redis_server.url, tmp_path / "b")
    assert_clean(report)
    assert report.load_errors > 0
    events = events_of(report.log_path)
    reasons = {e.reason for e in events if isinstance(e, ev.RemoteLoadFailed)}
    assert reasons == {"length", "checksum"}
    # A corrupt chunk is never loaded: every load that read the server failed.
    remote_loads: set[str] = set()
    results: dict[str, type] = {}
    for e in events:
        if isinstance(e, ev.LoadPlanned) and REMOTE_SLOT in e.slots:
            remote_loads.add(e.req_id)
        elif isinstance(e, (ev.LoadDone, ev.LoadFailed)) and e.req_id in remote_loads:
            remote_loads.discard(e.req_id)
            results.setdefault(e.req_id, type(e))
            assert type(e) is ev.LoadFailed, f"{e.req_id} loaded a corrupt chunk"
    assert results
    check_clean(report.log_path)


def test_an_outage_mid_run_is_survived_recorded_once_and_sharing_resumes(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    assert_clean(_run(redis_server.url, tmp_path / "a"))

    def outage(step: int, finished: int, total: int) -> None:
        if step == 6:
            redis_server.kill()
        elif step == 30:
            redis_server.start()  # empty: no persistence
            time.sleep(0.05)  # past the back-off

    # The lookup's bound is generous here: on a loaded machine the default 50 ms can time out
    # and be recorded as an outage of its own, and this test counts the outages.
    report = _run(
        redis_server.url,
        tmp_path / "b",
        progress=outage,
        num_requests=12,
        extra={"remote_lookup_timeout_ms": 2000},
    )
    assert_clean(report)  # no crash, the oracle held at every step
    events = events_of(report.log_path)
    kinds = [type(e) for e in events if isinstance(e, (ev.RemoteOutage, ev.RemoteRestored))]
    assert kinds == [ev.RemoteOutage, ev.RemoteRestored]  # recorded once, then back
    restored = next(i for i, e in enumerate(events) if isinstance(e, ev.RemoteRestored))
    assert any(isinstance(e, ev.RemoteSaveDone) for e in events[restored:])
    check_clean(report.log_path)
    # Sharing resumed: the restarted server holds only what was written after it came back,
    # and a third engine loads from it.
    third = _run(redis_server.url, tmp_path / "c", num_requests=12)
    assert_clean(third)
    assert sum(_remote_tokens(events_of(third.log_path)).values()) > 0
    check_clean(third.log_path)


# Each wrong type Redis has, written under a key the way another program would.
_WRONG_TYPES: tuple[Callable[[Any, bytes], Any], ...] = (
    lambda raw, name: raw.rpush(name, b"a", b"b"),
    lambda raw, name: raw.hset(name, b"field", b"value"),
    lambda raw, name: raw.sadd(name, b"member"),
    lambda raw, name: raw.zadd(name, {b"member": 1.0}),
    lambda raw, name: raw.xadd(name, {b"field": b"value"}),
)


def test_keys_of_the_wrong_type_are_load_failures_recorded_and_then_overwritten(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Every chunk key replaced by a list, hash, set, sorted set or stream: each GET is a
    WRONGTYPE error reply. A load failure for that chunk, recorded and recomputed; never a
    raise into vLLM, never an outage; the recomputed chunk's write replaces the key."""
    assert_clean(_run(redis_server.url, tmp_path / "a"))
    raw = redis_server.client()
    names = sorted(raw.keys(b"kvledger:*"))
    assert len(names) >= 4
    values = {name: raw.get(name) for name in names}
    for i, name in enumerate(names):
        raw.delete(name)
        _WRONG_TYPES[i % len(_WRONG_TYPES)](raw, name)
    # A lookup bound a loaded test machine cannot miss: no outage here is the server's.
    report = _run(redis_server.url, tmp_path / "b", extra={"remote_lookup_timeout_ms": 2000})
    assert_clean(report)  # every request finished, the oracle held at every step
    assert report.load_errors > 0
    events = events_of(report.log_path)
    failed = [e for e in events if isinstance(e, ev.RemoteLoadFailed)]
    assert failed
    for e in failed:
        assert e.reason.startswith("refused: ResponseError: WRONGTYPE"), e.reason
    # Every wrong-type chunk a failed load read is recorded, not only the first of the load.
    refused = {k for e in failed for k in e.keys}
    planned: dict[str, set[bytes]] = {}
    for e in events:
        if isinstance(e, ev.LoadPlanned):
            planned[e.req_id] = {
                k for k, slot in zip(e.keys, e.slots, strict=True) if slot == REMOTE_SLOT
            }
        elif isinstance(e, ev.LoadFailed):
            assert planned.get(e.req_id, set()) <= refused, e.req_id
    assert not [e for e in events if isinstance(e, ev.RemoteOutage)]  # the server stayed up
    check_clean(report.log_path)
    # The recomputed chunks were written again: RENAME replaced the wrong-type keys with the
    # very bytes the first replica wrote (the same tokens, the same KV).
    healed = [name for name in names if raw.type(name) == b"string"]
    assert healed
    assert all(raw.get(name) == values[name] for name in healed)


@pytest.mark.parametrize("method", ["exists", "get", "put"])
def test_an_unforeseen_exception_in_the_tier_is_an_outage_never_a_raise(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> None:
    """Whatever the store itself raises (a bug, say), the connector's boundary catches: the
    lookup is a miss, the load is recomputed, the save fails; an outage is recorded naming
    it; nothing reaches vLLM, not even as an adapter error."""
    from kvledger.connector.remote import RemoteStore

    assert_clean(_run(redis_server.url, tmp_path / "a"))
    real = getattr(RemoteStore, method)
    calls: list[int] = []

    def broken(self: RemoteStore, *args: Any) -> Any:
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError(f"unforeseen in {method}")
        return real(self, *args)

    if method == "put":
        redis_server.client().flushall()  # nothing to find: the second replica writes
    monkeypatch.setattr(RemoteStore, method, broken)
    report = _run(redis_server.url, tmp_path / "b", extra={"remote_lookup_timeout_ms": 2000})
    assert_clean(report)
    assert calls
    events = events_of(report.log_path)
    errors = [e.error for e in events if isinstance(e, ev.RemoteOutage)]
    assert any(f"RuntimeError: unforeseen in {method}" in text for text in errors), errors
    check_clean(report.log_path)
