"""``kv_connector_extra_config`` validation, and ``KVLedgerConnector`` built through vLLM's real
``VllmConfig`` (and vLLM's own connector factory) for both roles."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from fakes import (
    FakeBlocks,
    FakeRequest,
    KVConnectorOutput,
    NewRequestData,
    SchedulerOutput,
    hold_saves,
)

from kvledger.connector.config import ENV_LOG_DIR, ConnectorConfig, ConnectorConfigError
from kvledger.connector.messages import ChunkTransfer, StepPlan, TransferPlan
from kvledger.connector.scheduler import SchedulerSide

ACCEPTED = [
    "block_hits",
    "chunk_size",
    "digests",
    "discard_partial_chunks",
    "host_pool_bytes",
    "log_background",
    "log_dir",
    "log_fsync",
    "log_queue_bytes",
    "log_required",
    "log_rotate_bytes",
    "remote_lookup_timeout_ms",
    "remote_max_chunk_bytes",
    "remote_retry_ms",
    "remote_secret_env",
    "remote_secret_file",
    "remote_timeout_ms",
    "remote_ttl_s",
    "remote_url",
    "save_decode_cache",
    "strict",
]


# --- ConnectorConfig.from_extra_config ---------------------------------------------------------


@pytest.mark.parametrize("extra", [None, {}])
def test_defaults(extra: dict[str, Any] | None) -> None:
    config = ConnectorConfig.from_extra_config(extra, environ={})
    assert attrs.asdict(config) == {
        "chunk_size": 256,
        "host_pool_bytes": 4 << 30,
        "save_decode_cache": False,
        "discard_partial_chunks": True,
        "block_hits": True,
        "log_dir": None,
        "log_rotate_bytes": 256 << 20,
        "log_fsync": "close",
        "log_background": True,
        "log_queue_bytes": 64 << 20,
        "log_required": False,
        "strict": False,
        "remote_url": None,
        "remote_timeout_ms": 2000,
        "remote_lookup_timeout_ms": 50,
        "remote_retry_ms": 500,
        "remote_ttl_s": 0,
        "remote_max_chunk_bytes": 512 << 20,
        "remote_secret_file": None,
        "remote_secret_env": None,
        "digests": "off",
    }
    assert sorted(attrs.asdict(config)) == ACCEPTED


def test_every_key_is_read() -> None:
    config = ConnectorConfig.from_extra_config(
        {
            "chunk_size": 512,
            "host_pool_bytes": 1 << 20,
            "save_decode_cache": "true",
            "discard_partial_chunks": "0",
            "log_dir": "/var/log/kvledger",
            "log_rotate_bytes": 4096,
            "log_fsync": "step",
            "log_background": "false",
            "log_queue_bytes": 1 << 20,
            "log_required": True,
            "strict": True,
        },
        environ={},
    )
    assert config == ConnectorConfig(
        chunk_size=512,
        host_pool_bytes=1 << 20,
        save_decode_cache=True,
        discard_partial_chunks=False,
        log_dir="/var/log/kvledger",
        log_rotate_bytes=4096,
        log_fsync="step",
        log_background=False,
        log_queue_bytes=1 << 20,
        log_required=True,
        strict=True,
    )


@pytest.mark.parametrize("text", ["true", "True", "TRUE", "1", "false", "False", "0"])
def test_booleans_accept_strings(text: str) -> None:
    config = ConnectorConfig.from_extra_config({"strict": text}, environ={})
    assert config.strict is (text.lower() in ("true", "1"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("chunk_size", 0),
        ("chunk_size", -256),
        ("chunk_size", "256"),
        ("chunk_size", 256.0),
        ("chunk_size", True),
        ("chunk_size", None),
        ("host_pool_bytes", 0),
        ("host_pool_bytes", "4G"),
        ("log_rotate_bytes", -1),
        ("log_rotate_bytes", [1]),
        ("save_decode_cache", "yes"),
        ("save_decode_cache", 2),
        ("save_decode_cache", None),
        ("discard_partial_chunks", "maybe"),
        ("strict", 1.0),
        ("log_dir", 7),
        ("log_dir", ["/tmp"]),
        ("log_fsync", "always"),
        ("log_fsync", None),
        ("log_background", "on"),
        ("log_queue_bytes", 0),
        ("log_required", 3),
        ("digests", "on"),
        ("digests", True),
    ],
)
def test_bad_value_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConnectorConfigError, match=rf"^{key} must be") as info:
        ConnectorConfig.from_extra_config({key: value}, environ={})
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("unknown", [["chnk_size"], ["chunksize", "save_decode"]])
def test_unknown_key_is_named_with_the_accepted_keys(unknown: list[str]) -> None:
    extra = {name: 1 for name in unknown} | {"chunk_size": 256}
    with pytest.raises(ConnectorConfigError) as info:
        ConnectorConfig.from_extra_config(extra, environ={})
    message = str(info.value)
    for name in unknown:
        assert repr(name) in message
    assert f"accepted keys: {ACCEPTED}" in message


def test_env_var_turns_the_log_on() -> None:
    assert ConnectorConfig.from_extra_config({}, environ={ENV_LOG_DIR: "/logs"}).log_dir == "/logs"
    assert ConnectorConfig.from_extra_config({}, environ={ENV_LOG_DIR: ""}).log_dir is None
    # The explicit key wins over the environment.
    explicit = ConnectorConfig.from_extra_config({"log_dir": "/mine"}, environ={ENV_LOG_DIR: "/e"})
    assert explicit.log_dir == "/mine"


def test_env_var_is_read_from_the_process_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(ENV_LOG_DIR, str(tmp_path))
    config = ConnectorConfig.from_extra_config({"chunk_size": 16})
    assert config.log_dir == str(tmp_path)
    side = SchedulerSide(config, block_size=16, num_slots=4)
    req = FakeRequest("R", list(range(3, 40)))
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
    side.build_connector_meta(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("R", req.prompt_token_ids, ([1, 2, 3],), 0)],
            num_scheduled_tokens={"R": 37},
        )
    )
    side.shutdown()
    assert side.log_path is not None and os.path.dirname(side.log_path) == str(tmp_path)
    assert os.path.getsize(side.log_path) > 0


def test_no_log_without_the_env_var(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(ENV_LOG_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    side = SchedulerSide(ConnectorConfig.from_extra_config({}), block_size=16, num_slots=4)
    side.build_connector_meta(SchedulerOutput())
    side.shutdown()
    assert side.log_path is None and list(tmp_path.iterdir()) == []


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    config = ConnectorConfig(chunk_size=24)
    config.check_block_size(8)
    config.check_block_size(24)
    with pytest.raises(ConnectorConfigError, match=r"chunk_size \(24\).*block_size \(16\)"):
        config.check_block_size(16)
    with pytest.raises(ConnectorConfigError, match="chunk_size"):
        SchedulerSide(config, block_size=16, num_slots=4)


# --- through vLLM's VllmConfig ----------------------------------------------------------------

BLOCK = 16


@pytest.fixture(scope="module")
def vllm_build() -> Callable[..., Any]:
    """``build(role, **extra) -> KVLedgerConnector`` through vLLM's own connector factory (the
    third-party loading path: kv_connector_module_path), for a tiny model's VllmConfig."""
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from kvledger.connector.testing.harness import (
        HarnessConfig,
        _build_kv_cache_config,
        _build_vllm_config,
        _prepare_environment,
    )

    _prepare_environment(True)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    roles = {"scheduler": KVConnectorRole.SCHEDULER, "worker": KVConnectorRole.WORKER}

    def build(role: str, connector: str = "KVLedgerConnector", **extra: Any) -> Any:
        config = HarnessConfig(
            block_size=BLOCK,
            kv_connector={
                "kv_connector": connector,
                "kv_connector_module_path": "kvledger.connector.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            },
        )
        vllm_config = _build_vllm_config(config)
        kv_cache_config = _build_kv_cache_config(config)
        if "kv_cache_config" in inspect.signature(KVConnectorFactory.create_connector).parameters:
            return KVConnectorFactory.create_connector(vllm_config, roles[role], kv_cache_config)
        return KVConnectorFactory.create_connector(vllm_config, roles[role])  # vLLM 0.11.0

    return build


def _oracle_caches() -> Any:
    from kvledger.connector.testing.oracle import KVOracle

    # The harness model: 2 layers, 2 KV heads of 16, float32.
    return KVOracle(
        ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
        num_blocks=8,
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=16,
    )


@pytest.mark.vllm
def test_the_salt_names_the_pool_format(vllm_build: Callable[..., Any], monkeypatch) -> None:
    """The chunk keys' salt names the host pool format, and the worker role expects the same:
    ``tokens`` (no suffix, as every earlier version's salt) where vLLM's backends keep tokens
    as rows; on vLLM's CPU platform, the kernel vLLM's own rule picks and the block size. The
    worker then refuses caches of another format when they are registered."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import cpu_attn

    from kvledger.connector.kv_layout import KVCacheLayoutError

    salt = vllm_build("scheduler", chunk_size=32).scheduler_side.tracker_config.salt
    assert "pool=" not in salt
    assert vllm_build("worker", chunk_size=32).worker_side.pool_format == "tokens"
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    # raising=False: vLLMs before the CPU kernel picker (0.11) lack the private function.
    monkeypatch.setattr(
        cpu_attn, "_get_attn_isa", lambda dtype, bs, d, kv_dtype=None: "amx", raising=False
    )
    cpu_salt = vllm_build("scheduler", chunk_size=32).scheduler_side.tracker_config.salt
    assert cpu_salt == f"{salt}|pool=cpu_attn-amx-block{BLOCK}"
    worker = vllm_build("worker", chunk_size=32)
    assert worker.worker_side.pool_format == f"cpu_attn-amx-block{BLOCK}"
    with pytest.raises(KVCacheLayoutError, match="as 'tokens'"):
        worker.register_kv_caches(_oracle_caches().caches)


@pytest.mark.vllm
def test_scheduler_role(vllm_build: Callable[..., Any]) -> None:
    from kvledger.connector.vllm import KVLedgerConnector, KVLedgerMetadata

    connector = vllm_build("scheduler", chunk_size=32, host_pool_bytes=1 << 20)
    assert isinstance(connector, KVLedgerConnector)
    side = connector.scheduler_side
    assert isinstance(side, SchedulerSide)
    # One token: 2 layers x K/V x 2 heads x 16 x 4 bytes = 512 B; a 32-token slot 16 KiB.
    assert side.tracker_config.block_size == BLOCK
    assert side.tracker_config.chunk_size == 32
    assert side.tracker_config.num_slots == (1 << 20) // (512 * 32)
    assert "2L" in side.tracker_config.salt
    req = FakeRequest("R", list(range(3, 70)))
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    connector.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    meta = connector.build_connector_meta(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("R", req.prompt_token_ids, ([1, 2, 3, 4, 5],), 0)],
            num_scheduled_tokens={"R": 67},
        )
    )
    assert isinstance(meta, KVLedgerMetadata)
    assert [(c.token_start, c.token_end) for p in meta.plan.saves for c in p.chunks] == [
        (0, 32),
        (32, 64),
    ]
    connector.update_connector_output(KVConnectorOutput())
    assert connector.request_finished(req, [1, 2, 3, 4, 5]) == (True, None)
    connector.shutdown()


@pytest.mark.vllm
def test_worker_role_loads_with_no_forward_context(vllm_build: Callable[..., Any]) -> None:
    from kvledger.connector.vllm import KVLedgerMetadata, KVLedgerWorkerMetadata
    from kvledger.connector.worker import WorkerSide

    connector = vllm_build("worker", chunk_size=32, host_pool_bytes=1 << 20)
    assert isinstance(connector.worker_side, WorkerSide)
    oracle = _oracle_caches()
    connector.register_kv_caches(oracle.caches)
    assert connector.worker_side.pool.num_slots == (1 << 20) // (512 * 32)
    connector.start_load_kv(None)  # nothing bound: nothing to do
    tokens = list(range(3, 40))
    oracle.write("A", tokens, [1, 2], 0, 32)
    save = TransferPlan("A", "save", (1, 2), (ChunkTransfer(b"k" * 16, 0, 0, 32, 0),))
    connector.bind_connector_metadata(KVLedgerMetadata(StepPlan(step=0, saves=(save,))))
    connector.wait_for_save()
    out = connector.build_connector_worker_meta()
    assert isinstance(out, KVLedgerWorkerMetadata) and out.report.saves_done
    connector.clear_connector_metadata()
    load = TransferPlan("B", "load", (5, 6), (ChunkTransfer(b"k" * 16, 0, 0, 32, 0),))
    connector.handle_preemptions(KVLedgerMetadata(StepPlan(step=1, loads=(load,))))
    connector.bind_connector_metadata(KVLedgerMetadata(StepPlan(step=1, loads=(load,))))
    connector.start_load_kv(None)  # MRV1 passes the forward context; MRV2 may pass None
    assert oracle.verify("B", tokens, [5, 6], 32) is None
    assert connector.get_block_ids_with_load_errors() == set()
    assert connector.get_finished(set()) == (None, None)
    assert connector.build_connector_worker_meta().report.loads_done == ("B",)
    connector.clear_connector_metadata()
    connector.shutdown()


@pytest.mark.vllm
def test_worker_role_handle_preemptions_with_an_id_set(
    vllm_build: Callable[..., Any], monkeypatch
) -> None:
    """vLLM 0.14 - 0.18 pass the preempted request ids instead of the metadata."""
    from kvledger.connector.vllm import KVLedgerMetadata

    connector = vllm_build("worker", chunk_size=32, host_pool_bytes=1 << 20)
    oracle = _oracle_caches()
    connector.register_kv_caches(oracle.caches)
    events = hold_saves(connector.worker_side, monkeypatch)
    oracle.write("A", list(range(3, 40)), [1, 2], 0, 32)
    save = TransferPlan("A", "save", (1, 2), (ChunkTransfer(b"k" * 16, 0, 0, 32, 0),))
    connector.bind_connector_metadata(KVLedgerMetadata(StepPlan(step=0, saves=(save,))))
    connector.wait_for_save()
    connector.clear_connector_metadata()
    connector.handle_preemptions(set())
    assert events[0].synchronized == 0
    connector.handle_preemptions({"A"})
    assert events[0].synchronized == 1


WORKER_METHODS: dict[str, Callable[[Any], Any]] = {
    "register_kv_caches": lambda c: c.register_kv_caches({}),
    "handle_preemptions": lambda c: c.handle_preemptions({"R"}),
    "start_load_kv": lambda c: c.start_load_kv(None),
    "wait_for_layer_load": lambda c: c.wait_for_layer_load("model.layers.0.self_attn.attn"),
    "save_kv_layer": lambda c: c.save_kv_layer("model.layers.0.self_attn.attn", None, None),
    "wait_for_save": lambda c: c.wait_for_save(),
    "get_finished": lambda c: c.get_finished(set()),
    "get_block_ids_with_load_errors": lambda c: c.get_block_ids_with_load_errors(),
    "build_connector_worker_meta": lambda c: c.build_connector_worker_meta(),
}

SCHEDULER_METHODS: dict[str, Callable[[Any], Any]] = {
    "on_new_request": lambda c: c.on_new_request(FakeRequest("R", [3, 4])),
    "get_num_new_matched_tokens": lambda c: c.get_num_new_matched_tokens(
        FakeRequest("R", [3, 4]), 0
    ),
    "update_state_after_alloc": lambda c: c.update_state_after_alloc(
        FakeRequest("R", [3, 4]), FakeBlocks([1]), 0
    ),
    "build_connector_meta": lambda c: c.build_connector_meta(SchedulerOutput()),
    "update_connector_output": lambda c: c.update_connector_output(KVConnectorOutput()),
    "request_finished": lambda c: c.request_finished(FakeRequest("R", [3, 4]), [1]),
}


@pytest.mark.vllm
@pytest.mark.parametrize("method", sorted(WORKER_METHODS))
def test_worker_method_on_the_scheduler_role_names_the_role(
    vllm_build: Callable[..., Any], method: str
) -> None:
    connector = vllm_build("scheduler", chunk_size=32, host_pool_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="worker method called on the scheduler role"):
        WORKER_METHODS[method](connector)


@pytest.mark.vllm
@pytest.mark.parametrize("method", sorted(SCHEDULER_METHODS))
def test_scheduler_method_on_the_worker_role_names_the_role(
    vllm_build: Callable[..., Any], method: str
) -> None:
    connector = vllm_build("worker", chunk_size=32, host_pool_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="scheduler method called on the worker role"):
        SCHEDULER_METHODS[method](connector)


@pytest.mark.vllm
@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_host_pool_too_small_is_a_clear_error(vllm_build: Callable[..., Any], role: str) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("host_pool_bytes=16383 holds no chunk: one chunk of 32 tokens takes "),
    ):
        vllm_build(role, chunk_size=32, host_pool_bytes=16383)
    vllm_build(role, chunk_size=32, host_pool_bytes=16384)  # exactly one slot


@pytest.mark.vllm
@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_bad_extra_config_fails_construction(vllm_build: Callable[..., Any], role: str) -> None:
    with pytest.raises(ConnectorConfigError, match="'chunk_sz'"):
        vllm_build(role, chunk_sz=32)
    with pytest.raises(ConnectorConfigError, match="save_decode_cache must be true or false"):
        vllm_build(role, save_decode_cache="on")


@pytest.mark.vllm
def test_chunk_size_not_a_multiple_of_vllm_block_size_scheduler(
    vllm_build: Callable[..., Any],
) -> None:
    with pytest.raises(ConnectorConfigError, match=r"chunk_size \(24\).*block_size \(16\)"):
        vllm_build("scheduler", chunk_size=24, host_pool_bytes=1 << 20)


@pytest.mark.vllm
def test_chunk_size_not_a_multiple_of_vllm_block_size_worker(
    vllm_build: Callable[..., Any],
) -> None:
    with pytest.raises(ConnectorConfigError, match=r"chunk_size \(24\)"):
        vllm_build("worker", chunk_size=24, host_pool_bytes=1 << 20)


def test_two_connectors_logging_to_one_directory_do_not_collide(tmp_path) -> None:
    """An engine restarted in place opens a second log in the same directory: a new file."""
    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.scheduler import SchedulerSide

    config = ConnectorConfig(chunk_size=16, log_dir=str(tmp_path))
    first = SchedulerSide(config, block_size=16, num_slots=4)
    second = SchedulerSide(config, block_size=16, num_slots=4)
    assert first.log_path != second.log_path
    first.shutdown()
    second.shutdown()
    assert len(list(tmp_path.glob("*.kvlog"))) == 2


@pytest.mark.vllm
def test_before_vllm_0_18_reports_ride_in_the_connector_stats(
    vllm_build: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.11-0.17 has no worker metadata: the worker's report travels in its connector
    stats (aggregated per rank, serialisable), and the scheduler side confirms saves from it."""
    import pickle

    import kvledger.connector.vllm as front

    monkeypatch.setattr(front, "WORKER_META_CHANNEL", False)
    worker = vllm_build("worker", chunk_size=32, host_pool_bytes=1 << 20)
    oracle = _oracle_caches()
    worker.register_kv_caches(oracle.caches)
    oracle.write("A", list(range(3, 40)), [1, 2], 0, 32)
    save = TransferPlan("A", "save", (1, 2), (ChunkTransfer(b"k" * 16, 0, 0, 32, 0),))
    worker.bind_connector_metadata(front.KVLedgerMetadata(StepPlan(step=0, saves=(save,))))
    worker.wait_for_save()
    stats = worker.get_kv_connector_stats()
    assert isinstance(stats, front.KVLedgerStats) and not stats.is_empty()
    stats = pickle.loads(pickle.dumps(stats))  # it crosses processes
    merged = stats.aggregate(front.KVLedgerStats())  # a second rank with nothing to say
    assert merged.reduce() == {"kvledger_reports": 1}
    rebuilt = front.KVLedgerConnector.build_kv_connector_stats(data=merged.data)
    assert rebuilt is not None and rebuilt.data == merged.data
    worker.shutdown()

    side = SchedulerSide(ConnectorConfig(chunk_size=16), block_size=16, num_slots=8)
    r = FakeRequest("R", list(range(7, 47)))
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 0)
    plan = side.build_connector_meta(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("R", r.prompt_token_ids, ([1, 2, 3],), 0)],
            num_scheduled_tokens={"R": 40},
        )
    )
    keys = [c.key for p in plan.saves for c in p.chunks]
    assert keys
    from kvledger.connector.messages import WorkerReport

    report = WorkerReport(saves_done=(("R", tuple(keys)),))
    from types import SimpleNamespace

    out = SimpleNamespace(  # vLLM 0.11-0.17's KVConnectorOutput: no worker metadata field
        kv_connector_stats=front.KVLedgerStats({"kvledger_reports": [report.to_plain()]})
    )
    side.update_connector_output(out)
    assert side.tracker.state("R").saved == 32
    assert not side.tracker.violations


