"""The tier interface (``connector/tiers.py``): a tier plugs in through it alone.

``tests/_memory_tier.py`` is a tier no product module knows, registered by URL scheme. Under
vLLM's real scheduler with the KV-content oracle checked after every step
(``connector.testing.run``), two engines share it as they share a Redis server; a chunk it
lost or damaged, and an outage, become the same recorded facts as Redis's, and
``kvledger check`` re-derives every decision of every log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import _memory_tier
import pytest
from _memory_tier import DOWN, STORES, MemoryTier
from _rigs import assert_clean, check_clean
from _verdicts import events_of

from kvledger.connector.config import TIER_SCHEMES, ConnectorConfig, ConnectorConfigError
from kvledger.connector.scheduler import SchedulerSide
from kvledger.connector.testing.harness import skip_reason
from kvledger.connector.tiers import REDIS_TIER, Tier, open_tier, register_tier, registered_tiers
from kvledger.tracker import events as ev
from kvledger.tracker.tiers import POOL, REMOTE, REMOTE_SLOT, slot_of, tier_of_slot

WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=8, prompt_len=(48, 160), max_tokens=(8, 48), seed=0
)


@pytest.fixture(autouse=True)
def _registered() -> Any:
    before = dict(TIER_SCHEMES)
    _memory_tier.register()
    yield
    TIER_SCHEMES.clear()
    TIER_SCHEMES.update(before)


def _url() -> str:
    return f"memory://t{uuid.uuid4().hex}"


def _config(url: str) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"chunk_size": 32, "remote_url": url}, environ={})


# --- the registry and the interface ------------------------------------------------------------


def test_the_slot_codes_name_each_tier_once() -> None:
    assert tier_of_slot(0) == tier_of_slot(7) == POOL
    assert tier_of_slot(REMOTE_SLOT) == REMOTE and slot_of(REMOTE) == REMOTE_SLOT == -1
    assert tier_of_slot(-2) is None  # a code no tier has (a damaged log)


def test_a_registered_scheme_opens_its_tier_and_redis_urls_open_redis() -> None:
    url = _url()
    tier = open_tier(_config(url), rank=3, scheduler=False)
    assert isinstance(tier, MemoryTier) and isinstance(tier, Tier) and tier.rank == 3
    assert registered_tiers()["memory"] == ("_memory_tier", "MemoryTier")
    assert open_tier(ConnectorConfig(), scheduler=True) is None
    from kvledger.connector.remote import RemoteStore

    assert (RemoteStore.__module__, RemoteStore.__name__) == REDIS_TIER
    redis = open_tier(_config("redis://127.0.0.1:1/0"), scheduler=True)  # opens; never asked
    assert isinstance(redis, RemoteStore) and isinstance(redis, Tier)
    redis.close()


def test_a_scheme_nobody_registered_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConnectorConfigError, match=r"remote_url must start with .*memory://"):
        _config("nosuch://x")
    with pytest.raises(ConnectorConfigError, match="control character"):
        _config("memory://a b")


def test_register_tier_refuses_a_taken_or_bad_scheme() -> None:
    register_tier("memory", "_memory_tier", "MemoryTier")  # the same again: fine
    with pytest.raises(ValueError, match="already opens _memory_tier:MemoryTier"):
        register_tier("memory", "elsewhere", "Other")
    with pytest.raises(ValueError, match="Redis tier"):
        register_tier("redis", "mine", "Mine")
    with pytest.raises(ValueError, match="lower-case"):
        register_tier("Mem", "mine", "Mine")


_FRESH_PROCESS = """
import sys
from kvledger.connector.config import TIER_SCHEMES, ConnectorConfig
from kvledger.connector.tiers import open_tier, registered_tiers
assert "memory" not in TIER_SCHEMES  # nobody called register_tier in this process
config = ConnectorConfig.from_extra_config({"remote_url": "memory://fresh"}, environ={})
tier = open_tier(config, rank=1, scheduler=False)
print(type(tier).__module__, type(tier).__name__, tier.rank, registered_tiers()["memory"])
"""


def test_an_installed_packages_entry_point_names_a_tier_in_every_process(tmp_path: Path) -> None:
    """vLLM opens the tier in processes of its own, which a register_tier call in the serving
    script never reaches: a package's entry point (group kvledger.tiers) is found in each."""
    dist = tmp_path / "memtier-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: memtier\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvledger.tiers]\nmemory = _memory_tier:MemoryTier\n")
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tmp_path), str(here), str(here.parent)])
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [
        "_memory_tier",
        "MemoryTier",
        "1",
        "('_memory_tier',",
        "'MemoryTier')",
    ]
    # Without the package, the same URL is a config error that names the schemes there are.
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "remote_url must start with redis://, rediss://, unix:// or file://" in done.stderr


