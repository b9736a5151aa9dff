"""DuoAttention (``duo``): the head split, its files and refusals, the memory a streaming head frees, padding, and the
calibration (kvpress's on-the-fly scores) against a plain recomputation. The kept sets after every step are checked
against ``tests/references/duo_rules.py`` in ``tests/references/test_kept_sets.py``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import kvcompress
from kvcompress.generation import prefill
from kvcompress.methods.duo import DuoConfig
from kvcompress.methods.duo.patterns import (
    DuoPattern,
    kept_fraction,
    load_pattern,
    ratio_for,
    resolve_path,
    streaming_heads,
    write_pattern,
)
from kvcompress.models.testing import tiny_tokenizer
from kvcompress.train import duo_calibrate
from tests.helpers import cache_logits, duo_pattern_file


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- the head split


def test_the_lowest_scored_share_of_all_pairs_are_streaming_ties_to_the_earlier_pair():
    scores = np.array([[0.5, 0.1, 0.9], [0.1, 0.7, 0.1]])
    assert streaming_heads(scores, 0.5, None).tolist() == [[False, True, False], [True, False, True]]
    assert streaming_heads(scores, 1 / 3, None).tolist() == [[False, True, False], [True, False, False]]
    assert not streaming_heads(scores, 0.0, None).any() and streaming_heads(scores, 1.0, None).all()
    assert streaming_heads(scores, None, 0.5).tolist() == [[False, True, False], [True, False, True]]  # below t


def test_round_halves_to_even_as_kvpress():
    scores = np.arange(10, dtype=float).reshape(2, 5)
    assert streaming_heads(scores, 0.25, None).sum() == 2  # round(2.5) = 2
    assert streaming_heads(scores, 0.35, None).sum() == 4  # round(3.5) = 4


def test_ratio_for_keeps_at_most_the_share_asked():
    for tokens in (1024, 4096, 16384):
        share = ratio_for(0.5, tokens, 128, 256, 90)
        streaming = np.zeros(90, dtype=bool)
        streaming[: round(90 * share)] = True
        assert kept_fraction(streaming, tokens, 128, 256) <= 0.5
        streaming[round(90 * share) - 1] = False  # one streaming head fewer keeps more than half
        assert kept_fraction(streaming, tokens, 128, 256) > 0.5


def test_the_shipped_smollm2_pattern_is_found_by_layer_count_and_splits_half_its_heads():
    path = resolve_path(None, 30)
    assert path.name == "smollm2-135m.json"
    pattern, streaming, _ = DuoConfig().resolve(30)
    assert (pattern.layers, pattern.kv_heads, pattern.sink_size, pattern.recent_size) == (30, 3, 128, 256)
    assert int(streaming.sum()) == 45  # round(0.5 * 90)
    order = np.argsort(pattern.scores, axis=None, kind="stable")
    assert set(np.flatnonzero(streaming.reshape(-1))) == set(order[:45].tolist())


# ------------------------------------------------------------------------------------------- refusals


def test_a_model_without_a_shipped_pattern_is_refused_with_the_calibration_command(tiny_llama):
    with pytest.raises(ValueError, match=r"no shipped head pattern for a 2-layer model.*train duo-calibrate"):
        kvcompress.cache_for(tiny_llama, "duo")


def test_a_pattern_of_another_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"has 3 layers, but the model has 2.*duo-calibrate"):
        kvcompress.cache_for(tiny_llama, "duo", pattern=duo_pattern_file(3, 2))
    cache = kvcompress.cache_for(tiny_llama, "duo", pattern=duo_pattern_file(2, 3))
    with pytest.raises(ValueError, match=r"gives layer 0 3 KV heads, but the model has 2.*duo-calibrate"):
        prefill(tiny_llama, ids_of(1, 12), cache)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"head_compression_ratio": 1.5}, r"head_compression_ratio must be a number in \[0, 1\]"),
        ({"head_compression_ratio": 0.5, "threshold": 0.2}, "head_compression_ratio or threshold, not both"),
        ({"sink_size": -1}, "sink_size"),
        ({"pattern": "/nonexistent/pattern.json"}, r"pattern='/nonexistent/pattern.json' does not exist"),
    ],
)
def test_bad_parameters_are_refused_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        DuoConfig(**params)


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"scores": [[1, "x"]], "sink_size": 4, "recent_size": 8}')
    with pytest.raises(ValueError, match=r"bad.json \(a DuoAttention pattern\) is damaged.*duo-calibrate"):
        DuoConfig(pattern=str(bad))
    other = tmp_path / "other.json"
    other.write_text('{"format": "something-else", "scores": [[1]], "sink_size": 4, "recent_size": 8}')
    with pytest.raises(ValueError, match="format is 'something-else'"):
        DuoConfig(pattern=str(other))
    missing = tmp_path / "missing.json"
    missing.write_text('{"scores": [[1]]}')
    with pytest.raises(ValueError, match="no sink_size, recent_size"):
        DuoConfig(pattern=str(missing))


def test_the_authors_tsv_and_config_are_read_clipped(tmp_path, tiny_llama):
    (tmp_path / "full_attention_heads.tsv").write_text("1.2\t0.3\n-0.1\t0.6\n")
    (tmp_path / "config.json").write_text(json.dumps({"sink_size": 2, "recent_size": 3}))
    pattern = load_pattern(str(tmp_path / "full_attention_heads.tsv"))
    assert pattern.scores.tolist() == [[1.0, 0.3], [0.0, 0.6]] and (pattern.sink_size, pattern.recent_size) == (2, 3)
    cache = kvcompress.cache_for(tiny_llama, "duo", pattern=str(tmp_path / "full_attention_heads.tsv"), threshold=0.5)
    prefill(tiny_llama, ids_of(1, 20), cache)
    counts = [layer.valid.sum(-1)[0].tolist() for layer in cache.compressed_layers]
    assert counts == [[20, 5], [5, 20]]  # heads below 0.5 keep 2 sinks + 3 recent


# ------------------------------------------------------------------------------------------- memory


def test_streaming_heads_free_their_tokens_the_cache_holds_the_sum_of_the_heads(tiny_llama):
    """The ragged layer holds each head's blocks (16 tokens here): a streaming head 8 tokens in one block, a
    retrieval head its 200 in 13 blocks; the slot layout holds every head at the fullest head's count."""
    ids = ids_of(1, 200)
    params = {"pattern": duo_pattern_file(), "sink_size": 2, "recent_size": 6}
    ragged = kvcompress.cache_for(tiny_llama, "duo", **params)
    prefill(tiny_llama, ids, ragged)
    slots = kvcompress.cache_for(tiny_llama, "duo", ragged=False, **params)
    prefill(tiny_llama, ids, slots)
    token_bytes = 2 * 16 * 4  # a key and a value of 16 float32
    for layer in ragged.compressed_layers:
        counts = layer.valid.sum(-1)[0].tolist()
        assert sorted(counts) == [8, 200]
        assert layer.pool.block == 16
        assert layer.kv_nbytes() == sum(math.ceil(count / 16) * 16 for count in counts) * token_bytes
    full = 2 * 2 * 200 * token_bytes  # layers x KV heads x tokens
    assert ragged.nbytes() == 2 * (16 + 208) * token_bytes < 0.6 * full
    assert slots.nbytes() == full  # each layer has a retrieval head: the slot layout frees nothing


