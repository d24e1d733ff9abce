"""A ``StepDecoded`` read entry by entry: the one place its numbers, blocks and tokens are
resolved, and where what cannot be resolved is named.

A steady decode step is one record for many requests. Its readers apply it as a batch where
they can (the replay's ``Tracker``, through ``_Decoding``; a recorder's digests, through
``RecordedSteps.columns``). Where one must go request by request, it reads the entries here:
the replay's slow path (``Tracker._apply_step_decoded``), a recorder's rules
(``RecordedSteps.entries``), the history walk behind ``explain`` and ``show``
(``tracker/history.py``) and the what-if replay (``replay/replayer.py``). So a damaged record
gets the same rule names and details whichever of them reads it. What makes an entry *steady*
differs between the two kinds of log (the Tracker's bounds, a recorder's last count): each
reader judges that itself, under the one rule name ``decoded_not_steady``.

The rules, past the record's well-formedness (``tracker/wellformed.py``):

- ``decoded_blocks``: its blocks or tokens do not pair with its numbers;
- ``decoded_unknown``: it names a number no live request holds;
- ``decoded_not_steady``: it names a request that could not have taken a steady step.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvledger.tracker import events as ev
from kvledger.tracker.violation import Violation

__all__ = ["Entry", "entries", "not_steady", "unknown"]


class Entry(NamedTuple):
    """One request's share of a ``StepDecoded``: its number, the live request that holds
    it, the block its table grew by (None: none) and, in a recorder's log, the token id the
    step made known (None in kvledger's own log, which learns them later, in bulk)."""

    num: int
    req_id: str
    block: int | None
    token: int | None


def entries(
    e: ev.StepDecoded,
    req_of: Mapping[int, str],
    *,
    tokens: bool = False,
    judge: Callable[[Entry], Violation | None] | None = None,
) -> tuple[list[Entry], list[Violation]]:
    """The entries of ``e`` whose numbers ``req_of`` resolves and that ``judge`` passes, in
    order, and the violations of the rest, in the record's order (``req_of``: number -> live
    request, ``RequestNumbers.req_of``; ``judge``: the reader's own test of an entry, a
    violation when it fails, called once per resolved entry, in order).

    - Numbers repeated, or ``tokens`` that do not pair with them (one each, or none in
      kvledger's own log; ``tokens=True``: a recorder's log, one each): no entry can be told
      from another, so none is read, and the record is ``decoded_blocks``.
    - Blocks that do not pair (an odd count, a number twice, a number not in ``nums``):
      ``decoded_blocks``, and every entry read without a block.
    - A number no live request holds: ``decoded_unknown``, under the number.
    """
    nums, carried = e.nums, e.tokens
    said = {"numbers": len(nums), "tokens": len(carried), "blocks": len(e.blocks)}
    width = len(carried)
    if (width != len(nums) and (tokens or width)) or len(set(nums)) != len(nums):
        return [], [Violation("decoded_blocks", e.step, "", "StepDecoded", said)]
    bad: list[Violation] = []
    grown = e.new_blocks()
    if grown is None:
        bad.append(Violation("decoded_blocks", e.step, "", "StepDecoded", said))
        grown = {}
    out: list[Entry] = []
    new = tuple.__new__
    get_block = grown.get
    for i, num in enumerate(nums):
        rid = req_of.get(num)
        if rid is None:
            bad.append(unknown(e, num))
            continue
        entry: Entry = new(Entry, (num, rid, get_block(num), carried[i] if width else None))
        failed = judge(entry) if judge is not None else None
        if failed is not None:
            bad.append(failed)
            continue
        out.append(entry)
    return out, bad


def unknown(e: ev.StepDecoded, num: int) -> Violation:
    """Number ``num`` of ``e`` stands for no request the reader can advance."""
    return Violation("decoded_unknown", e.step, str(num), "StepDecoded", {"num": num})


def not_steady(e: ev.StepDecoded, req_id: str, **detail: int) -> Violation:
    """The entry of ``req_id`` could not have been a steady step (the reader says why)."""
    return Violation("decoded_not_steady", e.step, req_id, "StepDecoded", detail)
