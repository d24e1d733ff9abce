"""Replay speed and memory: ``kvledger check`` over a synthetic log of about a million events.

The log is written by the real Tracker with a LogWriter, driven by a decode-heavy serving
workload: ``--live`` requests at a time (default 256), each a 512-token prompt (a 256-token
prefix shared by groups of 8 requests, so later ones load it from the pool) prefilled in one
step, then 200 to 800 decode steps from the next step on (vLLM schedules a request once a
step); a finished request is replaced by a new one; every 97 steps two requests are
preempted and re-admitted the step after (they reload their saved prefix). Steady decode steps are logged as the connector logs them: one ``StepDecoded``
record per step for all the requests that decoded one token steadily (``--full``: one
``Scheduled`` record per request and step instead). An *event* is one request's share of a
callback (a steady decode step counts one per request, as it would without ``StepDecoded``);
a *record* is what the file holds. Then, over that log:

- ``read+verify``: ``LogReader.iter_raw`` (checksums, frame shape, tags, interning; no event
  objects), the floor any replay pays;
- ``decode``: ``LogReader`` iteration (event objects);
- ``decode+Tracker.apply``: every input event through ``Tracker.apply`` and nothing else: the
  floor a replay of this tracker cannot go under;
- ``check``: ``replay.check``: fold every input, re-derive every decision, run the
  invariants, compare with the recorded decisions (target: 1M events in under 3 s, one core);
- ``check peak``: Python heap peak of ``check`` (tracemalloc, a separate run: tracemalloc
  slows the run down), for this log and for one a quarter as long with the same number of
  live requests: the replay holds one frame and the live requests, so the two peaks are
  about equal.

    python bench/replay_bench.py                      # 1M events, and 250k for the memory row
    python bench/replay_bench.py --events 200000 --rounds 1   # quicker
    python bench/replay_bench.py --full --events 200000       # one record per event
    python bench/replay_bench.py --by-type                    # and apply's time by event type

Timings are medians of ``--rounds`` rounds; each round runs every variant once, in a random
order. The machine is shared: expect noise.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.replay.replayer import check
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

BLOCK = 16
CHUNK = 256
PROMPT = 512
SHARED = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def write_log(
    path: Path,
    target: int,
    live: int,
    num_slots: int,
    *,
    hot: bool = True,
    seed: int = 1,
    rotate_bytes: int | None = None,
    batch: bool = False,
    jitter: float = 0.0,
) -> int:
    """Drive the workload until ``target`` events were applied, counting a steady decode step
    folded into ``StepDecoded`` as one event per request (a "request-step"); returns the
    number of steps. ``hot``: steady decode steps as the connector records them (one
    ``StepDecoded`` record per step for all of them), else one ``Scheduled`` per request.
    ``rotate_bytes``: segments of that size (default: one file). ``batch``: the connector's
    batch (``Tracker.decode_batch``) instead of ``decode_step_ok`` request by request; the two
    write the same log. ``jitter``: the share of steps reported one token ahead of the
    tracker's count (a request the hot path must refuse)."""
    rng = random.Random(seed)
    config = TrackerConfig(block_size=BLOCK, chunk_size=CHUNK, num_slots=num_slots)
    writer = LogWriter(path, config.to_dict(), rotate_bytes=rotate_bytes, fsync="never")
    t = Tracker(config, log=writer)
    free = list(range(1, 1_000_000))
    prefixes = [[rng.randrange(32000) for _ in range(SHARED)] for _ in range(64)]
    tokens: dict[str, list[int]] = {}
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    budget: dict[str, int] = {}
    running: list[str] = []
    admitted: list[str] = []  # admitted (prefilled) this step
    preempted: list[str] = []
    saves: list[tuple[str, tuple[bytes, ...]]] = []
    loads: list[str] = []
    next_id = 0
    step = 0
    steady_steps = decoded_records = 0

    def admit(rid: str, admission: ev.Admission) -> None:
        toks = tokens[rid]
        ext = t.lookup(rid, 0, toks, preempted=admission is ev.Admission.RESUMED)
        table = [free.pop() for _ in range(cdiv(len(toks) + 1, BLOCK))]
        blocks[rid] = table
        t.allocated(rid, table, ext)
        out = t.scheduled(
            rid,
            num_computed=ext,
            num_scheduled=len(toks) - ext,
            all_token_ids=toks,
            block_ids=table,
            admission=admission,
        )
        collect(rid, out)
        computed[rid] = len(toks)
        toks.append(rng.randrange(32000))  # the sampled token
        # vLLM schedules a request once a step: its first decode step is the next one.
        admitted.append(rid)

    def collect(rid: str, out: list[ev.DecisionEvent]) -> None:
        for d in out:
            if isinstance(d, ev.SavePlanned) and d.keys:
                saves.append((rid, d.keys))
            elif isinstance(d, ev.LoadPlanned) and d.keys:
                loads.append(rid)

    while t.counts["events"] - decoded_records + steady_steps < target:
        pending_saves, saves[:] = list(saves), []
        for rid, keys in pending_saves:
            t.save_done(rid, keys)
        pending_loads, loads[:] = list(loads), []
        for rid in pending_loads:
            t.load_done(rid)
        for rid in preempted:
            admit(rid, ev.Admission.RESUMED)
        preempted = []
        while len(running) + len(admitted) < live:
            rid = f"req-{next_id:06d}-{rng.getrandbits(32):08x}"
            next_id += 1
            prompt = prefixes[next_id // 8 % len(prefixes)] + [
                rng.randrange(32000) for _ in range(PROMPT - SHARED)
            ]
            tokens[rid] = list(prompt)
            budget[rid] = rng.randint(200, 800)
            t.add_request(rid, prompt)
            admit(rid, ev.Admission.NEW)
        still: list[str] = []
        for rid in running:
            if computed[rid] == len(tokens[rid]) - 1 and len(tokens[rid]) - PROMPT >= budget[rid]:
                t.finished(rid)
                free.extend(blocks.pop(rid))
                del tokens[rid], computed[rid], budget[rid]
            else:
                still.append(rid)
        said: list[int] = []  # the num_computed vLLM reports for each
        new_at: dict[int, int] = {}  # position -> the block its table grew by
        for i, rid in enumerate(still):
            nc = computed[rid]
            said.append(nc + 1 if jitter and rng.random() < jitter else nc)
            if cdiv(nc + 1, BLOCK) > len(blocks[rid]):
                new_at[i] = free.pop()
                blocks[rid].append(new_at[i])
        # The connector's hot path: a steady single-token step (at most one new block) is
        # only numbered; any other goes through scheduled.
        steady: list[int] = []
        grown: list[tuple[int, int]] = []
        if hot and batch:
            unsteady, steady, grown = t.decode_batch(still, said, new_at)
        elif hot:
            unsteady = []
            for i, rid in enumerate(still):
                num = t.decode_step_ok(rid, said[i], new_at.get(i))
                if num is None:
                    unsteady.append(i)
                    continue
                steady.append(num)
                if i in new_at:
                    grown.append((num, new_at[i]))
        else:
            unsteady = list(range(len(still)))
        for i in unsteady:
            rid = still[i]
            new = [new_at[i]] if i in new_at else []
            out = t.scheduled(
                rid, num_computed=said[i], num_scheduled=1, all_token_ids=tokens[rid], block_ids=new
            )
            if out:
                collect(rid, out)
        for rid in still:
            computed[rid] += 1
            tokens[rid].append(rng.randrange(32000))
        if hot and batch:
            t.record_decoded(steady, grown)
        else:
            t.decoded(steady, grown)
        steady_steps += len(steady)
        decoded_records += 1 if steady else 0
        running = still + admitted
        admitted.clear()
        if step % 97 == 96:
            for rid in rng.sample(running, min(2, len(running))):
                running.remove(rid)
                t.preempted(rid)
                free.extend(blocks.pop(rid))
                computed[rid] = 0
                preempted.append(rid)
        t.end_step()
        step += 1
    t.close()
    return step


