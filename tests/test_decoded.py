"""``tracker.decoded.entries``: the one reading of a ``StepDecoded``'s entries (issue 26), by
every reader that goes request by request (the replay's slow path, a recorder's rules, the
history walk, the what-if replays). Its contract, over any record and any numbering."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvledger.tracker import decoded
from kvledger.tracker import events as ev

_NUMS = st.lists(st.integers(0, 12), max_size=10)


@st.composite
def records(draw: Any) -> tuple[ev.StepDecoded, dict[int, str]]:
    nums = draw(st.one_of(_NUMS.map(lambda xs: list(dict.fromkeys(xs))), _NUMS))
    paired = draw(st.lists(st.sampled_from(nums or [0]), unique=True, max_size=len(nums)))
    blocks = [x for n in paired for x in (n, 100 + n)]
    if draw(st.booleans()):
        blocks += draw(st.lists(st.integers(0, 20), max_size=3))  # odd, twice, or not in nums
    width = draw(st.sampled_from([0, len(nums), len(nums) + 1]))
    tokens = [500 + i for i in range(width)]
    held = draw(st.sets(st.integers(0, 12)))
    req_of = {n: f"r{n}" for n in held}
    return ev.StepDecoded(3, "", tuple(nums), tuple(blocks), tuple(tokens)), req_of


@given(records(), st.booleans())
def test_each_entry_is_read_once_in_order(record: Any, tokens: bool) -> None:
    e, req_of = record
    found, bad = decoded.entries(e, req_of, tokens=tokens)
    rules = [v.rule for v in bad]
    assert all(v.step == e.step and v.event == "StepDecoded" for v in bad)
    if len(set(e.nums)) != len(e.nums) or len(e.tokens) not in (
        (len(e.nums),) if tokens else (0, len(e.nums))
    ):
        # No entry can be told from another: the record is named once, nothing is read.
        assert (found, rules) == ([], ["decoded_blocks"])
        return
    grown = e.new_blocks()
    if grown is None:
        assert rules[0] == "decoded_blocks"
        rules, grown = rules[1:], {}
    assert [e.num for e in found] == [n for n in e.nums if n in req_of]
    assert rules == ["decoded_unknown"] * sum(n not in req_of for n in e.nums)
    assert [v.req_id for v in bad if v.rule == "decoded_unknown"] == [
        str(n) for n in e.nums if n not in req_of
    ]
    for entry in found:
        assert entry.req_id == req_of[entry.num]
        assert entry.block == grown.get(entry.num)
        i = e.nums.index(entry.num)
        assert entry.token == (e.tokens[i] if e.tokens else None)


@given(records())
def test_the_readers_judgement_keeps_the_records_order(record: Any) -> None:
    """A reader's own test of each entry (``judge``) is asked in order, and what it names
    falls between the unknown numbers where its entry stood."""
    e, req_of = record
    asked: list[int] = []

    def judge(entry: decoded.Entry) -> Any:
        asked.append(entry.num)
        return decoded.not_steady(e, entry.req_id) if entry.num % 2 else None

    found, bad = decoded.entries(e, req_of, judge=judge)
    plain = decoded.entries(e, req_of)[0]
    assert asked == [x.num for x in plain]
    assert found == [x for x in plain if x.num % 2 == 0]
    named = [v.req_id for v in bad if v.rule != "decoded_blocks"]
    expected = [
        str(n) if n not in req_of else req_of[n] for n in e.nums if n not in req_of or n % 2
    ]
    readable = len(set(e.nums)) == len(e.nums) and len(e.tokens) in (0, len(e.nums))
    assert named == (expected if readable else [])
