"""KV-content digests on the worker: a deterministic 64-bit digest of a block's bytes.

The scheduler plans which blocks to digest (``tracker.digests.DigestPlan``); this module
computes the digests with torch on the device the caches live on and hands back a
``tracker.digests.DigestReport``. Nothing here decides or judges anything.

The digest of block ``b`` is a weighted sum, modulo 2**64, of the block's bytes read as 64-bit
words (``view(torch.int64)``: no conversion, no copy beyond gathering the blocks), with fixed
odd pseudo-random weights, one sum per layer, the layers' sums combined with weights of their
own, and a final 64-bit mix on the host. A single changed element changes the digest (its
word changes by ``delta * 2**k``, ``k < 64``, times an odd weight: never 0 mod 2**64);
integer arithmetic makes it exact and the same on every run and device. It is not
cryptographic: it catches wrong, stale or missing bytes, not an adversary.

A block's bytes are read in the cache's own order, for every layout ``connector.kv_layout``
describes: ``flash_attn`` ``[2, num_blocks, ...]`` (block dim 1), ``flashinfer``
``[num_blocks, 2, ...]`` and ``cpu_attn`` ``[num_blocks, heads, block_size, 2 * head_size]``
(block dim 0). Digests compare only within one run's layout, which is all the rule needs.

``full`` digests every layer of a block; ``sampled`` one layer, chosen by the block's key (so
that the step that computed a prefix and the one that loaded it digest the same layer, and
over many blocks every layer is looked at): ``1 / num_layers`` of the bytes.

Cost: the blocks are gathered with one ``index_select`` per layer, multiplied and summed on
the device; the host waits once per step (one ``tolist`` for every digest of the step).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvledger.connector.kv_layout import describe_kv_caches
from kvledger.connector.logsafe import safe_logger
from kvledger.tracker import events as ev
from kvledger.tracker.codec import describe_exception
from kvledger.tracker.digests import (
    DIGEST_MODES,
    DigestBlock,
    DigestPlan,
    DigestPlanner,
    DigestReport,
)
from kvledger.tracker.recorded_steps import RecordedSteps

__all__ = ["BlockDigester", "RecorderDigests", "WorkerDigests"]

_log = safe_logger("kvledger.connector")

_MASK = (1 << 64) - 1
# Before-digests of loads not verified yet, kept at most (the oldest dropped: unverified).
_MAX_PENDING = 1 << 16
# Integer dtypes by width, widest first: the block's bytes are read as the widest that divides
# them (int64 for every real layout).
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


def _mix64(x: int) -> int:
    """splitmix64's finaliser: spreads the sum's bits (a digest is compared, never summed);
    returned as a signed 64-bit int."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    # As a signed 64-bit int: what every reader of the log holds (Arrow, DuckDB, SQL).
    return x - (1 << 64) if x >> 63 else x


def _odd_weights(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64)
    return w | 1


