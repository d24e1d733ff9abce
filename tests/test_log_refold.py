"""The fold of a re-read log equals the live state: at every step, for every request and for
the chunk index, replaying the log's input events gives exactly what the live Tracker held."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from _pool import stored_items

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.logreader import LogReader
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

BLOCK = 16
CONFIGS = {
    "defaults": TrackerConfig(block_size=BLOCK, chunk_size=16, num_slots=24),
    "decode-and-partial": TrackerConfig(
        block_size=BLOCK,
        chunk_size=32,
        num_slots=12,
        save_decode_cache=True,
        discard_partial_chunks=False,
    ),
}


def _snapshot(t: Tracker) -> tuple[dict[str, Any], list[tuple[bytes, int]], dict[str, int]]:
    return dict(t.states), stored_items(t.index), t.index.stats()


def _drive(t: Tracker, seed: int) -> list[Any]:
    """A small serving run through the Tracker's API, the way the connector calls it: shared
    prefixes, chunked prefill, steady decode steps (StepDecoded), new blocks, preemptions and
    re-admissions, confirmed and failed saves. Returns a snapshot after every step."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(32)]
    prompts = {
        f"r{i}": shared[: rng.choice([0, 16, 32])]
        + [rng.randrange(1000) for _ in range(rng.randint(10, 60))]
        for i in range(8)
    }
    tokens = {r: list(p) for r, p in prompts.items()}
    budget = {r: rng.randint(10, 50) for r in prompts}
    free = list(range(1, 500))
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    waiting = list(prompts)
    running: list[str] = []
    pending_saves: list[tuple[str, tuple[bytes, ...]]] = []
    snapshots = []
    for r, p in prompts.items():
        t.add_request(r, p)
    for _ in range(400):
        if not (waiting or running or pending_saves):
            break
        for r, keys in pending_saves:  # the worker's reports from the last step
            if rng.random() < 0.1:
                t.save_failed(r, keys)
            else:
                t.save_done(r, keys)
        pending_saves = []
        admitted = []
        for r in list(waiting)[:2]:
            ext = t.lookup(r, 0, tokens[r])
            n = min(24, len(tokens[r]) - ext)
            blocks[r] = [free.pop() for _ in range(-(-(ext + n) // BLOCK))]
            t.allocated(r, blocks[r], ext)
            computed[r] = ext
            waiting.remove(r)
            admitted.append(r)
        steady: list[int] = []
        grown: list[tuple[int, int]] = []
        for r in running + admitted:
            nc, known = computed[r], len(tokens[r])
            n = min(24, known - nc) if nc < known - 1 else 1
            need = -(-(nc + n) // BLOCK) - len(blocks[r])
            new = [free.pop() for _ in range(max(0, need))]
            blocks[r].extend(new)
            num = None
            if r not in admitted and n == 1 and len(new) <= 1:
                num = t.decode_step_ok(r, nc, new[0] if new else None)
            if num is not None:
                steady.append(num)
                if new:
                    grown.append((num, new[0]))
            else:
                admission = ev.Admission.NEW if r in admitted else ev.Admission.RUNNING
                out = t.scheduled(
                    r,
                    num_computed=nc,
                    num_scheduled=n,
                    all_token_ids=tokens[r],
                    block_ids=blocks[r] if r in admitted else new,
                    admission=admission,
                )
                keys = tuple(k for d in out if isinstance(d, ev.SavePlanned) for k in d.keys)
                if keys:
                    pending_saves.append((r, keys))
            computed[r] = nc + n
            if nc + n >= known:
                tokens[r].append(rng.randrange(1000))
        t.decoded(steady, grown)  # the end of build_connector_meta
        running = running + admitted
        for r in [r for r in running if len(tokens[r]) - len(prompts[r]) >= budget[r]]:
            running.remove(r)
            t.finished(r)
            free.extend(blocks.pop(r))
        if running and rng.random() < 0.08:
            r = rng.choice(running)
            running.remove(r)
            t.preempted(r)
            free.extend(blocks.pop(r))
            waiting.append(r)
        t.end_step()
        snapshots.append(_snapshot(t))
    return snapshots


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_refolding_the_log_gives_the_live_state_at_every_step(
    tmp_path: Path, name: str, seed: int
) -> None:
    config = CONFIGS[name]
    path = tmp_path / "run.kvlog"
    live = Tracker(config, log=LogWriter(path, config.to_dict(), rotate_bytes=2048))
    snapshots = _drive(live, seed)
    live.close()
    assert not live.violations, [v.describe() for v in live.violations]
    assert any(s[2]["stored"] for s in snapshots), "the run stored nothing: a weak test"

    reader = LogReader(tmp_path)  # several segments: rotation is part of the round trip
    assert len(reader.paths) > 1
    replayed = Tracker(config)
    decoded_steps = 0
    for step, frame in enumerate(reader):
        assert frame.step == step
        for e in frame.events:
            if e.KIND == "input":
                replayed.step = e.step
                replayed.apply(e)
            decoded_steps += isinstance(e, ev.StepDecoded)
        assert _snapshot(replayed) == snapshots[step], f"step {step} differs"
    assert reader.stop is None
    assert step == len(snapshots) - 1
    assert decoded_steps > 0, "no steady decode step was logged: a weak test"
    assert not replayed.violations, [v.describe() for v in replayed.violations]
