"""The steady batch: the decode step of the running requests, checked as one.

``Tracker.decode_step_ok`` decides a steady step request by request: a few comparisons, but a
Python call per request per step. When a step was steady for every running request, the next
one usually is too: the same requests, in the same order, each one token further. A
``SteadyBatch`` holds what those checks need for all of them at once (their numbers, the count
each must be at, how far their limits and block tables reach), so the next step is checked
with a list comparison and two integer comparisons, and the tracker advances the requests by
one shared counter. It decides exactly what ``decode_step_ok`` would: anything it cannot prove
the same way (a request's limit or capacity reached, another event about any request since,
vLLM's counts not the expected ones) is left to the request-by-request path, which then says
what happens.

Pure data and integer arithmetic, no I/O: the tracker builds it (``Tracker.steady_batch``) and
advances it (``Tracker.batch_step``); the connector's adapter holds it between steps.
"""

from __future__ import annotations

import operator

__all__ = ["SteadyBatch"]


class SteadyBatch:
    """The requests of a step that was steady for each of them, ready for the next.

    ``req_ids`` in vLLM's order (the step's running requests), ``nums`` their request numbers
    (a ``StepDecoded``'s), ``counts`` the ``num_computed`` each must be at next step.
    ``room``: steady steps left before some request's limit (``steady_limit``), the same for
    every step since the limits do not move while the batch lives. ``caps``: tokens each block
    table holds; ``cap_room`` a lower bound of ``min(caps[i] - counts[i])``, recomputed only when
    it runs out (a table grows by a block about every ``block_size`` steps). ``changes``: the
    tracker's count of other events when the batch was last right (any other event may move a
    limit: the batch is then rebuilt)."""

    __slots__ = ("cap_room", "caps", "changes", "counts", "nums", "req_ids", "room")

    def __init__(
        self,
        req_ids: list[str],
        nums: tuple[int, ...],
        counts: list[int],
        limits: list[int],
        caps: list[int],
        changes: int,
    ) -> None:
        self.req_ids = req_ids
        self.nums = nums
        self.counts = counts
        self.room = min(map(operator.sub, limits, counts))
        self.caps = caps
        self.cap_room = min(map(operator.sub, caps, counts))
        self.changes = changes

    def fits(self, num_computed: list[int], grown: list[tuple[int, int]], block_size: int) -> bool:
        """Whether this step (vLLM's ``num_computed`` per request, in order; ``grown``: (index,
        block id) of those whose table grew by one block) is one steady step for each, as
        ``Tracker.decode_step_ok`` would find it. Changes nothing."""
        if num_computed != self.counts or self.room < 1:
            return False
        if self.cap_room >= 1:
            return True
        # The lower bound ran out: the exact room, with this step's blocks.
        caps = self.caps
        if grown:
            caps = list(caps)
            for i, _ in grown:
                caps[i] += block_size
        room: int = min(map(operator.sub, caps, self.counts))
        return room >= 1

    def advance(self, grown: list[tuple[int, int]], block_size: int) -> None:
        """One steady step taken (after ``fits``)."""
        caps = self.caps
        for i, _ in grown:
            caps[i] += block_size
        if self.cap_room < 1:
            self.cap_room = min(map(operator.sub, caps, self.counts))
        self.counts = [c + 1 for c in self.counts]
        self.room -= 1
        self.cap_room -= 1
