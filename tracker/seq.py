"""Persistent append-only sequences: O(1) amortised append for values that never mutate.

A request's token ids and block table grow by one element per decode step. Copying a tuple of
2,000 ids per step would cost microseconds, so a ``Seq`` is a view ``(buffer, length)``: the
view that owns the end of the buffer appends in place, every other view copies first. Old
views therefore keep seeing exactly what they saw, which is what a frozen state needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar, overload

__all__ = ["Seq"]

T = TypeVar("T")


class Seq(Sequence[T], Generic[T]):
    """An immutable view of the first ``n`` items of a shared buffer."""

    __slots__ = ("_buf", "_n")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._buf: list[T] = list(items)
        self._n = len(self._buf)

    @classmethod
    def _view(cls, buf: list[T], n: int) -> Seq[T]:
        new: Seq[T] = cls.__new__(cls)
        new._buf = buf
        new._n = n
        return new

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            # Bounded by this view's length first, so only the slice is copied (a request's
            # tokens are sliced a chunk at a time: copying the whole view each time was
            # the cost).
            start, stop, step = index.indices(self._n)
            if step > 0:
                return self._buf[start:stop:step]
            return self._buf[: self._n][index]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("Seq index out of range")
        return self._buf[index]

    def __iter__(self) -> Iterator[T]:
        buf = self._buf
        return (buf[i] for i in range(self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Seq):
            return self._n == other._n and (
                (self._buf is other._buf) or self._buf[: self._n] == other._buf[: other._n]
            )
        if isinstance(other, (list, tuple)):
            return self._n == len(other) and self._buf[: self._n] == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self._n > 8:
            head = ", ".join(map(repr, self._buf[:4]))
            return f"Seq([{head}, ... {self._n} items])"
        return f"Seq({self._buf[: self._n]!r})"

    def extended(self, items: Sequence[T]) -> Seq[T]:
        """A view with ``items`` appended; this view is unchanged."""
        if not items:
            return self
        if self._n == len(self._buf):
            buf = self._buf
        else:  # another view owns the tail: fork
            buf = self._buf[: self._n]
        buf.extend(items)
        return Seq._view(buf, len(buf))
