"""``explain``: why each lookup missed what it missed, every token, from the log alone.

At each admission, the lookup vLLM acted on (the last one before the request was scheduled)
asked about ``N`` tokens. They split into tokens **hit**:

- ``local``: vLLM's own prefix cache (``LookupAsked.local_hit``);
- ``pool`` and ``remote``: loaded from the host pool or the remote tier (the admission's
  ``LoadPlanned``, chunk by chunk, less what a failed load left vLLM to recompute); on a
  recorder's log ``inner``, the tokens the wrapped connector loaded (its tiers are its own);
- ``last_token``: the last token of a prompt the cache held whole. vLLM computes it anyway,
  for its logits (``external = hit - local - 1``): a rule, not a miss, so it counts as hit;

and tokens **missed**, each attributed to exactly one reason (:data:`REASONS`). A reason is
derived by the tracker's own rules, called here, never written again:
``tracker.plans.lookup_spans`` (the units a lookup reads, and their keys) and ``span_tier``
(where the lookup finds one), ``save_policy_end`` (which chunks the save policy leaves out),
``transfer_plan`` (which tier each loaded token came from), ``tracker.index_fold`` (the
pool's index, folded from the recorded events as the recording Tracker folded them) and
``tracker.history.walk`` (each request's state, as the Tracker held it).

For a unit the lookup missed, in this order: what the remote tier's recorded facts say (down,
or no longer holding it); what happened to its chunk in the pool (a save in flight, failed,
evicted by another request's save, dropped after a failed load); else what was computed
before under the same prefix (a trie of token sequences by parent key): nothing (a new
prefix), the same tokens up to token ``k`` (the prefix diverges), the same tokens in full
(never saved: by policy, after a violation, for want of a slot, or not yet), or the same tokens
under another chain root (another cache salt). A unit the pool holds after one it does not
is missed for the reason of that earlier one (a hit is a prefix).

Logs of earlier runs (``explain(..., earlier=[...])``, ``--earlier``) are read first, each as a
new engine (its own pool and requests): what they computed is history, so a prefix another
engine computed is ``earlier_run``, and one computed under another model or layout salt is
``different_salt``; the remote tier's recorded facts carry over (it is shared).

On a recorder's log (``connector/recorder.py``) no pool decision is recorded: explain shows
what the log can show (what vLLM was offered against what this run computed before) and names
the rest ``not_offered``: the wrapped connector's private store is not in the log.

A record that says something impossible (``tracker.wellformed``: a negative block id, keys and
answers of different lengths, ...) is read as the recording ``Tracker`` read it: the pool's,
the remote store's and the digests' folds take in nothing of it. The report
names each under ``malformed`` (``replay.malformed``): its rule, its step and its position, as
``kvledger check`` names it, on a connector's log and on a recorder's.

Memory follows the distinct token sequences computed (bounded by ``history_tokens``; beyond
it the oldest are forgotten and counted in ``forgotten``), plus a few numbers per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvledger.replay.explainer import HISTORY_TOKENS, Explainer
from kvledger.replay.malformed import MalformedRecords
from kvledger.replay.misses import (
    HITS,
    NOTES,
    REASONS,
    RECORDED_NOTE,
    AdmissionMisses,
    Miss,
    RequestMisses,
    Tally,
    totals,
)
from kvledger.replay.naming import resolve
from kvledger.replay.source import LogPath, LogSource, damage_dict, open_log
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.framing import StopInfo
from kvledger.tracker.history import walk

# The model is replay.misses and the walk replay.explainer: their names are here too, where
# users of the library met them first.
__all__ = [
    "HITS",
    "REASONS",
    "AdmissionMisses",
    "Explainer",
    "Explanation",
    "Miss",
    "RequestMisses",
    "Tally",
    "explain",
]

# --- the command's result ---------------------------------------------------------------------


@attrs.define
class Explanation:
    """What :func:`explain` found: every admission's tokens hit and missed, by request."""

    log: str
    recorded: bool
    config: TrackerConfig
    requests: list[RequestMisses]
    without_lookup: int = 0
    forgotten: int = 0
    request: str | None = None  # what --request narrowed it to
    damage: StopInfo | None = None
    # The earlier logs read before it (``earlier``) that could not be read to their end:
    # (log, damage). What they lack is history the reasons did not see.
    earlier_damage: tuple[tuple[str, StopInfo], ...] = ()
    # A recorder's log: the wrapped connector's KV events (tracker.inner_store), as counted.
    inner_stores: int = 0
    inner_removals: int = 0
    inner_unplaced: int = 0
    # The log's records that say something impossible, by the rules they break
    # (replay.malformed): every one counted, the first KEPT listed.
    malformed: MalformedRecords = attrs.Factory(MalformedRecords)

    def admissions(self) -> list[AdmissionMisses]:
        return [a for r in self.requests for a in r.admissions]

    def totals(self) -> dict[str, Any]:
        return totals(self.admissions())

    def notes(self) -> list[str]:
        notes = list(NOTES)
        if self.recorded and not self.inner_stores:
            notes.append(RECORDED_NOTE)
        elif self.recorded:
            notes.append(
                f"the wrapped connector published its KV events ({self.inner_stores} stores, "
                f"{self.inner_removals} removals): what it did not offer is split by them "
                "(inner_never_stored, inner_evicted, inner_not_offered)"
                + (
                    f"; {self.inner_unplaced} stores name a parent it never stored, so what "
                    "it never stored cannot be told (not_offered)"
                    if self.inner_unplaced
                    else ""
                )
                + ("" if self.inner_removals else "; it published no removal: a drop is unsaid")
            )
        if self.without_lookup:
            notes.append(
                f"{self.without_lookup} admissions had no lookup before them (nothing was "
                "asked): not counted"
            )
        if self.forgotten:
            notes.append(
                f"the history of computed prefixes outgrew its bound: {self.forgotten} "
                "sequences were forgotten (a token they held may read new_prefix)"
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "log": self.log,
            "kind": "recorded" if self.recorded else "kvledger",
            "request": self.request,
            "config": {
                "block_size": c.block_size,
                "chunk_size": c.chunk_size,
                "num_slots": c.num_slots,
                "discard_partial_chunks": c.discard_partial_chunks,
                "save_decode_cache": c.save_decode_cache,
                "block_hits": c.block_hits,
            },
            **self.totals(),
            "requests": [r.to_dict() for r in self.requests],
            "notes": self.notes(),
            "damage": damage_dict(self.damage),
            "earlier_damage": [
                {"log": log, **(damage_dict(d) or {})} for log, d in self.earlier_damage
            ],
            "malformed": self.malformed.to_dict(),
            # A recorder's log: the wrapped connector's KV events as explain counted them.
            "inner_events": {
                "stores": self.inner_stores,
                "removals": self.inner_removals,
                "unplaced": self.inner_unplaced,
            }
            if self.recorded
            else None,
        }