def timed(fn: Any) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median_time(fn: Any, rounds: int) -> tuple[float, Any]:
    runs = [timed(fn) for _ in range(rounds)]
    return statistics.median(r[0] for r in runs), runs[-1][1]


def events_of(counts: dict[str, Any]) -> int:
    """A check's events as this bench counts them (``check``'s ``counts``): a record each, but
    a ``StepDecoded`` one per request it names, as without it."""
    return int(
        counts["events"] - counts["by_type"].get("StepDecoded", 0) + counts["steady_decode_steps"]
    )


def read_raw(path: Path) -> int:
    return sum(len(f.records) for f in LogReader(path).iter_raw())


def decode(path: Path) -> int:
    return sum(len(f.events) for f in LogReader(path))


def _tracker_for(reader: LogReader) -> Tracker:
    """A Tracker of the log's own configuration, never strict (as ``check`` builds it)."""
    return Tracker(TrackerConfig.from_header({**reader.header["config"], "strict": False}))


def bare_apply(path: Path) -> int:
    """The floor a replay cannot go under: decode, and ``Tracker.apply`` every input event
    (no comparison, no bookkeeping)."""
    reader = LogReader(path)
    t = _tracker_for(reader)
    n = 0
    for frame in reader:
        for e in frame.events:
            if e.KIND == "input":
                t.step = e.step
                t.apply(e)
                n += 1
    return n


