"""The transfer backend's ``cpu_attn`` layout against vLLM's CPU engine itself.

Two independent references, as issue 8 asks (a layout that was wrong inside a block passed
every whole-block copy and failed only on partial reloads):

- vLLM's own kernel, ``cpu_attn_reshape_and_cache`` (what the attention layer calls to write
  K and V): tokens it wrote, at whole and partial blocks, are what the backend saves, and the
  backend's load writes the bytes the kernel wrote;
- the same model's K and V from transformers: after a real forward pass on the engine, the
  chunks the connector saved to its host pool (a whole one and a partial one) hold, token by
  token, the K (after rotary embedding) and V that transformers computes for those tokens.

The host pool keeps this layout's chunks as the cache's own blocks (its pool format,
``cpu_attn-<kernel>-block<N>``); ``slot_tokens`` reads them token by token.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.connector.testing.engine import EngineSpec

BS, HEADS, HEAD = 32, 2, 64


def _kernel_caches(isa: str, dtype: torch.dtype, mapping: torch.Tensor, seed: int):
    """Two layers of zeroed caches into which vLLM's kernel wrote random K and V of
    ``len(mapping)`` tokens at ``mapping``; and those K and V, ``[layers, tokens, H, D]``."""
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    caches, keys, values = {}, [], []
    for layer in range(2):
        cache = torch.zeros(6, HEADS, BS, 2 * HEAD, dtype=dtype)
        # As vLLM's CPU attention does: [blocks, heads, 2 * block_size, head] split in two.
        key_cache, value_cache = cache.view(6, HEADS, 2 * BS, HEAD).chunk(2, dim=2)
        k = torch.randn(len(mapping), HEADS, HEAD, generator=gen).to(dtype)
        v = torch.randn(len(mapping), HEADS, HEAD, generator=gen).to(dtype)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, mapping, isa)
        caches[f"model.layers.{layer}.self_attn.attn"] = cache
        keys.append(k)
        values.append(v)
    return caches, torch.stack(keys), torch.stack(values)


ISAS = [
    pytest.param("vec", torch.float32, id="vec-fp32"),
    pytest.param(
        "amx",
        torch.bfloat16,
        id="amx-bf16",
        marks=pytest.mark.skipif(
            not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles"
        ),
    ),
]


@pytest.mark.parametrize("isa, dtype", ISAS)
def test_backend_reads_and_writes_what_vllms_kernel_writes(isa: str, dtype: torch.dtype) -> None:
    from kvledger.connector.kv_layout import cpu_attn_isa, slot_mapping_for, slot_tokens
    from kvledger.connector.transfer import TransferBackend

    assert cpu_attn_isa(dtype, BS, HEAD) == isa
    # 45 tokens: block 3 whole, then the first 13 tokens of block 1 (a partial block).
    mapping = torch.tensor(slot_mapping_for([3, 1], BS, 0, 45))
    caches, keys, values = _kernel_caches(isa, dtype, mapping, seed=1)
    backend = TransferBackend(caches, chunk_tokens=64)
    assert backend.spec.layout == "cpu_attn" and backend.spec.cpu_isa == isa
    assert backend.spec.pool_format == f"cpu_attn-{isa}-block{BS}"
    slot = torch.zeros(backend.chunk_shape, dtype=dtype)
    backend.save(slot, mapping).synchronize()
    # The slot holds the blocks as the kernel wrote them: block 3 whole, then block 1's.
    for layer, cache in enumerate(caches.values()):
        assert torch.equal(slot[layer, 0], cache[3])
    # Read token by token, [layers, K/V, tokens, H * D]: exactly the kernel's input.
    rows = slot_tokens(backend.spec, slot)
    assert torch.equal(rows[:, 0, :45], keys.flatten(2))
    assert torch.equal(rows[:, 1, :45], values.flatten(2))
    assert not rows[:, :, 45:].any()
    # A load starting inside a block (tokens 7-44 of the chunk, into block 1 from token 7 on,
    # then block 2): the bytes land where the kernel would have written them.
    fresh = {name: torch.zeros_like(c) for name, c in caches.items()}
    target = torch.tensor(slot_mapping_for([0, 1, 2], BS, 39, 77))
    TransferBackend(fresh, chunk_tokens=64).load(slot, target, 7).synchronize()
    import vllm._custom_ops as ops

    for layer, (name, cache) in enumerate(fresh.items()):
        written = torch.zeros_like(cache)
        key_cache, value_cache = written.view(6, HEADS, 2 * BS, HEAD).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys[layer, 7:45], values[layer, 7:45], key_cache, value_cache, target, isa
        )
        assert torch.equal(cache, written), name


def test_saved_chunks_hold_transformers_k_and_v(tiny_model: str) -> None:
    """A 50-token prompt through the engine: its whole chunk (tokens 0-31) and its partial
    chunk (32-49) in the host pool are transformers' K and V for those tokens."""
    from transformers import AutoModelForCausalLM

    from kvledger.connector.kv_layout import slot_tokens
    from kvledger.connector.testing.engine import Engine
    from kvledger.connector.vllm import _attention_isa

    from .conftest import prompts

    prompt = prompts(tiny_model, 50, [50])[0]
    spec = EngineSpec(
        model=tiny_model,
        num_blocks=5,
        extra_config={"chunk_size": BS, "discard_partial_chunks": False},
    )
    with Engine(spec) as engine:
        run = engine.generate([prompt], 1)
        assert run.worker["chunks_saved"] == 2, run.worker
        worker = engine.worker_connector()
        pool = worker.worker_side.pool
        # The pool format of the kernel vLLM set on its attention layers, which the
        # scheduler's chunk keys name in their salt.
        isa = _attention_isa(worker._vllm_config, pool.spec.layer_names)
        assert isa == pool.spec.cpu_isa is not None
        fmt = pool.spec.pool_format
        assert fmt == f"cpu_attn-{pool.spec.cpu_isa}-block{BS}"
        salt = engine.scheduler_connector().scheduler_side.tracker_config.salt
        assert salt.endswith(f"|pool={fmt}"), salt
        slots = [slot_tokens(pool.spec, pool.slot(i)).clone() for i in range(pool.num_slots)]

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    layers = len(cache.layers)
    # [layers, K/V, tokens, H * D], as the pool keeps a chunk.
    k = torch.stack([cache.layers[i].keys[0] for i in range(layers)])  # [L, H, T, D]
    v = torch.stack([cache.layers[i].values[0] for i in range(layers)])
    ref = torch.stack([k, v], dim=1).transpose(2, 3).flatten(-2)  # [L, 2, T, H * D]

    def held(start: int, end: int) -> bool:
        want = ref[:, :, start:end]
        return any(
            torch.allclose(s[:, :, : end - start], want, rtol=1e-4, atol=1e-4) for s in slots
        )

    assert held(0, 32), "no pool slot holds transformers' K/V of tokens 0-31"
    assert held(32, 50), "no pool slot holds transformers' K/V of tokens 32-49 (partial chunk)"
    # The comparison can fail: the chunk one token off is in no slot.
    assert not held(1, 33)
