"""``--steps``: one parser (``replay.steps``) for every command that takes a range of steps.
Each form (``A:B``, ``A:``, ``:B``, ``N``) selects the same steps through ``show`` and through
``timeline``, and each bad input is refused by both with the same message, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import replay
from kvledger.replay.cli import main
from kvledger.replay.steps import parse_steps, range_text

SHORT = Path(__file__).resolve().parent / "data" / "replay-short-load.kvlog"
LAST = 301  # the log's last step (its first is 0)
REQUEST = "req-2"  # alive from step 0 to 86, preempted at 15, resumed at 31


def _show(capsys: Any, text: str) -> tuple[int, Any, str]:
    code = main(["show", str(SHORT), "-r", REQUEST, "--steps", text, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else None, err


def _timeline(capsys: Any, tmp_path: Path, text: str) -> tuple[int, Any, str]:
    out_file = tmp_path / "t.html"
    code = main(["timeline", str(SHORT), "-o", str(out_file), "-r", REQUEST, "--steps", text])
    out, err = capsys.readouterr()
    if code == 0:
        assert out.startswith(f"wrote {out_file}")
    code_json = main(
        ["timeline", str(SHORT), "-o", str(out_file), "-r", REQUEST, "--steps", text, "--json"]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code_json == code
    return code, doc, err


@pytest.mark.parametrize(
    ("text", "first", "last"),
    [("10:40", 10, 40), ("31:", 31, None), (":20", None, 20), ("31", 31, 31), (":", None, None)],
)
def test_each_form_selects_the_same_steps_in_every_command(
    capsys: Any, tmp_path: Path, text: str, first: int | None, last: int | None
) -> None:
    assert parse_steps(text) == (first, last)
    lo, hi = 0 if first is None else first, LAST if last is None else last
    every = list(replay.show(SHORT, REQUEST))
    code, doc, _ = _show(capsys, text)
    assert code == 0
    assert [r["index"] for r in doc["rows"]] == [r.index for r in every if lo <= r.step <= hi]
    code, doc, _ = _timeline(capsys, tmp_path, text)
    assert code == 0 and doc["steps"] == [lo, hi]
    assert all(lo <= a["step"] <= hi for r in doc["requests"] for a in r["admissions"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x:y", "--steps 'x:y': expected A:B, A:, :B or N (step numbers)"),
        ("", "--steps '': expected A:B, A:, :B or N (step numbers)"),
        ("3:4:5", "--steps '3:4:5': expected A:B, A:, :B or N (step numbers)"),
        ("1.5", "--steps '1.5': expected A:B, A:, :B or N (step numbers)"),
        ("40:25", "--steps '40:25': the first step 40 is after the last 25"),
    ],
)
def test_bad_input_is_refused_alike_by_every_command(
    capsys: Any, tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_steps(text)
    for code, doc, err in (_show(capsys, text), _timeline(capsys, tmp_path, text)):
        assert code == 2 and err == f"kvledger: {message}\n"
        assert doc is None or doc == {"error": message, "exit_code": 2}
    assert not (tmp_path / "t.html").exists()


@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6))
def test_a_written_range_reads_back(first: int, last: int) -> None:
    for steps in ((first, last), (first, None), (None, last)):
        if steps[0] is not None and steps[1] is not None and steps[0] > steps[1]:
            with pytest.raises(ValueError, match="is after the last"):
                parse_steps(range_text(steps))
        else:
            assert parse_steps(range_text(steps)) == steps
    assert parse_steps(str(first)) == (first, first)
