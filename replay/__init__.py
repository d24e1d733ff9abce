"""Offline replay of kvledger logs: ``open``, ``check``, ``diff``.

    import replay

    result = replay.check("kvledger-1234.kvlog")          # re-fold, re-derive, compare
    result.exit_code, result.problems[0].describe()
    replay.check("run.kvlog", chunk_size=512)              # what-if: the plans under another config
    for event, frame in replay.open("logs/"):              # a file, a list of segments, a directory
        ...
    replay.diff("a.kvlog", "b.kvlog")                      # first divergence between two runs

Importing this package is cheap: nothing is loaded until a name is used (no torch, no vLLM;
``check`` needs only ``tracker``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["check", "diff", "open"]

_LAZY = {
    "open": ("replay.source", "open_log"),
    "check": ("replay.replayer", "check"),
    "diff": ("replay.diff", "diff"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    module_name, attr = target
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise AttributeError(f"replay.{name} is not available: {module_name} is missing") from None
    return getattr(module, attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``replay.diff`` is both a submodule and the function it defines. Importing the
    submodule sets the package attribute ``diff`` to the module; this class keeps
    ``replay.diff`` the function (the submodule stays in ``sys.modules['replay.diff']``)."""

    @property
    def diff(self) -> Any:
        return __getattr__("diff")

    @diff.setter
    def diff(self, value: Any) -> None:
        pass  # the import system binding the submodule: sys.modules has it


sys.modules[__name__].__class__ = _Package
