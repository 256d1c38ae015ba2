"""The docs' pages for the docs tests: README.md and docs/*.md, and the tables marked ``<!-- checked: COMMAND -->``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- checked: (?P<command>[^>]*?) -->$")


@dataclasses.dataclass
class Table:
    """A markdown table under a ``checked`` marker: its lines and, per row, its cells."""

    page: Path
    command: str
    line: int  # 1-based, the marker's
    lines: list[str]  # header, separator, rows

    @property
    def rows(self) -> list[list[str]]:
        return [[c.strip() for c in line.strip().strip("|").split("|")] for line in self.lines[2:]]

    def where(self) -> str:
        return f"{name(self.page)}:{self.line}"


def name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def checked_tables(pages=PAGES) -> list[Table]:
    """Every table under a ``<!-- checked: COMMAND -->`` marker (the table starts on the next line)."""
    tables = []
    for page in pages:
        lines = text(page).splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                continue
            body = []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                body.append(row)
            assert len(body) >= 3, f"{name(page)}:{i + 1}: a checked marker must stand right above a table"
            tables.append(Table(page, m["command"], i + 1, body))
    return tables
