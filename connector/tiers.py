"""Storage tiers behind the host pool: one interface, one registry, one boundary.

The host pool (``connector/store.py``) is the primary tier: the tracker keeps its index,
every plan names its slots, and the transfer backend moves its bytes on the compute
device's streams. Behind it, ``remote_url`` names one shared tier by its URL's scheme: Redis
(``redis://``, ``rediss://``, ``unix://``: ``connector/remote.py``), a directory
(``file://``: ``connector/disk.py``), or any tier an installed package names by an entry
point (group ``kvledger.tiers``) or registered with :func:`register_tier`. (vLLM 0.33's
kv_offload is built the same way: a primary CPU tier, and ``SecondaryTierManager``s
registered by name and module path in ``SecondaryTierFactory``.)

A tier moves chunk bytes and says what happened; it decides nothing. The scheduler and
worker sides (``connector/scheduler.py``, ``connector/worker.py``) talk to it only through
:class:`Tier`, and record what it did as the remote tier's facts (``RemoteFound``,
``RemoteSaveDone``, ``RemoteSaveFailed``, ``RemoteLoadFailed``, ``RemoteOutage``,
``RemoteRestored``), which the tracker folds (``tracker/remote.py``) and a plan counts on
(``tracker/tiers.py``: the load plan's slot -1). So adding a tier is one module with a class
that keeps :class:`Tier`'s contract, and its tests: nothing in the sides, the tracker or the
log format changes (design note 18).

The contract, which the sides rely on to keep a serving engine up:

- a chunk is named by its 16-byte chunk key; a tier stores each worker rank's share apart
  (``rank``). It stores a value (``connector/values.py``: a header that binds the bytes to
  their chunk key, rank and KV layout, with their checksums or MAC, then the chunk's bytes)
  and returns it verbatim: the worker seals every value before ``put`` and checks every value
  after ``get``, so a tier never decides whether bytes are a chunk's, and cannot forget to
  (design note 21);
- ``exists``, ``get`` and ``put`` either answer for every key (in order), or raise: a raise
  means the tier is not serving us (an outage, recorded once until it answers again). The
  sides catch everything a tier raises and record :func:`down_reason` of it; nothing
  reaches vLLM;
- a tier's reason is one line: :data:`MISSING`, ``refused: <error>`` (this chunk's own
  command failed; the others and the tier are fine) or ``unavailable[: <error>]`` (written by
  the sides when the tier is down); the value's check adds its own (``length``,
  ``checksum``, and ``tracker.remote.FOREIGN_REASONS``: not this chunk's);
- the scheduler side's instance (``scheduler=True``) answers ``exists`` within its lookup
  bound: it runs on vLLM's scheduler thread.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvledger.connector.config import (
    REDIS_SCHEMES,
    TIER_ENTRY_POINTS,
    TIER_SCHEMES,
    ConnectorConfig,
    ConnectorConfigError,
    tier_target,
)

if TYPE_CHECKING:
    from kvledger.connector.values import Sealed

__all__ = [
    "MISSING",
    "REDIS_TIER",
    "REFUSED",
    "UNAVAILABLE",
    "Tier",
    "TierUnavailable",
    "down_reason",
    "open_tier",
    "register_tier",
    "registered_tiers",
    "serving",
]

# Why a chunk's read or write failed, as the facts record it (RemoteLoadFailed,
# RemoteSaveFailed): no such key; an error reply to its own command; the tier was down.
MISSING = "missing"
REFUSED = "refused"
UNAVAILABLE = "unavailable"
# The tier a Redis URL opens (connector.config checks Redis URLs itself).
REDIS_TIER = ("kvledger.connector.remote", "RemoteStore")


class TierUnavailable(Exception):
    """The tier is not serving us; the message is ``Type: message`` of the cause, scrubbed."""


@runtime_checkable
class Tier(Protocol):
    """A chunk store behind the host pool. Opened once per side and rank by
    ``from_config(config, *, rank, scheduler)``, a classmethod of the class registered."""

    #: What the logs and errors call it: ``redis``, ``file``, ...
    name: str

    def available(self) -> bool:
        """False while it backs off after a failure: nothing is asked of it meanwhile."""
        ...

    def check(self, *, startup: bool = False) -> str | None:
        """One cheap round trip: None if it serves us, else why not. At ``startup``, a tier
        that answers but refuses the configuration raises ``ConnectorConfigError``."""
        ...

    def check_chunk_bytes(self, chunk_bytes: int) -> None:
        """Raise ``ConnectorConfigError`` if it cannot hold a chunk of ``chunk_bytes``."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        """1 for each key it holds, else 0."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | str]:
        """Each key's value exactly as stored, or why it cannot be read (:data:`MISSING`,
        ``refused: <error>``). The worker checks the value (``connector/values.py``)."""
        ...

    def put(self, items: Sequence[tuple[bytes, Sealed]]) -> list[str | None]:
        """Store each (key, value): ``value.head()`` then ``value.payload``, verbatim (or
        ``value.head_len`` zeros, the payload, then the head over the zeros). None once
        stored for good (readable by every engine sharing the tier), else why not. A reader
        sees a whole value or none."""
        ...

    def describe(self, exc: BaseException) -> str:
        """``Type: message`` of ``exc``, one line, bounded, with no secret in it."""
        ...

    def close(self) -> None:
        """Let go of its connections or files; never raises."""
        ...


