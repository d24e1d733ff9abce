"""Named checks run after each fold. A failure is a ``Violation`` value, never an assert.

Each check reads the state after an event (and the event) and returns a Violation or None.
``CHECKS_BY_EVENT`` says which checks run after which event type, so the decode hot path runs
only the three that a decode step can break.
"""

from __future__ import annotations

from collections.abc import Callable

from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.state import Phase, RequestState
from kvledger.tracker.violation import Violation

__all__ = [
    "ALL_CHECKS",
    "CHECKS_BY_EVENT",
    "check",
    "load_within_allocation",
    "saved_le_computed",
    "tokens_match_schedule",
    "tokens_within_blocks",
]


Check = Callable[[RequestState, ev.Event, TrackerConfig], "Violation | None"]


def _v(rule: str, e: ev.Event, **detail: int | str) -> Violation:
    return Violation(rule, e.step, e.req_id, type(e).__name__, dict(detail))


def tokens_within_blocks(s: RequestState, e: ev.Event, cfg: TrackerConfig) -> Violation | None:
    """Tokens being computed fit in the block table (else slot mappings get truncated)."""
    cap = len(s.block_ids) * cfg.block_size
    if s.phase is Phase.RUNNING and s.num_tokens > cap:
        return _v("tokens_within_blocks", e, num_tokens=s.num_tokens, capacity=cap)
    return None


def tokens_match_schedule(s: RequestState, e: ev.Event, cfg: TrackerConfig) -> Violation | None:
    """``num_tokens == num_computed + num_scheduled``, and the token ids are known up to at
    most ``max_async_lag`` not-yet-sampled tokens (async scheduling)."""
    if not isinstance(e, ev.Scheduled) or s.phase is not Phase.RUNNING:
        return None
    expected = e.num_computed + e.num_scheduled
    if s.num_tokens != expected:
        return _v("tokens_match_schedule", e, num_tokens=s.num_tokens, expected=expected)
    if len(s.token_ids) < s.num_tokens - cfg.max_async_lag:
        return _v(
            "tokens_known",
            e,
            tokens_known=len(s.token_ids),
            num_tokens=s.num_tokens,
            max_async_lag=cfg.max_async_lag,
        )
    return None


def saved_le_computed(s: RequestState, e: ev.Event, cfg: TrackerConfig) -> Violation | None:
    """Nothing counts as saved beyond the KV that exists."""
    if s.phase is Phase.RUNNING and s.saved > s.num_tokens:
        return _v("saved_le_computed", e, saved=s.saved, num_tokens=s.num_tokens)
    if s.save.cursor > s.num_tokens and s.phase is Phase.RUNNING:
        return _v("saved_le_computed", e, save_cursor=s.save.cursor, num_tokens=s.num_tokens)
    return None


def load_within_allocation(s: RequestState, e: ev.Event, cfg: TrackerConfig) -> Violation | None:
    """A load stays inside the blocks, inside what vLLM counts computed, and short of the
    last token."""
    load = s.load
    if load is None or load.done or s.phase is not Phase.RUNNING:
        return None
    cap = len(s.block_ids) * cfg.block_size
    if load.end > cap or load.end > s.num_computed or load.end >= len(s.token_ids):
        return _v(
            "load_within_allocation",
            e,
            load_end=load.end,
            capacity=cap,
            num_computed=s.num_computed,
            tokens_known=len(s.token_ids),
        )
    return None


ALL_CHECKS: tuple[Check, ...] = (
    tokens_within_blocks,
    tokens_match_schedule,
    saved_le_computed,
    load_within_allocation,
)

CHECKS_BY_EVENT: dict[type[ev.Event], tuple[Check, ...]] = {
    ev.Scheduled: (tokens_within_blocks, tokens_match_schedule, saved_le_computed),
    ev.LoadPlanned: (load_within_allocation,),
    ev.SavePlanned: (saved_le_computed,),
    ev.LoadFailed: (saved_le_computed,),
}


def check(
    state: RequestState | None,
    event: ev.Event,
    config: TrackerConfig,
    checks: tuple[Check, ...] | None = None,
) -> list[Violation]:
    """Run the checks that apply after ``event`` (or the given ones)."""
    if state is None:
        return []
    out: list[Violation] = []
    for fn in CHECKS_BY_EVENT.get(type(event), ()) if checks is None else checks:
        v = fn(state, event, config)
        if v is not None:
            out.append(v)
    return out
