"""The LMCache tests' one child per release (tests/_lmcache.py): which runs it makes for the
modules that need them, and which report each module reads."""

from __future__ import annotations

import dataclasses

import pytest

from tests._lmcache import _keyed, _Need


def _labels(keyed: dict, module: str) -> dict[str, tuple]:
    """module's labels, each with the run (spec, way) it reads."""
    return {
        label: (run["spec"], run["way"])
        for run in keyed.values()
        for label in run["module_labels"].get(module, ())
    }


def test_a_run_two_modules_need_is_made_once_and_a_same_named_other_spec_is_not() -> None:
    from kvledger.connector.testing.lmcache import WORKLOADS

    same = WORKLOADS["issue1969"]
    other = dataclasses.replace(same, num_gpu_blocks=same.num_gpu_blocks + 8)
    keyed = _keyed(
        [
            _Need("a", lambda: ["issue1969"], bare=True, ways=(True,)),
            _Need("b", lambda: [same], bare=False, ways=(True, False)),
            _Need("c", lambda: [other], bare=False, ways=(True,)),
        ]
    )
    # a's bare run; a's and b's recorded run, once; b's unbatched one; c's own spec.
    assert len(keyed) == 4
    assert _labels(keyed, "a") == {
        "issue1969": (same, None),
        "issue1969+recorded": (same, True),
    }
    assert _labels(keyed, "b") == {
        "issue1969+recorded": (same, True),
        "issue1969+recorded@False": (same, False),
    }
    assert _labels(keyed, "c") == {"issue1969+recorded": (other, True)}
    shared = [run for run in keyed.values() if set(run["module_labels"]) == {"a", "b"}]
    assert len(shared) == 1 and shared[0]["way"] is True


def test_one_module_naming_two_specs_alike_is_refused() -> None:
    from kvledger.connector.testing.lmcache import WORKLOADS

    same = WORKLOADS["issue1969"]
    other = dataclasses.replace(same, max_tokens=same.max_tokens + 1)
    with pytest.raises(ValueError, match="two different runs named 'issue1969\\+recorded'"):
        _keyed([_Need("a", lambda: [same, other], bare=False, ways=(True,))])
