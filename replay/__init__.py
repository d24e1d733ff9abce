"""Offline replay of kvledger logs: the library behind the ``kvledger`` command.

    from kvledger import replay

    result = replay.check("kvledger-1234.kvlog")          # re-fold, re-derive, compare
    result.exit_code, result.problems[0].describe()
    replay.check("run.kvlog", chunk_size=512)              # what-if: the plans under another config
    for event, frame in replay.open("logs/"):              # a file, a list of segments, a directory
        ...
    replay.diff("a.kvlog", "b.kvlog")                      # first divergence between two runs
    replay.show("run.kvlog", "req-3")                      # one request's life, state by state
    replay.stats("run.kvlog")                              # what the log holds
    replay.timeline("run.kvlog", "t.html")                 # a picture of the telling requests
    replay.export("run.kvlog", "tables/")                  # the tidy tables, for SQL

One module per job: ``source`` (opening a log), ``format`` (events as text and plain values),
``steps`` (a range of steps), ``counts`` (what a step did), ``results`` (what check and export
return), ``replayer`` (check and what-if), ``recorded`` (check of a recorder's log),
``divergence`` (diff), ``lives`` (show), ``summary`` (stats), ``misses``, ``explainer`` and
``explain`` (why each lookup missed), ``charts`` (timeline), ``tables`` (the tidy tables),
``writers`` (export), ``perfetto`` (the trace), ``otlp`` (OpenTelemetry spans), ``sql``,
``tail``, ``extras`` (the optional dependencies), ``demo``; ``cli`` and ``commands`` (the
command line, on top of them all: docs/architecture.md). The names above are functions;
importing this package is cheap: nothing is loaded until a name is used (no torch, no vLLM).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["check", "diff", "export", "open", "show", "stats", "timeline"]

_LAZY = {
    "open": ("kvledger.replay.source", "open_log"),
    "check": ("kvledger.replay.replayer", "check"),
    "diff": ("kvledger.replay.divergence", "diff"),
    "show": ("kvledger.replay.lives", "show"),
    "stats": ("kvledger.replay.summary", "stats"),
    "timeline": ("kvledger.replay.charts", "timeline"),
    "export": ("kvledger.replay.writers", "export"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kvledger.replay' has no attribute {name!r}")
    module_name, attr = target
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
