"""WorkerSide on CPU paged caches in both vLLM layouts: it executes hand-written StepPlans and
reports what happened; the KV-content oracle checks the bytes.

Geometry: blocks of 4 tokens, chunks of 8 tokens (two blocks), 2 layers, 2 KV heads of 4.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from fakes import hold_saves

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.messages import ChunkTransfer, StepPlan, TransferPlan, WorkerReport
from kvledger.connector.testing.faults import FaultyWorkerSide
from kvledger.connector.testing.oracle import KVOracle
from kvledger.connector.transfer import KVCacheLayoutError
from kvledger.connector.worker import WorkerSide

LAYOUTS = ["flash_attn", "flashinfer"]
B, C = 4, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def make(
    layout: str,
    *,
    num_blocks: int = 16,
    slots: int = 4,
    load_fault: Any = None,
    digests: str = "off",
) -> tuple[WorkerSide, KVOracle]:
    oracle = KVOracle(
        LAYERS, num_blocks=num_blocks, block_size=B, num_kv_heads=2, head_size=4, layout=layout
    )
    config = ConnectorConfig(chunk_size=C, digests=digests)
    worker = (
        WorkerSide(config, num_slots=slots, layout=layout)
        if load_fault is None
        else FaultyWorkerSide(config, num_slots=slots, layout=layout, load_fault=load_fault)
    )
    worker.register_kv_caches(oracle.caches)
    return worker, oracle


def tokens(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 1000 + i * 17) % 5000 for i in range(n)]


def key(i: int) -> bytes:
    return bytes([i]) * 16


def plan(
    req_id: str, kind: str, table: list[int], start: int, end: int, slots: list[int]
) -> TransferPlan:
    """Tokens [start, end) of a request with block table ``table``, chunk by chunk, into or
    out of ``slots`` (one per chunk touched)."""
    chunks = []
    first = start // C
    for i, slot in enumerate(slots):
        lo = max(start, (first + i) * C)
        hi = min(end, (first + i + 1) * C)
        chunks.append(ChunkTransfer(key(slot), slot, lo, hi, lo - (first + i) * C))
    return TransferPlan(req_id, kind, tuple(table), tuple(chunks))


def run_step(worker: WorkerSide, step_plan: StepPlan) -> WorkerReport:
    """vLLM's worker order for one step (no forward pass)."""
    worker.handle_preemptions(step_plan)
    worker.bind(step_plan)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.get_finished(set())
    report = worker.build_report()
    worker.clear()
    return report


