"""Every ``console`` block of docs/*.md and README.md runs here, and its output must be what the
page shows (issue 10: a page whose examples drift fails the build).

How a page marks its blocks (docs/index.md, "Examples that are tested", says the same):

- a fenced block of language ``console`` is a terminal session: each ``$ `` line is a command
  (an open quote or a trailing backslash continues it on the next lines), and the lines after
  it, up to the next ``$ ``, are what it prints: its standard output, then its standard error;
- a block that cannot run here (a GPU, a live vLLM server, a long benchmark) is preceded by
  ``<!-- skip: next "the reason" -->`` (Sybil's skip directive), so the reason shows in the
  Markdown; a block that starts with ``$ `` must be a ``console`` block (a plain one would
  escape the test).

Commands run with bash in a scratch directory per page, one after the other (a page may build on
its earlier blocks: ``export -o tables`` then ``ls tables``), with ``kvledger`` on PATH and
``tests/data`` beside them. The example logs are made here, deterministically: ``run-a`` and
``run-b`` (and ``run-async``) by vLLM's real scheduler (``connector.testing.run``, fixed seeds) as
replay-commands.md shows. Timings, run ids, log file names and temporary paths are masked
before comparing (``MASKS``). ``echo $?`` sees the previous command's exit status.

``KVLEDGER_WRITE_DOCS=1 pytest tests/test_docs_console.py -k PAGE`` rewrites the outputs of a
page's blocks from what the commands print now (then read the diff: the prose around a block
may need the same change).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import unittest
from collections.abc import Callable
from pathlib import Path

import pytest
from sybil import Example, Sybil  # the dev extra
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
WRITE = os.environ.get("KVLEDGER_WRITE_DOCS") == "1"

# (pattern, replacement), applied to what a page shows and to what the command printed.
MASKS: list[tuple[re.Pattern[str], str]] = [
    # wall time: "in 0.06s", "wall time  0.410 s", "seconds  9.96"
    (re.compile(r"\b\d+\.\d+ ?s\b"), "<SECONDS>"),
    (re.compile(r"(seconds\s+)\d+\.\d+"), r"\1<SECONDS>"),
    # a log file's name holds its start time and process id
    (re.compile(r"kvledger-\d{8}-\d{6}-\d+-[0-9a-f]+((?:\.\d+)?\.kvlog)"), r"kvledger-<RUN>\1"),
    # a run's id (a random UUID)
    (re.compile(r"(\brun\s+|\"run_id\": \")[0-9a-f]{32}\b"), r"\1<RUN_ID>"),
    (re.compile(r"(\"created_wall_ns\": )\d+"), r"\1<NS>"),
    # the demo's scratch directory (tempfile.mkdtemp)
    (re.compile(r"kvledger-demo-\w+"), "kvledger-demo-<TMP>"),
    # torch's own log lines on stderr (glog style: "W1125 16:50:43.292000 24688 file.py:53] ..."),
    # which come and go with the machine (Triton present or not)
    (re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] .*\n?", re.M), ""),
]


def normalize(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return "\n".join(lines)


# --- a console block ------------------------------------------------------------------------


def _complete(command: str) -> bool:
    if command.endswith("\\"):
        return False
    try:
        shlex.split(command)
    except ValueError:  # an open quote: the command goes on
        return False
    return True


def parse_session(source: str) -> list[tuple[str, str]]:
    """(command, what it printed) for each ``$ `` line of a console block."""
    session: list[tuple[str, list[str]]] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if not session:
                raise ValueError(f"a console block starts with {line!r}, not a '$ ' command")
            session[-1][1].append(line)
            i += 1
            continue
        command = line[2:]
        while not _complete(command) and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i]
        session.append((command, []))
        i += 1
    return [(c, "\n".join(out)) for c, out in session]


def run_session(source: str, cwd: Path, env: dict[str, str]) -> str:
    """The block as it reads when its commands run now: each command, then what it prints."""
    status = 0
    parts = []
    for command, _ in parse_session(source):
        proc = subprocess.run(
            ["bash", "-c", f"(exit {status}); {command}"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        status = proc.returncode
        parts.append("$ " + command)
        printed = (proc.stdout + proc.stderr).rstrip("\n")
        if printed:
            parts.append(printed)
    return "\n".join(parts) + "\n"


# --- the logs the pages use -----------------------------------------------------------------

_RUN_SPEC = dict(
    num_requests=4,
    num_gpu_blocks=12,
    prompt_len=(20, 50),
    max_tokens=(20, 40),
    enable_prefix_caching=False,
)


def _make_runs(where: Path) -> None:
    """replay-commands.md's run-a (chunk_size 32), run-b (16) and run-async (run-a under async
    scheduling), as the page says, and why-missed.md's run-miss (tests/_miss_run.py)."""
    code = (
        "from kvledger.connector.testing.run import RunSpec, run\n"
        f"spec = {_RUN_SPEC!r}\n"
        "run(RunSpec(**spec), log_dir='run-a')\n"
        "run(RunSpec(**spec, extra_config={'chunk_size': 16}), log_dir='run-b')\n"
        "run(RunSpec(**spec, async_scheduling=True), log_dir='run-async')\n"
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from _miss_run import make; make('run-miss')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], cwd=where, env=env, check=True, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    """Makes run-a and run-b once, when a page first needs them (vLLM's startup: seconds)."""
    where = tmp_path_factory.mktemp("runs")
    made = False

    def get() -> Path:
        nonlocal made
        if not made:
            from kvledger.connector.testing.harness import skip_reason

            reason = skip_reason()
            if reason is not None:
                pytest.skip(f"run-a, run-b and run-async need vLLM's scheduler: {reason}")
            _make_runs(where)
            made = True
        return where

    return get


