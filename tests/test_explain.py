"""``kvledger explain``: each reason has a run that produces it, with its facts; the figures of
explain, ``stats`` and the SQL ``misses`` table (DuckDB) are the same; a recorder's log is
explained as far as it can be; ``--request`` narrows, and an unknown id names the nearest.

The runs drive a real ``Tracker`` through vLLM's callbacks (block size 4, chunks of 8 tokens)
and write a real log; ``test_a_run_of_vllms_scheduler_shows_its_reasons`` runs vLLM's real
scheduler with the connector and the KV-content oracle (the run of docs/why-missed.md).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from _rigs import example_spec
from test_explain_props import check_admission

from kvledger.connector.logwriter import LogWriter
from kvledger.replay.cli import main
from kvledger.replay.explain import REASONS, AdmissionMisses, Explanation, explain
from kvledger.replay.summary import stats
from kvledger.tracker import events as ev
from kvledger.tracker.config import TrackerConfig
from kvledger.tracker.tracker import Tracker

B, C = 4, 8
NEW, RESUMED = ev.Admission.NEW, ev.Admission.RESUMED


class Run:
    """A Tracker with a log, driven by hand: each method is one of vLLM's callbacks."""

    def __init__(self, path: Path, **config: Any) -> None:
        self.config = TrackerConfig(block_size=B, chunk_size=C, **{"num_slots": 16, **config})
        self.writer = LogWriter(path, self.config.to_dict(), fsync="never")
        self.t = Tracker(self.config, log=self.writer)
        self.path = path
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.next_block = 1
        self.saves: dict[str, list[tuple[bytes, ...]]] = {}
        self.loaded: dict[str, int] = {}

    def add(self, rid: str, prompt: Sequence[int], salt: str = "") -> None:
        self.tokens[rid] = list(prompt)
        self.t.add_request(rid, prompt, salt)

    def admit(
        self,
        rid: str,
        *,
        local: int = 0,
        accept: int | None = None,
        admission: ev.Admission = NEW,
        room: int = 8,
    ) -> list[ev.DecisionEvent]:
        tokens = self.tokens[rid]
        offered = self.t.lookup(rid, local, tokens, preempted=admission is RESUMED)
        accepted = offered if accept is None else accept
        n = -(-(len(tokens) + room) // B)
        self.blocks[rid] = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.t.allocated(rid, self.blocks[rid], accepted)
        done = local + accepted
        out = self.t.scheduled(
            rid,
            num_computed=done,
            num_scheduled=len(tokens) - done,
            all_token_ids=tokens,
            block_ids=self.blocks[rid],
            admission=admission,
        )
        self._note(rid, out)
        return out

    def decode(self, rid: str, token: int) -> None:
        tokens = self.tokens[rid]
        n = len(tokens)
        tokens.append(token)
        out = self.t.scheduled(rid, num_computed=n, num_scheduled=1, all_token_ids=tokens)
        self._note(rid, out)

    def _note(self, rid: str, decisions: list[ev.DecisionEvent]) -> None:
        for d in decisions:
            if isinstance(d, ev.SavePlanned) and d.keys:
                self.saves.setdefault(rid, []).append(d.keys)
            if isinstance(d, ev.LoadPlanned) and d.keys:
                self.loaded[rid] = d.end - d.start

    def step(self) -> None:
        self.t.end_step()

    def saved(self, rid: str, ok: bool = True) -> tuple[bytes, ...]:
        keys = tuple(k for ks in self.saves.pop(rid, []) for k in ks)
        (self.t.save_done if ok else self.t.save_failed)(rid, keys)
        return keys

    def load(self, rid: str, failed_block: int | None = None) -> None:
        if failed_block is None:
            self.t.load_done(rid)
        else:
            self.t.load_failed(rid, [self.blocks[rid][failed_block]])

    def finish(self, rid: str) -> None:
        self.t.finished(rid, "stopped")

    def close(self) -> Path:
        self.t.end_step()
        self.writer.close()
        return self.path


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 101 + i * 7) % 900 + 10 for i in range(n)]


def explained(path: Path) -> Explanation:
    """The explanation of ``path``, checked: every admission adds up, and explain, stats and
    SQL agree on every figure."""
    x = explain(path)
    for a in x.admissions():
        check_admission(a)
    agree(path, x)
    return x


