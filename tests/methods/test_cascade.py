"""Cascading KV Cache: the spec's test vectors (toy trace, spans, fill counts), invariants I1-I5, the EMA and the
selection rule, positions, prefill modes, and equality with the sink cache (N = 1) and the full cache (I4)."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress
from kvcompress.core.contract import AttentionStats
from kvcompress.generation import cache_argument, prefill, stream_nll
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.registry import make_config
from tests.helpers import cache_logits, needs_smollm2, own_logits, per_sequence_path, ranks


def cascade_tokens(layer) -> list[list[list[int]]]:
    """Per sequence, per cascade: the stream indices it holds, oldest first (sinks not included)."""
    tok, width = layer._tok.tolist(), layer.width
    return [
        [
            [tok[b][layer.sinks + i * width + (start + r) % width] for r in range(count)]
            for i, (count, start) in enumerate(zip(rings.count, rings.start, strict=True))
        ]
        for b, rings in enumerate(layer._rings)
    ]


def ring_counts(layer) -> torch.Tensor:
    """``[B, N]``: each sequence's token count per cascade."""
    return torch.tensor([rings.count for rings in layer._rings])


def hand_layer(batch: int = 1, heads: int = 1, **params) -> CascadeLayer:
    """A cascade layer driven by hand (no model, no RoPE)."""
    layer = CascadeLayer(make_config("cascade", **params).policy(0))
    layer.update(torch.zeros(batch, heads, 0, 2), torch.zeros(batch, heads, 0, 2))
    layer.after_attention(None)
    return layer


def push(layer: CascadeLayer, count: int = 1, received: torch.Tensor | None = None) -> None:
    """Insert ``count`` tokens one at a time; ``received`` ``[B, S + |C|]`` is folded in as attention after each."""
    batch, heads = layer._kv.shape[:2]
    for _ in range(count):
        key = torch.randn(batch, heads, 1, 2)
        layer.update(key, key.clone())
        stats = None
        if received is not None:
            stats = AttentionStats(query_count=1, received=received[:, None, None].expand(-1, heads, 1, -1))
        layer.after_attention(stats)


def kept(layer: CascadeLayer, row: int = 0) -> list[int]:
    return [int(t) for t, v in zip(layer.token_idx[row, 0], layer.valid[row, 0], strict=True) if v]


def span(layer: CascadeLayer) -> int:
    tokens = [t for ring in cascade_tokens(layer)[0] for t in ring]
    return max(tokens) - min(tokens) + 1


