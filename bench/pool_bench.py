"""The host pool's bookkeeping (``connector/store.py``, ``HostChunkPool``): what the worker adds
to each chunk transfer besides the copy itself, and what building a pool costs.

- ``transfer``: one transfer's bookkeeping on a pool of ``--slots`` slots: ``track`` (the
  claim that refuses a racing transfer, and the record), ``in_flight``, ``wait_slot``, over
  ``--transfers`` transfers spread over the slots; µs per transfer. The transfers are
  stand-ins already finished: no bytes move, so this is the bookkeeping alone.
- ``build``: a pool of ``--big`` slots (default 262,144: the default 4 GiB pool of a small
  model's 16 KiB chunks), ms. Its memory is ``torch.empty`` (not touched); the rest is ours.

With ``--against REV``, ``connector/store.py`` of that git revision is timed beside this
tree's, alternately, in a random order each round, and the ratios printed (medians of
``--rounds``)::

    python bench/pool_bench.py --against c140de1
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.connector import store  # noqa: E402
from kvledger.connector.kv_layout import describe_kv_caches  # noqa: E402
from kvledger.connector.transfer import TransferHandle  # noqa: E402

CHUNK = 8


class _Done:
    """A finished transfer's event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _spec() -> object:
    caches = {f"l{i}": torch.zeros((2, 8, 4, 2, 8), dtype=torch.float16) for i in range(2)}
    return describe_kv_caches(caches)


def store_at(rev: str) -> ModuleType:
    """``connector/store.py`` as it was at ``rev``, imported beside this tree's."""
    text = subprocess.run(
        ["git", "show", f"{rev}:connector/store.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="kvledger-pool-bench-")) / "store_then.py"
    path.write_bytes(text)
    spec = importlib.util.spec_from_file_location("kvledger.connector.store_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_transfer(mod: ModuleType, spec: object, slots: int, n: int) -> float:
    pool = mod.HostChunkPool(spec, CHUNK, slots)
    handles = [TransferHandle(_Done()) for _ in range(n)]
    t = time.perf_counter()
    for k, handle in enumerate(handles):
        i = k % slots
        pool.track(i, "write", handle)
        pool.in_flight(i)
        pool.wait_slot(i)
    return (time.perf_counter() - t) / n * 1e6


def build(mod: ModuleType, spec: object, slots: int) -> float:
    t = time.perf_counter()
    mod.HostChunkPool(spec, CHUNK, slots)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--against", metavar="REV", help="also time connector/store.py of REV")
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--transfers", type=int, default=20_000)
    p.add_argument("--big", type=int, default=262_144, help="slots of the pool built")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    spec = _spec()
    trees = {"this tree": store}
    if args.against:
        trees[args.against] = store_at(args.against)
    times: dict[tuple[str, str], list[float]] = {
        (name, what): [] for name in trees for what in ("transfer", "build")
    }
    for _ in range(args.rounds):
        for name in random.sample(list(trees), len(trees)):
            mod = trees[name]
            times[(name, "transfer")].append(per_transfer(mod, spec, args.slots, args.transfers))
            times[(name, "build")].append(build(mod, spec, args.big))
    print(f"{'':<12}{'µs per transfer':>17}{f'ms to build {args.big:,} slots':>28}")
    med = {key: statistics.median(runs) for key, runs in times.items()}
    for name in trees:
        print(f"{name:<12}{med[(name, 'transfer')]:>17.2f}{med[(name, 'build')]:>28.2f}")
    if args.against:
        a, b = "this tree", args.against
        print(
            f"this tree / {b}: transfer {med[(a, 'transfer')] / med[(b, 'transfer')]:.2f}, "
            f"build {med[(a, 'build')] / med[(b, 'build')]:.4f} "
            f"(medians of {args.rounds} rounds, random order)"
        )


if __name__ == "__main__":
    main()
