"""Compactor's own mechanics beyond the reference kept sets (tests/references): the prompt's queries it holds until
it compresses belong to the current prompt only; a run of slots is read as a view, any other index copied; the
non-causal attention taken a block of chunks at a time is the padded softmax."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods import compactor
from kvcompress.methods.compactor import gathered


def kept(cache) -> list:
    return [layer.token_idx[layer.valid].tolist() for layer in cache.compressed_layers]


@torch.no_grad()
def test_a_reset_in_the_middle_of_a_chunked_prompt_forgets_its_queries(tiny_llama):
    params = {"ratio": 0.5, "chunk_size": 4, "sink_size_start": 2, "sink_size_end": 1}
    first = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    prompt = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(1))
    cache = kvcompress.cache_for(tiny_llama, "compactor", **params)
    with cache.deferred_compression():  # a prompt abandoned before it compressed
        tiny_llama(input_ids=first, **cache_argument(tiny_llama, cache), use_cache=True)
        cache.reset()
    prefill(tiny_llama, prompt, cache, chunk_size=5)
    fresh = kvcompress.cache_for(tiny_llama, "compactor", **params)
    prefill(tiny_llama, prompt, fresh, chunk_size=5)
    assert kept(cache) == kept(fresh)
    assert cache.tokens_stored() == [10, 10]


def test_gathered_views_a_run_of_slots_and_copies_any_other_index():
    x = torch.arange(2 * 10 * 3.0).view(2, 10, 3)
    run, holes = torch.arange(2, 7), torch.tensor([1, 2, 4, 5])
    viewed, doubled = gathered(run, x, 2 * x)
    assert torch.equal(viewed, x[:, 2:7]) and viewed.data_ptr() == x[:, 2:].data_ptr()  # a view, nothing copied
    assert torch.equal(doubled, 2 * x[:, 2:7])
    copied, doubled = gathered(holes, x, 2 * x)
    assert torch.equal(copied, x[:, [1, 2, 4, 5]]) and torch.equal(doubled, 2 * x[:, [1, 2, 4, 5]])
    assert torch.equal(gathered(torch.tensor([3, 3, 4]), x)[0], x[:, [3, 3, 4]])  # a repeat is not a run


@pytest.mark.parametrize("block", [1, 2 * (2 * 2 * 5 * 5), 1 << 20])  # 1 chunk, 2 chunks, all per block
@pytest.mark.parametrize("length", [3, 10, 23])  # under a chunk, whole chunks, whole chunks and a rest
def test_noncausal_attention_in_blocks_of_chunks_equals_the_padded_softmax(block, length, monkeypatch):
    monkeypatch.setattr(compactor, "CPU_BLOCK_LOGITS", block)
    generator = torch.Generator().manual_seed(length)
    queries = 20 * torch.randn(2, 2, length, 3, generator=generator, dtype=torch.float64)  # wide logits: the floor
    keys = torch.randn(2, length, 3, generator=generator, dtype=torch.float64)
    chunk = 5
    expected = torch.zeros(2, length, dtype=torch.float64)
    for start in range(0, length, chunk):  # each chunk zero-padded to chunk_size, padding queries included
        q, k = queries[:, :, start : start + chunk], keys[:, start : start + chunk]
        width = k.shape[1]
        q = torch.cat([q, q.new_zeros(2, 2, chunk - width, 3)], 2)
        k = torch.cat([k, k.new_zeros(2, chunk - width, 3)], 1)
        probs = torch.softmax(q @ k[:, None].transpose(-2, -1), -1)
        expected[:, start : start + width] = probs.sum((1, 2))[:, :width] / 2
    got = compactor.noncausal_attention(queries.float(), keys.float(), chunk)
    torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-6)
