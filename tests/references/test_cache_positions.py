"""``position_mode="cache"`` against its definition (StreamingLLM's re-indexing): after eviction, the logits of every
new token equal those of a fresh forward of the model (its own SDPA attention and ``DynamicCache``) over exactly the
tokens that token attends to, at positions ``0 .. k-1``.

A one-layer model makes this an identity (the keys and values of layer 0 depend on the token only; deeper layers'
keys would carry the context they were computed in). Which tokens a new token attends to is read from the cache
before and after the forward (``layer.token_idx`` where ``layer.valid``): methods that evict after attending
(streaming, BUZZ, one-shot streaming, the cascade's chunked prefill) attend to what was stored before plus the
forward's own tokens; the cascade's exact mode inserts first, so a token attends to what is stored after it.
Token by token and in chunks, without and with left padding (each sequence re-indexed over its own real tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvcompress
from kvcompress.generation import cache_argument
from tests.references.driver import kept_sets, token_ids


def one_layer_model(tiny_llama, kv_heads: int):
    """The tiny Llama's shapes with one decoder layer: (model for the cache, an SDPA copy for the reference)."""
    config = copy.deepcopy(tiny_llama.config)
    config.num_hidden_layers = 1
    config.num_key_value_heads = kv_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    return model, copy.deepcopy(model)


@pytest.fixture(scope="module")
def gqa(tiny_llama):
    return one_layer_model(tiny_llama, kv_heads=2)


@pytest.fixture(scope="module")
def mqa(tiny_llama):
    return one_layer_model(tiny_llama, kv_heads=1)  # one KV head: a per-head method keeps one token set


@torch.no_grad()
def compare_with_fresh_forwards(models, method, params, *, length=30, chunk=1, pads=(0,), prompt=0, insert_first=False):
    """Feed ``length`` stream tokens (a first forward of ``prompt`` tokens, then ``chunk`` at a time) and compare
    every real token's logits with a fresh forward; returns how many compared tokens attended after an eviction."""
    model, reference = models
    cache = kvcompress.cache_for(model, method, **params)
    layer = cache.compressed_layers[0]
    ids = token_ids(len(pads), length, seed=1)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    bounds = [0, *range(prompt or chunk, length, chunk), length]
    after = [[[]] for _ in pads]
    evicted = 0
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        before = after
        logits = model(
            input_ids=ids[:, start:stop],
            attention_mask=mask[:, :stop],
            position_ids=positions[:, start:stop],
            **cache_argument(model, cache),
            use_cache=True,
        ).logits
        after = kept_sets(layer)
        for b in range(len(pads)):
            real = [t for t in range(start, stop) if mask[b, t]]
            if not real:
                continue
            heads = after[b] if insert_first else before[b]
            assert all(h == heads[0] for h in heads), "the kept set differs between KV heads"
            tokens = heads[0] if insert_first else heads[0] + real
            assert tokens[len(tokens) - len(real) :] == real
            fresh = reference(input_ids=ids[b, tokens][None], position_ids=torch.arange(len(tokens))[None]).logits
            got = logits[b, [t - start for t in real]]
            torch.testing.assert_close(got, fresh[0, -len(real) :], rtol=1e-4, atol=1e-4)
            evicted += tokens != [t for t in range(real[-1] + 1) if mask[b, t]]
    return evicted


STREAMING = [  # budget, sinks, chunk, pads
    (6, 4, 1, (0,)),
    (8, 2, 3, (0, 3)),
    (5, 0, 1, (0, 4)),
    (7, 1, 4, (0,)),
    (4, 3, 2, (5, 0)),
]


@pytest.mark.parametrize("circular", [True, False], ids=["circular", "generic"])
@pytest.mark.parametrize(("budget", "sinks", "chunk", "pads"), STREAMING)
def test_streaming_logits_equal_a_fresh_forward_over_the_kept_tokens(budget, sinks, chunk, pads, circular, gqa):
    params = {"budget": budget, "sinks": sinks, "circular": circular}
    assert compare_with_fresh_forwards(gqa, "streaming", params, chunk=chunk, pads=pads) >= 5


@pytest.mark.parametrize("pads", [(0,), (0, 3)], ids=["unpadded", "left-padded"])
def test_cascade_exact_logits_equal_a_fresh_forward_over_the_cache_after_insertion(pads, gqa):
    params = {"budget": 10, "sinks": 2, "cascades": 4}
    assert compare_with_fresh_forwards(gqa, "cascade", params, pads=pads, insert_first=True) >= 5


def test_cascade_chunked_prefill_logits_equal_a_fresh_forward_over_cache_and_chunk(gqa):
    params = {"budget": 10, "sinks": 2, "cascades": 4, "prefill": "chunked"}
    assert compare_with_fresh_forwards(gqa, "cascade", params, chunk=3, pads=(0, 4)) >= 5


@pytest.mark.parametrize(("chunk", "pads"), [(1, (0,)), (3, (0, 4))])
def test_buzz_cache_positions_equal_a_fresh_forward_over_the_kept_tokens(chunk, pads, mqa):
    params = {"sinks": 2, "window": 4, "threshold": 6, "stride": 3, "position_mode": "cache"}
    assert compare_with_fresh_forwards(mqa, "buzz", params, chunk=chunk, pads=pads) >= 5


@pytest.mark.parametrize("pads", [(0,), (3, 0)], ids=["unpadded", "left-padded"])
def test_one_shot_streaming_decodes_at_cache_positions(pads, gqa):
    params = {"ratio": 0.5, "sinks": 2}
    assert compare_with_fresh_forwards(gqa, "streaming_oneshot", params, prompt=16, pads=pads) >= 5
