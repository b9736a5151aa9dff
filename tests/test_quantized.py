"""Quantized storage (``kv_bits``, issue 49): KIVI's arithmetic, the reference without eviction, eviction in place,
bytes, errors; and transformers' ``QuantizedCache`` (quanto backend) where optimum-quanto is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers.cache_utils import DynamicCache

import kvcompress
from kvcompress.core import quantized_attention, quantized_slots
from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import StatsRequest
from kvcompress.core.kivi import dequantize_keys, dequantize_values, pack, quantize_keys, quantize_values, unpack
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.quantized_layer import QuantizedLayer, quantized_layer_class
from kvcompress.generation import cache_argument, prefill
from kvcompress.models.testing import tiny_model
from kvcompress.registry import make_config
from tests.helpers import tiny_tokenizer_dir
from tests.references.kivi import KiviReferenceCache, minmax_roundtrip


def forced_logits(model, ids: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    """Logits of every position from ``prompt - 1`` on: the prompt in one forward, then one token per forward."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], **cache_argument(model, cache), use_cache=True).logits[:, -1]]
        for step in range(prompt, ids.shape[1]):
            out.append(model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- arithmetic ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 16 * bits // 8 and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantizers_match_the_reference_arithmetic(bits, dtype):
    x = (torch.randn(2, 3, 4, 8, 16) * 3).to(dtype)  # [..., n groups, G tokens, d]
    codes, scale, low = quantize_keys(x, bits)
    keys = dequantize_keys(codes, scale, low, bits)
    assert keys.dtype == dtype
    expected = minmax_roundtrip(x, bits, dim=-2)
    # the reference rounds ``code * scale`` and ``+ min`` apart, ``addcmul`` once: one unit in the dtype's last place
    ulp = 2 * torch.finfo(dtype).eps * float(x.float().abs().max())
    torch.testing.assert_close(keys, expected, rtol=0, atol=ulp)
    assert float((keys.float() - x.float()).abs().max()) <= float(scale.float().max()) * 0.5 + ulp
    values = x.flatten(-3, -2)  # [..., tokens, d]: per token, channel groups of 8
    codes, scale, low = quantize_values(values, bits, 8)
    read = dequantize_values(codes, scale, low, bits)
    expected = minmax_roundtrip(values.unflatten(-1, (2, 8)), bits, dim=-1).flatten(-2)
    torch.testing.assert_close(read, expected, rtol=0, atol=ulp)


def test_constant_group_reads_back_exactly():
    x = torch.full((1, 1, 1, 4, 8), 0.37)
    codes, scale, low = quantize_keys(x, 4)
    assert float(scale.abs().max()) == 0 and torch.equal(dequantize_keys(codes, scale, low, 4), x)


# --- against the reference, no eviction ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("bits,group,residual", [(8, 8, 16), (4, 8, 16), (4, 16, 16), (2, 4, 8)])
def test_full_quantized_equals_reference(kind, bits, group, residual):
    """Prompt in one forward (its attention exact), then decoding: logits of every step match the independent
    reference of KIVI's arithmetic (and differ from the full-precision cache's: quantization happened)."""
    model = tiny_model(kind)
    ids = token_ids(2, 70)
    cache = kvcompress.cache_for(model, "full", kv_bits=bits, kv_group=group, kv_residual=residual)
    ours = forced_logits(model, ids, cache, 37)
    reference = forced_logits(model, ids, KiviReferenceCache(2, bits, group, residual), 37)
    exact = forced_logits(model, ids, DynamicCache(config=model.config), 37)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours[:, 0], exact[:, 0], rtol=1e-5, atol=1e-5)  # the prompt's own forward: exact
    assert float((ours - exact).abs().max()) > 1e-3


