#!/usr/bin/env python3
"""Remote tier throughput: RemoteStore's save and load of one chunk against a raw SET / GET of
the same bytes through the same redis-py client, on a real ``redis-server``.

Run by hand; it prints numbers and never passes or fails on them. The chunk is 256 tokens of
Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bf16: 32 MiB per tensor-parallel rank):

  save  RemoteStore.put   header (length + CRC-32 per 4 MiB piece) then the payload, one
                          MULTI/EXEC (SET + APPEND), confirmed     vs   raw  client.set(key, bytes)
  load  RemoteStore.get   one pipelined GET, header checked, every piece's CRC-32
                          verified                                   vs   raw  client.get(key)

Rounds interleave raw and ours so drift on a shared machine hits both alike; each figure is
the median over --repeats rounds after --warmup rounds, in GB/s (1e9 bytes/s); "vs raw" is
the median of the per-round ratios (target: at least 0.80). Without --url it starts its own
``redis-server`` (no persistence) on a free port and stops it after.

  python bench/remote_bench.py
  python bench/remote_bench.py --url redis://127.0.0.1:6379/0 --chunks 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.remote import RemoteStore, remote_key

GB = 1e9
# Llama-3.1-8B: K and V, 32 layers, 8 KV heads, head size 128, 2 bytes (bf16), per token.
BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


@contextlib.contextmanager
def redis_server(binary: str) -> Iterator[str]:
    """A throwaway ``redis-server`` on 127.0.0.1 and a free port: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", tmp]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"redis-server did not start: {args}") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def median_gbs(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / GB


def run(url: str, args: argparse.Namespace) -> None:
    store = RemoteStore(url, timeout_s=60.0, retry_s=0.5)
    if (why := store.check()) is not None:
        raise SystemExit(f"{url}: {why}")
    client = store.client
    nbytes = args.tokens * BYTES_PER_TOKEN
    chunks = [os.urandom(nbytes) for _ in range(args.chunks)]  # incompressible, like KV
    keys = [b"bench-%d" % i + bytes(24) for i in range(args.chunks)]
    raw_keys = [remote_key(k, 0) + b":raw" for k in keys]
    total = nbytes * args.chunks

    def raw_save() -> None:
        pipe = client.pipeline(transaction=False)
        for key, data in zip(raw_keys, chunks, strict=True):
            pipe.set(key, data)
        pipe.execute()

    def our_save() -> None:
        store.put([(k, memoryview(c)) for k, c in zip(keys, chunks, strict=True)])

    def raw_load() -> None:
        pipe = client.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        got = pipe.execute()
        assert all(len(g) == nbytes for g in got)

    def our_load() -> None:
        got = store.get(keys, nbytes)
        assert all(not isinstance(g, str) for g in got), got

    variants: dict[str, Callable[[], None]] = {
        "raw save": raw_save,
        "save": our_save,
        "raw load": raw_load,
        "load": our_load,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.warmup + args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if round_ >= args.warmup:
                times[name].append(dt)
    # The loaded bytes are the saved ones (a round trip through the server).
    assert bytes(store.get(keys[:1], nbytes)[0]) == chunks[0]  # type: ignore[arg-type]
    client.delete(*raw_keys, *(remote_key(k, 0) for k in keys))
    store.close()

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"chunk: {args.tokens} tokens of Llama-3.1-8B = {nbytes / 2**20:.0f} MiB, "
        f"{args.chunks} per call; {args.repeats} rounds after {args.warmup} warm-up"
    )
    print(f"{'':10} {'GB/s':>7} {'raw GB/s':>9} {'vs raw':>7}")
    for op in ("save", "load"):
        ours, raw = times[op], times[f"raw {op}"]
        ratio = statistics.median(r / o for r, o in zip(raw, ours, strict=True))
        print(f"{op:10} {median_gbs(total, ours):7.2f} {median_gbs(total, raw):9.2f} {ratio:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a Redis URL; default: start a redis-server here")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk (256)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks per call (1)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        run(args.url, args)
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server is not installed (apt-get install redis-server), or pass --url"
        )
    with redis_server(binary) as url:
        run(url, args)


if __name__ == "__main__":
    main()
