"""The plain values that cross between vLLM's scheduler process and its worker processes.

Scheduler -> worker, once per step: a ``StepPlan`` (in the connector metadata), made of
``TransferPlan``s of ``ChunkTransfer``s. Worker -> scheduler, once per step and rank: a
``WorkerReport`` (in the worker metadata, or in the connector stats on the releases without
it: connector/edge.py).
``connector.scheduler`` and ``connector.worker`` both import them from here and never import
each other. The transfer plans are made by the tracker's pure planning code
(``tracker.plans.transfer_plan``), so their classes are defined there and named here.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs

from kvledger.tracker.digests import DigestPlan, DigestReport
from kvledger.tracker.plans import ChunkTransfer, TransferPlan

__all__ = ["ChunkTransfer", "StepPlan", "TransferPlan", "WorkerReport"]


class StepPlan(NamedTuple):
    """What the scheduler tells the worker for one step (travels in the connector metadata).

    A named tuple, not an attrs class: one is built on every step of vLLM's scheduler, and a
    tuple is built in one C call where a frozen attrs instance sets each field through
    ``object.__setattr__``, some 7 us a steady step on a 2-vCPU VM (docs/performance.md).
    Change one with ``_replace``."""

    step: int
    loads: tuple[TransferPlan, ...] = ()
    saves: tuple[TransferPlan, ...] = ()
    # Blocks vLLM counts as loaded but that we refuse to fill: the worker reports them through
    # get_block_ids_with_load_errors so vLLM's recompute policy recomputes them.
    refused_blocks: tuple[int, ...] = ()
    preempted: tuple[str, ...] = ()
    # request_finished returned True for these: the worker reports each in finished_sending
    # once no save of it is in flight, and only then may vLLM free its blocks.
    delayed_free: tuple[str, ...] = ()
    # Blocks to digest this step (connector/digests.py); None with digests off.
    digests: DigestPlan | None = None


@attrs.frozen
class WorkerReport:
    """What one worker (one ``rank``) tells the scheduler; travels in
    ``kv_connector_worker_meta``. Under tensor or pipeline parallelism every rank holds a
    share of each chunk, so the scheduler confirms a chunk only when every rank reported it."""

    saves_done: tuple[tuple[str, tuple[bytes, ...]], ...] = ()
    saves_failed: tuple[tuple[str, tuple[bytes, ...]], ...] = ()
    loads_done: tuple[str, ...] = ()
    loads_failed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    rank: int = 0
    # The remote tier's results (connector/tiers.py): (what, req id, chunk keys, reason),
    # what being "saved" (the server confirmed the writes), "save_failed" or "load_failed".
    remote: tuple[tuple[str, str, tuple[bytes, ...], str], ...] = ()
    # The KV-content digests of this rank (connector/digests.py); None with digests off.
    digests: DigestReport | None = None

    def merged(self, other: WorkerReport) -> WorkerReport:
        """This rank's results of two moments, in order."""
        return WorkerReport(
            self.saves_done + other.saves_done,
            self.saves_failed + other.saves_failed,
            self.loads_done + other.loads_done,
            self.loads_failed + other.loads_failed,
            self.rank,
            self.remote + other.remote,
            _merged(self.digests, other.digests),
        )

    def __bool__(self) -> bool:
        return bool(
            self.saves_done
            or self.saves_failed
            or self.loads_done
            or self.loads_failed
            or self.remote
            or self.digests
        )

    def to_plain(self) -> list[Any]:
        """Lists, strings, bytes and ints only: travels through any serialiser vLLM uses for
        connector stats (pickle, msgpack, msgspec)."""
        return [
            [[r, list(k)] for r, k in self.saves_done],
            [[r, list(k)] for r, k in self.saves_failed],
            list(self.loads_done),
            [[r, list(b)] for r, b in self.loads_failed],
            self.rank,
            [[w, r, list(k), why] for w, r, k, why in self.remote],
            None if self.digests is None else self.digests.to_plain(),
        ]

    @classmethod
    def from_plain(cls, data: Any) -> WorkerReport:
        saves_done, saves_failed, loads_done, loads_failed, rank, *rest = data
        remote = rest[0] if rest else ()
        digests = rest[1] if len(rest) > 1 else None
        return cls(
            tuple((str(r), tuple(bytes(x) for x in k)) for r, k in saves_done),
            tuple((str(r), tuple(bytes(x) for x in k)) for r, k in saves_failed),
            tuple(str(r) for r in loads_done),
            tuple((str(r), tuple(int(x) for x in b)) for r, b in loads_failed),
            int(rank),
            tuple(
                (str(w), str(r), tuple(bytes(x) for x in k), str(why)) for w, r, k, why in remote
            ),
            None if digests is None else DigestReport.from_plain(digests),
        )


def _merged(a: DigestReport | None, b: DigestReport | None) -> DigestReport | None:
    if a is None or b is None:
        return a if b is None else b
    return a.merged(b)
