"""Drive vLLM's real v1 ``Scheduler`` on a CPU-only machine: no model, no worker.

Used by the connector's integration tests, ``kvledger demo`` and the scheduler-overhead
benchmark. The scheduler is vLLM's own class (``AsyncScheduler`` under async scheduling),
built the way vLLM's unit tests build it: a hand-written tiny Llama ``config.json`` (nothing
is downloaded), ``DeviceConfig("cpu")`` and a ``KVCacheConfig`` with ``num_blocks`` blocks and
no tensors. A KV connector, when configured, is loaded by vLLM itself from the
``kv_transfer_config`` (``kv_connector_module_path``), i.e. the real third-party loading path.

The "worker" is a user hook ``on_scheduled(scheduler_output) -> KVConnectorOutput | None``
that runs once per ``schedule()`` (the fake forward pass, and the worker-side connector
results: ``finished_sending``, ``finished_recving``, ``invalid_block_ids``...). The harness then
samples deterministic tokens (a function of request id and position, see ``fake_token``) and
calls ``update_from_output``. Under async scheduling the output of step N is applied after step
N+1 has been scheduled, as ``EngineCore.step_with_batch_queue`` does.

vLLM (and torch) are imported lazily, inside functions: ``import kvledger.connector.testing.harness``
works in an environment without them. vLLM reads some settings from environment variables;
``SchedulerHarness`` sets them before building anything (see ``_prepare_environment``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import random
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HarnessConfig",
    "HarnessStats",
    "RequestView",
    "SchedulerHarness",
    "StepResult",
    "WorkloadRequest",
    "fake_token",
    "load_failures_reportable",
    "make_kv_connector_output",
    "model_runner_v2_available",
    "named_prompts",
    "random_workload",
    "shared_prefix_prompts",
    "skip_reason",
    "vllm_available",
]

# Token ids below this are reserved: 0 pad, 1 BOS, 2 EOS in the tiny config.
_FIRST_TOKEN = 3
_EOS = 2
# Layout of the fake model: small, but with real per-layer names so that a fake worker can
# allocate paged KV tensors matching the KVCacheConfig (num_kv_heads x head_size per layer).
_NUM_LAYERS = 2
_NUM_KV_HEADS = 2
_HEAD_SIZE = 16

# The scheduler hook: receives this step's SchedulerOutput, returns the worker-side connector
# results to feed back (a vllm KVConnectorOutput) or None.
ScheduledHook = Callable[[Any], Any]


# --------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------


@functools.cache
def _import_error() -> str | None:
    """Import the scheduler once; remember why it failed. The import takes seconds, so this
    runs only when something needs vLLM (never at ``import kvledger.connector.testing.harness``)."""
    try:
        import vllm.config
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # any failure (missing dep, broken torch) means "not usable"
        return f"vLLM's scheduler is not importable: {type(exc).__name__}: {exc}"
    return None


def vllm_available() -> bool:
    """True if vLLM's v1 scheduler can be imported here (imports it on first call)."""
    return _import_error() is None


def skip_reason() -> str | None:
    """None if vLLM is usable, else a reason for ``pytest.skip``."""
    return _import_error()


@functools.cache
def load_failures_reportable() -> bool:
    """Whether a worker can tell this vLLM's scheduler that a load failed (the
    ``invalid_block_ids`` of KVConnectorOutput, 0.11.1 on). On 0.11.0 it cannot: vLLM then
    computes over whatever the failed blocks hold."""
    from vllm.v1.outputs import KVConnectorOutput

    return "invalid_block_ids" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