def apply_by_type(path: Path) -> dict[str, tuple[int, float]]:
    """``bare_apply`` with each ``Tracker.apply`` timed: event type -> (records, seconds).
    The timer's own cost (about 0.1 us a call) is in each figure."""
    reader = LogReader(path)
    t = _tracker_for(reader)
    out: dict[str, list[float]] = {}
    clock = time.perf_counter
    for frame in reader:
        for e in frame.events:
            if e.KIND == "input":
                t.step = e.step
                start = clock()
                t.apply(e)
                spent = clock() - start
                row = out.setdefault(type(e).__name__, [0, 0.0])
                row[0] += 1
                row[1] += spent
    return {name: (int(n), secs) for name, (n, secs) in out.items()}


def check_peak(path: Path) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        check(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--events",
        type=int,
        default=1_000_000,
        help="events in the big log, a steady decode step counting one per request "
        "(default 1,000,000); the small log has a quarter",
    )
    ap.add_argument("--live", type=int, default=256, help="requests running at a time")
    ap.add_argument("--slots", type=int, default=256, help="host pool chunk slots")
    ap.add_argument(
        "--full",
        action="store_true",
        help="one Scheduled record per request and step (no StepDecoded): the slow path",
    )
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each (median)")
    ap.add_argument("--keep", action="store_true", help="keep the logs (prints where)")
    ap.add_argument(
        "--by-type",
        action="store_true",
        help="after the timed rounds, one more pass of the floor timing Tracker.apply by "
        "event type (where a replay's time goes)",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvledger-replay-bench-"))
    logs: dict[str, Path] = {}
    for name, n in (("small", args.events // 4), ("big", args.events)):
        path = tmp / f"{name}.kvlog"
        seconds, steps = timed(
            lambda p=path, n=n: write_log(p, n, args.live, args.slots, hot=not args.full)
        )
        logs[name] = path
        print(
            f"wrote {path.name}: {path.stat().st_size:,} bytes, {steps:,} steps in {seconds:.1f}s",
            flush=True,
        )

    big = logs["big"]
    result = check(big)
    if result.exit_code != 0:
        raise SystemExit(f"the bench log does not check clean: {result.problems[:3]}")
    c = result.counts
    records = c["events"]
    logical = events_of(c)
    size = big.stat().st_size

    # Each round times every variant once, in a random order (the machine's speed drifts:
    # a variant timed in a run of its own would carry the drift into the ratios below).
    variants: dict[str, Any] = {
        "read+verify (iter_raw)": lambda: read_raw(big),
        "read+decode (events)": lambda: decode(big),
        "decode+Tracker.apply (floor)": lambda: bare_apply(big),
        "check (fold+plan+compare)": lambda: check(big),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in random.sample(list(variants), len(variants)):
            seconds, out = timed(variants[name])
            times[name].append(seconds)
            if name.startswith("read+verify"):
                assert out == records
    rows = [(name, statistics.median(runs)) for name, runs in times.items()]
    dec_runs, chk_runs = times["read+decode (events)"], times["check (fold+plan+compare)"]
    t_dec, t_chk = statistics.median(dec_runs), statistics.median(chk_runs)
    t_bare = statistics.median(times["decode+Tracker.apply (floor)"])
    per_round = [chk / dec for chk, dec in zip(chk_runs, dec_runs, strict=True)]
    res = result

    peaks = {name: check_peak(path) for name, path in logs.items()}
    small_res = check(logs["small"])

    print()
    print(
        f"log: {logical:,} events ({records:,} records: {c['inputs']:,} inputs, "
        f"{c['decisions']:,} decisions; {c['steady_decode_steps']:,} steady decode steps in "
        f"{c['by_type'].get('StepDecoded', 0):,} StepDecoded records)"
    )
    print(
        f"     {c['steps']:,} steps, {c['requests']:,} requests, at most "
        f"{c['peak_live_requests']} live; {size:,} bytes ({size / logical:.2f} B/event)"
    )
    print(f"{'':<30}{'seconds':>9}{'M events/s':>12}{'M records/s':>13}")
    for label, secs in rows:
        print(f"{label:<30}{secs:>9.2f}{logical / secs / 1e6:>12.2f}{records / secs / 1e6:>13.2f}")
    per_m = t_chk / logical * 1e6
    print(
        f"check: 1M events in {per_m:.2f} s ({'within' if per_m < 3.0 else 'OVER'} the 3 s "
        f"budget); {t_chk / t_bare:.2f}x the decode+apply floor"
    )
    spread = f"{min(per_round):.1f} to {max(per_round):.1f}" if len(per_round) > 1 else ""
    print(
        f"issue 26: {logical / t_chk / 1e6:.2f} M events/s (goal at least 1); "
        f"{t_chk / t_dec:.1f}x decoding (goal at most 3"
        + (f"; per round {spread})" if spread else ")")
    )
    print()
    print(f"{'memory (tracemalloc peak)':<30}{'events':>12}{'live':>6}{'peak':>10}")
    for name, r in (("small", small_res), ("big", res)):
        rc = r.counts
        n = events_of(rc)
        print(
            f"{'check ' + logs[name].name:<30}{n:>12,}"
            f"{rc['peak_live_requests']:>6}{peaks[name] / 2**20:>8.1f}MB"
        )
    print(f"peak ratio big/small: {peaks['big'] / peaks['small']:.2f}")
    if args.by_type:
        by_type = apply_by_type(big)
        total = sum(secs for _, secs in by_type.values())
        print()
        print(f"{'Tracker.apply by event type':<30}{'records':>9}{'seconds':>9}{'us each':>9}")
        for name, (n, secs) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
            print(f"{name:<30}{n:>9,}{secs:>9.3f}{secs / n * 1e6:>9.1f}")
        print(f"{'all':<30}{sum(n for n, _ in by_type.values()):>9,}{total:>9.3f}")
    print()
    flags = (" --full" if args.full else "") + (" --by-type" if args.by_type else "")
    print(
        f"command: python bench/replay_bench.py --events {args.events} --live {args.live} "
        f"--slots {args.slots} --rounds {args.rounds}{flags}"
    )
    print(f"cli:     kvledger check {big}" + ("" if args.keep else "   (deleted; --keep keeps it)"))
    if not args.keep:
        for p in logs.values():
            p.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
