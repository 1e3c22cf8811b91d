"""docs/architecture.md is a map of the source: its file table (between the ``file-map`` markers)
has exactly one row per ``.py`` and ``.c`` file under ``src/kvdock``, and names no file that does
not exist. A module added, renamed or removed without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvdock"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- file-map:begin -->", "<!-- file-map:end -->"
ROW = re.compile(r"^\| `([^`]+)` \|")  # a file's row: its path (relative to src/kvdock) in the first cell


def source_files() -> set[str]:
    return {p.relative_to(SRC).as_posix() for ext in ("*.py", "*.c") for p in SRC.rglob(ext)}


def table_rows(text: str) -> list[str]:
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC.name} needs one {BEGIN} ... {END} table"
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    return [m.group(1) for line in table.splitlines() if (m := ROW.match(line))]


def test_every_source_file_has_one_row() -> None:
    rows = table_rows(DOC.read_text())
    assert len(source_files()) > 100  # (the walk found the sources at all)
    missing = sorted(source_files() - set(rows))
    assert not missing, f"files under src/kvdock with no row in docs/architecture.md's file table: {missing}"
    repeated = sorted({r for r in rows if rows.count(r) > 1})
    assert not repeated, f"files with more than one row: {repeated}"


def test_every_row_names_an_existing_file() -> None:
    gone = sorted(set(table_rows(DOC.read_text())) - source_files())
    assert not gone, f"docs/architecture.md's file table names files that do not exist under src/kvdock: {gone}"


def test_every_row_says_what_the_file_does() -> None:
    text = DOC.read_text()
    table = text[text.index(BEGIN) : text.index(END)]
    bare = [line for line in table.splitlines() if ROW.match(line) and not line.split("|")[2].strip()]
    assert not bare, f"rows without a description: {bare}"


def test_the_table_reader_sees_missing_and_unknown_files() -> None:
    """The checks above can fail: a table missing a file, or naming one that does not exist."""
    text = DOC.read_text()
    rows = table_rows(text)
    dropped = text.replace("| `sdk/ops.py` |", "| sdk/ops.py |", 1)
    assert "sdk/ops.py" in rows and "sdk/ops.py" not in table_rows(dropped)
    added = text.replace(END, "| `sdk/nowhere.py` | a file that does not exist |\n" + END, 1)
    assert set(table_rows(added)) - source_files() == {"sdk/nowhere.py"}


def test_the_doc_points_nowhere_outside_the_repository() -> None:
    text = DOC.read_text()
    assert "../" not in text, "docs/architecture.md must not point outside the repository"
    for stale in ("sdk/fastpath.py", "sdk.fastpath", "sdk.transfer.", "sdk.connection", "TIER_KINDS"):
        assert stale not in text, f"stale name {stale!r} in docs/architecture.md"