class _ByRequest:
    """The admissions an :class:`Explainer` hands out, gathered by request life."""

    def __init__(self) -> None:
        self.lives: dict[str, RequestMisses] = {}

    def keep(self, a: AdmissionMisses) -> None:
        r = self.lives.get(a.request)
        if r is None:
            r = self.lives[a.request] = RequestMisses(a.request, a.req_id)
        r.admissions.append(a)

    def requests(self, labels: Iterable[str]) -> list[RequestMisses]:
        """The lives named, in that order, each one's admissions in order."""
        out = [self.lives[label] for label in labels if label in self.lives]
        for r in out:
            r.admissions.sort(key=lambda a: a.admission)
        return out


def _explain_run(
    explainer: Explainer,
    frames: Iterable[Any],
    config: TrackerConfig,
    malformed: MalformedRecords | None = None,
    *,
    recorded: bool,
) -> dict[str, str]:
    """Feed one run's frames (a recorder's, when ``recorded``) through ``explainer`` (and
    ``malformed``, which names the records that say something impossible) to their end: every
    life label, in arrival order, with its request id."""
    labels: dict[str, str] = {}
    for item in walk(frames, config, recorded=recorded):
        if item.new and item.life:
            labels.setdefault(item.life, item.req_id)
        if malformed is not None:
            malformed.feed(item)
        explainer.feed(item)
    explainer.finish()
    return labels


def explain_frames(
    frames: Iterable[Any], config: TrackerConfig, *, name: str, recorded: bool = False
) -> Explanation:
    """:func:`explain` over frames that are no log on disk (``kvledger whatif``'s forecast: a
    run the tracker's rules replayed under other settings, ``replay/whatif.py``)."""
    by_request = _ByRequest()
    explainer = Explainer(config, by_request.keep, recorded=recorded)
    requests = by_request.requests(_explain_run(explainer, frames, config, recorded=recorded))
    return Explanation(
        log=name,
        recorded=recorded,
        config=config,
        requests=requests,
        without_lookup=explainer.without_lookup,
        forgotten=explainer.history.forgotten,
    )


def explain(
    path: LogPath | LogSource,
    *,
    request: str | None = None,
    earlier: Sequence[LogPath] = (),
    history_tokens: int = HISTORY_TOKENS,
) -> Explanation:
    """Explain every admission's lookup of a log (``request``: only that request, a life
    label like ``id#2`` or an id, all its lives; every request is still read, since what one
    computed explains another's misses). ``earlier``: logs of runs before it (the same engine
    before a restart, another replica, another model), read first: what they computed is
    history (``earlier_run``, ``different_salt``). An unknown ``request`` raises
    :class:`RequestNotFound` naming the nearest ids."""
    earlier_sources = [open_log(p) for p in earlier]  # every log readable before any is read
    src = open_log(path)
    config = src.config()
    recorded = src.recorded
    by_request = _ByRequest()
    explainer = Explainer(config, by_request.keep, recorded=recorded, history_tokens=history_tokens)
    for old in earlier_sources:
        old_config = old.config()
        explainer.new_run(old.name, old_config)
        _explain_run(explainer, old.frames(), old_config, recorded=old.recorded)
    explainer.new_run("", config)
    # The explained log's own malformed records, not the earlier runs'.
    malformed = MalformedRecords(recorded=recorded)
    labels = _explain_run(explainer, src.frames(), config, malformed, recorded=recorded)
    why = None if src.damage is None else src.damage.describe()
    chosen = list(labels) if request is None else resolve(request, labels, read_in_part=why)
    requests = by_request.requests(chosen)
    return Explanation(
        log=src.name,
        recorded=recorded,
        config=config,
        requests=requests,
        without_lookup=explainer.without_lookup,
        forgotten=explainer.history.forgotten,
        request=request,
        damage=src.damage,
        earlier_damage=tuple((old.name, old.damage) for old in earlier_sources if old.damage),
        malformed=malformed,
        inner_stores=explainer.inner.with_tokens,
        inner_removals=explainer.inner.removals,
        inner_unplaced=explainer.inner.unplaced,
    )
