"""What a wrapped connector says it holds: its own KV events, folded.

A recorder's log (connector/recorder.py) cannot see the wrapped connector's store, but where
the connector publishes KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, collected by vLLM through ``take_events`` every step: LMCache's adapter
with ``enable_kv_events``, vLLM's OffloadingConnector, KVLedgerConnector with KV events on),
the recorder logs them (``InnerStored``, ``InnerRemoved``), and :class:`InnerStore` folds them
into what the connector said it stored and dropped, and when.

An entry is one of the connector's keys: the tokens it covers (``block_size`` of the event's
``token_ids``), its parent key, and so where it starts: its parent's end (0 for a key without
a parent). A key whose parent the log never saw stored cannot be placed, and is skipped (it
was stored before the log began, under a parent the log does not name).

:meth:`InnerStore.cover` answers, for a request's tokens, which of them the connector stored
under the same prefix, following the keys from a root while their tokens match. The
connector's own hashing is never recomputed: two keys with the same tokens under the same
parent are the same prefix, whatever hash function named them.

Pure: no I/O. Memory is bounded by :data:`MAX_TOKENS` token ids held in entries (the oldest
entries forgotten first; a forgotten key's children can no longer be reached from a root).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvledger.tracker import events as ev
from kvledger.tracker.wellformed import malformed

__all__ = ["MAX_TOKENS", "Entry", "InnerStore", "Piece"]

MAX_TOKENS = 1 << 24  # as explain's history of computed prefixes (replay/explainer.py)


class Entry(NamedTuple):
    parent: bytes
    start: int
    tokens: tuple[int, ...]
    stored: int  # the step of its InnerStored
    removed: int | None  # the step of the InnerRemoved that dropped it (None: held)


class Piece(NamedTuple):
    """Tokens ``[start, end)`` of a request, stored by the connector as one key: ``stored``
    at that step, ``removed`` at that step (None: held, as far as its events say)."""

    start: int
    end: int
    stored: int
    removed: int | None


class InnerStore:
    """The connector's published stores and removals (see the module docstring)."""

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.children: dict[bytes, list[bytes]] = {}  # parent key -> keys stored under it
        # What the connector publishes: stores with their token ids, removals. Until it has
        # published a removal, a store not offered may have been dropped silently.
        self.stores = 0
        self.with_tokens = 0
        self.removals = 0
        # Stores under a parent key the log never saw stored (LMCache names the parent of a
        # store call's first chunk 0 when the call starts past the prompt's first chunk):
        # where they lie is unknown, so "never stored" cannot be said while there are any.
        self.unplaced = 0
        # Sizes of keys some other key continues: the connector's whole units (a prompt's
        # partial tail is never continued).
        self.whole_sizes: set[int] = set()
        self.tokens = 0  # token ids held in entries
        self.forgotten = 0  # entries forgotten for the bound

    def apply(self, e: ev.Event) -> None:
        if e.__class__ is ev.InnerStored:
            assert isinstance(e, ev.InnerStored)
            if not malformed(e):
                self._stored(e)
        elif e.__class__ is ev.InnerRemoved:
            assert isinstance(e, ev.InnerRemoved)
            if not malformed(e):
                self._removed(e)

    def _stored(self, e: ev.InnerStored) -> None:
        self.stores += 1
        if not e.token_ids or e.block_size <= 0:
            return  # nothing to match a request's tokens with
        self.with_tokens += 1
        parent = e.parent
        if parent:
            above = self.entries.get(parent)
            if above is None:
                self.unplaced += 1  # stored under a key this log never saw: cannot be placed
                return
            start = above.start + len(above.tokens)
            self.whole_sizes.add(len(above.tokens))
        else:
            start = 0
        size = e.block_size
        for i, key in enumerate(e.hashes):
            tokens = e.token_ids[i * size : (i + 1) * size]
            old = self.entries.pop(key, None)
            if old is not None:
                self.tokens -= len(old.tokens)
            if old is None or old.parent != parent:
                self.children.setdefault(parent, []).append(key)
            if i:
                self.whole_sizes.add(size)
            self.entries[key] = Entry(parent, start, tokens, e.step, None)
            self.tokens += len(tokens)
            parent, start = key, start + size
        while self.tokens > MAX_TOKENS:
            self._forget(next(iter(self.entries)))

    def _removed(self, e: ev.InnerRemoved) -> None:
        self.removals += 1
        keys = e.hashes or tuple(k for k, v in self.entries.items() if v.removed is None)
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.removed is None:
                self.entries[key] = entry._replace(removed=e.step)

    def _forget(self, key: bytes) -> None:
        entry = self.entries.pop(key)
        self.tokens -= len(entry.tokens)
        self.forgotten += 1
        under = self.children.get(entry.parent)
        if under is not None and key in under:
            under.remove(key)
            if not under:
                del self.children[entry.parent]

    def cover(self, tokens: Sequence[int]) -> list[Piece]:
        """The connector's keys that hold ``tokens`` from the first one on, in order: at each
        step down, a held key before a dropped one, then the longer (a whole key before a
        prompt's tail under the same parent), then the one stored last."""
        out: list[Piece] = []
        parent, pos, n = b"", 0, len(tokens)
        while pos < n:
            best: tuple[bool, int, int, bytes, Entry] | None = None
            for key in self.children.get(parent, ()):
                entry = self.entries[key]
                size = len(entry.tokens)
                if pos + size > n or tuple(tokens[pos : pos + size]) != entry.tokens:
                    continue
                rank = (entry.removed is None, size, entry.stored)
                if best is None or rank > best[:3]:
                    best = (*rank, key, entry)
            if best is None:
                break
            key, entry = best[3], best[4]
            end = pos + len(entry.tokens)
            out.append(Piece(pos, end, entry.stored, entry.removed))
            parent, pos = key, end
        return out

    def held_whole(self, tokens: Sequence[int], limit: int) -> Piece | None:
        """The last of the connector's whole keys it still holds for ``tokens``, every key
        before it held too, ending at or before ``limit``: what it could have offered (None:
        nothing)."""
        last = None
        for piece in self.cover(tokens):
            if piece.removed is not None or piece.end > limit:
                break
            if piece.end - piece.start in self.whole_sizes:
                last = piece
        return last
