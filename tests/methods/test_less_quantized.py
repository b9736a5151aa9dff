"""LESS over quantized slots (``kv_bits`` below 16, issue 49): the layer, equivalence with the quantized full cache
when nothing is evicted, logits within the quantization noise of the 16-bit method, the state folded from what
attention read, and the bytes."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

import kvcompress
from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import StatsRequest
from kvcompress.core.quantized_slots import QuantizedSlotBuffers
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.less import LessConfig
from kvcompress.methods.less.layer import LessLayer, LessQuantizedLayer
from kvcompress.models.testing import tiny_model
from tests.methods.test_less import strong_kernels
from tests.test_quantized import forced_logits, token_ids

QUANT = {"kv_group": 8, "kv_residual": 16}


def less(model, budget: int, **storage) -> LessConfig:
    return LessConfig(base="h2o", budget=budget, kernels=strong_kernels(model), **storage)


def test_kv_bits_picks_the_quantized_less_layer():
    model = tiny_model()
    assert all(type(layer) is LessLayer for layer in kvcompress.cache_for(model, less(model, 24)).layers)
    cache = kvcompress.cache_for(model, less(model, 24, kv_bits=4, **QUANT))
    assert all(type(layer) is LessQuantizedLayer for layer in cache.layers)
    cache = kvcompress.cache_for(model, "less", base="h2o", budget=24, kv_bits=8, kv_group=8, kv_residual=8)
    assert all(type(layer) is LessQuantizedLayer for layer in cache.layers)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [8, 4])
def test_nothing_evicted_equals_the_quantized_full_cache(kind, bits):
    """A budget above the sequence: nothing is folded, LESS is its base policy over the same quantized storage, so
    its logits are the quantized full cache's (the tolerance of ``test_full_quantized_equals_reference``)."""
    model = tiny_model(kind)
    ids = token_ids(2, 70)
    full = forced_logits(model, ids, kvcompress.cache_for(model, "full", kv_bits=bits, **QUANT), 37)
    cache = kvcompress.cache_for(model, less(model, 512, kv_bits=bits, **QUANT))
    ours = forced_logits(model, ids, cache, 37)
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-4)
    assert not any(layer.folded for layer in cache.layers)


@pytest.mark.parametrize("bits", [8, 4])
def test_evicting_stays_within_the_quantization_noise_of_the_16_bit_method(bits):
    """H2O evicting at 24 tokens with strong kernels (the state takes a large share): LESS at ``bits`` differs from
    LESS at 16 bits by no more than twice the quantization noise of the full cache at the same bits (the bound
    ``test_within_quantization_noise_of_transformers_quantized_cache`` uses); it keeps as many tokens, and
    something was folded."""
    model = tiny_model()
    ids = token_ids(2, 70)
    exact = forced_logits(model, ids, DynamicCache(config=model.config), 30)
    quantized = forced_logits(model, ids, kvcompress.cache_for(model, "full", kv_bits=bits, **QUANT), 30)
    noise = float((quantized - exact).abs().max())
    assert noise > 1e-3
    plain = kvcompress.cache_for(model, less(model, 24))
    cache = kvcompress.cache_for(model, less(model, 24, kv_bits=bits, **QUANT))
    expected, ours = forced_logits(model, ids, plain, 30), forced_logits(model, ids, cache, 30)
    assert float((ours - expected).abs().max()) <= 2 * noise
    assert cache.tokens_stored() == plain.tokens_stored()
    assert all(layer.folded and bool(layer.low_rank[..., -1].any()) for layer in cache.layers)


