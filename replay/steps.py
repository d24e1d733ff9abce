"""A range of steps, as every command that takes one reads it (``--steps``): ``A:B`` (both ends
included), ``A:`` (from A), ``:B`` (up to B) or ``N`` (step N alone); ``None`` for an open end.

One parser and one rule for a range that ends before it starts, for ``show``, ``timeline`` and
the library calls behind them (``replay.lives.select``, ``replay.charts.timeline``), so that a
range one command takes, every command takes.
"""

from __future__ import annotations

__all__ = ["StepRange", "ordered", "parse_steps", "range_text"]

StepRange = tuple[int | None, int | None]
"""``(first, last)``, both included; ``None`` for an open end."""

_FORMS = "expected A:B, A:, :B or N (step numbers)"


def parse_steps(text: str) -> StepRange:
    """``--steps``'s text as ``(first, last)``; a ``ValueError`` naming what was wrong."""
    first_text, sep, last_text = text.partition(":")
    try:
        first = int(first_text) if first_text.strip() else None
        last = int(last_text) if last_text.strip() else None
    except ValueError:
        raise ValueError(f"--steps {text!r}: {_FORMS}") from None
    if not sep:
        if first is None:
            raise ValueError(f"--steps {text!r}: {_FORMS}")
        last = first
    return ordered((first, last), text)


def ordered(steps: StepRange, text: str | None = None) -> StepRange:
    """``steps``, or a ``ValueError`` when it ends before it starts (``text``: how it was
    written, for the message)."""
    first, last = steps
    if first is not None and last is not None and first > last:
        written = range_text(steps) if text is None else text
        raise ValueError(f"--steps {written!r}: the first step {first} is after the last {last}")
    return steps


def range_text(steps: StepRange) -> str:
    """``(3, None)`` as ``3:``: the range as it is written."""
    first, last = steps
    return f"{'' if first is None else first}:{'' if last is None else last}"
