"""The steady batch (tracker/steady_batch.py, ``Tracker.steady_batch`` / ``batch_step``) decides
exactly what the request-by-request path decides: two trackers fed the same steps, one always
request by request, the other through the batch where it can, write the same log and end in
the same states, whatever vLLM does (a count off by one, a block it forgot to allocate, a save
due, a finish, a preemption)."""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tracker import events as ev
from tracker.config import TrackerConfig
from tracker.steady_batch import SteadyBatch
from tracker.tracker import Tracker

CFG = TrackerConfig(block_size=4, chunk_size=8, num_slots=6)


class _Sink:
    def __init__(self) -> None:
        self.events: list[ev.Event] = []

    def append(self, e: ev.Event) -> None:
        self.events.append(e)

    def end_step(self, step: int) -> None:
        pass


class _Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class _Side:
    """One tracker and what the connector keeps beside it (its batch)."""

    def __init__(self, batched: bool) -> None:
        self.log = _Sink()
        self.t = Tracker(CFG, log=self.log, logger=_Quiet())
        self.batched = batched
        self.batch: SteadyBatch | None = None
        self.saves: dict[str, list[bytes]] = {}

    def decisions(self, rid: str, out: list[ev.DecisionEvent]) -> None:
        for d in out:
            if isinstance(d, ev.SavePlanned) and d.keys:
                self.saves.setdefault(rid, []).extend(d.keys)

    def step(self, steps: list[tuple[str, int, list[int], list[int], bool]]) -> str:
        """One build_connector_meta: (req id, num_computed, all tokens, new blocks, resumed)
        per cached request, in vLLM's order. Returns how the step went."""
        t = self.t
        batch, self.batch = self.batch, None
        if self.batched and batch is not None and not any(r for *_, r in steps):
            simple = all(len(new) <= 1 for _, _, _, new, _ in steps)
            if simple and [rid for rid, *_ in steps] == batch.req_ids:
                grown = [(i, new[0]) for i, (_, _, _, new, _) in enumerate(steps) if new]
                if t.batch_step(batch, [nc for _, nc, _, _, _ in steps], grown):
                    self.batch = batch
                    t.end_step()
                    return "batch"
        steady: list[int] = []
        grown_pairs: list[tuple[int, int]] = []
        whole = bool(steps)
        for rid, nc, tokens, new, resumed in steps:
            if not resumed and len(new) <= 1:
                num = t.decode_step_ok(rid, nc, new[0] if new else None)
                if num is not None:
                    steady.append(num)
                    if new:
                        grown_pairs.append((num, new[0]))
                    continue
            whole = False
            admission = ev.Admission.RESUMED if resumed else ev.Admission.RUNNING
            out = t.scheduled(
                rid,
                num_computed=nc,
                num_scheduled=1 if not resumed else len(tokens) - nc,
                all_token_ids=tokens,
                block_ids=new,
                admission=admission,
            )
            self.decisions(rid, out)
        t.decoded(steady, grown_pairs)
        if whole and self.batched:
            self.batch = t.steady_batch([rid for rid, *_ in steps])
        t.end_step()
        return "whole" if whole else "mixed"


_ACTIONS = st.sampled_from(
    ["decode"] * 12
    + ["off_by_one", "forget_block", "save_done", "save_failed", "finish", "preempt", "add"]
)


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 14), min_size=1, max_size=4),
    actions=st.lists(_ACTIONS, min_size=1, max_size=60),
    save_decode=st.booleans(),
)
def test_the_batch_decides_what_the_request_by_request_path_decides(
    prompts: list[int], actions: list[str], save_decode: bool
) -> None:
    cfg = TrackerConfig(block_size=4, chunk_size=8, num_slots=6, save_decode_cache=save_decode)
    sides = [_Side(False), _Side(True)]
    for s in sides:
        s.t = Tracker(cfg, log=s.log, logger=_Quiet())
    tokens: dict[str, list[int]] = {}
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    running: list[str] = []
    next_block = [100]

    def alloc(rid: str, upto: int, forget: bool = False) -> list[int]:
        new = []
        while len(blocks[rid]) * cfg.block_size < upto and not forget:
            blocks[rid].append(next_block[0])
            new.append(next_block[0])
            next_block[0] += 1
        return new

    def admit(rid: str, n: int) -> None:
        tokens[rid] = [(hash(rid) + i) % 97 for i in range(n)]
        blocks[rid] = []
        computed[rid] = 0
        new = alloc(rid, n)
        for s in sides:
            s.t.add_request(rid, tokens[rid])
            external = s.t.lookup(rid, 0, tokens[rid])
            s.t.allocated(rid, new, external)
            out = s.t.scheduled(
                rid,
                num_computed=0,
                num_scheduled=n,
                all_token_ids=tokens[rid],
                block_ids=new,
                admission=ev.Admission.NEW,
            )
            s.decisions(rid, out)
            s.t.decoded([])
            s.t.end_step()
        computed[rid] = n
        running.append(rid)

    for i, n in enumerate(prompts):
        admit(f"r{i}", n)
    added = len(prompts)
    for action in actions:
        if action == "add":
            admit(f"r{added}", 3 + added % 5)
            added += 1
            continue
        if not running:
            continue
        victim = running[len(actions) % len(running)]
        if action in ("save_done", "save_failed"):
            for s in sides:
                for rid, keys in list(s.saves.items()):
                    if action == "save_done":
                        s.t.save_done(rid, keys)
                    else:  # the save cursor moves back: a save is due again sooner
                        s.t.save_failed(rid, keys)
                s.saves.clear()
            continue
        if action == "finish":
            running.remove(victim)
            for s in sides:
                s.t.finished(victim, "length")
            continue
        if action == "preempt":
            running.remove(victim)
            for s in sides:
                s.t.preempted(victim)
            continue
        cached = []
        for rid in running:
            nc = computed[rid]
            tokens[rid].append((nc * 7 + len(rid)) % 97)
            forget = action == "forget_block" and rid == victim
            new = alloc(rid, nc + 1, forget)
            if action == "off_by_one" and rid == victim:
                nc += 1
            cached.append((rid, nc, list(tokens[rid]), new, False))
            computed[rid] = computed[rid] + 1
        how = [s.step(cached) for s in sides]
        event(f"batched side: {how[1]}")
        assert how[0] != "batch"
        # the same log, step by step
        assert sides[0].log.events == sides[1].log.events
    for rid in tokens:
        a, b = (s.t.state(rid) for s in sides)
        assert a == b, rid
    assert sides[0].log.events == sides[1].log.events
    assert sides[0].t.violations == sides[1].t.violations
