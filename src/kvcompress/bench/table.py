"""Benchmark results as markdown tables and JSON files.

Every benchmark returns rows (a list of flat dicts). ``markdown_table`` renders chosen columns with per-column
formats; ``save_rows`` writes the rows and the environment they came from as JSON so tables and plots can be
regenerated without rerunning.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvcompress.results import append_row

Column = tuple[str, str, str]  # (row key, header, format spec such as ".2f" or "" for str())


def format_cell(value: object, spec: str = "") -> str:
    """Render one value: ``None``/NaN as an em dash, numbers with ``spec``, booleans as yes/no."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec and isinstance(value, (int, float)):
        return format(value, spec)
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[Column]) -> str:
    """A GitHub-flavoured markdown table of ``rows`` with the given ``(key, header, format)`` columns.

    Numeric columns (a non-empty format spec) are right-aligned. A row missing a key shows an em dash.
    """
    if not columns:
        raise ValueError("columns must name at least one (key, header, format) column")
    header = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---:" if spec else "---" for _, _, spec in columns) + "|"
    body = ["| " + " | ".join(format_cell(row.get(key), spec) for key, _, spec in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def save_rows(path: str | Path, rows: Sequence[Mapping[str, object]], meta: Mapping[str, object]) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` as JSON (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": dict(meta), "rows": [dict(row) for row in rows]}, indent=1) + "\n")
    return path


def load_rows(path: str | Path) -> tuple[list[dict[str, object]], dict[str, object]]:
    """Read a file written by ``save_rows``; returns ``(rows, meta)``."""
    data = json.loads(Path(path).read_text())
    return data["rows"], data["meta"]


def partial_writer(out: Path | None, name: str) -> Callable[[Mapping[str, object]], None] | None:
    """A callback appending each finished row to ``OUT/NAME.partial.jsonl`` (emptied first); ``None`` without out."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{name}.partial.jsonl"
    partial.write_text("")

    def on_row(row: Mapping[str, object]) -> None:
        append_row(row, partial)

    return on_row


def save_outputs(
    out: Path, name: str, rows: Sequence[Mapping[str, object]], meta: Mapping[str, object], table: str
) -> None:
    """Write ``OUT/NAME.json`` (rows + meta) and ``OUT/NAME.md`` (the table)."""
    save_rows(out / f"{name}.json", rows, meta)
    (out / f"{name}.md").write_text(table + "\n")
