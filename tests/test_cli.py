"""The command line: generate with a compressed cache on the real model, parameter parsing, and the pass-through
commands handing --help to their module (tests/cli runs every command for real on a tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvcompress
from kvcompress.cli import app, method_params, one_line_warning
from kvcompress.eval.data import prose
from tests.helpers import needs_smollm2

runner = CliRunner()


def test_method_params_are_parsed_by_each_parameters_type():
    assert method_params("snapkv", None, 0.5, ["window=16", "pooling=avg", "budget=None"]) == (
        "snapkv",
        {"window": 16, "pooling": "avg", "budget": None, "ratio": 0.5},
    )
    assert method_params("buzz", 64, None, ["log_n=yes", "local_max=0"]) == (
        "buzz",
        {"log_n": True, "local_max": False, "budget": 64},
    )


def test_the_method_takes_the_spec_eval_and_leaderboard_take_and_a_parameter_given_twice_is_refused():
    assert method_params("snapkv:window=16, pooling=avg", None, 0.5, ["kernel=3"]) == (
        "snapkv",
        {"window": 16, "pooling": "avg", "ratio": 0.5, "kernel": 3},
    )
    assert method_params("kvzip:ragged=false;kv_bits=4", None, 0.5, []) == (
        "kvzip",
        {"ragged": False, "kv_bits": 4, "ratio": 0.5},
    )
    with pytest.raises(ValueError, match="window is given twice"):
        method_params("snapkv:window=16", None, None, ["window=8"])
    with pytest.raises(ValueError, match="ratio is given twice"):
        method_params("snapkv:ratio=0.25", None, 0.5, [])


def test_generate_rejects_bad_budget_before_loading_a_model():
    result = runner.invoke(app, ["generate", "hi", "--method", "h2o", "--budget", "0"])
    assert result.exit_code != 0
    assert "budget must be an integer in [1, " in str(result.exception)


@pytest.mark.slow
@needs_smollm2
def test_generate_streaming_256_on_4000_token_prompt_stores_256_tokens(tmp_path):
    book = prose()[0].text  # shipped with the package
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(book[:17000] + "\n\nWhat happens in the story above? Answer in two sentences.")
    args = ["generate", "--file", str(prompt), "--method", "streaming", "--budget", "256", "--max-new-tokens", "24"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    numbers = {
        key: int(value.replace(",", "")) for key, value in re.findall(r"│ ([a-zA-Z ,()]+?)\s+│ ([\d,]+)", result.output)
    }
    assert numbers["prompt tokens"] > 3900
    assert numbers["tokens stored per layer (physical)"] == 256
    bytes_per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, fp32 keys + values
    assert numbers["KV bytes stored"] == 256 * bytes_per_token
    assert numbers["KV bytes, full cache"] == numbers["tokens seen (logical)"] * bytes_per_token
    text = result.output.split("streaming on smollm2-135m")[0]
    assert len(re.findall(r"[A-Za-z]{3,}", text)) >= 5  # real words came out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["eval", "--help"], "--budgets"),
        (["report", "--help"], "--no-plots"),
        (["bench", "decode", "--help"], "--methods"),
        (["bench", "cache-op", "--help"], "--quick"),
        (["train", "less", "--help"], "--windows"),
        (["train", "pod-calibrate", "--help"], "--last-queries"),
        (["train", "pod-adapt", "--help"], "--trainable"),
    ],
)
def test_pass_through_commands_show_their_module_help(args, expected, capsys):
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    assert expected in result.output + capsys.readouterr().out


def test_unknown_benchmark_names_the_choices():
    result = runner.invoke(app, ["bench", "nope"])
    assert result.exit_code != 0
    assert "cache-op, decode, prefill" in result.output


def test_kvcompress_warnings_print_as_one_line_and_other_packages_as_python_shows_them():
    own = str(Path(kvcompress.__file__).parent / "core" / "cache.py")
    line = one_line_warning(UserWarning("less: no kernels given"), UserWarning, own, 94)
    assert line == "kvcompress: warning: less: no kernels given\n"
    other = one_line_warning(UserWarning("careful"), UserWarning, "/elsewhere/module.py", 7, "x = 1")
    assert other.startswith("/elsewhere/module.py:7: UserWarning: careful\n")
