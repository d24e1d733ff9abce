"""Request numbers: how ``StepDecoded`` names requests, a rule of the log format.

A request takes the lowest free number at the ``RequestAdded`` that starts its life and gives
it back at its ``Finished``. Those two recorded facts alone decide every number, so the
Tracker that writes a log and any reader of it (a replay, ``kvledger show``) assign the same
ones. (In kvledger's own log a ``RequestAdded`` whose prompt the fold refuses starts no life
and takes none: ``state.starts_life``. A recorder numbers every request it logs.) Numbers
stay small (bounded by the live requests), so a step's record stays small.
"""

from __future__ import annotations

import heapq

from kvledger.tracker import events as ev

__all__ = ["NUMBERED", "RequestNumbers"]

# The only events that change the numbers (``RequestNumbers.follow``).
NUMBERED = frozenset({ev.RequestAdded, ev.Finished})


class RequestNumbers:
    """``num_of`` (req id -> number) and ``req_of`` (number -> req id) are read directly on
    hot paths; they change only through ``take`` and ``give_back``, each of which that
    changes them bumps ``version`` (a reader that cached numbers knows whether they hold)."""

    __slots__ = ("_free", "_next", "num_of", "req_of", "version")

    def __init__(self) -> None:
        self.num_of: dict[str, int] = {}
        self.req_of: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0
        self.version = 0

    def take(self, req_id: str) -> int:
        """The request's number, taking the lowest free one if it has none."""
        num = self.num_of.get(req_id)
        if num is not None:
            return num
        if self._free:
            num = heapq.heappop(self._free)
        else:
            num, self._next = self._next, self._next + 1
        self.num_of[req_id] = num
        self.req_of[num] = req_id
        self.version += 1
        return num

    def follow(self, event: ev.Event) -> None:
        """The rule itself, for an event the fold accepted: a ``RequestAdded`` takes a number
        (a repeated one keeps it), a ``Finished`` gives it back; nothing else changes them."""
        cls = event.__class__
        if cls is ev.RequestAdded:
            self.take(event.req_id)
        elif cls is ev.Finished:
            self.give_back(event.req_id)

    def give_back(self, req_id: str) -> None:
        num = self.num_of.pop(req_id, None)
        if num is not None:
            del self.req_of[num]
            heapq.heappush(self._free, num)
            self.version += 1
