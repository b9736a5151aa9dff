"""Every script of ``experiments/`` and ``scripts/`` answers ``--help`` with its usage and does nothing else (a
script that took ``--help`` for a folder or a count once ended in a traceback)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")
# (scripts/vllm_*.py run in vLLM's environment: tests/vllm checks them there)
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if not p.name.startswith("vllm_"))


def answers_help(run, argv0: str, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as stop:
        run()
    assert stop.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_answers_help_with_its_usage(name, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, f"experiments.{name}", raising=False)  # run afresh, as `python -m` does
    out = answers_help(lambda: runpy.run_module(f"experiments.{name}", run_name="__main__"), name, monkeypatch, capsys)
    assert out.startswith("usage:")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_answers_help_with_its_usage(name, monkeypatch, capsys):
    path = str(ROOT / "scripts" / name)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    out = answers_help(lambda: runpy.run_path(path, run_name="__main__"), path, monkeypatch, capsys)
    assert out.startswith("usage:")
