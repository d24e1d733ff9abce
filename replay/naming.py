"""Which request a name given on the command line means: the one rule every command uses
(``show``, ``explain``, ``timeline``, ``check --request``).

A name is a life label (``id``, or ``id#2`` for the second life of a reused id), a vLLM request
id (all its lives), or a part of exactly one id (vLLM's ids carry long random suffixes). Any
other name is :class:`RequestNotFound`, naming the ids that contain it when there are several,
else the nearest ids by spelling, so a typo gets its correction; so is the empty name, which
names no request.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

from kvledger.replay.format import elide

__all__ = ["RequestNotFound", "resolve"]


class RequestNotFound(LookupError):
    """No request by that name: ``candidates`` contain it (several: ambiguous), ``nearest``
    are spelled like it. The message shows ids as every command prints a value read from a
    log (:func:`replay.format.elide`: control characters escaped, a long id cut); the name
    asked for as its repr."""

    def __init__(
        self,
        request: str,
        candidates: Sequence[str] = (),
        nearest: Sequence[str] = (),
        *,
        read_in_part: str | None = None,
    ) -> None:
        self.request = request
        self.candidates = tuple(candidates)
        self.nearest = tuple(nearest)
        if not request:
            msg = "no request '' in the log: an empty id names no request"
        elif len(self.candidates) > 1:
            shown = ", ".join(map(elide, self.candidates[:10]))
            more = "" if len(self.candidates) <= 10 else f" (+{len(self.candidates) - 10} more)"
            msg = f"request {request!r} is ambiguous: {shown}{more}"
        else:
            hint = f"; nearest: {', '.join(map(elide, self.nearest))}" if self.nearest else ""
            msg = f"no request {request!r} in the log{hint}"
            if read_in_part is not None:  # it may be in what could not be read
                msg = (
                    f"no request {request!r} in what could be read of the log ({read_in_part})"
                    f"{hint}"
                )
        super().__init__(msg)

    def __str__(self) -> str:
        return str(self.args[0])


def resolve(name: str, lives: Mapping[str, str], *, read_in_part: str | None = None) -> list[str]:
    """The life labels ``name`` means, in the order of ``lives`` (life label -> vLLM request
    id, in arrival order); :class:`RequestNotFound` when it means none. ``read_in_part``: why
    the log was not read to its end, when it was not (the request may be past it)."""
    if not name:  # a part of every id: it named them all ("ambiguous"), never one
        raise RequestNotFound(name)
    if name in lives:
        return [name]
    ids = list(dict.fromkeys(lives.values()))
    if name in ids:
        return [label for label, rid in lives.items() if rid == name]
    containing = [rid for rid in ids if name in rid]
    if len(containing) == 1:
        return [label for label, rid in lives.items() if rid == containing[0]]
    raise RequestNotFound(
        name,
        containing,
        () if containing else nearest(name, ids),
        read_in_part=read_in_part,
    )


def nearest(name: str, names: Iterable[str], n: int = 5) -> list[str]:
    """Up to ``n`` of ``names`` spelled most like ``name``."""
    return difflib.get_close_matches(name, sorted(set(names)), n=n, cutoff=0.5)
