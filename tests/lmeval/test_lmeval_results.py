"""lm-eval results files in ``kvcompress report`` (no lm-eval needed to read them)."""

from __future__ import annotations

import json

from kvcompress.eval.lmeval_results import load_lmeval
from kvcompress.eval.report import write_report


def _results(method: str | None, budget: int | None, ppl: float, kv_bytes: float | None) -> dict:
    config = {"model": "kvcompress" if method else "hf", "model_args": "pretrained=smollm2-135m,method=x"}
    if method:
        config["kvcompress"] = {"method": method, "params": {"budget": budget}, "kv_bytes_mean": kv_bytes}
    return {
        "results": {
            "kvc_wikitext": {
                "alias": "kvc_wikitext",
                "word_perplexity,none": ppl,
                "word_perplexity_stderr,none": "N/A",
                "sample_len": 3,
            }
        },
        "n-samples": {"kvc_wikitext": {"original": 62, "effective": 3}},
        "config": config,
    }


def test_report_tables_lm_eval_runs_by_method_and_budget(tmp_path):
    runs = [(None, None, 39.3497, None), ("full", None, 39.3497, 2**21), ("h2o", 64, 52.125, 2**19)]
    for i, run in enumerate(runs):
        (tmp_path / f"run{i}").mkdir()
        (tmp_path / f"run{i}" / "results_2026.json").write_text(json.dumps(_results(*run)))
    rows = load_lmeval(tmp_path)
    assert [(r["method"], r["budget"], r["n"]) for r in rows] == [("hf", None, 3), ("full", None, 3), ("h2o", 64, 3)]
    assert rows[2]["metrics"] == {"word_perplexity,none": (52.125, "N/A")}
    text = write_report(tmp_path, tmp_path / "report" / "r", plots=False).read_text()
    assert "| h2o |  | 52.1250 (3) |" in text and "| full | 39.3497 (3) |  |" in text
    assert "| h2o |  | 0.500 |" in text and "| full | 2.000 |  |" in text