def stored(worker: WorkerSide, oracle: KVOracle, req_id: str, toks: list[int], table: list[int]):
    """Write the request's KV with the fake forward and save it into slots 0.. (one per
    chunk)."""
    n = len(toks)
    oracle.write(req_id, toks, table, 0, n)
    save = plan(req_id, "save", table, 0, n, list(range(-(-n // C))))
    report = run_step(worker, StepPlan(step=0, saves=(save,)))
    assert report.saves_done == ((req_id, tuple(c.key for c in save.chunks)),)
    return save


# --- register_kv_caches ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("caches", "layout", "named"),
    [
        ({"l0": torch.zeros(3, 4, 5)}, None, "(3, 4, 5)"),
        ({"l0": torch.zeros(3, 6, 4, 2, 4)}, None, "(3, 6, 4, 2, 4)"),
        ({"l0": torch.zeros(2, 6, 4, 2, 4)}, "flashinfer", "(2, 6, 4, 2, 4)"),
        ({"l0": torch.zeros(2, 6, 4, 2, 4), "l1": torch.zeros(2, 5, 4, 2, 4)}, None, "(2, 5, 4"),
        ({"l0": torch.zeros(2, 2, 4, 2, 4)}, None, "(2, 2, 4, 2, 4)"),  # ambiguous
    ],
    ids=["3d", "no-kv-dim", "wrong-layout", "layers-differ", "ambiguous"],
)
def test_register_kv_caches_errors_name_the_shape(
    caches: dict[str, torch.Tensor], layout: str | None, named: str
) -> None:
    worker = WorkerSide(ConnectorConfig(chunk_size=C), num_slots=2, layout=layout)
    with pytest.raises(KVCacheLayoutError, match=re.escape(named)):
        worker.register_kv_caches(caches)


def test_register_kv_caches_with_no_layers() -> None:
    with pytest.raises(KVCacheLayoutError, match="no KV cache layers"):
        WorkerSide(ConnectorConfig(chunk_size=C), num_slots=2).register_kv_caches({})


def test_register_refuses_caches_of_another_pool_format() -> None:
    """Caches whose pool format is not the one the chunk keys name are refused when vLLM
    registers them, naming both, before any pool is made: a chunk of one format read as
    another's would be wrong KV. The format they name is accepted."""
    oracle = KVOracle(LAYERS, num_blocks=16, block_size=B)  # FlashAttention: tokens
    worker = WorkerSide(ConnectorConfig(chunk_size=C), num_slots=2)
    worker.pool_format = "cpu_attn-vec-block4"
    with pytest.raises(KVCacheLayoutError, match=r"as 'tokens'.*pool format 'cpu_attn-vec-block4'"):
        worker.register_kv_caches(oracle.caches)
    assert worker.backend is None and worker.pool is None
    # vLLM's CPU attention layout, [blocks, heads, block_size, 2 * head_size], kernel vec.
    cpu = {name: torch.zeros(16, 2, 32, 2 * 16) for name in LAYERS}
    worker = WorkerSide(ConnectorConfig(chunk_size=64), num_slots=2)
    worker.pool_format = "tokens"
    with pytest.raises(
        KVCacheLayoutError, match=r"kernel vec.*as 'cpu_attn-vec-block32'.*'tokens'"
    ):
        worker.register_kv_caches(cpu, cpu_isa="vec")
    worker.pool_format = "cpu_attn-vec-block32"
    worker.register_kv_caches(cpu, cpu_isa="vec")
    assert worker.pool is not None and worker.pool.chunk_shape == (2, 2, 2, 32, 32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_register_infers_the_layout_and_sizes_the_pool_from_the_budget(layout: str) -> None:
    oracle = KVOracle(LAYERS, num_blocks=16, block_size=B, layout=layout)
    # One slot: 2 layers x K/V x 8 tokens x (2 heads x 8) x 4 bytes = 2048 bytes.
    worker = WorkerSide(ConnectorConfig(chunk_size=C, host_pool_bytes=3 * 2048 + 100))
    worker.register_kv_caches(oracle.caches)
    assert worker.backend is not None and worker.backend.spec.layout == layout
    assert worker.pool is not None and worker.pool.num_slots == 3


def test_host_pool_budget_smaller_than_one_chunk_is_an_error() -> None:
    oracle = KVOracle(LAYERS, num_blocks=16, block_size=B)
    worker = WorkerSide(ConnectorConfig(chunk_size=C, host_pool_bytes=2047))
    with pytest.raises(ValueError, match=r"2047 bytes is smaller than one chunk slot of 2048"):
        worker.register_kv_caches(oracle.caches)


def test_transfers_before_register_kv_caches_are_an_error() -> None:
    worker = WorkerSide(ConnectorConfig(chunk_size=C), num_slots=2)
    worker.bind(StepPlan(step=0, loads=(plan("R", "load", [1, 2], 0, 8, [0]),)))
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.start_load_kv()


# --- loads and saves ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_then_load_into_other_blocks(layout: str) -> None:
    """start_load_kv takes no forward context: loads are issued from the bound plan alone."""
    worker, oracle = make(layout)
    toks = tokens(20)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4, 5])
    # Another request with the same 20 tokens: loads [0, 16) into fresh blocks.
    table = [9, 10, 11, 12, 13]
    assert oracle.verify("B", toks, table, 16) is not None  # nothing there yet
    load = plan("B", "load", table, 0, 16, [0, 1])
    worker.bind(StepPlan(step=1, loads=(load,)))
    worker.start_load_kv()
    assert oracle.verify("B", toks, table, 16) is None
    mismatch = oracle.verify("B", toks, table, 17)
    assert mismatch.position == 16  # nothing past the load's range
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    report = worker.build_report()
    assert report.loads_done == ("B",) and report.loads_failed == ()
    assert worker.stats["tokens_loaded"] == 16 and worker.stats["chunks_loaded"] == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_at_a_slot_offset_touches_only_its_range(layout: str) -> None:
    worker, oracle = make(layout)
    toks = tokens(16)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4])
    table = [9, 10, 11, 12]
    oracle.write("B", toks, table, 0, 4)  # block 9: a local prefix-cache hit
    load = plan("B", "load", table, 4, 12, [0, 1])
    assert [(c.token_start, c.token_end, c.slot_offset) for c in load.chunks] == [
        (4, 8, 4),
        (8, 12, 0),
    ]
    run_step(worker, StepPlan(step=1, loads=(load,)))
    assert oracle.verify("B", toks, table, 12) is None
    assert oracle.verify("B", toks, table, 13).position == 12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("failing_chunk", [0, 1, 2])