def test_a_log_that_cannot_be_written_never_stops_the_engine(tmp_path) -> None:
    """Disk full mid-run: the failure is reported once (Tracker.log_error), logging stops, and
    every callback goes on answering as before."""
    from kvledger.connector.scheduler import SchedulerSide

    side = SchedulerSide(
        ConnectorConfig(chunk_size=16, log_dir=str(tmp_path)), block_size=16, num_slots=8
    )
    writer = side.tracker._log

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    writer._out.write = writer._out.write_step = no_space  # the disk is full from here on
    r = FakeRequest("R", list(range(7, 47)))
    for step in range(3):
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)
        side.build_connector_meta(SchedulerOutput())  # writes (or fails to write) a frame
        assert side.adapter_errors == 0, f"step {step}"
    assert side.tracker.log_error is not None and "No space left" in side.tracker.log_error
    side.shutdown()


def test_max_async_lag_follows_async_scheduling_and_draft_tokens() -> None:
    from types import SimpleNamespace

    from kvledger.connector.vllm import _max_async_lag

    def cfg(async_scheduling: bool, drafts: int | None) -> Any:
        spec = None if drafts is None else SimpleNamespace(num_speculative_tokens=drafts)
        return SimpleNamespace(
            speculative_config=spec,
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        )

    assert _max_async_lag(cfg(False, None)) == 1
    assert _max_async_lag(cfg(True, None)) == 1
    assert _max_async_lag(cfg(False, 3)) == 3
    assert _max_async_lag(cfg(True, 3)) == 4


