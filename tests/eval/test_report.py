from __future__ import annotations

import json
import math

import pytest

from kvcompress.eval.plots import running_ppl
from kvcompress.eval.report import mean_se, write_report
from tests.helpers import result_row


def _row(method, budget, sample, **scores):
    return result_row(method, budget, sample, scores)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_mean_and_standard_error():
    assert mean_se([1.0, 0.0, 1.0, 0.0]) == (0.5, pytest.approx(math.sqrt(1 / 3 / 4)))
    assert mean_se([2.0]) == (2.0, None)


def test_report_table_has_the_right_means_and_counts(tmp_path):
    env = {"kind": "environment", "cpu": "Test CPU", "cpu_count": 2, "torch_threads": 1}
    rows = [env]
    rows += [_row("full", None, f"s{i}", accuracy=1.0) for i in range(2)]
    rows += [_row("window", 64, f"s{i}", accuracy=float(i % 2)) for i in range(4)]
    rows += [_row("window", 128, f"s{i}", accuracy=1.0) for i in range(3)]
    rows += [_row("h2o", 64, "s0", accuracy=0.25)]
    _write(tmp_path / "passkey.jsonl", rows)
    md = write_report(tmp_path, tmp_path / "out" / "report").read_text()
    lines = md.splitlines()
    header = lines.index("| method | no limit | 64 | 128 |")
    assert lines[header + 2] == "| full | 1.000 ± 0.000 (2) |  |  |"
    assert lines[header + 3] == "| window |  | 0.500 ± 0.289 (4) | 1.000 ± 0.000 (3) |"
    assert lines[header + 4] == "| h2o |  | 0.250 (1) |  |"
    assert "Test CPU" in md
    assert "| window |  | 64 (4) | 128 (3) |" in md  # stored tokens per layer
    png = tmp_path / "out" / "report-passkey-aware-accuracy-vs-budget.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert f"]({png.name})" in md


def test_report_groups_modes_separately_and_breaks_niah_down_by_subtask(tmp_path):
    rows = []
    for mode, value in (("agnostic", 0.0), ("aware", 1.0)):
        for sub in ("single", "vt"):
            row = _row("snapkv", 64, f"niah-{sub}", score=value)
            row.update(task="niah", mode=mode, info={"subtask": sub})
            rows.append(row)
    _write(tmp_path / "niah.jsonl", rows)
    md = write_report(tmp_path, tmp_path / "r", plots=False).read_text()
    assert "## niah (agnostic)" in md and "## niah (aware)" in md
    agnostic, aware = md.split("## niah (aware)")
    assert "| snapkv | 0.000 ± 0.000 (2) |" in agnostic and "| snapkv | 1.000 ± 0.000 (2) |" in aware
    assert "| snapkv | 64 | 1.00 (1) | 1.00 (1) |" in aware


def test_running_ppl_pools_streams_and_accumulates():
    rows = [
        {"task_params": {"bin": 2, "length": 5}, "extra": {"nll_bins": [1.0, 3.0]}},
        {"task_params": {"bin": 2, "length": 5}, "extra": {"nll_bins": [3.0, 1.0]}},
    ]
    xs, ys = running_ppl(rows)
    assert xs == [2, 4]
    assert ys == pytest.approx([math.exp(2.0), math.exp(2.0)])


def test_rows_with_other_task_parameters_are_not_averaged_together(tmp_path):
    short = [_row("window", 64, "s0", accuracy=1.0)]
    long = [_row("window", 64, "s0", accuracy=0.0)]
    long[0]["task_params"] = {"length": 4096}
    _write(tmp_path / "passkey.jsonl", short + long)
    md = write_report(tmp_path, tmp_path / "r", plots=False).read_text()
    assert "## passkey (aware)\n" in md and "## passkey (aware) [parameter set 2]" in md
    assert "| window | 1.000 (1) |" in md and "| window | 0.000 (1) |" in md
    assert "0.500" not in md
