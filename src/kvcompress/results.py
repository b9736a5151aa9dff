"""Results files: JSON lines, one row (a JSON object) per finished measurement, appended as each row finishes.

A stopped run resumes by skipping the rows already written. Nothing written is lost and no row is written twice:

- A line that is not a JSON object (a torn last line of a killed write, a hand edit, valid JSON that is no object) is
  skipped by readers with a warning naming the file and line (``read_rows(..., problems=[])`` collects them).
- Before appending, a torn last line is ended with a newline, so it stays on its own line (skipped, still there to
  read) instead of gluing the next row onto it.
- Writers take an exclusive lock on the file (``fcntl.flock``, where the platform has it) around each append, and
  ``ResultsFile.append`` re-reads what other writers appended before writing a row: two processes on one file never
  both write a row of the same key (and each skips the rows the other has finished).

Used by the evaluation runner, the benchmarks and the repository's experiments.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks; one writer per file there)
    fcntl = None

logger = logging.getLogger(__name__)


def parse_lines(
    data: bytes, path: Path, first_line: int, problems: list[str] | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of the rows in ``data`` (whole lines of a results file starting at line
    ``first_line``); every other line is recorded in ``problems`` as ``"FILE:LINE: what is wrong"`` (logged when
    ``problems`` is ``None``)."""
    for number, line in enumerate(data.split(b"\n"), first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            reason = None if isinstance(row, dict) else f"is JSON but not an object (a {type(row).__name__})"
        except (json.JSONDecodeError, UnicodeDecodeError):
            row, reason = None, "is not valid JSON (an interrupted write?)"
        if reason is None:
            yield number, row
            continue
        message = f"{path}:{number}: {reason}; skipped"
        if problems is None:
            logger.warning("%s", message)
        else:
            problems.append(message)


def read_rows(path: str | os.PathLike[str], problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Every row of a JSONL file (none when it does not exist yet); lines that are no JSON object are skipped and
    reported (appended to ``problems`` when given, else logged)."""
    return [row for _, row in numbered_rows(path, problems)]


def numbered_rows(path: str | os.PathLike[str], problems: list[str] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """``read_rows`` with each row's line number."""
    path = Path(path)
    return list(parse_lines(path.read_bytes(), path, 1, problems)) if path.exists() else []


@contextmanager
def locked(path: Path) -> Iterator[IO[bytes]]:
    """The file opened for appending under an exclusive lock, its torn last line (if any) ended first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            end_torn_line(handle)
            yield handle
        finally:
            handle.flush()
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def end_torn_line(handle: IO[bytes]) -> None:
    """End an unterminated last line (a write that was cut off) with a newline, so the next row starts a line."""
    size = handle.seek(0, os.SEEK_END)
    if size == 0:
        return
    handle.seek(size - 1)
    if handle.read(1) != b"\n":
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n")
        handle.flush()
        logger.warning("%s: the last line was cut off (an interrupted write); kept on a line of its own", handle.name)


def _encoded(row: Mapping[str, Any]) -> bytes:
    return (json.dumps(dict(row)) + "\n").encode("utf-8")


def append_row(row: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Append one row (creating the file and its folder), under the file's lock."""
    with locked(Path(path)) as handle:
        handle.write(_encoded(row))


def done_keys(path: str | os.PathLike[str], key: str = "key") -> set[Any]:
    """The ``key`` field of every row already in ``path``."""
    return {row[key] for row in read_rows(path) if key in row}


class ResultsFile:
    """A results file several processes may append to at once, with each row's identity given by ``key`` (rows
    whose ``key`` is ``None``, e.g. environment rows, are always appended).

    ``done(key)`` answers from every row written so far, by any writer (what was appended since the last look is
    read first); ``append(row)`` writes the row under the lock unless a row of its key is already there."""

    def __init__(self, path: str | os.PathLike[str], key: Callable[[dict[str, Any]], Hashable | None]) -> None:
        self.path = Path(path)
        self.key = key
        self.keys: set[Hashable] = set()
        self.offset = 0  # bytes read so far (whole lines only)
        self.lines = 0

    def refresh(self) -> None:
        """Read the whole lines appended since the last look."""
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        if not whole:
            return
        for _, row in parse_lines(whole[:-1], self.path, self.lines + 1, None):
            key = self.key(row)
            if key is not None:
                self.keys.add(key)
        self.offset += len(whole)
        self.lines += whole.count(b"\n")

    def done(self, key: Hashable) -> bool:
        self.refresh()
        return key in self.keys

    def append(self, row: Mapping[str, Any]) -> bool:
        """Append ``row`` unless a row of its key is in the file; returns whether it was written."""
        key = self.key(dict(row))
        with locked(self.path) as handle:
            self.refresh()
            if key is not None and key in self.keys:
                return False
            handle.write(_encoded(row))
        self.refresh()
        return True
