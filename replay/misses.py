"""What a missed token is: the model ``kvledger explain`` reports in, and every reader counts in.

A lookup's tokens split into tokens **hit** (:data:`HITS`: vLLM's prefix cache, the host pool,
the remote tier, the wrapped connector's tiers on a recorder's log, the last token recomputed by
rule) and tokens **missed**, each span of them a :class:`Miss` with exactly one reason
(:data:`REASONS`) and the facts behind it. :class:`AdmissionMisses` is one admission's split,
:class:`RequestMisses` a request life's, :class:`Tally` any sum of them. Finding the reasons is
``replay.explain``'s walk; ``stats``, the tables, the timeline, the Perfetto trace and the
OpenTelemetry spans read these values, never the walk's insides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

import attrs

__all__ = [
    "HITS",
    "NOTES",
    "REASONS",
    "RECORDED_NOTE",
    "AdmissionMisses",
    "Miss",
    "RequestMisses",
    "Tally",
    "totals",
    "zero_hits",
]

# Every reason a missed token can have, in the order reports list them, and what it means.
REASONS: dict[str, str] = {
    "new_prefix": "never computed by any earlier request in this log",
    "prefix_diverged": "computed before under the same prefix, up to token k where this prompt "
    "differs: the chunk holding them is keyed by all of its tokens",
    "different_salt": "the same tokens were computed under another salt (the request's "
    "cache_salt, or an earlier run's model or layout): chunk keys differ",
    "earlier_run": "computed by an earlier run (--earlier LOG): that engine's host pool is not "
    "this one's, and no shared tier was seen holding it",
    "partial_chunk": "the tokens asked end inside a block (or chunk): partial ones are not saved "
    "(discard_partial_chunks), or these tokens lie inside a longer chunk",
    "decode_not_saved": "computed as decode output, which is not saved (save_decode_cache off)",
    "save_failed": "its save failed (or was cancelled: computed over a failed load)",
    "being_computed": "another request of this run was computing it in the step the lookup "
    "asked: nothing of it was saved yet",
    "save_in_flight": "its save was planned, or due, and not confirmed when the lookup asked",
    "evicted": "evicted from the host pool: its slot went to another request's save (or it "
    "left outside the plans, reset_cache)",
    "dropped": "dropped from the host pool after a load of it failed",
    "pool_full": "never saved: the pool had no free slot and every stored chunk was pinned",
    "remote_down": "the remote tier, which held it, was down at the lookup",
    "remote_evicted": "the remote tier held it once and did not any more (evicted, expired, "
    "restarted empty)",
    "foreign_value": "the remote tier held a value under its key that is not this chunk's "
    "(another chunk's, rank's or layout's, or not signed with the shared secret): refused, never "
    "loaded (a load that counted on it failed and vLLM recomputed; later lookups do not count it "
    "until this engine writes the chunk)",
    "load_failed": "vLLM accepted it, its load failed, and vLLM recomputed from there",
    "load_refused": "vLLM counted it as loaded; the tracker refused the load (a violation) and "
    "vLLM recomputed it",
    "recompute_only": "the pool held it (or could have), but a violation had made the request "
    "(or the one that computed it) fall back to recompute: no load, no save",
    "not_accepted": "offered to vLLM, which accepted fewer tokens",
    "inner_not_offered": "the wrapped connector's KV events say it stored it and still held "
    "it, yet it did not offer it: a silently shortened hit",
    "inner_evicted": "computed before in this run; the wrapped connector stored it and its KV "
    "events say it dropped it",
    "inner_never_stored": "computed before in this run; the wrapped connector's KV events name "
    "no store of it",
    "not_offered": "computed before in this run but not offered by the wrapped connector: "
    "why is in its private store, which a recorder's log cannot show (it publishes no KV "
    "events with their tokens)",
    "unexplained": "the log does not say: the recorded answer and the fold disagree, or the "
    "token ids are not in the log",
}

# The parts of the tokens hit, in order.
HITS: dict[str, str] = {
    "local": "vLLM's own prefix cache",
    "pool": "loaded from the host pool",
    "remote": "loaded from the remote tier",
    "inner": "loaded by the wrapped connector (a recorder's log: its tiers are its own)",
    "last_token": "the last token of a prompt the cache held whole: vLLM computes it for its "
    "logits (a rule, not a miss)",
}

NOTES = (
    "tokens asked: the prompt, and on a re-admission the output so far, at the lookup vLLM "
    "acted on (the last one before the admission)",
    "vLLM's own prefix cache counts as hit (local); the pool's hits count from there on",
    "the last token of a prompt the cache held whole is recomputed by vLLM for its logits: "
    "it counts as hit (last_token), by rule, not as a miss",
)
RECORDED_NOTE = (
    "a recorder's log holds what vLLM was offered, not the wrapped connector's store: a "
    "token computed before in this run but not offered is not_offered, and why is not in "
    "the log"
)


class Miss(NamedTuple):
    """Tokens ``[start, end)`` of an admission's lookup, missed for ``reason``."""

    start: int
    end: int
    reason: str
    step: int | None = None  # when the fact that explains it happened
    by: str | None = None  # the request involved: the evicting one, the one that computed it
    at_token: int | None = None  # prefix_diverged: the first token that differs
    detail: str = ""

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        d = self._asdict()
        d["tokens"] = self.tokens
        return d

    def describe(self) -> str:
        """The reason with its facts, in words."""
        by, step, detail = self.by, self.step, self.detail
        text = _FACTS.get(self.reason, "")
        if self.reason == "evicted" and by is None:
            text = "evicted at step {step}"
        if ("{by}" in text and by is None) or ("{step}" in text and step is None):
            text = ""
        text = text.format(by=by, step=step, at=self.at_token)
        if detail:
            text = f"{text}: {detail}" if text else detail
        return f"{self.reason} ({text})" if text else self.reason