def test_load_fault_reports_the_blocks_from_the_failed_chunk_on(
    layout: str, failing_chunk: int
) -> None:
    def fault(req_id: str, chunk: ChunkTransfer) -> bool:
        return req_id == "B" and chunk.token_start == failing_chunk * C

    worker, oracle = make(layout, load_fault=fault)
    toks = tokens(24)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4, 5, 6])
    table = [9, 10, 11, 12, 13, 14, 15]
    load = plan("B", "load", table, 0, 24, [0, 1, 2])
    other = plan("O", "load", [7, 8], 0, 8, [0])
    report = run_step(worker, StepPlan(step=1, loads=(load, other)))
    failed = tuple(table[failing_chunk * 2 : 6])
    assert report.loads_failed == (("B", failed),)
    assert report.loads_done == ("O",)
    assert worker.get_block_ids_with_load_errors() == set(failed)
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    # The chunks before the failed one did arrive.
    assert oracle.verify("B", toks, table, failing_chunk * C) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saves_of_a_request_whose_load_failed_are_not_stored(layout: str) -> None:
    """Its forward ran over a prefix that is not in the cache: the save is reported failed
    and its host slot is never written, and no block the step filled is digested as its
    key's (with digests on); another request's save and digests in the step go on."""
    from kvledger.tracker.digests import DigestBlock, DigestPlan

    worker, oracle = make(layout, load_fault=lambda req, ch: req == "B", digests="full")
    toks = tokens(16)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4])
    table = [9, 10, 11, 12, 13, 14]
    oracle.write("B", toks + tokens(8, 1), table, 8, 24, poisoned=True)
    oracle.write("O", tokens(8, 2), [7, 8], 0, 8)
    sentinel = worker.pool.slot(2).clone().fill_(-7.0)
    worker.pool.slot(2).copy_(sentinel)
    load = plan("B", "load", table, 0, 8, [0])
    save_b = plan("B", "save", table, 16, 24, [2])
    save_o = plan("O", "save", [7, 8], 0, 8, [3])
    full = (DigestBlock("B", 4, 13, key(2)), DigestBlock("O", 0, 7, key(3)))
    digests = DigestPlan(1, full=full)
    step = StepPlan(step=1, loads=(load,), saves=(save_b, save_o), digests=digests)
    report = run_step(worker, step)
    assert report.loads_failed == (("B", (9, 10)),)
    assert report.saves_failed == (("B", (key(2),)),)
    assert report.saves_done == (("O", (key(3),)),)
    assert report.digests is not None
    assert [(rid, index) for rid, index, _, _ in report.digests.blocks] == [("O", 0)]
    # Under async scheduling the next step was scheduled before vLLM heard of the failure,
    # and runs over the same unloaded blocks: B's blocks are not digested then either.
    full = (DigestBlock("B", 5, 14, key(3)), DigestBlock("O", 1, 8, key(2)))
    report = run_step(worker, StepPlan(step=2, digests=DigestPlan(2, full=full)))
    assert report.digests is not None
    assert [(rid, index) for rid, index, _, _ in report.digests.blocks] == [("O", 1)]
    assert torch.equal(worker.pool.slot(2), sentinel)
    assert worker.stats["chunks_saved"] == 3  # A's two chunks, then O's; never B's


def test_saves_over_a_block_shared_with_a_failed_load_are_refused_that_step_and_the_next() -> None:
    """``H`` holds ``B``'s first block (vLLM's prefix cache shares it from ``B``'s allocation
    on) and computes over it in the step in which ``B``'s load of it fails, and again in the
    next (async scheduling scheduled it before vLLM heard): its saves of both steps are
    refused, that of the step after is not. ``B``'s own save the next step is the tracker's
    to cancel; a request holding none of the blocks saves as usual. So does ``H`` over a
    block the scheduler refused to load."""
    worker, oracle = make("flash_attn", load_fault=lambda req, ch: req == "B")
    toks = tokens(16)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4])
    load = plan("B", "load", [9, 10, 11], 0, 8, [0])
    holder = [9, 10, 12, 13]

    def save(req_id: str, table: list[int], slot: int) -> TransferPlan:
        return plan(req_id, "save", table, 8, 16, [slot])

    def step(n: int, *saves: TransferPlan, **more: Any) -> tuple[list[str], list[str]]:
        """The requests whose saves failed, and those whose saves were done."""
        report = run_step(worker, StepPlan(step=n, saves=saves, **more))
        return [r for r, _ in report.saves_failed], [r for r, _ in report.saves_done]

    other = save("O", [5, 6, 7, 8], 2)
    assert step(1, save("H", holder, 1), other, loads=(load,)) == (["H"], ["O"])
    assert worker.get_block_ids_with_load_errors() == {9, 10}
    assert step(2, save("H", holder, 1), save("B", [9, 10, 11, 14], 3)) == (["H"], ["B"])
    assert step(3, save("H", holder, 1)) == ([], ["H"])
    assert step(4, save("H", holder, 1), refused_blocks=(12,)) == (["H"], [])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refused_blocks_are_reported_as_load_errors(layout: str) -> None:
    worker, _ = make(layout)
    worker.bind(StepPlan(step=0, refused_blocks=(3, 4)))
    worker.start_load_kv()
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.get_block_ids_with_load_errors() == set()
    assert not worker.build_report()  # refusals are not load results of a request


