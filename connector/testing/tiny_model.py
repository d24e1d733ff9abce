"""A tiny Llama made on this machine, for vLLM's real engine on CPU (no model hub here).

``build_tiny_llama()`` writes a Hugging Face model directory vLLM can load: a
``transformers.LlamaConfig`` (hidden 256, 2 layers, 4 query heads, 2 KV heads of size 64,
fp32), random weights drawn with a fixed seed and saved as safetensors, and a BPE
tokenizer trained offline with ``tokenizers`` on a fixed text made here. Random weights are
enough for the engine tests: greedy output depends on every KV value, so a wrong KV changes
tokens.

The directory is cached under ``build/`` keyed by a hash of everything that makes it (the
config, the seed, the tokenizer text and this module's version), so a test session builds it
once (a second or two) and a changed recipe never reuses a stale one.

transformers, tokenizers and safetensors are imported only when a model is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

__all__ = ["TinyLlamaSpec", "build_tiny_llama", "corpus", "default_cache_root"]

# Bump when the recipe changes in a way the spec does not show.
_RECIPE = 2


@dataclasses.dataclass(frozen=True)
class TinyLlamaSpec:
    """What the model is: its shape, its seed, and how spread its random weights are."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    # Wider than Llama's 0.02: logits of a random model then have clear margins, so greedy
    # picks are decided by the KV, not by float rounding between two equal-looking batches.
    initializer_range: float = 0.1
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(
            {**dataclasses.asdict(self), "recipe": _RECIPE, "text": _corpus_digest()},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_root() -> Path:
    """``build/`` of this checkout (ignored by git), or ``$KVLEDGER_MODEL_CACHE``."""
    env = os.environ.get("KVLEDGER_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "build"


def _corpus() -> list[str]:
    """A fixed text to train the tokenizer on: pseudo-English made from a seeded word list,
    the same on every machine (the repo's docs would change the vocabulary on every edit)."""
    text = (
        "the a of to and in is it that for on with as was by at from this be are or an "
        "cache block token request chunk pool load save engine model layer head key value "
        "prefix scheduler worker step preempt resume host device memory page slot hash log "
        "event state fold plan check replay trace time first second last one two three four "
        "five six seven eight nine ten red green blue small large fast slow old new river "
        "stone cloud light night day morning evening tree house road city sea mountain"
    )
    words = text.split()
    rng = random.Random(1234)
    lines = []
    for _ in range(4000):
        n = rng.randint(6, 18)
        lines.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
    return lines


def corpus() -> list[str]:
    """The sentences the tokenizer was trained on (``kvledger demo --engine`` prompts with them)."""
    return _corpus()


def _corpus_digest() -> str:
    return hashlib.sha256("\n".join(_corpus()).encode()).hexdigest()[:16]


def build_tiny_llama(spec: TinyLlamaSpec | None = None, cache_root: Path | None = None) -> Path:
    """The model directory for ``spec`` (built once, then reused): pass it as vLLM's model."""
    spec = spec or TinyLlamaSpec()
    root = cache_root or default_cache_root()
    out = root / f"tiny-llama-{spec.key()}"
    if (out / ".complete").exists():
        return out
    tmp = root / f".tiny-llama-{spec.key()}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(tmp, spec.vocab_size)
    _write_model(tmp, spec, vocab)
    (tmp / ".complete").write_text(json.dumps(dataclasses.asdict(spec)) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same model first: theirs is as good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # SentencePiece-style word boundaries: every token decodes to readable text.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers' annotations
    fast = fast_cls(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def _write_model(out: Path, spec: TinyLlamaSpec, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config: Any = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    model_cls: Any = LlamaForCausalLM  # untyped in transformers' annotations
    model = model_cls(config)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name.endswith("norm.weight"):
                t = torch.ones_like(param)
            else:  # drawn here, not by transformers' init, so the seed alone fixes them
                t = torch.randn(param.shape, generator=gen) * spec.initializer_range
            state[name] = t.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