def agree(path: Path, x: Explanation | None = None) -> dict[str, Any]:
    """explain --json, stats and the SQL misses table count the same tokens."""
    from kvledger.replay.sql import query

    x = x or explain(path)
    doc = x.to_dict()
    assert doc["tokens_asked"] - doc["tokens_hit"] == doc["missed_tokens"]
    assert sum(doc["reasons"].values()) == doc["missed_tokens"]
    st = stats(path)
    assert st.misses["reasons"] == doc["reasons"]
    for key in ("tokens_asked", "tokens_hit", "missed_tokens", "hit", "admissions"):
        assert st.misses[key] == doc[key], key
    assert doc["tokens_asked"] == st.all_lookups.tokens  # the lookups stats has always counted
    assert doc["hit"]["local"] == st.all_lookups.local
    rows = query([str(path)], "SELECT reason, sum(tokens) FROM misses GROUP BY reason").rows
    assert {r: int(n) for r, n in rows} == doc["reasons"]
    (pairs,) = query(
        [str(path)],
        "SELECT count(*) FROM misses m JOIN admissions a USING (request, admission) "
        "WHERE m.step = a.step AND m.lookup_step = a.lookup_step",
    ).rows
    assert pairs[0] == sum(len(a.misses) for a in x.admissions())
    return doc


def admission(x: Explanation, request: str, n: int = 1) -> AdmissionMisses:
    (a,) = [a for a in x.admissions() if a.request == request and a.admission == n]
    return a


def misses(a: AdmissionMisses) -> list[tuple[int, int, str]]:
    return [(m.start, m.end, m.reason) for m in a.misses]


# --- one run per reason -----------------------------------------------------------------------


