"""The optional extras, guarded in one place: rich (``cli``), matplotlib (``timeline``),
pyarrow (``parquet``), duckdb (``sql``) and opentelemetry-proto (``otlp``). Nothing else in ``replay`` imports them: a use that needs one gets it
from :func:`require` (or :func:`pyplot`), which names the extra to install when it is
missing; a nicety with a plain fallback (rich's tables and progress bars) asks
:func:`optional`. Also the small output helpers the commands share (:class:`Output`,
:func:`progress_bar`, :func:`write_atomic`)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import ModuleType
from typing import IO, Any, Literal

from kvledger.replay.format import elide, visible

__all__ = [
    "MissingExtra",
    "Output",
    "optional",
    "progress_bar",
    "pyplot",
    "require",
    "write_atomic",
]


class MissingExtra(ImportError):
    """An optional dependency is not installed: the message says which extra to install."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """``module``, imported; :class:`MissingExtra` naming the extra when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(
            f"{what} needs {module}, which is not installed: pip install kvledger[{extra}]"
        ) from None


def pyplot(what: str) -> ModuleType:
    """matplotlib's ``pyplot``, drawing to files only (the ``timeline`` extra)."""
    matplotlib = require("matplotlib", "timeline", what)
    matplotlib.use("Agg", force=True)
    return require("matplotlib.pyplot", "timeline", what)


def optional(module: str) -> ModuleType | None:
    """``module`` if it is installed, else None (the caller falls back to plain output)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def write_atomic(out: str, data: bytes) -> None:
    """Write ``out`` whole or not at all (aside, then renamed; what was set aside is removed
    when that fails)."""
    tmp = out + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def progress_bar(stream: IO[str], label: str, *, unit: Literal["bytes", "requests"]) -> Any:
    """A rich progress bar on a terminal; None (silent) when piped or rich is missing.
    ``unit="bytes"``: a download-style count (``check``); ``"requests"``: requests finished
    and the step, with the time taken (``demo``)."""
    if not stream.isatty():
        return None
    progress = optional("rich.progress")
    console = optional("rich.console")
    if progress is None or console is None:
        return None
    if unit == "bytes":
        columns = [progress.DownloadColumn()]
    else:
        columns = [
            progress.TextColumn(
                "{task.completed}/{task.total} requests finished, step {task.fields[step]}"
            ),
            progress.TimeElapsedColumn(),
        ]
    return progress.Progress(
        progress.TextColumn(f"[bold]{label}"),
        progress.BarColumn(),
        *columns,
        console=console.Console(file=stream),
        transient=True,
    )


@contextmanager
def reading_progress(
    label: str, *, quiet: bool = False
) -> Iterator[Callable[[int, int], None] | None]:
    """``progress(bytes done, bytes total)`` drawing a bar on stderr while a command reads
    its log (``check``, ``whatif``); None when ``quiet`` (``--json``), piped, or without rich."""
    bar = None if quiet else progress_bar(sys.stderr, label, unit="bytes")
    if bar is None:
        yield None
        return
    with bar:
        task = bar.add_task(label, total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield progress


class Output:
    """Tables and lines: rich on a terminal, plain text otherwise. A table cell wider than
    :data:`replay.format.WIDE` is elided (:func:`replay.format.elide`); every control character
    of a line, a cell or a heading is shown escaped (:func:`replay.format.visible`)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.console: Any = None
        rich = optional("rich.console") if self.stream.isatty() else None
        if rich is not None:
            self.console = rich.Console(file=self.stream, highlight=False, soft_wrap=True)

    def line(self, text: str = "", style: str = "") -> None:
        # One line: a control character in it (a value read from a log: an escape sequence
        # in a request id, a newline) is shown escaped (replay.format.visible), never sent.
        text = visible(text)
        if self.console is not None:
            from rich.text import Text

            self.console.print(Text(text, style=style))
        else:
            self.stream.write(text + "\n")

    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        title: str = "",
        right: Sequence[str] = (),
        styles: Sequence[str] | None = None,
    ) -> None:
        # A cell holds a value read from a log, of any size: each is elided, so that no row
        # (and, in plain text, no column's padding) grows with it. --json prints it whole.
        # A control character in a cell or a heading is shown escaped (replay.format.visible).
        cells = [["" if v is None else elide(str(v)) for v in row] for row in rows]
        columns, right = [visible(c) for c in columns], [visible(c) for c in right]
        title = visible(title)
        if self.console is not None:
            from rich.table import Table

            t = Table(title=title or None, title_justify="left", header_style="bold")
            for c in columns:
                t.add_column(c, justify="right" if c in right else "left", overflow="fold")
            for i, row in enumerate(cells):
                t.add_row(*row, style=(styles[i] if styles else None) or None)
            self.console.print(t)
            return
        if title:
            self.stream.write(title + "\n")
        widths = [len(c) for c in columns]
        for row in cells:
            widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]

        def fmt(values: Sequence[str]) -> str:
            parts = [
                v.rjust(w) if c in right else v.ljust(w)
                for c, v, w in zip(columns, values, widths, strict=True)
            ]
            return "  ".join(parts).rstrip()

        self.stream.write(fmt(list(columns)) + "\n")
        for row in cells:
            self.stream.write(fmt(row) + "\n")
