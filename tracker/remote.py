"""The remote tier's fold: how the recorded facts about the shared store change what the
tracker believes it holds (``ChunkIndex.remote``), and the pure helpers the lookup needs.

A remote store changes under us (another replica writes, the server evicts or restarts), so
nothing here assumes: the index of remote keys is exactly what the recorded events say, and a
replay of the log rebuilds it, hence every lookup answer and load plan that counted on it.

- ``RemoteFound``: a lookup asked the store; the keys it found are present (but a distrusted
  one: below), the others not;
- ``RemoteSaveDone``: a write was confirmed: present, and trusted again. ``RemoteSaveFailed``
  changes nothing;
- ``RemoteLoadFailed``: a load found the key gone, short or corrupt: not present. One whose
  value was not this chunk's (:data:`FOREIGN_REASONS`: another chunk's, rank's or layout's,
  not signed with the shared secret, another format: ``connector/values.py`` checks) is also
  a violation, ``foreign_value``: someone wrote to the tier what no engine of this layout
  saved there. Nothing was loaded (the load failed and vLLM recomputed), so the request does
  not fall back to recompute: its own save of the chunk writes the right value back. Until
  this engine's write of the key is confirmed, the key is *distrusted*: a lookup that finds
  it does not count it (the store holds a value, not this chunk's), so a tier whose value
  keeps being foreign costs one failed load per key, not one per lookup;
- ``RemoteOutage`` / ``RemoteRestored``: the store is down (nothing is offered from it, and
  what it held before is forgotten, except by a load its lookup already counted:
  ``RemoteKeys.loadable``) or back.

A fact that says something impossible (``tracker.wellformed``: a ``RemoteFound`` with 2 keys
and 5 answers, say) changes nothing: nothing says which answer belongs to which key.

No I/O: the connector talks to the tier ``remote_url`` opens (``connector/tiers.py``: Redis,
a directory, a plug-in) and reports these facts, the same for every tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvledger.tracker import events as ev
from kvledger.tracker.chunks import ChunkIndex, RemoteKeys, chunk_keys
from kvledger.tracker.state import RequestState
from kvledger.tracker.violation import Violation
from kvledger.tracker.wellformed import malformed

__all__ = [
    "FOREIGN_REASONS",
    "FORMAT",
    "MISPLACED",
    "REMOTE_EFFECTS",
    "REMOTE_TYPES",
    "UNAUTHENTICATED",
    "WRONG_LAYOUT",
    "WRONG_RANK",
    "apply_remote",
    "foreign",
    "foreign_violations",
    "lookup_keys",
]

# Why a value read from the tier is not the chunk asked for (connector/values.py); each is
# the start of a RemoteLoadFailed's reason, ``<name>[: <detail>]``.
MISPLACED = "misplaced"  # it names another chunk key: swapped between keys
WRONG_RANK = "wrong_rank"  # another tensor-parallel worker's share
WRONG_LAYOUT = "wrong_layout"  # written by an engine whose KV bytes mean something else
UNAUTHENTICATED = "unauthenticated"  # no MAC, or a wrong one, under the shared secret
FORMAT = "format"  # not a value of this format (an older kvledger's, or not kvledger's)
FOREIGN_REASONS = (MISPLACED, WRONG_RANK, WRONG_LAYOUT, UNAUTHENTICATED, FORMAT)


def foreign(reason: str) -> bool:
    """Whether a ``RemoteLoadFailed``'s reason says the value was not this chunk's (rather
    than gone, damaged, refused or unavailable)."""
    return reason.partition(":")[0] in FOREIGN_REASONS


def foreign_violations(event: ev.Event) -> list[Violation]:
    """``foreign_value`` for a well-formed ``RemoteLoadFailed`` whose value was not its
    chunk's: the tier served someone else's bytes under this key (never loaded)."""
    if event.__class__ is not ev.RemoteLoadFailed:
        return []
    assert isinstance(event, ev.RemoteLoadFailed)
    if not foreign(event.reason) or malformed(event):
        return []
    detail = {"keys": "|".join(k.hex() for k in event.keys), "reason": event.reason}
    return [Violation("foreign_value", event.step, event.req_id, "RemoteLoadFailed", detail)]


def _found(remote: RemoteKeys, e: ev.Event) -> None:
    assert isinstance(e, ev.RemoteFound)
    remote.add(k for k, f in zip(e.keys, e.found, strict=True) if f)
    remote.discard(k for k, f in zip(e.keys, e.found, strict=True) if not f)


def _saved(remote: RemoteKeys, e: ev.Event) -> None:
    assert isinstance(e, ev.RemoteSaveDone)
    remote.add(e.keys, written=True)


def _lost(remote: RemoteKeys, e: ev.Event) -> None:
    assert isinstance(e, ev.RemoteLoadFailed)
    if foreign(e.reason):
        remote.distrust(e.keys)
    else:
        remote.discard(e.keys)


def _nothing(remote: RemoteKeys, e: ev.Event) -> None:
    pass


REMOTE_EFFECTS: dict[type[ev.Event], Callable[[RemoteKeys, ev.Event], None]] = {
    ev.RemoteFound: _found,
    ev.RemoteSaveDone: _saved,
    ev.RemoteSaveFailed: _nothing,
    ev.RemoteLoadFailed: _lost,
    ev.RemoteOutage: lambda remote, e: remote.set_up(False),
    ev.RemoteRestored: lambda remote, e: remote.set_up(True),
}

# The remote tier's event types: they change the remote index only, never a request's state.
REMOTE_TYPES: tuple[type[ev.Event], ...] = tuple(REMOTE_EFFECTS)


def apply_remote(index: ChunkIndex, event: ev.Event) -> None:
    """Fold one remote fact into the index's remote keys (a malformed one: no change)."""
    if not malformed(event):
        REMOTE_EFFECTS[event.__class__](index.remote, event)


def lookup_keys(
    state: RequestState, all_token_ids: Sequence[int], num_tokens: int, chunk_size: int
) -> list[bytes]:
    """The keys of the full chunks of ``all_token_ids[:num_tokens]``, as the lookup's fold
    will know them: the request's known keys, extended over the tokens it does not know yet
    (what the connector asks the store about before it asks the tracker)."""
    known = state.keys
    n = num_tokens // chunk_size
    if len(known) >= n:
        return known[:n]
    prev = known[-1] if len(known) else state.root
    return known[:] + chunk_keys(prev, all_token_ids[: n * chunk_size], chunk_size, len(known))
