"""vLLM's real engine on CPU with the disk tier (``remote_url`` ``file:///dir``,
``connector/disk.py``): one engine writes its chunks to a directory; a second engine, whose
host pool starts empty, loads them from the files; a third finds some files gone and some
damaged, which are load failures vLLM recomputes. Every request finishes with the same tokens
as without the connector, and every log checks clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _verdicts import events_of

from kvledger.connector.testing.engine import EngineSpec
from kvledger.tracker import events as ev

from .conftest import EngineRuns, Workload, assert_same_outputs, prompts, run_workloads

BLOCK = 32
ENGINE = dict(num_blocks=5, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
WORKLOAD = "disk"


def _workloads(model: str) -> list[Workload]:
    # Prompts of full chunks and a tail, a shared prefix: every chunk is written, then found.
    ps = prompts(model, 23, [70, 90, 100], shared_prefix=40)
    return [Workload(WORKLOAD, [(ps, 16)])]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk") / "chunks"


def _run(model: str, directory: Path) -> EngineRuns:
    extra = {"chunk_size": BLOCK, "remote_url": directory.as_uri()}
    return run_workloads(EngineSpec(model=model, extra_config=extra, **ENGINE), _workloads(model))


@pytest.fixture(scope="module")
def base(tiny_model: str) -> EngineRuns:
    spec = EngineSpec(model=tiny_model, connector=False, **ENGINE)
    return run_workloads(spec, _workloads(tiny_model))


@pytest.fixture(scope="module")
def writer(tiny_model: str, directory: Path, base: EngineRuns) -> EngineRuns:
    return _run(tiny_model, directory)


@pytest.fixture(scope="module")
def reader(tiny_model: str, directory: Path, writer: EngineRuns) -> EngineRuns:
    return _run(tiny_model, directory)


@pytest.fixture(scope="module")
def damaged(tiny_model: str, directory: Path, reader: EngineRuns) -> EngineRuns:
    for i, path in enumerate(sorted(directory.iterdir())):
        if i % 2:
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[-3] ^= 0x5A
            path.write_bytes(bytes(data))
    return _run(tiny_model, directory)


def test_a_second_engine_loads_the_first_ones_chunks_from_the_files(
    base: EngineRuns, writer: EngineRuns, reader: EngineRuns, directory: Path
) -> None:
    assert writer.total(WORKLOAD, "remote_chunks_saved") > 0
    assert any(directory.glob("*.0.kvl2"))
    assert reader.total(WORKLOAD, "remote_chunks_loaded") > 0
    for runs in (writer, reader):
        assert_same_outputs(base, runs, WORKLOAD)  # every request, token for token
        runs.assert_check_clean()
        assert runs.stats.violations_total == 0


def test_files_gone_or_damaged_are_recomputed_and_recorded(
    base: EngineRuns, damaged: EngineRuns
) -> None:
    assert_same_outputs(base, damaged, WORKLOAD)
    damaged.assert_check_clean()
    assert damaged.total(WORKLOAD, "remote_chunks_loaded") == 0  # nothing damaged was loaded
    assert damaged.log_path is not None
    events = events_of(damaged.log_path)
    reasons = {e.reason for e in events if isinstance(e, ev.RemoteLoadFailed)}
    assert "checksum" in reasons, reasons
    assert any(isinstance(e, ev.LoadFailed) for e in events)  # vLLM recomputed them
