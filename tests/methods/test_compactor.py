"""Compactor's own mechanics beyond the reference kept sets (tests/references): the prompt's queries it holds until
it compresses belong to the current prompt only; a prompt fed in chunks is scored chunk by chunk as it comes in, to
the scores it would get at its end, holding a bounded number of queries; a run of slots is read as a view, any other
index copied; the non-causal attention taken a block of chunks at a time is the padded softmax."""

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


SEQUENCE_SCORES = compactor.CompactorPolicy.sequence_scores
SCORE_CHUNKS = compactor.CompactorPolicy.score_completed_chunks
EARLY = {"ratio": 0.5, "chunk_size": 4, "sink_size_start": 2, "sink_size_end": 3}


def chunked_scores(model, monkeypatch, prefill_chunk: int, early: bool, held: list | None = None):
    """The scores every layer's select gives each sequence, after a prefill in chunks of ``prefill_chunk`` of a batch
    of two 41-token prompts (the second's first 9 tokens padding), with or without the chunks scored early;
    ``held``: receives the queries each layer holds after each of its early scorings."""
    scores = []

    def recorded(self, *args):
        scores.append(SEQUENCE_SCORES(self, *args))
        return scores[-1]

    def scored_early(self, layer):
        if early:
            SCORE_CHUNKS(self, layer)
        if held is not None:
            held.append(sum(q.shape[2] for q in self.queries))

    monkeypatch.setattr(compactor.CompactorPolicy, "sequence_scores", recorded)
    monkeypatch.setattr(compactor.CompactorPolicy, "score_completed_chunks", scored_early)
    ids = torch.randint(3, 128, (2, 41), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = kvcompress.cache_for(model, "compactor", **EARLY)
    prefill(model, ids, cache, attention_mask=mask, chunk_size=prefill_chunk)
    return scores, kept(cache)


# 6: a last forward longer than the end sinks; 2: shorter, so the end sinks' first token came in an earlier forward
@pytest.mark.parametrize("prefill_chunk", [6, 2])
def test_a_chunked_prompt_is_scored_chunk_by_chunk_to_the_scores_it_gets_at_its_end(
    prefill_chunk, tiny_llama, monkeypatch
):
    late, late_kept = chunked_scores(tiny_llama, monkeypatch, prefill_chunk, early=False)
    held: list[int] = []
    early, early_kept = chunked_scores(tiny_llama, monkeypatch, prefill_chunk, early=True, held=held)
    assert len(early) == len(late) == 2 * 2  # two layers, two sequences
    for got, expected in zip(early, late, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert early_kept == late_kept
    # between forwards a layer holds the queries of fewer than a chunk and the end sinks (no more can be scored
    # yet), never the prompt's: each forward scored what it completed and dropped the rest
    forwards = -(-41 // prefill_chunk)
    assert len(held) == 2 * forwards
    assert max(held) == EARLY["chunk_size"] + EARLY["sink_size_end"] - 1


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
