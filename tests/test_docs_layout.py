"""docs/architecture.md lists every module of the three packages, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _listed(text: str, heading: str) -> set[str]:
    """The module names in the table that follows ``heading``'s line."""
    section = text.split(heading, 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `([\w/]+(?:\.py)?)` \|", "|" + section, flags=re.M))


def test_architecture_lists_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for package, heading in (
        ("tracker", "`tracker/`, the core"),
        ("connector", "`connector/`, the I/O shell"),
        ("replay", "`replay/`, the offline tools"),
    ):
        files = {
            p.name
            for p in (ROOT / package).glob("*.py")
            if p.name not in ("__init__.py", "__main__.py")
        }
        files |= {f"{p.name}/" for p in (ROOT / package).iterdir() if (p / "__init__.py").exists()}
        assert _listed(text, heading) == files, package


def test_a_subpackage_of_replay_names_each_of_its_modules() -> None:
    """A subpackage of replay is one row of the table (``commands/``); the row names each of
    its modules, so a module added there is described too."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("`replay/`, the offline tools", 1)[1].split("\n## ", 1)[0]
    for package in sorted(p for p in (ROOT / "replay").iterdir() if (p / "__init__.py").exists()):
        (row,) = [r for r in section.splitlines() if r.startswith(f"| `{package.name}/` |")]
        named = set(re.findall(r"`(\w+\.py)`", row))
        files = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
        assert named == files, package.name
