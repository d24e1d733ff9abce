"""Test helpers that read the chunk index."""

from __future__ import annotations

from kvledger.tracker.chunks import ChunkIndex


def stored_items(index: ChunkIndex) -> list[tuple[bytes, int | None]]:
    """(key, slot) of every stored chunk, least recently used first."""
    return [(key, index.slot_of(key)) for key in index]