def ids_of(batch: int, length: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- schedule: spec §1.5 toy trace, §1.11 spans, §1.12 fill counts ---------------------------------------------


def test_toy_trace_s2_c8_n4_matches_the_spec():
    layer = hand_layer(budget=10, sinks=2, cascades=4)
    expected = {
        5: [0, 1, 3, 4, 5],
        9: [0, 1, 3, 5, 7, 8, 9],
        17: [0, 1, 3, 7, 11, 13, 15, 16, 17],
        39: [0, 1, 19, 27, 31, 33, 35, 37, 38, 39],
    }
    for token in range(40):
        push(layer)
        if token in expected:
            assert kept(layer) == expected[token], token
    assert cascade_tokens(layer) == [[[38, 39], [35, 37], [31, 33], [19, 27]]]


@pytest.mark.parametrize(("cascades", "tokens", "expected"), [(4, 20_000, 7669), (2, 20_000, 3071), (8, 70_000, 65133)])
def test_spans_for_c2048_without_selection(cascades, tokens, expected):
    layer = hand_layer(budget=4 + 2048, sinks=4, cascades=cascades, select_tokens=False)
    push(layer, tokens)
    assert span(layer) == expected
    equation_4 = make_config("cascade", budget=2052, cascades=cascades).span  # 7680 / 3072 / 65280
    assert abs(span(layer) - equation_4) / equation_4 < 0.01


def test_fill_counts_after_2052_tokens():
    layer = hand_layer(budget=2052, sinks=4, cascades=4)
    push(layer, 2052)
    assert ring_counts(layer).tolist() == [[512, 512, 128, 0]]
    assert int(layer.valid.sum()) == 4 + 1152
    eager = hand_layer(budget=2052, sinks=4, cascades=4, eager_fill=True)
    push(eager, 2052)
    assert ring_counts(eager).tolist() == [[512, 512, 512, 512]]


def test_eager_fill_behaves_as_a_sink_cache_until_full():
    layer = hand_layer(budget=10, sinks=2, cascades=4, eager_fill=True)
    push(layer, 10)
    assert kept(layer) == list(range(10))
    push(layer)  # token 10 evicts from the first cascade and the chain goes on by the clock from now on
    assert len(kept(layer)) == 10 and 10 in kept(layer)


# --- invariants I1, I2, I5 under data-dependent selection ------------------------------------------------------


def test_invariants_hold_with_random_scores_per_sequence():
    batch, sinks, width, cascades = 3, 2, 4, 4
    layer = hand_layer(batch=batch, heads=2, budget=sinks + width * cascades, sinks=sinks, cascades=cascades)
    generator = torch.Generator().manual_seed(0)
    previous = [set() for _ in range(batch)]
    previous_counts = torch.zeros(batch, cascades, dtype=torch.long)
    for token in range(300):
        received = torch.rand(batch, sinks + width * cascades, generator=generator)
        push(layer, received=received)
        counts = ring_counts(layer)
        assert bool((counts >= previous_counts).all())  # I2: counts never decrease
        previous_counts = counts.clone()
        for row in range(batch):
            rings = cascade_tokens(layer)[row]
            for i, ring in enumerate(rings):
                assert ring == sorted(ring)  # I1: ring order is stream order
                if i + 1 < cascades and rings[i + 1]:
                    assert len(ring) == width  # I2: a deeper cascade holds tokens only when this one is full
                    assert max(rings[i + 1]) < min(ring)  # I1: deeper cascades hold older tokens
            if token >= sinks:
                assert rings[0][-1] == token  # the new token always enters the first cascade
            now = set(kept(layer, row))
            assert len(previous[row] - now) <= 1  # I5: at most one token leaves per step
            previous[row] = now
    assert len({tuple(kept(layer, row)) for row in range(batch)}) > 1  # rows decided independently


@pytest.mark.parametrize(
    "params",
    [
        {"cascades": 4},
        {"cascades": 3, "base": 3, "tie": "resident"},
        {"cascades": 4, "eager_fill": True, "reduction": "max"},
        {"cascades": 1},
        {"cascades": 4, "select_tokens": False},
    ],
)
def test_in_step_path_equals_the_per_sequence_tensor_path(params):
    # the batch-in-step fast path (Python counters, slice moves) and the per-sequence tensor path (used once a
    # batch is padded) must store the same tokens with the same scores, keys and values, RoPE included
    batch, heads, dim, sinks, width = 3, 2, 8, 2, 4
    budget = sinks + width * params["cascades"]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim))
    layers = []
    for tensor_path in (False, True):
        layer = CascadeLayer(make_config("cascade", budget=budget, sinks=sinks, **params).policy(0), inv_freq)
        per_sequence_path(layer, tensor_path)
        layers.append(layer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(120):
        keys = torch.randn(batch, heads, 1, dim, generator=generator)
        values = torch.randn(batch, heads, 1, dim, generator=generator)
        received = torch.rand(batch, heads, 1, budget, generator=generator).softmax(-1)
        for layer in layers:
            layer.update(keys, values)
            layer.after_attention(AttentionStats(query_count=1, received=received))
    fast, reference = layers
    assert fast._in_step and not reference._in_step
    assert torch.equal(fast._tok, reference._tok)
    assert [r.count for r in fast._rings] == [r.count for r in reference._rings]
    assert [r.start for r in fast._rings] == [r.start for r in reference._rings]
    slots = fast.capacity  # the scratch slot after them holds anything
    torch.testing.assert_close(fast._score[:, :slots], reference._score[:, :slots], rtol=0, atol=1e-7)
    torch.testing.assert_close(fast._k, reference._k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast._v, reference._v, rtol=0, atol=0)
    torch.testing.assert_close(fast.keys, reference.keys, rtol=1e-5, atol=1e-5)


# --- EMA and selection (spec §1.6, A1) ------------------------------------------------------------------------


def test_gamma_follows_equation_14():
    assert make_config("cascade", budget=2052, cascades=4).ema_gamma == pytest.approx(0.99105, abs=1e-5)
    assert make_config("cascade", budget=4100, cascades=4).ema_gamma == pytest.approx(0.99551, abs=1e-5)
    assert make_config("cascade", budget=2052, cascades=4, gamma=0.5).ema_gamma == 0.5


def test_ema_update_new_tokens_enter_with_zero_and_scores_travel_with_their_token():
    layer = hand_layer(budget=6, sinks=2, cascades=2, gamma=0.5)  # W = 2
    push(layer, 4)  # sinks 0, 1; first cascade 2, 3
    received = torch.tensor([[0.1, 0.1, 0.4, 0.2, 0.0, 0.0, 0.0]])[:, :6]
    layer.after_attention(AttentionStats(query_count=1, received=received[:, None, None]))
    state = dict(zip(kept(layer), layer.state["score"][0, 0][layer.valid[0, 0]].tolist(), strict=True))
    assert state[2] == pytest.approx(0.2) and state[3] == pytest.approx(0.1)
    push(layer)  # token 4 evicts token 2 into the second cascade: 4 enters with 0, 2 keeps its score
    state = dict(zip(kept(layer), layer.state["score"][0, 0][layer.valid[0, 0]].tolist(), strict=True))
    assert state[4] == 0.0 and state[2] == pytest.approx(0.2)


@pytest.mark.parametrize(("reduction", "expected"), [("mean", 0.3), ("median", 0.2), ("max", 0.6)])
def test_head_reduction(reduction, expected):
    layer = hand_layer(heads=3, budget=4, sinks=0, cascades=2, gamma=0.0, reduction=reduction)
    push(layer)
    per_head = torch.tensor([0.1, 0.2, 0.6])[None, :, None, None] * torch.tensor([1.0, 0, 0, 0])
    layer.after_attention(AttentionStats(query_count=1, received=per_head))
    assert float(layer._score[0, 0]) == pytest.approx(expected)


def set_scores(layer: CascadeLayer, scores: dict[int, float]) -> None:
    """With gamma = 0, one attention step sets each stored token's score to what it received."""
    received = torch.zeros(1, layer.capacity)
    for slot in range(layer.capacity):
        received[0, slot] = scores.get(int(layer._tok[0, slot]), 0.0)
    layer.after_attention(AttentionStats(query_count=1, received=received[:, None, None]))


@pytest.mark.parametrize(
    ("tie", "arriving", "resident", "survivor"),
    [("incoming", 0.5, 0.5, 1), ("resident", 0.5, 0.5, 0), ("incoming", 0.4, 0.5, 0), ("resident", 0.6, 0.5, 1)],
)
def test_selection_keeps_the_higher_score_and_ties_follow_the_rule(tie, arriving, resident, survivor):
    layer = hand_layer(budget=4, sinks=0, cascades=2, gamma=0.0, tie=tie)  # W = 2
    push(layer, 3)
    assert cascade_tokens(layer)[0] == [[1, 2], [0]]
    # token 3 (k = 3, odd): the first cascade evicts 1, which arrives at the second cascade (not accepting) and
    # competes with its newest token, 0
    set_scores(layer, {1: arriving, 0: resident})
    push(layer)
    assert cascade_tokens(layer)[0] == [[2, 3], [survivor]]


def test_without_selection_the_incoming_token_always_wins():
    layer = hand_layer(budget=4, sinks=0, cascades=2, gamma=0.0, select_tokens=False)
    push(layer, 3)
    set_scores(layer, {0: 1.0})  # the resident is much better, but scores are not consulted
    push(layer)
    assert cascade_tokens(layer)[0] == [[2, 3], [1]]


# --- positions (spec §1.8) --------------------------------------------------------------------------------------


def test_ranks_are_consecutive_in_stream_order():
    layer = hand_layer(budget=10, sinks=2, cascades=4)
    push(layer, 23)
    rank, occupied = torch.tensor([ranks(layer._layout, layer._rings[0])[: layer.capacity]]), layer._tok >= 0
    by_token = sorted(zip(layer._tok[0][occupied[0]].tolist(), rank[0][occupied[0]].tolist(), strict=True))
    assert [r for _, r in by_token] == list(range(len(by_token)))


def test_config_rejects_bad_parameters():
    with pytest.raises(ValueError, match="cascades"):
        make_config("cascade", budget=7, sinks=4, cascades=4)
    with pytest.raises(ValueError, match="reduction"):
        make_config("cascade", budget=12, reduction="sum")
    with pytest.raises(ValueError, match="gamma"):
        make_config("cascade", budget=12, gamma=1.5)
    with pytest.raises(ValueError, match="base"):
        make_config("cascade", budget=12, base=1)
    with pytest.raises(ValueError, match="prefill"):
        make_config("cascade", budget=12, prefill="fast")


# --- with a model -----------------------------------------------------------------------------------------------


def test_n1_equals_the_sink_cache_token_for_token(tiny_llama):
    # our streaming cache with budget B attends to B + 1 tokens (it evicts after attention); the cascade inserts
    # before attention, so the same attention set is a cascade of S + |C| = B + 1 slots.
    ids = ids_of(1, 90, seed=11)
    sink = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "streaming", budget=15, sinks=4))
    cascade = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=16, cascades=1))
    torch.testing.assert_close(cascade, sink, rtol=1e-4, atol=1e-5)


