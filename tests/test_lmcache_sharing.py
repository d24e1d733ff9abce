"""The LMCache tests' one child per release (tests/_lmcache.py): which runs it makes for the
modules that need them, and which report each module reads."""

from __future__ import annotations

import dataclasses

import pytest

from tests._lmcache import _keyed, _Need


def _labels(keyed: tuple[dict, dict], module: str) -> dict[str, tuple]:
    """module's labels, each with the run (spec, way) it reads."""
    runs, labels = keyed
    return {
        label: (runs[key]["spec"], runs[key]["way"])
        for (of, label), key in labels.items()
        if of == module
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
    assert len(keyed[0]) == 4
    assert _labels(keyed, "a") == {
        "issue1969": (same, None),
        "issue1969+recorded": (same, True),
    }
    assert _labels(keyed, "b") == {
        "issue1969+recorded": (same, True),
        "issue1969+recorded@False": (same, False),
    }
    assert _labels(keyed, "c") == {"issue1969+recorded": (other, True)}
    runs, labels = keyed
    shared = {key for (of, _), key in labels.items() if of == "a"} & {
        key for (of, _), key in labels.items() if of == "b"
    }
    assert len(shared) == 1 and runs[shared.pop()]["way"] is True


def test_one_module_naming_two_specs_alike_is_refused() -> None:
    from kvledger.connector.testing.lmcache import WORKLOADS

    same = WORKLOADS["issue1969"]
    other = dataclasses.replace(same, max_tokens=same.max_tokens + 1)
    with pytest.raises(ValueError, match="two different runs named 'issue1969\\+recorded'"):
        _keyed([_Need("a", lambda: [same, other], bare=False, ways=(True,))])