def test_refused_and_failed_blocks_are_reported_together() -> None:
    worker, oracle = make("flash_attn", load_fault=lambda req, ch: True)
    stored(worker, oracle, "A", tokens(8), [1, 2])
    load = plan("B", "load", [9, 10], 0, 8, [0])
    run_step(worker, StepPlan(step=1, loads=(load,), refused_blocks=(5,)))
    assert worker.get_block_ids_with_load_errors() == {5, 9, 10}


# --- lifetimes ---------------------------------------------------------------------------------


def test_delayed_free_is_reported_once_the_saves_completed(monkeypatch) -> None:
    worker, oracle = make("flash_attn")
    events = hold_saves(worker, monkeypatch)
    oracle.write("R", tokens(16), [1, 2, 3, 4], 0, 16)
    save = plan("R", "save", [1, 2, 3, 4], 0, 16, [0, 1])
    worker.bind(StepPlan(step=0, saves=(save,)))
    worker.wait_for_save()
    assert worker.get_finished({"R"}) == (None, None)
    assert not worker.build_report()  # still in flight
    worker.clear()
    worker.bind(StepPlan(step=1, delayed_free=("R",)))
    assert worker.get_finished(set()) == (None, None)
    events[0].completed = True
    assert worker.get_finished(set()) == (None, None)  # one chunk still in flight
    events[1].completed = True
    assert worker.get_finished(set()) == ({"R"}, None)
    assert worker.get_finished(set()) == (None, None)  # reported once
    done = worker.build_report().saves_done
    assert [(r, k) for r, keys in done for k in keys] == [("R", key(0)), ("R", key(1))]


def test_handle_preemptions_waits_only_when_something_was_preempted(monkeypatch) -> None:
    worker, oracle = make("flashinfer")
    events = hold_saves(worker, monkeypatch)
    oracle.write("R", tokens(8), [1, 2], 0, 8)
    run_step(worker, StepPlan(step=0, saves=(plan("R", "save", [1, 2], 0, 8, [0]),)))
    worker.handle_preemptions(None)
    worker.handle_preemptions(StepPlan(step=1))
    assert events[0].synchronized == 0
    worker.handle_preemptions(StepPlan(step=2, preempted=("R",)))
    assert events[0].synchronized == 1
    assert worker.build_report().saves_done == (("R", (key(0),)),)


def test_shutdown_drains_saves(monkeypatch) -> None:
    worker, oracle = make("flash_attn")
    events = hold_saves(worker, monkeypatch)
    oracle.write("R", tokens(8), [1, 2], 0, 8)
    run_step(worker, StepPlan(step=0, saves=(plan("R", "save", [1, 2], 0, 8, [0]),)))
    worker.shutdown()
    assert events[0].synchronized == 1


def test_binding_a_step_orders_its_forward_pass_after_saves_in_flight() -> None:
    """A preempted request's blocks may be reused by this step's forward pass, and vLLM before
    0.14 never calls handle_preemptions: binding the step makes the compute stream wait on
    every save still in flight (without blocking the host)."""
    from kvledger.connector.config import ConnectorConfig
    from kvledger.connector.messages import StepPlan
    from kvledger.connector.worker import WorkerSide

    class Handle:
        def __init__(self) -> None:
            self.waited = 0
            self.synchronized = 0

        def wait(self, stream: Any = None) -> None:
            self.waited += 1

        def synchronize(self) -> None:
            self.synchronized += 1

        def done(self) -> bool:
            return False

    side = WorkerSide(ConnectorConfig(chunk_size=16))
    held = [Handle(), Handle()]
    side._saves_in_flight = [("A", b"a", held[0]), ("B", b"b", held[1])]
    side.bind(StepPlan(step=1))
    assert [h.waited for h in held] == [1, 1]
    assert [h.synchronized for h in held] == [0, 0]  # the host did not block


# --- speculative decoding: vLLM defers wait_for_save past the connector output ------------------