class BlockDigester:
    """Digests blocks of vLLM's paged KV caches (``kv_caches``: layer name -> cache, in layer
    order, as ``register_kv_caches`` gets them). ``mode``: ``full`` or ``sampled``."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], mode: str = "full", layout: str | None = None
    ) -> None:
        if mode not in DIGEST_MODES or mode == "off":
            raise ValueError(f"digest mode must be 'sampled' or 'full', got {mode!r}")
        self.mode = mode
        self.spec = describe_kv_caches(kv_caches, layout)
        caches = list(kv_caches.values())
        # Each layer as [num_blocks, ...] (a view: flash_attn's block dim is the second).
        self._blocks = [
            c.transpose(0, 1) if self.spec.layout == "flash_attn" else c for c in caches
        ]
        first = self._blocks[0]
        block_bytes = first[0].numel() * first.element_size()
        size, self._word = next((s, d) for s, d in _WORDS if block_bytes % s == 0)
        self.block_bytes = block_bytes
        device = first.device
        self._weights = _odd_weights(block_bytes // size, 0x6B766C).to(device)
        self._layer_weights = _odd_weights(len(caches), 0x6C6179).to(device)
        self.device = device

    def layer_of(self, key: bytes) -> int:
        """The layer ``sampled`` digests for the block keyed ``key``."""
        return int.from_bytes(key[:8], "little") % len(self._blocks)

    def digest(self, blocks: Sequence[DigestBlock]) -> torch.Tensor:
        """The blocks' raw digests, an int64 tensor on the caches' device (no host wait);
        :meth:`finish` turns a host copy into the digests."""
        n = len(blocks)
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        # Checked on the host: on CUDA an index out of range is a device-side assert, which
        # no except catches and which fails every later CUDA call of the engine.
        limit = self.spec.num_blocks
        bad = next((b.block_id for b in blocks if not 0 <= b.block_id < limit), None)
        if bad is not None:
            raise ValueError(f"block id {bad} out of range [0, {limit})")
        if self.mode == "full":
            ids = torch.tensor([b.block_id for b in blocks], dtype=torch.int64).to(self.device)
            total = torch.zeros(n, dtype=torch.int64, device=self.device)
            for layer, view in enumerate(self._blocks):
                total += self._sums(view, ids) * self._layer_weights[layer]
            return total
        out = torch.zeros(n, dtype=torch.int64, device=self.device)
        by_layer: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            by_layer.setdefault(self.layer_of(b.key), []).append(i)
        for layer, rows in sorted(by_layer.items()):
            ids = torch.tensor([blocks[i].block_id for i in rows], dtype=torch.int64)
            where = torch.tensor(rows, dtype=torch.int64).to(self.device)
            sums = self._sums(self._blocks[layer], ids.to(self.device))
            out.index_copy_(0, where, sums * self._layer_weights[layer])
        return out

    def _sums(self, view: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        words = view.index_select(0, ids).reshape(ids.numel(), -1).view(self._word)
        if self._word is not torch.int64:
            words = words.to(torch.int64)
        if words.device.type == "cpu":
            # One fused multiply-add pass; CPU's parallel integer sum over a row was up to
            # 100x slower on a busy host (bench/digest_bench.py). CUDA has no integer mv.
            return torch.mv(words, self._weights)
        return (words * self._weights).sum(dim=1)

    @staticmethod
    def finish(raw: int) -> int:
        """A raw digest (from the device, as a Python int) as the digest reported."""
        return _mix64(raw)


class WorkerDigests:
    """The worker's digest hook, per step: :meth:`before_load` in ``start_load_kv`` before any
    load is issued, :meth:`after_forward` in ``wait_for_save`` after the forward pass,
    :meth:`report` when the worker's results go to the scheduler. A failure here is logged and
    costs that step's digests, never the step."""

    def __init__(self, mode: str, *, layout: str | None = None, rank: int = 0) -> None:
        self.mode = mode
        self.layout = layout
        self.rank = rank
        self.digester: BlockDigester | None = None
        self._before: tuple[tuple[DigestBlock, ...], torch.Tensor] | None = None
        # Digests before the load, of loads not verified yet (asynchronous ones wait here).
        self._before_of: dict[tuple[str, int], int] = {}
        self._blocks: list[tuple[str, int, bytes, int]] = []
        self._loads: list[tuple[str, int, bytes, int, int, int]] = []
        # The digests of blocks computed here, (req id, block index) -> (key, digest), kept
        # (bounded) until the chunk holding them is written to the remote tier with them.
        self._computed: OrderedDict[tuple[str, int], tuple[bytes, int]] = OrderedDict()
        # Digests that came with values loaded from the remote tier, reported as carried.
        self._carried: list[tuple[str, int, bytes, int]] = []
        # Failures of each place so far, and what the next report says of them (one
        # RecordLost each: DigestReport.errors).
        self._failures: dict[str, int] = {}
        self._errors: dict[str, str] = {}

    @property
    def errors(self) -> int:
        """How many times the digests failed, every place together."""
        return sum(self._failures.values())

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.digester = BlockDigester(kv_caches, self.mode, self.layout)

    def before_load(self, plan: DigestPlan | None) -> None:
        if self._before is not None:
            # The last step's before-digests were never followed by a forward (vLLM runs a
            # step without one, kv_connector_no_forward, when nothing is scheduled but an
            # asynchronous load starts): kept for their verification, at a host wait.
            self._settle_before()
        try:
            if plan is None or not plan.before or self.digester is None:
                return
            self._before = (plan.before, self.digester.digest(plan.before))
        except Exception as exc:
            self._failed("before_load", exc)

    def _settle_before(self) -> None:
        before, self._before = self._before, None
        if before is None or self.digester is None:
            return
        try:
            values = before[1].tolist()
            for b, v in zip(before[0], values, strict=True):
                self._keep_before(b, self.digester.finish(v))
        except Exception as exc:
            self._failed("before_load", exc)

    def _keep_before(self, b: DigestBlock, digest: int) -> None:
        pending = self._before_of
        pending[(b.req_id, b.block_index)] = digest
        if len(pending) > _MAX_PENDING:  # loads never verified (their requests went away)
            del pending[next(iter(pending))]

    def after_forward(
        self,
        plan: DigestPlan | None,
        load_errors: Collection[int] = (),
        failed: Collection[str] = (),
    ) -> None:
        """Digest the plan's ``full`` and ``verify`` blocks; a loaded block in ``load_errors``
        (its load failed or was refused: vLLM recomputes it) is not judged, and no block of a
        request in ``failed`` (its load failed this step) is digested as its key's: this
        step's forward ran over a prefix that was never loaded, so its new blocks are not
        what their keys name (its saves are refused for the same reason)."""
        before, self._before = self._before, None
        if plan is None or self.digester is None:
            return
        try:
            if load_errors and plan.verify:
                plan = attrs.evolve(
                    plan, verify=tuple(b for b in plan.verify if b.block_id not in load_errors)
                )
            if failed and plan.full:
                plan = attrs.evolve(
                    plan, full=tuple(b for b in plan.full if b.req_id not in failed)
                )
            self._after(plan, before)
        except Exception as exc:
            self._failed("after_forward", exc)

    def _after(self, plan: DigestPlan, before: tuple[tuple[DigestBlock, ...], Any] | None) -> None:
        assert self.digester is not None
        digest = self.digester.digest
        parts: list[tuple[tuple[DigestBlock, ...], torch.Tensor]] = []
        if before is not None:
            parts.append(before)
        if plan.full:
            parts.append((plan.full, digest(plan.full)))
        if plan.verify:
            parts.append((plan.verify, digest(plan.verify)))
        if not parts:
            return
        # The one host wait of the step.
        raw = torch.cat([t for _, t in parts]).tolist()
        finish = self.digester.finish
        i = 0
        for k, (blocks, _) in enumerate(parts):
            values = [finish(v) for v in raw[i : i + len(blocks)]]
            i += len(blocks)
            if before is not None and k == 0:
                for b, v in zip(blocks, values, strict=True):
                    self._keep_before(b, v)
            elif blocks is plan.full:
                computed = self._computed
                for b, v in zip(blocks, values, strict=True):
                    self._blocks.append((b.req_id, b.block_index, b.key, v))
                    computed[(b.req_id, b.block_index)] = (b.key, v)
                while len(computed) > _MAX_PENDING:
                    computed.popitem(last=False)
            else:
                for b, v in zip(blocks, values, strict=True):
                    was = self._before_of.pop((b.req_id, b.block_index), None)
                    if was is not None:  # stamped with this plan's step: the load's
                        self._loads.append((b.req_id, b.block_index, b.key, was, v, plan.step))

    def _failed(self, where: str, exc: Exception) -> None:
        error = describe_exception(exc, 500)
        _log.warning("kvledger.digest_failed", where=where, error=error)
        n = self._failures[where] = self._failures.get(where, 0) + 1
        # The 1st, 2nd, 4th, 8th, ... failure of a place is reported: a digester failing at
        # every step costs the log a record per doubling, not one per step.
        if n & (n - 1) == 0:
            self._errors[where] = (
                error if n == 1 else f"{error} (failure {n} here; the next said: failure {2 * n})"
            )

    def forget(self, req_ids: Sequence[str]) -> None:
        """Requests that finished: their pending before-digests are dropped (the digests of
        their blocks stay, bounded: their last chunks are written to the tier after this)."""
        gone = set(req_ids)
        for k in [k for k in self._before_of if k[0] in gone]:
            del self._before_of[k]

    def of_blocks(self, req_id: str, first: int, end: int) -> tuple[tuple[bytes, int], ...]:
        """(key, digest) of blocks ``[first, end)`` of ``req_id`` computed here, up to the
        first one not known: what a value written to the remote tier carries."""
        out = []
        for i in range(first, end):
            known = self._computed.get((req_id, i))
            if known is None:
                break
            out.append(known)
        return tuple(out)

    def carried(self, req_id: str, first: int, digests: Sequence[tuple[bytes, int]]) -> None:
        """A value loaded into blocks ``first, first + 1, ...`` of ``req_id`` carried these
        (key, digest): reported, so that the log judges the load by them."""
        self._carried.extend(
            (req_id, first + i, key, digest) for i, (key, digest) in enumerate(digests)
        )

    def report(self) -> DigestReport | None:
        """What was digested since the last report."""
        if not (self._blocks or self._loads or self._carried or self._errors):
            return None
        out = DigestReport(
            tuple(self._blocks),
            tuple(self._loads),
            self.rank,
            tuple(self._carried),
            tuple(self._errors.items()),
        )
        self._blocks, self._loads, self._carried, self._errors = [], [], [], {}
        return out