# --- one edge: KVLedgerConnector and KVLedgerRecorder read their settings alike ---------------


# The recorder wraps vLLM's toy connector here: what it wraps is not what is tested.
def _inner(tmp_path: Any) -> dict[str, Any]:
    from kvledger.connector.testing.recorded import example_connector

    return {
        "inner": example_connector(),
        "inner_extra_config": {"shared_storage_path": str(tmp_path)},
    }


# Bad values of the keys both classes take. The recorder parsed its settings by hand once:
# "false" was true, 40 became 32 and -7 became 16, "abc" raised a bare ValueError, and its
# log settings were ignored.
BAD_SHARED = [
    ("chunk_size", "abc"),
    ("chunk_size", -7),
    ("chunk_size", 0),
    ("chunk_size", True),
    ("chunk_size", 40),  # not whole blocks of 16: refused when vLLM's block size is known
    ("log_background", "on"),
    ("log_background", None),
    ("log_fsync", "always"),
    ("log_rotate_bytes", -1),
    ("log_rotate_bytes", "256M"),
    ("log_queue_bytes", 0),
    ("log_required", 3),
    ("log_dir", 7),
    ("digests", "on"),
    ("digests", True),
]


def _error(build: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        build()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(("key", "value"), BAD_SHARED)
def test_a_bad_value_gets_the_same_error_from_both_configs(key: str, value: Any) -> None:
    from kvledger.connector.config import RecorderConfig

    def connector() -> Any:
        ConnectorConfig.from_extra_config({key: value}, environ={}).check_block_size(16)

    def recorder() -> Any:
        config = RecorderConfig.from_extra_config({"inner": "X", key: value}, environ={})
        config.chunk_size_for(16)

    assert _error(connector) == _error(recorder)
    kind, message = _error(recorder)
    assert kind is ConnectorConfigError and message.startswith(key), message
    assert repr(value) in message or f"({value})" in message


@pytest.mark.vllm
@pytest.mark.parametrize(("key", "value"), BAD_SHARED)
def test_a_bad_value_refuses_both_classes_alike(
    vllm_build: Callable[..., Any], tmp_path: Any, key: str, value: Any
) -> None:
    """Through vLLM's own connector factory, in the scheduler role: the same error."""
    ours = _error(lambda: vllm_build("scheduler", **{key: value}))
    recorder = _error(
        lambda: vllm_build("scheduler", "KVLedgerRecorder", **_inner(tmp_path), **{key: value})
    )
    assert ours == recorder
    assert ours[0] is ConnectorConfigError and ours[1].startswith(key)


def _writer_settings(writer: Any) -> dict[str, Any]:
    from kvledger.connector.logwriter import _BackgroundOutput

    out = writer._out
    return {
        "rotate_bytes": writer.rotate_bytes,
        "fsync": writer.fsync,
        "background": isinstance(out, _BackgroundOutput),
        "queue_bytes": getattr(out, "max_bytes", None),
    }


GOOD_LOG = [
    {},
    {"log_background": "false", "log_fsync": "step", "log_rotate_bytes": 4096},
    {"log_background": "1", "log_queue_bytes": 1 << 20, "log_fsync": "never"},
]


@pytest.mark.vllm
@pytest.mark.parametrize("extra", GOOD_LOG)
def test_the_log_settings_mean_the_same_in_both_classes(
    vllm_build: Callable[..., Any], tmp_path: Any, extra: dict[str, Any]
) -> None:
    """The same log keys give both classes the same writer: rotation, fsync, the background
    thread and its queue bound; both logs are named by who wrote them."""
    ours = vllm_build("scheduler", host_pool_bytes=1 << 20, log_dir=str(tmp_path / "a"), **extra)
    recorder = vllm_build(
        "scheduler", "KVLedgerRecorder", **_inner(tmp_path), log_dir=str(tmp_path / "b"), **extra
    )
    ours_writer = ours.scheduler_side.tracker._log
    assert _writer_settings(ours_writer) == _writer_settings(recorder.recording.log)
    expected = ConnectorConfig.from_extra_config(extra, environ={})
    assert _writer_settings(ours_writer)["background"] is expected.log_background
    assert os.path.basename(ours.scheduler_side.log_path).startswith("kvledger-2")
    assert os.path.basename(recorder.log_path).startswith("kvledger-rec-2")
    ours.shutdown()
    recorder.shutdown()


@pytest.mark.vllm
def test_a_log_dir_that_cannot_be_written_is_the_same_policy_in_both(
    vllm_build: Callable[..., Any], tmp_path: Any
) -> None:
    """Without log_required both serve without a log; with it both refuse to start, naming
    the directory, with the same message."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log_dir = str(blocker / "logs")
    ours = vllm_build("scheduler", host_pool_bytes=1 << 20, log_dir=log_dir)
    recorder = vllm_build("scheduler", "KVLedgerRecorder", **_inner(tmp_path), log_dir=log_dir)
    assert ours.scheduler_side.log_path is None and recorder.log_path is None
    assert recorder.recording is not None and recorder.recording.log is None
    required = {"log_dir": log_dir, "log_required": "true"}
    kind, message = _error(lambda: vllm_build("scheduler", host_pool_bytes=1 << 20, **required))
    assert (kind, message) == _error(
        lambda: vllm_build("scheduler", "KVLedgerRecorder", **_inner(tmp_path), **required)
    )
    assert kind is ConnectorConfigError and log_dir in message and "log_required" in message


@pytest.mark.vllm
def test_the_recorder_takes_the_chunk_size_it_is_given(
    vllm_build: Callable[..., Any], tmp_path: Any
) -> None:
    """A chunk size of whole blocks is the recorded one, as given (none: 256)."""
    from kvledger.replay.source import open_log

    for given, recorded in ((48, 48), (None, 256)):
        extra = {} if given is None else {"chunk_size": given}
        log_dir = tmp_path / f"chunk-{given}"
        recorder = vllm_build(
            "scheduler", "KVLedgerRecorder", **_inner(tmp_path), log_dir=str(log_dir), **extra
        )
        recorder.shutdown()
        assert open_log(recorder.log_path).config().chunk_size == recorded


def test_the_recorder_refuses_unknown_keys_naming_where_the_inners_go() -> None:
    from kvledger.connector.config import RecorderConfig

    with pytest.raises(ConnectorConfigError) as info:
        RecorderConfig.from_extra_config({"inner": "X", "chunk_sz": 16}, environ={})
    assert "'chunk_sz'" in str(info.value) and "inner_extra_config" in str(info.value)
    with pytest.raises(ConnectorConfigError, match="needs `inner`"):
        RecorderConfig.from_extra_config({}, environ={})
    with pytest.raises(ConnectorConfigError, match=r"^inner_extra_config must be a map"):
        RecorderConfig.from_extra_config({"inner": "X", "inner_extra_config": [1]}, environ={})