@functools.cache
def _recovery_source() -> str | None:
    """The source of this vLLM's recovery from a failed load
    (``Scheduler._update_requests_with_invalid_blocks``), or None where it has none: what
    the predicates below read a bug or its fix from."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    recover = getattr(Scheduler, "_update_requests_with_invalid_blocks", None)
    return None if recover is None else inspect.getsource(recover)


@functools.cache
def load_recovery_misses_resumed() -> bool:
    """Whether this vLLM's recovery from a failed synchronous load looks for the failed
    blocks only below ``request.num_cached_tokens`` (``_update_requests_with_invalid_blocks``,
    before vLLM PR #38096). vLLM sets that count at a request's first scheduling and does not
    reset it at a preemption, so when a resumed request's load fails beyond it, vLLM does not
    roll the request back and computes over the failed blocks (0.14.1 and 0.18.1 here)."""
    source = _recovery_source()
    return source is not None and "request.num_cached_tokens" in source


@functools.cache
def async_recovery_keeps_placeholders() -> bool:
    """Whether this vLLM, recovering from a failed load under async scheduling, rolls back a
    request's computed tokens but leaves its output placeholders: the failed step's sampled
    token is dropped while its placeholder stays, so the next step's token lands one
    position early and vLLM's token ids are no longer the model's (vLLM issues #45138 and
    #49250, part 2; open through 0.33). Read from the source of its recovery
    (``_update_requests_with_invalid_blocks``): a fix resets ``num_output_placeholders``
    there."""
    source = _recovery_source()
    if source is None or not load_failures_reportable():
        return False
    return "num_output_placeholders" not in source


@functools.cache
def model_runner_v2_available() -> bool:
    """Whether this vLLM can run Model Runner V2 here: it has one (0.14 on), and it does not
    refuse it without Triton (0.22 to 0.30 raise "requires Triton" when it is asked for; 0.33
    does not on this platform). Where it cannot, ``model_runner_v2`` is ignored: the
    scheduler runs with Model Runner V1's output shapes, as that vLLM would by default."""
    import importlib.util

    import vllm.envs as envs

    if not hasattr(envs, "VLLM_USE_V2_MODEL_RUNNER"):
        return False
    from vllm.config import VllmConfig

    validate = getattr(VllmConfig, "_validate_v2_model_runner", None)
    if validate is None or importlib.util.find_spec("triton") is not None:
        return True
    return "requires Triton" not in inspect.getsource(validate)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HarnessConfig:
    """Everything that shapes the scheduler's behaviour; defaults give a small pool that
    preempts with a couple of 48-token requests."""

    block_size: int = 16
    # Blocks in the (fake) GPU pool, block 0 included: vLLM reserves it as the null block, so
    # num_gpu_blocks - 1 are usable.
    num_gpu_blocks: int = 10
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # 0: no cap. Otherwise the most tokens one request may prefill per step.
    long_prefill_token_threshold: int = 0
    # Set explicitly: vLLM 0.33's SchedulerConfig defaults it to None, which VllmConfig turns
    # into True whenever the executor allows it.
    async_scheduling: bool = False
    # VLLM_USE_V2_MODEL_RUNNER. MRV2 is vLLM 0.33's default here (no triton, platform
    # "unspecified"); it changes the SchedulerOutput: resumed requests come back in
    # scheduled_new_reqs instead of scheduled_cached_reqs.resumed_req_ids.
    model_runner_v2: bool = True
    # None, or the --kv-transfer-config dict: kv_connector, kv_connector_module_path, kv_role,
    # kv_connector_extra_config (any KVTransferConfig field is passed through).
    kv_connector: Mapping[str, Any] | None = None
    # Salt of the fake sampler and the model seed.
    seed: int = 0
    vocab_size: int = 1024
    log_stats: bool = True
    # vLLM's KV cache events on, through its null publisher (a test reads the batches the
    # scheduler hands it): the prefix cache's and the connector's.
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_gpu_blocks < 2:
            raise ValueError("block_size must be > 0 and num_gpu_blocks >= 2 (block 0 is null)")
        if self.vocab_size <= _FIRST_TOKEN:
            raise ValueError(f"vocab_size must be > {_FIRST_TOKEN}")
        if self.kv_connector is not None:
            missing = {"kv_connector", "kv_role"} - set(self.kv_connector)
            if missing:
                raise ValueError(f"kv_connector config lacks {sorted(missing)}")

    def with_(self, **changes: Any) -> HarnessConfig:
        """A copy with some fields changed (tests build variants of one base config)."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """What one ``SchedulerHarness.step()`` did.

    ``scheduler_output`` is None only for an async-scheduling drain call, which applies a
    pending output without scheduling. ``applied_step`` is the step whose model output was fed
    to ``update_from_output`` in this call: equal to ``step`` when scheduling is synchronous,
    the previous step (or None while the queue fills) under async scheduling.
    """

    step: int
    scheduler_output: Any | None
    applied_step: int | None
    num_scheduled_tokens: Mapping[str, int]
    # Request ids, in scheduling order.
    new: tuple[str, ...]
    resumed: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    # After this call, every unfinished request. Under async scheduling vLLM advances it when
    # it schedules, so it runs ahead of the tokens known to the request.
    num_computed_tokens: Mapping[str, int]


@dataclass
class HarnessStats:
    steps: int = 0  # schedule() calls
    empty_steps: int = 0  # schedule() calls that scheduled no token
    outputs_applied: int = 0  # update_from_output() calls
    scheduled_tokens: int = 0
    preemptions: int = 0  # sum of len(preempted_req_ids)
    resumptions: int = 0
    finished: int = 0


@dataclass(frozen=True)
class RequestView:
    """A copy of what a KV-content oracle needs about one request, taken at one moment."""

    req_id: str
    status: str
    block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV-cache group
    all_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    # Tokens scheduled whose output has not been applied yet (async scheduling).
    num_in_flight_tokens: int
    num_output_placeholders: int
    num_preemptions: int


@dataclass(frozen=True)
class WorkloadRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class _Pending:
    """A scheduled step whose model output has not been applied yet."""

    step: int
    scheduler_output: Any
    model_runner_output: Any
    new: tuple[str, ...]
    resumed: tuple[str, ...]
    preempted: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# Deterministic fake sampler and workloads
# --------------------------------------------------------------------------------------------


def fake_token(req_id: str, position: int, seed: int = 0, vocab_size: int = 1024) -> int:
    """The token the fake model samples for ``req_id`` at index ``position`` of its
    all_token_ids: a pure function, so runs (sync, async, preempted or not) are comparable.
    Never a special token, so only max_tokens ends a request."""
    digest = zlib.crc32(f"{seed}:{req_id}:{position}".encode())
    return _FIRST_TOKEN + digest % (vocab_size - _FIRST_TOKEN)


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_TOKEN, vocab_size) for _ in range(n)]


def shared_prefix_prompts(
    n: int, prefix_len: int, suffix_len: int, seed: int = 0, vocab_size: int = 1024
) -> list[list[int]]:
    """``n`` prompts sharing their first ``prefix_len`` tokens, each with its own suffix."""
    rng = random.Random(seed)
    prefix = _random_tokens(rng, prefix_len, vocab_size)
    return [prefix + _random_tokens(rng, suffix_len, vocab_size) for _ in range(n)]


def named_prompts(name: str, seed: int, requests: Iterable[Any]) -> dict[str, list[int]]:
    """The token stream of each prompt name of a scripted workload (``requests``, each with
    ``prompt`` and ``prompt_len``), seeded by the workload's name (token ids 10 to 999), as long
    as the longest request naming it: a request's prompt is the first ``prompt_len`` of them."""
    rng = random.Random(f"{name}:{seed}")
    longest: dict[str, int] = {}
    for r in requests:
        longest[r.prompt] = max(longest.get(r.prompt, 0), r.prompt_len)
    return {prompt: [rng.randrange(10, 1000) for _ in range(n)] for prompt, n in longest.items()}


def random_workload(
    n: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 128),
    max_tokens: tuple[int, int] = (1, 32),
    vocab_size: int = 1024,
    prefix: str = "req",
) -> list[WorkloadRequest]:
    """``n`` requests with prompt lengths and max_tokens drawn uniformly from the inclusive
    ranges; ids are ``f"{prefix}-{i}"``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(*prompt_len)
        out.append(
            WorkloadRequest(
                req_id=f"{prefix}-{i}",
                prompt_token_ids=tuple(_random_tokens(rng, length, vocab_size)),
                max_tokens=rng.randint(*max_tokens),
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# vLLM construction (all vLLM/torch imports live below this line, inside functions)
# --------------------------------------------------------------------------------------------


def _prepare_environment(model_runner_v2: bool) -> None:
    """Settings vLLM reads from the environment.

    Offline and a cache root in the temp dir are defaults (an existing value wins); the model
    runner is forced, because ``VllmConfig.use_v2_model_runner`` is a property that re-reads
    VLLM_USE_V2_MODEL_RUNNER on every access and the Scheduler copies it in ``__init__``. It is
    left set afterwards, as in a real vLLM process, so a connector that reads the property
    later sees the same mode (the last harness built in a process wins for such late readers).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # ModelConfig inspects the architecture in a subprocess (~14 s) and caches the result
    # under VLLM_CACHE_ROOT/modelinfos; a stable temp path makes later runs take ~10 ms.
    os.environ.setdefault(
        "VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "kvledger-vllm-cache")
    )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner_v2 else "0"


def _tiny_llama_config(vocab_size: int, max_model_len: int) -> dict[str, Any]:
    hidden = _NUM_KV_HEADS * 2 * _HEAD_SIZE
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": hidden // _HEAD_SIZE,
        "num_key_value_heads": _NUM_KV_HEADS,
        "head_dim": _HEAD_SIZE,
        "num_hidden_layers": _NUM_LAYERS,
        "vocab_size": vocab_size,
        "max_position_embeddings": max(2048, max_model_len),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": _EOS,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }


def _model_dir(vocab_size: int, max_model_len: int) -> str:
    """A directory holding only config.json; named by its content so concurrent processes
    share it and it is written once."""
    text = json.dumps(_tiny_llama_config(vocab_size, max_model_len), sort_keys=True)
    name = "kvledger-tiny-llama-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), name)
    target = os.path.join(path, "config.json")
    if not os.path.exists(target):
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)  # atomic: a reader never sees half a file
    return path


