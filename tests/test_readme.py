"""The README's examples work as printed: its Python example is ``examples/needle.py`` and prints what the README
shows; every command of its command-line section exits 0."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.cli import main
from tests.helpers import needs_smollm2

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of ``text`` opened with ```` ```language ```` (an empty language: plain fences)."""
    blocks, current, opened = [], [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if opened is None:
                opened, current = line[3:].strip(), []
            else:
                if opened == language:
                    blocks.append("".join(current))
                opened = None
        elif opened is not None:
            current.append(line)
    return blocks


def test_the_python_example_is_examples_needle_py():
    [code] = _blocks(_section("Use it from Python"), "python")
    assert code == (ROOT / "examples" / "needle.py").read_text(encoding="utf-8")


@pytest.mark.slow
@needs_smollm2
def test_the_python_example_prints_what_the_readme_shows():
    [printed] = _blocks(_section("Use it from Python"), "")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "needle.py")], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out == printed


@pytest.mark.slow
@needs_smollm2
def test_every_command_line_example_exits_0(tmp_path, monkeypatch):
    [commands] = _blocks(_section("Command line"), "bash")
    lines = [line for line in commands.splitlines() if line.strip()]
    assert len(lines) >= 6 and all(line.startswith("kvcompress ") for line in lines)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)  # outputs go to runs/ under a fresh folder, as in a fresh clone
    for line in lines:
        with pytest.raises(SystemExit) as done:
            main(shlex.split(line)[1:])
        assert done.value.code == 0, line
    assert (tmp_path / "runs" / "readme" / "ruler.jsonl").is_file()
    assert (tmp_path / "runs" / "readme" / "report.md").is_file()
    assert (tmp_path / "runs" / "readme-leaderboard" / "smollm2-135m" / "leaderboard.md").is_file()
