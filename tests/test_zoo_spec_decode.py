"""Why the zoo has no row for vLLM #55503 (docs/bug-zoo.md, "Round two"): OffloadingConnector's
``assert len(offload_keys) == len(offload_block_ids)`` in ``_build_store_jobs`` reported with
MTP speculative decoding (vLLM 0.26, open).

vLLM 0.33's real scheduler runs here with an EAGLE-family ``speculative_config`` (a draft model
that is a ``config.json`` only: the scheduler never runs it), its real OffloadingConnector (the
rig's copies, decode chunks stored too), and the rig's model runner with a drafter layer. The
fake sampler accepts a deterministic number of each step's drafts and rejects the rest, as a
target model verifying them would: vLLM rolls ``num_computed_tokens`` back by the rejected
ones. Both slices of the assertion take their length from ``RequestOffloadState.
storable_chunks``, the least of the token bound, the blocks bound and the keys bound (#52923);
these tests take the last two out and count when either would have bound.

Nothing here changes what vLLM or the rig ship: every patch is undone by ``monkeypatch``.
"""

from __future__ import annotations

import collections
import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from kvledger.connector.testing.harness import skip_reason

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason())),
]

K = 3  # num_speculative_tokens


def _accepted(req_id: str, num_tokens: int) -> int:
    """How many of the drafts proposed at ``num_tokens`` are right: 0 to K, deterministic."""
    return zlib.crc32(f"accepted:{req_id}:{num_tokens}".encode()) % (K + 1)


def _speculative(monkeypatch: pytest.MonkeyPatch, draft_dir: Path) -> collections.Counter[str]:
    """Build the harness's engine with an EAGLE ``speculative_config`` and give its fake
    sampler drafts: after each output vLLM's engine core hands the scheduler the next drafts
    (``update_draft_token_ids``, synchronous scheduling), and a step's sampled tokens are the
    accepted drafts and one more. Returns the counts of drafts scheduled and rejected."""
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.v1.outputs import DraftTokenIds

    from kvledger.connector.testing import harness as H

    config = H._tiny_llama_config(1024, 1024)
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    draft_dir.mkdir(exist_ok=True)
    (draft_dir / "config.json").write_text(json.dumps(config))
    build = H._build_vllm_config

    def with_drafter(cfg: Any) -> Any:
        base = build(cfg)
        spec = SpeculativeConfig(
            method="eagle",
            model=str(draft_dir),
            num_speculative_tokens=K,
            target_model_config=base.model_config,
            target_parallel_config=base.parallel_config,
        )
        return VllmConfig(
            model_config=base.model_config,
            scheduler_config=base.scheduler_config,
            cache_config=base.cache_config,
            kv_transfer_config=base.kv_transfer_config,
            device_config=base.device_config,
            speculative_config=spec,
        )

    counts: collections.Counter[str] = collections.Counter()

    def sample(self: Any, out: Any) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            drafts = list(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if request.is_prefill_chunk:
                sampled[req_id] = []
                continue
            first = int(request.num_computed_tokens) - len(drafts)
            truth = [
                H.fake_token(req_id, first + i, self.config.seed, self.config.vocab_size)
                for i in range(len(drafts) + 1)
            ]
            j = 0
            while j < len(drafts) and drafts[j] == truth[j]:
                j += 1
            counts["drafts_scheduled"] += len(drafts)
            counts["drafts_rejected"] += len(drafts) - j
            sampled[req_id] = truth[: j + 1]
        return sampled

    apply = H.SchedulerHarness._apply

    def apply_then_draft(self: Any, pending: Any) -> tuple[str, ...]:
        finished = apply(self, pending)
        ids: list[str] = []
        drafts: list[list[int]] = []
        for request in self.scheduler.running:
            if request.is_finished() or request.is_prefill_chunk:
                continue
            rid, n = request.request_id, request.num_tokens
            seed, vocab = self.config.seed, self.config.vocab_size
            proposal = [H.fake_token(rid, n + i, seed, vocab) for i in range(K)]
            right = _accepted(rid, n)
            if right < K:  # the first wrong draft: every one after it is rejected too
                proposal[right] = H.fake_token(rid, n + right, seed + 1, vocab)
                if proposal[right] == H.fake_token(rid, n + right, seed, vocab):
                    proposal[right] = 3 + (proposal[right] - 2) % (vocab - 3)
            ids.append(rid)
            drafts.append(proposal)
        if ids:
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))
        return finished

    monkeypatch.setattr(H, "_build_vllm_config", with_drafter)
    monkeypatch.setattr(H.SchedulerHarness, "_sample", sample)
    monkeypatch.setattr(H.SchedulerHarness, "_apply", apply_then_draft)
    return counts


