"""``pip install`` into a venv, done by uv where it can: the same packages, far faster.

Most of ``make test``'s first phase was pip resolving and unpacking (torch into three venvs, vLLM's
requirements into two). uv installs the same requirements from the same places: pip's own
configuration (``pip config list``: its files and ``PIP_*`` variables: indexes, find-links,
constraints) is read and handed over, with pip's way of choosing among indexes (the best
version any of them offers), and pip's byte-compiling unless ``--no-compile`` is given.
Where uv is not installed (``make`` puts it in ``.venv``), pip's configuration holds a setting
this does not translate, or uv fails, pip does the install itself and the reason is printed.

    python .ci/uvpip.py VENV_PYTHON install [pip install's arguments]
    python .ci/uvpip.py VENV_PYTHON uninstall NAMES
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UV = ROOT / ".venv" / "bin" / "uv"  # the Makefile's pin, installed with .venv

# pip options (config keys) and uv's flags for them; a value may hold several, space-separated.
_MAPPED = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# Settings that change nothing uv resolves or installs (how pip talks, logs or caches); pip's
# cert is handed over as uv's SSL_CERT_FILE (uv_flags).
_HARMLESS = {
    "default-timeout",
    "timeout",
    "retries",
    "disable-pip-version-check",
    "progress-bar",
    "no-color",
    "quiet",
    "verbose",
    "no-input",
    "root-user-action",
    "cache-dir",
    "no-cache-dir",
    "config-file",  # where pip found the settings listed with it
}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings for ``install``: its files' [global] and [install] sections,
    then its environment variables, each overriding the one before (pip's own order)."""
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    ranked: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        section, _, key = name.rpartition(".")
        rank = {"global": 1, "install": 2, ":env:": 3}.get(section)
        if rank is None:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw.strip("'\"")
        if key not in ranked or rank >= ranked[key][0]:
            ranked[key] = (rank, str(value))
    return {key: value for key, (_, value) in ranked.items()}


def uv_flags(settings: dict[str, str]) -> tuple[list[str], dict[str, str]] | str:
    """uv's flags and environment for pip's ``settings``, or why they cannot be handed over."""
    flags = ["--index-strategy", "unsafe-best-match"]  # pip's choice among indexes
    env: dict[str, str] = {}
    for key, value in settings.items():
        if key in _MAPPED:
            for item in value.split():
                flags += [_MAPPED[key], item]
        elif key == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                flags.append("--no-index")
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key not in _HARMLESS:
            return f"pip's setting {key!r} has no uv flag here"
    return flags, env


def uv_install_args(args: list[str]) -> list[str]:
    """pip install's arguments as uv's: uv does not byte-compile unless told; pip does unless
    told not to."""
    if "--no-compile" in args:
        return [a for a in args if a != "--no-compile"]
    return ["--compile-bytecode", *args]


def pip(python: str, command: str, args: list[str]) -> int:
    """``python -m pip command args`` (install or uninstall), by uv where it can; the exit
    status."""
    fallback = [python, "-m", "pip", command, *(["-y"] if command == "uninstall" else []), *args]
    why: str
    if shutil.which(str(UV)) is None:
        why = f"{UV} is not installed"
    else:
        try:
            translated = uv_flags(pip_settings(python)) if command == "install" else ([], {})
        except (OSError, subprocess.CalledProcessError) as exc:  # no pip config to read
            translated = f"pip's settings could not be read ({exc})"
        if isinstance(translated, str):
            why = translated
        else:
            flags, env = translated
            uv_args = uv_install_args(args) if command == "install" else args
            cmd = [str(UV), "pip", command, "--python", python, *flags, *uv_args]
            done = subprocess.run(cmd, env={**os.environ, **env}, check=False)
            if done.returncode == 0:
                return 0
            why = f"uv exited {done.returncode}"
    print(f"uvpip: {why}; pip does it instead", file=sys.stderr, flush=True)
    return subprocess.run(fallback, check=False).returncode


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("install", "uninstall"):
        sys.exit(__doc__)
    return pip(argv[0], argv[1], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
