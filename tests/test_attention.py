"""The attention function's statistics equal those of the explicit attention matrix; RoPE re-rotation is exact."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core import attention, softmax
from kvcompress.core.contract import StatsRequest
from kvcompress.core.fused_attention import attention_with_lse, chunked_attention_with_lse
from kvcompress.core.rope import rotate_by

B, HQ, HKV, Q, L, D = 2, 6, 2, 5, 12, 8


def naive(query, key, value, mask, scale):
    key = key.repeat_interleave(HQ // HKV, dim=1)
    value = value.repeat_interleave(HQ // HKV, dim=1)
    full_mask = mask.repeat_interleave(HQ // HKV, dim=1) if mask.shape[1] > 1 else mask
    probs = ((query @ key.transpose(-1, -2)) * scale).masked_fill(~full_mask, float("-inf")).softmax(-1)
    return probs @ value, probs


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(B, h, n, D, generator=g) for h, n in ((HQ, Q), (HKV, L), (HKV, L)))
    mask = torch.rand(B, HKV, Q, L, generator=g) > 0.3
    mask[..., -1] = True  # no empty row
    return query, key, value, mask


@pytest.mark.parametrize("received", [True, False])
def test_statistics_equal_the_explicit_attention_matrix(inputs, received, monkeypatch):
    monkeypatch.setattr(softmax, "CHUNK_ELEMENTS", HQ * L * 2 * B)  # force several query chunks
    query, key, value, mask = inputs
    output, stats = attention.attention_with_stats(
        query, key, value, mask, 0.3, StatsRequest(received=received, last_queries=3)
    )
    expected, probs = naive(query, key, value, mask, 0.3)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    grouped = probs.view(B, HKV, HQ // HKV, Q, L)
    torch.testing.assert_close(stats.last, grouped[:, :, :, -3:], rtol=1e-5, atol=1e-6)
    if received:
        torch.testing.assert_close(stats.received, grouped.sum(dim=3), rtol=1e-5, atol=1e-5)
    else:
        assert stats.received is None


@pytest.mark.parametrize("queries", [Q, L])
@pytest.mark.parametrize("lse", [True, False])
def test_plain_causal_softmax_equals_the_explicit_causal_mask(inputs, queries, lse, monkeypatch):
    """``mask=None`` with several queries: causal attention of the last ``q`` of ``L`` keys, computed in row chunks
    that see only their visible keys (three rows per chunk here), equals the explicit mask's result."""
    monkeypatch.setattr(softmax, "CAUSAL_ROWS", 3)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(B, HQ, queries, D, generator=g)
    _, key, value, _ = inputs
    causal = softmax.causal_mask(queries, L, query.device)
    expected, probs = naive(query, key, value, causal, 0.3)
    parts = softmax.chunked_softmax(query, key, None, 0.3, value=value, lse=lse, received=True, last_n=4)
    torch.testing.assert_close(parts.output, expected, rtol=1e-5, atol=1e-5)
    grouped = probs.view(B, HKV, HQ // HKV, queries, L)
    torch.testing.assert_close(parts.received, grouped.sum(dim=3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.last, grouped[:, :, :, -4:], rtol=1e-5, atol=1e-6)
    if lse:
        logits = (query @ key.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2)) * 0.3
        expected_lse = logits.masked_fill(~causal, float("-inf")).logsumexp(-1)
        torch.testing.assert_close(parts.lse, expected_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention.sdpa(query, key, value, None, 0.3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("received", [True, False])
@pytest.mark.parametrize("queries", [Q, L])
def test_plain_causal_statistics_build_only_the_last_rows_mask(inputs, queries, received, monkeypatch):
    """A plain causal prefill (``mask=None``) asking for its last rows: the output, the rows and their visibility
    equal the explicit causal mask's, and no mask wider than those rows is built (a ``q x L`` boolean mask is
    256 MiB at 16K tokens: it made SnapKV's peak at 16K tokens 0.59x the full cache's bytes)."""
    built = []
    causal_mask = attention.causal_mask

    def recorded(rows, length, device):
        built.append(rows)
        return causal_mask(rows, length, device)

    monkeypatch.setattr(attention, "causal_mask", recorded)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(B, HQ, queries, D, generator=g)
    _, key, value, _ = inputs
    output, stats = attention.attention_with_stats(
        query, key, value, None, 0.3, StatsRequest(received=received, last_queries=3)
    )
    causal = softmax.causal_mask(queries, L, query.device)
    expected, probs = naive(query, key, value, causal, 0.3)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        stats.last, probs.view(B, HKV, HQ // HKV, queries, L)[:, :, :, -3:], rtol=1e-5, atol=1e-6
    )
    assert torch.equal(stats.last_visible, causal[:, :, -3:])
    sdpa_mask = [queries] if queries < L and not received else []  # SDPA's own, for a chunk after earlier keys
    assert sorted(built) == sorted([3, *sdpa_mask])


def test_sdpa_path_matches_explicit_attention(inputs):
    query, key, value, mask = inputs
    expected, _ = naive(query, key, value, mask, 0.3)
    torch.testing.assert_close(attention.sdpa(query, key, value, mask, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_rerotation_equals_rotating_at_the_new_position():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    x = torch.randn(3, 7, D)
    start = torch.randint(0, 500, (3, 7))
    target = torch.randint(0, 500, (3, 7))
    once = rotate_by(rotate_by(x, start, inv_freq), target - start, inv_freq)
    torch.testing.assert_close(once, rotate_by(x, target, inv_freq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("function", [attention_with_lse, chunked_attention_with_lse], ids=["cpu-kernel", "fallback"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "every-key"])
def test_attention_with_lse_equals_explicit_softmax(causal, function):
    """The output and log-normalisers equal explicit float32 attention, from the fused CPU kernel and from the
    chunked softmax that devices without such a kernel take: causal over the queries' own keys, or over every key of
    a longer sequence."""
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, groups, queries, dim = 2, 2, 3, 7, 8
    length = queries if causal else 11
    query = torch.randn(batch, kv_heads * groups, queries, dim, generator=generator)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    output, lse = function(query, key, value, 0.3, causal=causal)
    logits = query.view(batch, kv_heads, groups, queries, dim) @ key[:, :, None].transpose(-1, -2) * 0.3
    if causal:
        logits = logits.masked_fill(~softmax.causal_mask(queries, queries, query.device)[:, :, None], -torch.inf)
    expected = (logits.softmax(-1) @ value[:, :, None]).view_as(query)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, logits.logsumexp(-1).view(batch, -1, queries), atol=1e-5, rtol=1e-5)