# --- KVLedgerRecorder's hooks (connector/recorder.py) -------------------------------------


class RecorderDigests:
    """The recorder's scheduler-side digest hook: a ``DigestPlanner`` fed with the very events
    the recorder writes (vLLM's facts and the inner's answers, so the plan is what a reader of
    the log would derive), ``plan(scheduler_output)`` once per step, ``report(reports)`` ->
    the events of the workers' digest reports. A loaded block the inner reported a load error
    for (``InnerLoadErrors`` of the same output) is not judged: vLLM recomputes it."""

    def __init__(self, recording: Any, block_size: int) -> None:
        self.planner = DigestPlanner(block_size)
        self._recording = recording
        # The recorder's view of what the log says (tracker/recorded_steps.py): a StepDecoded
        # is planned as the Scheduled events it stands for, read before the log takes it.
        self._steps: RecordedSteps | None = getattr(recording, "steps", None)
        self._block_of: dict[tuple[str, int], int] = {}
        self._load_errors: set[int] = set()
        if recording is not None:
            recording.observe = self.observe

    def observe(self, *events: ev.Event) -> None:
        """Told of each event the recorder is about to write. One the plan cannot take loses
        the request it is about (every request, for one about none) to the planner until
        vLLM gives its whole table again (``DigestPlanner.lose``); the events after it are
        still taken, and every record is still written."""
        for e in events:
            try:
                self._observe(e)
            except Exception as exc:
                rid = getattr(e, "req_id", "")
                with contextlib.suppress(Exception):
                    self.planner.lose((rid,) if isinstance(rid, str) and rid else None)
                _log.warning("kvledger.digest_observe_failed", req_id=rid, error=repr(exc))

    def _observe(self, e: ev.Event) -> None:
        if isinstance(e, ev.InnerLoadErrors):
            self._load_errors.update(e.block_ids)
        elif isinstance(e, ev.StepDecoded):
            if self._steps is not None:
                self.planner.observe_decoded(e, self._steps)
        else:
            self.planner.observe(e)

    def plan(self, scheduler_output: Any) -> DigestPlan | None:
        step = getattr(self._recording, "step", 0)
        plan = self.planner.plan(step)
        if plan is not None:
            for b in plan.verify:
                self._block_of[(b.req_id, b.block_index)] = b.block_id
        return plan

    def report(self, reports: Sequence[Any]) -> list[ev.Event]:
        """The events of the workers' reports that came with this step's output (called for
        every output, with or without reports, so that a failed load's window is counted in
        steps). A block whose load the inner reported failed is not judged, and no block is
        recorded as its key's that a request computed over a failed load
        (``DigestPlanner.computed_over_failed``)."""
        errors, self._load_errors = self._load_errors, set()
        skipped = self.planner.computed_over_failed(errors)
        events: list[ev.Event] = []
        step = getattr(self._recording, "step", 0)
        for report in reports:
            if not isinstance(report, DigestReport):
                continue
            loads = []
            for row in report.loads:
                block = self._block_of.pop((row[0], row[1]), None)
                if block not in errors:
                    loads.append(row)
            report = attrs.evolve(report, loads=tuple(loads)).without(skipped)
            events += report.events(step)
        return events
