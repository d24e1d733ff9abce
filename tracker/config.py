"""The tracker's configuration: every number the fold and the plans depend on.

It is written into the log header, so a replay uses the configuration the run used, and a
what-if replay (``kvledger check --with chunk_size=512``) changes only what it names.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ABSENT_IN_OLD_HEADERS", "ConfigError", "TrackerConfig"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the key and what is accepted."""


# Upper bounds of the numbers that size something. A log header is input like any other: a
# header claiming 2**64 slots must be refused by name, never allocated (or looped over).
MAX_BLOCK_SIZE = 1 << 16  # tokens per vLLM block (vLLM uses 16 to 256)
MAX_CHUNK_SIZE = 1 << 24  # tokens per chunk
MAX_NUM_SLOTS = 1 << 32  # chunks in the host pool (a slot number is a uint32)
MAX_ASYNC_LAG = 1 << 30  # unsampled scheduled tokens (1 + drafts); a what-if check uses the top


# The value of a setting added after logs were written, for a header that lacks it: the
# behaviour the code had before the setting existed.
ABSENT_IN_OLD_HEADERS: dict[str, Any] = {"block_hits": False}


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer from {low} to {high}, got {value!r}")


def _of_type(name: str, value: object, t: type) -> None:
    if not isinstance(value, t):
        raise ConfigError(f"{name} must be a {t.__name__}, got {value!r}")


@attrs.frozen(slots=True)
class TrackerConfig:
    """Configuration of the fold, the plans and the chunk index.

    - ``block_size``: vLLM's tokens per KV block.
    - ``chunk_size``: tokens per saved chunk; a multiple of ``block_size``.
    - ``num_slots``: how many chunks the host pool holds (the index's bound).
    - ``discard_partial_chunks``: never save the partial *block* at the end of a prefill (with
      ``block_hits``, the whole blocks of its partial chunk are saved anyway); without
      ``block_hits``, never save the prefill's partial chunk at all.
    - ``block_hits``: hits at block granularity: a prompt whose first N whole blocks are in
      the pool is offered N blocks, however ``chunk_size`` divides them (design note 14).
      A log written before this setting existed reads it as False: its run decided by whole
      chunks, and a replay must decide as it did.
    - ``save_decode_cache``: also save chunks completed during decode.
    - ``salt``: model and layout identity mixed into every chunk key, so chunks of two models
      (or two layouts) can never match.
    - ``max_async_lag``: how many scheduled tokens may not be sampled yet (async scheduling: 1;
      with speculative decoding, 1 + the number of draft tokens).
    - ``strict``: raise on the first violation (tests); the default records it and falls back
      to recompute.
    """

    block_size: int = 16
    chunk_size: int = 256
    num_slots: int = 1024
    discard_partial_chunks: bool = True
    save_decode_cache: bool = False
    block_hits: bool = True
    salt: str = ""
    max_async_lag: int = 1
    strict: bool = False

    def __attrs_post_init__(self) -> None:
        _int_in("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _int_in("chunk_size", self.chunk_size, 1, MAX_CHUNK_SIZE)
        _int_in("num_slots", self.num_slots, 1, MAX_NUM_SLOTS)
        if self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        _int_in("max_async_lag", self.max_async_lag, 0, MAX_ASYNC_LAG)
        # A string "no" is truthy: a flag must be a real bool, or a header means its opposite.
        for flag in ("discard_partial_chunks", "save_decode_cache", "block_hits", "strict"):
            _of_type(flag, getattr(self, flag), bool)
        _of_type("salt", self.salt, str)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrackerConfig:
        """Build from a header or user dict; an unknown key is an error naming it."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown tracker config key(s) {unknown}; accepted: {sorted(known)}")
        return cls(**data)

    def saved_tail_end(self, prefill_end: int) -> int:
        """Where the save of a prefill that ends at ``prefill_end`` stops in its partial chunk:
        at the prefill's end without ``discard_partial_chunks``; at its last whole block with
        ``block_hits``; else at the chunk's start (nothing of it is saved). The one home of
        that rule: the save plan, the steady-decode bound and ``explain`` read it here."""
        if not self.discard_partial_chunks:
            return prefill_end
        unit = self.block_size if self.block_hits else self.chunk_size
        return prefill_end // unit * unit

    @classmethod
    def from_header(cls, data: dict[str, Any]) -> TrackerConfig:
        """Build from a log header's config: a setting the header lacks was written before
        the setting existed, and takes the value that reproduces that run's behaviour
        (``ABSENT_IN_OLD_HEADERS``), not today's default."""
        return cls.from_dict({**ABSENT_IN_OLD_HEADERS, **data})

    def with_changes(self, **changes: Any) -> TrackerConfig:
        return self.from_dict({**self.to_dict(), **changes})