def test_a_tier_that_cannot_be_loaded_or_is_no_tier_is_a_startup_error() -> None:
    register_tier("gone", "no_such_module_here", "Tier")
    with pytest.raises(ConnectorConfigError, match="gone:// opens no_such_module_here:Tier"):
        open_tier(_config("gone://x"), scheduler=True)
    register_tier("notier", "_memory_tier", "STORES")  # a dict has no from_config
    with pytest.raises(ConnectorConfigError, match="notier://"):
        open_tier(_config("notier://x"), scheduler=True)


class OldInterfaceTier(MemoryTier):
    """A tier written for the interface before the worker sealed values: it checked (or
    forgot to check) the bytes itself and returned bare payloads."""

    def get(self, keys: Any, expected_len: int) -> Any:  # type: ignore[override]
        return super().get(keys)


def test_a_tier_written_for_the_old_interface_refuses_to_start() -> None:
    register_tier("oldtier", __name__, "OldInterfaceTier")
    with pytest.raises(ConnectorConfigError, match=r"earlier Tier interface") as info:
        open_tier(_config("oldtier://x"), scheduler=False)
    assert "drop expected_len" in str(info.value)


def test_a_plug_in_tier_stores_sealed_values_it_never_checks() -> None:
    """The worker seals every value it puts and checks every value it gets, around the tier:
    the memory tier holds the whole value, header included, bound to its key."""
    from kvledger.connector.values import ValueSeal

    url = _url()
    tier = open_tier(_config(url), scheduler=False)
    assert tier is not None
    seal = ValueSeal(rank=0, layout=b"L" * 16)
    tier.put([(b"a" * 16, seal.seal(b"a" * 16, memoryview(b"x" * 64)))])
    (stored,) = STORES[url.partition("://")[2]].values()
    assert len(stored) > 64 and stored.endswith(b"x" * 64)
    assert seal.open(b"b" * 16, stored, 64) == f"misplaced: the value of chunk {(b'a' * 16).hex()}"


def test_the_tiers_own_url_check_runs_at_startup() -> None:
    with pytest.raises(ConnectorConfigError, match="memory://<name>"):
        SchedulerSide(_config("memory://not-a-name"), block_size=16, num_slots=4)


# --- under vLLM's real scheduler, with the KV-content oracle ------------------------------------

needs_vllm = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


def _run(url: str, log_dir: Path, **kw: Any) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    extra = {"chunk_size": 32, "remote_url": url, "remote_retry_ms": 20}
    return run(RunSpec(**{**WORKLOAD, **kw, "extra_config": extra}), log_dir=str(log_dir))


def _remote_keys_loaded(events: list[ev.Event]) -> set[bytes]:
    return {
        k
        for e in events
        if isinstance(e, ev.LoadPlanned)
        for k, slot in zip(e.keys, e.slots, strict=True)
        if tier_of_slot(slot) == REMOTE
    }


@pytest.mark.vllm
@needs_vllm
def test_two_engines_share_chunks_through_a_tier_no_product_module_knows(
    tmp_path: Path,
) -> None:
    url = _url()
    first = _run(url, tmp_path / "a")
    assert_clean(first)
    a = events_of(first.log_path)
    written = {k for e in a if isinstance(e, ev.RemoteSaveDone) for k in e.keys}
    assert written and not _remote_keys_loaded(a)
    assert {k for k, _ in STORES[url.partition("://")[2]]} == written
    second = _run(url, tmp_path / "b")
    assert_clean(second)  # the bytes it loaded from the tier are the right KV, every step
    b = events_of(second.log_path)
    loaded = _remote_keys_loaded(b)
    assert loaded and loaded <= written
    found = {
        k
        for e in b
        if isinstance(e, ev.RemoteFound)
        for k, f in zip(e.keys, e.found, strict=True)
        if f
    }
    assert loaded <= found
    assert second.tokens_loaded > first.tokens_loaded
    check_clean(first.log_path)
    check_clean(second.log_path)


