"""A value belongs to its key (issue 30), under vLLM's real scheduler with the KV-content
oracle checked after every step (``connector.testing.run``), on a real ``redis-server`` and a
``file://`` directory.

One engine fills the tier; the tier is then tampered with the way the field does it: values
swapped between keys (an operator's ``RENAME``, a buggy client, files copied over each
other), a value written by an engine whose KV bytes mean something else under the same keys,
and, with a shared secret, a value written without it. A second engine serves the same
workload from the tier. Each time: no wrong KV (the oracle), no crash, every refused value a
recorded ``RemoteLoadFailed`` naming why and a ``foreign_value`` violation, ``kvledger
check`` exits 1 naming it, and the tier heals (a third engine loads the right values the
second one wrote back).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _redis import RedisServer, redis_server
from _rigs import assert_clean, check_clean
from _verdicts import events_of

from kvledger.connector.testing.harness import skip_reason
from kvledger.tracker import events as ev
from kvledger.tracker.remote import foreign
from kvledger.tracker.tiers import REMOTE_SLOT

__all__ = ["redis_server"]  # the fixture, imported for pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=8, prompt_len=(48, 160), max_tokens=(8, 48), seed=0
)
SECRET = "0123456789abcdef0123456789abcdef"


def _run(url: str, log_dir: Path, **extra: Any) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    config = {"chunk_size": 32, "remote_url": url, "remote_retry_ms": 20, **extra}
    return run(RunSpec(**{**WORKLOAD, "extra_config": config}), log_dir=str(log_dir))


def _refused(events: list[ev.Event]) -> list[ev.RemoteLoadFailed]:
    return [e for e in events if isinstance(e, ev.RemoteLoadFailed)]


def _remote_loads_done(events: list[ev.Event]) -> int:
    """Loads that read the tier and completed."""
    pending: set[str] = set()
    done = 0
    for e in events:
        if isinstance(e, ev.LoadPlanned) and REMOTE_SLOT in e.slots:
            pending.add(e.req_id)
        elif isinstance(e, ev.LoadDone) and e.req_id in pending:
            pending.discard(e.req_id)
            done += 1
        elif isinstance(e, ev.LoadFailed):
            pending.discard(e.req_id)
    return done


def _served_without_wrong_kv(report: Any, reason: str) -> list[ev.Event]:
    """The run had no oracle mismatch, refused values with ``reason``, recorded each as a
    ``foreign_value`` violation and nothing else; its log checks exit 1 naming it."""
    from kvledger.replay.explain import explain
    from kvledger.replay.replayer import check

    assert [m.describe() for m in report.mismatches] == []
    assert report.leaks == () and report.adapter_errors == 0
    assert report.finished == report.requests
    assert report.load_errors > 0
    events = events_of(report.log_path)
    refused = _refused(events)
    assert refused and all(e.reason.startswith(reason) and foreign(e.reason) for e in refused)
    rules = {v.split(": ")[1].split(" at ")[0] for v in report.violations}
    assert rules == {"foreign_value"}, report.violations
    result = check(report.log_path)
    assert result.exit_code == 1
    assert {p.name for p in result.problems} == {"foreign_value"}
    assert all(p.kind == "violation" and p.recorded_too for p in result.problems)
    # explain names it, for the tokens whose load read a refused value, with the reason.
    misses = [
        m
        for r in explain(report.log_path).requests
        for a in r.admissions
        for m in a.misses
        if m.reason == "foreign_value"
    ]
    assert misses and all(m.detail.startswith(reason) for m in misses)
    assert {m.step for m in misses} <= {e.step for e in refused}
    return events


def _swap_pairs(names: list[Any], rename: Any) -> int:
    """Swap the values of consecutive names, two by two."""
    pairs = 0
    for a, b in zip(names[::2], names[1::2], strict=False):
        rename(a, b)
        pairs += 1
    return pairs


@pytest.mark.redis
def test_values_swapped_between_redis_keys_are_refused_and_the_tier_heals(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    assert_clean(_run(redis_server.url, tmp_path / "a"))
    raw = redis_server.client()
    names = sorted(raw.keys(b"kvledger:v2:*"))
    assert len(names) >= 4

    def swap(a: bytes, b: bytes) -> None:
        raw.rename(a, b"swap-tmp")
        raw.rename(b, a)
        raw.rename(b"swap-tmp", b)

    assert _swap_pairs(names, swap) >= 2
    second = _run(redis_server.url, tmp_path / "b")
    events = _served_without_wrong_kv(second, "misplaced: the value of chunk ")
    # Each refusal names the chunk the value belongs to: its swap partner.
    partner = {}
    for a, b in zip(names[::2], names[1::2], strict=False):
        ka, kb = (bytes.fromhex(n.split(b":")[2].decode()) for n in (a, b))
        partner[ka], partner[kb] = kb, ka
    for e in _refused(events):
        (key,) = e.keys
        assert e.reason == f"misplaced: the value of chunk {partner[key].hex()}"
    # The second engine recomputed and wrote the right values back: a third loads them.
    third = _run(redis_server.url, tmp_path / "c")
    assert_clean(third)
    assert _remote_loads_done(events_of(third.log_path)) > 0
    check_clean(third.log_path)


def test_chunk_files_swapped_in_a_file_tier_are_refused(tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    assert_clean(_run(chunks.as_uri(), tmp_path / "a"))
    names = sorted(os.listdir(chunks))
    assert len(names) >= 4

    def swap(a: str, b: str) -> None:
        os.rename(chunks / a, chunks / "swap.tmp")
        os.rename(chunks / b, chunks / a)
        os.rename(chunks / "swap.tmp", chunks / b)

    assert _swap_pairs(names, swap) >= 2
    _served_without_wrong_kv(_run(chunks.as_uri(), tmp_path / "b"), "misplaced: ")


def test_a_value_written_under_another_kv_layout_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose KV bytes mean something else computes the same chunk keys (the salt
    misses what differs): its values are bound to its own layout, and refused here."""
    import kvledger.connector.worker as worker
    from kvledger.connector.values import layout_fingerprint

    chunks = tmp_path / "chunks"
    monkeypatch.setattr(
        worker, "layout_fingerprint", lambda *parts: layout_fingerprint("another", *parts)
    )
    assert_clean(_run(chunks.as_uri(), tmp_path / "a"))
    monkeypatch.undo()
    _served_without_wrong_kv(_run(chunks.as_uri(), tmp_path / "b"), "wrong_layout: ")


@pytest.mark.redis
def test_with_a_secret_a_value_written_without_it_is_refused(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tenant with write access but not the secret fills the tier first.
    assert_clean(_run(redis_server.url, tmp_path / "a"))
    monkeypatch.setenv("KVLEDGER_TEST_SECRET", SECRET)
    keyed = {"remote_secret_env": "KVLEDGER_TEST_SECRET"}
    second = _run(redis_server.url, tmp_path / "b", **keyed)
    _served_without_wrong_kv(second, "unauthenticated: written without the secret")
    # The values the keyed engine wrote back open for an engine holding the secret.
    third = _run(redis_server.url, tmp_path / "c", **keyed)
    assert_clean(third)
    assert _remote_loads_done(events_of(third.log_path)) > 0
    check_clean(third.log_path)
