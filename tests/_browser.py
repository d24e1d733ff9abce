"""A real headless Chromium for the timeline page's tests: it runs the page's script, then
either prints the DOM the script built (``--dump-dom``) or takes a screenshot (``--screenshot``),
read back as pixels with Pillow.

Where no Chromium is installed the tests are skipped, except in CI (``CI`` or
``KVLEDGER_REQUIRE_BROWSER`` set, as ``.ci/run`` does): there a missing browser is a failure,
never a silent skip. Debian's package is ``chromium`` (``apt-get install chromium``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

__all__ = ["dump_dom", "require_chromium", "screenshot"]

_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def require_chromium() -> str:
    """The Chromium binary, or skip (fail in CI)."""
    for name in _NAMES:
        binary = shutil.which(name)
        if binary is not None:
            return binary
    why = "no headless Chromium is installed (apt-get install chromium)"
    if os.environ.get("CI") or os.environ.get("KVLEDGER_REQUIRE_BROWSER"):
        pytest.fail(f"{why}; CI requires it (CI / KVLEDGER_REQUIRE_BROWSER is set)")
    pytest.skip(why)


def _run(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    argv = [
        require_chromium(),
        "--headless",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile}",  # one profile per call: no lock shared between tests
        *args,
        url,
    ]
    proc = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-2000:]
        raise AssertionError(f"chromium exited with {proc.returncode}: {tail}")
    return proc


def _url(page: Path, fragment: str) -> str:
    return page.resolve().as_uri() + (f"#{fragment}" if fragment else "")


def dump_dom(page: Path, tmp_path: Path, fragment: str = "") -> str:
    """The page's DOM after its scripts ran, as Chromium serializes it."""
    proc = _run(
        _url(page, fragment), tmp_path / "profile-dom", "--virtual-time-budget=5000", "--dump-dom"
    )
    return proc.stdout.decode()


def screenshot(
    page: Path, out: Path, tmp_path: Path, size: tuple[int, int] = (1280, 1400), fragment: str = ""
) -> Any:
    """A screenshot of the page at ``size``, as a Pillow RGB image (also saved to ``out``)."""
    from PIL import Image

    _run(
        _url(page, fragment),
        tmp_path / f"profile-{out.stem}",
        f"--screenshot={out}",
        f"--window-size={size[0]},{size[1]}",
        "--virtual-time-budget=5000",
    )
    assert out.exists(), f"chromium wrote no screenshot to {out}"
    return Image.open(out).convert("RGB")