def test_n1_chunked_exact_prefill_equals_the_sink_cache_fed_token_by_token(tiny_llama):
    ids = ids_of(1, 90, seed=12)
    sink = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "streaming", budget=15, sinks=4))
    cascade = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=16, cascades=1), 13)
    torch.testing.assert_close(cascade, sink, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
def test_equals_the_full_cache_while_the_stream_is_shorter_than_s_plus_w(model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    ids = ids_of(1, 30, seed=13)  # 30 + 6 generated < S + W = 4 + 32
    reference, sequences = own_logits(model, ids)
    logits, ours = cache_logits(model, ids, kvcompress.cache_for(model, "cascade", budget=132, cascades=4))
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours, sequences)


@pytest.mark.parametrize("params", [{"cascades": 4}, {"cascades": 2, "reduction": "max", "base": 3}])
def test_exact_prefill_in_chunks_equals_token_by_token(tiny_llama, params):
    ids = ids_of(1, 120, seed=14)
    one = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=20, **params))
    chunked = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=20, **params), 17)
    torch.testing.assert_close(chunked, one, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_with_chunks_of_one_is_exact_and_bounded_otherwise(tiny_llama):
    ids = ids_of(1, 100, seed=15)
    exact = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=20))
    ones = stream_nll(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", budget=20, prefill="chunked"))
    torch.testing.assert_close(ones, exact, rtol=1e-4, atol=1e-5)
    cache = kvcompress.cache_for(tiny_llama, "cascade", budget=20, prefill="chunked")
    losses = stream_nll(tiny_llama, ids, cache, 16)
    assert torch.isfinite(losses).all()
    assert cache.tokens_stored() == [20, 20] and int(cache.compressed_layers[0].valid[0, 0].sum()) <= 20


def test_chunked_prefill_advances_the_ema_in_closed_form():
    # no RoPE, one head, S = 0: hand-made queries and keys; compare with the formula of spec A12
    config = make_config("cascade", budget=8, sinks=0, cascades=2, gamma=0.7, prefill="chunked")
    layer = CascadeLayer(config.policy(0))
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(1, 1, 2, 4, generator=generator)
    layer.update(first, first.clone())
    layer.cascade_attention(torch.randn(1, 1, 2, 4, generator=generator), 1.0)
    before = layer._score[0, :8].clone()
    keys = torch.randn(1, 1, 3, 4, generator=generator)
    queries = torch.randn(1, 1, 3, 4, generator=generator)
    stored_keys = layer._k[0, 0].clone()
    occupied = layer._tok[0] >= 0
    old_tokens = layer._tok[0].tolist()
    layer.update(keys, keys.clone())
    layer.cascade_attention(queries, 1.0)
    all_keys = torch.cat([stored_keys, keys[0, 0]])
    logits = queries[0, 0] @ all_keys.T
    visible = torch.cat([occupied[None].expand(3, -1), torch.ones(3, 3).tril().bool()], 1)
    probs = logits.masked_fill(~visible, -math.inf).softmax(-1)
    weight = torch.tensor([0.3 * 0.7**2, 0.3 * 0.7, 0.3])
    expected_cache = 0.7**3 * before + weight @ probs[:, :8]
    expected_chunk = weight @ probs[:, 8:]
    got = {int(t): float(s) for t, s in zip(layer._tok[0, :8], layer._score[0, :8], strict=True) if t >= 0}
    for slot in range(8):
        if occupied[slot]:
            assert got[old_tokens[slot]] == pytest.approx(float(expected_cache[slot]), abs=1e-6)
    for m in range(3):
        assert got[2 + m] == pytest.approx(float(expected_chunk[m]), abs=1e-6)


def test_padded_batch_with_evictions_equals_single_runs(tiny_llama):
    long, short = ids_of(1, 40, seed=16), ids_of(1, 27, seed=17)
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1
    params = {"budget": 12, "sinks": 2, "cascades": 2}
    batched, _ = cache_logits(tiny_llama, batch, kvcompress.cache_for(tiny_llama, "cascade", **params), mask, 10)
    for row, ids in enumerate((long, short)):
        single, _ = cache_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, "cascade", **params), None, 10)
        torch.testing.assert_close(batched[row], single[0], rtol=1e-4, atol=1e-5)