@pytest.mark.parametrize("seal_block", [None, 8, 24])
def test_chunked_prompt_equals_reference(monkeypatch, seal_block):
    """A prompt in chunks: each chunk reads the earlier chunks as stored (quantized beyond the residual window);
    sealed every group at once or ``seal_block`` slots at a time (one and three key groups here)."""
    if seal_block is not None:
        monkeypatch.setattr(quantized_slots, "SEAL_BLOCK", seal_block)
    model = tiny_model()
    ids = token_ids(1, 60, seed=3)
    cache = kvcompress.cache_for(model, "full", kv_bits=4, kv_group=8, kv_residual=16)
    reference = KiviReferenceCache(2, 4, 8, 16)
    with torch.no_grad():
        for start in (0, 24, 48):
            ours = model(ids[:, start : start + 24], **cache_argument(model, cache), use_cache=True).logits
            theirs = model(ids[:, start : start + 24], **cache_argument(model, reference), use_cache=True).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_sealing_a_block_at_a_time_is_sealing_every_group(monkeypatch):
    """H2O evicting while a prompt goes in chunks, then decoding: the same logits, bit for bit, whether a forward
    of several tokens seals its layer's key groups all at once or one group at a time (each group is quantized
    on its own; the blocks only bound the float copies sealing takes)."""
    model = tiny_model()
    ids = token_ids(2, 70, seed=4)

    def run() -> torch.Tensor:
        cache = kvcompress.cache_for(model, "h2o", budget=24, kv_bits=4, kv_group=8, kv_residual=8)
        with torch.no_grad():
            prefill(model, ids[:, :50], cache, chunk_size=12)
            return torch.stack(
                [
                    model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True).logits[:, -1]
                    for step in range(50, 70)
                ]
            )

    whole = run()
    monkeypatch.setattr(quantized_slots, "SEAL_BLOCK", 8)
    assert torch.equal(run(), whole)


