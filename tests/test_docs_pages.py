"""The docs pages stay true to the repository: every relative link names a file that exists,
every page is reachable from the overview, the generated tables are current, and the rule
table of debugging.md names every rule the code can report (issue 10: a link to a missing
file, a page linked from nowhere but the nav, rules missing from the table)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())  # a link in a code block is not a link
    return [m.group(1) for m in _LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    missing = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert missing == [], f"{page.name} links to files that are not in the repository"


def test_every_page_is_linked_from_another_page() -> None:
    # the nav alone is not enough: a reader of the Markdown (or of the README) never sees it
    linked = {
        (page.parent / t.split("#", 1)[0]).resolve()
        for page in PAGES
        for t in _links(page)
        if not re.match(r"[a-z]+:", t) and not t.startswith("#")
    }
    orphans = [
        p.name
        for p in sorted(DOCS.glob("*.md"))
        if p.name != "index.md" and p.resolve() not in linked
    ]
    assert orphans == []


def test_the_generated_tables_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(DOCS / "gen_events.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _code_rules() -> set[str]:
    """Every rule the code reports: the core's (docs/gen_events.py finds them in tracker/),
    those the connector records through ``Tracker.mark_violation``, and ``check
    --replicas``'s."""
    sys.path.insert(0, str(DOCS))
    try:
        import gen_events
    finally:
        sys.path.remove(str(DOCS))
    rules = set(re.findall(r"^\| `(\w+)` \|", gen_events.rules_table(), flags=re.M))
    for path in (ROOT / "connector").glob("*.py"):
        rules |= set(re.findall(r'mark_violation\([^,]+,\s*"(\w+)"', path.read_text()))
    from kvledger.replay.replicas import RULE  # check --replicas: a rule over several logs

    return rules | {RULE}


