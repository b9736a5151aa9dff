"""LESS's decoding step as one softmax over the stored keys and the state's rows: equal to Eq. 3's log-sum-exp mix
with the base policy's statistics, taken by real decoding steps; the cache's states stacked with current ratios."""

from __future__ import annotations

import pytest
import torch

import kvcompress
import kvcompress.methods.less.policy as less_policy
from kvcompress.core.attention import attention_with_stats
from kvcompress.core.contract import StatsRequest
from kvcompress.core.forward import ForwardPass
from kvcompress.generation import cache_argument
from kvcompress.methods.less import LessConfig
from kvcompress.methods.less.low_rank_slots import low_rank_slots_attention, state_ratio
from kvcompress.methods.less.policy import mix_low_rank
from tests.methods.test_less import decode_logits, ids_of, strong_kernels

REQUEST = StatsRequest(received=True, last_queries=1)


def random_step(seed: int, logit_scale: float = 1.0, empty_rows: bool = True):
    """One decoding step's tensors: 4 query heads over 2 KV heads, 11 stored keys, a state of rank 3."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 4, 1, 8, generator=generator) * logit_scale
    key, value = (torch.randn(2, 2, 11, 8, generator=generator) for _ in range(2))
    features = torch.rand(2, 4, 1, 3, generator=generator)
    psi = torch.rand(2, 2, 5, 3, generator=generator)  # five evicted tokens
    if empty_rows:
        psi[0, 1, :, 2] = 0  # a state row no evicted token reached: z = 0 and H = 0 there
    evicted = torch.randn(2, 2, 5, 8, generator=generator)
    low_rank = psi.transpose(-1, -2) @ torch.cat([evicted, torch.ones(2, 2, 5, 1)], dim=-1)  # [H | z]
    return query, key, value, features, low_rank


def heads_first(features):
    """``[B, H_q, 1, R]`` -> ``[H_q, B, R]``: φ as the decoding step takes it (``phi_head_major``)."""
    return features.squeeze(2).transpose(0, 1)


def eq3_mix(query, key, value, features, low_rank):
    """The general path: the sparse softmax with its log-normaliser, then Eq. 3's mix."""
    request = StatsRequest(received=True, last_queries=1, lse=True)
    output, stats = attention_with_stats(query, key, value, None, None, request, rows_see_keys=True)
    grouped = features.view(2, 2, 2, 3)  # [B, H_kv, G, R]
    num = (grouped @ low_rank[..., :-1]).view(2, 4, 1, -1)
    den = (grouped @ low_rank[..., -1:]).view(2, 4, 1)
    return mix_low_rank(stats.lse, output, num, den), stats


@pytest.mark.parametrize("logit_scale", [1.0, 40.0], ids=["plain", "large-logits"])
def test_slots_attention_equals_the_eq3_mix_and_the_sparse_statistics(logit_scale):
    query, key, value, features, low_rank = random_step(0, logit_scale)
    output, stats = low_rank_slots_attention(
        query, key, value, None, heads_first(features), low_rank, state_ratio(low_rank), REQUEST
    )
    expected, sparse = eq3_mix(query, key, value, features, low_rank)
    assert bool(torch.isfinite(output).all())
    torch.testing.assert_close(output, expected)
    # LESS's mass stays out of the policy's scores: they are the sparse softmax's, bit for bit
    assert torch.equal(stats.received, sparse.received) and torch.equal(stats.last, sparse.last)
    assert stats.query_count == 1 and stats.last_visible is None


def test_an_empty_state_takes_no_mass():
    query, key, value, features, low_rank = random_step(1)
    empty = torch.zeros_like(low_rank)
    output, stats = low_rank_slots_attention(
        query, key, value, None, heads_first(features), empty, state_ratio(empty), REQUEST
    )
    sparse_output, sparse = attention_with_stats(query, key, value, None, None, REQUEST, rows_see_keys=True)
    torch.testing.assert_close(output, sparse_output)  # to rounding: the softmax runs over the state's rows too
    assert torch.equal(stats.received, sparse.received)
    assert bool((state_ratio(empty) == 0).all())


def test_statistics_are_computed_only_when_asked_and_the_output_keeps_the_dtype():
    query, key, value, features, low_rank = (t.bfloat16() if i < 3 else t for i, t in enumerate(random_step(2)))
    output, stats = low_rank_slots_attention(
        query, key, value, None, heads_first(features), low_rank, state_ratio(low_rank), StatsRequest()
    )
    assert output.dtype == torch.bfloat16 and stats.received is None and stats.last is None
    expected, _ = eq3_mix(query.float(), key.float(), value.float(), features, low_rank)
    torch.testing.assert_close(output.float(), expected, rtol=2e-2, atol=2e-2)  # bfloat16 inputs and output


def test_decoding_steps_take_the_slots_path(tiny_llama, monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return low_rank_slots_attention(*args, **kwargs)

    monkeypatch.setattr(less_policy, "low_rank_slots_attention", counted)
    ids = ids_of(1, 30, seed=7)
    config = LessConfig(base="h2o", budget=12, kernels=strong_kernels(tiny_llama))
    decode_logits(tiny_llama, ids, kvcompress.cache_for(tiny_llama, config))
    layers = tiny_llama.config.num_hidden_layers
    assert len(calls) == layers * (30 - 13)  # every step after the first eviction (token 12, the 13th)


def test_the_states_are_stacked_and_their_ratios_current_after_a_batch_reorder(tiny_llama):
    ids = ids_of(2, 30, seed=8)
    config = LessConfig(base="h2o", budget=10, kernels=strong_kernels(tiny_llama))
    stacked, alone = (kvcompress.cache_for(tiny_llama, config) for _ in range(2))
    for layer in alone.compressed_layers:
        layer.forward_pass = ForwardPass([layer])  # each layer a forward of its own: it folds at once, into its state

    def storages() -> int:
        return len({layer.stored_low_rank.untyped_storage().data_ptr() for layer in stacked.compressed_layers})

    for cache in (stacked, alone):
        decode_logits(tiny_llama, ids[:, :20], cache)
    assert storages() == 1
    for cache in (stacked, alone):
        cache.reorder_cache(torch.tensor([1, 0]))  # as beam search does: every state replaced
    assert storages() == len(stacked.compressed_layers)
    logits = decode_logits(tiny_llama, ids[:, 20:], stacked)
    torch.testing.assert_close(logits, decode_logits(tiny_llama, ids[:, 20:], alone), rtol=1e-5, atol=1e-6)
    assert storages() == 1  # stacked again at the first fold after the reorder
    for mine, theirs in zip(stacked.compressed_layers, alone.compressed_layers, strict=True):
        torch.testing.assert_close(mine.low_rank, theirs.low_rank, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine.ratio, state_ratio(mine.low_rank), rtol=0, atol=0)


def test_kernels_whose_psi_is_zero_never_fold(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=8, init="zero"))
    decode_logits(tiny_llama, ids_of(1, 20, seed=9), cache)
    assert all(layer.policy.inert and not layer.folded for layer in cache.compressed_layers)
    warm = kvcompress.cache_for(tiny_llama, LessConfig(base="h2o", budget=8))  # the paper's init: ψ small, not 0
    decode_logits(tiny_llama, ids_of(1, 20, seed=9), warm)
    assert all(not layer.policy.inert and layer.folded for layer in warm.compressed_layers)


def test_decoding_with_gradients_on_folds_without_recording_them(tiny_llama):
    """A forward outside ``torch.no_grad`` (the folds enter it themselves): the same states, none recording a graph."""
    ids = ids_of(1, 24, seed=4)
    caches = [kvcompress.cache_for(tiny_llama, LessConfig(budget=8, kernels=strong_kernels(tiny_llama))) for _ in "ab"]
    with torch.enable_grad():
        for t in range(ids.shape[1]):
            tiny_llama(ids[:, t : t + 1], **cache_argument(tiny_llama, caches[0]))
    decode_logits(tiny_llama, ids, caches[1])  # under torch.no_grad
    for graded, plain in zip(caches[0].compressed_layers, caches[1].compressed_layers, strict=True):
        assert not graded.low_rank.requires_grad and graded.low_rank.grad_fn is None
        torch.testing.assert_close(graded.low_rank, plain.low_rank)
        assert bool(graded.low_rank.abs().sum() > 0)  # tokens were folded