def register_tier(scheme: str, module_path: str, class_name: str) -> None:
    """Make ``remote_url`` ``<scheme>://...`` open ``module_path``'s ``class_name`` (a
    :class:`Tier`, with a ``from_config`` classmethod), in this process, from now on. The
    module is imported when a tier is opened. vLLM opens the tier in processes of its own (the
    engine core's, the workers'), which a call in the serving script does not reach: there, a
    package names its tier as an entry point instead, found in every process::

        [project.entry-points."kvledger.tiers"]
        mytier = "mypackage.tier:MyTier"
    """
    if not scheme.isascii() or not scheme.isalnum() or scheme != scheme.lower():
        raise ValueError(f"a tier's scheme is lower-case letters and digits, got {scheme!r}")
    if scheme in REDIS_SCHEMES:
        raise ValueError(f"{scheme}:// is the Redis tier's")
    target = (module_path, class_name)
    if TIER_SCHEMES.get(scheme, target) != target:
        raise ValueError(f"{scheme}:// already opens {':'.join(TIER_SCHEMES[scheme])}")
    TIER_SCHEMES[scheme] = target


def registered_tiers() -> dict[str, tuple[str, str]]:
    """Every scheme known besides Redis's (registered, or an installed package's entry
    point), and the (module, class) it opens."""
    for point in entry_points(group=TIER_ENTRY_POINTS):
        tier_target(point.name)
    return dict(TIER_SCHEMES)


def _tier_class(url: str) -> Any:
    """The class ``url``'s scheme opens, imported only then (no tier's client is imported by
    a connector that does not use it). connector.config let only a Redis URL or a registered
    scheme's through."""
    scheme = url.partition("://")[0]
    module_path, class_name = tier_target(scheme) or REDIS_TIER
    try:
        return getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConnectorConfigError(
            f"remote_url {scheme}:// opens {module_path}:{class_name}, which cannot be "
            f"loaded: {type(exc).__name__}: {exc}"
        ) from None


def open_tier(config: ConnectorConfig, *, rank: int = 0, scheduler: bool) -> Tier | None:
    """The tier ``config.remote_url`` names, opened for one side (None: no remote tier).
    At startup, a tier that cannot serve this configuration raises ``ConnectorConfigError``;
    one that is down is served around (the scheduler records the outage)."""
    if config.remote_url is None:
        return None
    cls = _tier_class(config.remote_url)
    scheme = config.remote_url.partition("://")[0]
    if not callable(getattr(cls, "from_config", None)):
        raise ConnectorConfigError(
            f"remote_url {scheme}:// opens {':'.join(tier_target(scheme) or REDIS_TIER)}, "
            "which has no from_config: not a connector.tiers.Tier"
        )
    _check_interface(cls, scheme)
    tier: Tier = cls.from_config(config, rank=rank, scheduler=scheduler)
    if not isinstance(tier, Tier):
        raise ConnectorConfigError(
            f"remote_url {scheme}:// opened a {type(tier).__name__}, which lacks some of "
            "kvledger.connector.tiers.Tier's methods"
        )
    return tier


def _check_interface(cls: Any, scheme: str) -> None:
    """A tier written for the interface before values were sealed by the worker
    (``get(keys, expected_len)``: it checked the bytes itself, or forgot to) refuses to start:
    it would be handed sealed values it does not expect."""
    get = getattr(cls, "get", None)
    try:
        params = inspect.signature(get).parameters if callable(get) else {}
    except (TypeError, ValueError):  # a builtin or C method: nothing to read
        return
    if "expected_len" in params:
        raise ConnectorConfigError(
            f"remote_url {scheme}:// opens {cls.__module__}:{cls.__qualname__}, written for "
            "kvledger's earlier Tier interface (get(keys, expected_len)): a tier now stores and "
            "returns values verbatim, and the worker checks them (docs/remote.md, Writing a "
            "tier): drop expected_len and any check of your own"
        )


def down_reason(tier: Tier, exc: Exception) -> str:
    """What an exception a tier raised says, for the log: a ``TierUnavailable``'s own
    message (already scrubbed by the tier), or the tier's ``describe`` of anything else; its
    type alone when ``describe`` raises too (the message may hold a secret)."""
    if isinstance(exc, TierUnavailable):
        return str(exc)
    try:
        return str(tier.describe(exc))
    except Exception:  # a tier's own bug: the sides still record the outage
        return type(exc).__name__


def serving(tier: Tier) -> bool:
    """``tier.available()``; False when it raises: a tier that cannot tell is not asked, and
    what the sides would have asked of it fails as unavailable (a miss, or a recompute)."""
    try:
        return bool(tier.available())
    except Exception:
        return False
