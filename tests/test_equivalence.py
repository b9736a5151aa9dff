"""Invariant 1: with nothing to evict, every method reproduces the model's own logits."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from tests.helpers import (
    cache_logits,
    duo_pattern_file,
    kvzip_head_file,
    needs_smollm2,
    own_logits,
    tiny_tokenizer_dir,
)

NO_EVICTION = {
    "full": {},
    "window": {"budget": 512},
    "streaming": {"budget": 512},
    "cascade": {"budget": 516},
    "h2o": {"budget": 512},
    "tova": {"budget": 512},
    "scissorhands": {"budget": 512},
    "snapkv": {"ratio": 1.0},
    "random": {"budget": 512},
    "knorm": {"budget": 512},
    "buzz": {"budget": 512},
    "less": {"budget": 512},
    "nacl": {"ratio": 1.0},
    "h2o_oneshot": {"ratio": 1.0},
    "tova_oneshot": {"ratio": 1.0},
    "scissorhands_oneshot": {"ratio": 1.0},
    "streaming_oneshot": {"ratio": 1.0},
    "pod": {"block_size": 2, "n_recent": 512},
    "keydiff": {"ratio": 1.0},
    "expected_attention": {"ratio": 1.0},
    "compactor": {"ratio": 1.0},
    "periodic": {"budget": 512, "interval": 3},
    "kvzip": {"ratio": 1.0, "tokenizer": tiny_tokenizer_dir()},  # (the reconstruction runs and leaves no trace)
    "duo": {"pattern": duo_pattern_file(), "head_compression_ratio": 0.0},  # every head a retrieval head
}


def test_every_registered_method_is_covered():
    assert set(NO_EVICTION) == set(kvcompress.METHODS)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("method", sorted(NO_EVICTION))
def test_budget_above_length_reproduces_model_logits(method, model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    ids = torch.randint(1, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    assert_reproduces_model_logits(model, method, ids)


@pytest.mark.parametrize("allocation", ["pyramid", "adakv"])
@pytest.mark.parametrize("method", ["snapkv", "keydiff", "expected_attention", "compactor"])
def test_uneven_budgets_with_nothing_to_evict_reproduce_model_logits(method, allocation, tiny_qwen2):
    ids = torch.randint(1, tiny_qwen2.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    reference, ref_sequences = own_logits(tiny_qwen2, ids)
    cache = kvcompress.cache_for(tiny_qwen2, method, ratio=1.0, allocation=allocation)
    logits, sequences = cache_logits(tiny_qwen2, ids, cache)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sequences, ref_sequences)


@pytest.mark.parametrize("allocation", ["global", "layer"])
def test_kvzip_head_budgets_with_nothing_to_evict_reproduce_model_logits(allocation, tiny_llama):
    ids = torch.randint(1, tiny_llama.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    reference, ref_sequences = own_logits(tiny_llama, ids)
    cache = kvcompress.cache_for(tiny_llama, "kvzip", ratio=1.0, allocation=allocation, tokenizer=tiny_tokenizer_dir())
    logits, sequences = cache_logits(tiny_llama, ids, cache)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sequences, ref_sequences)


@pytest.mark.parametrize("ragged", [True, False])
def test_duo_streaming_heads_whose_window_holds_the_prompt_reproduce_model_logits(ragged, tiny_llama):
    """Every head a streaming head, but sinks + window cover the 37-token prompt: nothing evicted, through the
    ragged storage (or the slot layout), with a batch of 2."""
    ids = torch.randint(1, tiny_llama.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    reference, ref_sequences = own_logits(tiny_llama, ids)
    params = {"head_compression_ratio": 1.0, "sink_size": 4, "recent_size": 33, "ragged": ragged}
    cache = kvcompress.cache_for(tiny_llama, "duo", pattern=duo_pattern_file(), **params)
    logits, sequences = cache_logits(tiny_llama, ids, cache)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sequences, ref_sequences)
    assert all(getattr(layer, "ragged", False) == ragged for layer in cache.compressed_layers)


@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("split", ["ratio-1", "window-holds-prompt"])
def test_kvzip_head_level_with_nothing_to_evict_reproduces_model_logits(split, ragged, tiny_llama):
    """KVzip's head level at ratio 1 (every head keeps everything), or at a tiny ratio whose streaming heads' sinks
    and window cover the 36 prefilled tokens (every head streaming, nothing evicted); a batch of 2."""
    ids = torch.randint(1, tiny_llama.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    reference, ref_sequences = own_logits(tiny_llama, ids)
    params = {"ratio": 1.0} if split == "ratio-1" else {"ratio": 0.01, "sink_size": 4, "recent_size": 32}
    cache = kvcompress.cache_for(tiny_llama, "kvzip", level="head", pattern=kvzip_head_file(), ragged=ragged, **params)
    logits, sequences = cache_logits(tiny_llama, ids, cache)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sequences, ref_sequences)
    assert all(getattr(layer, "ragged", False) == ragged for layer in cache.compressed_layers)
    assert all(layer.compressed for layer in cache.compressed_layers)  # (the split ran, and evicted nothing)


def assert_reproduces_model_logits(model, method: str, ids: torch.Tensor) -> None:
    """``method`` with nothing to evict gives the model's own logits and greedy tokens for ``ids``."""
    reference, ref_sequences = own_logits(model, ids)
    cache = kvcompress.cache_for(model, method, **NO_EVICTION[method])
    logits, sequences = cache_logits(model, ids, cache)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sequences, ref_sequences)


def test_prepared_model_still_works_with_an_ordinary_cache(tiny_llama):
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    reference, _ = own_logits(tiny_llama, ids, mask)
    kvcompress.prepare_model(tiny_llama)
    out = tiny_llama.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    torch.testing.assert_close(torch.stack(out.logits, 1), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_match_for_every_method():
    from kvcompress.models import load_model

    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2-135m")
    text = "The quick brown fox jumps over the lazy dog. " * 12
    ids = tokenizer(text, return_tensors="pt").input_ids
    reference, _ = own_logits(model, ids, new_tokens=4)
    for method, params in NO_EVICTION.items():
        if method == "duo":  # the pattern shipped for SmolLM2, every head a retrieval head
            params = {"head_compression_ratio": 0.0}
        cache = kvcompress.cache_for(model, method, **params)
        logits, _ = cache_logits(model, ids, cache, new_tokens=4)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4, msg=method)
    # KVzip's head level with the head scores shipped for SmolLM2, every head kept whole
    logits, _ = cache_logits(model, ids, kvcompress.cache_for(model, "kvzip", level="head", ratio=1.0), new_tokens=4)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4, msg="kvzip level=head")