# How each reason's facts read (Miss.describe).
_FACTS = {
    "prefix_diverged": "differs at token {at} from what {by} computed at step {step}",
    "different_salt": "computed by {by} at step {step}",
    "partial_chunk": "computed by {by} at step {step}",
    "decode_not_saved": "decode output of {by} at step {step}",
    "save_failed": "{by}'s save failed at step {step}",
    "being_computed": "computed by {by} in step {step}, as the lookup asked",
    "save_in_flight": "saved by {by} from step {step}",
    "evicted": "evicted at step {step} to make room for {by}",
    "dropped": "dropped at step {step}: {by}'s load of it failed",
    "pool_full": "{by} found no slot at step {step}",
    "remote_down": "down since step {step}",
    "remote_evicted": "since step {step}",
    "foreign_value": "refused at step {step}",
    "load_failed": "failed at step {step}; vLLM recomputed",
    "recompute_only": "{by}, at step {step}",
    "inner_not_offered": "stored by the wrapped connector at step {step}, still held",
    "inner_evicted": "dropped by the wrapped connector at step {step}",
    "inner_never_stored": "computed by {by} at step {step}; no store of it published",
    "not_offered": "computed by {by} at step {step}",
}


@attrs.define
class AdmissionMisses:
    """One admission: its lookup's tokens, hit and missed (see the module docstring)."""

    request: str
    req_id: str
    admission: int  # 1 for the first, 2 after a preemption, ... (the admissions table's)
    step: int
    lookup_step: int | None
    asked: int
    hit: dict[str, int]  # HITS -> tokens
    misses: list[Miss]
    accepted: int = 0
    loaded: int = 0  # tokens the load plan loads (before any failure)
    load_result: str | None = None
    load_seconds: float | None = None
    wall_ns: int = 0

    @property
    def tokens_hit(self) -> int:
        return sum(self.hit.values())

    @property
    def missed_tokens(self) -> int:
        return sum(m.tokens for m in self.misses)

    def reasons(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for m in self.misses:
            out[m.reason] += m.tokens
        return _ordered(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "req_id": self.req_id,
            "admission": self.admission,
            "step": self.step,
            "lookup_step": self.lookup_step,
            "tokens_asked": self.asked,
            "tokens_hit": self.tokens_hit,
            "missed_tokens": self.missed_tokens,
            "hit": dict(self.hit),
            "reasons": self.reasons(),
            "misses": [m.to_dict() for m in self.misses],
            "accepted": self.accepted,
            "loaded": self.loaded,
            "load_result": self.load_result,
            "load_seconds": self.load_seconds,
        }


def _ordered(counts: Counter[str]) -> dict[str, int]:
    return {r: counts[r] for r in REASONS if counts.get(r)}


def zero_hits() -> dict[str, int]:
    return dict.fromkeys(HITS, 0)


@attrs.define
class RequestMisses:
    """One request life's admissions, and their sums."""

    request: str
    req_id: str
    admissions: list[AdmissionMisses] = attrs.field(factory=list)

    def totals(self) -> dict[str, Any]:
        return totals(self.admissions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "req_id": self.req_id,
            **self.totals(),
            "admissions": [a.to_dict() for a in self.admissions],
        }


class Tally:
    """Sums over admissions: tokens asked, hit by part, missed by reason."""

    def __init__(self) -> None:
        self.admissions = 0
        self.asked = 0
        self.hits = zero_hits()
        self.reasons: Counter[str] = Counter()

    def add(self, a: AdmissionMisses) -> None:
        self.admissions += 1
        self.asked += a.asked
        for k, v in a.hit.items():
            self.hits[k] += v
        for m in a.misses:
            self.reasons[m.reason] += m.tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "admissions": self.admissions,
            "tokens_asked": self.asked,
            "tokens_hit": sum(self.hits.values()),
            "missed_tokens": sum(self.reasons.values()),
            "hit": dict(self.hits),
            "reasons": _ordered(self.reasons),
        }


def totals(admissions: Iterable[AdmissionMisses]) -> dict[str, Any]:
    """The sums of ``admissions``: tokens asked, hit by part, missed by reason."""
    tally = Tally()
    for a in admissions:
        tally.add(a)
    return tally.to_dict()