def test_a_padded_batch_equals_single_runs(tiny_llama):
    long, short = ids_of(1, 26, seed=3), ids_of(1, 19, seed=4)
    batch = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 7:], mask[1, 7:] = short[0], 1
    params = {"pattern": duo_pattern_file(), "sink_size": 3, "recent_size": 5}
    batch_logits, _ = cache_logits(tiny_llama, batch, kvcompress.cache_for(tiny_llama, "duo", **params), mask, 8)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "duo", **params), None, 8)
        torch.testing.assert_close(batch_logits[row], single[0], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- calibration


def plain_scores(model, windows: torch.Tensor, q_len: int) -> np.ndarray:
    """kvpress's on-the-fly score recomputed plainly in float64: hidden states by hooks on the decoder layers, RoPE
    as an explicit rotation of each (i, i + d/2) pair by ``position * inv_freq``, one loop per head."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // heads
    inv_freq = model.model.rotary_emb.inv_freq.double()
    angles = torch.arange(q_len, dtype=torch.float64)[:, None] * inv_freq[None]  # [q_len, d/2]
    cos, sin = angles.cos(), angles.sin()

    def rotate(vector: torch.Tensor) -> torch.Tensor:  # [d] -> [q_len, d]
        first, second = vector[: d // 2], vector[d // 2 :]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    totals = np.zeros((config.num_hidden_layers, kv_heads))
    inputs = {}
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        for window in windows:
            with torch.no_grad():
                model(input_ids=window[None], use_cache=False)
                for i, layer in enumerate(model.model.layers):
                    normed = layer.input_layernorm(inputs[i]).double()[0]
                    attention = layer.self_attn
                    q = (normed @ attention.q_proj.weight.double().T).view(-1, heads, d).mean(0)
                    k = (normed @ attention.k_proj.weight.double().T).view(-1, kv_heads, d).mean(0)
                    for h in range(heads):
                        keys = rotate(k[h // (heads // kv_heads)])
                        last_query = rotate(q[h])[-1]
                        weights = torch.softmax(keys @ last_query / math.sqrt(d), dim=0)
                        totals[i, h // (heads // kv_heads)] += float(weights.cumsum(0).mean()) / (heads // kv_heads)
    finally:
        for hook in hooks:
            hook.remove()
    return totals / len(windows)


def test_calibration_scores_match_a_plain_recomputation(tiny_llama):
    windows = ids_of(3, 40, seed=7)
    got = duo_calibrate.head_scores(tiny_llama, windows, q_len=24)
    np.testing.assert_allclose(got, plain_scores(tiny_llama, windows, 24), rtol=1e-5, atol=1e-6)


def test_calibrate_command_writes_a_pattern_duo_reads(tmp_path, tiny_llama):
    model_dir = tmp_path / "tiny"
    tiny_llama.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    books = tmp_path / "books"
    books.mkdir()
    (books / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "duo.json"
    duo_calibrate.main(
        ["--model", str(model_dir), "--data", str(books), "--samples", "2", "--length", "64", "--out", str(out)]
    )
    pattern = load_pattern(str(out))
    assert (pattern.layers, pattern.kv_heads, pattern.sink_size, pattern.recent_size) == (2, 2, 128, 256)
    assert pattern.meta["samples"] == 2 and pattern.meta["calibration"].startswith("kvpress")
    cache = kvcompress.cache_for(tiny_llama, "duo", pattern=str(out), sink_size=2, recent_size=4)
    prefill(tiny_llama, ids_of(1, 30), cache)
    assert sum(int(layer.valid.sum()) for layer in cache.compressed_layers) == 2 * 30 + 2 * 6


def test_a_written_pattern_round_trips(tmp_path):
    pattern = DuoPattern(np.array([[0.25, 0.5]]), 4, 16, {"model": "x"})
    loaded = load_pattern(str(write_pattern(pattern, tmp_path / "p.json")))
    assert loaded.scores.tolist() == [[0.25, 0.5]] and (loaded.sink_size, loaded.recent_size) == (4, 16)