@pytest.mark.vllm
@needs_vllm
def test_a_chunk_the_tier_lost_or_damaged_is_a_recorded_load_failure_never_wrong_kv(
    tmp_path: Path,
) -> None:
    url = _url()
    assert_clean(_run(url, tmp_path / "a"))
    store = STORES[url.partition("://")[2]]
    for i, entry in enumerate(sorted(store)):
        if i % 2:
            store[entry] = store[entry][:-8]  # short
    report = _run(url, tmp_path / "b")
    assert_clean(report)  # recomputed: the oracle held at every step
    assert report.load_errors > 0
    events = events_of(report.log_path)
    reasons = {e.reason for e in events if isinstance(e, ev.RemoteLoadFailed)}
    assert reasons == {"length"}
    check_clean(report.log_path)


@pytest.mark.vllm
@needs_vllm
def test_a_tier_down_is_an_outage_recorded_once_and_served_around(tmp_path: Path) -> None:
    url = _url()
    name = url.partition("://")[2]
    assert_clean(_run(url, tmp_path / "a"))
    DOWN.add(name)
    try:
        report = _run(url, tmp_path / "b")
    finally:
        DOWN.discard(name)
    assert_clean(report)
    events = events_of(report.log_path)
    outages = [e for e in events if isinstance(e, ev.RemoteOutage)]
    assert len(outages) == 1 and "MemoryDown" in outages[0].error
    assert not _remote_keys_loaded(events)  # nothing offered from a tier that is down
    check_clean(report.log_path)


class BuggyTier(MemoryTier):
    """A plug-in tier with its own bugs (``FAULTS``): ``available`` or ``describe`` raise
    where the contract says they answer, ``exists`` raises something that is no
    ``TierUnavailable``, and ``put`` answers with values that are no reasons."""

    FAULTS: frozenset[str] = frozenset()

    def __init__(self, url: str, rank: int) -> None:
        super().__init__(url.replace("buggy://", "memory://", 1), rank)

    def available(self) -> bool:
        if "available" in self.FAULTS:
            raise RuntimeError("available() of a tier with a bug")
        return True

    def describe(self, exc: BaseException) -> str:
        if "describe" in self.FAULTS:
            raise RuntimeError("describe() of a tier with a bug")
        return super().describe(exc)

    def exists(self, keys: Any) -> list[int]:
        if "exists" in self.FAULTS:
            raise ValueError("an error the tier did not foresee, holding a secret: hunter2")
        return super().exists(keys)

    def put(self, items: Any) -> list[Any]:
        super().put(items)
        return [True] * len(items) if "put" in self.FAULTS else [None] * len(items)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(
    "faults", [("available",), ("exists", "describe"), ("put",)], ids=lambda f: "+".join(f)
)
def test_a_plug_in_tiers_own_bugs_never_reach_vllm(
    faults: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sides catch everything a tier does wrong, its bugs included (connector/tiers.py's
    contract): under vLLM's real scheduler with the KV-content oracle, no adapter error, no
    wrong token, every request finished, and what the tier did is a recorded fact that
    ``kvledger check`` re-derives: nothing offered from a tier that cannot say it serves, an
    outage named by the error's type alone when the tier cannot describe it (its message may
    hold a secret), and writes whose results are no reasons recorded as failed."""
    register_tier("buggy", __name__, "BuggyTier")
    monkeypatch.setattr(BuggyTier, "FAULTS", frozenset(faults))
    url = f"buggy://t{uuid.uuid4().hex}"
    assert_clean(_run(url, tmp_path / "a"))  # the first engine fills the tier
    report = _run(url, tmp_path / "b")  # the second asks it
    assert_clean(report)
    events = events_of(report.log_path)
    outages = [e.error for e in events if isinstance(e, ev.RemoteOutage)]
    failed = [e.reason for e in events if isinstance(e, ev.RemoteSaveFailed)]
    if "available" in faults:
        assert not _remote_keys_loaded(events)
        assert failed and set(failed) == {"unavailable"}
        assert outages and all(o.endswith("unavailable") for o in outages)
    elif "exists" in faults:
        assert outages and set(outages) == {"ValueError"} and "hunter2" not in str(events)
        assert not _remote_keys_loaded(events)
    else:
        assert failed and all(r.startswith("unavailable: TierError: put gave") for r in failed)
        assert not any(isinstance(e, ev.RemoteSaveDone) for e in events)
    check_clean(report.log_path)
