"""A partial export: the files ``export`` writes from a log it could read only in part.

A damaged log (a torn tail after a crash, a frame whose checksum fails) or one missing
segment files still gives everything before the damage, and ``export`` writes it: a torn tail
is what every crash leaves, and those are the runs one most needs to look at. But a file of
the rows up to the damage looks like the whole run to any tool that reads it later, long
after the command's exit status 2 and its message on standard error are gone. So such a file
is marked twice:

- in its name, which a tool reading only the data sees, and which a script opening the whole
  export's name does not find: ``.partial`` before its extension (:func:`partial_name`:
  ``requests.partial.parquet``, ``run.partial.otlp.json``; a Hive tree's partition is
  ``run=<name>.partial``, so the ``run`` column says it on every row);
- inside it, where its format has a place: the parquet footer's key-value metadata, the OTLP
  resource's attributes (on every span), the Perfetto trace's ``otherData`` and a global
  instant at its end, each :data:`PARTIAL_KEY` with :func:`partial_reason`; JSON lines on
  standard output end with one more line, ``{"kvledger.partial": reason}``.

Writing nothing instead would make ``export`` the one command of no use on a crashed run;
the other commands already show what was read and say where it stopped.

A whole export and a partial one of the same output never stand side by side: publishing
one removes the other (:func:`publish`), as writing an export replaces the last one.
"""

from __future__ import annotations

import os

from kvledger.replay.source import MissingSegments
from kvledger.tracker.framing import StopInfo

__all__ = ["PARTIAL", "PARTIAL_KEY", "partial_name", "partial_reason", "publish"]

PARTIAL = ".partial"
PARTIAL_KEY = "kvledger.partial"

# Extensions of two parts: the mark goes before both (run.partial.otlp.json).
_COMPOUND = (".perfetto.json", ".otlp.json", ".otlp.jsonl")


def partial_reason(damage: StopInfo | None, missing: MissingSegments | None) -> str | None:
    """Why what was read is not the whole log, in one line; None when it is."""
    why = []
    if damage is not None:
        why.append(f"read stopped early: {damage.describe()}")
    if missing is not None:
        why.append(missing.describe())
    return "; ".join(why) or None


def partial_name(path: str) -> str:
    """``path`` with :data:`PARTIAL` before its extension: ``t/requests.parquet`` ->
    ``t/requests.partial.parquet``, ``run.otlp.json`` -> ``run.partial.otlp.json``."""
    head, name = os.path.split(path)
    lower = name.lower()
    ext = next((s for s in _COMPOUND if lower.endswith(s) and len(name) > len(s)), None)
    stem, ext = (name[: -len(ext)], name[-len(ext) :]) if ext else os.path.splitext(name)
    return os.path.join(head, f"{stem}{PARTIAL}{ext}")


def publish(temp: str, out: str, partial: str | None) -> str:
    """Rename ``temp`` into place, as ``out`` or, when ``partial``, as its partial name; the
    other of the two, left by an earlier export, is removed. The path written."""
    final, other = (partial_name(out), out) if partial else (out, partial_name(out))
    os.replace(temp, final)
    if os.path.isfile(other):
        os.unlink(other)
    return final
