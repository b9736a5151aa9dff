"""Readers of published long-context benchmarks, each in the schema its authors distribute, for the ``dataset`` task.

Each schema module turns the rows of one JSON-lines file into ``Item``s: the context (the benchmark's
instructions and the long document: what the query-agnostic setting compresses), the question after it, the
answer prefix that starts the assistant turn, the references, the generation length and the benchmark's own
score. ``SCHEMAS`` maps a schema name to its module; ``detect_schema`` tells the schema from a row's fields.

Files are read as JSON only (``json.loads`` per line); nothing in a file is executed. A malformed file raises
one ``ValueError`` naming the file, the line and what is wrong (``RowError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Item:
    """One question of a benchmark file, ready to prompt and to score.

    ``scorer`` maps a prediction to the benchmark's scores (``"score"`` first: the headline, in [0, 1]).
    ``chat``: the prompt goes through the model's chat template (``False``: raw completion text, as LongBench
    prompts its few-shot and code tasks). ``stop_when_found``: decoding may stop once all these strings are in
    the answer (only where that cannot change the score).
    """

    id: str
    subset: str
    context: str
    question: str
    answer_prefix: str
    answers: Any
    max_new_tokens: int
    scorer: Callable[[str], dict[str, float]]
    chat: bool = True
    stop_when_found: tuple[str, ...] = ()
    source_id: Any = None


class RowError(ValueError):
    """A malformed row: ``{file} line {n}: {what}``."""

    def __init__(self, path: Path, line: int, message: str) -> None:
        super().__init__(f"{path} line {line}: {message}")


@dataclass(frozen=True)
class Row:
    """A row with where it came from, so that every complaint about it names the file and the line."""

    path: Path
    line: int
    data: dict[str, Any]
    schema: str

    def error(self, message: str) -> RowError:
        return RowError(self.path, self.line, message)

    def field(self, key: str) -> Any:
        if key not in self.data:
            raise self.error(f"field {key!r} is missing (a {self.schema} row has {', '.join(FIELDS[self.schema])})")
        return self.data[key]

    def text(self, key: str) -> str:
        value = self.field(key)
        if not isinstance(value, str):
            raise self.error(f"field {key!r} must be a string, got {type(value).__name__}")
        return value

    def texts(self, key: str) -> list[str]:
        """A non-empty list of strings (a lone string is taken as a one-element list)."""
        value = self.field(key)
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise self.error(f"field {key!r} must be a non-empty list of strings, got {json.dumps(value)[:80]}")
        return value

    def integer(self, key: str) -> int:
        value = self.field(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(f"field {key!r} must be an integer >= 1, got {value!r}")
        return value


# The fields each schema's rows must have (as published), named in error messages.
FIELDS = {
    "ruler": ("index", "input", "outputs", "length"),
    "kvpress": ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens"),
    "longbench": ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"),
    "infinitebench": ("id", "context", "input", "answer", "options"),
    "loogle": ("input", "title", "qa_pairs", "output"),
}
SCHEMA_NAMES = tuple(FIELDS)


def read_rows(path: str | Path, schema: str) -> Iterator[Row]:
    """The JSON objects of a JSON-lines file, one per non-blank line, read lazily (files can be large)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"file {str(path)!r} does not exist or is not a file; give a .jsonl file of the benchmark")
    with path.open(encoding="utf-8") as handle:
        number = 0
        try:
            for number, line in enumerate(handle, 1):  # noqa: B007 (number is read in the except clause)
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as error:
                    raise RowError(path, number, f"not valid JSON ({error.msg}, column {error.colno})") from None
                if not isinstance(data, dict):
                    raise RowError(path, number, f"a row must be a JSON object, got {type(data).__name__}")
                yield Row(path, number, data, schema)
        except UnicodeDecodeError:
            raise RowError(path, number + 1, "not UTF-8 text") from None


def detect_schema(data: dict[str, Any]) -> str | None:
    """The schema whose published fields a row has (``None`` if none fits)."""
    keys = set(data)
    if "qa_pairs" in keys:
        return "loogle"
    if {"context", "question", "answer_prefix"} <= keys:  # before LongBench: kvpress keeps LongBench's columns
        return "kvpress"
    if {"all_classes", "_id"} & keys:
        return "longbench"
    if {"input", "outputs"} <= keys:
        return "ruler"
    if {"context", "input", "answer"} <= keys:
        return "infinitebench"
    return None


def check_subset(subset: str, allowed: tuple[str, ...] | dict, schema: str, where: str) -> str:
    if subset not in allowed:
        raise ValueError(f"{where}: {schema} subset must be one of {', '.join(allowed)}; got {subset!r}")
    return subset


def split_suffix(text: str, suffix: str) -> tuple[str, str]:
    """``(text without suffix, suffix)`` when ``text`` ends with ``suffix`` (white space aside), else ``(text, "")``."""
    stripped = text.rstrip()
    if suffix.strip() and stripped.endswith(suffix.strip()):
        return stripped[: -len(suffix.strip())].rstrip(), suffix.strip()
    return text, ""


def file_subset(path: Path, subset: str | None, allowed: tuple[str, ...] | dict, schema: str) -> str:
    """The benchmark task of a file: ``subset`` if given, else the file name (``kv_retrieval.jsonl``)."""
    if subset is not None:
        return check_subset(subset, allowed, schema, "--param subset")
    return check_subset(path.stem, allowed, schema, f"file name {path.name!r} (or give --param subset)")
