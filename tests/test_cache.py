"""Property tests of the compressed cache: budgets, order, padding, logical vs stored length, bytes."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill, stream_nll
from kvcompress.methods.snapkv import SnapKVConfig
from tests.helpers import cache_logits, duo_pattern_file, kvzip_head_file, tiny_tokenizer_dir

EVICTING = {
    "window": {"budget": 12},
    "streaming": {"budget": 12, "sinks": 4},
    "streaming-original": {"budget": 12, "sinks": 4, "position_mode": "original"},
    "cascade": {"budget": 12, "sinks": 4, "cascades": 4},
    "h2o": {"budget": 12},
    "tova": {"budget": 12},
    "scissorhands": {"budget": 12, "history": 8},
    "snapkv": {"budget": 12, "window": 4},
    "random": {"budget": 12},
    "knorm": {"budget": 12},
    "buzz": {"budget": 12, "budget_kind": "peak"},
    "buzz-logn": {"budget": 12, "budget_kind": "peak", "log_n": True},
    "less": {"budget": 12},
    "less-lambda": {"base": "streaming", "budget": 12},
    "nacl": {"budget": 12},
    "nacl-ratio": {"ratio": 0.4},
    "nacl-shared": {"budget": 12, "head_wise": False},
    "nacl-greedy": {"budget": 12, "eviction": "greedy"},
    "h2o_oneshot": {"budget": 12},
    "tova_oneshot": {"budget": 12},
    "scissorhands_oneshot": {"budget": 12, "history": 8},
    "streaming_oneshot": {"budget": 12},
    "pod-snapkv": {"block_size": 2, "n_sink": 2, "n_recent": 4, "base": SnapKVConfig(budget=12, window=4)},
    "keydiff": {"budget": 12},
    "keydiff-adakv": {"budget": 12, "allocation": "adakv"},
    "expected_attention": {"budget": 12},
    "compactor": {"budget": 12, "chunk_size": 8, "sink_size_start": 2},
    "compactor-adakv": {"budget": 12, "allocation": "adakv", "chunk_size": 8},
    "periodic": {"budget": 12, "interval": 3},
    "periodic-knorm": {"budget": 12, "interval": 2, "scorer": "knorm"},
    # quantized storage (issue 49): an evicting method at 4 bits, a one-shot one at 8 (keys per channel in groups of
    # 8 slots, values per token; the newest 8 tokens exact)
    "h2o-kv4": {"budget": 12, "kv_bits": 4, "kv_group": 8, "kv_residual": 8},
    "snapkv-kv8": {"budget": 12, "window": 4, "kv_bits": 8, "kv_group": 4, "kv_residual": 4},
    "less-kv4": {"budget": 12, "kv_bits": 4, "kv_group": 8, "kv_residual": 8},  # LESS's own quantized layer
    "pod-kv4": {  # PoD's own quantized layer (keys of the block-start heads only)
        **{"block_size": 2, "n_sink": 2, "n_recent": 4, "base": SnapKVConfig(budget=12, window=4)},
        **{"kv_bits": 4, "kv_group": 8, "kv_residual": 8},
    },
    # the cascade's rings and streaming's circular ring quantized (methods/cascade/quantized.py)
    "streaming-kv4": {"budget": 12, "sinks": 4, "kv_bits": 4, "kv_group": 8, "kv_residual": 8},
    "cascade-kv4": {"budget": 12, "sinks": 4, "cascades": 4, "kv_bits": 4, "kv_group": 8, "kv_residual": 8},
    "expected_attention-pyramid": {"budget": 12, "allocation": "pyramid", "beta": 4},
    "snapkv-adakv": {"budget": 12, "window": 4, "allocation": "adakv"},
    # per-head budgets stored ragged, quantized (core/ragged_quantized.py)
    "snapkv-adakv-kv4": {
        "budget": 12,
        "window": 4,
        "allocation": "adakv",
        "kv_bits": 4,
        "kv_group": 4,
        "kv_residual": 4,
    },
}
# methods that compress in ``prefill`` (KVzip reruns the model over the prompt's ids): checked through
# ``cache_logits``, which prefills them, where a test feeds a whole generation
PREFILLED = {
    "kvzip": {"ratio": 0.5, "tokenizer": tiny_tokenizer_dir()},
    "kvzip-layer": {"ratio": 0.5, "allocation": "layer", "chunk_size": 5, "tokenizer": tiny_tokenizer_dir()},
}
# methods whose heads keep different counts by a calibrated split, not a budget (DuoAttention's retrieval heads keep
# everything): checked where a test runs every method without a budget bound (devices, architectures, CUDA)
HEAD_SPLIT = {
    "duo": {"pattern": duo_pattern_file(), "sink_size": 4, "recent_size": 8},
    # KVzip's head level: calibrated head scores, duo's split (no reconstruction: compressed once after the prompt)
    "kvzip-head": {"ratio": 0.5, "level": "head", "pattern": kvzip_head_file(), "sink_size": 4, "recent_size": 8},
}
# budgets shared unevenly (methods/allocation.py): a layer's heads (adakv) or the layers (pyramid) keep the budget
# on average, one head or layer more than another
UNEVEN = {key for key, params in EVICTING.items() if params.get("allocation", "uniform") != "uniform"}


def method_of(key: str) -> str:
    return key.split("-")[0]


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def periodic_limit(interval: int, prompt: int, steps: int) -> int:
    """Tokens a ``periodic`` cache (budget 12) holds after ``steps`` decoding steps of one token."""
    return prompt + steps if steps < interval else 12 + steps % interval


@pytest.mark.parametrize("key", sorted(EVICTING))
def test_budget_never_exceeded_and_order_kept_while_decoding(key, tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, method_of(key), **EVICTING[key])
    ids = ids_of(1, 30)
    with torch.no_grad():
        tiny_llama(ids, **cache_argument(tiny_llama, cache))
        for step in range(25):
            tiny_llama(ids_of(1, 1, seed=step + 1), **cache_argument(tiny_llama, cache))
            for layer in cache.compressed_layers:
                real = layer.valid.sum(-1)
                limit = 12 + (step + 1 if layer.policy.one_shot else 0)  # one-shot: decoding appends
                if method_of(key) == "periodic":  # the prompt whole, then the budget every ``interval`` steps
                    limit = periodic_limit(EVICTING[key]["interval"], 30, step + 1)
                assert int(real.max()) <= limit or key in UNEVEN
                kept = layer.kept()  # the stored tokens in stream order: distinct, increasing
                if key in UNEVEN:  # shorter heads end with free slots
                    assert all(bool((row[row >= 0].diff() > 0).all()) for row in kept.token_idx.flatten(0, 1))
                else:
                    assert bool((kept.token_idx.diff(dim=-1) > 0).all())
            layers = cache.compressed_layers
            average = sum(int(layer.valid.sum()) for layer in layers) / (len(layers) * layers[0].valid.shape[1])
            periodic = method_of(key) == "periodic"
            bound = periodic_limit(EVICTING[key]["interval"], 30, step + 1) if periodic else 12 + step + 1
            assert average <= bound + (0.5 if key in UNEVEN else 0)  # (pyramid: one rounding per layer)
    assert cache.get_seq_length() == cache.tokens_seen() == 55


# quantized storage is left out: its key groups are groups of slots, and a padded row's slots sit a padding's width
# off a single run's, so the rows quantize in other groups (as transformers' QuantizedCache groups padding too)
QUANTIZED = {key for key, params in EVICTING.items() if params.get("kv_bits", 16) < 16}


@pytest.mark.parametrize("key", sorted(set(EVICTING) - QUANTIZED))
def test_padded_batch_equals_single_runs(key, tiny_llama):
    long, short = ids_of(1, 26, seed=3), ids_of(1, 19, seed=4)
    batch = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 7:], mask[1, 7:] = short[0], 1
    method, params = method_of(key), EVICTING[key]
    batch_logits, _ = cache_logits(tiny_llama, batch, kvcompress.cache_for(tiny_llama, method, **params), mask, 8)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, method, **params), None, 8)
        torch.testing.assert_close(batch_logits[row], single[0], rtol=1e-4, atol=1e-5)


def test_padding_never_takes_budget(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "window", budget=10)
    ids = ids_of(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :22] = 0  # the second sequence has only 8 real tokens
    prefill(tiny_llama, ids, cache, attention_mask=mask)
    layer = cache.compressed_layers[0]
    assert layer.valid.sum(-1).tolist() == [[10, 10], [8, 8]]
    assert layer.stored_length() == 10


def _bytes_per_step(model, cache, steps):
    sizes = []
    with torch.no_grad():
        for token in ids_of(1, steps, seed=5)[0]:
            model(token.view(1, 1), **cache_argument(model, cache))
            sizes.append(cache.nbytes())
    return sizes


def test_stored_bytes_grow_to_the_budget_then_stay_constant_over_4000_tokens(tiny_llama):
    config = tiny_llama.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=64)  # the generic layer: cat, then gather
    sizes = _bytes_per_step(tiny_llama, cache, 4000)
    assert sizes[:64] == [(n + 1) * per_token for n in range(64)]
    assert set(sizes[64:]) == {64 * per_token}
    assert cache.tokens_seen() == 4000


def test_circular_streaming_stores_the_tokens_seen_up_to_exactly_the_budget(tiny_llama):
    config = tiny_llama.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    cache = kvcompress.cache_for(tiny_llama, "streaming", budget=64)  # a ring buffer, grown up to the budget
    sizes = _bytes_per_step(tiny_llama, cache, 300)
    assert sizes == [min(seen, 64) * per_token for seen in range(1, 301)]
    assert cache.tokens_seen() == 300


def test_chunked_prefill_bounds_storage_and_matches_one_pass_for_full(tiny_llama):
    ids = ids_of(1, 50, seed=6)
    one = kvcompress.cache_for(tiny_llama, "full")
    chunked = kvcompress.cache_for(tiny_llama, "full")
    torch.testing.assert_close(
        prefill(tiny_llama, ids, chunked, chunk_size=7), prefill(tiny_llama, ids, one), rtol=1e-4, atol=1e-5
    )
    bounded = kvcompress.cache_for(tiny_llama, "h2o", budget=16)
    prefill(tiny_llama, ids, bounded, chunk_size=8)
    assert bounded.tokens_stored() == [16, 16]


def test_chunked_prefill_keeps_snapkv_window_inside_the_last_chunk(tiny_llama):
    ids = ids_of(1, 70, seed=9)  # 70 = 6 + 64: the remainder chunk comes first
    one_pass = kvcompress.cache_for(tiny_llama, "snapkv", budget=20, window=16)
    chunked = kvcompress.cache_for(tiny_llama, "snapkv", budget=20, window=16)
    prefill(tiny_llama, ids, one_pass)
    prefill(tiny_llama, ids, chunked, chunk_size=32)
    for single, split in zip(one_pass.compressed_layers, chunked.compressed_layers, strict=True):
        assert torch.equal(single.token_idx, split.token_idx)


def test_one_shot_method_compresses_once_after_a_chunked_prefill(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "snapkv", ratio=0.25, window=4)
    prefill(tiny_llama, ids_of(1, 40, seed=7), cache, chunk_size=8)
    assert cache.tokens_stored() == [10, 10]


@pytest.mark.parametrize(
    ("method", "params"), [("snapkv", {"budget": 12, "window": 4}), ("pod", {"budget": 12, "block_size": 2})]
)
def test_a_chunked_prefill_inside_a_callers_deferred_block_leaves_the_compression_to_it(tiny_llama, method, params):
    cache = kvcompress.cache_for(tiny_llama, method, **params)
    ids = ids_of(1, 48, seed=9)
    with cache.deferred_compression():
        prefill(tiny_llama, ids[:, :32], cache, chunk_size=8)  # its own block, nested in the caller's
        assert max(cache.tokens_stored()) == 32
        prefill(tiny_llama, ids[:, 32:], cache, chunk_size=8)
    assert max(cache.tokens_stored()) < 48


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("snapkv", {"budget": 12, "window": 4}),
        ("pod", {"budget": 12, "block_size": 2}),
        ("tova_oneshot", {"budget": 12}),
        ("h2o_oneshot", {"budget": 12}),
    ],
)
def test_chunks_that_more_prompt_follows_skip_statistics_only_the_latest_forward_counts(
    tiny_llama, method, params, monkeypatch
):
    """SnapKV (alone or under PoD) votes with the last forward's window only, one-shot TOVA with its last query:
    ``prefill`` computes no statistics for the chunks before the last, and keeps the tokens and logits of computing
    them in every chunk; a method accumulating over every query (H2O's one-shot form) still observes every chunk."""
    ids = ids_of(1, 48, seed=10)
    observed = []

    def run(skip: bool):
        cache = kvcompress.cache_for(tiny_llama, method, **params)
        policy = type(cache.compressed_layers[0].policy)
        observe = policy.observe
        monkeypatch.setattr(
            policy, "observe", lambda self, layer, stats: observed.append(1) or observe(self, layer, stats)
        )
        observed.clear()
        if skip:
            logits = prefill(tiny_llama, ids, cache, chunk_size=8)
        else:
            with cache.deferred_compression():
                for start in range(0, 48, 8):
                    logits = prefill(tiny_llama, ids[:, start : start + 8], cache)
        monkeypatch.undo()
        return logits, [layer.token_idx.clone() for layer in cache.compressed_layers], len(observed)

    skipped, every = run(True), run(False)
    torch.testing.assert_close(skipped[0], every[0])
    assert all(torch.equal(a, b) for a, b in zip(skipped[1], every[1], strict=True))
    layers = len(tiny_llama.model.layers)
    assert every[2] == 6 * layers  # (a tiny model: every chunk observed without the declaration)
    assert skipped[2] == (6 * layers if method == "h2o_oneshot" else layers)


@pytest.mark.parametrize("method", ["nacl", "snapkv"])
def test_one_pass_prefill_compresses_each_layer_before_the_next_layer_runs(tiny_llama, method):
    cache = kvcompress.cache_for(tiny_llama, method, ratio=0.25)
    first = cache.compressed_layers[0]
    seen_by_second_layer = []
    hook = tiny_llama.model.layers[1].register_forward_pre_hook(
        lambda *_: seen_by_second_layer.append(first.stored_length())
    )
    try:
        prefill(tiny_llama, ids_of(1, 40, seed=7), cache)
    finally:
        hook.remove()
    assert seen_by_second_layer == [10]  # layer 0 already holds its 25 % when layer 1 attends


def test_stream_nll_with_full_cache_equals_one_forward(tiny_llama):
    ids = ids_of(1, 40, seed=8)
    tiny_llama.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = tiny_llama(ids).logits[0, :-1]
    reference = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    losses = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "full"), chunk_size=3)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-5)


