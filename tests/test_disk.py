"""The disk tier (``connector/disk.py``, ``remote_url`` ``file:///dir``): its files, what each
failure becomes, and two engines sharing a directory under vLLM's real scheduler with the
KV-content oracle checked after every step (``connector.testing.run``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from _rigs import assert_clean, check_clean
from _verdicts import events_of

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.connector.disk import DiskTier, chunk_file
from kvledger.connector.testing.harness import skip_reason
from kvledger.connector.tiers import Tier, TierUnavailable, open_tier
from kvledger.connector.values import Sealed, ValueSeal
from kvledger.tracker import events as ev
from kvledger.tracker.tiers import REMOTE, tier_of_slot

KEYS = [bytes([i]) * 16 for i in range(4)]
SEAL = ValueSeal(rank=0, layout=b"L" * 16)


def _sealed(key: bytes, payload: bytes) -> tuple[bytes, Sealed]:
    return key, SEAL.seal(key, memoryview(payload))


def _opened(keys: list[bytes], got: list[object], size: int) -> list[object]:
    """What the worker makes of each value ``get`` returned: its bytes, or why not."""
    return [
        g
        if isinstance(g, str)
        else (lambda o: o if isinstance(o, str) else bytes(o.payload))(SEAL.open(k, g, size))  # type: ignore[arg-type]
        for k, g in zip(keys, got, strict=True)
    ]


def _tier(path: Path, rank: int = 0) -> DiskTier:
    config = ConnectorConfig.from_extra_config(
        {"chunk_size": 32, "remote_url": path.as_uri()}, environ={}
    )
    tier = open_tier(config, rank=rank, scheduler=False)
    assert isinstance(tier, DiskTier) and isinstance(tier, Tier)
    return tier


def test_put_exists_get_round_trip_per_rank(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "chunks")  # made at startup
    assert tier.check(startup=True) is None
    payloads = [os.urandom(1000) for _ in KEYS[:2]]
    assert tier.put([_sealed(k, p) for k, p in zip(KEYS, payloads, strict=False)]) == [None] * 2
    assert tier.exists(KEYS) == [1, 1, 0, 0]
    assert _opened(KEYS[:3], tier.get(KEYS[:3]), 1000) == [*payloads, "missing"]
    other = _tier(tmp_path / "chunks", rank=1)  # each rank's share apart
    assert other.exists(KEYS) == [0, 0, 0, 0]
    assert sorted(os.listdir(tmp_path / "chunks")) == sorted(chunk_file(k, 0) for k in KEYS[:2])


def test_a_short_or_damaged_file_is_refused_never_loaded(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put([_sealed(k, b"\x07" * 500) for k in KEYS[:3]])
    short, damaged = (tmp_path / chunk_file(k, 0) for k in KEYS[:2])
    short.write_bytes(short.read_bytes()[:-1])
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert _opened(KEYS[:3], tier.get(KEYS[:3]), 500)[:2] == ["length", "checksum"]
    assert _opened([KEYS[2]], tier.get([KEYS[2]]), 499) == ["length"]  # another size


def test_a_file_that_cannot_be_read_or_written_fails_alone(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    (tmp_path / chunk_file(KEYS[0], 0)).mkdir()  # in the way of the chunk's file
    results = tier.put([_sealed(KEYS[0], b"a" * 10), _sealed(KEYS[1], b"b" * 10)])
    assert results[0] is not None and results[0].startswith("refused: ")
    assert results[1] is None
    got = _opened(KEYS[:2], tier.get(KEYS[:2]), 10)
    assert isinstance(got[0], str) and got[0].startswith("refused: IsADirectoryError")
    assert got[1] == b"b" * 10
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]  # no temporary left behind


def test_a_directory_gone_is_an_outage_until_it_is_back(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "d")
    shutil.rmtree(tmp_path / "d")
    assert tier.check() is not None
    for call in (lambda: tier.exists(KEYS), lambda: tier.get(KEYS), lambda: tier.put([])):
        with pytest.raises(TierUnavailable, match="not a directory"):
            call()
    (tmp_path / "d").mkdir()
    assert tier.check() is None and tier.exists(KEYS) == [0] * 4


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("file://host/x", "file:///absolute"),
        ("file:///", "other than /"),
        ("file:////", "other than /"),
        ("file:///.", "other than /"),
        ("file:///./", "other than /"),
        ("file:///.//.", "other than /"),
        ("file:///x?mode=1", "no query"),
        ("file://relative", "file:///absolute"),
        ("file://[::1/x", "file:///absolute"),
        # What urllib's unquote would silently make a U+FFFD, and what decodes to a control
        # or invisible character, each shown.
        ("file:///srv/%ff%fe", "file:// path has percent-escapes that are not UTF-8 (%ff%fe)"),
        ("file:///srv/a%C3/b%e9", "not UTF-8 (%C3 %e9)"),
        ("file:///srv/kv%0Al", "control or invisible character, percent-encoded (%0A)"),
        ("file:///srv/kvl%00", "control or invisible character, percent-encoded (%00)"),
        ("file:///srv/%1b[0m", "(%1b)"),
        ("file:///srv/k%E2%80%8Bvl", "(%E2%80%8B)"),  # a zero-width space
    ],
)
def test_a_bad_file_url_is_a_startup_error_naming_the_key(url: str, says: str) -> None:
    config = ConnectorConfig.from_extra_config({"chunk_size": 32, "remote_url": url}, environ={})
    with pytest.raises(ConnectorConfigError, match="remote_url") as info:
        open_tier(config, scheduler=True)
    assert says in str(info.value)


def test_a_path_percent_encoded_as_utf8_is_the_directory_it_spells(tmp_path: Path) -> None:
    tier = _tier(Path(f"{tmp_path}/caf\u00e9 d"))  # as_uri encodes: caf%C3%A9%20d
    assert tier.directory == f"{tmp_path}/caf\u00e9 d" and os.path.isdir(tier.directory)


@pytest.mark.parametrize(
    "tail", ["/a/b/../../made", "/a/%2e%2e/made", "/a/b/..", "/a/b/%2E%2E%2F..%2Fmade"]
)
def test_a_path_with_dot_dot_is_refused_and_makes_nothing(tail: str, tmp_path: Path) -> None:
    """file:///srv/x/../../etc/kvl made /etc/kvl (tried under tmp_path: a regression then
    makes nothing outside it)."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    for url in (tmp_path.as_uri() + tail, "file:///.."):
        config = ConnectorConfig.from_extra_config(
            {"chunk_size": 32, "remote_url": url}, environ={}
        )
        with pytest.raises(
            ConnectorConfigError, match=r"remote_url file:// may not have \.\."
        ) as info:
            open_tier(config, scheduler=True)
        assert "name the directory plainly" in str(info.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_only_the_named_directory_is_made_never_its_parents(tmp_path: Path) -> None:
    leaf = tmp_path / "p" / "q" / "leaf"
    tier = _tier(leaf)  # its parent not there: an outage, not an error (below)
    assert tier.check(startup=True) is not None
    assert not (tmp_path / "p").exists()
    (tmp_path / "afile").write_text("")
    config = ConnectorConfig.from_extra_config(
        {"chunk_size": 32, "remote_url": (tmp_path / "afile").as_uri()}, environ={}
    )
    with pytest.raises(ConnectorConfigError, match="is not a directory"):
        open_tier(config, scheduler=True)


def test_a_directory_whose_parent_is_not_there_at_startup_is_an_outage_until_it_is(
    tmp_path: Path,
) -> None:
    """As a Redis server down at startup: the tier opens, says why it does not serve, and
    its check makes the directory once the parent (a mount, say) is there."""
    mount = tmp_path / "mnt"
    tier = _tier(mount / "kvl")
    why = tier.check(startup=True)
    assert why == f"FileNotFoundError: {mount / 'kvl'} cannot be made: {mount} is not there"
    for call in (lambda: tier.exists(KEYS), lambda: tier.get(KEYS), lambda: tier.put([])):
        with pytest.raises(TierUnavailable):
            call()
    assert tier.check() == why and not mount.exists()
    mount.mkdir()
    assert tier.check() is None and (mount / "kvl").is_dir()
    assert tier.put([_sealed(KEYS[0], b"x" * 10)]) == [None]
    assert _tier(mount / "kvl", rank=0).exists(KEYS[:2]) == [1, 0]


def test_a_directory_that_cannot_be_written_at_startup_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    monkeypatch.setattr(
        "kvledger.connector.disk.os.access", lambda *_: False
    )  # as root, chmod is not
    config = ConnectorConfig.from_extra_config(
        {"chunk_size": 32, "remote_url": (tmp_path / "d").as_uri()}, environ={}
    )
    with pytest.raises(ConnectorConfigError, match=r"remote_url .*not readable and writable"):
        SchedulerSide(config, block_size=16, num_slots=4)


class _EmptyStep:
    """A scheduler output with nothing scheduled (as tests/test_remote.py's)."""

    preempted_req_ids: tuple[str, ...] = ()
    scheduled_new_reqs: tuple[object, ...] = ()
    num_scheduled_tokens: dict[str, int] = {}  # noqa: RUF012

    class scheduled_cached_reqs:
        req_ids: tuple[str, ...] = ()
        num_computed_tokens: tuple[int, ...] = ()
        new_block_ids: tuple[object, ...] = ()


def test_the_scheduler_records_a_missing_directory_as_an_outage_and_probes_it_back(
    tmp_path: Path,
) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    mount = tmp_path / "mnt"
    config = ConnectorConfig.from_extra_config(
        {"chunk_size": 32, "remote_url": (mount / "kvl").as_uri()}, environ={}
    )
    side = SchedulerSide(config, block_size=16, num_slots=4)  # no raise
    assert not side.tracker.index.remote.up  # the outage is a folded fact
    side.build_connector_meta(_EmptyStep())
    assert not side.tracker.index.remote.up and not mount.exists()
    mount.mkdir()
    side.build_connector_meta(_EmptyStep())  # the step's probe makes the directory
    assert side.tracker.index.remote.up and (mount / "kvl").is_dir()


# --- under vLLM's real scheduler, with the KV-content oracle ------------------------------------

WORKLOAD: dict[str, Any] = dict(
    num_gpu_blocks=24, num_requests=8, prompt_len=(48, 160), max_tokens=(8, 48), seed=0
)


def _run(directory: Path, log_dir: Path, **kw: Any) -> Any:
    from kvledger.connector.testing.run import RunSpec, run

    extra = {"chunk_size": 32, "remote_url": directory.as_uri()}
    return run(RunSpec(**{**WORKLOAD, "extra_config": extra}), log_dir=str(log_dir), **kw)


@pytest.mark.vllm
@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_two_engines_share_a_directory_and_a_lost_or_damaged_file_is_recomputed(
    tmp_path: Path,
) -> None:
    chunks = tmp_path / "chunks"
    first = _run(chunks, tmp_path / "a")
    assert_clean(first)
    written = {
        k for e in events_of(first.log_path) if isinstance(e, ev.RemoteSaveDone) for k in e.keys
    }
    assert written and {chunk_file(k, 0) for k in written} == set(os.listdir(chunks))
    second = _run(chunks, tmp_path / "b")
    assert_clean(second)  # the KV it loaded from the files is right, every step
    loaded = {
        k
        for e in events_of(second.log_path)
        if isinstance(e, ev.LoadPlanned)
        for k, slot in zip(e.keys, e.slots, strict=True)
        if tier_of_slot(slot) == REMOTE
    }
    assert loaded and loaded <= written
    check_clean(first.log_path)
    check_clean(second.log_path)
    # A third engine finds some files gone and some damaged: recorded, recomputed.
    for i, name in enumerate(sorted(os.listdir(chunks))):
        path = chunks / name
        if i % 3 == 0:
            path.unlink()
        elif i % 3 == 1:
            data = bytearray(path.read_bytes())
            data[-5] ^= 0x55
            path.write_bytes(bytes(data))
    third = _run(chunks, tmp_path / "c")
    assert_clean(third)
    assert third.load_errors > 0
    reasons = {e.reason for e in events_of(third.log_path) if isinstance(e, ev.RemoteLoadFailed)}
    assert "checksum" in reasons
    check_clean(third.log_path)


@pytest.mark.vllm
@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_a_directory_missing_at_startup_is_recorded_and_served_once_it_appears(
    tmp_path: Path,
) -> None:
    """The directory's parent (a mount, say) appears at step 5: the run starts, the outage is
    recorded once, the tier serves from the next step's probe, and the KV-content oracle holds
    at every step."""
    mount = tmp_path / "mnt"

    def mount_up(step: int, finished: int, total: int) -> None:
        if step == 5:
            mount.mkdir()

    report = _run(mount / "chunks", tmp_path / "log", progress=mount_up)
    assert_clean(report)
    events = events_of(report.log_path)
    kinds = [type(e) for e in events if isinstance(e, (ev.RemoteOutage, ev.RemoteRestored))]
    assert kinds == [ev.RemoteOutage, ev.RemoteRestored]
    outage = next(e for e in events if isinstance(e, ev.RemoteOutage))
    assert outage.step == 0 and "is not there" in outage.error
    restored = next(i for i, e in enumerate(events) if isinstance(e, ev.RemoteRestored))
    assert events[restored].step >= 5
    written = {k for e in events[restored:] if isinstance(e, ev.RemoteSaveDone) for k in e.keys}
    assert written and {chunk_file(k, 0) for k in written} <= set(os.listdir(mount / "chunks"))
    check_clean(report.log_path)
