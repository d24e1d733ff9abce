"""The connector's metrics counters (``connector.metrics.COUNTERS``) counted again from a run's
log: what vLLM's Prometheus registry must show for that run (tests/test_metrics.py under vLLM's
scheduler, tests/engine/test_engine_metrics.py on its real engine)."""

from __future__ import annotations

import os

from kvledger.connector import metrics
from kvledger.replay.source import open_log
from kvledger.tracker import events as ev


def counted_from_log(path: str | os.PathLike[str]) -> dict[str, int]:
    """Each counter's total over the log at ``path`` (a file or a log directory)."""
    t = dict.fromkeys(metrics.COUNTERS, 0)
    for frame in open_log(path).frames():
        for e in frame.events:
            if isinstance(e, ev.LookupAnswered):
                t["lookups"] += 1
                t["hit_tokens"] += e.external
            elif isinstance(e, (ev.LoadPlanned, ev.SavePlanned)) and e.keys and e.end > e.start:
                kind = "load" if isinstance(e, ev.LoadPlanned) else "save"
                t[f"{kind}s"] += 1
                t[f"{kind}_tokens"] += e.end - e.start
            elif isinstance(e, ev.LoadDone):
                t["loads_done"] += 1
            elif isinstance(e, ev.LoadFailed):
                t["load_failures"] += 1
            elif isinstance(e, ev.SaveDone):
                t["chunks_saved"] += len(e.keys)
            elif isinstance(e, ev.SaveFailed):
                t["save_failures"] += len(e.keys)
            elif isinstance(e, ev.ViolationRecorded):
                t["violations"] += 1
    return t
