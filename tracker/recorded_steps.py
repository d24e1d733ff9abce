"""A recorder's steady decode steps: the rule that writes them and reads them back.

``KVLedgerRecorder`` (connector/recorder.py) writes one ``Scheduled`` per scheduled request
per step, except for a running request that decoded exactly one token in the plainest way:
those are batched into one ``StepDecoded`` record per run of them (a step with one unusual
request in the middle has two runs, so the order of a step's records is kept). Each entry of a
recorder's ``StepDecoded`` stands for exactly the ``Scheduled`` the recorder would have
written, and every reader of a recorder's log expands it back (:meth:`RecordedSteps.expand`),
so the rules, the digests and ``check --differential`` judge the same events either way.

An entry fits (:meth:`RecordedSteps.fits`) when the ``Scheduled`` would be: a running request
(not resumed), one token scheduled, at most one block appended, vLLM's ``num_computed`` equal
to the count the log last gave the request (its previous ``num_computed + num_scheduled``),
and exactly one token id to record, the one after those the log already holds. What the
reader needs to rebuild it is then in the log: the request's number (``tracker.numbering``:
from ``RequestAdded`` and ``Finished``), its count and its known token ids (from the events
that came before), the block and the token (in the record).

The writer follows each event once the log took it and the reader each event it reads, with
the same :meth:`RecordedSteps.follow`: a record the log lost (an encoding error, which the
recorder replaces by ``RecordLost``) never moves the writer's view, so the two never part.
Pure: no I/O.
"""

from __future__ import annotations

import operator
from typing import Any

from kvledger.tracker import decoded
from kvledger.tracker import events as ev
from kvledger.tracker.numbering import RequestNumbers
from kvledger.tracker.violation import Violation

__all__ = ["Life", "RecordedSteps", "advance"]


_NUM_TOKENS = operator.attrgetter("num_tokens")
_KNOWN = operator.attrgetter("known")


class Life:
    """What the log says of one live request: its number, its token count after its last
    scheduled step (``num_tokens``: -1 until its first ``Scheduled`` of an admission) and how
    many of its token ids the log holds (``known``)."""

    __slots__ = ("known", "num", "num_tokens")

    def __init__(self, num: int, known: int) -> None:
        self.num = num
        self.known = known
        self.num_tokens = -1


def advance(lives: Any) -> None:
    """One steady step each: what a ``StepDecoded`` entry says of its request (the writer
    calls it with the lives it batched, once the log took the record)."""
    for life in lives:
        life.num_tokens += 1
        life.known += 1