def run_step_deferred(
    worker: WorkerSide,
    step_plan: StepPlan,
    forward: Any = None,
    draft: Any = None,
) -> tuple[WorkerReport, set[str] | None]:
    """vLLM 0.33's order with a drafter (``defer_finalize``: ``execute_model`` collects the
    connector output right after the target forward, and ``sample_tokens`` calls
    ``finalize_kv_connector`` -> ``wait_for_save``, ``clear_connector_metadata`` after the
    draft forward; kv_connector_model_runner_mixin.py, gpu_model_runner.py). Returns the
    step's report and finished-sending set."""
    worker.handle_preemptions(step_plan)
    worker.bind(step_plan)
    worker.start_load_kv()
    if forward is not None:
        forward()
    sending, _ = worker.get_finished(set())
    worker.get_block_ids_with_load_errors()
    report = worker.build_report()
    if draft is not None:
        draft()
    worker.wait_for_save()
    worker.clear()
    return report, sending


def test_deferred_a_request_is_not_reported_sent_before_its_saves_are_issued(
    monkeypatch,
) -> None:
    """With ``defer_finalize`` get_finished runs before the step's saves are issued. A request
    whose freeing waits (delayed_free) and that has a save in the bound plan must not be
    reported finished-sending then: vLLM would free blocks the save has yet to read."""
    worker, oracle = make("flash_attn")
    events = hold_saves(worker, monkeypatch)
    oracle.write("R", tokens(16), [1, 2, 3, 4], 0, 16)
    save = plan("R", "save", [1, 2, 3, 4], 0, 16, [0, 1])
    report, sending = run_step_deferred(
        worker, StepPlan(step=0, saves=(save,), delayed_free=("R",))
    )
    assert sending is None  # the save was not even issued yet
    assert len(events) == 2 and not report
    report, sending = run_step_deferred(worker, StepPlan(step=1))
    assert sending is None  # issued, still in flight
    for event in events:
        event.completed = True
    report, sending = run_step_deferred(worker, StepPlan(step=2))
    assert sending == {"R"}
    assert report.saves_done == (("R", (key(0), key(1))),)


def test_deferred_saves_of_a_request_whose_load_failed_are_refused() -> None:
    """With ``defer_finalize`` the step's report (carrying the failed load) is built before
    wait_for_save: the saves of the request whose load failed in this step must still be
    refused, not stored from KV computed over a wrong prefix."""
    worker, oracle = make("flash_attn", load_fault=lambda req, ch: req == "B")
    toks = tokens(16)
    stored(worker, oracle, "A", toks, [1, 2, 3, 4])
    table = [9, 10, 11, 12, 13, 14]
    sentinel = worker.pool.slot(2).clone().fill_(-7.0)
    worker.pool.slot(2).copy_(sentinel)
    load = plan("B", "load", table, 0, 8, [0])
    save_b = plan("B", "save", table, 16, 24, [2])
    save_o = plan("O", "save", [7, 8], 0, 8, [3])

    def forward() -> None:
        oracle.write("B", toks + tokens(8, 1), table, 8, 24, poisoned=True)
        oracle.write("O", tokens(8, 2), [7, 8], 0, 8)

    report, _ = run_step_deferred(
        worker, StepPlan(step=1, loads=(load,), saves=(save_b, save_o)), forward
    )
    assert report.loads_failed == (("B", (9, 10)),)
    nxt, _ = run_step_deferred(worker, StepPlan(step=2))
    assert nxt.saves_failed == (("B", (key(2),)),)
    assert nxt.saves_done == (("O", (key(3),)),)
    assert torch.equal(worker.pool.slot(2), sentinel)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deferred_saves_read_the_kv_the_drafter_wrote(layout: str) -> None:
    """The draft forward runs between the connector output and wait_for_save, and writes its
    own layers' KV for the step (here: layer 1 stands for the drafter's layer). The saves
    must hold it: loaded into other blocks, every layer of every token is right."""
    worker, oracle = make(layout)
    toks = tokens(16)
    table = [1, 2, 3, 4]
    save = plan("R", "save", table, 0, 16, [0, 1])
    report, _ = run_step_deferred(
        worker,
        StepPlan(step=0, saves=(save,)),
        forward=lambda: oracle.write("R", toks, table, 0, 16, layers=[0]),
        draft=lambda: oracle.write("R", toks, table, 0, 16, layers=[1]),
    )
    assert not report  # confirmed in the next step's report
    report, _ = run_step_deferred(worker, StepPlan(step=1))
    assert report.saves_done == (("R", (key(0), key(1))),)
    other = [9, 10, 11, 12]
    run_step_deferred(worker, StepPlan(step=2, loads=(plan("Q", "load", other, 0, 16, [0, 1]),)))
    assert oracle.verify("Q", toks, other, 16) is None


