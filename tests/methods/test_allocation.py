"""Budget allocation (methods/allocation.py): PyramidKV's per-layer schedule against kvpress's formula re-derived in
the reference, AdaKV's per-head share with a floor that binds, and what uneven heads store and report."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.allocation import heads_share, pyramid_count
from kvcompress.methods.keydiff import KeyDiffConfig
from tests.helpers import filled_layer
from tests.references.scorer_rules import pyramid_budget


@pytest.mark.parametrize("n", [19, 64, 100, 1000, 4096])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("window", [0, 8, 64])
@pytest.mark.parametrize("beta", [1, 2, 20])
def test_pyramid_schedule_is_kvpress_formula(n, ratio, window, beta):
    for layers in (1, 2, 24, 30):
        for layer in range(layers):
            want = pyramid_budget(n, n * ratio, window, beta, layer, layers)
            assert pyramid_count(n, n * ratio, window, beta, layer, layers) == want


def test_pyramid_budgets_shrink_with_depth_and_average_the_ratio():
    counts = [pyramid_count(4096, 2048.0, 64, 20, layer, 30) for layer in range(30)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 3 * counts[-1]
    assert abs(sum(counts) / 30 - 2048) <= 1


def test_adakv_floor_keeps_a_share_of_every_head():
    """Head 0 outscores head 1 everywhere: without a floor head 1 loses everything, with alpha it keeps its best."""
    keys = torch.randn(1, 2, 10, 4)
    scores = torch.stack([torch.arange(10.0) + 100, torch.arange(10.0)])[None]  # [1, 2, 10]
    layer = filled_layer(KeyDiffConfig(budget=4), keys)
    total = torch.tensor([8])
    no_floor = heads_share(layer, scores, None, total).keep
    assert no_floor[0, 0].sum() == 8 and no_floor[0, 1].sum() == 0
    floored = heads_share(layer, scores, None, total, torch.tensor([2])).keep
    assert floored[0, 1].nonzero().flatten().tolist() == [8, 9]  # head 1's two best
    assert floored[0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 9]  # head 0 the rest of the 8


def test_adakv_ties_evict_the_older_token_then_the_lower_head():
    layer = filled_layer(KeyDiffConfig(budget=2), torch.randn(1, 2, 3, 4))
    kept = heads_share(layer, torch.zeros(1, 2, 3), None, torch.tensor([3])).keep
    assert kept[0].tolist() == [[False, False, True], [False, True, True]]  # (t0,h0), (t0,h1), (t1,h0) go


@pytest.mark.parametrize("ragged", [True, False])
def test_uneven_heads_store_their_counts_and_decode(tiny_llama, ragged):
    """AdaKV heads keep different counts: ragged storage (the default) holds their sum plus at most one block of
    slack per head; the slot layout (``ragged=False``) holds the fullest head's count per head. ``nbytes`` says
    which, and the cache decodes on (the kept sets through decoding are checked in
    tests/references/test_kept_sets.py)."""
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = kvcompress.cache_for(tiny_llama, "expected_attention", ratio=0.5, allocation="adakv", ragged=ragged)
    prefill(tiny_llama, ids, cache)
    per_head = [layer.valid.sum(-1)[0].tolist() for layer in cache.compressed_layers]
    assert all(sum(heads) == 2 * 20 for heads in per_head)
    assert any(len(set(heads)) > 1 for heads in per_head)  # uneven somewhere
    kv_heads, token_bytes = 2, 16 * 2 * 4  # keys + values of head_dim 16, float32
    if ragged:
        blocks = [layer.pool.block for layer in cache.compressed_layers]
        pairs = zip(per_head, blocks, strict=True)
        held = sum(-(-n // block) * block * token_bytes for heads, block in pairs for n in heads)
    else:
        held = sum(max(heads) * kv_heads * token_bytes for heads in per_head)
    assert cache.nbytes() == held
    assert cache.tokens_stored() == [max(heads) for heads in per_head]
    next_ids = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(5))
    logits = tiny_llama(next_ids, **cache_argument(tiny_llama, cache), use_cache=True).logits
    assert torch.isfinite(logits).all()