class RecordedSteps:
    """Follows a recorder's events in log order (:meth:`follow`), keeping per live request
    what a steady entry leaves out; :meth:`expand` turns a ``StepDecoded`` back into its
    ``Scheduled`` events, :meth:`fits` says whether a ``Scheduled`` can be written as one.

    For the recorder's hot path: ``lives`` may be read directly after :meth:`settle`;
    :meth:`defer` advances a batch of lives lazily (one counter for all of them, written into
    them when next read); ``changes`` counts the events followed that touched a life."""

    __slots__ = ("_deferred", "_numbers", "_pending", "_req_of", "changes", "lives")

    def __init__(self) -> None:
        self._numbers = RequestNumbers()
        self._req_of = self._numbers.req_of
        self.lives: dict[str, Life] = {}
        self.changes = 0
        self._deferred: list[Life] = []
        self._pending = 0

    def advance(self, lives: list[Life]) -> None:
        """These lives each took one steady step (a ``StepDecoded`` the log took)."""
        self.settle()
        advance(lives)
        self.changes += 1

    def defer(self, lives: list[Life]) -> None:
        """:meth:`advance`, for the same list step after step: one counter moves now, the
        lives when next read (:meth:`settle`)."""
        if lives is not self._deferred:
            self.settle()
            self._deferred = lives
        self._pending += 1

    def settle(self) -> None:
        """Write the deferred steps into their lives."""
        n = self._pending
        if n:
            for life in self._deferred:
                life.num_tokens += n
                life.known += n
            self._pending = 0
        self._deferred = []

    def follow(self, e: ev.Event) -> None:
        """One event the log holds (or, for the writer, just took)."""
        if self._pending:
            self.settle()
        cls = e.__class__
        if cls is not ev.StepDecoded:
            self.changes += 1
        if cls is ev.Scheduled:
            assert isinstance(e, ev.Scheduled)
            life = self.lives.get(e.req_id)
            if life is not None:
                life.num_tokens = e.num_computed + e.num_scheduled
                if e.token_ids:
                    life.known = max(life.known, e.token_start + len(e.token_ids))
        elif cls is ev.StepDecoded:
            assert isinstance(e, ev.StepDecoded)
            req_of, lives = self._req_of, self.lives
            found = (lives.get(req_of.get(num, "")) for num in e.nums)
            advance([life for life in found if life is not None and life.num_tokens >= 0])
        elif cls is ev.RequestAdded:
            assert isinstance(e, ev.RequestAdded)
            num = self._numbers.take(e.req_id)  # a repeated one keeps its number
            self.lives[e.req_id] = Life(num, len(e.prompt_token_ids))
        elif cls is ev.LookupAsked:
            assert isinstance(e, ev.LookupAsked)
            life = self.lives.get(e.req_id)
            if life is not None and e.token_ids:
                life.known = max(life.known, e.token_start + len(e.token_ids))
        elif cls is ev.Preempted:
            life = self.lives.get(e.req_id)
            if life is not None:
                life.num_tokens = -1  # the next step of it is a resumption
        elif cls is ev.Finished:
            self._numbers.give_back(e.req_id)
            self.lives.pop(e.req_id, None)

    def fits(self, e: ev.Scheduled) -> int | None:
        """The request's number if ``e`` can be written as an entry of a ``StepDecoded`` (see
        the module docstring); None: it must be written as it is."""
        self.settle()
        life = self.lives.get(e.req_id)
        if (
            life is None
            or e.admission is not ev.Admission.RUNNING
            or e.num_scheduled != 1
            or len(e.block_ids) > 1
            or len(e.token_ids) != 1
            or life.num_tokens < 0
            or e.num_computed != life.num_tokens
            or e.token_start != life.known
        ):
            return None
        return life.num

    def expand(self, e: ev.StepDecoded) -> tuple[list[ev.Scheduled], list[Violation]]:
        """The ``Scheduled`` events a recorder's ``StepDecoded`` stands for, in its order, and
        the violations of the entries that stand for none; then follows it."""
        out = self.scheduled_of(e)
        self.follow(e)
        return out

    def scheduled_of(self, e: ev.StepDecoded) -> tuple[list[ev.Scheduled], list[Violation]]:
        """:meth:`expand` without following ``e``."""
        entries, bad = self.entries(e)
        running = ev.Admission.RUNNING
        return [
            ev.Scheduled(
                e.step, rid, nc, 1, known, (token,), () if block is None else (block,), running
            )
            for rid, nc, known, token, block in entries
        ], bad

    def columns(self, e: ev.StepDecoded) -> tuple[list[str], list[int], list[int]] | None:
        """:meth:`entries`' request ids, counts and token starts as three lists, read with
        loops in C (the recorder's digests, every step); None when an entry is not plain (use
        :meth:`entries`, which names it)."""
        self.settle()
        nums = e.nums
        if len(e.tokens) != len(nums) or len(set(nums)) != len(nums) or e.new_blocks() is None:
            return None
        found: list[Any] = list(map(self._req_of.get, nums))
        if None in found:
            return None
        rids: list[str] = found
        found = list(map(self.lives.get, rids))
        if None in found:
            return None
        counts: list[int] = list(map(_NUM_TOKENS, found))
        if counts and min(counts) < 0:
            return None
        return rids, counts, list(map(_KNOWN, found))

    def entries(
        self, e: ev.StepDecoded
    ) -> tuple[list[tuple[str, int, int, int, int | None]], list[Violation]]:
        """What each entry of a recorder's ``StepDecoded`` stands for, as ``(req id,
        num_computed, token_start, token id, new block or None)`` (its ``Scheduled``: one token,
        running), and the violations of the entries that stand for none (read by
        ``tracker.decoded``, as every reader reads them). Does not follow ``e`` (the
        recorder's digests read a step's entries before the log takes it)."""
        self.settle()
        lives = self.lives

        def judge(entry: decoded.Entry) -> Violation | None:
            # (A numbered request has a life: both change at RequestAdded and Finished.)
            life = lives.get(entry.req_id)
            if life is None or life.num_tokens < 0:
                # Not scheduled in this life, or preempted since: its step was no steady one.
                return decoded.not_steady(e, entry.req_id)
            return None

        found, bad = decoded.entries(e, self._req_of, tokens=True, judge=judge)
        out: list[tuple[str, int, int, int, int | None]] = []
        for _, rid, block, token in found:
            life = lives[rid]
            assert token is not None  # tokens=True: every entry carries its token
            out.append((rid, life.num_tokens, life.known, token, block))
        return out, bad

    def encode(self, events: Any) -> list[ev.Event]:
        """``events`` (one step's, in order) as a recorder writes them: each run of
        consecutive ``Scheduled`` that fit becomes one ``StepDecoded``. Follows them. The
        recorder's hot path makes the same choice from vLLM's objects directly; this form is
        for tests and tools."""
        out: list[ev.Event] = []
        run: list[tuple[int, int, int | None]] = []

        def flush(step: int) -> None:
            if run:
                blocks = tuple(x for num, _, b in run if b is not None for x in (num, b))
                decoded = ev.StepDecoded(
                    step, "", tuple(n for n, _, _ in run), blocks, tuple(t for _, t, _ in run)
                )
                out.append(decoded)
                self.follow(decoded)
                run.clear()

        step = -1
        for e in events:
            if e.step != step:
                flush(step)
                step = e.step
            num = self.fits(e) if e.__class__ is ev.Scheduled else None
            if num is not None:
                assert isinstance(e, ev.Scheduled)
                block = e.block_ids[0] if e.block_ids else None
                run.append((num, e.token_ids[0], block))
                continue
            flush(step)
            out.append(e)
            self.follow(e)
        flush(step)
        return out
