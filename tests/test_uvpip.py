"""``.ci/uvpip.py``: uv is handed pip's own configuration, or pip does the install itself.

pip's settings are read as pip reads them (a config file, then ``PIP_*`` variables over it),
through the real ``pip config list`` of this venv."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _uvpip() -> Any:
    spec = importlib.util.spec_from_file_location("uvpip", ROOT / ".ci" / "uvpip.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


uvpip = _uvpip()


@pytest.fixture
def pip_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pip config file of this test's own, no user or XDG config (the machine's may set
    indexes), and no PIP_* variables but the ones a test sets."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS"):
        monkeypatch.setenv(name, str(tmp_path / "elsewhere"))
    path = tmp_path / "pip.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(path))
    return path


def test_pips_indexes_links_and_constraints_are_handed_to_uv(
    pip_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pip_config.write_text(
        "[global]\n"
        "index-url = https://mirror.example/simple\n"
        "extra-index-url = file:///opt/a/simple file:///opt/b/simple\n"
        "find-links = /opt/file-wheels\n"
        "timeout = 60\n"
        "[install]\n"
        "constraint = /etc/caps.txt\n"
    )
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")  # the environment wins, as in pip
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/mine.pem")
    settings = uvpip.pip_settings(sys.executable)
    flags, env = uvpip.uv_flags(settings)
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(flags[2::2], flags[3::2], strict=True))
    assert sorted(pairs) == sorted(
        [
            ("--index-url", "https://mirror.example/simple"),
            ("--extra-index-url", "file:///opt/a/simple"),
            ("--extra-index-url", "file:///opt/b/simple"),
            ("--find-links", "/opt/wheels"),
            ("--constraint", "/etc/caps.txt"),
        ]
    )
    assert env == {"SSL_CERT_FILE": "/etc/ssl/mine.pem"}


def test_a_setting_uv_is_not_told_leaves_the_install_to_pip(pip_config: Path) -> None:
    pip_config.write_text("[global]\nonly-binary = :all:\n")
    why = uvpip.uv_flags(uvpip.pip_settings(sys.executable))
    assert why == "pip's setting 'only-binary' has no uv flag here"


def test_pip_byte_compiles_unless_told_not_to_and_so_does_uv() -> None:
    assert uvpip.uv_install_args(["-q", "torch"]) == ["--compile-bytecode", "-q", "torch"]
    assert uvpip.uv_install_args(["-q", "--no-compile", "torch"]) == ["-q", "torch"]


def test_without_uv_pip_installs_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A local wheel into a fresh venv, uv missing: pip installs it, and the reason is said."""
    wheel_dir = tmp_path / "wheels"
    project = tmp_path / "tiny"
    (project / "tiny_pkg").mkdir(parents=True)
    (project / "tiny_pkg" / "__init__.py").write_text("X = 1\n")
    (project / "pyproject.toml").write_text(
        '[project]\nname = "tiny-pkg"\nversion = "1.0"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheel_dir), str(project)],
        check=True,
    )  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    monkeypatch.setattr(uvpip, "UV", tmp_path / "no-uv-here")
    [wheel] = wheel_dir.glob("*.whl")
    assert uvpip.pip(py, "install", ["-q", "--no-deps", str(wheel)]) == 0
    assert "is not installed; pip does it instead" in capfd.readouterr().err
    done = subprocess.run([py, "-c", "import tiny_pkg; print(tiny_pkg.X)"], capture_output=True)
    assert done.stdout.strip() == b"1"
