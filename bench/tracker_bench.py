"""Tracker cost on a synthetic serving workload, against a mutable baseline in the same run.

Workload (defaults): 256 concurrent requests, 2,048-token prompts prefilled in 512-token
chunks, 512 decode steps, a few preemptions (each preempted request is re-admitted two steps
later and reloads its saved prefix). Every scheduler callback goes through:

- ``kvledger``: the Tracker (events, fold, plans, invariants) writing the msgpack log;
- ``kvledger-nolog``: the same without the log;
- ``baseline``: a plain mutable dict-of-lists tracker doing the same arithmetic (token and
  block lists, chunk keys, save cursor, index lookups) with no events, no immutability and
  no log;
- ``driver``: the workload driver calling no-op methods, whose time is subtracted from all.

Then the log written by the ``kvledger`` run is read back (read+verify rate) and fully
replayed (fold + re-plan + invariants). Timings are noisy on shared machines: each variant is
run ``--rounds`` times interleaved and the median is reported; ratios are what count.

    python bench/tracker_bench.py                 # the defaults above
    python bench/tracker_bench.py --requests 64 --decode 128 --rounds 3   # quicker
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.chunks import chunk_keys, root_key
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

BLOCK = 16
CHUNK = 256


# --- the workload driver -----------------------------------------------------------------


class Workload:
    def __init__(
        self,
        requests: int,
        prompt: int,
        prefill_chunk: int,
        decode: int,
        preempt_every: int,
        seed: int,
    ):
        rng = random.Random(seed)
        self.prompts = {
            f"req-{i:04d}-{rng.getrandbits(32):08x}": [rng.randrange(32000) for _ in range(prompt)]
            for i in range(requests)
        }
        self.prefill_chunk = prefill_chunk
        self.decode = decode
        self.preempt_every = preempt_every
        self.rng_seed = seed

    def drive(self, t: Any) -> int:
        """Run the workload against adapter ``t``; returns the number of (request, step) pairs."""
        rng = random.Random(self.rng_seed)
        free = list(range(1, 400_000))
        tokens = {r: list(p) for r, p in self.prompts.items()}
        computed = dict.fromkeys(self.prompts, 0)
        blocks: dict[str, list[int]] = {r: [] for r in self.prompts}
        decoded = dict.fromkeys(self.prompts, 0)
        waiting = list(self.prompts)
        preempted_at: dict[str, int] = {}
        pending_saves: list[tuple[str, tuple[bytes, ...]]] = []
        running: list[str] = []
        pairs = 0
        step = 0
        for r in self.prompts:
            t.add(r, self.prompts[r])
        while waiting or running or preempted_at:
            for r, keys in pending_saves:  # the worker confirms last step's saves
                t.save_done(r, keys)
            pending_saves = []
            for r in [r for r, s in preempted_at.items() if s + 2 <= step]:
                del preempted_at[r]
                waiting.append(r)
            admitted = []
            for r in waiting:
                ext = t.lookup(r, 0, tokens[r])
                nb = -(-(ext + min(self.prefill_chunk, len(tokens[r]) - ext)) // BLOCK)
                blocks[r] = [free.pop() for _ in range(nb)]
                t.allocated(r, blocks[r], ext)
                computed[r] = ext
                admitted.append(r)
            waiting = []
            for r in running + admitted:
                nc = computed[r]
                known = len(tokens[r])
                n = min(self.prefill_chunk, known - nc) if nc < known - 1 else 1
                need = -(-(nc + n) // BLOCK) - len(blocks[r])
                new_blocks = [free.pop() for _ in range(max(0, need))]
                blocks[r].extend(new_blocks)
                if r in admitted:
                    out = t.scheduled(r, nc, n, tokens[r], tuple(blocks[r]), True)
                else:
                    out = t.scheduled(r, nc, n, tokens[r], new_blocks, False)
                pairs += 1
                if out:
                    pending_saves.append((r, out))
                computed[r] = nc + n
                if nc + n >= known:  # sampled a token
                    tokens[r].append(rng.randrange(32000))
                    decoded[r] += 1
            t.meta_built()  # the end of build_connector_meta: vLLM finishes requests after it
            running = [r for r in running + admitted]
            finished = [r for r in running if decoded[r] >= self.decode]
            for r in finished:
                t.finished(r)
                free.extend(blocks[r])
            running = [r for r in running if decoded[r] < self.decode]
            if (
                self.preempt_every
                and step % self.preempt_every == self.preempt_every - 1
                and running
            ):
                for r in rng.sample(running, min(4, len(running))):
                    running.remove(r)
                    t.preempted(r)
                    free.extend(blocks[r])
                    blocks[r] = []
                    computed[r] = 0
                    preempted_at[r] = step
            t.end_step()
            step += 1
        return pairs


class NoopAdapter:
    def add(self, r, p):
        pass

    def lookup(self, r, local, toks):
        return 0

    def allocated(self, r, blocks, ext):
        pass

    def scheduled(self, r, nc, n, toks, blocks, admission):
        return ()

    def preempted(self, r):
        pass

    def finished(self, r):
        pass

    def save_done(self, r, keys):
        pass

    def end_step(self):
        pass

    def meta_built(self):
        pass


class TrackerAdapter:
    """Calls the Tracker the way connector/scheduler.py does: steady single-token decode
    steps are numbered into one StepDecoded per step, everything else is a Scheduled."""

    def __init__(self, tracker: Tracker):
        self.t = tracker
        self.steady: list[int] = []
        self.grown: list[tuple[int, int]] = []

    def add(self, r, p):
        self.t.add_request(r, p)

    def lookup(self, r, local, toks):
        return self.t.lookup(r, local, toks)

    def allocated(self, r, blocks, ext):
        self.t.allocated(r, blocks, ext)

    def scheduled(self, r, nc, n, toks, blocks, admission):
        if n == 1 and not admission and len(blocks) <= 1:
            new_block = blocks[0] if blocks else None
            num = self.t.decode_step_ok(r, nc, new_block)
            if num is not None:
                self.steady.append(num)
                if new_block is not None:
                    self.grown.append((num, new_block))
                return ()
        out = self.t.scheduled(
            r,
            num_computed=nc,
            num_scheduled=n,
            all_token_ids=toks,
            block_ids=blocks,
            admission=ev.Admission.NEW if admission else ev.Admission.RUNNING,
        )
        keys: tuple[bytes, ...] = ()
        for d in out:
            if isinstance(d, ev.SavePlanned):
                keys += d.keys
        return keys

    def preempted(self, r):
        self.t.preempted(r)

    def finished(self, r):
        self.t.finished(r)

    def save_done(self, r, keys):
        self.t.save_done(r, keys)

    def meta_built(self):
        self.t.decoded(self.steady, self.grown)
        self.steady = []
        self.grown = []

    def end_step(self):
        self.t.end_step()


class MutableBaseline:
    """The same arithmetic with mutable dicts and lists: no events, no immutability, no log."""

    def __init__(self, slots: int):
        self.req: dict[str, dict[str, Any]] = {}
        self.index: dict[bytes, int] = {}
        self.slots = slots
        self.root = root_key("")

    def add(self, r, p):
        self.req[r] = {
            "tokens": list(p),
            "blocks": [],
            "n": 0,
            "cursor": 0,
            "keys": chunk_keys(self.root, p, CHUNK),
            "prefill_end": len(p),
        }

    def _keys(self, s):
        if len(s["tokens"]) // CHUNK > len(s["keys"]):
            prev = s["keys"][-1] if s["keys"] else self.root
            s["keys"].extend(chunk_keys(prev, s["tokens"], CHUNK, first_chunk=len(s["keys"])))

    def lookup(self, r, local, toks):
        s = self.req[r]
        if len(toks) > len(s["tokens"]):
            s["tokens"].extend(toks[len(s["tokens"]) :])
            self._keys(s)
        hit = 0
        for k in s["keys"][: len(toks) // CHUNK]:
            if k not in self.index:
                break
            hit += CHUNK
        return max(0, hit - local - (1 if hit >= len(toks) else 0))

    def allocated(self, r, blocks, ext):
        self.req[r]["blocks"] = list(blocks)

    def scheduled(self, r, nc, n, toks, blocks, admission):
        s = self.req[r]
        if admission:
            s["blocks"] = list(blocks)
            s["cursor"] = 0
            s["prefill_end"] = len(toks)
        else:
            s["blocks"].extend(blocks)
        if len(toks) > len(s["tokens"]):
            s["tokens"].extend(toks[len(s["tokens"]) : nc + n])
            self._keys(s)
        s["n"] = nc + n
        if len(s["blocks"]) * BLOCK < s["n"]:
            raise AssertionError("tokens beyond blocks")
        limit = min(s["n"], len(s["tokens"]), s["prefill_end"])
        keys = []
        while s["cursor"] + CHUNK <= limit:
            k = s["keys"][s["cursor"] // CHUNK]
            if k not in self.index:
                keys.append(k)
            s["cursor"] += CHUNK
        return tuple(keys)

    def preempted(self, r):
        s = self.req[r]
        s["blocks"] = []
        s["n"] = 0

    def finished(self, r):
        self.req.pop(r, None)

    def save_done(self, r, keys):
        for k in keys:
            self.index[k] = len(self.index)

    def end_step(self):
        pass

    def meta_built(self):
        pass


def _timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument(
        "--preempt-every", type=int, default=64, help="preempt 4 requests every N steps (0: never)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    work = Workload(
        args.requests, args.prompt, args.prefill_chunk, args.decode, args.preempt_every, seed=1
    )
    config = TrackerConfig(
        block_size=BLOCK, chunk_size=CHUNK, num_slots=args.requests * (args.prompt // CHUNK + 4)
    )
    tmp = tempfile.mkdtemp(prefix="kvledger-bench-")
    times: dict[str, list[float]] = {
        "driver": [],
        "baseline": [],
        "kvledger-nolog": [],
        "kvledger": [],
    }
    pairs = 0
    log_path = ""
    for rnd in range(args.rounds):
        times["driver"].append(_timed(lambda: work.drive(NoopAdapter())))
        times["baseline"].append(_timed(lambda: work.drive(MutableBaseline(config.num_slots))))
        times["kvledger-nolog"].append(_timed(lambda: work.drive(TrackerAdapter(Tracker(config)))))
        log_path = os.path.join(tmp, f"bench-{rnd}.kvlog")
        holder: dict[str, int] = {}

        def with_log(log_path: str = log_path, holder: dict[str, int] = holder) -> None:
            writer = LogWriter(log_path, config.to_dict(), rotate_bytes=None)
            tracker = Tracker(config, log=writer)
            holder["pairs"] = work.drive(TrackerAdapter(tracker))
            tracker.close()

        times["kvledger"].append(_timed(with_log))
        pairs = holder["pairs"]
        print(
            f"round {rnd + 1}/{args.rounds}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
            flush=True,
        )

    med = {k: statistics.median(v) for k, v in times.items()}
    drv = med["driver"]
    per = {k: (med[k] - drv) / pairs * 1e6 for k in ("baseline", "kvledger-nolog", "kvledger")}
    print()
    print(
        f"workload: {args.requests} requests x ({args.prompt}-token prompt in {args.prefill_chunk}-token chunks + {args.decode} decode steps), preempt 4 every {args.preempt_every} steps"
    )
    print(f"(request, step) pairs: {pairs:,}")
    print(f"{'variant':<16}{'median s':>10}{'us/req/step':>14}{'vs baseline':>13}")
    for k in ("baseline", "kvledger-nolog", "kvledger"):
        print(f"{k:<16}{med[k]:>10.2f}{per[k]:>14.2f}{per[k] / per['baseline']:>12.2f}x")
    print(f"{'driver (subtracted)':<16}{drv:>7.2f}")

    # Log size: bytes per decode-step event, measured on a decode-only stretch of the file.
    size = os.path.getsize(log_path)
    frames = list(LogReader(log_path).iter_raw())
    n_records = sum(len(f.records) for f in frames)
    # Logical events: a StepDecoded record stands for one single-token step per request in it.
    n_events = sum(
        len(rec[2]) if rec[0] == ev.StepDecoded.TAG and len(rec) > 2 else 1
        for f in frames
        for rec in f.records
    )
    decode_bytes = decode_events = 0
    offsets = [f.offset for f in frames] + [size]
    for f, nxt in zip(frames, offsets[1:], strict=True):
        tags = {rec[0] for rec in f.records}
        if tags == {ev.StepDecoded.TAG}:
            # One record for the whole step: count one decode event per request in it.
            decode_bytes += nxt - f.offset
            decode_events += sum(len(rec[2]) for rec in f.records if len(rec) > 2)
    print()
    print(
        f"log: {size:,} bytes, {len(frames):,} frames, {n_records:,} records = {n_events:,} logical events (one per request per step), {size / n_events:.1f} B/logical event overall"
    )
    if decode_events:
        print(
            f"decode-step events: {decode_bytes / decode_events:.2f} B per request per decode step (decode-only frames, framing included)"
        )

    # Read + verify (checksums, shapes, tags, interning) without building event objects.
    def read_raw() -> int:
        return sum(len(f.records) for f in LogReader(log_path).iter_raw())

    read_times = [_timed(read_raw) for _ in range(args.rounds)]
    print(
        f"read+verify: {n_events / statistics.median(read_times) / 1e6:.2f} M logical events/s ({n_records / statistics.median(read_times) / 1e6:.2f} M records/s)"
    )

    def decode_all() -> int:
        return sum(len(f.events) for f in LogReader(log_path))

    dec_times = [_timed(decode_all) for _ in range(args.rounds)]
    print(
        f"read+verify+decode to event objects: {n_events / statistics.median(dec_times) / 1e6:.2f} M logical events/s"
    )

    # Full replay: fold every input event, re-derive every decision, run invariants, compare.
    def replay() -> int:
        tracker = Tracker(TrackerConfig.from_header(LogReader(log_path).header["config"]))
        mismatches = 0
        recorded: list[Any] = []
        derived: list[Any] = []
        for frame in LogReader(log_path):
            for e in frame.events:
                if e.KIND == "input":
                    if recorded != derived:
                        mismatches += 1
                    tracker.step = e.step
                    derived = tracker.apply(e)
                    recorded = []
                else:
                    recorded.append(e)
        return mismatches

    rep_times = []
    for _ in range(args.rounds):
        holder2: dict[str, int] = {}
        rep_times.append(_timed(lambda h=holder2: h.setdefault("m", replay())))
    print(
        f"full replay (fold + re-plan + invariants + compare): {n_events / statistics.median(rep_times) / 1e3:.0f} k logical events/s, {holder2['m']} decision mismatches"
    )
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
