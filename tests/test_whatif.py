"""``kvledger whatif``: forecasts proven against real runs of vLLM's scheduler.

Each workload runs under vLLM's real scheduler with the connector and the KV-content oracle,
once with a large pool, and again for real under each setting asked; the forecast made from
the large run's log alone is compared with the real run's pool hits. A forecast at the run's
own settings is the run, token for token. The hit curve's stack (Mattson's distances) is
checked against an LRU pool of every size by hypothesis, and against the per-size forecasts.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.replay.cli import main
from kvledger.replay.whatif import Unanswerable, _Recency, parse_settings, sweep, whatif

# Pool bytes per token of the rigs' model (2 layers, 2 KV heads of 16, float32, K and V).
BYTES_PER_TOKEN = 512

# Two workloads: prompts sharing a 48-token prefix with six asked again; and a GPU cache
# small enough that requests are preempted and resumed (they reload their saved prefix).
PLAIN: dict[str, Any] = dict(
    num_requests=12,
    num_gpu_blocks=40,
    prompt_len=(40, 120),
    max_tokens=(6, 24),
    shared_prefix=48,
    repeat_prompts=6,
    enable_prefix_caching=False,
)
PREEMPTING: dict[str, Any] = dict(
    num_requests=16,
    num_gpu_blocks=24,
    max_num_seqs=6,
    prompt_len=(40, 100),
    max_tokens=(20, 60),
    shared_prefix=40,
    repeat_prompts=6,
    enable_prefix_caching=False,
)
WORKLOADS = {"plain": PLAIN, "preempting": PREEMPTING}
LARGE = 64  # slots of the run every forecast is made from


def _vllm() -> None:
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(f"vLLM's scheduler is not usable: {reason}")


def real_run(
    tmp: Path, workload: dict[str, Any], chunk: int, slots: int, **extra: Any
) -> tuple[int, str]:
    """Run ``workload`` under vLLM's real scheduler with a pool of ``slots`` chunks of
    ``chunk`` tokens (``extra``: more of the connector's settings): (tokens the worker loaded
    from the pool, the log's path)."""
    from kvledger.connector.testing.run import RunSpec, run

    d = tmp / f"c{chunk}s{slots}{''.join(sorted(extra))}"
    d.mkdir()
    extra = {"chunk_size": chunk, "host_pool_bytes": slots * chunk * BYTES_PER_TOKEN, **extra}
    report = run(RunSpec(**workload, extra_config=extra), log_dir=str(d))
    assert report.ok, report
    assert report.log_path is not None
    return report.tokens_loaded, report.log_path


@pytest.fixture(scope="module", params=sorted(WORKLOADS))
def large(request: Any, tmp_path_factory: Any) -> tuple[str, dict[str, Any], str, int]:
    _vllm()
    tmp = tmp_path_factory.mktemp(f"whatif-{request.param}")
    loaded, log = real_run(tmp, WORKLOADS[request.param], 32, LARGE)
    return request.param, WORKLOADS[request.param], log, loaded


def _explained(requests: Any) -> list[dict[str, Any]]:
    return [r.to_dict() for r in requests]


def _pool(f: Any) -> int:
    return int(f.forecast.totals()["hit"]["pool"])


@pytest.mark.vllm
def test_a_forecast_at_the_runs_own_settings_is_the_run(large: Any) -> None:
    """Nothing changed: every request's hits, by source, and its misses, by reason, are the
    run's own; the forecast broke none of the tracker's rules."""
    name, _, log, loaded = large
    f = whatif(log, {})
    assert f.violations == []
    assert f.actual.totals() == f.forecast.totals()
    assert _explained(f.actual.requests) == _explained(f.forecast.requests)
    assert f.actual.totals()["hit"]["pool"] == loaded  # explain's pool figure is the worker's
    if name == "preempting":
        assert any(a.admission > 1 for r in f.actual.requests for a in r.admissions)


# (chunk size, slots): smaller pools, and other chunk sizes at a few sizes.
SETTINGS = [(32, 2), (32, 4), (32, 8), (16, 4), (16, 8), (64, 2), (16, LARGE)]


@pytest.mark.vllm
def test_forecasts_from_one_log_match_real_runs(large: Any, tmp_path: Path) -> None:
    """The forecast from the large run's log, against a real run under each setting: the
    pool's hits within 20% or 16 tokens (docs/whatif.md has the table)."""
    name, workload, log, _ = large
    errors = []
    for chunk, slots in SETTINGS:
        real, _ = real_run(tmp_path, workload, chunk, slots)
        f = whatif(log, {"chunk_size": chunk, "num_slots": slots})
        assert f.violations == []
        forecast = _pool(f)
        if abs(forecast - real) > max(0.2 * real, 16):
            errors.append(f"{name} chunk {chunk} slots {slots}: forecast {forecast}, real {real}")
    assert errors == []


@pytest.mark.vllm
def test_the_remote_tier_partial_chunks_and_block_hits_against_real_runs(
    large: Any, tmp_path: Path
) -> None:
    """The other settings, each against a real run: a small pool with a remote tier (a
    ``file://`` directory) forecast from the large run without one, and back (the remote
    tier turned off, the pool large again); partial chunks kept; block hits off. The hits
    by source (pool and remote) within 20% or 16 tokens."""
    from kvledger.replay.explain import explain

    _, workload, log, loaded = large
    cases = [
        ({"num_slots": 2, "remote": True}, 2, {"remote_url": f"file://{tmp_path}/tier2"}),
        ({"num_slots": 4, "remote": True}, 4, {"remote_url": f"file://{tmp_path}/tier4"}),
        ({"discard_partial_chunks": False}, LARGE, {"discard_partial_chunks": False}),
        ({"num_slots": 4, "discard_partial_chunks": False}, 4, {"discard_partial_chunks": False}),
        ({"block_hits": False}, LARGE, {"block_hits": False}),
    ]
    errors = []
    for changes, slots, extra in cases:
        if "remote_url" in extra:
            (tmp_path / extra["remote_url"].rsplit("/", 1)[1]).mkdir()
        _, real_log = real_run(tmp_path, workload, 32, slots, **extra)
        real = explain(real_log).totals()["hit"]
        f = whatif(log, changes)
        assert f.violations == []
        forecast = f.forecast.totals()["hit"]
        for source in ("pool", "remote"):
            if abs(forecast[source] - real[source]) > max(0.2 * real[source], 16):
                errors.append(
                    f"{changes} {source}: forecast {forecast[source]}, real {real[source]}"
                )
        if changes.get("remote"):
            assert real["remote"] > 0  # the tier served what the small pool lost
            back = whatif(real_log, {"num_slots": LARGE, "remote": False}).forecast.totals()
            assert back["hit"]["remote"] == 0
            assert abs(back["hit"]["pool"] - loaded) <= max(0.2 * loaded, 16)
    assert errors == []


@pytest.mark.vllm
def test_the_curve_from_one_pass_matches_the_forecasts_per_size(large: Any) -> None:
    """The sweep (one pass, stack distances) against one forecast per size: the same at
    sizes where the pool is not full of chunks being read (docs/whatif.md: below that a
    chunk being loaded keeps its slot, which an LRU stack does not know)."""
    _, _, log, loaded = large
    sizes = [4, 6, 8, 16, LARGE]
    curve = sweep(log, sizes)
    assert curve.violations == []
    assert curve.actual == loaded
    for n, offered in zip(curve.sizes, curve.offered, strict=True):
        per_size = _pool(whatif(log, {"num_slots": n}))
        assert abs(offered - per_size) <= max(0.2 * per_size, 16), (n, offered, per_size)
    assert curve.offered[-1] == loaded  # the run's own size: the run
    assert curve.offered == sorted(curve.offered)  # an LRU pool never loses by growing


# vLLM's scheduler run other ways: async scheduling (results a step later), vLLM's own prefix
# cache (local hits), a drafter's deferred save, a capped prefill, the first model runner.
VARIANTS: dict[str, dict[str, Any]] = {
    "async": dict(PREEMPTING, async_scheduling=True),
    "prefix-cache": dict(PREEMPTING, enable_prefix_caching=True),
    "drafter": dict(PLAIN, drafter_layers=1),
    "long-prefill": dict(PREEMPTING, long_prefill_token_threshold=24, max_num_batched_tokens=64),
    "model-runner-v1": dict(PREEMPTING, model_runner_v2=False),
}


@pytest.mark.vllm
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_scheduler_variants(variant: str, tmp_path: Path) -> None:
    """Each variant run for real with 64 slots and with 4: each log at its own settings is
    its run; each forecasts the other within 20% or 16 tokens."""
    _vllm()
    workload = VARIANTS[variant]
    large_loaded, large_log = real_run(tmp_path, workload, 32, LARGE)
    small_loaded, small_log = real_run(tmp_path, workload, 32, 4)
    for log in (large_log, small_log):
        same = whatif(log, {})
        assert same.violations == []
        assert same.actual.totals() == same.forecast.totals()
        assert _explained(same.actual.requests) == _explained(same.forecast.requests)
    for log, slots, real in ((large_log, 4, small_loaded), (small_log, LARGE, large_loaded)):
        f = whatif(log, {"num_slots": slots})
        assert f.violations == []
        assert abs(_pool(f) - real) <= max(0.2 * real, 16), (slots, _pool(f), real)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=60),
    st.integers(1, 8),
)
def test_stack_distances_are_an_lru_pool_of_every_size(refs: list[int], slots: int) -> None:
    """Mattson's property, on the stack the curve uses: after any references, a key is at
    distance <= n exactly when an LRU pool of n slots holds it."""
    stack = _Recency()
    lru: OrderedDict[bytes, None] = OrderedDict()
    for r in refs:
        key = bytes([r])
        stack.touch(key)
        lru.pop(key, None)
        lru[key] = None
        while len(lru) > slots:
            lru.popitem(last=False)
        for k in range(13):
            probe = bytes([k])
            d = stack.distance_at(stack.last.get(probe))
            assert (d is not None and d <= slots) == (probe in lru), (refs, slots, k)


