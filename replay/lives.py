"""``show``: one request's life, a row per event with the request's state after it.

States are the recorded ones: the walk (``tracker.history.walk``) folds the recorded events,
input facts *and* decisions, under the configuration of the log's header, so each state is
exactly what the recording Tracker held after that event. (Re-deriving the decisions with this
version of the code and comparing them is ``kvledger check``'s job, not a view's.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from replay.format import describe_event
from replay.source import LogPath, LogSource, damage_dict, open_log
from tracker import events as ev
from tracker.config import TrackerConfig
from tracker.history import POOL, Folded, walk
from tracker.log import StopInfo

__all__ = ["RequestLife", "RequestNotFound", "Row", "show"]


class RequestNotFound(LookupError):
    """``show`` found no request with that id; ``candidates`` are ids that contain it."""

    def __init__(self, request: str, candidates: Sequence[str] = ()) -> None:
        self.request = request
        self.candidates = tuple(candidates)
        if len(self.candidates) > 1:
            shown = ", ".join(self.candidates[:10])
            more = "" if len(self.candidates) <= 10 else f" (+{len(self.candidates) - 10} more)"
            msg = f"request {request!r} is ambiguous: {shown}{more}"
        else:
            msg = f"no request {request!r} in the log"
        super().__init__(msg)


@attrs.frozen
class Row:
    """One event of a request's life and the request's state right after it."""

    index: int  # position of the event in the log (0-based, over all events)
    step: int
    event: str
    detail: str
    life: str
    phase: str
    tokens_known: int
    num_tokens: int
    num_computed: int
    block_ids: tuple[int, ...]
    saved: int
    saves_in_flight: int
    load: tuple[int, int] | None
    load_done: bool
    preempted: bool
    preemptions: int
    recompute_only: bool
    violation: str = ""  # the rule, on a ViolationRecorded row

    @property
    def blocks(self) -> int:
        return len(self.block_ids)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["block_ids"] = list(self.block_ids)
        d["load"] = None if self.load is None else list(self.load)
        d["blocks"] = self.blocks
        return d


class RequestLife(list[Row]):
    """``show``'s result: the rows, plus the request's id, the config and any read damage."""

    request: str
    config: TrackerConfig
    damage: StopInfo | None
    log: str

    def __init__(
        self,
        rows: Iterable[Row],
        request: str,
        config: TrackerConfig,
        damage: StopInfo | None,
        log: str,
    ) -> None:
        super().__init__(rows)
        self.request = request
        self.config = config
        self.damage = damage
        self.log = log

    def to_dict(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "request": self.request,
            "rows": [r.to_dict() for r in self],
            "damage": damage_dict(self.damage),
        }


def _row(item: Folded) -> Row:
    pos, e, label, s = item.pos, item.event, item.life, item.after
    violation = e.rule if isinstance(e, ev.ViolationRecorded) else ""
    if s is None:  # an event about a request the log never added
        return Row(pos, e.step, type(e).__name__, describe_event(e), label,
                   "unknown", 0, 0, 0, (), 0, 0, None, False, False, 0, False, violation)  # fmt: skip
    return Row(
        index=pos,
        step=e.step,
        event=type(e).__name__,
        detail=describe_event(e),
        life=label,
        phase=s.phase.name.lower(),
        tokens_known=len(s.token_ids),
        num_tokens=s.num_tokens,
        num_computed=s.num_computed,
        block_ids=tuple(s.block_ids),
        saved=s.saved,
        saves_in_flight=len(s.save.pending),
        load=None if s.load is None else (s.load.start, s.load.end),
        load_done=bool(s.load is not None and s.load.done),
        preempted=s.preempted,
        preemptions=s.life.num_preemptions,
        recompute_only=s.recompute_only,
        violation=violation,
    )


def show(path: LogPath | LogSource, request: str) -> RequestLife:
    """One request's life: a :class:`Row` per event of the request (every life of the id,
    when vLLM reused it), with the request's state after the event.

    ``request`` is the exact id, or a part of exactly one id (vLLM's ids carry long random
    suffixes); :class:`RequestNotFound` otherwise, with the ids that matched."""
    src = open_log(path)
    config, _ = src.lenient_config()
    rows = [_row(s) for s in walk(src.frames(), config, lambda rid: rid == request)]
    if rows:
        return RequestLife(rows, request, config, src.damage, src.name)
    damage = src.damage
    candidates: dict[str, None] = {}
    for frame in src.frames():
        for e in frame.events:
            if request in e.req_id and e.req_id != POOL:
                candidates[e.req_id] = None
    candidates_list = list(candidates)
    if len(candidates_list) != 1:
        raise RequestNotFound(request, candidates_list)
    rid = candidates_list[0]
    rows = [_row(s) for s in walk(src.frames(), config, lambda r: r == rid)]
    return RequestLife(rows, rid, config, src.damage or damage, src.name)