def _build_vllm_config(cfg: HarnessConfig) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_dir = _model_dir(cfg.vocab_size, cfg.max_model_len)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=cfg.seed,
        max_model_len=cfg.max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        async_scheduling=cfg.async_scheduling,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=cfg.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    kv_transfer_config = (
        KVTransferConfig(**dict(cfg.kv_connector)) if cfg.kv_connector is not None else None
    )
    events: dict[str, Any] = {}
    if cfg.kv_events:
        from vllm.config import KVEventsConfig

        events["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # The hybrid KV-cache manager is left for VllmConfig to resolve: 0.33 disables it for a
    # connector without SupportsHMA, exactly as `vllm serve --kv-transfer-config` would.
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        **events,
    )


def _build_kv_cache_config(cfg: HarnessConfig) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=cfg.block_size,
        num_kv_heads=_NUM_KV_HEADS,
        head_size=_HEAD_SIZE,
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(_NUM_LAYERS)]
    # No tensors: the scheduler only does block-id bookkeeping.
    return KVCacheConfig(
        num_blocks=cfg.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def _accepted_kwargs(cls: type, candidates: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``candidates`` that ``cls(...)`` accepts (constructor keywords vary by
    version). A subclass that forwards ``*args, **kwargs`` (AsyncScheduler) is looked through
    to the first class in its MRO that names its parameters."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {k: v for k, v in candidates.items() if k in params}
    return dict(candidates)


def _scheduler_class(scheduler_config: Any) -> type:
    """The same class choice as EngineCore: AsyncScheduler iff async scheduling."""
    getter = getattr(scheduler_config, "get_scheduler_cls", None)
    if getter is not None:
        return getter()  # type: ignore[no-any-return]
    # vLLM 0.11 has no get_scheduler_cls: scheduler_cls names the class, V0's by default
    # (the CUDA platform swaps in V1's), AsyncScheduler's under async scheduling.
    if scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _build_scheduler(cfg: HarnessConfig, vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = cfg.num_gpu_blocks
    scheduler_cls = _scheduler_class(vllm_config.scheduler_config)
    kwargs = _accepted_kwargs(
        scheduler_cls,
        {
            "vllm_config": vllm_config,
            "kv_cache_config": kv_cache_config,
            "structured_output_manager": StructuredOutputManager(vllm_config),
            "block_size": cfg.block_size,
            "hash_block_size": cfg.block_size,
            "log_stats": cfg.log_stats,
        },
    )
    return scheduler_cls(**kwargs)


def _make_block_hasher(vllm_config: Any, block_size: int) -> Any:
    """The request block hasher EngineCore installs when prefix caching or a connector is on
    (connectors key external KV by ``request.block_hashes``)."""
    if not (vllm_config.cache_config.enable_prefix_caching or vllm_config.kv_transfer_config):
        return None
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # vLLM 0.11: in vllm.utils itself
        from vllm.utils import get_hash_fn_by_name  # type: ignore[attr-defined, no-redef]
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def make_kv_connector_output(
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    **extra: Any,
) -> Any:
    """A vLLM ``KVConnectorOutput`` for a hook to return, without importing vLLM there."""
    from vllm.v1.outputs import KVConnectorOutput

    fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    invalid = set(invalid_block_ids)
    if "invalid_block_ids" in fields:
        extra["invalid_block_ids"] = invalid
    elif invalid:  # vLLM 0.11.0: the scheduler has no way to hear of a failed load
        raise NotImplementedError("this vLLM's KVConnectorOutput has no invalid_block_ids")
    return KVConnectorOutput(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving),
        **extra,
    )


@functools.cache
def _model_runner_output_fields() -> frozenset[str]:
    from vllm.v1.outputs import ModelRunnerOutput

    return frozenset(f.name for f in dataclasses.fields(ModelRunnerOutput))


@functools.cache
def _sampled_as_arrays() -> bool:
    """vLLM 0.11.1 and 0.11.2 take each request's sampled tokens as a numpy array (their
    scheduler calls ``.tolist()``); the others as a list."""
    from vllm.v1.outputs import ModelRunnerOutput

    field = next(f for f in dataclasses.fields(ModelRunnerOutput) if f.name == "sampled_token_ids")
    return "ndarray" in str(field.type)


def _as_sampled(tokens: list[int]) -> Any:
    if not _sampled_as_arrays():
        return tokens
    import numpy as np

    return np.array(tokens, dtype=np.int64)


def _make_model_runner_output(
    sampled: Mapping[str, list[int]], kv_connector_output: Any | None
) -> Any:
    """A ModelRunnerOutput for the requests of one step. Field names vary across vLLM
    versions, so only the fields this version declares are passed."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(sampled)
    candidates: dict[str, Any] = {
        "req_ids": req_ids,
        "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
        "sampled_token_ids": [_as_sampled(sampled[r]) for r in req_ids],
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": None,
        "kv_connector_output": kv_connector_output,
    }
    names = _model_runner_output_fields()
    return ModelRunnerOutput(**{k: v for k, v in candidates.items() if k in names})


# --------------------------------------------------------------------------------------------
# The harness
# --------------------------------------------------------------------------------------------


class SchedulerHarness:
    """vLLM's real scheduler, a fake worker (``on_scheduled``) and a fake sampler."""

    def __init__(self, config: HarnessConfig, on_scheduled: ScheduledHook | None = None) -> None:
        reason = skip_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.config = config
        self.on_scheduled = on_scheduled
        _prepare_environment(config.model_runner_v2 and model_runner_v2_available())
        self.vllm_config = _build_vllm_config(config)
        self.kv_cache_config = _build_kv_cache_config(config)
        self.scheduler = _build_scheduler(config, self.vllm_config, self.kv_cache_config)
        self.connector = self.scheduler.get_kv_connector()
        self._block_hasher = _make_block_hasher(self.vllm_config, config.block_size)
        # EngineCore's batch queue: 1 (sync) or max_concurrent_batches (2 when async; before
        # vLLM 0.26 the executor's property, the same numbers for one process).
        batches = getattr(self.vllm_config, "max_concurrent_batches", None)
        if batches is None:
            batches = 2 if config.async_scheduling else 1
        self._queue_size = max(1, int(batches))
        self._queue: deque[_Pending] = deque()
        self._step = 0
        self._ever_scheduled: set[str] = set()
        self.stats = HarnessStats()
        self.finished: dict[str, str] = {}  # req id -> finish reason
        self.output_tokens: dict[str, list[int]] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}

    # -- properties ----------------------------------------------------------------------

    @property
    def use_v2_model_runner(self) -> bool:
        """The mode the scheduler was built in (it copies it in ``__init__``)."""
        # vLLM 0.11 has no Model Runner V2 (see model_runner_v2_available).
        return bool(getattr(self.scheduler, "use_v2_model_runner", False))

    @property
    def layer_names(self) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[0].layer_names)

    @property
    def num_free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def is_done(self) -> bool:
        """Nothing left to schedule and no output pending (finished requests whose blocks a
        connector still holds count as not done: the scheduler keeps stepping for them)."""
        return not self._queue and not self.scheduler.has_requests()

    # -- requests ------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        kwargs = _accepted_kwargs(
            Request,
            {
                "request_id": req_id,
                "prompt_token_ids": list(prompt_token_ids),
                "sampling_params": params,
                "pooling_params": None,
                "mm_features": None,
                "block_hasher": self._block_hasher,
                "eos_token_id": _EOS,  # required up to vLLM 0.16
            },
        )
        self.prompts[req_id] = tuple(prompt_token_ids)
        self.output_tokens[req_id] = []
        self.scheduler.add_request(Request(**kwargs))

    def abort_request(self, *req_ids: str) -> None:
        """Abort between steps, as EngineCore does with its aborts queue."""
        from vllm.v1.request import RequestStatus

        live = [r for r in req_ids if r in self.scheduler.requests]
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        # vLLM 0.11 returns nothing (every live request named was finished); some releases
        # (0.18) return (request id, client index) pairs, the others the requests.
        if finished is not None:
            live = [r[0] if isinstance(r, tuple) else r.request_id for r in finished]
        for req_id in live:
            self._record_finished(req_id, "abort")

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> StepResult | None:
        """One engine step; None when there is nothing to do (see ``is_done``).

        Sync: schedule, run the hook, apply the output. Async: schedule and run the hook, and
        apply the oldest pending output only once the batch queue is full or nothing else can
        be scheduled, so vLLM schedules step N+1 before it sees step N's tokens.
        """
        pending: _Pending | None = None
        if self.scheduler.has_requests():
            pending = self._schedule_and_run()
            self._queue.appendleft(pending)
            executed = pending.scheduler_output.total_num_scheduled_tokens > 0
            if len(self._queue) < self._queue_size and (executed or self.scheduler.has_requests()):
                return self._result(pending, applied=None, finished=())
        elif not self._queue:
            return None
        applied = self._queue.pop()
        finished = self._apply(applied)
        if pending is None:  # drain call: nothing scheduled, only an output applied
            self._step += 1
        return self._result(pending, applied=applied, finished=finished)

    def close(self) -> None:
        self.scheduler.shutdown()

    def __enter__(self) -> SchedulerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views for oracles ---------------------------------------------------------------

    def request_view(self, req_id: str) -> RequestView:
        request = self.scheduler.requests[req_id]
        try:
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        except KeyError:  # not allocated yet
            blocks = ()
        return RequestView(
            req_id=req_id,
            status=request.status.name,
            block_ids=tuple(tuple(group) for group in blocks),
            all_token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=int(request.num_prompt_tokens),
            num_computed_tokens=int(request.num_computed_tokens),
            num_in_flight_tokens=int(getattr(request, "num_in_flight_tokens", 0)),
            num_output_placeholders=int(getattr(request, "num_output_placeholders", 0)),
            num_preemptions=int(getattr(request, "num_preemptions", 0)),
        )

    def running_views(self) -> dict[str, RequestView]:
        """Every running request, in the scheduler's running order."""
        return {r.request_id: self.request_view(r.request_id) for r in self.scheduler.running}

    def waiting_for_remote_kvs(self) -> list[str]:
        """Requests parked until the worker reports their async load in finished_recving."""
        from vllm.v1.request import RequestStatus

        return [
            rid
            for rid, r in self.scheduler.requests.items()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]

    def describe(self) -> str:
        waiting = [r.request_id for r in self.scheduler.waiting]
        running = [r.request_id for r in self.scheduler.running]
        return (
            f"step={self._step} running={running} waiting={waiting} "
            f"remote={self.waiting_for_remote_kvs()} pending_outputs={len(self._queue)} "
            f"free_blocks={self.num_free_blocks} requests={sorted(self.scheduler.requests)}"
        )

    # -- internals -----------------------------------------------------------------------

    def _schedule_and_run(self) -> _Pending:
        running_before = [r.request_id for r in self.scheduler.running]
        out = self.scheduler.schedule()
        preempted = self._preempted(out, running_before)
        step = self._step
        self._step += 1
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.total_num_scheduled_tokens
        if out.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
        self.stats.preemptions += len(preempted)
        # Sample now, while the requests are in the state this step was scheduled from:
        # under async scheduling they move on before this output is applied.
        sampled = self._sample(out)
        new, resumed = self._admissions(out)
        self.stats.resumptions += len(resumed)
        kv_out = self.on_scheduled(out) if self.on_scheduled is not None else None
        if kv_out is None and self.connector is not None:
            # Always report a (possibly empty) KVConnectorOutput, as MultiprocExecutor's
            # KVOutputAggregator does, so update_connector_output runs every step.
            # (UniProcExecutor omits it on a no-forward step with nothing to report.)
            kv_out = make_kv_connector_output()
        mro = _make_model_runner_output(sampled, kv_out)
        return _Pending(step, out, mro, new, resumed, preempted)

    def _preempted(self, out: Any, running_before: list[str]) -> tuple[str, ...]:
        """The requests this schedule() preempted: ``preempted_req_ids`` from vLLM 0.12 on;
        before, the requests that were running and are now back in the waiting queue as
        PREEMPTED (where vLLM's scheduler puts a request it preempts)."""
        if hasattr(out, "preempted_req_ids"):
            return tuple(sorted(out.preempted_req_ids or ()))
        from vllm.v1.request import RequestStatus

        before = set(running_before)
        return tuple(
            sorted(
                r.request_id
                for r in self.scheduler.waiting
                if r.request_id in before and r.status == RequestStatus.PREEMPTED
            )
        )

    def _sample(self, out: Any) -> dict[str, list[int]]:
        """One fake token per request that reached the end of its known tokens; none for a
        partial prefill chunk (the real runner discards those samples)."""
        sampled: dict[str, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            position = int(request.num_computed_tokens)  # after this step's tokens
            partial = getattr(request, "is_prefill_chunk", None)
            if partial is None:  # older vLLM: no async placeholders to account for
                partial = position < request.num_tokens
            sampled[req_id] = (
                []
                if partial
                else [fake_token(req_id, position, self.config.seed, self.config.vocab_size)]
            )
        return sampled

    def _apply(self, pending: _Pending) -> tuple[str, ...]:
        outputs = self.scheduler.update_from_output(
            pending.scheduler_output, pending.model_runner_output
        )
        self.stats.outputs_applied += 1
        finished: list[str] = []
        for engine_outputs in outputs.values():
            for o in engine_outputs.outputs:
                self.output_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self._record_finished(o.request_id, str(o.finish_reason))
                    finished.append(o.request_id)
        return tuple(finished)

    def _record_finished(self, req_id: str, reason: str) -> None:
        if req_id not in self.finished:
            self.finished[req_id] = reason
            self.stats.finished += 1

    def _admissions(self, out: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(first admissions, re-admissions). A re-admission is MRV1's resumed_req_ids, or a
        request back in scheduled_new_reqs after having been scheduled before (MRV2, and the
        async-load path of older versions)."""
        new: list[str] = []
        resumed: list[str] = []
        for data in out.scheduled_new_reqs:
            (resumed if data.req_id in self._ever_scheduled else new).append(data.req_id)
        cached = out.scheduled_cached_reqs
        flagged = getattr(cached, "resumed_req_ids", None)
        if flagged is None:  # vLLM 0.11.0: a list of flags, one per cached request
            flags = getattr(cached, "resumed_from_preemption", None) or ()
            flagged = {r for r, flag in zip(cached.req_ids, flags, strict=True) if flag}
        resumed.extend(r for r in cached.req_ids if r in flagged)
        self._ever_scheduled.update(out.num_scheduled_tokens)
        return tuple(new), tuple(resumed)

    def _result(
        self, pending: _Pending | None, applied: _Pending | None, finished: tuple[str, ...]
    ) -> StepResult:
        out = pending.scheduler_output if pending is not None else None
        return StepResult(
            step=pending.step if pending is not None else self._step - 1,
            scheduler_output=out,
            applied_step=applied.step if applied is not None else None,
            num_scheduled_tokens=dict(out.num_scheduled_tokens) if out is not None else {},
            new=pending.new if pending is not None else (),
            resumed=pending.resumed if pending is not None else (),
            preempted=pending.preempted if pending is not None else (),
            finished=finished,
            num_computed_tokens={
                rid: int(r.num_computed_tokens)
                for rid, r in self.scheduler.requests.items()
                if not r.is_finished()
            },
        )
