"""StepDecoded's request numbers and block pairs: the log-format rules every reader shares."""

from __future__ import annotations

from kvledger.tracker import events as ev
from kvledger.tracker.numbering import RequestNumbers


def test_lowest_free_number_taken_at_added_given_back_at_finished() -> None:
    n = RequestNumbers()
    assert [n.take(r) for r in "abc"] == [0, 1, 2]
    assert n.take("b") == 1  # taking again keeps the number
    n.give_back("b")
    n.give_back("a")
    n.give_back("zz")  # never numbered: nothing to give back
    assert n.req_of == {2: "c"} and n.num_of == {"c": 2}
    assert n.take("d") == 0 and n.take("e") == 1 and n.take("f") == 3


def test_block_pairs_parse_or_are_refused_whole() -> None:
    def pairs(nums: tuple[int, ...], blocks: tuple[int, ...]) -> dict[int, int] | None:
        return ev.StepDecoded(0, "", nums, blocks).new_blocks()

    assert pairs((1, 2), ()) == {}
    assert pairs((1, 2), (2, 40)) == {2: 40}
    assert pairs((1, 2), (2, 40, 1)) is None  # odd length
    assert pairs((1, 2), (2, 40, 2, 41)) is None  # a number twice
    assert pairs((1, 2), (7, 40)) is None  # a number not in nums
