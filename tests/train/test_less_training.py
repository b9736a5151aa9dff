"""LESS kernel training: beats the sparse baseline on a tiny model, resumes layer by layer deterministically, refuses
mixed settings and the evaluation split, and its output loads as a cache's kernels."""

from __future__ import annotations

import hashlib

import pytest
import torch

import kvcompress
from kvcompress.methods.less import LessConfig
from kvcompress.methods.less.kernels import layer_file, load_kernels, load_layer
from kvcompress.models import tiny_tokenizer
from kvcompress.train.less import train_less
from kvcompress.train.less_data import budget_tokens
from tests.helpers import cache_logits

TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
    "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. "
)


def train(model, tmp_path, **overrides):
    (tmp_path / "book.txt").write_text(TEXT * 40)
    params = dict(tokenizer=tiny_tokenizer(), window=64, windows=12, epochs=4, hidden=16, progress=False)
    params.update(overrides)
    return train_less(model, "h2o", 16, [tmp_path / "book.txt"], tmp_path / "kernels", **params)


def test_training_beats_the_sparse_baseline_and_resumes_layer_by_layer(tiny_llama, tmp_path):
    out = train(tiny_llama, tmp_path)
    records = [load_layer(out, i)[1] for i in range(2)]
    for record in records:
        assert record["best_val_mse"] < record["baseline_val_mse"]
        assert len(record["history"]) == 4 and record["loss_start"] == 17  # budget 16 + the current token
        assert record["train_tokens"] == record["train_windows"] * 64
    assert not (out / "activations").exists()  # removed once every layer is done
    first = layer_file(out, 0).stat().st_mtime_ns
    kept = load_layer(out, 1)[0].state_dict()
    layer_file(out, 1).unlink()  # as if the run had stopped after layer 0
    train(tiny_llama, tmp_path)
    assert layer_file(out, 0).stat().st_mtime_ns == first  # finished layers are not retrained
    again = load_layer(out, 1)[0].state_dict()
    for name, tensor in kept.items():
        assert torch.equal(again[name], tensor), name  # fixed seeds: the same kernels


def test_trained_kernels_load_into_a_cache(tiny_llama, tmp_path):
    out = train(tiny_llama, tmp_path, epochs=1)
    kernels = load_kernels(out)
    assert kernels.meta["base"]["budget"] == 16 and kernels.meta["training"]["windows"] == 12
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=16, kernels=str(out)))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cache_logits(tiny_llama, ids, cache, new_tokens=4)
    assert bool(cache.compressed_layers[0].low_rank[..., -1].any())


def test_other_settings_in_the_same_directory_are_refused(tiny_llama, tmp_path):
    train(tiny_llama, tmp_path, epochs=1)
    with pytest.raises(ValueError, match="other settings"):
        train(tiny_llama, tmp_path, epochs=2)


def test_resuming_takes_the_same_texts_moved_and_refuses_changed_ones(tiny_llama, tmp_path):
    out = train(tiny_llama, tmp_path, epochs=1)
    digest = hashlib.sha256((TEXT * 40).encode()).hexdigest()
    assert load_kernels(out).meta["training"]["data"] == [{"name": "book.txt", "sha256": digest}]  # no path
    moved = tmp_path / "elsewhere" / "book.txt"
    moved.parent.mkdir()
    moved.write_text(TEXT * 40)
    layer_file(out, 1).unlink()
    params = dict(tokenizer=tiny_tokenizer(), window=64, windows=12, epochs=1, hidden=16, progress=False)
    train_less(tiny_llama, "h2o", 16, [moved], out, **params)
    assert layer_file(out, 1).is_file()
    moved.write_text(TEXT * 41)
    with pytest.raises(ValueError, match="training differ"):
        train_less(tiny_llama, "h2o", 16, [moved], out, **params)


def test_wikitext_test_split_is_never_used_for_training(tiny_llama, tmp_path):
    test_file = tmp_path / "wikitext-2" / "test.txt"
    test_file.parent.mkdir()
    test_file.write_text(TEXT * 40)
    with pytest.raises(ValueError, match="never train on it"):
        train_less(tiny_llama, "h2o", 16, [test_file], tmp_path / "k", tokenizer=tiny_tokenizer(), window=64)


def test_budget_shares_of_the_window():
    assert budget_tokens(0.1, 512, "h2o") == 50
    assert budget_tokens(0.05, 512, "h2o") == 24
    assert budget_tokens(0.2, 512, "h2o") == 102
    assert budget_tokens(0.1, 512, "streaming") == 51
    assert budget_tokens(50, 512, "h2o") == 50
    for bad in (0, -1, 512, True):
        with pytest.raises(ValueError, match="budget"):
            budget_tokens(bad, 512, "h2o")
