"""The tidy tables, ``export``, ``sql`` and the Perfetto trace, against ``kvledger stats``.

One synthetic decode-heavy log (``replay_bench.write_log``: the real Tracker and LogWriter,
``--live`` requests at a time, steady decode steps as ``StepDecoded``), then, interleaved over
``--rounds`` rounds, each reader of it; the baseline is ``stats`` (one walk of the log, the
same fold), measured in the same rounds:

- ``tables``: ``replay.tables.table_rows`` with the rows thrown away (no ``problems``): the
  walk plus building every row;
- ``export parquet`` / ``export jsonl``: a directory of every table (no ``problems``);
- ``export + problems``: parquet, with the ``problems`` table (a replay, as ``check`` does);
- ``sql on the log``: ``kvledger sql LOG`` (tables in memory, then DuckDB), one query;
- ``sql on an export``: the same query over the parquet directory;
- ``perfetto``: the Chrome trace.

    python bench/tables_bench.py                           # 200k events, 3 rounds
    python bench/tables_bench.py --events 1000000 --rounds 1

Timings are medians; the machine is shared, read the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from replay_bench import write_log

from kvledger import replay
from kvledger.replay import sql, writers
from kvledger.replay.tables import table_rows

QUERY = "SELECT step, sum(hit) / sum(asked) AS hit_rate FROM admissions GROUP BY step"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="events in the log")
    ap.add_argument("--live", type=int, default=256, help="requests running at a time")
    ap.add_argument("--slots", type=int, default=256, help="host pool chunk slots")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "bench.kvlog"
        steps = write_log(log, args.events, args.live, args.slots)
        st = replay.stats(log)
        print(
            f"log: {st.logical_events:,} events ({st.events:,} records), {steps:,} steps, "
            f"{st.requests:,} requests, {log.stat().st_size:,} bytes"
        )
        exported = Path(d) / "exported"
        writers.export(log, exported, problems=False)

        def out(name: str) -> Path:
            return Path(d) / name

        variants: dict[str, Callable[[], object]] = {
            "stats (baseline)": lambda: replay.stats(log),
            "tables": lambda: table_rows(log, lambda t, r: None, problems=False),
            "export parquet": lambda: writers.export(log, out("p"), problems=False),
            "export jsonl": lambda: writers.export(log, out("j"), "jsonl", problems=False),
            "export + problems": lambda: writers.export(log, out("pp")),
            "sql on the log": lambda: sql.query([str(log)], QUERY),
            "sql on an export": lambda: sql.query([str(exported)], QUERY),
            "perfetto": lambda: writers.export(log, out("t.json"), problems=False),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["stats (baseline)"])
        print(f"{'':24s} {'seconds':>8s} {'x stats':>8s} {'M events/s':>11s}")
        for name, ts in times.items():
            t = statistics.median(ts)
            rate = st.logical_events / t / 1e6
            print(f"{name:24s} {t:8.2f} {t / base:8.2f} {rate:11.2f}")
        sizes = {
            "parquet": sum(p.stat().st_size for p in out("p").iterdir()),
            "jsonl": sum(p.stat().st_size for p in out("j").iterdir()),
            "trace": out("t.json").stat().st_size,
        }
        print("sizes: " + ", ".join(f"{k} {v:,} bytes" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