def test_the_state_folds_what_attention_read(monkeypatch):
    """Every forward (a prompt in chunks, then decoding at the budget) adds to ``H`` exactly ``ψ(k)ᵀ v`` of the
    tokens it evicted, ``k`` and ``v`` as attention read them (the layer's dequantized keys and values at the
    moment of eviction, exact in the residual window): the same direct sum as
    ``test_state_equals_direct_sum_over_evicted_tokens``, over the quantized cache's reading."""
    model = tiny_model()
    ids = token_ids(1, 60, seed=2)
    cache = kvcompress.cache_for(model, less(model, 20, kv_bits=4, kv_group=8, kv_residual=8))
    records = []
    before_eviction = LessLayer.before_eviction

    def recording(layer, victims, dropped):
        keys, values = layer.keys.clone(), layer.values.clone()
        evicted = dropped.clone() if victims is None else torch.zeros_like(layer.valid).scatter_(2, victims, True)
        records.append((layer, keys, values, evicted & layer.valid))
        before_eviction(layer, victims, dropped)

    monkeypatch.setattr(LessLayer, "before_eviction", recording)
    states = [torch.zeros_like(layer.low_rank[..., :-1]) if layer.is_initialized else None for layer in cache.layers]
    folds = 0
    with torch.no_grad():
        for start, stop in [(0, 16), (16, 32), *[(t, t + 1) for t in range(32, 60)]]:
            records.clear()
            model(ids[:, start:stop], **cache_argument(model, cache), use_cache=True)
            for index, layer in enumerate(cache.layers):
                expected = torch.zeros_like(layer.low_rank[..., :-1]) if states[index] is None else states[index]
                for owner, keys, values, evicted in records:
                    if owner is layer:
                        psi = layer.policy.kernels.psi(keys) * evicted[..., None]  # [B, H_kv, W, R]
                        expected = expected + psi.transpose(2, 3) @ values
                        folds += 1
                torch.testing.assert_close(layer.low_rank[..., :-1], expected, rtol=1e-4, atol=1e-5)
                states[index] = layer.low_rank[..., :-1].clone()
    assert folds > 28 * len(cache.layers)


