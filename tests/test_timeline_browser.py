"""The timeline page in a real browser (headless Chromium): its script runs without errors and
builds the lanes, panels and marks the data asks for; zooming to a step range draws only what
is in it; and the screenshot shows the injected fault of the short-load log (the problem
colour, the short-load colour) where the clean log shows none.

``KVLEDGER_WRITE_DOCS=1`` also writes the short-load screenshot to docs/img/ (the picture in
docs/replay-commands.md).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from _browser import dump_dom, screenshot

from kvledger import replay
from kvledger.replay.charts import COLORS

pytestmark = pytest.mark.browser

DATA = Path(__file__).resolve().parent / "data"
SHORT = DATA / "replay-short-load.kvlog"
CLEAN = DATA / "replay-clean.kvlog"
DOC_IMAGE = Path(__file__).resolve().parent.parent / "docs" / "img" / "timeline-short-load.png"
SIZE = (1280, 1300)


def _page(log: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / f"{name}.html"
    replay.timeline(log, out)
    return out


def _rgb(color: str) -> tuple[int, int, int]:
    return (int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16))


def _pixels(image, color: str, tolerance: int = 12) -> int:
    """Pixels of ``image`` within ``tolerance`` of ``color`` in every channel."""
    import numpy as np

    a = np.asarray(image, dtype=np.int16)
    return int((np.abs(a - np.array(_rgb(color), dtype=np.int16)) <= tolerance).all(axis=2).sum())


def _count(dom: str, cls: str) -> int:
    return len(re.findall(rf'class="{cls}"', dom))


def test_the_page_script_runs_and_draws_what_the_data_holds(tmp_path: Path) -> None:
    dom = dump_dom(_page(SHORT, tmp_path, "short"), tmp_path)
    assert 'data-rendered="1"' in dom, "the script did not finish drawing"
    assert re.search(r'<pre id="errors">\s*</pre>', dom), "the script reported errors"
    lanes = re.findall(r'<g class="lane" data-request="([^"]+)"', dom)
    assert sorted(lanes) == sorted(
        ["req-8", "req-3", "req-7", "req-2", "req-4", "req-5", "req-6", "req-9"]
    )
    panels = re.findall(r'<g class="panel" data-panel="([^"]+)"', dom)
    assert panels == ["requests", "pool", "hit_rate"]
    # The six short loads, each marked where check found it (the decision's name on hover).
    assert len(re.findall(r'class="problem" d="[^"]+"[^>]*data-name="LoadPlanned"', dom)) == 6
    assert _count(dom, "short") == 6 and "loaded 16 of 32" in dom
    assert "step 31: LoadPlanned (decision)" in dom
    assert _count(dom, "phase preempted") >= 6 and _count(dom, "phase waiting") >= 6
    clean = dump_dom(_page(CLEAN, tmp_path, "clean"), tmp_path)
    assert 'data-rendered="1"' in clean and re.search(r'<pre id="errors">\s*</pre>', clean)
    assert _count(clean, "problem") == 0 and _count(clean, "short") == 0
    assert _count(clean, "loaded") > 0 and "kvledger check: no problems" in clean


def test_a_step_range_in_the_address_zooms_the_page(tmp_path: Path) -> None:
    page = _page(SHORT, tmp_path, "short")
    dom = dump_dom(page, tmp_path, fragment="steps=25:40")
    assert 'data-domain="24.50:40.50"' in dom and 'data-rendered="1"' in dom
    # Only req-2's problem (step 31) is in view; the other five are drawn when zoomed out.
    marks = re.findall(
        r'class="problem" d="[^"]+"[^>]*data-name="LoadPlanned">\s*<title>([^<]*)', dom
    )
    assert [m.split(":")[0] for m in marks] == ["step 31"]
    ticks = [int(t) for t in re.findall(r'<text class="tick"[^>]*>(\d+)</text>', dom)]
    assert ticks and min(ticks) >= 25 and max(ticks) <= 40


def test_the_screenshot_shows_the_short_loads_and_the_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(SHORT.parents[2])  # the page's title names the log as the docs do
    short_log = SHORT.relative_to(SHORT.parents[2])
    short = screenshot(_page(short_log, tmp_path, "short"), tmp_path / "short.png", tmp_path, SIZE)
    clean = screenshot(_page(CLEAN, tmp_path, "clean"), tmp_path / "clean.png", tmp_path, SIZE)
    for image in (short, clean):  # not blank: a drawn chart, lanes and panels
        assert image.size == SIZE
        assert len(image.getcolors(1 << 20) or ()) > 50
        white = _pixels(image, "#ffffff", tolerance=3)
        assert white < 0.95 * SIZE[0] * SIZE[1]
        assert _pixels(image, COLORS["running"]) > 2000  # the phase bands
        assert _pixels(image, COLORS["pool_stored"]) > 2000  # the pool panel
    # Six diamonds of the problem colour, in the short-load log only.
    assert _pixels(short, COLORS["problem"]) > 6 * 40
    assert _pixels(clean, COLORS["problem"]) == 0
    # The short part of each load is outlined in the short-load colour.
    assert _pixels(short, COLORS["short"]) > 6 * 10
    assert _pixels(clean, COLORS["short"]) == 0
    # Zoomed to steps 25..40: one problem left in view.
    zoomed = screenshot(
        tmp_path / "short.html", tmp_path / "zoomed.png", tmp_path, SIZE, fragment="steps=25:40"
    )
    assert 40 < _pixels(zoomed, COLORS["problem"]) < _pixels(short, COLORS["problem"])
    if os.environ.get("KVLEDGER_WRITE_DOCS"):
        DOC_IMAGE.parent.mkdir(exist_ok=True)
        shutil.copyfile(tmp_path / "short.png", DOC_IMAGE)


# Appended to a copy of the page: real wheel, drag and double-click events dispatched to the
# page's own handlers, the domain recorded after each.
_INTERACT = """<script>
(function () {
  const chart = document.getElementById("chart");
  const box = chart.getBoundingClientRect();
  const mid = box.left + 130 + (box.width - 154) / 2;
  const seen = [chart.dataset.domain];
  chart.dispatchEvent(new WheelEvent("wheel", { deltaY: -600, clientX: mid, clientY: box.top + 300,
    bubbles: true, cancelable: true }));
  seen.push(chart.dataset.domain);
  chart.dispatchEvent(new MouseEvent("mousedown", { clientX: mid, clientY: box.top + 300, bubbles: true }));
  window.dispatchEvent(new MouseEvent("mousemove", { clientX: mid + 200, clientY: box.top + 300 }));
  window.dispatchEvent(new MouseEvent("mouseup", {}));
  seen.push(chart.dataset.domain);
  chart.dispatchEvent(new MouseEvent("dblclick", { bubbles: true }));
  seen.push(chart.dataset.domain);
  document.body.dataset.domains = seen.join(" ");
})();
</script>
"""


def test_wheel_zooms_drag_pans_and_double_click_resets(tmp_path: Path) -> None:
    page = _page(SHORT, tmp_path, "short")
    driven = tmp_path / "driven.html"
    driven.write_text(page.read_text().replace("</body>", _INTERACT + "</body>"))
    dom = dump_dom(driven, tmp_path)
    found = re.search(r'data-domains="([^"]+)"', dom)
    assert found is not None and re.search(r'<pre id="errors">\s*</pre>', dom)
    spans = [tuple(float(v) for v in d.split(":")) for d in found.group(1).split()]
    full, zoomed, panned, reset = spans
    assert full == (-0.5, 301.5) and reset == full
    width = zoomed[1] - zoomed[0]
    assert width < 0.5 * (full[1] - full[0])  # zoomed in, about the middle of the steps
    assert zoomed[0] < 151 < zoomed[1]
    # dragged right by 200 pixels: the view moved to earlier steps, its width kept
    assert panned[0] < zoomed[0] and panned[1] - panned[0] == pytest.approx(width)
