"""The records of a log that say something impossible, named as ``kvledger check`` names them.

The rules are ``tracker.wellformed``'s, asked here and written nowhere else: its
:class:`~tracker.wellformed.Wellformed`, fed every record of a log once, in log order (the
remote store's outages and returns are judged against the records before them), is what the
``Tracker`` asks about every input of ``check``'s replay and ``tracker.recorded_rules`` about
every record of a recorder's log. The views ask it through :class:`MalformedRecords`, fed the
records of their walk (``tracker.history.walk``, or ``labelled`` where nothing is folded):
``explain`` lists the records it finds under its report, ``show --request`` marks each row of the
request's life with the rules its record breaks, and ``show``'s list of requests (:func:`read`)
names every malformed record of the log, about one request or none.

A ``StepDecoded`` that is well formed is also read entry by entry, as every reader of one
reads it (``tracker.decoded``): its numbers resolved under the log's request numbering
(``tracker.numbering``: ``RequestAdded`` and ``Finished`` decide it; in kvledger's own log a
``RequestAdded`` the fold refuses takes none, ``state.starts_life``), so blocks or tokens
that do not pair with its numbers are ``decoded_blocks`` and a number no live request holds is
``decoded_unknown``, here as in ``check``. (Whether an entry could have been a steady step,
``decoded_not_steady``, is a judgement of the fold: ``check`` makes it.)

A malformed record is named by its rule (one per malformation: ``field_negative``,
``field_lengths``, ...), at its own step (the step of the frame it was read from) and its
position in the log (0-based, every record counted): the rule, the step and the position are
``check``'s, on a connector's log and on a recorder's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from kvledger.replay.source import LogPath, LogSource, open_log
from kvledger.tracker import decoded
from kvledger.tracker import events as ev
from kvledger.tracker.history import Folded, Labelled, labelled
from kvledger.tracker.numbering import RequestNumbers
from kvledger.tracker.state import starts_life
from kvledger.tracker.violation import Violation
from kvledger.tracker.wellformed import Wellformed

__all__ = ["KEPT", "Malformed", "MalformedRecords", "detail_text", "read"]

KEPT = 10_000
"""The malformed records a reader keeps, at most (a hostile log may hold millions); every one
is still counted, by rule."""


def detail_text(v: Violation) -> str:
    """A violation's numbers as ``check`` prints them (and the ``Tracker`` records them in
    ``ViolationRecorded.detail``): ``field=keys/found,lengths=2/5``."""
    return ",".join(f"{k}={val}" for k, val in v.detail.items())


@attrs.frozen
class Malformed:
    """One rule a record breaks: the record's position, step and request, the rule, and the
    field and numbers (``detail``, as ``check`` prints them)."""

    index: int  # the record's position in the log (0-based, every record counted): check's
    step: int  # the record's own step
    req_id: str  # the request id it carries ("": none)
    request: str  # its request's life label ("": about no request)
    event: str  # its type
    rule: str
    detail: str
    path: str  # the file and byte offset of the frame it was read from
    offset: int

    def describe(self) -> str:
        """``step 2 #5 ChunkStored: field_negative (field=slot,value=-1)``."""
        who = f" {self.request}" if self.request else ""
        tail = f" ({self.detail})" if self.detail else ""
        return f"step {self.step} #{self.index} {self.event}{who}: {self.rule}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


class MalformedRecords:
    """Every malformed record of one log, fed its walk in order (:meth:`feed`, each item of
    ``tracker.history.walk``, a record yielded again for another request counted once): the
    first :data:`KEPT` rules broken kept in :attr:`records`, all counted in :attr:`by_rule`.
    ``recorded``: a recorder's log, whose ``StepDecoded`` carries a token per number."""

    __slots__ = (
        "_check",
        "_found",
        "_numbers",
        "_pos",
        "_recorded",
        "by_rule",
        "keep",
        "records",
        "total",
    )

    def __init__(self, keep: int = KEPT, *, recorded: bool = False) -> None:
        self._check = Wellformed().check
        self._numbers = RequestNumbers()
        self._recorded = recorded
        self._pos = -1
        self._found: list[Violation] = []
        self.keep = keep
        self.records: list[Malformed] = []
        self.by_rule: Counter[str] = Counter()
        self.total = 0

    def feed(self, item: Folded | Labelled) -> list[Violation]:
        """The rules ``item``'s record breaks (empty: none). A record is judged once, at its
        first item: a ``StepDecoded`` comes again for each request it advances."""
        if item.pos == self._pos:
            return self._found
        self._pos = item.pos
        e = item.event
        found = self._found = self._check(e)
        cls = e.__class__
        if cls is ev.Finished or (
            # The Tracker numbers only a request its fold gives a state; a recorder, every one.
            isinstance(e, ev.RequestAdded) and (self._recorded or starts_life(e))
        ):
            self._numbers.follow(e)
        elif cls is ev.StepDecoded and not found:  # a malformed one is read no further
            assert isinstance(e, ev.StepDecoded)
            found = self._found = decoded.entries(e, self._numbers.req_of, tokens=self._recorded)[1]
        if found:
            self.total += len(found)
            self.by_rule.update(v.rule for v in found)
            room = self.keep - len(self.records)
            frame = item.frame
            for v in found[: max(0, room)]:
                self.records.append(
                    Malformed(
                        index=item.pos,
                        step=e.step,
                        req_id=e.req_id,
                        request=item.life,
                        event=v.event,
                        rule=v.rule,
                        detail=detail_text(v),
                        path=str(getattr(frame, "path", "")),
                        offset=getattr(frame, "offset", -1),
                    )
                )
        return found

    def to_dict(self) -> dict[str, Any]:
        """``{"total": n, "by_rule": {rule: n}, "records": [...]}``: every rule broken
        counted, the kept records listed (``--json``)."""
        return {
            "total": self.total,
            "by_rule": dict(self.by_rule.most_common()),
            "records": [r.to_dict() for r in self.records],
        }


def read(path: LogPath | LogSource, keep: int = KEPT) -> MalformedRecords:
    """Every malformed record of a log, read once without a fold (``tracker.history.labelled``:
    each record with its position and its request's life)."""
    src = open_log(path)
    records = MalformedRecords(keep, recorded=src.recorded)
    feed = records.feed
    for item in labelled(src.frames()):
        feed(item)
    return records
