"""LMCache's pinned releases for the ``lmcache`` tests (installed by ``make lmcache``), and the
one child process per release that every such test of a pytest run reads.

Where a release is missing the tests are skipped, except in CI (``CI`` or
``KVLEDGER_REQUIRE_LMCACHE`` set): there a missing release is a failure, never a silent skip.

A child's start, importing vLLM and LMCache, costs 8 to 9 CPU-seconds, more than most of the
runs it then does. Three modules run LMCache (test_lmcache.py, test_zoo.py,
test_recorder_steady.py): each once made its own child for each release it reads, eleven in
all for five releases, in whichever pytest-xdist worker ran it, and two of them ran the same
recorded runs. So each module says at its import (``need``) which runs it reads against which
release. The first worker to ask for a release (``runs``) runs every run that any collected
module needs of it, each once, in one child, and writes the reports where every worker of the
run finds them; a worker that asks meanwhile waits for them. Run alone, a module runs only
what it needs.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["need", "require_lmcache", "runs"]

# A workload: a name of the adapter rig's workloads, or a spec of either rig.
Workloads = Callable[[], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class _Need:
    module: str
    workloads: Workloads  # called when first run: specs are imported only then
    bare: bool
    ways: tuple[bool, ...]  # the recorder's steady_decode of each recorded run


_NEEDS: dict[str, list[_Need]] = {}


def need(
    module: str,
    version: str,
    workloads: Workloads,
    *,
    bare: bool = False,
    ways: Sequence[bool] = (True,),
) -> None:
    """At ``module``'s import: the runs it reads against ``version``. Each workload is run
    recorded by KVLedgerRecorder (digests sampled) once for each of ``ways`` (its
    ``steady_decode``), and also bare where ``bare``."""
    _NEEDS.setdefault(version, []).append(_Need(module, workloads, bare, tuple(ways)))


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


def runs(module: str, version: str, shared_dir: Path) -> dict[str, Any]:
    """The reports of ``module``'s runs against ``version`` (LMCacheReport), by label: a
    workload's name for its bare run, ``NAME+recorded`` for the recorded one, and
    ``NAME+recorded@False`` for one recorded with ``steady_decode`` off. ``shared_dir``: the
    directory every worker of the run sees (the ``shared_dir`` fixture)."""
    needs = _NEEDS.get(version, [])
    assert any(n.module == module for n in needs), f"{module} never said it needs {version}"
    keyed, labels = _keyed(needs)
    require_lmcache([version], mp=any(run["mp"] for run in keyed.values()))
    reports = _shared_reports(version, keyed, shared_dir)
    return {
        label: dataclasses.replace(reports[key], workload=label)
        for (of, label), key in labels.items()
        if of == module
    }


def _keyed(
    needs: Sequence[_Need],
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    """Every run the needs name, once each, by a key of its spec and way; and the key each
    module's label names."""
    from kvledger.connector.testing.lmcache import EVENT_WORKLOADS, WORKLOADS
    from kvledger.connector.testing.lmcache_mp import LMCacheMPRun

    named = {**WORKLOADS, **EVENT_WORKLOADS}
    keyed: dict[str, dict[str, Any]] = {}
    labels: dict[tuple[str, str], str] = {}
    for n in needs:
        for workload in n.workloads():
            spec = named[workload] if isinstance(workload, str) else workload
            mp = isinstance(spec, LMCacheMPRun)
            fields = spec.to_fields() if mp else dataclasses.asdict(spec)
            ways: list[bool | None] = [None] if n.bare else []
            for way in [*ways, *n.ways]:
                key = json.dumps([mp, fields, way], sort_keys=True, default=str)
                keyed.setdefault(key, {"spec": spec, "way": way, "mp": mp})
                label = spec.name if way is None else f"{spec.name}+recorded"
                label += "" if way in (None, True) else f"@{way}"
                if labels.setdefault((n.module, label), key) != key:
                    # two runs of one module under one label: which is it?
                    raise ValueError(f"{n.module}: two different runs named {label!r}")
    return keyed, labels


def _shared_reports(version: str, keyed: dict[str, dict[str, Any]], root: Path) -> dict[str, Any]:
    """The reports of every keyed run: read where another worker wrote them, else run here
    in one child (every other worker that asks meanwhile waits on the lock) and written."""
    from kvledger.connector.testing.lmcache import LMCacheReport
    from kvledger.connector.testing.lmcache_mp import run_mixed, version_jobs

    where = root / "lmcache-runs" / version
    where.mkdir(parents=True, exist_ok=True)
    said = where / "reports.json"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not said.exists():
            try:
                jobs = []
                for i, run in enumerate(keyed.values()):
                    logs = None if run["way"] is None else str(where / f"run{i}")
                    way = True if run["way"] is None else run["way"]
                    for job in version_jobs(run["spec"], logs, "sampled", way, bare=False):
                        jobs.append({**job, "label": f"run{i}"})
                done = run_mixed(version, jobs)
                text = json.dumps(
                    {"reports": {k: done[f"run{i}"].to_json() for i, k in enumerate(keyed)}}
                )
            except Exception as exc:  # said once: the other workers fail with it, not again
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            said.with_suffix(".tmp").write_text(text)
            said.with_suffix(".tmp").rename(said)
        data = json.loads(said.read_text())
    if "error" in data:
        raise RuntimeError(f"LMCache {version}'s runs failed: {data['error']}")
    reports = {k: LMCacheReport.from_json(r) for k, r in data["reports"].items()}
    missing = keyed.keys() - reports.keys()
    assert not missing, f"LMCache {version}: runs asked for after its child ran: {missing}"
    return reports