@pytest.mark.parametrize("method,params", [("h2o", {"budget": 24}), ("snapkv", {"ratio": 0.5, "window": 4})])
def test_compaction_quantizes_what_attention_read(monkeypatch, method, params):
    """A compaction (H2O evicting after each prompt chunk and after a forward of another size on a holed layer;
    SnapKV's one-shot compression) forms the key groups anew, a block at a time, from what attention read: the
    codes and key-group parameters are those of the dequantized view taken just before, put in stream order and
    quantized (bit for bit, for every occupied slot), and the values' codes move with their slots."""
    monkeypatch.setattr(quantized_slots, "SEAL_BLOCK", 16)  # two key groups a block
    compactions = []
    compact = quantized_slots.QuantizedSlotBuffers.compact

    def checked(slots, width, ordered, shrink, used=None):
        keys, values = (tensor.clone() for tensor in slots.view(width))
        before = slots.token_idx[:, :, :width].clone()
        value_codes = slots.values[:, :, :width].clone()
        used, ragged = compact(slots, width, ordered, shrink, used)
        after = slots.token_idx[:, :, :used]
        occupied = after >= 0
        source = (after[..., None] == before[:, :, None, :]).float().argmax(-1)  # each token's former slot
        expected = torch.where(occupied[..., None], _gather(keys, source), 0.0)
        count = -(-used // slots.group)
        padded = torch.zeros(*expected.shape[:2], count * slots.group, expected.shape[-1])
        padded[:, :, :used] = expected
        grid = (slots.token_idx[:, :, : count * slots.group] >= 0).unflatten(2, (count, slots.group))
        codes, scale, low = quantize_keys(padded.unflatten(2, (count, slots.group)), slots.bits, grid)
        stored = slots.keys[:, :, :used]
        assert torch.equal(stored[occupied], codes.flatten(2, 3)[:, :, :used][occupied])
        assert torch.equal(slots.key_scale[:, :, :count], scale) and torch.equal(slots.key_min[:, :, :count], low)
        assert torch.equal(slots.values[:, :, :used][occupied], _gather(value_codes, source)[occupied])
        compactions.append(used)
        return used, ragged

    monkeypatch.setattr(quantized_slots.QuantizedSlotBuffers, "compact", checked)
    model = tiny_model()
    ids = token_ids(2, 70, seed=8)
    cache = kvcompress.cache_for(model, method, kv_bits=4, kv_group=8, kv_residual=8, **params)
    with torch.no_grad():
        prefill(model, ids[:, :48], cache, chunk_size=12)
        for step in range(48, 53):
            model(ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True)
        model(ids[:, 53:60], **cache_argument(model, cache), use_cache=True)
    assert len(compactions) >= (4 if method == "h2o" else 1) * len(cache.layers)


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor.gather(2, index[..., None].expand(*index.shape, tensor.shape[-1]))


def test_kv_bits_16_is_the_full_precision_layer():
    model = tiny_model()
    ids = token_ids(2, 40)
    cache = kvcompress.cache_for(model, "h2o", budget=24, kv_bits=16)
    assert all(type(layer) is CompressedLayer for layer in cache.layers)
    plain = forced_logits(model, ids, kvcompress.cache_for(model, "h2o", budget=24), 20)
    assert torch.equal(forced_logits(model, ids, cache, 20), plain)


def compare_codes_path_with_view(monkeypatch, queries: int = 1) -> list[bool]:
    """Wrap ``QuantizedLayer.attend``: each forward of ``queries`` tokens that reads the codes is compared with the
    default attention over the dequantized view of the same slots under the same mask (output and statistics;
    ``queries=0``: forwards of any size); the returned list gets one entry per compared forward: whether the mask
    hid any slot (a plain causal chunk, mask ``None``, counts as hiding). A forward of several tokens is also
    compared asking for every statistic (mass received, the last 3 rows, the log-normalisers)."""
    checked: list[bool] = []
    from_codes = QuantizedLayer.attend

    def attend(layer, query, key, value, mask, scaling):
        result = from_codes(layer, query, key, value, mask, scaling)
        if layer._reads_codes and queries in (0, query.shape[2]):
            request = layer.policy.stats if layer.policy.wants_stats(layer) else StatsRequest()
            compare_with_view(layer, query, mask, scaling, request, result)
            if query.shape[2] > 1:
                every = StatsRequest(received=True, last_queries=3, lse=True)
                compare_with_view(layer, query, mask, scaling, every, layer.attend_codes(query, mask, scaling, every))
            checked.append(mask is None and query.shape[2] > 1 or mask is not None and not bool(mask.all()))
        return result

    monkeypatch.setattr(QuantizedLayer, "attend", attend)
    return checked


def compare_with_view(layer, query, mask, scaling, request, result) -> None:
    """``result`` (output, statistics) equal to the default attention over the layer's dequantized view."""
    output, stats = result
    keys, values = layer.slots.view(layer.view_width)
    expected, expected_stats = layer_attention(query, keys, values, mask, scaling, request, None)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    if request.received:
        torch.testing.assert_close(stats.received, expected_stats.received, rtol=1e-5, atol=1e-6)
    if request.last_queries:
        torch.testing.assert_close(stats.last, expected_stats.last, rtol=1e-5, atol=1e-6)
        if expected_stats.last_visible is None:
            assert stats.last_visible is None
        else:
            assert torch.equal(stats.last_visible.expand_as(expected_stats.last_visible), expected_stats.last_visible)
    if request.lse:
        torch.testing.assert_close(stats.lse, expected_stats.lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "method,params,bits,residual",
    [("full", {}, 4, 16), ("h2o", {"budget": 24}, 4, 8), ("h2o", {"budget": 24}, 2, 0), ("tova", {"budget": 20}, 8, 8)],
)
def test_decoding_step_from_codes_equals_the_dequantized_view(monkeypatch, method, params, bits, residual):
    """A decoding step reads the codes (``core.quantized_attention``): at every step and layer its output and
    statistics are those of the default attention over the dequantized view of the same slots. (Two caches run
    apart would not stay equal: float rounding of 1e-6 flips a code now and then when a key group is sealed.)"""
    checked = compare_codes_path_with_view(monkeypatch)
    model = tiny_model()
    ids = token_ids(2, 60, seed=5)
    cache = kvcompress.cache_for(model, method, kv_bits=bits, kv_group=8, kv_residual=residual, **params)
    forced_logits(model, ids, cache, 30)
    assert len(checked) == 30 * len(cache.layers)


@pytest.mark.parametrize(
    "method,params,bits,residual",
    [("full", {}, 4, 16), ("h2o", {"budget": 24}, 4, 8), ("h2o", {"budget": 24}, 2, 0), ("tova", {"budget": 20}, 8, 8)],
)
def test_read_at_is_the_view_bit_for_bit(monkeypatch, method, params, bits, residual):
    """``QuantizedSlotBuffers.read_at`` (what LESS folds of its victims) reads slots as ``view`` does, bit for bit, at
    every forward and layer while the forward runs: a padded batch in prompt chunks of 13 (the chunk's own tokens,
    more than the residual window), then decoding steps (a padding token in one row), for every slot of the view
    (free ones included) in a shuffled order and for a few slots twice; with the residual window's slots found
    from its entries, and given as the attention finds them (``ring_targets``)."""
    checked = []
    from_codes = QuantizedLayer.attend

    def attend(layer, query, key, value, mask, scaling):
        result = from_codes(layer, query, key, value, mask, scaling)
        slots, width = layer.slots, layer.view_width
        keys, values = slots.view(width)
        generator = torch.Generator().manual_seed(len(checked))
        order = torch.stack([torch.randperm(width, generator=generator) for _ in range(keys.shape[0] * keys.shape[1])])
        index = torch.cat([order, order[:, :3]], dim=-1).view(*keys.shape[:2], -1)
        expected_keys = keys.gather(2, index[..., None].expand(*index.shape, keys.shape[-1]))
        expected_values = values.gather(2, index[..., None].expand(*index.shape, values.shape[-1]))
        targets = [None] if slots.ring is None else [None, slots.ring_targets(width)]
        for given in targets:  # (the slots matched with the ring's entries, or with the targets attention found)
            read_keys, read_values = slots.read_at(index, width, given)
            assert torch.equal(read_keys, expected_keys) and torch.equal(read_values, expected_values)
        checked.append(query.shape[2])
        return result

    monkeypatch.setattr(QuantizedLayer, "attend", attend)
    model = tiny_model()
    ids = token_ids(2, 50, seed=8)
    real = torch.ones(2, 50, dtype=torch.long)
    real[0, :5] = 0
    real[1, 44] = 0
    cache = kvcompress.cache_for(model, method, kv_bits=bits, kv_group=8, kv_residual=residual, **params)
    with torch.no_grad():
        prefill(model, ids[:, :39], cache, attention_mask=real[:, :39], chunk_size=13)
        for step in range(39, 50):
            mask = real[:, : step + 1]
            model(ids[:, step : step + 1], attention_mask=mask, **cache_argument(model, cache), use_cache=True)
    assert checked.count(1) == 11 * len(cache.layers) and checked.count(13) == 3 * len(cache.layers)


@pytest.mark.parametrize(
    "method,params,bits,residual",
    [("full", {}, 4, 16), ("h2o", {"budget": 24}, 4, 8), ("h2o", {"budget": 24}, 2, 0)],
)
def test_decoding_step_from_codes_under_a_padding_mask(monkeypatch, method, params, bits, residual):
    """The codes path with an attention mask: a batch of two prompts of different lengths (the shorter one left
    padded), then decoding with a few padding tokens in the middle of one row (a row that waits while the other
    decodes): at every step and layer the output and statistics are those of the default attention over the
    dequantized view under the same mask, and the mask did hide slots (at every step without eviction)."""
    checked = compare_codes_path_with_view(monkeypatch)
    model = tiny_model()
    ids = token_ids(2, 56, seed=6)
    real = torch.ones(2, 56, dtype=torch.long)
    real[0, :9] = 0  # the first prompt is 9 tokens shorter
    real[1, 40:43] = 0  # the second row waits three steps
    cache = kvcompress.cache_for(model, method, kv_bits=bits, kv_group=8, kv_residual=residual, **params)
    with torch.no_grad():
        model(ids[:, :32], attention_mask=real[:, :32], **cache_argument(model, cache), use_cache=True)
        for step in range(32, 56):
            mask = real[:, : step + 1]
            model(ids[:, step : step + 1], attention_mask=mask, **cache_argument(model, cache), use_cache=True)
    assert len(checked) == 24 * len(cache.layers)
    # (H2O evicts the padding first: its later steps may need no mask)
    assert all(checked) if method == "full" else any(checked)


@pytest.mark.parametrize(
    "method,params,bits,residual",
    [
        ("full", {}, 4, 16),
        ("h2o", {"budget": 24}, 4, 8),
        ("h2o", {"budget": 24}, 2, 0),
        ("tova", {"budget": 20}, 8, 8),
        ("snapkv", {"ratio": 0.5, "window": 4}, 4, 8),
        ("knorm", {"budget": 20}, 4, 8),
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_prompt_chunks_from_codes_equal_the_dequantized_view(monkeypatch, method, params, bits, residual, padded):
    """A forward of several tokens reads the codes a block of slots at a time (``quantized_chunk_attention``): a
    prompt in chunks of 13 tokens, then a few decoding steps, then another chunk of 7 (a holed layer receiving a
    forward of another size): at every forward and layer its output and statistics (the method's, and every
    statistic) are those of the default attention over the dequantized view; row chunks of a few queries (2 over
    40 slots: 2 sequences x 4 query heads) and blocks of one key group (8 slots), so a row chunk reads several
    blocks and a forward several row chunks."""
    monkeypatch.setattr(quantized_attention, "CODES_LOGITS", 2 * 2 * 4 * 40)
    monkeypatch.setattr(quantized_attention, "CODES_BLOCK", 8)
    checked = compare_codes_path_with_view(monkeypatch, queries=0)
    model = tiny_model()
    ids = token_ids(2, 60, seed=7)
    real = torch.ones(2, 60, dtype=torch.long)
    if padded:
        real[0, :9] = 0  # the first prompt is 9 tokens shorter
        real[1, 48:50] = 0  # padding inside the last chunk of the second row
    cache = kvcompress.cache_for(model, method, kv_bits=bits, kv_group=8, kv_residual=residual, **params)
    with torch.no_grad():
        prefill(model, ids[:, :39], cache, attention_mask=real[:, :39], chunk_size=13)
        for step in range(39, 43):
            mask = real[:, : step + 1]
            model(ids[:, step : step + 1], attention_mask=mask, **cache_argument(model, cache), use_cache=True)
        model(ids[:, 43:50], attention_mask=real[:, :50], **cache_argument(model, cache), use_cache=True)
    assert len(checked) == 8 * len(cache.layers)
    assert all(checked[: 3 * len(cache.layers)])  # the prompt's chunks: causal, or padded


# --- with eviction -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,params",
    [("h2o", {"budget": 24}), ("knorm", {"budget": 20}), ("snapkv", {"ratio": 0.5}), ("tova", {"budget": 24})],
)
def test_evicting_methods_store_quantized(method, params):
    model = tiny_model()
    ids = token_ids(2, 64)
    cache = kvcompress.cache_for(model, method, kv_bits=4, kv_group=8, kv_residual=8, **params)
    logits = forced_logits(model, ids, cache, 30)
    assert torch.isfinite(logits).all()
    assert all(type(layer) is QuantizedLayer for layer in cache.layers)
    full = kvcompress.cache_for(model, method, **params)
    forced_logits(model, ids, full, 30)
    assert cache.tokens_stored() == full.tokens_stored()
    assert cache.nbytes() < full.nbytes()
    assert cache.nbytes() <= cache.allocated_nbytes()


def test_evicting_in_place_keeps_every_stored_key_on_its_groups_grid():
    """H2O at its budget rewrites victims' slots in place and seals tokens as they leave the exact window: every
    stored token outside the window reads back on its key group's grid (``min + q * scale``, ``q`` in 0..15) and its
    value on its own, and the layer decodes in place (no compaction: its capacity does not move)."""
    model = tiny_model()
    ids = token_ids(1, 90, seed=5)
    cache = kvcompress.cache_for(model, "h2o", budget=32, kv_bits=4, kv_group=8, kv_residual=8)
    forced_logits(model, ids, cache, 40)
    layer = cache.layers[1]
    slots = layer.slots
    assert not layer.dense  # decoding at the budget: victims' slots reused
    keys, _ = slots.view(slots.capacity)
    sealed = (slots.token_idx >= 0) & (slots.token_idx < slots.window_start(layer.seen))
    assert int(sealed.sum()) > 20
    groups = slots.key_scale.shape[2]
    scale = slots.key_scale.repeat_interleave(8, dim=2).float()
    low = slots.key_min.repeat_interleave(8, dim=2).float()
    codes = (keys.float() - low) / torch.where(scale > 0, scale, torch.ones_like(scale))
    on_grid = ((codes - codes.round()).abs() < 1e-3) & (codes.round() >= 0) & (codes.round() <= 15)
    assert bool(on_grid[sealed[..., None].expand_as(on_grid)].all())
    assert groups * 8 == slots.capacity


def test_bytes_are_codes_scales_and_the_residual():
    model = tiny_model()  # 2 layers, 2 KV heads, head_dim 16
    ids = token_ids(1, 40)
    cache = kvcompress.cache_for(model, "full", kv_bits=4, kv_group=8, kv_residual=16)
    forced_logits(model, ids, cache, 40)
    heads, dim, tokens = 2, 16, 40
    codes = 2 * tokens * heads * dim // 2  # keys and values, two codes a byte
    value_params = 2 * tokens * heads * (dim // 8) * 4  # scale and minimum per token and channel group, fp32
    key_params = 2 * (tokens // 8) * heads * dim * 4  # scale and minimum per key group and channel
    residual = 2 * 16 * heads * dim * 4  # exact keys and values of the newest 16 tokens
    assert cache.nbytes() == 2 * (codes + value_params + key_params + residual)


# --- errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params,message",
    [
        ({"kv_bits": 3}, "kv_bits must be one of 16, 8, 4, 2, got 3"),
        ({"kv_group": 0}, "kv_group must be at least 1"),
        ({"kv_bits": 4, "kv_residual": 20, "kv_group": 8}, "kv_residual must be 0 or a multiple of kv_group (8)"),
    ],
)
def test_parameters_are_checked(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvcompress.make_config("h2o", **params)


def test_storages_that_are_not_slots_have_quantized_forms():
    """Every storage of its own has a quantized form now (docs/results/quantization.md, Limits, listed those that
    had none): LESS's low-rank layer (``LessQuantizedLayer``: ``tests/methods/test_less_quantized.py``), PoD's
    shared keys (``PoDQuantizedLayer``: ``tests/methods/test_pod_quantized.py``), ragged per-head storage
    (``QuantizedRaggedPool``: ``tests/test_ragged_quantized.py``), the cascade's rings and streaming's circular ring
    (``methods/cascade/quantized.py``: ``tests/methods/test_cascade_quantized.py``). A layer class with none is
    still refused with one line."""

    class OwnStorage(CompressedLayer):
        pass

    model = tiny_model()
    with pytest.raises(ValueError, match="kv_bits=4 is not supported by method 'h2o' with its storage OwnStorage"):
        quantized_layer_class(make_config("h2o", kv_bits=4), OwnStorage)
    for circular in (True, False):  # the circular ring, and the way out it had (the standard layer)
        params = {"budget": 32, "circular": circular, "kv_bits": 4, "kv_group": 8, "kv_residual": 8}
        cache = kvcompress.cache_for(model, "streaming", **params)
        assert torch.isfinite(forced_logits(model, token_ids(1, 50), cache, 20)).all()
    cache = kvcompress.cache_for(model, "cascade", budget=36, kv_bits=4, kv_group=8, kv_residual=8)
    assert torch.isfinite(forced_logits(model, token_ids(1, 50), cache, 20)).all()
    # ragged per-head storage (per-head budgets: AdaKV's allocation, KVzip, DuoAttention) is no longer refused: it
    # stores codes once compressed (not ignored: its pools are quantized)
    ids = token_ids(1, 50)
    kvzip = {"ratio": 0.5, "tokenizer": tiny_tokenizer_dir()}
    for method, params in [("snapkv", {"ratio": 0.5, "allocation": "adakv"}), ("kvzip", kvzip)]:
        cache = kvcompress.cache_for(model, method, kv_bits=4, kv_group=8, kv_residual=8, **params)
        prefill(model, ids[:, :30], cache)
        assert torch.isfinite(forced_logits(model, ids[:, 29:], cache, 1)).all()
        assert all(layer.pool.bits == 4 for layer in cache.compressed_layers)


def test_group_must_divide_the_value_head_dimension():
    model = tiny_model()  # head_dim 16
    cache = kvcompress.cache_for(model, "full", kv_bits=4, kv_group=32, kv_residual=32)
    with pytest.raises(ValueError, match=r"kv_group must divide the value head dimension \(16\)"):
        forced_logits(model, token_ids(1, 10), cache, 10)


# --- transformers' QuantizedCache (optimum-quanto) ----------------------------------------------------------------
needs_quanto = pytest.mark.skipif(
    importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None,
    reason="optimum-quanto not installed (transformers' QuantizedCache backend)",
)


@needs_quanto
def test_within_quantization_noise_of_transformers_quantized_cache():
    """Same bits, group and residual as transformers' ``QuantizedCache`` with KIVI's axes (keys per channel,
    values per token) on the quanto backend: ours and theirs differ from the exact cache by the same order, and from
    each other by no more than that. (They differ in when tokens leave the exact window: transformers quantizes the
    whole prompt after its forward and re-quantizes everything each time its residual fills.)"""
    from transformers.cache_utils import QuantizedCache

    model = tiny_model()
    ids = token_ids(2, 96)
    bits, group, residual = 4, 16, 32
    theirs_cache = QuantizedCache(
        "quanto", model.config, nbits=bits, axis_key=-1, axis_value=0, q_group_size=group, residual_length=residual
    )
    ours_cache = kvcompress.cache_for(model, "full", kv_bits=bits, kv_group=group, kv_residual=residual)
    exact = forced_logits(model, ids, DynamicCache(config=model.config), 64)
    theirs = forced_logits(model, ids, theirs_cache, 64)
    ours = forced_logits(model, ids, ours_cache, 64)
    noise = float((theirs - exact).abs().max())
    assert noise > 1e-3
    assert float((ours - exact).abs().max()) <= 2 * noise
    assert float((ours - theirs).abs().max()) <= 2 * noise


# --- reuse ---------------------------------------------------------------------------------------------------
def test_fork_and_save_load_continue_alike(tmp_path):
    model = tiny_model()
    ids = token_ids(1, 50, seed=2)
    cache = kvcompress.cache_for(model, "h2o", budget=24, kv_bits=4, kv_group=8, kv_residual=8)
    with torch.no_grad():
        model(ids[:, :40], **cache_argument(model, cache))
        kvcompress.save_cache(cache, tmp_path / "quantized.safetensors")
        loaded = kvcompress.load_cache(tmp_path / "quantized.safetensors", model)
        fork = cache.fork()
        expected = forced_logits(model, ids[:, 40:], cache, 1)
        assert torch.equal(forced_logits(model, ids[:, 40:], fork, 1), expected)
        assert torch.equal(forced_logits(model, ids[:, 40:], loaded, 1), expected)
    assert loaded.nbytes() == cache.nbytes()


def test_a_pass_taken_back_leaves_the_stored_tokens_intact():
    """KVzip runs reconstruction passes through the cache and takes them back (rewinding the tokens seen): the
    context's tokens read back as stored, within one quantization step of the exact cache's: rounded once when
    stored, once more when the compression's compaction forms the key groups anew (``core.quantized_slots``)."""
    from tests.helpers import tiny_tokenizer_dir

    model = tiny_model()
    ids = token_ids(1, 59, seed=1)
    caches = {}
    for bits in (16, 8):
        params = {"ratio": 0.5, "tokenizer": tiny_tokenizer_dir(), "ragged": False}
        caches[bits] = kvcompress.cache_for(model, "kvzip", kv_bits=bits, kv_group=8, kv_residual=16, **params)
        with torch.no_grad():
            prefill(model, ids, caches[bits])
    for exact, quantized in zip(caches[16].layers, caches[8].layers, strict=True):
        a, b = exact.kept(), quantized.kept()
        assert torch.equal(a.token_idx, b.token_idx)
        real = (a.token_idx >= 0)[..., None]
        step = float(quantized.slots.key_scale.max())
        assert float(((a.keys - b.keys).abs() * real).max()) <= step + 1e-5