def _uses_runs(text: str) -> bool:
    return re.search(r"^\$ .*\brun-(a|b|async|miss)\b", text, flags=re.M) is not None


# --- the pages ------------------------------------------------------------------------------


def _evaluate_console(example: Example) -> str | None:
    ns = example.namespace
    actual = run_session(example.parsed, ns["cwd"], ns["env"])
    if WRITE:
        lexeme = example.region.lexemes["source"]
        ns["rewrites"].append((example.region.start + lexeme.offset, len(lexeme), actual))
        return None
    if normalize(actual) == normalize(example.parsed):
        return None
    import difflib

    diff = difflib.unified_diff(
        normalize(example.parsed).splitlines(),
        normalize(actual).splitlines(),
        "the page",
        "the commands now",
        lineterm="",
    )
    return "\n".join(diff)


_SYBIL = Sybil(parsers=[CodeBlockParser("console", _evaluate_console), SkipParser()])


def _env(cwd: Path) -> dict[str, str]:
    env = dict(os.environ)
    # kvledger from this environment (its bin directory first), plain tables (no terminal)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(TERM="dumb", NO_COLOR="1", COLUMNS="200", VLLM_LOGGING_LEVEL="ERROR")
    # this checkout's code, whatever the environment has installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_console_blocks_print_what_the_page_shows(
    page: Path, tmp_path: Path, runs: Callable[[], Path]
) -> None:
    document = _SYBIL.parse(page)
    examples = list(document.examples())
    if not any(e.region.evaluator is _evaluate_console for e in examples):
        pytest.skip("no console block")
    (tmp_path / "tests").mkdir()
    if sys.prefix != sys.base_prefix:  # a page may say .venv/bin/kvledger, as the README does
        (tmp_path / ".venv").symlink_to(sys.prefix)
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    if _uses_runs(page.read_text()):
        for name in ("run-a", "run-b", "run-async", "run-miss"):
            shutil.copytree(runs() / name, tmp_path / name)
    document.namespace.update(cwd=tmp_path, env=_env(tmp_path), rewrites=[])
    failures, skipped, ran = [], [], 0
    for example in examples:
        line = example.line
        try:
            example.evaluate()
        except unittest.SkipTest as e:
            skipped.append(f"line {line}: {e}")
            continue
        except Exception as e:
            failures.append(f"{page.name}, the block at line {line}:\n{e}")
            continue
        ran += example.region.evaluator is _evaluate_console
    if WRITE:
        text = document.text
        for start, length, new in sorted(document.namespace["rewrites"], reverse=True):
            text = text[:start] + new + text[start + length :]
        page.write_text(text)
    assert not failures, "\n\n".join(failures)
    if not ran and skipped:
        pytest.skip("; ".join(skipped))


_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_a_terminal_session_is_a_console_block(page: Path) -> None:
    # A session in a plain (or bash) block would never run: name it console, or skip it.
    text = page.read_text()
    wrong = [
        text[: m.start()].count("\n") + 1
        for m in _FENCE.finditer(text)
        if m["lang"] != "console" and m["body"].lstrip().startswith("$ ")
    ]
    assert wrong == [], f"{page.name}: blocks at lines {wrong} start with '$ ': make them console"