def test_crop_is_refused_with_a_reason(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "window", budget=8)
    prefill(tiny_llama, ids_of(1, 10), cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(5)


def test_observers_see_every_layer_after_each_forward(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=8)
    seen = []
    for layer in cache.compressed_layers:
        layer.observers.append(lambda layer: seen.append((cache.compressed_layers.index(layer), layer.stored_length())))
    prefill(tiny_llama, ids_of(1, 12, seed=3), cache, chunk_size=6)
    assert seen == [(0, 6), (1, 6), (0, 8), (1, 8)]


def test_cache_positions_skip_the_rotation_only_when_the_model_gave_stream_indices(tiny_llama, monkeypatch):
    """``position_mode="cache"`` re-indexes keys to their rank; before anything is dropped the ranks are the stream
    indices, so keys given at those positions are used as they are. Positions with a gap are re-indexed."""
    from kvcompress.core.layer import CompressedLayer

    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(3))
    stream = torch.arange(24)[None]
    gapped = torch.cat([torch.arange(12), torch.arange(12) + 40])[None]

    def logits(positions: torch.Tensor, rotate_always: bool) -> torch.Tensor:
        if rotate_always:
            monkeypatch.setattr(CompressedLayer, "_ranks_are_positions", lambda self: False)
        cache = kvcompress.cache_for(tiny_llama, "streaming_oneshot", budget=64)
        with torch.no_grad():
            out = tiny_llama(input_ids=ids, position_ids=positions, **cache_argument(tiny_llama, cache)).logits
        monkeypatch.undo()
        return out, cache

    fast, cache = logits(stream, rotate_always=False)
    assert cache.compressed_layers[0].stream_positions
    torch.testing.assert_close(fast, logits(stream, rotate_always=True)[0], rtol=1e-5, atol=1e-5)
    reindexed, cache = logits(gapped, rotate_always=False)
    assert not cache.compressed_layers[0].stream_positions
    torch.testing.assert_close(reindexed, logits(gapped, rotate_always=True)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reindexed, tiny_llama(input_ids=ids, position_ids=gapped).logits, atol=1e-3)
