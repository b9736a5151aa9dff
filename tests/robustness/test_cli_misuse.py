"""The command line refuses what cannot mean anything (an option given twice, a run of nothing, combinations without
a meaning) with one line and exit status 2, and prints help for every subcommand. Every case fails before a model
loads."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.cli.test_bad_inputs import run


def misuses(tmp: str) -> list[tuple[list[str], str]]:
    """(arguments, text the error line must contain)."""
    gen = ["generate", "hi", "--model", "no-model-needed"]
    return [
        ([*gen, "--budget", "4", "--budget", "8"], "--budget is given twice"),
        ([*gen, "--budget=4", "--budget", "8"], "--budget is given twice"),
        ([*gen, "-m", "h2o", "--method", "window"], "given twice (as -m and --method)"),
        ([*gen, "--chat", "--no-chat"], "given twice (as --chat and --no-chat)"),
        (["eval", "passkey", "--samples", "2", "--samples", "3"], "--samples is given twice"),
        (["eval", "passkey", "--out", "a", "--out=b"], "--out is given twice"),
        (["report", tmp, "--out", "a", "--out", "b"], "--out is given twice"),
        (["bench", "decode", "--model", "a", "--model", "b"], "--model is given twice"),
        (["train", "less", "--out", "a", "--out", "b"], "--out is given twice"),
        (["eval", "passkey", "--methods", ""], "--methods '' names nothing to run"),
        (["eval", "passkey", "--methods", " , "], "--methods ' , ' names nothing to run"),
        (["eval", "passkey", "--budgets", ","], "--budgets ',' names nothing to run"),
        ([*gen, "-m", "less", "-p", "base=full"], "base full keeps every token"),
        ([*gen, "-m", "knorm", "--budget", "8", "-p", "recent=9"], "recent must be an integer in [0, budget = 8]"),
        ([*gen, "-m", "pod", "-p", f"similarity={tmp}/nan.pt"], "similarities are NaN"),
    ]


def test_each_misuse_gives_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the pass-through commands rename argv[0]
    torch.save({"sim": torch.full((3, 30, 30), float("nan")), "kv_heads": 3}, tmp_path / "nan.pt")
    for args, expected in misuses(str(tmp_path)):
        status, out, err = run(args, capsys)
        lines = err.strip().splitlines()
        assert status == 2, (args, status, out, err)
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in out + err, (args, err)


@pytest.mark.parametrize("command", [["bench"], ["train"]])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_and_train_print_their_help(command, flag, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    status, out, err = run([*command, flag], capsys)
    assert status == 0 and err == ""
    assert "Usage: kvcompress " + command[0] in out and f"kvcompress {command[0]} NAME --help" in out


@pytest.mark.parametrize("command", [["bench", "decode"], ["train", "less"], ["eval"], ["report"], ["generate"]])
def test_every_subcommand_prints_help(command, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    status, out, _ = run([*command, "--help"], capsys)
    assert status == 0 and "usage" in out.lower()


def test_options_that_collect_values_may_repeat(capsys, monkeypatch):
    """``-p`` and ``--param`` take one value each time: repeating them is how several are given."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    status, _, err = run(
        ["generate", "hi", "-m", "h2o", "-p", "budget=8", "-p", "heavy_ratio=0.5", "--model", "x"], capsys
    )
    assert status == 2 and "given twice" not in err and "not a known model" in err
    status, _, err = run(["eval", "passkey", "--param", "length=300", "--param", "depth=0.5", "--samples", "0"], capsys)
    assert status == 2 and "given twice" not in err and "samples" in err
