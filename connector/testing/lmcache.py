"""LMCache's real vLLM v1 adapter under vLLM's real scheduler, on CPU (a test rig, not product).

vLLM 0.33 loads ``LMCacheConnectorV1`` from its own registry; that wrapper builds LMCache's
``LMCacheConnectorV1Impl`` (``lmcache.integration.vllm.vllm_v1_adapter``), which is the code
under test: request trackers, lookups, load and save specs, slot mappings, all of it LMCache's
own. Only what needs a GPU or a server process is replaced:

- the storage engine and the lookup client, by ``PrefixStore``: a CPU dict keyed by the token
  prefix of each chunk (LMCache's chunking: a chain over ``chunk_size`` tokens, the last chunk
  possibly partial), which copies KV in and out of the paged caches by slot mapping, as
  LMCache's GPU connector does. Its lookup counts the tokens of the leading chunks it holds;
  its "nothing cached for this lookup id" answer is the installed version's own (``None`` in
  0.3.x, ``-1`` from 0.4.2), read from LMCache's lookup client class;
- 0.3.x: ``_init_lmcache_engine`` (it sets a CUDA device), ``LookupClientFactory``, the ZMQ
  offload server, and vLLM's ``get_pp_group`` / ``get_tensor_model_parallel_rank`` (no
  distributed state in a test process); from 0.4.x ``LMCacheManager`` (and, 0.5.x,
  ``VllmServiceFactory``), which own the same components;
- ``Tensor.cuda()``: 0.3.9 moves slot mappings to CUDA unconditionally; here it is the identity.

Each LMCache version is installed by ``make lmcache`` into its own directory
(``build/lmcache-<version>``: they cannot share a site-packages); ``run_version`` runs a workload
in a child process with that directory on ``PYTHONPATH``, and returns the ``LMCacheReport``.

The worker role is a second connector built by vLLM's ``KVConnectorFactory`` from the same
config, driven by the rigs' model runner (``connector.testing.driver``: vLLM 0.33's call order)
over CPU paged caches owned by the KV-content oracle; LMCache's worker returns early unless the
forward context carries attention metadata, which a step with a forward pass has. After every
step every computed token of every running request is checked. The rig is
connector-agnostic past the stubs: ``kv_connector`` may name a connector that wraps LMCache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import random
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvledger.connector.testing.driver import ModelRunner, built_by_vllm
from kvledger.connector.testing.harness import HarnessConfig

__all__ = [
    "VERSIONS",
    "WORKLOADS",
    "LMCacheReport",
    "LMCacheRun",
    "PrefixStore",
    "installed",
    "lmcache_kv_connector",
    "missing_versions",
    "recorded_kv_connector",
    "run",
    "run_version",
    "version_path",
    "wrapped_in_recorder",
]

# The pinned wheels `make lmcache` installs. 0.3.9.post2 is the last release before LMCache PR
# #2007 (the #1969 fix), 0.3.10 the first after it; 0.4.2 and 0.5.6 are current lines.
VERSIONS = ("0.3.9.post2", "0.3.10", "0.4.2", "0.5.6")

_ROOT = Path(__file__).resolve().parents[2]
BUILD = _ROOT / "build"
DEPS = BUILD / "lmcache-deps"


def version_path(version: str) -> Path:
    return BUILD / f"lmcache-{version}"


def installed(version: str) -> bool:
    """Installed completely by ``make lmcache`` (it writes the stamps last)."""
    return (version_path(version) / ".installed").exists() and (DEPS / ".installed").exists()


def missing_versions(versions: Sequence[str] = VERSIONS) -> list[str]:
    return [v for v in versions if not installed(v)]


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMCacheRun:
    """A workload and the engine and LMCache settings it runs under."""

    name: str
    num_requests: int = 2
    prompt_len: int = 34
    max_tokens: int = 35
    block_size: int = 16
    num_gpu_blocks: int = 7  # block 0 included (vLLM's null block): 6 usable, as in #1969
    chunk_size: int = 16
    enable_prefix_caching: bool = True
    model_runner_v2: bool = False
    async_scheduling: bool = False
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    # Requests sharing a prompt prefix of this many tokens.
    shared_prefix: int = 0
    # Prompts of the first requests again, as new requests, once everything finished.
    repeat_prompts: int = 0
    # Give an adapter without get_kv_events (0.3.x) an empty one: vLLM 0.33's wrapper calls
    # it after every forward pass. False: the adapter as it is (0.3.x then fails at step 0).
    events_shim: bool = True
    # LMCache's KV events (its enable_kv_events): the engine publishes a CacheStoreEvent per
    # chunk it stores, as LMCacheEngine.store does (releases that have them: 0.4 on).
    kv_events: bool = False
    # Requests whose first retrieve finds the last chunk their lookup promised gone: an
    # eviction between the scheduler's lookup and the worker's retrieve (LMCache #4133).
    evict_before_retrieve: tuple[str, ...] = ()
    # More "lmcache.*" settings (save_decode_cache, save_unfull_chunk...).
    lmcache: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    max_steps: int = 2000

    def prompts(self) -> list[tuple[str, list[int], int]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(10, 1000) for _ in range(self.shared_prefix)]
        out = []
        for i in range(self.num_requests):
            tail = [rng.randrange(10, 1000) for _ in range(self.prompt_len - len(prefix))]
            out.append((f"req-{i}", prefix + tail, self.max_tokens))
        return out


WORKLOADS: dict[str, LMCacheRun] = {
    # LMCache #1969: two requests of 34 prompt + 35 output tokens, 7 blocks of 16, chunks of
    # 16, Model Runner V1: req-1 is preempted and resumes among the cached requests.
    # Without prefix caching (the measured case: nothing of req-1 survives in vLLM, so all
    # of its KV must come back from LMCache).
    "issue1969": LMCacheRun("issue1969", enable_prefix_caching=False),
    # With prefix caching: req-1's first block survives as a local hit.
    "issue1969_prefix_cache": LMCacheRun("issue1969_prefix_cache"),
    # The same under Model Runner V2: a resumed request comes back as a new request.
    "issue1969_mrv2": LMCacheRun(
        "issue1969_mrv2", enable_prefix_caching=False, model_runner_v2=True
    ),
    # Shared prefixes, preemptions and repeated prompts (full-prompt hits).
    "mixed": LMCacheRun(
        "mixed",
        num_requests=5,
        prompt_len=40,
        max_tokens=40,
        num_gpu_blocks=12,
        shared_prefix=20,
        repeat_prompts=2,
    ),
    # Long prompts prefilled in chunks of 32 tokens, decode-phase saving on, a pool that
    # preempts: partial prefills, saves of decoded tokens, resumptions mid-decode.
    "chunked_prefill": LMCacheRun(
        "chunked_prefill",
        num_requests=3,
        prompt_len=100,
        max_tokens=30,
        num_gpu_blocks=16,
        max_num_batched_tokens=32,
        shared_prefix=48,
        repeat_prompts=1,
        lmcache={"save_decode_cache": True},
    ),
    # #1969's workload with the adapter as it is under vLLM 0.33 (no get_kv_events shim).
    "issue1969_as_is": LMCacheRun(
        "issue1969_as_is", enable_prefix_caching=False, events_shim=False
    ),
    # #1969's workload under async scheduling (step N+1 scheduled before step N's token).
    "issue1969_async": LMCacheRun(
        "issue1969_async", enable_prefix_caching=False, async_scheduling=True
    ),
    # LMCache chunks of 64 tokens over vLLM blocks of 16, partial chunks saved.
    "big_chunks": LMCacheRun(
        "big_chunks",
        num_requests=4,
        prompt_len=90,
        max_tokens=40,
        num_gpu_blocks=20,
        chunk_size=64,
        shared_prefix=70,
        repeat_prompts=2,
        lmcache={"save_unfull_chunk": True},
    ),
}

# Workloads with LMCache's KV events on (releases with CacheStoreEvent: 0.4 on). #1969's
# workload: req-1, preempted, asks again for its prompt and its outputs.
EVENT_WORKLOADS: dict[str, LMCacheRun] = {
    "issue1969_events": LMCacheRun("issue1969_events", enable_prefix_caching=False, kv_events=True),
    "big_chunks_events": dataclasses.replace(
        WORKLOADS["big_chunks"], name="big_chunks_events", kv_events=True
    ),
}


def lmcache_kv_connector(spec: LMCacheRun) -> dict[str, Any]:
    """The ``--kv-transfer-config`` an LMCache user passes, with this run's chunk size."""
    extra: dict[str, Any] = {"lmcache.chunk_size": spec.chunk_size, "lmcache.local_cpu": True}
    if spec.kv_events:
        extra["lmcache.enable_kv_events"] = True
    extra.update({f"lmcache.{k}": v for k, v in spec.lmcache.items()})
    return {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def recorded_kv_connector(
    spec: LMCacheRun, log_dir: str, digests: str = "off", steady_decode: bool = True
) -> dict[str, Any]:
    """LMCache's ``--kv-transfer-config`` wrapped in ``KVLedgerRecorder`` (docs/recording.md):
    the recorder is loaded by module path, LMCache by its registry name, with its own extra
    config as ``inner_extra_config``."""
    return wrapped_in_recorder(
        lmcache_kv_connector(spec),
        log_dir,
        digests,
        spec.chunk_size,
        steady_decode=steady_decode,
    )


def wrapped_in_recorder(
    inner: dict[str, Any], log_dir: str, digests: str, chunk_size: int, **more: Any
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` ``inner`` (an LMCache connector, by its registry name)
    wrapped in ``KVLedgerRecorder``, its log written on the scheduler thread; ``more``: more of
    the recorder's extra config."""
    return {
        "kv_connector": "KVLedgerRecorder",
        "kv_connector_module_path": "kvledger.connector.vllm",
        "kv_role": inner["kv_role"],
        "kv_connector_extra_config": {
            "inner": inner["kv_connector"],
            "inner_extra_config": inner["kv_connector_extra_config"],
            "log_dir": log_dir,
            "digests": digests,
            # The granularity `kvledger check --differential` gives kvledger's pool: LMCache's.
            "chunk_size": chunk_size,
            "log_background": False,
            **more,
        },
    }


# --------------------------------------------------------------------------------------------
# The stand-in storage engine and lookup client
# --------------------------------------------------------------------------------------------


class PrefixStore:
    """LMCache's storage as seen by the adapter: chunks keyed by their token prefix.

    One instance plays the worker's engine and the scheduler's lookup client (they share a
    process here). ``store`` and ``retrieve`` follow LMCache's ``ChunkedTokenDatabase``: the
    mask is False on a chunk-aligned prefix (ValueError otherwise, as LMCache raises), a chunk
    already stored is not stored again, and a retrieve stops at the first chunk it lacks.
    """

    def __init__(
        self,
        chunk_size: int,
        block_size: int,
        no_lookup_result: int | None,
        kv_events: bool = False,
        evict_before_retrieve: Sequence[str] = (),
    ) -> None:
        self.chunk_size = chunk_size
        self.evict_before_retrieve = set(evict_before_retrieve)
        self._last_hit: dict[str, int] = {}  # lookup id -> the key of the last chunk it found
        self.block_size = block_size
        self.no_lookup_result = no_lookup_result
        self.chunks: dict[int, Any] = {}  # prefix key -> tensor [layers, 2, n, row]
        self.lookups: dict[str, int] = {}
        self.kvcaches: list[Any] = []
        # Per step, for the report: req id -> tokens retrieved / stored; failed retrieves.
        self.retrieved: dict[str, int] = {}
        self.stored: dict[str, int] = {}
        self.failed: set[str] = set()
        # LMCache's CacheStoreEvents not yet taken (None: its KV events are off).
        self.kv_events: list[Any] | None = [] if kv_events else None
        # Engine attributes the adapters read.
        self.metadata = SimpleNamespace(
            worker_id=0,
            kv_layer_groups_manager=SimpleNamespace(build_kv_layer_groups=lambda caches: None),
        )
        self.gpu_connector = None
        self.storage_manager = None
        self.token_database = None
        self.save_only_first_rank = False

    # -- keys --------------------------------------------------------------------------------

    def _chunks(self, tokens: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        """(start, end, key) per chunk; the key chains the previous chunk's key."""
        key = 0
        for start in range(0, len(tokens), self.chunk_size):
            end = min(start + self.chunk_size, len(tokens))
            key = hash((key, tuple(int(t) for t in tokens[start:end])))
            yield start, end, key

    def _skip(self, mask: Any, n: int) -> int:
        falses = n - int(mask.long().sum()) if mask is not None else 0
        if falses % self.chunk_size:
            raise ValueError(
                "The number of Falses in the mask is not a multiple of the chunk size."
            )
        return falses

    def _rows(self, layer: Any) -> Any:
        # vLLM's flash-attention layout [2, num_blocks, block_size, heads, head_size].
        return layer.reshape(2, layer.shape[1] * layer.shape[2], -1)

    # -- engine ------------------------------------------------------------------------------

    def post_init(self, **kwargs: Any) -> None:
        if kwargs.get("kvcaches") is not None:
            self.kvcaches = list(kwargs["kvcaches"])

    def store(self, tokens: Sequence[int], mask: Any = None, **kwargs: Any) -> None:
        import torch

        kvcaches = list(kwargs.get("kvcaches") or self.kvcaches)
        slots = kwargs["slot_mapping"].to("cpu").long()
        skip = self._skip(mask, len(tokens))
        # LMCacheEngine.store's events: one per chunk of the call (stored before or not: it
        # puts every chunk past the mask), the first one past token 0 naming parent 0.
        prev_key = 0
        for start, end, key in self._chunks(tokens):
            if start < skip:
                continue
            if key not in self.chunks:
                span = slots[start:end]
                rows = [self._rows(c)[:, span].clone() for c in kvcaches]
                self.chunks[key] = torch.stack(rows)
                req = str(kwargs.get("req_id", "?"))
                self.stored[req] = self.stored.get(req, 0) + (end - start)
            if self.kv_events is not None:
                from lmcache.utils import CacheStoreEvent

                self.kv_events.append(
                    CacheStoreEvent(
                        block_hashes=[key],
                        parent_block_hash=None if start == 0 else prev_key,
                        token_ids=[int(t) for t in tokens[start:end]],
                        block_size=end - start,
                        lora_id=None,
                        medium="cpu",
                        lora_name=None,
                    )
                )
                prev_key = key

    def retrieve(self, tokens: Sequence[int], mask: Any = None, **kwargs: Any) -> Any:
        import torch

        kvcaches = list(kwargs.get("kvcaches") or self.kvcaches)
        slots = kwargs["slot_mapping"].to("cpu").long()
        skip = self._skip(mask, len(tokens))
        req = str(kwargs.get("req_id", "?"))
        if req in self.evict_before_retrieve:  # LMCache #4133: evicted since the lookup
            self.evict_before_retrieve.discard(req)
            self.chunks.pop(self._last_hit.get(req, 0), None)
        ret = torch.zeros(len(tokens), dtype=torch.bool)
        for start, end, key in self._chunks(tokens):
            if start < skip:
                continue
            value = self.chunks.get(key)
            if value is None:
                break
            span = slots[start:end]
            for layer, cache in enumerate(kvcaches):
                self._rows(cache)[:, span] = value[layer].to(cache.dtype)
            ret[start:end] = True
        got = int(ret.sum())
        self.retrieved[req] = self.retrieved.get(req, 0) + got
        if got < len(tokens) - skip:
            self.failed.add(req)
        return ret

    def retrieve_layer(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the rig runs LMCache without use_layerwise")

    store_layer = retrieve_layer

    def lookup_unpin(self, *args: Any, **kwargs: Any) -> None:
        pass  # nothing is pinned: the store never evicts

    def get_kv_events(self) -> list[Any]:
        events, self.kv_events = self.kv_events or [], [] if self.kv_events is not None else None
        return events

    def close(self) -> None:
        pass

    # -- lookup client -----------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], lookup_id: str, **kwargs: Any) -> int:
        hit = 0
        for _, end, key in self._chunks(token_ids):
            if key not in self.chunks:
                break
            hit = end
            self._last_hit[lookup_id] = key
        self.lookups[lookup_id] = hit
        return hit

    def lookup_cache(self, lookup_id: str) -> int | None:
        return self.lookups.get(lookup_id, self.no_lookup_result)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.lookups.pop(lookup_id, None)

    def cancel_lookup(self, lookup_id: str) -> None:
        self.lookups.pop(lookup_id, None)

    def take_step(self) -> tuple[dict[str, int], dict[str, int], set[str]]:
        out = (self.retrieved, self.stored, self.failed)
        self.retrieved, self.stored, self.failed = {}, {}, set()
        return out


def _no_lookup_result() -> int | None:
    """What this LMCache version's lookup client answers for a lookup id it holds nothing
    for: asked of its own class, so the stand-in cannot drift from it."""
    module = importlib.import_module("lmcache.v1.lookup_client.lmcache_lookup_client")
    ask = getattr(module.LMCacheLookupClient, "lookup_cache", None)
    if ask is None:  # 0.3.9: the adapter never asks (no lookup cache before PR #2007)
        return None
    result: int | None = ask(SimpleNamespace(reqs_status={}), "absent")
    return result


class _FakeManager:
    """``LMCacheManager`` (0.4.x on): owns the engine and the lookup client."""

    def __init__(self, store: PrefixStore, role: str) -> None:
        self.lmcache_engine = store if role == "worker" else None
        self.lookup_client = store if role == "scheduler" else None
        self.lmcache_engine_metadata = None
        self.lookup_server = None

    def start_services(self) -> None:
        pass

    def stop_services(self) -> None:
        pass

    def post_init(self, *args: Any, **kwargs: Any) -> None:
        pass

    def build_kv_layer_groups(self, *args: Any, **kwargs: Any) -> None:
        pass


def _role_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    role = kwargs.get("role")
    for value in (role, *args, *kwargs.values()):
        if isinstance(value, str) and value in ("scheduler", "worker"):
            return value
        name = getattr(value, "role", None)
        if isinstance(name, str) and name in ("scheduler", "worker"):
            return name
    raise RuntimeError(f"cannot tell the role from LMCacheManager{args}{kwargs}")


@contextlib.contextmanager
def patched_lmcache(store: PrefixStore, events_shim: bool = True) -> Iterator[Any]:
    """Replace, in LMCache's adapter module, what needs a GPU or a server; yield the module."""
    import torch

    adapter = importlib.import_module("lmcache.integration.vllm.vllm_v1_adapter")
    # LMCache's configuration is a process-wide singleton that the extra config's "lmcache.*"
    # keys update in place: forget it, so each run starts from LMCache's defaults (a key set
    # by an earlier run in this process must not leak into the next).
    utils: Any = importlib.import_module("lmcache.integration.vllm.utils")
    utils._config_instance = None
    factory = SimpleNamespace(
        create_lookup_client=lambda *a, **k: store,
        create_lookup_server=lambda *a, **k: None,
    )
    patches: dict[str, Any] = {
        "_init_lmcache_engine": lambda *a, **k: store,
        "LookupClientFactory": factory,
        "ZMQOffloadServer": lambda *a, **k: SimpleNamespace(close=lambda: None),
        "get_pp_group": lambda: SimpleNamespace(is_last_rank=True, is_first_rank=True),
        "get_tensor_model_parallel_rank": lambda: 0,
        "LMCacheManager": lambda *a, **k: _FakeManager(store, _role_name(a, k)),
        "VllmServiceFactory": lambda config, vllm_config, role, *a, **k: SimpleNamespace(role=role),
    }
    saved = {name: getattr(adapter, name) for name in patches if hasattr(adapter, name)}
    for name in saved:
        setattr(adapter, name, patches[name])
    # vLLM 0.33's wrapper asks the worker for KV events every step; 0.3.x's impl has no
    # get_kv_events (a real 0.33 worker would raise AttributeError): it reports none here.
    impl = adapter.LMCacheConnectorV1Impl
    no_events = events_shim and not hasattr(impl, "get_kv_events")
    if no_events:
        impl.get_kv_events = lambda self: []
    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield adapter
    finally:
        torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]
        if no_events:
            del impl.get_kv_events
        for name, value in saved.items():
            setattr(adapter, name, value)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LMCacheReport:
    """What a run did, step by step where it matters (JSON-able)."""

    version: str
    workload: str
    steps: int = 0
    preemptions: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    resumptions: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # (step, req, local computed tokens, the connector's answer, the request's tokens)
    lookups: list[tuple[int, str, int, int | None, int]] = dataclasses.field(default_factory=list)
    # (step, req, external tokens vLLM accepted from the connector)
    claims: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    # (step, req, tokens the engine copied in) / (step, req, tokens stored)
    loads: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    saves: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    load_errors: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    # The oracle's first mismatch per (step, request): dicts, see _mismatch.
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finished: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    log_path: str | None = None
    # LMCache's MP mode (connector/testing/lmcache_mp.py): (store number, step, who) each time
    # LMCache waited on a store's future; store numbers count the stores in the order issued.
    store_waits: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.mismatches and self.error is None

    def first_mismatch(self) -> dict[str, Any] | None:
        return self.mismatches[0] if self.mismatches else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LMCacheReport:
        data = json.loads(text)
        for name in (
            "preemptions",
            "resumptions",
            "lookups",
            "claims",
            "loads",
            "saves",
            "load_errors",
            "store_waits",
        ):
            data[name] = [tuple(x) for x in data.get(name, [])]
        return cls(**data)


class _LMCacheRunner(ModelRunner):
    """vLLM's scheduler with the configured connector, a worker-role connector built the
    same way, and the rigs' model runner; what LMCache did each step goes in the report."""

    def __init__(
        self,
        spec: LMCacheRun,
        kv_connector: Mapping[str, Any],
        report: LMCacheReport,
        store: PrefixStore,
        make_worker: Any = built_by_vllm,
    ) -> None:
        self.spec = spec
        self.report = report
        self.store = store
        self._last: dict[str, tuple[int, float, tuple[int, ...]]] = {}
        config = HarnessConfig(
            block_size=spec.block_size,
            num_gpu_blocks=spec.num_gpu_blocks,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            enable_prefix_caching=spec.enable_prefix_caching,
            async_scheduling=spec.async_scheduling,
            model_runner_v2=spec.model_runner_v2,
            kv_connector=dict(kv_connector),
            seed=spec.seed,
        )
        # 0.3.9's adapter has no register_kv_caches: it reads the caches off the
        # forward context's attention layers, one per virtual engine.
        super().__init__(config, kv_cache_list=True, make_worker=make_worker)
        self._observe_claims()

    def _observe_claims(self) -> None:
        """Note the external tokens vLLM accepts (an observer on the scheduler's
        connector)."""
        connector = self.harness.connector
        real = connector.update_state_after_alloc
        real_lookup = connector.get_num_new_matched_tokens

        def looked_up(request: Any, num_computed_tokens: int) -> Any:
            answer = real_lookup(request, num_computed_tokens)
            self.report.lookups.append(
                (
                    self.step,
                    request.request_id,
                    num_computed_tokens,
                    answer[0],
                    request.num_tokens,
                )
            )
            return answer

        def observed(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens:
                self.report.claims.append((self.step, request.request_id, num_external_tokens))
            return real(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = observed
        connector.get_num_new_matched_tokens = looked_up

    def failed_loads(self, out: Any) -> set[str]:
        return set(self.store.failed)

    def finished_step(self, out: Any, output: Any) -> set[str]:
        retrieved, stored, failed = self.store.take_step()
        self.report.loads += [(self.step, r, n) for r, n in retrieved.items()]
        self.report.saves += [(self.step, r, n) for r, n in stored.items()]
        if output.invalid_block_ids:
            self.report.load_errors.append((self.step, sorted(output.invalid_block_ids)))
        return failed

    def after_step(self, result: Any) -> None:
        """What the step did, and the oracle's findings, each once."""
        self.report.preemptions += [(self.step, r) for r in result.preempted]
        self.report.resumptions += [(self.step, r) for r in result.resumed]
        for req_id, blocks, mismatch in self.checks():
            if mismatch is None:
                self._last.pop(req_id, None)
                continue
            # The same wrong token seen again on later steps is the same finding: once.
            again = (mismatch.position, mismatch.found, blocks)
            if self._last.get(req_id) != again:
                self._last[req_id] = again
                self.report.mismatches.append(self._mismatch(mismatch, blocks))

    def _mismatch(self, m: Any, blocks: Sequence[int]) -> dict[str, Any]:
        bs = self.spec.block_size
        block = blocks[m.position // bs]
        return {
            "step": self.step,
            "req_id": m.req_id,
            "position": m.position,
            "block": block,
            "layer": m.layer,
            "kv": "KV"[m.kv],
            "expected": m.expected,
            "found": m.found,
            "wrong_tokens": m.wrong_tokens,
            "holder": self._holder(block, exclude=m.req_id),
            # The request's whole block table, and whose KV each block holds (None: its
            # own, unwritten, or nobody's).
            "blocks": list(blocks),
            "holders": [self._holder(b, exclude=m.req_id) for b in blocks],
        }

    def _holder(self, block: int, exclude: str) -> str | None:
        """Whose KV the block holds: another request whose oracle values for some
        block-sized span of its tokens are in it (first slot), or None."""
        bs = self.spec.block_size
        row = self.oracle._rows(0, 0)[block * bs]
        for req_id, tokens in self.tokens.items():
            if req_id == exclude:
                continue
            for start in range(0, len(tokens), bs):
                want = self.oracle.expected(req_id, tokens, start, start + 1, 0, 0)[0]
                if bool((row == want).all()):
                    return f"{req_id}[{start}:{start + bs}]"
        return None

    def close(self) -> None:
        """Shut both roles down (a recorder closes its log here) and note the log's
        path."""
        with contextlib.suppress(Exception):
            self.worker.shutdown()
        self.harness.close()
        self.report.log_path = getattr(self.harness.connector, "log_path", None)

    def run_spec(self) -> None:
        self.run(
            self.spec.prompts(),
            repeat_prompts=self.spec.repeat_prompts,
            max_steps=self.spec.max_steps,
            verify=False,
            after_step=self.after_step,
        )
        self.report.steps = self.step
        self.report.finished = sorted(self.harness.finished)


def run(
    spec: LMCacheRun,
    kv_connector: Mapping[str, Any] | None = None,
    *,
    version: str = "",
) -> LMCacheReport:
    """Run ``spec`` in this process (lmcache must be importable here). ``kv_connector`` is
    the ``--kv-transfer-config`` (default: LMCache's own, ``lmcache_kv_connector``)."""
    report = LMCacheReport(version=version, workload=spec.name)
    store = PrefixStore(
        spec.chunk_size,
        spec.block_size,
        _no_lookup_result(),
        spec.kv_events,
        spec.evict_before_retrieve,
    )
    with patched_lmcache(store, spec.events_shim):
        driver = None
        try:
            driver = _LMCacheRunner(spec, kv_connector or lmcache_kv_connector(spec), report, store)
            driver.run_spec()
        except Exception as exc:  # the engine would have died here: report where
            step = driver.step if driver is not None else -1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            report.error = (
                f"step {step}: {type(exc).__name__}: {exc} "
                f"({Path(where.filename).name}:{where.lineno})"
            )
        finally:
            if driver is not None:
                driver.close()
    return report


def run_version(
    version: str,
    workloads: Sequence[str | LMCacheRun],
    *,
    record_to: str | None = None,
    digests: str = "sampled",
    steady_decode: bool = True,
    timeout: float = 1200,
    bare: bool = True,
) -> dict[str, LMCacheReport]:
    """Run workloads against one installed LMCache version, one after the other in one child
    process (its start, importing vLLM and LMCache, is most of the time). Reports by workload
    name; with ``record_to``, each workload runs a second time wrapped in ``KVLedgerRecorder``
    (logs in that directory, ``digests`` on the worker, ``steady_decode`` the recorder's),
    reported as ``NAME+recorded`` (``bare=False``: only that run)."""
    jobs = [
        job
        for workload in workloads
        for job in adapter_jobs(workload, record_to, digests, steady_decode, bare)
    ]
    return run_jobs(version, jobs, module="kvledger.connector.testing.lmcache", timeout=timeout)


def adapter_jobs(
    workload: str | LMCacheRun,
    record_to: str | None,
    digests: str,
    steady_decode: bool,
    bare: bool,
) -> list[dict[str, Any]]:
    """The child's jobs for one workload of the adapter rig: bare, recorded, or both."""
    spec = {**WORKLOADS, **EVENT_WORKLOADS}[workload] if isinstance(workload, str) else workload
    fields = dataclasses.asdict(spec)
    jobs: list[dict[str, Any]] = []
    if bare or record_to is None:
        jobs.append({"label": spec.name, "spec": fields, "kv_connector": None})
    if record_to is not None:
        kv = recorded_kv_connector(spec, record_to, digests, steady_decode)
        jobs.append({"label": f"{spec.name}+recorded", "spec": fields, "kv_connector": kv})
    return jobs


def run_jobs(
    version: str,
    jobs: Sequence[Mapping[str, Any]],
    *,
    module: str,
    paths: Sequence[Path] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 1200,
) -> dict[str, LMCacheReport]:
    """Run ``jobs`` in a child ``python -m module`` with that LMCache version (and ``paths``)
    on ``PYTHONPATH``, ``env`` added; one marked report line per job."""
    if not installed(version):
        raise FileNotFoundError(f"LMCache {version} is not installed under {BUILD} (make lmcache)")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    child_paths = [str(version_path(version)), str(DEPS), *map(str, paths), str(_ROOT)]
    child_env["PYTHONPATH"] = os.pathsep.join(child_paths)
    child_env["LMCACHE_LOG_LEVEL"] = "WARNING"
    child_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps({"version": version, "jobs": list(jobs)}),
        capture_output=True,
        text=True,
        env=child_env,
        cwd=str(_ROOT),
        timeout=timeout,
        check=False,
    )
    reports = [
        LMCacheReport.from_json(line[len(_MARK) :])
        for line in proc.stdout.splitlines()
        if line.startswith(_MARK)
    ]
    if proc.returncode != 0 or len(reports) != len(jobs):
        raise RuntimeError(
            f"LMCache {version} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return {r.workload: r for r in reports}


_MARK = "kvledger-lmcache-report "


def run_job(job: Mapping[str, Any], version: str) -> LMCacheReport:
    """One job of ``adapter_jobs``, in this (child) process."""
    fields = dict(job["spec"])
    fields["lmcache"] = dict(fields.get("lmcache") or {})
    report = run(LMCacheRun(**fields), job["kv_connector"], version=version)
    report.workload = job["label"]
    return report


def write_report(report: LMCacheReport) -> None:
    """The child's marked report line."""
    sys.stdout.write("\n" + _MARK + report.to_json() + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Child process: a JSON request on stdin, one marked report line per run on stdout."""
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    request = json.loads(sys.stdin.read())
    for job in request["jobs"]:
        write_report(run_job(job, request["version"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
