"""The rules any connector must keep, on recorded event sequences (tracker/recorded_rules.py):
each rule on the smallest history that breaks it and on its nearest clean neighbour, then
hypothesis histories of a well-behaved connector (clean) with one fault planted (that rule,
at that step)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.tracker import events as ev
from kvledger.tracker.recorded_rules import RECORDED_RULES, check_recorded

BS = 16
PROMPT = tuple(range(100, 148))  # 48 tokens, 3 blocks


def rules(events):
    return [v.rule for v in check_recorded(events, BS)]


def admission(rid="r", *, step=0, offered=32, accepted=32, blocks=(1, 2, 3, 4), local=0):
    """A request asked, answered ``offered``, allocated with ``accepted``, scheduled."""
    return [
        ev.RequestAdded(step, rid, PROMPT),
        ev.LookupAsked(step, rid, local, len(PROMPT), 48, ()),
        ev.InnerLookupAnswered(step, rid, offered, False),
        ev.Allocated(step, rid, blocks, accepted),
        ev.Scheduled(step, rid, local + accepted, 48 - local - accepted, 48, (), blocks, 1),
    ]


def test_every_rule_is_documented():
    assert set(RECORDED_RULES) == {
        "lookup_unstable",
        "accepted_beyond_offer",
        "accepted_beyond_allocation",
        "full_hit_no_last_token",
        "load_not_finished",
        "load_during_save",
        "freed_while_saving",
        "readmission_cached_below_external",
        "stale_completion",
        "finished_without_blocks",
        "connector_raised",
        "stored_not_offered",
    }


def test_clean_admission():
    assert rules(admission()) == []


def test_accepted_beyond_offer():
    assert rules(admission(offered=16, accepted=32)) == ["accepted_beyond_offer"]
    # An answer of None ("ask again later") offers nothing.
    assert rules(admission(offered=-1, accepted=16)) == ["accepted_beyond_offer"]


def test_accepted_beyond_allocation():
    assert rules(admission(blocks=(1,), accepted=32)) == ["accepted_beyond_allocation"]
    assert rules(admission(blocks=(1, 2), accepted=32)) == []


def test_full_hit_no_last_token():
    assert rules(admission(offered=48, accepted=47)) == ["full_hit_no_last_token"]
    assert rules(admission(offered=47, accepted=47)) == []
    # With a local hit, the external tokens count on top of it.
    assert rules(admission(local=16, offered=32, accepted=32)) == ["full_hit_no_last_token"]


def _ask(step, offered, rid="r", load_async=False):
    return [
        ev.LookupAsked(step, rid, 0, len(PROMPT), 48, ()),
        ev.InnerLookupAnswered(step, rid, offered, load_async),
    ]


def test_lookup_unstable_only_when_nothing_changed():
    start = [ev.RequestAdded(0, "r", PROMPT)]
    assert rules(start + _ask(0, 32) + _ask(1, 16)) == ["lookup_unstable"]
    assert rules(start + _ask(0, 32) + _ask(1, 32)) == []
    # A forward pass ran in between (another request computed): the store may have changed.
    other = [ev.Scheduled(0, "o", 0, 16, 0, (), (9,), 1)]
    assert rules(start + _ask(0, 32) + other + _ask(1, 16)) == []
    # A transfer result came back in between.
    done = [ev.InnerSendDone(1, "o")]
    assert rules(start + _ask(0, 32) + done + _ask(1, 16)) == []
    # "Ask again later" is not an answer to compare.
    assert rules(start + _ask(0, -1) + _ask(1, 16)) == []


def test_async_load_must_finish_before_computing():
    events = [
        ev.RequestAdded(0, "r", PROMPT),
        *_ask(0, 32, load_async=True),
        ev.Allocated(0, "r", (1, 2, 3), 32),
    ]
    computed = [ev.Scheduled(3, "r", 32, 16, 48, (), (1, 2, 3), 1)]
    assert rules(events + computed) == ["load_not_finished"]
    received = [ev.InnerRecvDone(2, "r"), ev.Allocated(2, "r", (1, 2, 3), 0)]
    assert rules(events + received + computed) == []


def test_late_sync_load_error():
    events = admission(accepted=32, blocks=(1, 2, 3))
    run = [ev.Scheduled(s, "r", 47 + s, 1, 48, (), (), 0) for s in (1, 2)]
    error = [ev.InnerLoadErrors(3, "", (2,))]
    assert rules(events + run + error) == ["load_not_finished"]
    # Reported in time (the next step's output; one step of slack for async scheduling).
    assert rules(events + run[:1] + error) == []
    # About a block the load did not write.
    assert rules(events + run + [ev.InnerLoadErrors(3, "", (3,))]) == []


def _finish(rid, delay, blocks=(1, 2, 3), step=5):
    return [ev.Finished(step, rid, "stopped"), ev.InnerFinishedAnswered(step, rid, delay, blocks)]


def test_load_during_save():
    first = admission("r", offered=0, accepted=0) + _finish("r", True)
    again = admission("r", step=6, offered=32, accepted=32, blocks=(5, 6, 7))
    assert rules(first + again) == ["load_during_save"]
    sent = [ev.InnerSendDone(6, "r")]
    assert rules(first + sent + again) == []


def test_freed_while_saving():
    first = admission("r", offered=0, accepted=0) + _finish("r", True, blocks=(1, 2))
    other = admission("o", step=6, offered=0, accepted=0, blocks=(2, 8, 9))
    assert "freed_while_saving" in rules(first + other)
    assert rules([*first, ev.InnerSendDone(6, "r"), *other]) == []
    # A finished_sending for a request whose blocks vLLM freed at once.
    freed = admission("r", offered=0, accepted=0) + _finish("r", False)
    assert rules([*freed, ev.InnerSendDone(6, "r")]) == ["freed_while_saving"]


def test_readmission_cached_below_external():
    events = admission("r", offered=32, accepted=32)[:4]
    short = ev.Scheduled(0, "r", 16, 32, 48, (), (1, 2, 3, 4), 2)
    assert rules([*events, short]) == ["readmission_cached_below_external"]
    right = ev.Scheduled(0, "r", 32, 16, 48, (), (1, 2, 3, 4), 2)
    assert rules([*events, right]) == []


# --- hypothesis: a well-behaved connector's histories are clean; one fault is named --------


@st.composite
def histories(draw):
    """Requests admitted one per step with answers a sane connector gives (block aligned,
    within the prompt less one token, accepted as offered), some preempted and re-admitted,
    finished with or without a delayed free that finished_sending ends before any reuse."""
    n = draw(st.integers(1, 6))
    events: list[ev.Event] = []
    step = 0
    next_block = 1
    for i in range(n):
        rid = f"r{i}"
        length = draw(st.integers(2, 80))
        prompt = tuple(range(length))
        events.append(ev.RequestAdded(step, rid, prompt))
        for _ in range(draw(st.integers(1, 3))):  # admitted, maybe preempted and re-admitted
            local = draw(st.integers(0, (length - 1) // BS)) * BS
            offered = draw(st.integers(0, (length - 1 - local) // BS)) * BS
            blocks = tuple(range(next_block, next_block + -(-length // BS)))
            next_block += len(blocks)
            events += [
                ev.LookupAsked(step, rid, local, length, 0, ()),
                ev.InnerLookupAnswered(step, rid, offered, False),
                ev.Allocated(step, rid, blocks, offered),
                ev.Scheduled(
                    step, rid, local + offered, length - local - offered, 0, (), blocks, 1
                ),
            ]
            step += 1
            if draw(st.booleans()):
                events.append(ev.Preempted(step, rid))
            else:
                break
        delay = draw(st.booleans())
        events += [
            ev.Finished(step, rid, "stopped"),
            ev.InnerFinishedAnswered(step, rid, delay, blocks),
        ]
        if delay:
            events.append(ev.InnerSendDone(step + 1, rid))
        step += 2
    return events


@settings(max_examples=200, deadline=None)
@given(histories())
def test_sane_histories_are_clean(events):
    assert rules(events) == []


@settings(max_examples=200, deadline=None)
@given(histories(), st.data())
def test_an_overclaimed_acceptance_is_named(events, data):
    """vLLM accepting more than was offered, at one admission: named there first (its
    Scheduled, which still counts the old acceptance, may also fall short of the new one)."""
    allocs = [i for i, e in enumerate(events) if isinstance(e, ev.Allocated)]
    i = data.draw(st.sampled_from(allocs))
    e = events[i]
    bad = ev.Allocated(e.step, e.req_id, (*e.block_ids, 999), e.num_external + BS)
    found = check_recorded([*events[:i], bad, *events[i + 1 :]], BS)
    assert (found[0].rule, found[0].step, found[0].req_id) == (
        "accepted_beyond_offer",
        e.step,
        e.req_id,
    )
    assert {(v.step, v.req_id) for v in found} == {(e.step, e.req_id)}
    assert {v.rule for v in found} <= {"accepted_beyond_offer", "readmission_cached_below_external"}


# --- completions of another life, hand-offs without blocks, raises (the bug-shape zoo) -------


def _life(rid, step, *, delay=False, blocks=(1, 2, 3), params=""):
    """Admitted, computed, finished (``delay``: request_finished keeps the blocks)."""
    return [
        *admission(rid, step=step, offered=0, accepted=0, blocks=blocks),
        ev.Finished(step + 1, rid, "finished_length_capped"),
        ev.InnerFinishedAnswered(step + 1, rid, delay, blocks, params),
    ]


def named(events):
    return [(v.rule, v.req_id, v.step) for v in check_recorded(events, BS)]


def test_stale_send_completion_for_an_earlier_life():
    """vLLM #51637's shape: the id comes back as a new request and receives a finished_sending
    while it runs; the completion of its first life had already come."""
    first = [*_life("x", 0, delay=True), ev.InnerSendDone(2, "x")]
    second = admission("x", step=3, offered=0, accepted=0, blocks=(4, 5, 6))
    assert named([*first, *second, ev.InnerSendDone(4, "x")]) == [("stale_completion", "x", 4)]
    (v,) = check_recorded([*first, *second, ev.InnerSendDone(4, "x")], BS)
    assert v.detail["request"].startswith("running") and v.detail["earlier_life_finished"] == 1
    # Its nearest clean neighbour: the second life finishes keeping its blocks, then the send.
    done = [ev.Finished(4, "x", "stopped"), ev.InnerFinishedAnswered(4, "x", True, (4, 5, 6))]
    assert named([*first, *second, *done, ev.InnerSendDone(5, "x")]) == []


def test_stale_send_completion_twice_and_for_a_running_request():
    first = [*_life("x", 0, delay=True), ev.InnerSendDone(2, "x")]
    assert named([*first, ev.InnerSendDone(3, "x")]) == [("stale_completion", "x", 3)]
    # A request that never finished cannot have finished sending.
    assert named([*admission("y"), ev.InnerSendDone(1, "y")]) == [("stale_completion", "y", 1)]
    # A freed request's late send stays freed_while_saving (not named twice).
    freed = [*_life("z", 0, delay=False), ev.InnerSendDone(2, "z")]
    assert named(freed) == [("freed_while_saving", "z", 2)]


def test_stale_recv_completion():
    asked = [
        ev.RequestAdded(0, "r", PROMPT),
        *_ask(0, 32, load_async=True),
        ev.Allocated(0, "r", (1, 2, 3), 32),
    ]
    received = [ev.InnerRecvDone(2, "r"), ev.Allocated(2, "r", (1, 2, 3), 0)]
    computed = [ev.Scheduled(3, "r", 32, 16, 48, (), (1, 2, 3), 1)]
    assert named([*asked, *received, *computed]) == []
    assert named([*asked, *received, *computed, ev.InnerRecvDone(4, "r")]) == [
        ("stale_completion", "r", 4)
    ]
    # A receive for a request that accepted no asynchronous load.
    assert named([*admission("s"), ev.InnerRecvDone(1, "s")]) == [("stale_completion", "s", 1)]
    # Aborted while loading: vLLM still waits for the receive, which is not stale.
    aborted = [
        ev.Finished(1, "r", "finished_aborted"),
        ev.InnerFinishedAnswered(1, "r", False, ()),
        ev.InnerRecvDone(2, "r"),
    ]
    assert named([*asked, *aborted]) == []


def test_completions_the_log_cannot_judge():
    # An id this log never saw (it began later), and one whose record was lost.
    assert named([ev.InnerSendDone(0, "old"), ev.InnerRecvDone(0, "old")]) == []
    lost = [*admission("y"), ev.RecordLost(1, "y", "request_finished", "boom")]
    assert named([*lost, ev.InnerSendDone(2, "y")]) == []


def _handoff(blocks, *, reason="finished_length_capped", computed=True, preempted=True):
    events = admission("b", offered=0, accepted=0)
    if not computed:
        events = events[:4]
    if preempted:
        events.append(ev.Preempted(1, "b"))
    return [
        *events,
        ev.Finished(2, "b", reason),
        ev.InnerFinishedAnswered(2, "b", False, blocks, "do_remote_decode,remote_block_ids"),
    ]


def test_finished_without_blocks():
    """vLLM #50297's shape: a prefill preempted in its last step (async scheduling) finishes
    with an empty block list, and the connector hands its KV off anyway."""
    assert named(_handoff(())) == [("finished_without_blocks", "b", 2)]
    # Its neighbours: with its blocks; aborted; never computed; no hand-off (a best-effort
    # cache, which vLLM lets finish so by design).
    assert named(_handoff((1, 2, 3))) == []
    assert named(_handoff((), reason="finished_aborted")) == []
    assert named(_handoff((), computed=False)) == []
    plain = _handoff(())
    plain[-1] = ev.InnerFinishedAnswered(2, "b", False, (), "")
    assert named(plain) == []


def test_connector_raised():
    raised = ev.InnerRaised(3, "r", "update_state_after_alloc", "AssertionError: Mismatch, 1")
    assert named([*admission("r"), raised]) == [("connector_raised", "r", 3)]
    (v,) = check_recorded([raised], BS)
    assert v.detail == {
        "callback": "update_state_after_alloc",
        "error": "AssertionError: Mismatch; 1",
    }


@st.composite
def lives(draw):
    """Well-behaved histories of what the new rules judge: request ids that come back (a new
    request once vLLM freed the earlier one: after its finished_sending when request_finished
    kept the blocks), asynchronous loads reported once in finished_recving (before the request
    computes, or after it was aborted while loading), preemptions (a preempted request aborted
    while it waits finishes with no blocks; a best-effort cache's request preempted in its last
    step finishes with none and hands nothing off), hand-offs of requests that finish with
    their blocks; another request's steps interleaved."""
    events: list[ev.Event] = []
    step = 0
    next_block = 1
    for _ in range(draw(st.integers(1, 6))):
        rid = draw(st.sampled_from(["x", "y"]))
        length = draw(st.integers(17, 80))
        blocks = tuple(range(next_block, next_block + -(-length // BS)))
        next_block += len(blocks)
        offered = draw(st.integers(0, (length - 1) // BS)) * BS
        load_async = offered > 0 and draw(st.booleans())
        events += [
            ev.RequestAdded(step, rid, tuple(range(length))),
            ev.LookupAsked(step, rid, 0, length, 0, ()),
            ev.InnerLookupAnswered(step, rid, offered, load_async),
            ev.Allocated(step, rid, blocks, offered),
        ]
        if load_async and draw(st.booleans()):  # aborted while its load runs
            events += [
                ev.Finished(step + 1, rid, "finished_aborted"),
                ev.InnerFinishedAnswered(step + 1, rid, False, ()),
                ev.InnerRecvDone(step + 2, rid, draw(st.booleans())),
            ]
            step += 3
            continue
        if load_async:
            events += [ev.InnerRecvDone(step + 1, rid), ev.Allocated(step + 1, rid, blocks, 0)]
            step += 1
        events.append(ev.Scheduled(step, rid, offered, length - offered, 0, (), blocks, 1))
        if draw(st.booleans()):  # another request computes meanwhile
            events.append(ev.Scheduled(step, "other", 0, 1, 0, (), (), 0))
        step += 1
        end = draw(st.sampled_from(["finish", "abort_preempted", "best_effort_preempted"]))
        if end != "finish":
            events.append(ev.Preempted(step, rid))
            reason = "finished_aborted" if end == "abort_preempted" else "finished_length_capped"
            events += [
                ev.Finished(step, rid, reason),
                ev.InnerFinishedAnswered(step, rid, False, ()),
            ]
            step += 1
            continue
        delay = draw(st.booleans())
        params = draw(st.sampled_from(["", "do_remote_decode,remote_block_ids"]))
        events += [
            ev.Finished(step, rid, "finished_stopped"),
            ev.InnerFinishedAnswered(step, rid, delay, blocks, params),
        ]
        if delay:
            events.append(ev.InnerSendDone(step + 1, rid))
        step += 2
    return events


@settings(max_examples=300, deadline=None)
@given(lives())
def test_well_behaved_lives_are_clean(events):
    assert named(events) == []


@settings(max_examples=200, deadline=None)
@given(lives(), st.data())
def test_a_repeated_completion_is_named_where_it_comes(events, data):
    """A completion reported again right after it came (a stale job, a rank reporting twice):
    named at that step, for that request, and nothing else is."""
    done = [i for i, e in enumerate(events) if isinstance(e, (ev.InnerSendDone, ev.InnerRecvDone))]
    if not done:
        return
    i = data.draw(st.sampled_from(done))
    again = events[i]
    planted = [*events[: i + 1], again, *events[i + 1 :]]
    assert named(planted) == [("stale_completion", again.req_id, again.step)]


@settings(max_examples=200, deadline=None)
@given(lives(), st.data())
def test_a_hand_off_without_blocks_is_named(events, data):
    handoffs = [
        i
        for i, e in enumerate(events)
        if isinstance(e, ev.InnerFinishedAnswered) and e.params and e.block_ids
    ]
    if not handoffs:
        return
    i = data.draw(st.sampled_from(handoffs))
    e = events[i]
    planted = [*events[:i], ev.InnerFinishedAnswered(e.step, e.req_id, e.delay, (), e.params)]
    planted += events[i + 1 :]
    assert named(planted) == [("finished_without_blocks", e.req_id, e.step)]


# --- stored_not_offered: the connector's own KV events against its answers -----------------


def _stored(step, keys, tokens, size=16, parent=b""):
    return ev.InnerStored(step, "", tuple(keys), parent, tuple(tokens), size, "cpu")


GATE = ev.InnerRemoved(0, "", (b"some-other-key",), "cpu")  # the connector publishes removals


def test_stored_not_offered():
    """It stored the prompt's first 48 tokens as three keys of 16, and still holds them: an
    answer of 16 leaves out 16 more it could have offered (the last key ends at the prompt's
    last token, which vLLM computes: 32 is what it owed)."""
    store = _stored(0, [b"k0", b"k1", b"k2"], PROMPT)
    found = check_recorded([store, GATE, *admission(offered=16, accepted=16)], BS)
    assert [(v.rule, v.req_id, v.step) for v in found] == [("stored_not_offered", "r", 0)]
    assert found[0].detail == {
        "num_tokens": 48,
        "local_hit": 0,
        "external": 16,
        "held": 32,
        "stored_at": 0,
    }
    # Its nearest clean neighbours: what it held, offered (with vLLM's own hit counted); a
    # key it dropped; a connector that never published a removal (it may drop silently).
    assert rules([store, GATE, *admission(offered=32, accepted=32)]) == []
    assert rules([store, GATE, *admission(local=16, offered=16, accepted=16)]) == []
    dropped = ev.InnerRemoved(0, "", (b"k1",), "cpu")
    assert rules([store, dropped, *admission(offered=16, accepted=16)]) == []
    assert rules([store, *admission(offered=16, accepted=16)]) == []
    # Everything dropped at once (AllBlocksCleared).
    cleared = ev.InnerRemoved(0, "", (), "cpu")
    assert rules([store, cleared, *admission(offered=0, accepted=0)]) == []


def test_a_prompts_tail_is_not_a_whole_key():
    """A key no other key continues is a prompt's tail (LMCache stores one per prompt): a
    longer prompt's lookup keys that range differently, so it is not owed."""
    keys = [_stored(0, [b"k0"], PROMPT[:16]), _stored(0, [b"t"], PROMPT[16:40], 24, b"k0")]
    assert rules([*keys, GATE, *admission(offered=16, accepted=16)]) == []
    # k0 is whole (the tail continues it): held and not offered.
    assert rules([*keys, GATE, *admission(offered=0, accepted=0)]) == ["stored_not_offered"]
    chained = [_stored(0, [b"k0", b"k1"], PROMPT[:32]), _stored(0, [b"t"], PROMPT[32:40], 8, b"k1")]
    assert rules([*chained, GATE, *admission(offered=0, accepted=0)]) == ["stored_not_offered"]


_CHUNK = 16
_BASE = tuple(range(200, 264))
# Prompts sharing prefixes, whole chunks or not; one diverging after the first chunk.
_PROMPTS = (_BASE[:20], _BASE[:32], _BASE[:40], _BASE[:48], _BASE, _BASE[:16] + (7,) * 30)


def _key(prefix):
    return hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()


@st.composite
def stores(draw):
    """A connector that stores prompts chunk by chunk (a prompt's partial tail as a key of
    its own, which only that very prompt finds), drops chunks, and publishes both; it offers
    the longest run of held chunks from the start, its tail only for the same prompt, never
    the last token. (events, the lookups' (index, step, offered))."""
    held: dict[tuple[int, ...], bool] = {}  # prefix -> held
    events: list = [GATE]
    lookups = []
    for step in range(draw(st.integers(1, 12))):
        op = draw(st.sampled_from(["store", "store", "drop", "look", "look"]))
        p = draw(st.sampled_from(_PROMPTS))
        if op == "store":
            parent = b""
            for a in range(0, len(p), _CHUNK):
                b = min(a + _CHUNK, len(p))
                prefix = p[:b]
                if not held.get(prefix):
                    held[prefix] = True
                    events.append(_stored(step, [_key(prefix)], p[a:b], b - a, parent))
                parent = _key(prefix)
        elif op == "drop" and any(held.values()):
            prefix = draw(st.sampled_from(sorted(k for k, v in held.items() if v)))
            held[prefix] = False
            events.append(ev.InnerRemoved(step, "", (_key(prefix),), "cpu"))
        elif op == "look":
            end = 0
            while end < len(p):
                b = min(end + _CHUNK, len(p))
                if not held.get(p[:b]):
                    break
                end = b
            offered = min(end, len(p) - 1)
            rid = f"r{len(lookups)}"
            events += [
                ev.RequestAdded(step, rid, p),
                ev.LookupAsked(step, rid, 0, len(p), len(p), ()),
                ev.InnerLookupAnswered(step, rid, offered, False),
            ]
            lookups.append((len(events) - 1, step, offered))
    return events, lookups


@settings(max_examples=300, deadline=None)
@given(stores())
def test_a_connector_that_offers_what_it_holds_is_clean(history):
    events, _ = history
    assert rules(events) == []


@settings(max_examples=200, deadline=None)
@given(stores(), st.data())
def test_an_answer_a_chunk_short_is_named(history, data):
    events, lookups = history
    owed = [(i, step, offered) for i, step, offered in lookups if offered >= _CHUNK]
    if not owed:
        return
    i, step, offered = data.draw(st.sampled_from(owed))
    e = events[i]
    events = [*events[:i], ev.InnerLookupAnswered(step, e.req_id, offered - _CHUNK, False)]
    found = check_recorded(events, BS)
    assert [(v.rule, v.req_id, v.step) for v in found] == [("stored_not_offered", e.req_id, step)]