def test_new_prefix(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    r.add("a", prompt(20, 1))
    r.admit("a")
    x = explained(r.close())
    a = admission(x, "a")
    assert misses(a) == [(0, 20, "new_prefix")]
    assert a.tokens_hit == 0 and a.missed_tokens == 20


def _saved_then(r: Run, first: str, tokens: list[int]) -> None:
    r.add(first, tokens)
    r.admit(first)
    r.step()
    r.saved(first)
    r.finish(first)


def test_prefix_diverged_at_the_token_that_differs(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 1)
    _saved_then(r, "a", p)
    r.add("b", [*p[:14], 999, 998])
    r.admit("b")
    x = explained(r.close())
    b = admission(x, "b")
    # Three whole blocks shared (block hits); the fourth holds the token that differs.
    assert b.hit["pool"] == 12
    assert misses(b) == [(12, 14, "prefix_diverged"), (14, 16, "new_prefix")]
    diverged = b.misses[0]
    assert (diverged.at_token, diverged.by, diverged.step) == (14, "a", 0)


def test_partial_chunk_not_saved_by_policy(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")  # discard_partial_chunks: True (the default)
    p = prompt(14, 2)
    _saved_then(r, "a", p)
    r.add("again", p)
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    # The tail's whole block is saved (block hits), its partial block is not.
    assert a.hit["pool"] == 12 and misses(a) == [(12, 14, "partial_chunk")]
    assert a.misses[0].by == "a" and "discard_partial_chunks" in a.misses[0].detail


def test_partial_chunk_not_saved_without_block_hits(tmp_path: Path) -> None:
    r = Run(tmp_path / "log", block_hits=False)
    p = prompt(12, 2)
    _saved_then(r, "a", p)
    r.add("again", p)
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert a.hit["pool"] == 8 and misses(a) == [(8, 12, "partial_chunk")]
    assert "partial chunks are not saved" in a.misses[0].detail


def test_partial_chunk_inside_a_longer_chunk(tmp_path: Path) -> None:
    r = Run(tmp_path / "log", discard_partial_chunks=False, block_hits=False)
    p = prompt(16, 3)
    _saved_then(r, "a", p)
    r.add("shorter", p[:12])
    r.admit("shorter")
    x = explained(r.close())
    a = admission(x, "shorter")
    assert a.hit["pool"] == 8 and misses(a) == [(8, 12, "partial_chunk")]
    assert "longer chunk" in a.misses[0].detail


def test_decode_output_is_not_saved(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")  # save_decode_cache: False (the default)
    r.add("a", prompt(6, 4))
    r.admit("a")
    for i in range(10):
        r.step()
        r.decode("a", 500 + i)
    r.finish("a")
    r.add("again", list(r.tokens["a"]))  # the prompt and the output, asked again
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert misses(a)[0] == (0, 8, "decode_not_saved") and a.misses[0].by == "a"


def test_save_failed(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 5)
    r.add("a", p)
    r.admit("a")
    r.step()
    r.saved("a", ok=False)
    r.finish("a")
    r.add("again", p)
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert misses(a) == [(0, 16, "save_failed")]
    assert (a.misses[0].by, a.misses[0].step) == ("a", 1)


def test_save_in_flight_at_the_lookup(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 6)
    r.add("a", p)
    r.admit("a")
    r.step()
    r.add("b", p)  # asks while a's save is still in flight
    r.admit("b")
    r.saved("a")
    x = explained(r.close())
    b = admission(x, "b")
    assert misses(b) == [(0, 16, "save_in_flight")]
    assert (b.misses[0].by, b.misses[0].step) == ("a", 0)


def test_evicted_at_a_step_to_make_room_for_a_request(tmp_path: Path) -> None:
    r = Run(tmp_path / "log", num_slots=2)
    p = prompt(16, 7)
    _saved_then(r, "a", p)
    r.step()
    _saved_then(r, "b", prompt(16, 8))  # its two chunks take a's two slots
    r.step()
    r.add("again", p)
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert misses(a) == [(0, 16, "evicted")]
    assert (a.misses[0].by, a.misses[0].step) == ("b", 2)
    assert "evicted at step 2 to make room for b" in a.misses[0].describe()


def test_a_failed_load_is_recomputed_and_the_chunk_dropped(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 9)
    _saved_then(r, "a", p)
    r.step()
    r.add("b", [*p, 1, 2])
    r.admit("b")
    assert r.loaded["b"] == 16
    r.step()
    r.load("b", failed_block=2)  # the second chunk (tokens 8..15) fails to load
    r.finish("b")
    r.step()
    r.add("c", p)
    r.admit("c")
    x = explained(r.close())
    b = admission(x, "b")
    assert b.hit["pool"] == 8 and b.load_result == "failed"
    assert misses(b) == [(8, 16, "load_failed"), (16, 18, "new_prefix")]
    c = admission(x, "c")
    assert c.hit["pool"] == 8
    assert misses(c) == [(8, 16, "dropped")] and c.misses[0].by == "b"


def test_a_tail_written_over_a_failed_load_is_not_stored_though_another_chunk_holds_its_tokens(
    tmp_path: Path,
) -> None:
    """test_explain_props' failures machine found this. ``c`` writes its prompt's tail (one
    whole block) over a load that then fails: the write is cancelled. By the time its result
    arrives, another chunk (``o``'s, same tokens in its first block) holds those tokens as an
    alias. The tail's own key is stored nowhere, so a later lookup of it is missed because
    the write was cancelled, not "stored, yet not held"."""
    r = Run(tmp_path / "log", num_slots=4)
    p = prompt(12, 3)  # a chunk, and a tail of one whole block
    _saved_then(r, "a", p)
    r.step()
    o = [*p, 1, 2, 3, 4]
    r.add("o", o)
    r.admit("o")  # reads a's chunk and tail
    r.step()
    r.load("o", failed_block=2)  # the tail fails: dropped; o recomputes from token 8
    r.saved("o")  # its first write, computed over the failed load: cancelled
    r.step()
    r._note("o", r.t.scheduled("o", num_computed=8, num_scheduled=8, all_token_ids=o))
    r.add("c", p)
    r.admit("c")  # hits the chunk only (o's write is in flight); writes the tail anew
    r.load("c", failed_block=0)  # the chunk fails: dropped, c's tail write cancelled
    r.saved("o")  # o's [8, 16) is stored: the tail's tokens, as an alias
    r.saved("c")
    r.finish("c")
    r.finish("o")
    r.step()
    r.add("d", p)
    r.admit("d")
    x = explained(r.close())
    d = admission(x, "d")
    assert misses(d) == [(0, 8, "dropped"), (8, 12, "save_failed")]
    assert d.misses[1].by == "c" and d.misses[1].detail == "computed over a failed load"


def test_a_prefix_another_request_computes_in_the_lookups_step_names_it(tmp_path: Path) -> None:
    """Two requests share a prompt and arrive together; the second looks up while the first
    computes the prompt's second chunk in the same step (vLLM records a step's schedule after
    its lookups). Those tokens were being computed by the first, not new: explain names it
    and the step, before any earlier run's fact (issue 28)."""
    for earlier in (False, True):
        r = Run(tmp_path / f"log-{earlier}")
        p = prompt(16, 23)
        if earlier:  # an earlier run computed the whole prompt: a fact of another log
            old = Run(tmp_path / "old")
            old.add("old", p)
            old.admit("old")
            old_log = old.close()
        t = r.t
        r.add("a", p)
        assert t.lookup("a", 0, p) == 0
        t.allocated("a", [1, 2, 3, 4, 5, 6], 0)
        t.scheduled(  # the first chunk this step
            "a",
            num_computed=0,
            num_scheduled=8,
            all_token_ids=p,
            block_ids=[1, 2, 3, 4, 5, 6],
            admission=NEW,
        )
        r.step()
        r.add("b", p)
        assert t.lookup("b", 0, p) == 0  # asked before a's step is scheduled
        t.scheduled("a", num_computed=8, num_scheduled=8, all_token_ids=p)  # a computes 8..16
        t.allocated("b", [7, 8, 9, 10, 11], 0)
        t.scheduled(
            "b",
            num_computed=0,
            num_scheduled=16,
            all_token_ids=p,
            block_ids=[7, 8, 9, 10, 11],
            admission=NEW,
        )
        path = r.close()
        x = explain(path, earlier=[old_log] if earlier else [])
        b = admission(x, "b")
        assert misses(b) == [(0, 8, "save_in_flight"), (8, 16, "being_computed")]
        computing = b.misses[1]
        assert (computing.by, computing.step) == ("a", 1)
        assert "computed by a in step 1" in computing.describe()
        check_admission(b)


def test_pool_full_no_slot_to_save(tmp_path: Path) -> None:
    r = Run(tmp_path / "log", num_slots=1)
    p = prompt(8, 10)
    _saved_then(r, "a", p)  # the only slot
    r.step()
    r.add("reader", [*p, 1])  # loads it: pinned until its load is done
    r.add("b", prompt(8, 11))
    r.admit("reader")
    r.admit("b")  # its chunk finds no slot: the one slot is pinned
    r.step()
    r.load("reader")
    r.finish("reader")
    r.finish("b")
    r.step()
    r.add("again", prompt(8, 11))
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert misses(a) == [(0, 8, "pool_full")] and a.misses[0].by == "b"


def _remote(r: Run, p: list[int]) -> tuple[bytes, ...]:
    """a's chunks saved, written to the remote store, then gone from the host pool."""
    r.add("a", p)
    r.admit("a")
    r.step()
    keys = r.saved("a")
    r.t.apply(ev.RemoteSaveDone(r.t.step, "a", keys))
    r.finish("a")
    for key in keys:
        r.t.apply(ev.ChunkEvicted(r.t.step, "", key))
    r.step()
    return keys


def test_the_remote_tier_down(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 12)
    _remote(r, p)
    r.t.apply(ev.RemoteOutage(r.t.step, "", "connection refused"))
    r.add("again", p)
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert misses(a) == [(0, 16, "remote_down")]
    assert a.misses[0].detail == "connection refused"


def test_the_remote_tier_evicted_the_chunk(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 13)
    keys = _remote(r, p)
    r.add("again", p)
    r.t.apply(ev.RemoteFound(r.t.step, "again", keys, (1, 0)))  # the second chunk is gone
    r.admit("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert a.hit["remote"] == 8 and misses(a) == [(8, 16, "remote_evicted")]


def _foreign_second_chunk(r: Run, p: list[int], reason: str) -> tuple[tuple[bytes, ...], str]:
    """a's two chunks on the remote tier; "again" finds both and loads them, and the worker
    refuses the second one's value for ``reason`` (``{}``: the first key's hex): the load
    fails from there. The keys, and the reason as recorded."""
    keys = _remote(r, p)
    r.add("again", [*p, 5])
    r.t.apply(ev.RemoteFound(r.t.step, "again", keys, (1, 1)))
    r.admit("again")
    r.step()
    why = reason.format(keys[0].hex())
    r.t.apply(ev.RemoteLoadFailed(r.t.step, "again", keys[1:], why))
    r.load("again", failed_block=2)  # the second chunk (tokens 8..15)
    return keys, why


def test_a_value_not_its_chunks_is_named_foreign_value(tmp_path: Path) -> None:
    """The remote tier served another chunk's value under the second key (swapped): the
    worker refused it, the load failed from there, and explain names the fact a user acts on,
    with the value's reason, not a bare load_failed."""
    r = Run(tmp_path / "log")
    _, why = _foreign_second_chunk(r, prompt(16, 15), "misplaced: the value of chunk {}")
    x = explained(r.close())
    a = admission(x, "again")
    assert a.hit["remote"] == 8 and a.load_result == "failed"
    assert misses(a) == [(8, 16, "foreign_value"), (16, 17, "new_prefix")]
    assert a.misses[0].detail == why
    assert a.misses[0].describe().startswith("foreign_value (refused at step")


def test_a_key_whose_value_was_foreign_is_not_counted_again_and_explained(tmp_path: Path) -> None:
    """The tier still holds the foreign value (a lookup finds the key): the tracker does not
    count it until this engine writes the chunk, and explain says why, not new_prefix."""
    r = Run(tmp_path / "log")
    p = prompt(16, 16)
    keys, why = _foreign_second_chunk(r, p, "wrong_layout: written under another KV layout ({})")
    r.finish("again")
    r.step()
    r.add("c", [*p, 6])
    r.t.apply(ev.RemoteFound(r.t.step, "c", keys, (1, 1)))
    r.admit("c")
    x = explained(r.close())
    c = admission(x, "c")
    assert c.tokens_hit == 8
    assert misses(c) == [(8, 16, "foreign_value"), (16, 17, "new_prefix")]
    assert c.misses[0].detail == why


def test_a_remote_hit_counts_as_remote(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 14)
    keys = _remote(r, p)
    r.add("again", [*p, 5])
    r.t.apply(ev.RemoteFound(r.t.step, "again", keys, (1, 1)))
    r.admit("again")
    r.step()
    r.load("again")
    x = explained(r.close())
    a = admission(x, "again")
    assert (a.hit["remote"], a.hit["pool"]) == (16, 0) and misses(a) == [(16, 17, "new_prefix")]


def test_a_load_vllm_counted_and_the_tracker_refused(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    r.add("a", prompt(16, 15))
    r.admit("a", accept=8)  # nothing was offered: vLLM accepting 8 is a violation
    x = explained(r.close())
    a = admission(x, "a")
    assert misses(a) == [(0, 8, "load_refused"), (8, 16, "new_prefix")]


def test_recompute_only_after_a_violation(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 16)
    _saved_then(r, "a", p)
    r.step()
    r.add("b", [*p, 7, 7])
    r.admit("b", accept=0)  # offered 16, accepted none: a violation, recompute only
    r.step()
    r.t.preempted("b")
    r.step()
    r.admit("b", admission=RESUMED)  # the pool holds 16 of its tokens; none offered now
    x = explained(r.close())
    first, second = admission(x, "b", 1), admission(x, "b", 2)
    assert misses(first) == [(0, 16, "not_accepted"), (16, 18, "new_prefix")]
    assert misses(second)[0] == (0, 16, "recompute_only")


def test_different_cache_salt(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 17)
    r.add("a", p, salt="tenant-a")
    r.admit("a")
    r.step()
    r.saved("a")
    r.finish("a")
    r.add("b", [*p, 3], salt="tenant-b")
    r.admit("b")
    x = explained(r.close())
    b = admission(x, "b")
    assert misses(b) == [(0, 16, "different_salt"), (16, 17, "new_prefix")]
    assert b.misses[0].by == "a" and "'tenant-a'" in b.misses[0].detail


def _one_run(path: Path, p: list[int], rid: str, **config: Any) -> Path:
    r = Run(path, **config)
    r.add(rid, p)
    r.admit(rid)
    r.step()
    r.saved(rid)
    r.finish(rid)
    return r.close()


def test_an_earlier_run_and_another_model(tmp_path: Path, capsys: Any) -> None:
    """Logs of earlier runs (--earlier) count as history: the same model's prefixes were
    computed by another engine (earlier_run), another model's under other keys
    (different_salt, naming both model salts)."""
    p = prompt(16, 23)
    before = _one_run(tmp_path / "before.kvlog", p, "old", salt="tiny-llama|fp16")
    other = _one_run(tmp_path / "other.kvlog", p, "other", salt="tiny-llama|fp32")
    now = _one_run(tmp_path / "now.kvlog", [*p, 1], "new", salt="tiny-llama|fp16")
    alone = admission(explain(now), "new")
    assert misses(alone) == [(0, 17, "new_prefix")]
    x = explain(now, earlier=[before])
    a = admission(x, "new")
    assert misses(a) == [(0, 16, "earlier_run"), (16, 17, "new_prefix")]
    assert a.misses[0].by == "old" and str(before) in a.misses[0].detail
    assert [r.request for r in x.requests] == ["new"]  # the earlier run's are history only
    y = explain(now, earlier=[other])
    b = admission(y, "new")
    assert misses(b) == [(0, 16, "different_salt"), (16, 17, "new_prefix")]
    assert "'tiny-llama|fp32'" in b.misses[0].detail and "'tiny-llama|fp16'" in b.misses[0].detail
    assert main(["explain", str(now), "--earlier", str(before), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reasons"] == {"earlier_run": 16, "new_prefix": 1}


def test_an_earlier_log_read_in_part_is_said_and_exits_2(tmp_path: Path, capsys: Any) -> None:
    """An earlier log cut short is history the reasons did not see: explain says so on
    stderr and exits 2, as it does for the log it explains, and --json names the damage."""
    p = prompt(16, 23)
    before = _one_run(tmp_path / "before.kvlog", p, "old")
    now = _one_run(tmp_path / "now.kvlog", [*p, 1], "new")
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(before.read_bytes()[:-20])
    assert main(["explain", str(now), "--earlier", str(before)]) == 0
    capsys.readouterr()
    assert main(["explain", str(now), "--earlier", str(torn)]) == 2
    err = capsys.readouterr().err
    assert f"{torn}: read stopped early" in err and "torn_tail" in err
    assert main(["explain", str(now), "--earlier", str(torn), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["damage"] is None
    assert [(d["log"], d["kind"]) for d in out["earlier_damage"]] == [(str(torn), "torn_tail")]


def test_a_whole_prompt_hit_leaves_the_last_token_by_rule(tmp_path: Path) -> None:
    r = Run(tmp_path / "log")
    p = prompt(16, 18)
    _saved_then(r, "a", p)
    r.add("again", p)
    r.admit("again", local=8)  # vLLM's own prefix cache holds the first 8
    x = explained(r.close())
    a = admission(x, "again")
    assert a.hit == {"local": 8, "pool": 7, "remote": 0, "inner": 0, "last_token": 1}
    assert a.misses == [] and a.tokens_hit == 16


def test_every_reason_has_a_run_here() -> None:
    """Each reason of REASONS is asserted as a missed span's reason by a test of this
    module."""
    source = Path(__file__).read_text()
    for reason in REASONS:  # as a missed span's reason: (start, end, "reason")
        assert f'"{reason}")' in source, reason


def test_what_the_log_does_not_say_is_unexplained(tmp_path: Path) -> None:
    """A log that lacks a fact (a load plan cut out of it: damage, or an edit): the tokens
    vLLM skipped with no load to show for them are ``unexplained``, never guessed."""
    from _replay_logs import copy_log

    r = Run(tmp_path / "log")
    p = prompt(16, 22)
    _saved_then(r, "a", p)
    r.add("again", [*p, 1])
    r.admit("again")
    source = r.close()

    def no_load(e: ev.Event) -> ev.Event | None:
        return None if isinstance(e, ev.LoadPlanned) else e

    copy_log(source, tmp_path / "edited.kvlog", no_load)
    a = admission(explain(source), "again")
    assert a.hit["pool"] == 16 and misses(a) == [(16, 17, "new_prefix")]
    cut = admission(explain(tmp_path / "edited.kvlog"), "again")
    assert misses(cut) == [(0, 16, "unexplained"), (16, 17, "new_prefix")]
    assert cut.misses[0].detail == "accepted, no load plan"


# --- a recorder's log -------------------------------------------------------------------------


@contextlib.contextmanager
def recorded_log(path: Path) -> Iterator[tuple[LogWriter, Callable[..., None]]]:
    """A recorder's log (its header names the inner connector), and ``ask``: one request
    admitted as the recorder records it (added, asked, the inner's offer, allocated with that
    offer accepted, scheduled)."""
    config = TrackerConfig(block_size=B, chunk_size=C)
    header = {**config.to_dict(), "recorder": {"format": 1, "inner": "SomeConnector"}}
    with LogWriter(path, header, fsync="never") as w:

        def ask(step: int, rid: str, tokens: list[int], offer: int, blocks: tuple[int, ...]):
            w.append(ev.RequestAdded(step, rid, tuple(tokens)))
            w.append(ev.LookupAsked(step, rid, 0, len(tokens), 0, tuple(tokens)))
            w.append(ev.InnerLookupAnswered(step, rid, offer))
            w.append(ev.Allocated(step, rid, blocks, offer))
            w.append(
                ev.Scheduled(step, rid, offer, len(tokens) - offer, 0, tuple(tokens), blocks, NEW)
            )

        yield w, ask


def test_a_recorders_log(tmp_path: Path) -> None:
    """On a recorder's log explain shows what vLLM was offered against what the run computed
    before; what the wrapped connector did not offer is not_offered."""
    path = tmp_path / "recorded.kvlog"
    p = prompt(16, 19)
    with recorded_log(path) as (w, ask):
        ask(0, "a", p, 0, (1, 2, 3, 4))
        w.end_step(0)
        w.append(ev.Finished(1, "a", "stopped"))
        ask(1, "b", [*p, 5], 8, (5, 6, 7, 8, 9))  # offered the first chunk only
        w.end_step(1)
    x = explained(path)
    assert x.recorded
    b = admission(x, "b")
    assert b.hit["inner"] == 8
    assert misses(b) == [(8, 16, "not_offered"), (16, 17, "new_prefix")]
    assert any("not the wrapped connector's store" in n for n in x.notes())


def test_a_recorders_log_with_the_connectors_kv_events(tmp_path: Path) -> None:
    """Where the wrapped connector publishes KV events, explain splits what it did not offer:
    it held it (a silently shortened hit), it dropped it (and every key after it: a hit is a
    prefix), it never stored it. The sums hold, and check names the shortened hit."""
    path = tmp_path / "recorded.kvlog"
    p = prompt(32, 23)
    with recorded_log(path) as (w, ask):
        ask(0, "a", p, 0, tuple(range(1, 9)))
        w.end_step(0)
        w.append(ev.Finished(1, "a", "stopped"))
        # The connector stored a's first three chunks (not the fourth), then dropped the second.
        w.append(ev.InnerStored(1, "", (b"h0", b"h1", b"h2"), b"", tuple(p[:24]), C, "cpu"))
        w.append(ev.InnerRemoved(1, "", (b"h1",), "cpu"))
        w.end_step(1)
        ask(2, "b", [*p, 5], 0, tuple(range(9, 18)))  # held [0, 8), offered nothing
        w.end_step(2)
    x = explained(path)
    b = admission(x, "b")
    assert misses(b) == [
        (0, 8, "inner_not_offered"),
        (8, 24, "inner_evicted"),
        (24, 32, "inner_never_stored"),
        (32, 33, "new_prefix"),
    ]
    held, dropped, never = b.misses[:3]
    assert (held.step, dropped.step, never.step, never.by) == (1, 1, 0, "a")
    assert dropped.describe() == "inner_evicted (dropped by the wrapped connector at step 1)"
    assert x.to_dict()["inner_events"] == {"stores": 1, "removals": 1, "unplaced": 0}
    from kvledger.replay.replayer import check

    result = check(path)
    assert [(p.name, p.req_id, p.step) for p in result.problems] == [("stored_not_offered", "b", 2)]


# --- the command ------------------------------------------------------------------------------


def _sample(tmp_path: Path) -> Path:
    r = Run(tmp_path / "sample.kvlog", num_slots=2)
    p = prompt(16, 20)
    _saved_then(r, "req-1", p)
    r.step()
    _saved_then(r, "req-2", prompt(16, 21))
    r.step()
    r.add("req-3", [*p, 4])
    r.admit("req-3")
    return r.close()


def test_the_command_text_json_and_request(tmp_path: Path, capsys: Any) -> None:
    log = _sample(tmp_path)
    assert main(["explain", str(log), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(explain(log).to_dict()))
    assert set(doc) >= {"tokens_asked", "tokens_hit", "missed_tokens", "reasons", "requests"}
    assert doc["missed_tokens"] == doc["tokens_asked"] - doc["tokens_hit"]
    assert main(["explain", str(log)]) == 0
    text = capsys.readouterr().out
    assert "missed tokens by reason" in text and "evicted" in text and "req-3" in text
    assert main(["explain", str(log), "--request", "req-3", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert [r["request"] for r in one["requests"]] == ["req-3"]
    assert one["missed_tokens"] == one["requests"][0]["missed_tokens"] == 17
    assert one["reasons"] == {"evicted": 16, "new_prefix": 1}
    assert main(["explain", str(log), "-r", "req-3"]) == 0
    text = capsys.readouterr().out
    assert "[0, 16)" in text and "evicted at step 2 to make room for req-2" in text


def test_an_unknown_request_names_the_nearest(tmp_path: Path, capsys: Any) -> None:
    log = _sample(tmp_path)
    assert main(["explain", str(log), "--request", "req-4"]) == 2
    err = capsys.readouterr().err
    assert "no request 'req-4' in the log; nearest: " in err
    assert {"req-1", "req-2", "req-3"} <= set(err.split("nearest: ")[1].strip().split(", "))
    assert main(["explain", str(log), "--request", "req-4", "--json"]) == 2
    assert "nearest" in json.loads(capsys.readouterr().out)["error"]


def test_a_missing_log_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    assert main(["explain", str(tmp_path / "nope.kvlog")]) == 2
    assert "no such file" in capsys.readouterr().err


# --- the same figures everywhere --------------------------------------------------------------


def _data_logs() -> Iterator[Path]:
    yield from sorted((Path(__file__).parent / "data").glob("replay-*.kvlog"))


@pytest.mark.parametrize("log", list(_data_logs()), ids=lambda p: p.name)
def test_explain_stats_and_sql_agree_on_the_data_logs(log: Path) -> None:
    explained(log)


def test_the_timeline_and_the_trace_label_the_same_misses(tmp_path: Path) -> None:
    from kvledger.replay.charts import timeline
    from kvledger.replay.perfetto import trace

    log = _sample(tmp_path)
    doc = explain(log).to_dict()
    result = timeline(log, tmp_path / "t.html", top=10)
    drawn = {
        (s.label, a.step): {r: n for r, n in _by_reason(a.misses).items()}
        for s in result.series
        for a in s.admissions
        if a.misses
    }
    want = {
        (a["request"], a["step"]): a["reasons"]
        for r in doc["requests"]
        for a in r["admissions"]
        if a["reasons"]
    }
    assert drawn == want
    page = (tmp_path / "t.html").read_text()
    assert "missed at the lookup, by reason" in page
    marks = [e for e in trace(log)["traceEvents"] if e.get("cat") == "miss"]
    assert sorted(
        e["args"]["reasons"]["evicted"] for e in marks if "evicted" in e["args"]["reasons"]
    ) == [16]


def _by_reason(spans: Sequence[tuple[int, int, str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for start, end, reason, _ in spans:
        out[reason] = out.get(reason, 0) + end - start
    return out


# --- vLLM's real scheduler ------------------------------------------------------------------


@pytest.mark.vllm
def test_a_run_of_vllms_scheduler_shows_its_reasons(tmp_path: Path) -> None:
    """The run of docs/why-missed.md (tests/_miss_run.py): vLLM's real scheduler with the
    connector, proven by the KV-content oracle, a pool of five chunks, prompts that share 40
    tokens, three asked again, one failed load: six reasons, each with its facts."""
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(f"vLLM's scheduler is not usable: {reason}")
    from _miss_run import make

    report = make(str(tmp_path / "run"))
    assert report.load_errors
    x = explained(tmp_path / "run")
    assert set(x.totals()["reasons"]) == {
        "new_prefix",
        "being_computed",  # req-0 and req-1 computed their shared 40 tokens in one step
        "prefix_diverged",
        "partial_chunk",
        "evicted",
        "load_failed",
    }
    for a in x.admissions():
        for m in a.misses:
            if m.reason == "prefix_diverged":
                assert m.at_token == 40 and (m.start, m.end) == (32, 40)  # the shared prefix
            if m.reason == "evicted":
                assert a.request in ("req-4", "again-req-0", "again-req-1", "again-req-2")
                assert m.by is not None and m.step is not None
            if m.reason == "being_computed":  # each by the other, in the step both asked
                assert {a.request, m.by} == {"req-0", "req-1"} and m.step == a.lookup_step
                assert (m.start, m.end) == (0, 40)
    failed = admission(x, "again-req-1")
    assert (0, 32, "load_failed") in misses(failed) and failed.load_result == "failed"


def test_the_page_names_every_reason() -> None:
    """docs/why-missed.md's table of reasons is REASONS, in its order."""
    page = (Path(__file__).parent.parent / "docs" / "why-missed.md").read_text()
    import re

    listed = re.findall(r"^\| `(\w+)` \|", page.split("## The reasons", 1)[1], flags=re.M)
    assert listed == list(REASONS)


@pytest.mark.vllm
def test_a_recorders_log_of_vllms_example_connector(tmp_path: Path) -> None:
    """vLLM's ExampleConnector wrapped in KVLedgerRecorder under vLLM's real scheduler (the
    oracle checking every token): vLLM's prefix cache serves the shared prefixes; the tails
    of the repeated prompts, computed before in this run and not offered by the inner, are
    ``not_offered``; it all adds up and agrees with stats and SQL."""
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(f"vLLM's scheduler is not usable: {reason}")
    from kvledger.connector.testing.recorded import run_wrapped

    spec = example_spec(
        tmp_path / "store",
        num_requests=4,
        num_gpu_blocks=24,
        prompt_len=(20, 50),
        max_tokens=(4, 8),
    )
    report = run_wrapped(spec, log_dir=str(tmp_path / "logs"))
    assert not report.mismatches
    x = explained(tmp_path / "logs")
    assert x.recorded
    t = x.totals()
    assert t["hit"]["local"] > 0  # vLLM's prefix cache: the shared and repeated prefixes
    # The repeated prompts' tails were computed before in this run; the inner offered none.
    again = [a for a in x.admissions() if a.request.startswith("again-")]
    assert again and all(m.reason == "not_offered" for a in again for m in a.misses)
    assert set(t["reasons"]) <= set(REASONS) - {"unexplained"}
    assert any("not the wrapped connector's store" in n for n in x.notes())
