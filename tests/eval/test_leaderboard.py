"""The leaderboard: its table from result rows (computed here by hand), its command on a tiny model, its errors."""

from __future__ import annotations

import math

import pytest

from kvcompress.cli import main
from kvcompress.eval.configs import expand_configs
from kvcompress.eval.leaderboard import asked_for, leaderboard_rows, leaderboard_table, parse_kept, write_leaderboard
from kvcompress.eval.runner import run_eval


def _row(method, budget, sample, score, kv_bytes, prefill=1.0, decode=0.5, new=5):
    return {
        "kind": "result", "task": "ruler", "method": method, "label": method, "budget": budget, "sample": sample,
        "scores": {"score": score}, "kv_bytes": kv_bytes, "prefill_s": prefill, "decode_s": decode,
        "new_tokens": new, "info": {"subtask": "niah_single_1" if sample == "a" else "vt"},
    }  # fmt: skip


def test_rows_give_score_error_bytes_and_speed_per_method_and_kept_ratio():
    rows = [
        _row("full", None, "a", 1.0, 1000),
        _row("full", None, "b", 1.0, 2000),
        _row("knorm", 0.5, "a", 1.0, 500, prefill=2.0, decode=1.0, new=10),
        _row("knorm", 0.5, "b", 0.0, 1200, prefill=4.0, decode=1.0, new=30),
        _row("snapkv", 0.5, "a", 1.0, 400),
        _row("snapkv", 0.5, "b", 1.0, 900),
    ]
    entries = leaderboard_rows(rows, "score")
    assert [(e["method"], e["kept"]) for e in entries] == [("full", 1.0), ("snapkv", 0.5), ("knorm", 0.5)]
    knorm = entries[2]
    assert knorm["n"] == 2 and knorm["score"] == 50.0
    assert knorm["se"] == pytest.approx(math.sqrt((50**2 + 50**2) / 1 / 2))  # sample std / sqrt(n)
    assert knorm["bytes_x_full"] == pytest.approx((0.5 + 0.6) / 2)  # each sample against full's same sample
    assert knorm["prefill_s"] == 3.0 and knorm["tokens_per_s"] == 20.0  # (10 + 30) tokens / 2 s
    table = leaderboard_table(entries)
    assert "| 0.5 | knorm | 50.0 ± 50.0 | 2 | 0.55 | 3.00 | 20.0 |" in table
    assert table.splitlines()[2].startswith("| 1 | full | 100.0 ± 0.0 | 2 | 1.00 |")


def test_kept_ratios_are_checked():
    assert parse_kept("0.75, 0.5") == [0.75, 0.5]
    for bad in ("1", "0", "-0.5", "half", "0.5,,"):
        with pytest.raises(ValueError, match="--kept"):
            parse_kept(bad)


def test_leaderboard_of_a_tiny_model_is_written_with_its_plot(tmp_path, tiny):
    path = run_eval(
        "ruler", tiny, ["full", "window", "snapkv"], [0.5], samples=2, out_dir=tmp_path, progress=False,
        length=1200, tasks=("niah_single_1",), modes=("agnostic",),
    )  # fmt: skip
    report, text = write_leaderboard(path, "tiny")
    assert report == tmp_path / "leaderboard.md" and (tmp_path / "leaderboard.png").stat().st_size > 0
    assert text.count("| 0.5 |") == 2 and "| 1 | full |" in text and "niah_single_1" in text


def test_a_leaderboard_shows_only_the_rows_it_was_asked_for():
    rows = [
        {**_row("full", None, "a", 1.0, 1000), "params": {}, "seed": 0, "task_params": {"length": 1024}},
        {**_row("knorm", 0.5, "a", 1.0, 500), "params": {}, "seed": 0, "task_params": {"length": 1024}},
        {**_row("knorm", 0.25, "a", 1.0, 500), "params": {}, "seed": 0, "task_params": {"length": 1024}},
        {**_row("snapkv", 0.5, "a", 1.0, 500), "params": {}, "seed": 0, "task_params": {"length": 1024}},
        {**_row("knorm", 0.5, "b", 0.0, 500), "params": {}, "seed": 0, "task_params": {"length": 2048}},
        {**_row("knorm", 0.5, "c", 0.0, 500), "params": {}, "seed": 1, "task_params": {"length": 1024}},
    ]
    select = asked_for(expand_configs(["full", "knorm"], [0.5]), seed=0, task_params={"length": 1024})
    assert [(r["method"], r["budget"], r["sample"]) for r in rows if select(r)] == [
        ("full", None, "a"), ("knorm", 0.5, "a"),
    ]  # fmt: skip


def test_a_run_logged_to_a_file_reports_each_evaluation_on_its_own_line(tmp_path, tiny, capsys):
    run_eval("passkey", tiny, ["full", "window"], [32], samples=2, out_dir=tmp_path, length=300)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("passkey ")]
    assert [line.split(":")[0] for line in lines] == [f"passkey {i}/4" for i in range(1, 5)]
    assert "passkey-001 window budget 32 accuracy" in lines[-1] and lines[-1].endswith("~0 s left)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "stream-ppl"], "--task must be a question-answering task"),
        (["--kept", "0.5,1.5"], "--kept takes ratios in (0, 1)"),
        (["--methods", " , "], "--methods needs at least one method"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as done:
        main(["leaderboard", *args])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
