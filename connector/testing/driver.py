"""The rigs' model runner: one engine step of vLLM 0.33's worker, as its GPU model runner drives
a KV connector, for any connector object (KVLedgerConnector, the recorder around any inner,
LMCache's adapter, ExampleConnector), over the KV-content oracle's paged caches.

vLLM's scheduler (``SchedulerHarness``) calls ``ModelRunner.execute_model`` with each
``SchedulerOutput``; it runs the worker-role connector in the order of vLLM 0.33's
``GPUModelRunner.execute_model`` with ``KVConnectorModelRunnerMixin._get_kv_connector_output``
(Model Runner V2's ``ActiveKVConnector`` keeps the same order)::

    handle_preemptions -> bind_connector_metadata
    start_load_kv                       before the forward when the step has a synchronous load
    the forward, layer by layer:        wait_for_layer_load -> the layer's KV -> save_kv_layer
    start_load_kv                       after the forward otherwise (an asynchronous load)
    wait_for_save
    get_transfer_results (get_finished before 0.33) -> get_block_ids_with_load_errors
    get_kv_connector_stats -> get_kv_connector_kv_cache_events -> build_connector_worker_meta
    clear_connector_metadata

- A step that schedules no token has no forward (``kv_connector_no_forward``): no attention
  metadata in the forward context, no layer calls.
- With a drafter (speculative decoding, ``drafter_layers``: the last layers stand for the draft
  model's) vLLM defers ``wait_for_save`` and the clear past the draft forward
  (``defer_finalize``): the connector output is built after the target's layers, then the
  drafter writes its layers, then ``wait_for_save`` -> ``clear_connector_metadata``.
- Only what this vLLM's ``KVConnectorOutput`` has a field for is asked of the connector (stats,
  events, worker metadata, load errors: each from the release that added it), and a release
  without ``has_sync_kv_loads`` starts every load before the forward, as its runner did: the
  version matrix's older releases get their own order.
- Async scheduling's one-step lag is the harness's (step N's output is applied after step N+1
  was scheduled); the tokens a step computes ahead of it are the fake sampler's, known in
  advance (``tokens_of``).

The forward pass is the oracle's: each layer gets every scheduled token's oracle value, negated
for a request whose forward runs over a prefix that failed to load (``failed_loads``, a rig's
hook: only the rig knows its connector's failures before vLLM hears of them). After each step
``verify`` checks every computed token of every running request, except those vLLM recomputes:
a forward over a failed load, a block reported in ``invalid_block_ids``, or what the rig's
``finished_step`` hook adds.

Used by run.py (KVLedgerConnector, fault injection), recorded.py (any connector, recorded or
not; zoo.py) and lmcache.py (LMCache's adapter).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvledger.connector.testing.harness import (
    HarnessConfig,
    RequestView,
    SchedulerHarness,
    StepResult,
    fake_token,
    make_kv_connector_output,
)

if TYPE_CHECKING:
    from kvledger.connector.testing.oracle import KVOracle, Mismatch, TokenMismatch

__all__ = ["ModelRunner", "Request", "built_by_vllm", "engine_config"]

# One request of a workload: (request id, prompt token ids, max_tokens).
Request = tuple[str, Sequence[int], int]


def engine_config(spec: HarnessConfig, kv_connector: Mapping[str, Any]) -> HarnessConfig:
    """The engine part of a rig's spec (a ``HarnessConfig`` subclass), loading ``kv_connector``
    (the ``--kv-transfer-config``)."""
    engine = {f.name: getattr(spec, f.name) for f in dataclasses.fields(HarnessConfig)}
    return HarnessConfig(**{**engine, "kv_connector": dict(kv_connector)})


@functools.cache
def _asked() -> frozenset[str]:
    """What this vLLM's model runner asks a connector after the forward: the fields of its
    KVConnectorOutput (each filled by one call), and ``get_transfer_results`` where its base
    class has it (0.33; before, ``get_finished``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.outputs import KVConnectorOutput

    asked = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    if hasattr(KVConnectorBase_V1, "get_transfer_results"):
        asked.add("get_transfer_results")
    return frozenset(asked)


def built_by_vllm(harness: SchedulerHarness) -> Any:
    """The worker-role connector of the harness's ``kv_transfer_config``, built as this vLLM
    builds one: its factory's class, with the arguments its base class takes."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvledger.connector.edge import build_connector

    config = harness.vllm_config
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    return build_connector(cls, config, KVConnectorRole.WORKER, harness.kv_cache_config)


class ModelRunner:
    """vLLM's scheduler (``harness``), a worker-role connector (``worker``) over the oracle's
    caches (``oracle``), and the model runner between them; see the module docstring.

    ``layout`` is the oracle's cache layout: under ``"flashinfer"`` an attention layer hands
    the connector the per-layer ``[blocks, 2, block_size, heads * head]`` view (recent vLLM's
    standardised ``[B, H, N, C]``, what ExampleConnector reads), else the raw tensor.
    ``kv_cache_list``: a layer's ``kv_cache`` is a list, one tensor per virtual engine, as
    vLLM held it when LMCache 0.3.9 was written (its adapter reads the caches there).
    ``make_worker`` builds the worker role (default: as vLLM does, ``built_by_vllm``).
    ``compute`` False: the forward makes the same connector calls but writes no KV, and
    ``verify`` checks nothing (a bench timing vLLM's scheduler, not the oracle's writes).
    """

    def __init__(
        self,
        config: HarnessConfig,
        *,
        layout: str = "flash_attn",
        make_worker: Callable[[SchedulerHarness], Any] = built_by_vllm,
        drafter_layers: int = 0,
        kv_cache_list: bool = False,
        compute: bool = True,
    ) -> None:
        from kvledger.connector.testing.oracle import KVOracle  # torch: imported when a rig runs

        if config.kv_connector is None:
            raise ValueError("ModelRunner drives a connector: HarnessConfig.kv_connector is None")
        if drafter_layers < 0:
            raise ValueError(f"drafter_layers={drafter_layers}: a count of layers, 0 or more")
        self.harness = SchedulerHarness(config, on_scheduled=self.execute_model)
        names = self.harness.layer_names
        if drafter_layers >= len(names):
            self.harness.close()
            raise ValueError(
                f"drafter_layers={drafter_layers}: the target model needs a layer of the "
                f"{len(names)} the engine has"
            )
        self.drafter_layers = drafter_layers
        self.compute = compute
        group = self.harness.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.oracle: KVOracle = KVOracle(
            names,
            num_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            num_kv_heads=int(group.num_kv_heads),
            head_size=int(group.head_size),
            layout=layout,
        )
        self.worker: Any = make_worker(self.harness)
        self.worker.register_kv_caches(self.oracle.caches)
        caches = self.oracle.caches
        self.views = (
            {name: c.view(c.shape[0], c.shape[1], c.shape[2], -1) for name, c in caches.items()}
            if layout == "flashinfer"
            else dict(caches)
        )
        self.attention_layers = {
            name: SimpleNamespace(kv_cache=[view] if kv_cache_list else view)
            for name, view in self.views.items()
        }
        self.attn_metadata = {name: SimpleNamespace(layer=name) for name in names}
        self.tokens: dict[str, list[int]] = {}
        # The step running: the one execute_model sees, and after_step's.
        self.step = 0
        self.load_errors = 0  # block ids reported in invalid_block_ids, all steps
        self.skip_verify: set[str] = set()
        self.mismatches: list[tuple[int, Mismatch | TokenMismatch]] = []

    # -- the rig's hooks ------------------------------------------------------------------------

    def failed_loads(self, out: Any) -> set[str]:
        """The requests whose forward this step runs over a prefix that failed to load, known
        after the synchronous loads, before the forward (their KV is written poisoned)."""
        return set()

    def finished_step(self, out: Any, output: Any) -> set[str]:
        """After the step's connector output (``output``): more requests not to verify."""
        return set()

    # -- one step -------------------------------------------------------------------------------

    def tokens_of(self, req_id: str, upto: int) -> list[int]:
        """The request's token ids up to ``upto``: its prompt, then the fake sampler's."""
        tokens = self.tokens.setdefault(req_id, list(self.harness.prompts[req_id]))
        cfg = self.harness.config
        while len(tokens) < upto:
            tokens.append(fake_token(req_id, len(tokens), cfg.seed, cfg.vocab_size))
        return tokens

    def blocks_of(self, req_id: str) -> tuple[int, ...]:
        return self.harness.request_view(req_id).block_ids[0]

    def holders(self, out: Any, blocks: set[int]) -> set[str]:
        """The requests scheduled in ``out`` whose block table holds one of ``blocks``: a
        block vLLM's prefix cache shares runs every holder's forward over what it holds."""
        if not blocks:
            return set()
        return {r for r in out.num_scheduled_tokens if blocks & set(self.blocks_of(r))}

    def execute_model(self, out: Any) -> Any:
        """One step of the worker for ``out`` (a SchedulerOutput): the KVConnectorOutput."""
        worker = self.worker
        meta = out.kv_connector_metadata
        forward = out.total_num_scheduled_tokens > 0
        context = SimpleNamespace(
            attn_metadata=self.attn_metadata if forward else None,
            no_compile_layers=self.attention_layers,
            virtual_engine=0,
        )
        # vLLM >= 0.14 calls it (before, a connector of that vLLM has none).
        handle_preemptions = getattr(worker, "handle_preemptions", None)
        if handle_preemptions is not None:
            handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        sync = bool(getattr(out, "has_sync_kv_loads", True))
        if sync:
            worker.start_load_kv(context)
        poisoned = self.failed_loads(out)
        computed = {new.req_id: int(new.num_computed_tokens) for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = int(cached.num_computed_tokens[i])
        writes = [
            (req_id, computed[req_id], computed[req_id] + n)
            for req_id, n in out.num_scheduled_tokens.items()
        ]
        target = len(self.views) - self.drafter_layers
        defer = forward and self.drafter_layers > 0
        if forward:
            self._forward(writes, poisoned, range(target))
        if not sync:
            worker.start_load_kv(context)
        if not defer:
            worker.wait_for_save()
        output, errors = self._connector_output(out)
        if defer:  # the draft model's forward, then finalize_kv_connector
            self._forward(writes, poisoned, range(target, len(self.views)))
            worker.wait_for_save()
        worker.clear_connector_metadata()
        self.load_errors += len(errors)
        holders = self.holders(out, errors)
        self.skip_verify = poisoned | holders | self.finished_step(out, output)
        return output

    def _forward(
        self, writes: Sequence[tuple[str, int, int]], poisoned: set[str], layers: range
    ) -> None:
        """Attention layers ``layers`` of the model: each waits for its load, computes its KV
        of every scheduled token (the oracle's values), and is saved."""
        names = list(self.views)
        spans = [
            (r, self.tokens_of(r, end), self.blocks_of(r), start, end)
            for r, start, end in (writes if self.compute else ())
        ]
        for layer in layers:
            name = names[layer]
            self.worker.wait_for_layer_load(name)
            for req_id, tokens, blocks, start, end in spans:
                bad = req_id in poisoned
                self.oracle.write(req_id, tokens, blocks, start, end, poisoned=bad, layers=[layer])
            self.worker.save_kv_layer(name, self.views[name], self.attn_metadata[name])

    def _connector_output(self, out: Any) -> tuple[Any, set[int]]:
        """What the runner asks the connector after the forward, in vLLM's order: the
        KVConnectorOutput, and the blocks whose load failed."""
        worker = self.worker
        asked = _asked()
        extra: dict[str, Any] = {}
        finished = set(out.finished_req_ids)
        if "get_transfer_results" in asked:
            results = worker.get_transfer_results(finished)
            sending, recving = results.finished_sending, results.finished_recving
            if "failed_recving" in asked:
                extra["failed_recving"] = set(results.failed_recving or ())
        else:
            sending, recving = worker.get_finished(finished)
        errors: set[int] = set()
        if "invalid_block_ids" in asked:  # vLLM >= 0.11.1 hears of failed loads
            errors = set(worker.get_block_ids_with_load_errors() or ())
        if "kv_connector_stats" in asked:
            extra["kv_connector_stats"] = worker.get_kv_connector_stats()
        if "kv_cache_events" in asked:
            extra["kv_cache_events"] = worker.get_kv_connector_kv_cache_events()
        if "kv_connector_worker_meta" in asked:
            extra["kv_connector_worker_meta"] = worker.build_connector_worker_meta()
        output = make_kv_connector_output(sending or (), recving or (), errors, **extra)
        return output, errors

    # -- checks and runs ------------------------------------------------------------------------

    def checks(
        self, views: Mapping[str, RequestView] | None = None
    ) -> Iterator[tuple[str, tuple[int, ...], Mismatch | None]]:
        """Per running request vLLM does not recompute: (id, block table, first wrong token or
        None); none where the runner does not ``compute``. ``views``: the running requests'
        (``SchedulerHarness.running_views``), when the caller took them already."""
        if not self.compute:
            return
        for req_id, view in (self.harness.running_views() if views is None else views).items():
            if req_id in self.skip_verify or not view.block_ids:
                continue
            upto = view.num_computed_tokens
            blocks = view.block_ids[0]
            yield (
                req_id,
                blocks,
                self.oracle.verify(req_id, self.tokens_of(req_id, upto), blocks, upto),
            )

    def token_checks(self, views: Mapping[str, RequestView]) -> Iterator[TokenMismatch]:
        """Each running request whose token ids in vLLM are not the model's (``tokens_of``):
        the first position where they differ. The KV check cannot see this: the oracle's
        values follow the model's tokens, and vLLM keys everything by its own. Every request
        is compared, a recomputed one too (a wrong id is wrong whatever its KV). Under async
        scheduling vLLM knows fewer ids than it computed; the ids it knows are compared."""
        from kvledger.connector.testing.oracle import TokenMismatch  # torch, as the oracle

        for req_id, view in views.items() if self.compute else ():
            known = view.all_token_ids
            model = self.tokens_of(req_id, len(known))
            if list(known) != model[: len(known)]:
                at = next(i for i, (a, b) in enumerate(zip(known, model, strict=False)) if a != b)
                yield TokenMismatch(req_id, at, model[at], known[at])

    def verify(self) -> list[Mismatch | TokenMismatch]:
        """Each running request's first wrong token id, then its first wrong KV, after a
        step."""
        views = self.harness.running_views() if self.compute else {}
        found: list[Mismatch | TokenMismatch] = list(self.token_checks(views))
        found += [m for _, _, m in self.checks(views) if m is not None]
        return found

    def forget(self, req_id: str) -> None:
        """A request id that comes back is a new request: its old tokens and values go."""
        self.tokens.pop(req_id, None)
        self.oracle.forget(req_id)

    def run(
        self,
        requests: Sequence[Request],
        *,
        repeat_prompts: int = 0,
        max_steps: int,
        verify: bool = True,
        after_step: Callable[[StepResult], None] | None = None,
    ) -> int:
        """Add ``requests``, step until vLLM has nothing left to do, then send the prompts of
        the first ``repeat_prompts`` again (``again-<id>``, 4 tokens each: full prompt hits)
        and step on; ``max_steps`` steps at most. After each step the oracle's check
        (``verify``: into ``mismatches``), then ``after_step``. Returns the steps run."""
        harness = self.harness
        again = [(f"again-{rid}", prompt, 4) for rid, prompt, _ in requests[:repeat_prompts]]
        for rid, prompt, max_tokens in requests:
            harness.add_request(rid, prompt, max_tokens)
        while self.step < max_steps:
            result = harness.step()
            if result is None:
                if again:
                    for rid, prompt, max_tokens in again:
                        harness.add_request(rid, prompt, max_tokens)
                    again = []
                    continue
                break
            if verify:
                self.mismatches += [(self.step, m) for m in self.verify()]
            if after_step is not None:
                after_step(result)
            self.step += 1
        return self.step

    def leaks(self, *more: str) -> list[str]:
        """What a finished run left behind: GPU blocks not free, ``more`` (the rig's), and
        requests not done."""
        harness = self.harness
        out: list[str] = []
        usable = harness.config.num_gpu_blocks - 1  # block 0 is vLLM's null block
        if harness.num_free_blocks != usable:
            out.append(f"gpu blocks: {harness.num_free_blocks} free of {usable}")
        out += more
        if not harness.is_done():
            out.append(f"not done after {self.step} steps: {harness.describe()}")
        return out
