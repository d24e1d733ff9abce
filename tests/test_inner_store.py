"""tracker/inner_store.py: a wrapped connector's KV events, folded into the keys it holds."""

from __future__ import annotations

from kvledger.tracker import events as ev
from kvledger.tracker.inner_store import InnerStore, Piece

T = tuple(range(100, 164))  # 64 tokens


def store(*events: ev.Event) -> InnerStore:
    s = InnerStore()
    for e in events:
        s.apply(e)
    return s


def stored(step, keys, tokens, size=16, parent=b""):
    return ev.InnerStored(step, "", tuple(keys), parent, tuple(tokens), size, "cpu")


def test_keys_are_placed_by_their_parents_and_cover_matching_tokens():
    s = store(stored(1, [b"a", b"b"], T[:32]), stored(2, [b"c"], T[32:48], parent=b"b"))
    assert s.cover(T) == [Piece(0, 16, 1, None), Piece(16, 32, 1, None), Piece(32, 48, 2, None)]
    # Other tokens under the same parent are another prefix: the cover stops there.
    assert s.cover(T[:16] + (7,) * 48) == [Piece(0, 16, 1, None)]
    assert s.cover(T[:40]) == [Piece(0, 16, 1, None), Piece(16, 32, 1, None)]  # c ends past 40
    assert s.whole_sizes == {16}


def test_removals_and_a_clear():
    s = store(stored(1, [b"a", b"b"], T[:32]), ev.InnerRemoved(3, "", (b"b",), "cpu"))
    assert s.cover(T) == [Piece(0, 16, 1, None), Piece(16, 32, 1, 3)]
    assert s.held_whole(T, 63) == Piece(0, 16, 1, None)
    s.apply(ev.InnerRemoved(4, "", (), "cpu"))  # AllBlocksCleared
    assert [p.removed for p in s.cover(T)] == [4, 3]
    assert s.held_whole(T, 63) is None and s.removals == 2
    # Stored again after the drop: held again.
    s.apply(stored(5, [b"a"], T[:16]))
    assert s.cover(T)[0] == Piece(0, 16, 5, None)


def test_a_prompts_tail_is_not_whole_and_a_longer_key_wins():
    s = store(stored(1, [b"a", b"b"], T[:32]), stored(2, [b"t"], T[16:20], 4, b"a"))
    # Under a, both b (16 tokens) and the tail t (4) match: the cover takes the longer.
    assert s.cover(T) == [Piece(0, 16, 1, None), Piece(16, 32, 1, None)]
    assert s.cover(T[:24]) == [Piece(0, 16, 1, None), Piece(16, 20, 2, None)]
    assert s.held_whole(T[:24], 23) == Piece(0, 16, 1, None)  # t is no whole key


def test_a_key_under_a_parent_never_stored_is_unplaced():
    """LMCache names the parent of a store call's first chunk 0 when the call starts past the
    prompt's start: such a key cannot be placed, and is counted."""
    s = store(stored(1, [b"#0"], T[:16]), stored(2, [b"x"], T[16:32], parent=b"#12345"))
    assert s.unplaced == 1 and s.cover(T) == [Piece(0, 16, 1, None)]


def test_what_cannot_be_matched_is_kept_out():
    no_tokens = ev.InnerStored(1, "", (b"a",), b"", (), 16, "cpu")
    malformed = ev.InnerStored(1, "", (b"a",), b"", T[:15], 16, "cpu")  # field_lengths
    s = store(no_tokens, malformed)
    assert (s.stores, s.with_tokens, s.cover(T)) == (1, 0, [])


def test_memory_is_bounded_by_tokens(monkeypatch):
    import kvledger.tracker.inner_store as inner_store

    monkeypatch.setattr(inner_store, "MAX_TOKENS", 40)
    s = store(stored(1, [b"a", b"b"], T[:32]), stored(2, [b"c"], T[32:48], parent=b"b"))
    assert (s.tokens, s.forgotten) == (32, 1)  # a, the oldest, is forgotten
    assert s.cover(T) == []  # and with it the way from the root to b and c