def test_memory_is_allocated_once_and_equals_the_budget(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "cascade", budget=36, cascades=4)
    config = tiny_llama.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    sizes = set()
    with torch.no_grad():
        prefill(tiny_llama, ids_of(1, 10, seed=18), cache)
        for token in ids_of(1, 200, seed=19)[0]:
            tiny_llama(token.view(1, 1), **cache_argument(tiny_llama, cache))
            sizes.add(sum(layer.allocated_nbytes() for layer in cache.layers))
    assert sizes == {36 * per_token}  # several cascades: every ring's region is allocated at the first forward
    assert cache.nbytes() == 36 * per_token  # and full once 36 tokens are stored
    assert cache.get_seq_length() == 210


def test_one_ring_grows_with_the_tokens_seen_and_never_stores_more_than_a_full_cache(tiny_llama):
    full = kvcompress.cache_for(tiny_llama, "full")
    ring = kvcompress.cache_for(tiny_llama, "streaming", budget=64, sinks=4)
    allocated = []
    with torch.no_grad():
        for cache in (full, ring):
            prefill(tiny_llama, ids_of(1, 10, seed=18), cache)
        for token in ids_of(1, 80, seed=19)[0]:
            for cache in (full, ring):
                tiny_llama(token.view(1, 1), **cache_argument(tiny_llama, cache))
            assert ring.nbytes() == min(full.nbytes(), full.nbytes() * 64 // cache.get_seq_length())
            allocated.append(sum(layer.allocated_nbytes() for layer in ring.layers))
    assert allocated[0] < allocated[-1] == ring.nbytes()  # grown from the prompt's size to the budget


def test_public_views_give_the_model_keys_in_stream_order(tiny_llama):
    ids = ids_of(1, 12, seed=20)
    full = kvcompress.cache_for(tiny_llama, "full")
    cascade = kvcompress.cache_for(tiny_llama, "cascade", budget=36, cascades=4)
    prefill(tiny_llama, ids, full)
    prefill(tiny_llama, ids, cascade)
    layer, reference = cascade.compressed_layers[0], full.compressed_layers[0]
    valid = layer.valid[0, 0]
    torch.testing.assert_close(layer.keys[:, :, valid], reference.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.values[:, :, valid], reference.values)
    assert layer.token_idx[0, 0, valid].tolist() == list(range(12))
    assert layer.rope_pos[0, 0, valid].tolist() == list(range(12))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_equals_the_full_cache_within_s_plus_w_and_runs_past_it():
    from kvcompress.models import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 5, return_tensors="pt").input_ids[:, :60]
    reference, _ = own_logits(model, ids, new_tokens=4)
    logits, _ = cache_logits(model, ids, kvcompress.cache_for(model, "cascade", budget=260, cascades=4), new_tokens=4)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)  # 64 tokens < S + W = 4 + 64
    long_ids = tokenizer("Once upon a time, " * 40, return_tensors="pt").input_ids[:, :200]
    losses = stream_nll(model, long_ids, kvcompress.cache_for(model, "cascade", budget=36, cascades=4), 50)
    assert torch.isfinite(losses).all()


