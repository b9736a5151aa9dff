"""The experiments' results files: JSON lines, one row per measured configuration, appended as each row finishes
so a stopped run resumes by skipping the rows whose ``key`` is already there."""

from __future__ import annotations

import json
from pathlib import Path


def load_rows(path: Path) -> list[dict]:
    """Every row of ``path`` (none when the file does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(row: dict, path: Path) -> None:
    """Append one row (creating the file and its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def done_keys(path: Path) -> set[str]:
    """The ``key`` of every row already in ``path``."""
    return {row["key"] for row in load_rows(path)}
