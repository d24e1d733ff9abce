#!/usr/bin/env python3
"""Stopping a real server in the middle of serving: is the log complete, and how long after the
signal was it sealed?

vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, its own process group,
vLLM's default multiprocessing) with KVLedgerConnector on the engine suite's tiny Llama, run
``--stops`` times. Each time, four concurrent completions overflow a small KV cache (vLLM
preempts), are sent again (their chunks come back from the pool), and the server is stopped:
Ctrl-C (SIGINT to the whole group) and SIGTERM to the server alone, in turn. (A stop with
requests still in flight is not timed here: tried once by Ctrl-C, the server had not exited
120 s later; not investigated.) ``--burners`` busy processes load the CPUs the
whole time, as another engine would. Per stop it prints whether the engine core said
``kvledger.log_sealed``, how long after the signal the log file was first written (the seal
writes what is pending and its end record in one call), and what ``kvledger check`` says of the log. Exit status 1 if any log is not
complete (check's exit 3: the engine was killed before the seal).

Run with the engine venv (``make setup-engine``)::

    .venv-engine/bin/python bench/stop_timing.py --stops 10 --burners 2

It prints numbers and never passes or fails on timings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BLOCK = 32
ENGINE = dict(num_blocks=8, block_size=BLOCK, max_model_len=224, max_num_seqs=4)


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


class _FirstWrite(threading.Thread):
    """When the file at ``path`` first changes size from now on (``at``, perf_counter seconds;
    nan if not within ``timeout``): the seal writes what is pending and the end record in one
    call. Polled (a stat each ~0.1 ms): file times tick too coarsely to tell milliseconds."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.path, self.timeout = path, timeout
        self.size = path.stat().st_size
        self.at = float("nan")
        self.start()

    def run(self) -> None:
        deadline = time.perf_counter() + self.timeout
        while time.perf_counter() < deadline:
            if self.path.stat().st_size != self.size:
                self.at = time.perf_counter()
                return
            time.sleep(0.0001)


def one_stop(
    model: str, log_dir: Path, sig: signal.Signals, group: bool, rng: random.Random
) -> tuple[bool, float, int]:
    from kvledger.connector.testing.served import Server, ServerSpec, kvledger_config

    top = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    prompts = [[rng.randrange(3, top) for _ in range(n)] for n in (40, 48, 57, 64)]
    spec = ServerSpec(model, kv_transfer_config=kvledger_config(log_dir, BLOCK), **ENGINE)
    with Server(spec) as server:
        server.complete(prompts, 96)  # outgrows the cache: vLLM preempts
        server.complete(prompts, 16)  # the same prompts: their chunks come from the pool
        time.sleep(rng.uniform(0.0, 1.0))
        (log,) = log_dir.glob("*.kvlog")
        seen = _FirstWrite(log)
        signalled = time.perf_counter()
        server.stop(sig, group=group)
        seen.join()
        output = server.output()
    logs = [log]
    delay = seen.at - signalled
    exe = Path(sys.executable).with_name("kvledger")
    check = subprocess.run(
        [str(exe), "check", str(logs[0])], capture_output=True, text=True, timeout=300
    )
    return "kvledger.log_sealed" in output, delay, check.returncode


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stops", type=int, default=10)
    ap.add_argument("--burners", type=int, default=2, help="busy processes (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    from kvledger.connector.testing.tiny_model import build_tiny_llama

    model = str(build_tiny_llama())
    rng = random.Random(args.seed)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,)) for _ in range(args.burners)]
    for b in burners:
        b.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvledger-stops-") as tmp:
            for i in range(args.stops):
                sig, group = (signal.SIGINT, True) if i % 2 == 0 else (signal.SIGTERM, False)
                how = "ctrl-c" if group else "sigterm"
                sealed, delay, code = one_stop(model, Path(tmp) / str(i), sig, group, rng)
                rows.append((how, sealed, delay, code))
                print(
                    f"stop {i + 1:>2} {how:<8} sealed={sealed!s:<5} "
                    f"written {delay * 1000:7.1f} ms after the signal   check exit {code}",
                    flush=True,
                )
    finally:
        stop.set()
        for b in burners:
            b.join()
    delays = [d * 1000 for _, s, d, c in rows if s and c == 0]
    incomplete = sum(1 for *_, c in rows if c == 3)
    print()
    print(f"{len(rows)} stops, {args.burners} burners: {incomplete} logs incomplete, "
          f"{sum(1 for _, s, *_ in rows if s)} sealed by the stop signal")  # fmt: skip
    if delays:
        print(
            f"signal to first write: median {statistics.median(delays):.1f} ms, "
            f"max {max(delays):.1f} ms"
        )
    return 1 if incomplete else 0


if __name__ == "__main__":
    raise SystemExit(main())
