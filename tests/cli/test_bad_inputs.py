"""Bad input through the ``kvcompress`` entry point (``kvcompress.cli.main``, what the installed script runs): each
is a user error, answered with one short line on stderr that names the parameter, exit status 2, no traceback.
Every case fails before a model is loaded, so none needs one."""

from __future__ import annotations

import sys

import pytest

import kvcompress.eval
from kvcompress.cli import main
from kvcompress.eval.data import DATA_ENV
from kvcompress.models import list_models

TOO_BIG = str(10**30)


def bad_inputs(tmp: str) -> list[tuple[list[str], str]]:
    """(arguments, text the error line must contain: the parameter it is about)."""
    gen = ["generate", "hi"]
    nacl = [*gen, "-m", "nacl", "-p", "budget=8", "-p"]
    return [
        ([*gen, "--budget", "0"], "budget"),
        ([*gen, "--budget", "-5"], "budget"),
        ([*gen, "--budget", "abc"], "--budget"),
        ([*gen, "--budget", TOO_BIG], "budget"),
        ([*gen, "-m", "streaming", "--budget", "4470000000"], "budget"),
        ([*gen, "-m", "cascade", "--budget", "4470000000"], "budget"),
        ([*gen, "-m", "snapkv", "--ratio", "0"], "ratio"),
        ([*gen, "-m", "snapkv", "--ratio", "1.5"], "ratio"),
        ([*gen, "-m", "snapkv", "--ratio", "nan"], "ratio"),
        ([*gen, "-m", "snapkv", "--ratio", "abc"], "--ratio"),
        ([*gen, "-m", "h2o", "--ratio", "0.5"], "ratio"),
        ([*gen, "-m", "magic"], "method"),
        ([*gen, "-m", "magic:budget=8"], "method"),
        ([*gen, "-m", "h2o:heavy_ratio=abc"], "heavy_ratio"),
        ([*gen, "-m", "h2o:bogus=1"], "bogus"),
        ([*gen, "-m", "h2o:budget"], "--method"),
        ([*gen, "-m", "h2o:budget=8", "-p", "budget=9"], "budget"),
        ([*gen, "-m", "h2o", "-p", "heavy_ratio=abc"], "heavy_ratio"),
        ([*gen, "-m", "h2o", "-p", "heavy_ratio=true"], "heavy_ratio"),
        ([*gen, "-m", "h2o", "-p", "heavy_ratio=1.5"], "heavy_ratio"),
        ([*nacl, "head_wise=maybe"], "head_wise"),
        ([*nacl, "temperature=inf"], "temperature"),
        ([*nacl, "temperature=0"], "temperature"),
        ([*nacl, "protect_share=abc"], "protect_share"),
        ([*nacl, "random_share=2"], "random_share"),
        ([*nacl, "seed=9223372036854775808"], "seed"),
        ([*nacl, "proxy_span=[0.5]"], "proxy_span"),
        ([*gen, "-m", "buzz", "-p", "log_n=1.5"], "log_n"),
        ([*gen, "-m", "buzz", "-p", "local_max=maybe"], "local_max"),
        ([*gen, "-m", "buzz", "-p", "stride=2"], "stride"),
        ([*gen, "-m", "buzz", "-p", "tw_ratio=nan"], "tw_ratio"),
        ([*gen, "-m", "cascade", "-p", "gamma=abc"], "gamma"),
        ([*gen, "-m", "cascade", "-p", "gamma=1"], "gamma"),
        ([*gen, "-m", "pod", "-p", "delta=nan"], "delta"),
        ([*gen, "-m", "pod", "-p", "similarity=/no/such/file.pt"], "similarity"),
        ([*gen, "-m", "pod", "-p", "block_size=2", "-p", "tau=2"], "tau"),
        ([*gen, "-m", "less", "-p", "kernels=/no/such/folder"], "kernels"),
        ([*gen, "-m", "less", "-p", "rank=100000000"], "rank"),
        ([*gen, "-m", "less", "-p", "hidden=0"], "hidden"),
        ([*gen, "-m", "scissorhands", "-p", "history=1000000000000"], "history"),
        ([*gen, "-m", "random", "-p", "seed=-1"], "seed"),
        ([*gen, "-m", "streaming", "-p", "position_mode=rank"], "position_mode"),
        ([*gen, "-m", "streaming", "-p", "sinks=1.5"], "sinks"),
        ([*gen, "-m", "streaming", "-p", "budget=4", "--budget", "8"], "budget"),
        ([*gen, "-m", "streaming", "-p", "budget=4", "-p", "budget=5"], "budget"),
        ([*gen, "-m", "streaming", "-p", "budget"], "--param"),
        ([*gen, "-m", "streaming", "-p", "nosuch=1"], "nosuch"),
        ([*gen, "-m", "snapkv", "--budget", "64", "-p", "pooling=median"], "pooling"),
        ([*gen, "-m", "snapkv", "--budget", "64", "-p", "kernel=4"], "kernel"),
        (["generate", "--file", f"{tmp}/missing.txt"], "--file"),
        (["generate", "--file", tmp], "--file"),
        (["generate", "--file", f"{tmp}/empty.txt"], "--file"),
        (["generate", "--file", f"{tmp}/latin1.txt"], "--file"),
        (["generate", ""], "prompt"),
        (["generate", "   ", "--no-chat"], "prompt"),
        (["generate"], "prompt"),
        (["generate", "hi", "--file", f"{tmp}/prompt.txt"], "prompt"),
        ([*gen, "--model", "no-such-model"], "smollm2-135m"),
        ([*gen, "--max-new-tokens", "0"], "--max-new-tokens"),
        ([*gen, "--chunk-size", "0"], "--chunk-size"),
        ([*gen, "--threads", "0"], "--threads"),
        (["eval", "summary", "--data", "/no/such/folder"], "/no/such/folder"),
        (["eval", "nosuchtask"], "task"),
        (["eval", "passkey", "--samples", "x"], "--samples"),
        (["report", tmp, "--out", f"{tmp}/report"], tmp),
        (["report"], "run_dir"),
        (["bench", "nosuch"], "benchmark"),
        (["train", "nosuch"], "trainer"),
        (["nosuchcommand"], "nosuchcommand"),
    ]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "prompt.txt").write_text("Hello")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    return tmp_path


