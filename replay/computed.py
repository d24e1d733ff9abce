"""What was computed before, for ``kvledger explain``: the token sequences of every unit a
request computed, kept by the unit before it (its parent key), so that equal prefixes meet and
the one sharing the longest prefix with a query is found by bisection.

Bounded by a budget of tokens: past it, the parents least recently added to are forgotten (and
counted, so a report can say a reason may read ``new_prefix`` for want of memory).
"""

from __future__ import annotations

import bisect
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["ANY_ROOT", "Computed", "History"]

ANY_ROOT = b""  # the parent under which every chain's first unit is also kept


class Computed(NamedTuple):
    key: bytes | None  # the unit's key (None: a partial piece)
    request: str
    step: int
    decode: bool  # past the computing admission's save policy (a decode chunk)
    root: bytes  # the chain's root (the request's model/layout/cache salt)
    salt: str  # the request's cache salt
    run: str  # the log it was computed in ("": the one explained)
    model: str  # that run's model/layout salt (TrackerConfig.salt)


class _Children:
    """The token sequences computed under one parent key, packed (4 bytes a token, big-endian,
    so byte order is token order) and sorted: the one sharing the longest prefix with a query
    sorts next to it."""

    __slots__ = ("info", "seqs")

    def __init__(self) -> None:
        self.seqs: list[bytes] = []
        self.info: dict[bytes, dict[bytes, Computed]] = {}  # seq -> root -> fact


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(tokens)}I", *tokens)


def _common(a: bytes, b: bytes) -> int:
    """Tokens two packed sequences share from their start."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // 4
    lo, hi = 0, n  # bisect on the longest equal prefix: slices compare in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // 4


class History:
    """What was computed, keyed by the unit before it (so equal prefixes meet), bounded by
    ``budget`` tokens: past it, the parents least recently added to are forgotten."""

    def __init__(self, budget: int) -> None:
        self.by_parent: OrderedDict[bytes, _Children] = OrderedDict()
        self.budget = budget
        self.tokens = 0
        self.forgotten = 0

    def add(self, parent: bytes, tokens: Sequence[int], fact: Computed) -> None:
        seq = _pack(tokens)
        ch = self.by_parent.get(parent)
        if ch is None:
            ch = self.by_parent[parent] = _Children()
        else:
            self.by_parent.move_to_end(parent)
        facts = ch.info.get(seq)
        if facts is None:
            bisect.insort(ch.seqs, seq)
            facts = ch.info[seq] = {}
            self.tokens += len(seq) // 4
        facts[fact.root] = fact
        while self.tokens > self.budget and len(self.by_parent) > 1:
            _, old = self.by_parent.popitem(last=False)
            self.tokens -= sum(len(s) for s in old.seqs) // 4
            self.forgotten += len(old.seqs)

    def nearest(
        self, parent: bytes, query: Sequence[int], root: bytes | None = None, other: bool = False
    ) -> tuple[int, Computed | None, bool]:
        """(tokens of ``query`` shared with the closest sequence computed under ``parent``, its
        fact, whether that sequence ended there: it is a shorter piece, not a different one).
        ``root`` with ``other``: only facts of another root."""
        ch = self.by_parent.get(parent)
        if ch is None or not ch.seqs:
            return 0, None, False
        q = _pack(query)
        i = bisect.bisect_left(ch.seqs, q)
        best, fact, ended = 0, None, False
        for j in (i - 1, i, i + 1):
            if 0 <= j < len(ch.seqs):
                seq = ch.seqs[j]
                pick = _pick(ch.info[seq], root, other)
                if pick is None:
                    continue
                n = _common(q, seq)
                full = n * 4 == len(seq)
                if n > best or (n == best and (fact is None or full)):
                    best, fact, ended = n, pick, full and len(seq) < len(q)
        return best, fact, ended


def _pick(facts: dict[bytes, Computed], root: bytes | None, other: bool) -> Computed | None:
    if root is None:
        return max(facts.values(), key=lambda f: f.step, default=None)
    if other:
        return max((f for r, f in facts.items() if r != root), key=lambda f: f.step, default=None)
    return facts.get(root)
