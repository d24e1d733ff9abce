"""The KV-content oracle: correctness without a model.

A fake forward pass writes, for every computed token, a value derived from (the prefix of
token ids up to it, its position, the layer, K or V) into its slot of the paged cache. After
every step, every computed token of every running request must hold exactly its oracle value.
Stale blocks after a preemption, an off-by-one load, a chunk stored under the wrong key, a
save of KV computed over a prefix that failed to load: each shows up as a wrong value at a
known position, layer and K/V.

Values are small integers plus a per-element fraction, exact in float32 (24-bit mantissa): a
prefix hash folded to 15 bits, and ``element / 256`` over at most 256 elements per token row.
A token written over a wrong prefix gets the value of its true position negated, so KV that
was "computed" on garbage can never pass for the real thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["KVOracle", "Mismatch", "TokenMismatch"]

_MASK = (1 << 61) - 1
_MUL = 1_000_003


@attrs.frozen
class Mismatch:
    """The first wrong token of a request, with what was expected and found."""

    req_id: str
    position: int
    layer: int
    kv: int
    expected: float
    found: float
    wrong_tokens: int

    def describe(self) -> str:
        return (
            f"{self.req_id}: token {self.position} layer {self.layer} {'KV'[self.kv]} holds "
            f"{self.found} instead of {self.expected} ({self.wrong_tokens} wrong tokens)"
        )


@attrs.frozen
class TokenMismatch:
    """vLLM holds another token id at ``position`` than the model computed there: the KV in
    the caches is the model's, and everything vLLM keys by its token ids (prefix-cache
    hashes, a connector's chunk keys, the text served) names other tokens than that KV.
    The oracle's values follow the model's tokens, so only this comparison sees it."""

    req_id: str
    position: int
    expected: int  # the model's token
    found: int  # vLLM's

    def describe(self) -> str:
        return (
            f"{self.req_id}: vLLM's token {self.position} is {self.found}, the model's "
            f"{self.expected}"
        )


class KVOracle:
    """Owns per-layer paged caches in vLLM's FlashAttention layout and knows what every
    computed token's KV must be."""

    def __init__(
        self,
        layer_names: Sequence[str],
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int = 2,
        head_size: int = 8,
        dtype: torch.dtype = torch.float32,
        layout: str = "flash_attn",
    ) -> None:
        if num_kv_heads * head_size > 256:
            raise ValueError("the oracle's exact encoding needs num_kv_heads * head_size <= 256")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = layout
        self.row = num_kv_heads * head_size
        shape = (
            (2, num_blocks, block_size, num_kv_heads, head_size)
            if layout == "flash_attn"
            else (num_blocks, 2, block_size, num_kv_heads, head_size)
        )
        # NaN marks "never written": it equals nothing, so an unwritten token always fails.
        self.caches: dict[str, torch.Tensor] = {
            name: torch.full(shape, float("nan"), dtype=dtype) for name in layer_names
        }
        self._layers = list(self.caches.values())
        self._fraction = torch.arange(self.row, dtype=torch.float64) / 256.0
        self._hashes: dict[str, list[int]] = {}

    # --- values ---------------------------------------------------------------------------

    def _prefix_hashes(self, req_id: str, tokens: Sequence[int], upto: int) -> list[int]:
        """Rolling hash of ``tokens[:p+1]`` for every p < upto (cached per request; token
        lists only grow, so the cache stays valid)."""
        hashes = self._hashes.setdefault(req_id, [])
        h = hashes[-1] if hashes else 7
        for p in range(len(hashes), upto):
            h = (h * _MUL + tokens[p] + 1) & _MASK
            hashes.append(h)
        return hashes

    def expected(
        self, req_id: str, tokens: Sequence[int], start: int, end: int, layer: int, kv: int
    ) -> torch.Tensor:
        hashes = self._prefix_hashes(req_id, tokens, end)[start:end]
        salt = layer * 7919 + kv * 104729
        base = torch.tensor(
            [((h ^ salt) * 2654435761) % 32749 + 1 for h in hashes], dtype=torch.float64
        )
        return (base[:, None] + self._fraction[None, :]).to(self._layers[0].dtype)

    def _rows(self, layer: int, kv: int) -> torch.Tensor:
        cache = self._layers[layer]
        if self.layout == "flash_attn":
            return cache[kv].view(self.num_blocks * self.block_size, self.row)
        return cache[:, kv].reshape(self.num_blocks * self.block_size, self.row)

    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [block_ids[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long
        )

    # --- the fake forward pass ------------------------------------------------------------

    def write(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        start: int,
        end: int,
        *,
        poisoned: bool = False,
        layers: Sequence[int] | None = None,
    ) -> None:
        """The forward pass computed tokens ``[start, end)``; ``poisoned`` when it did so over
        a prefix that is not in the cache (a failed load). ``layers``: only these layers (by
        index; default all), as when a draft model writes its own layers after the target."""
        if end <= start:
            return
        slots = self._slots(block_ids, start, end)
        for layer in range(len(self._layers)) if layers is None else layers:
            for kv in (0, 1):
                values = self.expected(req_id, tokens, start, end, layer, kv)
                if poisoned:
                    values = -values
                if self.layout == "flash_attn":
                    self._rows(layer, kv)[slots] = values
                else:
                    cache = self._layers[layer]
                    bs = self.block_size
                    cache[slots // bs, kv, slots % bs] = values.view(-1, *cache.shape[3:])

    def verify(
        self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int], upto: int
    ) -> Mismatch | None:
        """Check every token ``[0, upto)`` of the request; the first wrong one, or None."""
        if upto <= 0:
            return None
        slots = self._slots(block_ids, 0, upto)
        for layer in range(len(self._layers)):
            for kv in (0, 1):
                want = self.expected(req_id, tokens, 0, upto, layer, kv)
                if self.layout == "flash_attn":
                    got = self._rows(layer, kv)[slots]
                else:
                    cache = self._layers[layer]
                    bs = self.block_size
                    got = cache[slots // bs, kv, slots % bs].reshape(upto, self.row)
                bad = ~(got == want).all(dim=1)
                if bool(bad.any()):
                    first = int(bad.nonzero()[0, 0])
                    return Mismatch(
                        req_id,
                        first,
                        layer,
                        kv,
                        float(want[first, 0]),
                        float(got[first, 0]),
                        int(bad.sum()),
                    )
        return None

    def forget(self, req_id: str) -> None:
        self._hashes.pop(req_id, None)