def test_a_stack_outgrowing_its_tree_keeps_its_distances() -> None:
    stack = _Recency()
    for i in range(3000):  # past the tree's first size (1024 times): it is rebuilt
        stack.touch(bytes([i % 7]))
    assert sorted(stack.distance_at(t) for t in stack.last.values()) == list(range(1, 8))


def test_settings_are_parsed_or_named() -> None:
    assert parse_settings(["num_slots=4", "remote=off", "block_hits=false"]) == {
        "num_slots": 4,
        "remote": False,
        "block_hits": False,
    }
    with pytest.raises(Unanswerable, match="'salt' is not a what-if setting"):
        parse_settings(["salt=x"])
    with pytest.raises(Unanswerable, match="remote expects on or off"):
        parse_settings(["remote=maybe"])
    with pytest.raises(Unanswerable, match="num_slots expects an integer"):
        parse_settings(["num_slots=many"])


@pytest.mark.vllm
def test_the_command(large: Any, tmp_path: Path, capsys: Any) -> None:
    """``kvledger whatif`` as a user types it: a forecast (exit 0, explain's vocabulary in
    --json), a curve with its picture, and the questions it cannot answer (exit 2, why)."""
    _, _, log, loaded = large
    assert main(["whatif", log, "--with", "num_slots=4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["with"] == {"num_slots": 4}
    assert doc["recorded_config"]["num_slots"] == LARGE and doc["config"]["num_slots"] == 4
    assert doc["actual"]["hit"]["pool"] == loaded
    for side in ("actual", "forecast"):
        figures = doc[side]
        assert figures["tokens_asked"] == figures["tokens_hit"] + figures["missed_tokens"]
        assert sum(figures["reasons"].values()) == figures["missed_tokens"]
    assert doc["forecast"]["hit"]["pool"] <= loaded
    assert doc["forecast"]["reasons"].get("evicted", 0) > 0  # a smaller pool evicts
    assert doc["violations"] == []

    png = tmp_path / "curve.png"
    assert main(["whatif", log, "--sweep", "num_slots=1,4,64", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "the run" in text and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["whatif", log, "--with", "save_decode_cache=true"]) == 2
    assert "cannot be answered from this log" in capsys.readouterr().err
    assert main(["whatif", log, "--with", "salt=x"]) == 2
    assert "not a what-if setting" in capsys.readouterr().err
    assert main(["whatif", log, "--sweep", "num_slots=4", "--with", "num_slots=2"]) == 2
    assert "both set it" in capsys.readouterr().err
    assert main(["whatif", log, "--plot", str(png)]) == 2
    assert "give --sweep too" in capsys.readouterr().err


CLEAN = Path(__file__).parent / "data" / "replay-clean.kvlog"


def test_the_kept_demo_log_at_its_own_settings_and_a_larger_pool() -> None:
    """The demo run kept in tests/data (format 1.0): its own settings give the run; a pool of
    64 chunks wins back exactly the tokens the run lost to evictions, and no other miss
    moves (docs/whatif.md's example)."""
    same = whatif(CLEAN, {})
    assert same.violations == [] and same.actual.totals() == same.forecast.totals()
    run = same.actual.totals()
    bigger = whatif(CLEAN, {"num_slots": 64}).forecast.totals()
    evicted = run["reasons"]["evicted"]
    assert evicted > 0 and "evicted" not in bigger["reasons"]
    assert bigger["tokens_hit"] == run["tokens_hit"] + evicted
    assert {r: n for r, n in bigger["reasons"].items()} == {
        r: n for r, n in run["reasons"].items() if r != "evicted"
    }


def test_a_torn_log_is_forecast_as_far_as_it_reads(tmp_path: Path, capsys: Any) -> None:
    """A log cut inside a frame: the forecast of what was read, and exit 2 saying where the
    read stopped; a file that is no log: exit 2 naming it."""
    data = CLEAN.read_bytes()
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(data[: len(data) - 200])
    assert main(["whatif", str(torn), "--with", "num_slots=64", "--json"]) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert 0 < doc["actual"]["tokens_asked"] <= whatif(CLEAN, {}).actual.totals()["tokens_asked"]
    assert "read stopped early" in captured.err and "torn_tail" in captured.err
    assert main(["whatif", str(torn), "--sweep", "num_slots=8,64"]) == 2
    assert "read stopped early" in capsys.readouterr().err
    other = tmp_path / "notes.txt"
    other.write_text("not a log\n")
    assert main(["whatif", str(other), "--with", "num_slots=4"]) == 2
    assert "not a kvledger log" in capsys.readouterr().err


@pytest.mark.vllm
def test_a_recorders_log_forecasts_kvledgers_own_pool(tmp_path: Path, capsys: Any) -> None:
    """vLLM's ExampleConnector run under KVLedgerRecorder (a preempting workload): the
    forecast from its log of what kvledger's own pool would have hit, against KVLedgerConnector
    run for real on the same workload, at several chunk and pool sizes."""
    from _rigs import PREEMPTING_RECORDED, example_spec

    from kvledger.connector.testing.recorded import run_wrapped

    _vllm()
    workload = dict(PREEMPTING_RECORDED, repeat_prompts=3)
    (tmp_path / "store").mkdir()
    (tmp_path / "log").mkdir()
    report = run_wrapped(
        example_spec(tmp_path / "store", **workload), log_dir=str(tmp_path / "log")
    )
    assert report.mismatches == () and report.preemptions
    assert report.log_path is not None
    errors = []
    for chunk, slots in [(256, 1024), (16, 4), (32, 2), (32, 8)]:
        real, _ = real_run(tmp_path, workload, chunk, slots)
        f = whatif(report.log_path, {"chunk_size": chunk, "num_slots": slots})
        assert f.violations == [] and f.inner == "ExampleConnector"
        assert f.actual.totals()["hit"]["inner"] > 0 and f.actual.totals()["hit"]["pool"] == 0
        if abs(_pool(f) - real) > max(0.2 * real, 16):
            errors.append(f"chunk {chunk} slots {slots}: forecast {_pool(f)}, real {real}")
    assert errors == []
    assert main(["whatif", report.log_path, "--with", "num_slots=8"]) == 0
    assert "against the run's ExampleConnector" in capsys.readouterr().out
