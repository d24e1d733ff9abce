"""The tiers a chunk can be in, as the core names them, and how a load plan writes them.

Two tiers, both known to the core only through recorded facts:

- ``pool``: the host chunk pool, the primary tier. The core keeps its index
  (``ChunkIndex``): which chunk is in which slot, folded from the save and load facts.
- ``remote``: the shared tier behind the pool, whatever its medium (Redis, a directory, a
  registered plug-in: ``connector/tiers.py`` opens it). The core knows of it what its
  recorded facts say (``RemoteFound``, ``RemoteSaveDone``, ``RemoteLoadFailed``,
  ``RemoteOutage``/``RemoteRestored``; ``tracker/remote.py`` folds them into
  ``ChunkIndex.remote``).

A load plan (``LoadPlanned.slots``) names each chunk's tier in its slot: a slot ``>= 0`` is
a host pool slot, a negative one names another tier. The log format has one such code, -1,
the remote tier; it is mapped here and nowhere else, so that the plans, the worker and the
views ask this module which tier a slot names (design note 18).

Pure: no I/O.
"""

from __future__ import annotations

__all__ = ["POOL", "REMOTE", "REMOTE_SLOT", "slot_of", "tier_of_slot"]

POOL = "pool"
REMOTE = "remote"
# The slot a load plan names for a chunk read from the remote tier (the log format's code).
REMOTE_SLOT = -1
_TIER_SLOTS = {REMOTE: REMOTE_SLOT}
_SLOT_TIERS = {slot: tier for tier, slot in _TIER_SLOTS.items()}


def tier_of_slot(slot: int) -> str | None:
    """The tier a load plan's ``slot`` names: :data:`POOL` for a host slot, :data:`REMOTE`
    for :data:`REMOTE_SLOT`, None for a code no tier has (a damaged or hostile log)."""
    return POOL if slot >= 0 else _SLOT_TIERS.get(slot)


def slot_of(tier: str) -> int:
    """The slot code a load plan writes for a chunk read from ``tier`` (not the pool, whose
    chunks are named by their own slot)."""
    return _TIER_SLOTS[tier]