def test_bytes_are_the_quantized_slots_plus_the_state():
    """``nbytes()``: the quantized slot layer's bytes (codes, value and key-group scales and minima, the exact
    residual window; ``test_bytes_are_codes_scales_and_the_residual``) plus ``H`` (float32, ``R`` x ``D`` per KV
    head), ``z`` with the metadata: below the 16-bit LESS cache's by the storage's factor."""
    model = tiny_model()  # 2 layers, 2 KV heads, head_dim 16, float32; LESS's rank 8
    ids = token_ids(1, 70)
    budget, heads, dim, rank = 48, 2, 16, 8
    cache = kvcompress.cache_for(model, less(model, budget, kv_bits=4, kv_group=8, kv_residual=16))
    plain = kvcompress.cache_for(model, less(model, budget))
    forced_logits(model, ids, cache, 40)
    forced_logits(model, ids, plain, 40)
    assert cache.tokens_stored() == plain.tokens_stored() == [budget, budget]  # per layer
    codes = 2 * budget * heads * dim // 2  # keys and values, two codes a byte
    value_params = 2 * budget * heads * (dim // 8) * 4  # scale and minimum per token and channel group
    key_params = 2 * (budget // 8) * heads * dim * 4  # scale and minimum per key group and channel
    residual = 2 * 16 * heads * dim * 4  # exact keys and values of the newest 16 tokens
    state = heads * rank * dim * 4  # H
    assert cache.nbytes() == 2 * (codes + value_params + key_params + residual + state)
    exact = 2 * (2 * budget * heads * dim * 4 + state)
    assert plain.nbytes() == exact
    assert cache.nbytes() < plain.nbytes() and cache.nbytes() <= cache.allocated_nbytes()
    # without the residual window a stored token's key and value take 48 bytes per KV head instead of 128 (codes
    # 16, value parameters 16, its share of the key group's 16): the slots' bytes fall by 0.375, the state stays
    bare = kvcompress.cache_for(model, less(model, budget, kv_bits=4, kv_group=8, kv_residual=0))
    forced_logits(model, ids, bare, 40)
    assert bare.nbytes() - 2 * state == 0.375 * (plain.nbytes() - 2 * state)


@pytest.mark.parametrize("base", ["h2o", "tova"])
def test_attention_from_codes_equals_less_over_the_dequantized_view(monkeypatch, base):
    """With no gradient the layer reads the codes (the sparse part from ``core.quantized_attention``, then Eq. 3 by
    its log-normaliser): at every forward and layer (a prompt in chunks, decoding at the budget, a chunk of another
    size) its output and statistics equal LESS's own attention over the dequantized view of the same slots (the
    16-bit layer's arithmetic: one softmax over the stored keys and the state's rows at a decoding step), to the
    1e-5 of ``test_decoding_step_from_codes_equals_the_dequantized_view``; and no dequantized view is built."""
    from_codes = LessQuantizedLayer.attend
    checked = []

    def attend(layer, query, key, value, mask, scaling):
        result = from_codes(layer, query, key, value, mask, scaling)
        if layer._reads_codes:
            keys, values = view(layer.slots, layer.view_width)
            expected = layer.policy.attend(layer, query, keys, values, mask, scaling)
            if expected is None:  # nothing folded: the default attention
                request = layer.policy.stats if layer.policy.wants_stats(layer) else StatsRequest()
                expected = layer_attention(query, keys, values, mask, scaling, request, None)
            torch.testing.assert_close(result[0], expected[0], rtol=1e-5, atol=1e-5)
            assert (result[1] is None) == (expected[1] is None)
            for name in ("received", "last"):  # (H2O's statistic, TOVA's)
                if expected[1] is not None and getattr(expected[1], name) is not None:
                    torch.testing.assert_close(
                        getattr(result[1], name), getattr(expected[1], name), rtol=1e-5, atol=1e-6
                    )
            checked.append(layer.folded)
        return result

    view = QuantizedSlotBuffers.view
    built = []
    monkeypatch.setattr(QuantizedSlotBuffers, "view", lambda slots, width: built.append(width))
    monkeypatch.setattr(LessQuantizedLayer, "attend", attend)
    model = tiny_model()
    ids = token_ids(2, 60, seed=7)
    config = LessConfig(base=base, budget=24, kernels=strong_kernels(model), kv_bits=4, kv_group=8, kv_residual=8)
    cache = kvcompress.cache_for(model, config)
    with torch.no_grad():
        prefill(model, ids[:, :39], cache, chunk_size=13)
        for step in range(39, 50):
            model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True)
        model(ids[:, 50:57], **cache_argument(model, cache), use_cache=True)
    assert len(checked) == 15 * len(cache.layers) and any(checked) and not all(checked)
    assert built == []


def test_the_evicted_tokens_are_read_as_the_view_reads_them(monkeypatch):
    """The tokens LESS folds at its eviction are read from the codes (``read_slots``: ``QuantizedSlotBuffers.read_at``
    with the residual window's slots the step's attention found) bit for bit as the dequantized view reads them, at
    every forward and layer: a prompt in chunks, then decoding at the budget (the window's slots from the attention,
    which evictions inside the window exercise: a budget barely above the window)."""
    read_slots = LessQuantizedLayer.read_slots
    reads = []

    def checked(layer, index):
        keys, values = read_slots(layer, index)
        view_keys, view_values = layer.slots.view(layer.view_width)
        assert torch.equal(keys, view_keys.gather(2, index[..., None].expand(*index.shape, keys.shape[-1])))
        assert torch.equal(values, view_values.gather(2, index[..., None].expand(*index.shape, values.shape[-1])))
        reads.append(layer._ring_read is not None)
        return keys, values

    monkeypatch.setattr(LessQuantizedLayer, "read_slots", checked)
    model = tiny_model()
    ids = token_ids(2, 60, seed=4)
    cache = kvcompress.cache_for(model, less(model, 20, kv_bits=4, kv_group=8, kv_residual=16))
    with torch.no_grad():
        prefill(model, ids[:, :32], cache, chunk_size=16)
        for step in range(32, 60):
            model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True)
    assert reads.count(True) == 28 * len(cache.layers) and not all(reads)
