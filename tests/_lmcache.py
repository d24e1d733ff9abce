"""LMCache's pinned releases for the ``lmcache`` tests (installed by ``make lmcache``).

Where a release is missing the tests are skipped, except in CI (``CI`` or
``KVLEDGER_REQUIRE_LMCACHE`` set): there a missing release is a failure, never a silent skip.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

__all__ = ["require_lmcache"]


def require_lmcache(versions: Sequence[str], *, mp: bool = False) -> None:
    """Skip (fail in CI) unless every version in ``versions`` is installed (``mp``: and what
    LMCache's MP server imports, ``build/lmcache-mp-deps``)."""
    from kvledger.connector.testing.lmcache import BUILD, missing_versions
    from kvledger.connector.testing.lmcache_mp import MP_DEPS

    missing = missing_versions(versions)
    if mp and not (MP_DEPS / ".installed").exists():
        missing.append(MP_DEPS.name)
    if missing:
        why = f"LMCache {', '.join(missing)} not installed under {BUILD} (make lmcache)"
        if os.environ.get("CI") or os.environ.get("KVLEDGER_REQUIRE_LMCACHE"):
            pytest.fail(f"{why}; CI requires it (CI / KVLEDGER_REQUIRE_LMCACHE is set)")
        pytest.skip(why)
