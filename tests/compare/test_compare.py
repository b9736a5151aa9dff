"""The side-by-side comparison with kvpress: kept-set agreement, reading kept sets, the ratio mapping, tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import kvcompress
from experiments.compare.agreement import compare_kept, jaccard
from experiments.compare.ours import evaluate, kept_indices
from experiments.compare.table import build_tables
from kvcompress.generation import prefill
from kvcompress.models import tiny_model, tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vs_kvpress_side.py"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return tiny_model("llama"), tiny_tokenizer()


def test_jaccard():
    assert jaccard([1, 2, 3], [2, 3, 4]) == 0.5
    assert jaccard([], []) == 1.0
    assert jaccard([5], [5]) == 1.0


def test_compare_kept_counts_identical_heads_and_differences():
    ours = [[[0, 1, 2], [0, 1, 3]], [[4, 5, 6], [0, 5, 6]]]
    theirs = [[[0, 1, 2], [0, 1, 2]], [[4, 5, 6], [0, 5, 6]]]
    result = compare_kept(ours, theirs)
    assert result.exact == 3 and result.pairs == 4
    assert result.differing == [2, 3]
    assert result.min_jaccard == pytest.approx(0.5)
    assert result.mean_jaccard == pytest.approx((1 + 0.5 + 1 + 1) / 4)


def test_compare_kept_counts_same_token_swaps():
    token_ids = [7, 8, 9, 8, 5]
    # head 0 trades index 1 for index 3 (both token 8): a same-token swap; head 1 trades 2 (token 9) for 4 (token 5)
    result = compare_kept([[[0, 1], [0, 2]]], [[[0, 3], [0, 4]]], token_ids)
    assert result.same_token_swaps == 2
    assert sorted(result.differing) == [1, 2, 3, 4]


def test_compare_kept_rejects_different_shapes():
    with pytest.raises(ValueError, match="same layers and heads"):
        compare_kept([[[0]]], [[[0]], [[1]]])


def test_kept_indices_reads_what_streaming_keeps(tiny):
    model, _ = tiny
    cache = kvcompress.cache_for(model, "streaming", budget=10, sinks=4)
    prefill(model, torch.arange(3, 33)[None], cache)
    kept = kept_indices(cache)
    assert len(kept) == model.config.num_hidden_layers
    assert all(head == [0, 1, 2, 3, *range(24, 30)] for layer in kept for head in layer)


def _load_side_script():
    spec = importlib.util.spec_from_file_location("vs_kvpress_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("k_len", [100, 937, 1000, 1013, 4099])
def test_kvpress_ratio_keeps_exactly_the_budget(k_len):
    side = _load_side_script()
    for budget in (1, 7, 64, 99, 128, 256, 512):
        if budget >= k_len:
            continue
        ratio = side.kvpress_ratio(budget, k_len)
        # kvpress.utils.compute_n_kept and StreamingLLMPress both keep int(k_len * (1 - ratio)) tokens
        assert max(1, int(k_len * (1 - ratio))) == budget
        assert 0 <= ratio < 1


def test_kvpress_ratio_rejects_budget_outside_context():
    side = _load_side_script()
    with pytest.raises(ValueError, match="budget must be in"):
        side.kvpress_ratio(100, 100)


def test_report_from_both_sides(tiny, tmp_path):
    model, tokenizer = tiny
    context = list(range(3, 43))
    sample = {"id": "s0", "context_ids": context, "question_ids": [5, 6, 7], "answers": ["zz"], "max_new_tokens": 3}
    spec = {
        "model": "tiny",
        "model_dir": "",
        "seed": 0,
        "length": 64,
        "subtask": "single",
        "budgets": [12],
        "samples": [sample],
    }
    (tmp_path / "samples.json").write_text(json.dumps(spec))
    ours = evaluate(model, tokenizer, sample, "streaming", 12)
    assert ours["stored"] == 12
    theirs = dict(ours, side="kvpress", method="StreamingLLMPress", prediction="zz")
    # their head 0 of layer 0 keeps one different token
    theirs["kept"] = json.loads(json.dumps(ours["kept"]))
    theirs["kept"][0][0] = [*theirs["kept"][0][0][:-1], 20]
    (tmp_path / "kvcompress.jsonl").write_text(json.dumps(ours) + "\n")
    (tmp_path / "kvpress.jsonl").write_text(json.dumps(theirs) + "\n")
    text = build_tables(tmp_path)
    pairs = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert "| `streaming` | StreamingLLMPress | 12 | 1 | 0.00 | 1.00 | 0/1 |" in text
    assert f"{pairs - 1}/{pairs}" in text
