"""Results files: JSON lines, one row per finished measurement, appended as each row finishes.

A stopped run resumes by skipping the rows already written; a truncated last line (an interrupted write) is
skipped with a warning. Used by the evaluation runner, the benchmarks and the repository's experiments.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of a JSONL file (none when it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON (an interrupted write?); ignored", path, number)
    return rows


def append_row(row: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Append one row (creating the file and its folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(dict(row)) + "\n")


def done_keys(path: str | os.PathLike[str], key: str = "key") -> set[Any]:
    """The ``key`` field of every row already in ``path``."""
    return {row[key] for row in read_rows(path) if key in row}
