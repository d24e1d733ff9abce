"""A tier kept in this process's memory, for the tests: ``remote_url`` ``memory://<name>``.

It is the proof that a tier plugs in through ``connector.tiers.Tier`` alone: this module and
the tests that use it are all it takes (``connector.tiers.register_tier``); nothing in the
scheduler or worker sides, the tracker or the log format knows it. Engines (scheduler and
worker sides) opening the same name share one store, as engines share a Redis server. The
tests reach the store (``STORES``) to lose or damage a chunk, and take the tier down
(``DOWN``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvledger.connector.config import ConnectorConfig, ConnectorConfigError
from kvledger.connector.tiers import MISSING, TierUnavailable, register_tier
from kvledger.connector.values import Sealed

__all__ = ["DOWN", "STORES", "MemoryTier", "register"]

# name -> {(chunk key, rank): bytes}
STORES: dict[str, dict[tuple[bytes, int], bytes]] = {}
# Names whose tier is down: every call raises.
DOWN: set[str] = set()


def register() -> None:
    register_tier("memory", __name__, "MemoryTier")


class MemoryTier:
    name = "memory"

    def __init__(self, url: str, rank: int) -> None:
        scheme, _, rest = url.partition("://")
        if scheme != "memory" or not rest or not rest.isidentifier():
            raise ConnectorConfigError(f"remote_url must be memory://<name>, got {url!r}")
        self.store_name = rest
        self.rank = rank
        self.calls: list[str] = []
        STORES.setdefault(rest, {})

    @classmethod
    def from_config(cls, config: ConnectorConfig, *, rank: int = 0, scheduler: bool) -> Any:
        assert config.remote_url is not None
        return cls(config.remote_url, rank)

    def _serving(self, op: str) -> dict[tuple[bytes, int], bytes]:
        self.calls.append(op)
        if self.store_name in DOWN:
            raise TierUnavailable(f"MemoryDown: {self.store_name} is down")
        return STORES[self.store_name]

    def available(self) -> bool:
        return True

    def check(self, *, startup: bool = False) -> str | None:
        try:
            self._serving("check")
        except TierUnavailable as exc:
            return str(exc)
        return None

    def check_chunk_bytes(self, chunk_bytes: int) -> None:
        pass

    def exists(self, keys: Sequence[bytes]) -> list[int]:
        store = self._serving("exists")
        return [1 if (k, self.rank) in store else 0 for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | str]:
        store = self._serving("get")
        return [store.get((key, self.rank), MISSING) for key in keys]

    def put(self, items: Sequence[tuple[bytes, Sealed]]) -> list[str | None]:
        store = self._serving("put")
        for key, value in items:
            store[(key, self.rank)] = value.to_bytes()
        return [None] * len(items)

    def describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        pass
