"""One-shot baselines (``*_oneshot``): each keeps exactly what its rule selects, once, at the ratio budget."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.hashing import hash_uniform
from kvcompress.methods.random import layer_draws
from kvcompress.registry import make_config
from tests.helpers import filled_layer, kept_tokens, stats_from_rows

B, H, G, L, D = 2, 2, 3, 20, 8


def random_rows(queries: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(B, H, G, queries, L, generator=torch.Generator().manual_seed(seed)) * 3
    return logits.softmax(-1)


def evict(config, rows):
    layer = filled_layer(config, torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(0)))
    layer.after_attention(stats_from_rows(rows))
    return layer


def sorted_rows(index: torch.Tensor) -> list[list[list[int]]]:
    return index.sort(-1).values.tolist()


def test_h2o_oneshot_keeps_recent_half_and_heaviest_prompt_mass_per_head():
    rows = random_rows(queries=L)
    layer = evict(make_config("h2o_oneshot", ratio=0.4), rows)  # keep 8: 4 recent + 4 heavy
    mass = rows.sum(dim=(2, 3))
    heavy = mass[..., : L - 4].topk(4, dim=-1).indices
    expected = torch.cat([heavy, torch.arange(L - 4, L).expand(B, H, 4)], -1)
    assert kept_tokens(layer) == sorted_rows(expected)
    assert kept_tokens(layer)[0][0] != kept_tokens(layer)[0][1]


def test_tova_oneshot_keeps_top_last_token_attention_averaged_over_heads():
    rows = random_rows(queries=3)
    layer = evict(make_config("tova_oneshot", ratio=0.25), rows)
    current = rows[:, :, :, -1].mean(dim=(1, 2))
    expected = current.topk(5, dim=-1).indices[:, None].expand(B, H, 5)
    assert kept_tokens(layer) == sorted_rows(expected)


def test_scissorhands_oneshot_evicts_most_often_below_average_and_keeps_recent_quarter():
    rows = random_rows(queries=10)
    layer = evict(make_config("scissorhands_oneshot", ratio=0.4, history=10), rows)  # keep 8, 2 recent
    below = (rows.mean(dim=2) < 1.0 / L).sum(dim=2).double()
    score = torch.arange(L).double() / (L + 1) - below
    score[..., L - 2 :] = float("inf")
    assert kept_tokens(layer) == sorted_rows(score.topk(8, dim=-1).indices)


def test_streaming_oneshot_keeps_sinks_and_recent_prompt_tokens():
    layer = evict(make_config("streaming_oneshot", ratio=0.35, sinks=3), random_rows(queries=1))
    assert kept_tokens(layer) == [[[0, 1, 2, 16, 17, 18, 19]] * H] * B


@pytest.mark.parametrize("method", ["h2o_oneshot", "tova_oneshot", "scissorhands_oneshot", "streaming_oneshot"])
def test_compresses_once_then_decoding_appends(method):
    layer = evict(make_config(method, ratio=0.5), random_rows(queries=L))
    assert layer.stored_length() == L // 2
    for _ in range(3):
        layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        layer.register_new_tokens(None, None)
        stored = layer.stored_length()
        layer.after_attention(stats_from_rows(torch.randn(B, H, G, 1, stored).softmax(-1)))
    assert layer.stored_length() == L // 2 + 3


@pytest.mark.parametrize("method", ["h2o_oneshot", "tova_oneshot", "scissorhands_oneshot", "streaming_oneshot"])
def test_needs_exactly_one_budget(method):
    with pytest.raises(ValueError, match="exactly one of ratio"):
        make_config(method)
    with pytest.raises(ValueError, match="ratio"):
        make_config(method, ratio=0.0)


@pytest.mark.parametrize("seed", [0, 7, 2**63 - 1])
def test_random_draws_of_a_forward_equal_the_documented_hash_for_every_layer(seed):
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    heads = torch.arange(3)[None, :, None]
    for layer in (0, 1, 63, 64, 130):
        expected = hash_uniform(seed, layer, heads, positions[:, None, :])
        assert torch.equal(layer_draws(positions, seed, layer, 3), expected)
