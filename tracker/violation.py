"""A broken rule as a value (``Violation``), and the error strict mode raises with one.

Their own module, apart from the fold (``state``) and the checks (``invariants``) that make
them: every layer of the core names a violation, and these two classes are what mypyc, a
compiler of typed Python, refuses in a compiled module (an attrs class with a field default,
a subclass of a built-in exception). Here, the modules that fold and plan compile whole
(``bench/compiled_check.py``)."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["InvariantViolation", "Violation"]


@attrs.frozen(slots=True)
class Violation:
    """A broken rule: which, where, and the numbers involved."""

    rule: str
    step: int
    req_id: str
    event: str
    detail: dict[str, Any] = attrs.field(factory=dict, eq=False)

    def describe(self) -> str:
        nums = ", ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"step {self.step} {self.req_id}: {self.rule} at {self.event} ({nums})"


class InvariantViolation(AssertionError):
    """Raised in strict mode (tests); carries the Violation."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation
