"""Each baseline keeps exactly the tokens its rule selects on hand-made keys and attention (reference in-test)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompress.methods.random import hash_uniform
from kvcompress.registry import make_config
from tests.helpers import filled_layer, kept_tokens, stats_from_rows

B, H, G, L, D = 2, 2, 3, 20, 8


def random_keys(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(seed))


def random_rows(queries: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(B, H, G, queries, L, generator=torch.Generator().manual_seed(seed)) * 3
    return logits.softmax(-1)


def evict(config, rows=None, keys=None):
    layer = filled_layer(config, random_keys() if keys is None else keys)
    layer.after_attention(None if rows is None else stats_from_rows(rows))
    return layer


def sorted_rows(index: torch.Tensor) -> list[list[list[int]]]:
    return index.sort(-1).values.tolist()


def top_newest_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Reference top-k per row with ties going to the later token."""
    rows = [
        sorted(range(len(row)), key=lambda i, row=row: (-float(row[i]), -i))[:k]
        for row in scores.reshape(-1, scores.shape[-1])
    ]
    return torch.tensor(rows).reshape(*scores.shape[:-1], k)


def test_window_keeps_the_most_recent_tokens():
    layer = evict(make_config("window", budget=6))
    assert kept_tokens(layer) == [[list(range(14, 20))] * H] * B


def test_streaming_keeps_sinks_and_the_most_recent_tokens():
    layer = evict(make_config("streaming", budget=7, sinks=3))
    assert kept_tokens(layer) == [[[0, 1, 2, 16, 17, 18, 19]] * H] * B


def test_h2o_keeps_recent_window_and_heaviest_accumulated_mass_per_head():
    rows = random_rows(queries=L)
    layer = evict(make_config("h2o", budget=8, heavy_ratio=0.5), rows)
    mass = rows.sum(dim=(2, 3))  # summed over the query heads of each KV head and over queries
    heavy = mass[..., : L - 4].topk(4, dim=-1).indices
    expected = torch.cat([heavy, torch.arange(L - 4, L).expand(B, H, 4)], -1)
    assert kept_tokens(layer) == sorted_rows(expected)
    assert kept_tokens(layer)[0][0] != kept_tokens(layer)[0][1]  # heads choose independently


def test_tova_keeps_top_current_attention_averaged_over_heads():
    rows = random_rows(queries=3)
    layer = evict(make_config("tova", budget=5), rows)
    current = rows[:, :, :, -1].mean(dim=(1, 2))  # [B, L]: last query, all heads of the layer
    expected = current.topk(5, dim=-1).indices[:, None].expand(B, H, 5)
    assert kept_tokens(layer) == sorted_rows(expected)


def test_scissorhands_evicts_most_often_below_average_tokens_and_keeps_recent():
    rows = random_rows(queries=10)
    layer = evict(make_config("scissorhands", budget=8, history=10, recent=2), rows)
    below = (rows.mean(dim=2) < 1.0 / L).sum(dim=2).double()  # [B, H, L] low counts over the window
    score = torch.arange(L).double() / (L + 1) - below
    score[..., L - 2 :] = float("inf")
    expected = score.topk(8, dim=-1).indices
    assert kept_tokens(layer) == sorted_rows(expected)


def test_scissorhands_history_window_forgets_old_queries():
    config = make_config("scissorhands", budget=30, history=2)
    layer = filled_layer(config, random_keys())
    for seed in range(3):
        layer.seen += 1  # each observation is of the next query (the window's ring is indexed by stream index)
        layer.after_attention(stats_from_rows(random_rows(queries=1, seed=seed)))
    latest = torch.cat([random_rows(1, seed=s) for s in (1, 2)], dim=3).mean(dim=2) < 1.0 / L
    assert torch.equal(layer.state["low"].sum(-1), latest.sum(dim=2))


def test_snapkv_votes_of_observation_window_pooled_then_top_k_plus_window():
    window, budget = 4, 9
    rows = random_rows(queries=window)
    layer = evict(make_config("snapkv", budget=budget, window=window, kernel=3), rows)
    votes = rows.sum(dim=3).mean(dim=2)[..., : L - window]  # the prefix only is pooled (the authors' code)
    pooled = F.max_pool1d(votes.reshape(-1, 1, L - window), 3, 1, 1).reshape(B, H, L - window)
    prefix = top_newest_first(pooled, budget - window)
    expected = torch.cat([prefix, torch.arange(L - window, L).expand(B, H, window)], -1)
    assert kept_tokens(layer) == sorted_rows(expected)


def test_snapkv_pools_the_prefix_only_so_window_votes_do_not_leak_onto_its_edge():
    """The issue's case: 16 tokens, window 4, kernel 7, budget 6, prefix attention only on tokens 1 and 3. Pooling
    the whole row gave the window's votes to tokens 9-11 and kept 10 and 11, which received nothing."""
    length, window = 16, 4
    rows = torch.zeros(1, 1, 1, window, length)
    rows[..., 1], rows[..., 3] = 1.0, 2.0
    for q in range(window):  # each window query also attends causally to the window
        rows[..., q, length - window : length - window + q + 1] = 1.0
    rows = rows / rows.sum(-1, keepdim=True)
    config = make_config("snapkv", budget=6, window=window, kernel=7)
    layer = filled_layer(config, torch.randn(1, 1, length, D, generator=torch.Generator().manual_seed(0)))
    layer.after_attention(stats_from_rows(rows))
    kept = kept_tokens(layer)[0][0]
    assert kept[-window:] == list(range(12, 16)) and not {9, 10, 11} & set(kept)
    # every prefix token within 3 of token 3 ties at its pooled vote; ties keep the newest: 5 and 6
    assert kept == [5, 6, 12, 13, 14, 15]


def test_snapkv_ratio_keeps_that_share_of_the_prompt_once():
    layer = evict(make_config("snapkv", ratio=0.5, window=2, kernel=1), random_rows(queries=2))
    assert layer.stored_length() == L // 2
    layer.update(random_keys(1)[:, :, :1], random_keys(2)[:, :, :1])
    layer.register_new_tokens(None, None)
    layer.after_attention(stats_from_rows(random_rows(queries=1)))
    assert layer.stored_length() == L // 2 + 1  # decoding appends; one-shot never evicts again


def test_random_keeps_highest_hash_draws_and_depends_on_seed():
    first = evict(make_config("random", budget=6, seed=3))
    heads = torch.arange(H)[None, :, None]
    draws = hash_uniform(3, 0, heads, torch.arange(L)[None, None, :]).expand(B, H, L)
    assert kept_tokens(first) == sorted_rows(draws.topk(6, dim=-1).indices)
    other = evict(make_config("random", budget=6, seed=4))
    assert kept_tokens(first) != kept_tokens(other)


def test_hash_uniform_is_roughly_uniform():
    draws = hash_uniform(0, 0, torch.zeros(1, dtype=torch.long), torch.arange(20000))
    histogram = torch.histc(draws.float(), bins=10, min=0, max=1)
    assert draws.min() >= 0 and draws.max() < 1
    assert (histogram - 2000).abs().max() < 200


def test_knorm_keeps_lowest_key_norms_per_head():
    keys = random_keys()
    layer = evict(make_config("knorm", budget=5, recent=0), keys=keys)
    expected = (-keys.norm(dim=-1)).topk(5, dim=-1).indices
    assert kept_tokens(layer) == sorted_rows(expected)


def test_knorm_keeps_its_recent_window_and_never_evicts_the_forward_being_fed():
    keys = random_keys()
    layer = evict(make_config("knorm", budget=8, recent=2), keys=keys)  # a 20-token prompt: ranked by norm
    older = (-keys[:, :, : L - 2].norm(dim=-1)).topk(6, dim=-1).indices
    expected = torch.cat([older, torch.arange(L - 2, L).expand(B, H, 2)], -1)
    assert kept_tokens(layer) == sorted_rows(expected)
    question = torch.full((B, H, 5, D), 100.0)  # five huge-norm keys fed in one forward (a question)
    layer.update(question, question)
    layer.register_new_tokens(None, None)
    layer.after_attention(None)
    kept = kept_tokens(layer)
    assert all(row[-5:] == list(range(L, L + 5)) and len(row) == 8 for seq in kept for row in seq)
