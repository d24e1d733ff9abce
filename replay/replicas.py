"""``kvledger check --replicas``: several engines' logs that shared one remote tier, judged
together: what each saved against what the others loaded.

One log judges a load by the digests it knows: its own (the blocks it computed) and those the
value carried (the saver's, stored with the value: connector/values.py). A value forged by
someone who can write to the tier and knows the format, without the shared secret, can carry
digests that agree with its forged bytes, and then the loading engine's log alone calls the
load verified. The saver's log holds the digests the saver really computed: read together,
the logs catch it. So, over every log given:

- the *computed* book: every digest a replica computed (``BlockDigested``, not carried), by
  (rank, block key);
- each loaded block (``LoadDigested``) whose digest after the load is none the replicas
  computed for its key (while some replica computed one) is ``replica_digest_mismatch``,
  unless its own log already said so (``digest_mismatch``, ``load_unchanged``);
- each digest a value carried that is none the replicas computed for its key (while some
  replica computed one) is ``replica_digest_mismatch`` too: the value's header lied.

What cannot be judged is counted, not a problem: a block no given log computed (the saver's
log is not among them). Memory: the digests of every log given (a digest book's worth each).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvledger.replay.results import Problem
from kvledger.replay.source import LogPath, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.wellformed import malformed

__all__ = ["RULE", "ReplicaCheck", "cross_check"]

RULE = "replica_digest_mismatch"
_MASK = (1 << 64) - 1


@attrs.define
class ReplicaCheck:
    """The logs' cross-check: its problems (in the order of the logs given), and counts."""

    logs: list[str]
    problems: list[Problem] = attrs.field(factory=list)
    judged: int = 0  # loaded blocks and carried digests some replica computed a digest for
    unjudged: int = 0  # ... that no given log computed a digest for
    remote_loaded: int = 0  # chunks the logs loaded from the remote tier
    saved_elsewhere: int = 0  # ... of which another given log saved to the tier

    def to_dict(self) -> dict[str, Any]:
        return {
            "logs": self.logs,
            "problems": [p.to_dict() for p in self.problems],
            "judged": self.judged,
            "unjudged": self.unjudged,
            "remote_loaded": self.remote_loaded,
            "saved_elsewhere": self.saved_elsewhere,
        }


def _hex(d: int) -> str:
    return f"{d & _MASK:016x}"


def _events(path: LogPath) -> Iterable[tuple[ev.Event, Any]]:
    src = open_log(path)
    for frame in src.frames():
        for e in frame.events:
            yield e, frame


def cross_check(paths: Sequence[LogPath]) -> ReplicaCheck:
    """Judge every log's loads against the digests all the logs' engines computed."""
    from kvledger.tracker.tiers import REMOTE_SLOT

    computed: dict[tuple[int, bytes], set[int]] = {}
    saved: list[set[bytes]] = []
    for path in paths:
        mine: set[bytes] = set()
        for e, _ in _events(path):
            if isinstance(e, ev.BlockDigested) and not e.carried and not malformed(e):
                for key, digest in zip(e.keys, e.digests, strict=True):
                    computed.setdefault((e.rank, key), set()).add(digest)
            elif isinstance(e, ev.RemoteSaveDone):
                mine.update(e.keys)
        saved.append(mine)
    out = ReplicaCheck([str(p) for p in paths])
    for i, path in enumerate(paths):
        others: set[bytes] = set().union(*(s for j, s in enumerate(saved) if j != i))
        own: dict[tuple[int, bytes], set[int]] = {}  # this log's book, carried included
        for e, frame in _events(path):
            if isinstance(e, ev.LoadPlanned):
                for key, slot in zip(e.keys, e.slots, strict=False):
                    if slot == REMOTE_SLOT:
                        out.remote_loaded += 1
                        out.saved_elsewhere += key in others
            elif isinstance(e, ev.BlockDigested) and not malformed(e):
                for n, (key, digest) in enumerate(zip(e.keys, e.digests, strict=True)):
                    own.setdefault((e.rank, key), set()).add(digest)
                    if e.carried:
                        _judge(out, computed, e, frame, e.start + n, key, digest, "carried")
            elif isinstance(e, ev.LoadDigested) and not malformed(e):
                for n, (key, after) in enumerate(zip(e.keys, e.after, strict=True)):
                    known = own.get((e.rank, key))
                    if known and after not in known:
                        continue  # its own log's digest rules name it already
                    _judge(out, computed, e, frame, e.start + n, key, after, "loaded")
    return out


def _judge(
    out: ReplicaCheck,
    computed: dict[tuple[int, bytes], set[int]],
    e: ev.BlockDigested | ev.LoadDigested,
    frame: Any,
    block: int,
    key: bytes,
    digest: int,
    what: str,
) -> None:
    expected = computed.get((e.rank, key))
    if not expected:
        out.unjudged += 1
        return
    out.judged += 1
    if digest in expected:
        return
    step = e.judged_step if isinstance(e, ev.LoadDigested) else e.step
    detail = (
        f"{what} block {block} key {key.hex()}: {_hex(digest)}, but the replicas computed "
        f"{'|'.join(map(_hex, sorted(expected)))}" + (f" (rank {e.rank})" if e.rank else "")
    )
    out.problems.append(
        Problem(
            "violation",
            RULE,
            step,
            e.req_id,
            e,
            path=getattr(frame, "path", ""),
            offset=getattr(frame, "offset", -1),
            seq=getattr(frame, "seq", -1),
            detail=detail,
        )
    )