def test_the_rule_table_names_every_rule_the_code_reports() -> None:
    text = (DOCS / "debugging.md").read_text()
    table = text.split("## Rules", 1)[1].split("| rule | broken when |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    code = _code_rules()
    assert "record_lost" in documented and "adapter_error" in code  # the parse found the table
    # record_lost is written by the Tracker (tracker/tracker.py) as a ViolationRecorded of its own
    assert sorted(code - documented) == [], "rules the code reports that the table lacks"
    assert sorted(documented - code - {"record_lost"}) == [], "rules in the table no code reports"


# --- log-format.md's worked example ---------------------------------------------------------

_WALL_NS = 1_700_000_000_000_000_000  # the page's frozen clock: 1.7e18 ns


def _worked_example_log(path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The log of log-format.md's worked example, written by LogWriter as the page shows."""
    import kvledger.connector.logwriter
    from kvledger.connector.logwriter import LogWriter
    from kvledger.tracker.events import Finished, Scheduled

    monkeypatch.setattr(kvledger.connector.logwriter.time, "time_ns", lambda: _WALL_NS)
    with LogWriter(path, {"block_size": 16, "chunk_size": 256}) as w:
        w.append(Scheduled(7, "r1", 2048, 1, 2048, (42,)))
        w.append(Scheduled(7, "r2", 100, 1, 100, (7,)))
        w.end_step(7)
        w.append(Scheduled(8, "r1", 2049, 1, 2049, (31999,)))
        w.append(Finished(8, "r2"))
        w.end_step(8)
    return path.read_bytes()


def _dump(data: bytes) -> str:
    """The page's annotated hex dump of the worked example, from the file's bytes: the offsets,
    the header's size and every byte shown are the file's."""
    import struct

    frames = []
    at = 12
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        frames.append((at, data[at + 8 : at + 8 + n], data[at + 8 + n : at + 12 + n]))
        at += 12 + n
    assert at == len(data) and len(frames) == 4
    (h_at, header, _), (a_at, a, a_crc), (b_at, b, b_crc), (e_at, end, e_crc) = frames

    def cut(payload: bytes, sizes: list[int]) -> list[bytes]:
        assert sum(sizes) == len(payload), "the records' encoding changed: update _dump"
        out, i = [], 0
        for s in sizes:
            out.append(payload[i : i + s])
            i += s
        return out

    def head(at: int) -> bytes:
        return data[at : at + 8]

    lines = [
        f"{0:08x}  {data[:8].hex(' ')}  {data[8:10].hex(' ')}  {data[10:12].hex(' ')}".ljust(53)
        + '"KVLEDGER", major 1, minor 1',
        f"{h_at:08x}  {head(h_at)[:4].hex(' ')}  {head(h_at)[4:].hex(' ')}  ...".ljust(53)
        + f"header frame: {len(header)}-byte map, then its CRC",
    ]

    def row(at: int | None, raw: bytes, note: str, suffix: str = "") -> str:
        left = f"{at:08x}" if at is not None else ""
        return f"{left:<8}  {raw.hex(' ')}{suffix}".ljust(53) + note

    array, seq, step, wall, count, r1, r2 = cut(a, [1, 1, 1, 9, 1, 12, 10])
    lines += [
        row(a_at, head(a_at)[:4], f"frame: payload of {len(a)} bytes"),
        row(None, head(a_at)[4:], f'masked CRC of "{head(a_at)[:4].hex(" ")}"'),
        row(None, array, "array of 4"),
        row(None, seq, "seq 0"),
        row(None, step, "step 7"),
        row(None, wall, "wall_ns (uint64)"),
        row(None, count, "2 records"),
        row(None, r1, f'[4, "r1", 2048, 1, 0, [42]]  ({len(r1)} bytes)'),
        row(None, r2, '[4, "r2", 100, 1, 0, [7]]'),
        row(None, a_crc, "masked CRC of the payload"),
    ]
    b_head, b_r1, b_fin = cut(b, [13, 12, 3])
    lines += [
        f"{b_at:08x}  {head(b_at)[:4].hex(' ')}  {head(b_at)[4:].hex(' ')}".ljust(53)
        + f"frame: {len(b)} bytes",
        row(None, b_head, "seq 1, step 8, wall_ns, 2 records"),
        row(None, b_r1, '[4, 0, 2049, 1, 0, [31999]]  "r1" is ref 0'),
        row(None, b_fin, '[6, 1]: Finished("r2"), reason dropped'),
        row(None, b_crc, ""),
        f"{e_at:08x}  {head(e_at)[:4].hex(' ')}  {head(e_at)[4:].hex(' ')}".ljust(53)
        + f"frame: {len(end)} bytes, a map: the end record",
        row(None, end[:12], '{"end": "closed", "frames": 2, "last_step": 8}', " ..."),
        row(None, e_crc, ""),
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def test_the_worked_example_is_the_bytes_of_a_real_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The page's offsets were 51 bytes off once (a header grown by new record types): the dump
    # is now compared with the file LogWriter writes. KVLEDGER_WRITE_DOCS=1 rewrites it.
    import os

    page = DOCS / "log-format.md"
    text = page.read_text()
    dump = _dump(_worked_example_log(tmp_path / "demo.kvlog", monkeypatch))
    pattern = re.compile(r"(```\n)(00000000  4b 56 4c 45.*?)(```)", re.S)
    found = pattern.search(text)
    assert found is not None, "log-format.md: the worked example's dump block is gone"
    if os.environ.get("KVLEDGER_WRITE_DOCS") == "1":
        page.write_text(text[: found.start(2)] + dump + text[found.end(2) :])
        return
    assert found.group(2) == dump, (
        "log-format.md's worked example is stale: KVLEDGER_WRITE_DOCS=1 pytest "
        "tests/test_docs_pages.py -k worked_example rewrites it"
    )


def test_every_upcaster_is_in_the_log_format_page() -> None:
    # A reader in another language needs each conversion (StepDecoded's was missing once).
    from kvledger.tracker import codec

    text = (DOCS / "log-format.md").read_text()
    table = text.split("## Versions and upcasting", 1)[1].split("\n\n|", 1)[1].split("\n\n")[0]
    rows = set(re.findall(r"^\| `(\w+)` \| v(\d+):", "|" + table, flags=re.M))
    names = {tag: name for tag, (name, _, _) in codec.schemas().items()}
    wanted = {(names[tag], str(version)) for tag, version in codec.UPCASTERS}
    assert wanted and wanted <= rows, f"upcasters missing from log-format.md: {wanted - rows}"


def test_the_readme_example_prints_what_the_readme_shows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # "The tracker in a few lines": the Python block runs, and prints the Output block after it.
    text = (ROOT / "README.md").read_text()
    section = text.split("## The tracker in a few lines", 1)[1]
    found = re.search(r"```python\n(.*?)```\s*\nOutput:\s*\n\n```\n(.*?)```", section, re.S)
    assert found is not None, "README.md: the example or its output block is gone"
    exec(compile(found.group(1), "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out == found.group(2)


def _check_exits(tmp_path: Path) -> dict[str, int]:
    """``kvledger check``'s exit status for a log closed, open (no end record: cut between
    two frames) and torn (cut inside its last frame), from the tool itself."""
    from _logfiles import step_frames_end, torn_copy
    from test_replay_check import write_log

    from kvledger.replay.replayer import check

    closed = tmp_path / "closed.kvlog"
    write_log(closed)
    data = closed.read_bytes()
    opened = tmp_path / "open.kvlog"
    opened.write_bytes(data[: step_frames_end(data)])
    torn = torn_copy(closed, tmp_path / "torn.kvlog", 5)
    return {
        name: check(p).exit_code
        for name, p in (("closed", closed), ("open", opened), ("torn", torn))
    }


_EXIT = re.compile(r"\bexit(?:s| status|s with status)? ([0-9])\b")


def test_every_page_gives_a_torn_tail_the_exit_status_check_gives(tmp_path: Path) -> None:
    """docs/using-with-vllm.md said a torn tail was exit 3 while the tool (and
    docs/debugging.md) said 2: a line naming a torn tail and an exit status must give the
    tool's, and each row of "How the log ends" must give the status of the log it names."""
    codes = _check_exits(tmp_path)
    wrong = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()[:160]}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if "torn" in line.lower() and {int(d) for d in _EXIT.findall(line)} - {codes["torn"]}
    ]
    assert wrong == [], f"kvledger check exits {codes['torn']} on a torn tail"
    text = (DOCS / "using-with-vllm.md").read_text()
    table = text.split("### How the log ends", 1)[1].split("\n\n| how the engine stopped", 1)[1]
    rows = [r for r in table.split("\n\n", 1)[0].splitlines() if r.startswith("| ")][1:]
    assert len(rows) >= 8
    for row in rows:
        log, verdict = (c.strip() for c in row.strip("|").split(" | ")[2:4])
        ending = "torn" if "torn" in log else "open" if log.startswith("open") else "closed"
        assert verdict.startswith(f"exit {codes[ending]}"), (ending, row)
