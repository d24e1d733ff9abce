#!/usr/bin/env python3
"""Remote tier throughput: RemoteStore's save and load of one chunk, with the value sealed and
checked as the worker does it (connector/values.py), against a raw SET / GET of the same
bytes through the same redis-py client, on a real ``redis-server``.

Run by hand; it prints numbers and never passes or fails on them. The chunk is 256 tokens of
Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bf16: 32 MiB per tensor-parallel rank):

  save        ValueSeal.seal + RemoteStore.put: the value bound to its chunk key, rank and
              layout, a CRC-32 per 4 MiB piece computed while the payload is on the wire,
              published by RENAME                                   vs  raw  client.set
  save keyed  the same with a secret: SHA-256 per piece and an HMAC-SHA256 of the header
  load        RemoteStore.get + ValueSeal.open: one pipelined GET, the binding and every
              piece's CRC-32 checked                                vs  raw  client.get
  load keyed  the same with a secret: every piece's SHA-256 and the HMAC checked

Each round runs every variant once, in a new seeded random order (these machines are shared
and noisy: position must not bias a variant); each figure is the median over --repeats rounds
after --warmup rounds, in GB/s (1e9 bytes/s); "vs raw" is the median of the per-round ratios.
Without --url it starts its own ``redis-server`` (no persistence) on a free port.

  python bench/remote_bench.py
  python bench/remote_bench.py --url redis://127.0.0.1:6379/0 --chunks 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
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

from kvledger.connector.remote import RemoteStore, remote_key
from kvledger.connector.values import ValueSeal, layout_fingerprint

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
    layout = layout_fingerprint("meta-llama/Llama-3.1-8B|32L|8x128:bfloat16|tp1r0", "tokens")
    seals = {
        "": ValueSeal(rank=0, layout=layout),
        " keyed": ValueSeal(rank=0, layout=layout, secret=os.urandom(32)),
    }
    # 16-byte chunk keys, one set per kind of seal.
    keys = {
        kind: [
            (b"bench%s-%d" % (kind.strip().encode(), i)).ljust(16, b".") for i in range(args.chunks)
        ]
        for kind in seals
    }
    raw_keys = [remote_key(k, 0) + b":raw" for k in keys[""]]
    total = nbytes * args.chunks

    def raw_save() -> None:
        pipe = client.pipeline(transaction=False)
        for key, data in zip(raw_keys, chunks, strict=True):
            pipe.set(key, data)
        pipe.execute()

    def raw_load() -> None:
        pipe = client.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        got = pipe.execute()
        assert all(len(g) == nbytes for g in got)

    def saver(kind: str) -> Callable[[], None]:
        seal, ks = seals[kind], keys[kind]

        def save() -> None:
            sealed = [(k, seal.seal(k, memoryview(c))) for k, c in zip(ks, chunks, strict=True)]
            assert store.put(sealed) == [None] * len(ks)

        return save

    def loader(kind: str) -> Callable[[], None]:
        seal, ks = seals[kind], keys[kind]

        def load() -> None:
            got = [seal.open(k, v, nbytes) for k, v in zip(ks, store.get(ks), strict=True)]
            assert all(not isinstance(g, str) for g in got), got

        return load

    variants: dict[str, Callable[[], None]] = {"raw save": raw_save, "raw load": raw_load}
    for kind in seals:
        variants[f"save{kind}"] = saver(kind)
        variants[f"load{kind}"] = loader(kind)
    for kind in seals:  # something to load in the first round, whatever the order
        variants[f"save{kind}"]()
    raw_save()
    order = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.warmup + args.repeats):
        names = list(variants)
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            dt = time.perf_counter() - t0
            if round_ >= args.warmup:
                times[name].append(dt)
    # The loaded bytes are the saved ones (a round trip through the server).
    for kind, seal in seals.items():
        opened = seal.open(keys[kind][0], store.get(keys[kind][:1])[0], nbytes)  # type: ignore[arg-type]
        assert not isinstance(opened, str) and bytes(opened.payload) == chunks[0]
    client.delete(*raw_keys, *(remote_key(k, 0) for ks in keys.values() for k in ks))
    store.close()

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"chunk: {args.tokens} tokens of Llama-3.1-8B = {nbytes / 2**20:.0f} MiB, "
        f"{args.chunks} per call; {args.repeats} rounds after {args.warmup} warm-up, "
        f"random order (seed {args.seed})"
    )
    print(f"{'':12} {'GB/s':>7} {'raw GB/s':>9} {'vs raw':>7}")
    for op in ("save", "save keyed", "load", "load keyed"):
        ours, raw = times[op], times[f"raw {op.split()[0]}"]
        ratio = statistics.median(r / o for r, o in zip(raw, ours, strict=True))
        print(f"{op:12} {median_gbs(total, ours):7.2f} {median_gbs(total, raw):9.2f} {ratio:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a Redis URL; default: start a redis-server here")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk (256)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks per call (1)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="of the variants' order (0)")
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
