"""Compactor's own mechanics beyond the reference kept sets (tests/references): the prompt's queries it holds until
it compresses belong to the current prompt only."""

from __future__ import annotations

import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill


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