def test_a_skipped_wait_for_save_issues_the_saves_before_the_next_step(monkeypatch) -> None:
    """vLLM 0.33 never calls finalize_kv_connector on a pipeline stage that is not the last
    one when a drafter is configured (sample_tokens returns early there): the bound plan's
    saves are issued when the next step binds, before its loads or forward can overwrite the
    blocks, and the request is reported sent only after they completed."""
    worker, oracle = make("flash_attn")
    oracle.write("R", tokens(16), [1, 2, 3, 4], 0, 16)
    save = plan("R", "save", [1, 2, 3, 4], 0, 16, [0, 1])
    worker.handle_preemptions(StepPlan(step=0, saves=(save,)))
    worker.bind(StepPlan(step=0, saves=(save,)))
    worker.start_load_kv()
    assert worker.get_finished(set()) == (None, None)
    assert not worker.build_report()
    # No wait_for_save, no clear: the next step comes.
    worker.bind(StepPlan(step=1, delayed_free=("R",)))
    assert worker.get_finished(set()) == ({"R"}, None)
    report = worker.build_report()
    assert report.saves_done == (("R", (key(0), key(1))),)
    run_step(worker, StepPlan(step=2, loads=(plan("Q", "load", [9, 10, 11, 12], 0, 16, [0, 1]),)))
    assert oracle.verify("Q", tokens(16), [9, 10, 11, 12], 16) is None


# --- stream ordering (the CUDA path's logic, with stand-ins for streams and events) -------------