# --- streaming on the circular sink cache (N = 1) ----------------------------------------------------------------


def test_streaming_runs_on_the_circular_layer_only_where_it_applies():
    from kvcompress.core.layer import CompressedLayer
    from kvcompress.methods.cascade.circular import CircularSinkLayer

    assert make_config("streaming", budget=16, sinks=4).layer_class() is CircularSinkLayer
    assert make_config("streaming", budget=16, sinks=4, position_mode="original").layer_class() is CompressedLayer
    assert make_config("streaming", budget=4, sinks=4).layer_class() is CompressedLayer  # no ring slot


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(("budget", "sinks", "chunk"), [(15, 4, 1), (12, 0, 1), (20, 2, 7), (9, 4, 13)])
def test_streaming_circular_equals_the_generic_layer_token_by_token_and_in_chunks(
    model_fixture, budget, sinks, chunk, request, monkeypatch
):
    model = request.getfixturevalue(model_fixture)
    ids = ids_of(1, 70, seed=21)
    fast_cache = kvcompress.cache_for(model, "streaming", budget=budget, sinks=sinks)
    fast = stream_nll(model, ids, fast_cache, chunk)
    generic_cache = kvcompress.cache_for(model, "streaming", budget=budget, sinks=sinks, circular=False)
    generic = stream_nll(model, ids, generic_cache, chunk)
    assert type(fast_cache.compressed_layers[0]).__name__ == "CircularSinkLayer"
    assert type(generic_cache.compressed_layers[0]).__name__ == "CompressedLayer"
    torch.testing.assert_close(fast, generic, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(fast_cache.compressed_layers, generic_cache.compressed_layers, strict=True):
        kept_ours = ours.token_idx[ours.valid].view(1, -1)
        assert kept_ours.tolist() == theirs.token_idx[theirs.valid].view(1, -1).tolist()


def test_streaming_circular_equals_the_generic_layer_with_padding_prefill_and_generation(tiny_llama, monkeypatch):
    long, short = ids_of(1, 40, seed=22), ids_of(1, 23, seed=23)
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 17:], mask[1, 17:] = short[0], 1
    fast_cache = kvcompress.cache_for(tiny_llama, "streaming", budget=14, sinks=3)
    fast, fast_ids = cache_logits(tiny_llama, batch, fast_cache, mask, 8)
    generic_cache = kvcompress.cache_for(tiny_llama, "streaming", budget=14, sinks=3, circular=False)
    generic, generic_ids = cache_logits(tiny_llama, batch, generic_cache, mask, 8)
    torch.testing.assert_close(fast, generic, rtol=1e-4, atol=1e-5)
    assert torch.equal(fast_ids, generic_ids)
    ours, theirs = fast_cache.compressed_layers[1], generic_cache.compressed_layers[1]
    for row in range(2):
        assert (
            ours.token_idx[row, 0][ours.valid[row, 0]].tolist()
            == theirs.token_idx[row, 0][theirs.valid[row, 0]].tolist()
        )


def test_streaming_circular_applies_the_models_sliding_window(monkeypatch):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.2,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
        pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = ids_of(1, 50, seed=24)
    fast = stream_nll(model, ids, kvcompress.cache_for(model, "streaming", budget=12, sinks=2), 5)
    generic = stream_nll(model, ids, kvcompress.cache_for(model, "streaming", budget=12, sinks=2, circular=False), 5)
    torch.testing.assert_close(fast, generic, rtol=1e-4, atol=1e-5)


def test_a_budget_not_divisible_is_rounded_down_and_never_exceeded(tiny_llama):
    config = make_config("cascade", budget=11, sinks=4, cascades=4)  # |C| = 7 -> W = 1, 8 slots used
    assert (config.width, config.used_budget) == (1, 8)
    cache = kvcompress.cache_for(tiny_llama, config)
    with torch.no_grad():
        tiny_llama(torch.arange(1, 41)[None], **cache_argument(tiny_llama, cache))
    assert max(cache.tokens_stored()) == 8