def _bounds_taken_out(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """``storable_chunks`` with the blocks bound and the keys bound taken out (the token bound
    and the eagle exclusion kept, vLLM 0.33's body otherwise); counts when each would bind."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )

    counts: collections.Counter[str] = collections.Counter()

    def token_bound_only(self: Any, group_config: Any, group_state: Any, tokens: int) -> int:
        num_chunks = tokens // int(group_config.tokens_per_chunk)
        is_decoding = tokens > self.req.num_prompt_tokens
        if group_config.is_eagle_group and is_decoding and not self.req.is_finished():
            num_chunks = max(0, num_chunks - 1)
        counts["calls"] += 1
        if is_decoding and num_chunks > group_state.next_stored_chunk_idx:
            counts["decode_chunks_storable"] += 1
        if num_chunks > len(group_state.block_ids) // self.config.blocks_per_chunk:
            counts["blocks_bound_binds"] += 1
        if num_chunks > len(group_state.offload_keys):
            counts["keys_bound_binds"] += 1
        return num_chunks

    monkeypatch.setattr(RequestOffloadState, "storable_chunks", token_bound_only)
    return counts


def _runner(num_gpu_blocks: int) -> Any:
    from kvledger.connector.testing.driver import ModelRunner
    from kvledger.connector.testing.harness import HarnessConfig
    from kvledger.connector.testing.offloading import offloading_extra_config

    extra = offloading_extra_config(offloaded_block_size=16, offload_prompt_only=False)
    config = HarnessConfig(
        num_gpu_blocks=num_gpu_blocks,
        kv_connector={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    return ModelRunner(config, layout="flashinfer", drafter_layers=1)


def _requests() -> list[tuple[str, list[int], int]]:
    import random

    rng = random.Random(55503)
    shapes = [(40, 60), (64, 45), (33, 70), (16, 50), (95, 30)]
    return [
        (f"r{i}", [rng.randrange(10, 1000) for _ in range(n)], m) for i, (n, m) in enumerate(shapes)
    ]


@pytest.mark.parametrize("num_gpu_blocks", [12, 40], ids=["preempting", "roomy"])
def test_vllm_55503_speculative_decoding_never_makes_a_slice_short(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, num_gpu_blocks: int
) -> None:
    """Under speculative decoding, with drafts rejected and ``num_computed_tokens`` rolled
    back (and, in a pool of 11 usable blocks, preemptions), neither the blocks bound nor the
    keys bound ever binds, and with both taken out the store path never asserts. The token
    bound (``_calc_num_offloadable_tokens``) is clamped to ``req.num_tokens``, which counts no
    draft (drafts live in ``spec_token_ids``); ``Request.block_hashes`` is extended at every
    append over the accepted tokens, so a key exists for every whole chunk of them; and
    ``allocate_slots`` reserves the drafts' and the drafter's lookahead slots, so a block
    exists for every token counted."""
    drafts = _speculative(monkeypatch, tmp_path / "eagle")
    bounds = _bounds_taken_out(monkeypatch)
    runner = _runner(num_gpu_blocks)
    harness = runner.harness
    try:
        vllm_config = harness.vllm_config
        assert vllm_config.speculative_config.use_eagle()
        assert vllm_config.num_lookahead_tokens == K
        # A KV connector keeps the legacy hashes (config/vllm.py, num_hash_lookahead_tokens).
        assert vllm_config.num_hash_lookahead_tokens == 0
        runner.run(_requests(), repeat_prompts=3, max_steps=600)
    finally:
        runner.worker.shutdown()
        harness.close()
    assert harness.is_done() and len(harness.finished) == 8
    assert not runner.mismatches
    # Drafts were scheduled and some rejected: vLLM rolled num_computed_tokens back.
    assert drafts["drafts_scheduled"] > 250 and drafts["drafts_rejected"] > 100
    assert (harness.stats.preemptions > 0) == (num_gpu_blocks == 12)
    # The store path ran over decode chunks too, and no bound but the tokens' ever bound.
    assert bounds["calls"] > 100 and bounds["decode_chunks_storable"] > 0
    assert bounds["keys_bound_binds"] == 0 and bounds["blocks_bound_binds"] == 0


def test_vllm_55503_lookahead_hashes_stop_at_the_lookup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The one way vLLM 0.33 hashes behind ``num_tokens``, the EAGLE lookahead hashes, is off
    whenever a KV connector is configured. Forced on (that exclusion taken out, the hasher
    built as EngineCore builds it), OffloadingConnector's own lookup asserts that it has a key
    for every whole chunk of ``num_tokens`` (``_lookup_complete_chunks``, under
    ``get_num_new_matched_tokens``) on the first request, before any store: the lagging keys
    never reach ``_build_store_jobs``."""
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as offloading
    from vllm.config import VllmConfig

    from kvledger.connector.testing import harness as H

    def with_connectors(self: Any) -> int:
        spec = self.speculative_config
        if (
            spec is None
            or not spec.use_eagle_block_drop()
            or spec.disable_lookahead_block_hashes
            or not self.cache_config.enable_prefix_caching
        ):
            return 0
        return int(self.num_prefill_lookahead_tokens)

    def hasher(vllm_config: Any, block_size: int) -> Any:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return get_request_block_hasher(block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)

    _speculative(monkeypatch, tmp_path / "eagle")
    bounds = _bounds_taken_out(monkeypatch)
    monkeypatch.setattr(VllmConfig, "num_hash_lookahead_tokens", property(with_connectors))
    monkeypatch.setattr(H, "_make_block_hasher", hasher)
    runner = _runner(40)
    try:
        assert runner.harness.vllm_config.num_hash_lookahead_tokens == 1
        with pytest.raises(AssertionError) as raised:
            runner.run(_requests(), max_steps=600)
    finally:
        runner.worker.shutdown()
        runner.harness.close()
    where = raised.traceback[-1]
    assert Path(str(where.path)).name == "scheduler.py"
    assert where.frame.code.name == "_lookup_complete_chunks"
    assert "get_num_new_matched_tokens" in {entry.frame.code.name for entry in raised.traceback}
    source = Path(offloading.__file__).read_text().splitlines()
    assert "len(offload_keys) >= req_status.req.num_tokens // tokens_per_chunk" in "".join(
        line.strip() for line in source[where.lineno : where.lineno + 3]
    )
    assert bounds["calls"] == 0  # no store was ever considered