class FakeStream:
    """Stands in for a torch.cuda.Stream: compared by identity, named for messages."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class StreamEvent:
    """Stands in for the torch.cuda.Event of one transfer: records the streams made to wait on
    it; finished when the test says so."""

    def __init__(self) -> None:
        self.completed = False
        self.waited_by: list[Any] = []

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.completed = True

    def wait(self, stream: Any = None) -> None:
        self.waited_by.append(stream)


def test_transfers_are_ordered_against_the_stream_the_forward_runs_on(monkeypatch) -> None:
    """vLLM runs the forward pass on the stream current when it calls bind / start_load_kv (a
    dedicated, non-default stream in a vLLM worker). The worker records that stream: the step
    waits there for the saves still reading blocks, and for every load; the step's saves
    start after the work issued on it (and, if wait_for_save is called with another stream
    current, after that stream's work too)."""
    from kvledger.connector.transfer import TransferHandle

    worker, oracle = make("flash_attn")
    stored(worker, oracle, "A", tokens(16), [1, 2, 3, 4])  # slots 0, 1 hold A's chunks
    backend = worker.backend
    current = [FakeStream("previous step")]
    monkeypatch.setattr(backend, "compute_stream", lambda: current[0])
    issued: list[tuple[str, tuple[Any, ...], StreamEvent]] = []
    real = {"save": backend.save, "load": backend.load}

    def recording(kind: str) -> Any:
        def transfer(*args: Any, after: Any = (), **kwargs: Any) -> TransferHandle:
            real[kind](*args, **kwargs)  # CPU: the bytes move at once
            event = StreamEvent()
            issued.append((kind, tuple(after), event))
            return TransferHandle(event, torch.device("cuda"))  # a CUDA transfer's handle

        return transfer

    monkeypatch.setattr(backend, "save", recording("save"))
    monkeypatch.setattr(backend, "load", recording("load"))

    # A save of the previous step, still in flight.
    oracle.write("R", tokens(8, 3), [5, 6], 0, 8)
    run_step(worker, StepPlan(step=1, saves=(plan("R", "save", [5, 6], 0, 8, [2]),)))
    assert [(k, a) for k, a, _ in issued] == [("save", (current[0],))]
    in_flight = issued[0][2]

    forward = FakeStream("forward")
    current[0] = forward  # vLLM's current stream while it runs this step
    worker.bind(StepPlan(step=2, loads=(plan("B", "load", [9, 10, 11, 12], 0, 16, [0, 1]),)))
    assert in_flight.waited_by == [forward]  # the forward waits for the save reading blocks
    worker.start_load_kv()
    loads = [(a, e) for k, a, e in issued if k == "load"]
    assert [a for a, _ in loads] == [(forward,), (forward,)]  # after the blocks' last users
    assert all(e.waited_by == [forward] for _, e in loads)  # and the forward after the loads
    worker.get_finished(set())
    worker.build_report()
    worker.clear()

    # The next step saves; vLLM calls wait_for_save while another stream is current.
    oracle.write("S", tokens(8, 4), [13, 14], 0, 8)
    worker.bind(StepPlan(step=3, saves=(plan("S", "save", [13, 14], 0, 8, [3]),)))
    worker.start_load_kv()
    current[0] = FakeStream("elsewhere")
    worker.wait_for_save()
    kind, after, _ = issued[-1]
    assert kind == "save" and after == (forward, current[0])


def test_a_cuda_handle_makes_the_named_stream_wait() -> None:
    """``TransferHandle.wait(stream)`` orders exactly the stream it is given (no CUDA needed:
    the stream is named, so the current one is never asked for)."""
    from kvledger.connector.transfer import TransferHandle

    event, stream = StreamEvent(), FakeStream("forward")
    TransferHandle(event, torch.device("cuda")).wait(stream)
    assert event.waited_by == [stream]
    cpu_event = StreamEvent()
    TransferHandle(cpu_event).wait(stream)  # not a CUDA transfer: the event orders itself
    assert cpu_event.waited_by == [None]


def test_on_cpu_there_is_no_stream_to_order_against() -> None:
    worker, _ = make("flashinfer")
    assert worker.backend.compute_stream() is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_orders_its_transfers_against_the_forward_stream() -> None:
    """The worker driven as vLLM drives it, with the forward pass on a non-default stream (as
    in a vLLM worker): the step's save reads the KV the (slow) forward wrote, and the next
    step's load, held back on the transfer stream, has landed when the forward reads it."""
    spin = 200_000_000  # GPU cycles, about 0.1 s
    caches = {
        name: torch.zeros((2, 16, B, 2, 4), dtype=torch.float32, device="cuda") for name in LAYERS
    }
    worker = WorkerSide(ConnectorConfig(chunk_size=C), num_slots=4, layout="flash_attn")
    worker.register_kv_caches(caches)
    assert worker.backend is not None
    forward = torch.cuda.Stream()
    save = plan("R", "save", [1, 2], 0, 8, [0])
    with torch.cuda.stream(forward):
        worker.handle_preemptions(StepPlan(step=0, saves=(save,)))
        worker.bind(StepPlan(step=0, saves=(save,)))
        worker.start_load_kv()
        torch.cuda._sleep(spin)  # the forward pass, slow...
        for cache in caches.values():
            cache[:, 1:3].fill_(3.0)  # ...writes R's KV in blocks 1 and 2
        worker.wait_for_save()
        worker.get_finished(set())
        worker.build_report()
        worker.clear()
    load = plan("Q", "load", [5, 6], 0, 8, [0])
    with torch.cuda.stream(forward):
        worker.handle_preemptions(StepPlan(step=1, loads=(load,)))
        worker.bind(StepPlan(step=1, loads=(load,)))
        with torch.cuda.stream(worker.backend._stream):
            torch.cuda._sleep(spin)  # the transfer stream is busy for a while
        worker.start_load_kv()
        seen = [cache[:, 5:7].clone() for cache in caches.values()]  # the forward reads Q's KV
        worker.wait_for_save()
        worker.get_finished(set())
        report = worker.build_report()
        worker.clear()
    torch.cuda.synchronize()
    assert report.loads_done == ("Q",)
    assert all(bool((s == 3.0).all()) for s in seen)


# --- a copy that fails after it was issued (the device's error) ------------------------------


@pytest.mark.parametrize("where", ["query", "synchronize", "wait"])
def test_a_save_whose_copy_fails_later_is_reported_failed_and_nothing_raises(
    where: str, monkeypatch: Any
) -> None:
    """An asynchronous save's event raises once it is asked about (a CUDA error surfaces
    there, long after the copy was issued): polled (``get_finished``, ``build_report``),
    waited for by the host (a preemption, ``shutdown``) or by the next forward (``bind``).
    The worker raises into vLLM from none of them: the chunk is reported failed, once, so the
    scheduler never counts it stored, and the next step's saves go on as usual."""
    worker, oracle = make("flash_attn")
    events = hold_saves(worker, monkeypatch)
    oracle.write("R", tokens(8), [1, 2], 0, 8)
    oracle.write("S", tokens(8, seed=1), [3, 4], 0, 8)
    first = run_step(worker, StepPlan(step=0, saves=(plan("R", "save", [1, 2], 0, 8, [0]),)))
    assert first.saves_done == () and first.saves_failed == ()  # still in flight

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(events[0], where, broken)
    step = StepPlan(step=1, saves=(plan("S", "save", [3, 4], 0, 8, [1]),))
    if where == "synchronize":
        step = StepPlan(step=1, saves=step.saves, preempted=("R",))
    report = run_step(worker, step)
    assert report.saves_failed == (("R", (key(0),)),)
    assert all(r != "R" for r, _ in report.saves_done)
    events[1].completed = True
    later = run_step(worker, StepPlan(step=2))
    assert later.saves_done == (("S", (key(1),)),) and later.saves_failed == ()
    # The failed copy's slot is free again: a save into it is not refused for the rest of
    # the run (the pool drops a transfer whose event raised).
    oracle.write("T", tokens(8, seed=2), [5, 6], 0, 8)
    run_step(worker, StepPlan(step=3, saves=(plan("T", "save", [5, 6], 0, 8, [0]),)))
    events[2].completed = True
    again = run_step(worker, StepPlan(step=4))
    assert again.saves_done == (("T", (key(0),)),) and again.saves_failed == ()
    worker.shutdown()
    assert worker.build_report().saves_failed == ()  # said once


# --- a chunk read back from a remote tier -------------------------------------------------------


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_a_chunk_saved_by_one_worker_loads_from_the_tier_into_another(device: str) -> None:
    """One worker saves a chunk and writes it to the tier; another, sharing the tier, loads it
    into other blocks (the remote slot): the bytes land exactly. On CUDA the value read from
    the tier is pageable host memory, which a copy to the device cannot read: it goes through
    the pool's pinned staging chunk (a load that failed there would only be recomputed, and
    the tier would never serve a GPU)."""
    import uuid

    import _memory_tier

    from kvledger.connector.config import TIER_SCHEMES
    from kvledger.tracker.tiers import REMOTE_SLOT

    before = dict(TIER_SCHEMES)
    _memory_tier.register()
    try:
        config = ConnectorConfig.from_extra_config(
            {"chunk_size": C, "remote_url": f"memory://t{uuid.uuid4().hex}"}, environ={}
        )

        def worker() -> tuple[WorkerSide, dict[str, torch.Tensor]]:
            caches = {
                name: torch.zeros((2, 16, B, 2, 4), dtype=torch.float32, device=device)
                for name in LAYERS
            }
            side = WorkerSide(config, num_slots=4, layout="flash_attn")
            side.register_kv_caches(caches)
            return side, caches

        saver, written = worker()
        for i, cache in enumerate(written.values()):
            cache[:, 1:3] = (
                torch.arange(2 * 2 * B * 8, dtype=torch.float32).view(2, 2, B, 2, 4) + 1000 * i
            )
        report = run_step(saver, StepPlan(step=0, saves=(plan("R", "save", [1, 2], 0, 8, [0]),)))
        report = report.merged(saver.build_report())
        assert report.saves_done == (("R", (key(0),)),)
        assert [(what, r, keys) for what, r, keys, _ in report.remote] == [
            ("saved", "R", (key(0),))
        ]

        loader, read = worker()
        chunk = ChunkTransfer(key(0), REMOTE_SLOT, 0, 8, 0)
        load = TransferPlan("Q", "load", (5, 6), (chunk,))
        report = run_step(loader, StepPlan(step=0, loads=(load,)))
        if device == "cuda":
            torch.cuda.synchronize()
        assert report.loads_done == ("Q",) and report.loads_failed == ()
        assert loader.stats["remote_chunks_loaded"] == 1
        for name in LAYERS:
            assert torch.equal(read[name][:, 5:7].cpu(), written[name][:, 1:3].cpu())
        if device == "cpu":
            # What the CUDA case relies on, seen without a device: with the pool pinned (as it
            # is on CUDA), the copy reads the pool's staging chunk, never the tier's bytes.
            assert loader.pool is not None and loader.backend is not None
            staging = torch.zeros(loader.pool.chunk_shape)  # stands for the pinned chunk
            sources: list[torch.Tensor] = []
            real_load = loader.backend.load

            def spy(src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                sources.append(src)
                return real_load(src, *args, **kwargs)

            loader.pool.pinned = True
            loader.pool.staging = lambda: staging  # type: ignore[method-assign]
            loader.backend.load = spy  # type: ignore[method-assign]
            for cache in read.values():
                cache.zero_()
            report = run_step(loader, StepPlan(step=1, loads=(load,)))
            assert report.loads_done == ("Q",) and len(sources) == 1
            assert sources[0] is staging
            for name in LAYERS:
                assert torch.equal(read[name][:, 5:7], written[name][:, 1:3])
    finally:
        TIER_SCHEMES.clear()
        TIER_SCHEMES.update(before)
