"""The report's summary (one line per method and budget: scores with standard errors, KV bytes and time beside
the full cache's), its printed digest and the side-by-side plot of the task's ``plot_metrics``."""

from __future__ import annotations

import json

from kvcompress.eval.report import main, summary_table, write_report
from tests.helpers import result_row


def _row(method, budget, sample, accuracy, nll, kv_mib, seconds):
    scores = {"accuracy": accuracy, "answer_nll": nll}
    return result_row(method, budget, sample, scores, kv_bytes=int(kv_mib * 2**20), time_s=seconds, cpu_s=seconds / 2)


def _rows():
    rows = [_row("full", None, f"s{i}", 1.0, 0.1 * (i + 1), 8.0, 2.0 + i) for i in range(3)]
    rows += [_row("h2o", 64, f"s{i}", float(i == 0), 2.0 + i, 1.0, 1.0 + i) for i in range(3)]
    return rows


def test_summary_lines_hold_scores_with_errors_and_ratios_to_full():
    lines = summary_table(_rows(), ["accuracy", "answer_nll"]).splitlines()
    assert lines[0] == (
        "| method | budget | n | accuracy (higher is better) | answer_nll (lower is better) "
        "| KV MiB | × full | s/sample | CPU s | × full |"
    )
    # full: nll 0.1, 0.2, 0.3 -> mean 0.2, se 0.1/sqrt(3) = 0.058; time median 3.0 (2.0-4.0), CPU median 1.5
    full = "| full | no limit | 3 | 1.000 ± 0.000 | 0.20 ± 0.06 | 8.00 | 1.00 | 3.00 (2.00–4.00) | 1.50 | 1.00 |"
    assert lines[2] == full
    # h2o: accuracy 1/3 ± 0.333, nll 3.0 ± 0.58, KV 1/8 of full, time median 2.0 / 3.0
    assert lines[3] == "| h2o | 64 | 3 | 0.333 ± 0.333 | 3.00 ± 0.58 | 1.00 | 0.12 | 2.00 (1.00–3.00) | 1.00 | 0.67 |"


def test_report_prints_the_digest_and_draws_both_metrics_in_one_plot(tmp_path, capsys):
    (tmp_path / "passkey.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert main([str(tmp_path), "--out", str(tmp_path / "out" / "report"), "--summary"]) == 0
    printed = capsys.readouterr().out
    png = tmp_path / "out" / "report-passkey-aware-accuracy-answer_nll-vs-budget.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert f"plot: {png}" in printed
    assert "| h2o | 64 | 3 | 0.333 ± 0.333 | 3.00 ± 0.58 |" in printed
    assert "## passkey (aware)" in printed and "**answer_nll** (lower is better)" not in printed  # the short version
    md = write_report(tmp_path, tmp_path / "again", plots=False).read_text()
    assert "**answer_nll** (lower is better)" in md and "| h2o | 64 | 3 | 0.333 ± 0.333 |" in md