def run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    out, err = capsys.readouterr()
    return stop.value.code, out, err


def test_at_least_40_bad_inputs_each_give_one_line_naming_the_parameter_and_exit_2(files, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the pass-through commands rename argv[0]
    cases = bad_inputs(str(files))
    assert len(cases) >= 40
    for args, named in cases:
        status, out, err = run(args, capsys)
        lines = err.strip().splitlines()
        assert status == 2, (args, status, out, err)
        assert "Traceback" not in out + err, args
        assert len(lines) == 1 and lines[0].startswith("kvcompress"), (args, err)
        assert named in lines[0] and len(lines[0]) < 400, (args, lines[0])


def test_report_without_matplotlib_names_the_install_command(files, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails as if not installed
    monkeypatch.delitem(sys.modules, "kvcompress.eval.plots", raising=False)
    monkeypatch.delattr(kvcompress.eval, "plots", raising=False)  # imported by an earlier test
    status, _, err = run(["report", str(files), "--out", str(files / "report")], capsys)
    assert status == 2 and err.count("\n") == 1
    assert 'matplotlib is not installed; it comes with pip install "kvcompress[eval]"' in err


def test_debug_shows_the_traceback_instead(capsys):
    with pytest.raises(ValueError, match="budget must be an integer in"):
        main(["--debug", "generate", "hi", "--budget", "0"])


def test_explicit_data_folder_beats_the_environment(files, capsys, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(files))  # a folder that exists
    status, _, err = run(["eval", "summary", "--data", str(files / "nowhere")], capsys)
    assert status == 2 and "nowhere" in err
    status, out, _ = run(["eval", "--help"], capsys)
    assert status == 0 and "$KVCOMPRESS_DATA" in out


def test_models_prints_whole_install_commands_at_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = run(["models"], capsys)
    assert status == 0
    for info in list_models():
        assert f"  {info.name}: {info.install_command}\n" in out
