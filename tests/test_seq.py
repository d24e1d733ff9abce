"""tracker.seq.Seq: an immutable view of a shared append-only buffer.

The rule under test: a view never changes once made, whoever appends to the buffer it shares,
and the owner of the buffer's end appends in place (O(1)) while every other view forks.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.tracker.seq import Seq


def test_behaves_like_a_read_only_sequence() -> None:
    s = Seq([10, 11, 12, 13])
    assert len(s) == 4
    assert s[0] == 10 and s[3] == 13
    assert s[-1] == 13 and s[-4] == 10
    assert s[1:3] == [11, 12]
    assert s[::-1] == [13, 12, 11, 10]
    assert list(s) == [10, 11, 12, 13]
    assert list(s) == [10, 11, 12, 13]
    assert 12 in s and 99 not in s
    assert s.index(12) == 2
    with pytest.raises(IndexError):
        s[4]
    with pytest.raises(IndexError):
        s[-5]


def test_index_beyond_the_view_is_out_of_range_even_if_the_buffer_is_longer() -> None:
    a = Seq([1, 2])
    a.extended([3, 4])  # the buffer now holds 4 items; ``a`` still sees 2
    assert len(a) == 2
    with pytest.raises(IndexError):
        a[2]
    assert a[-1] == 2
    assert a[0:10] == [1, 2]
    assert list(a) == [1, 2]


def test_equality_with_seqs_lists_and_tuples() -> None:
    a = Seq([1, 2, 3])
    assert a == Seq([1, 2, 3])
    assert a == [1, 2, 3]
    assert a == (1, 2, 3)
    assert a != [1, 2]
    assert a != Seq([1, 2, 4])
    assert a != Seq([1, 2])
    assert (a == 1) is False


def test_unhashable_like_a_list() -> None:
    with pytest.raises(TypeError):
        hash(Seq([1]))


def test_repr_shows_items_or_a_summary() -> None:
    assert repr(Seq([1, 2])) == "Seq([1, 2])"
    long_repr = repr(Seq(range(20)))
    assert "20 items" in long_repr and long_repr.startswith("Seq([0, 1, 2, 3")
    # a view's repr never shows items past its end
    a = Seq([1, 2])
    a.extended([3])
    assert repr(a) == "Seq([1, 2])"


def test_constructor_copies_its_input() -> None:
    items = [1, 2, 3]
    s = Seq(items)
    items.append(4)
    items[0] = 99
    assert s == [1, 2, 3]


def test_extended_leaves_the_old_view_unchanged_and_appends_in_place() -> None:
    a = Seq([1, 2])
    b = a.extended([3])
    assert a == [1, 2] and len(a) == 2
    assert b == [1, 2, 3]
    # the owner of the buffer's end appends without copying (the O(1) decode path)
    assert b._buf is a._buf
    c = b.extended([4, 5])
    assert c._buf is a._buf
    assert (list(a), list(b), list(c)) == ([1, 2], [1, 2, 3], [1, 2, 3, 4, 5])


def test_two_appends_from_one_view_fork() -> None:
    """Two states made from the same parent (e.g. a replay and a live fold) never see each
    other's tokens."""
    a = Seq([1, 2])
    b = a.extended([3])
    c = a.extended([4])  # ``a`` no longer owns the end: copy first
    assert a == [1, 2]
    assert b == [1, 2, 3]
    assert c == [1, 2, 4]
    assert c._buf is not b._buf
    d = b.extended([5])
    e = c.extended([6])
    assert (b, c, d, e) == ([1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [1, 2, 4, 6])


def test_extended_with_nothing_is_the_same_view() -> None:
    a = Seq([1])
    assert a.extended([]) is a
    assert a.extended(()) is a


def test_extending_a_view_with_itself() -> None:
    a = Seq([1, 2])
    b = a.extended(a)
    assert b == [1, 2, 1, 2]
    assert a == [1, 2]


def test_copies_are_independent_values() -> None:
    """A copied view is the same value: appending to the copy and to the original must not
    write into each other's tokens."""
    a = Seq([1, 2])
    for dup in (copy.copy(a), copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        x = a.extended([3])
        y = dup.extended([4])
        assert a == [1, 2] and dup == [1, 2]
        assert x == [1, 2, 3]
        assert y == [1, 2, 4]


# --- property: every version ever made keeps its content -----------------------------------

# Extending an older version forks the shared buffer: every version must keep its content.
_ops = st.lists(
    st.tuples(st.just("extend"), st.integers(0, 50), st.lists(st.integers(0, 9), max_size=4)),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(start=st.lists(st.integers(0, 9), max_size=5), ops=_ops)
def test_every_version_keeps_its_content(start: list[int], ops: list[tuple[str, int, Any]]) -> None:
    versions: list[Seq[int]] = [Seq(start)]
    model: list[list[int]] = [list(start)]
    for op, which, arg in ops:
        i = which % len(versions)
        assert op == "extend"
        versions.append(versions[i].extended(arg))
        model.append(model[i] + list(arg))
        for v, m in zip(versions, model, strict=True):
            assert v == m
            assert len(v) == len(m)
            assert list(v) == m
            if m:
                assert v[-1] == m[-1]


_bound = st.none() | st.integers(-12, 12)


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(st.integers(0, 9), max_size=8),
    more=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    start=_bound,
    stop=_bound,
    step=st.none() | st.integers(-3, 3).filter(bool),
)
def test_a_slice_of_an_older_view_sees_only_the_view(
    items: list[int], more: list[int], start: int | None, stop: int | None, step: int | None
) -> None:
    # The view is shorter than its buffer: a slice is bounded by the view, for any bounds and
    # any step, exactly as the same slice of a list of its items.
    view = Seq(items)
    view.extended(more)  # the buffer grows past the view
    assert view[start:stop:step] == items[start:stop:step]
