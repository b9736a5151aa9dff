"""Every method on tiny models of every architecture family (``tests/models/zoo.py``).

- With a budget above the sequence, logits and greedy tokens equal the model's own ``DynamicCache`` run: per-layer
  RoPE (Gemma-3's two bases), partial rotary (Phi-3, GPT-NeoX), RoPE scaling (llama3, yarn's attention factor),
  sliding windows and q/k/v biases are all handled as the model handles them.
- With a real budget, the cache runs and no layer stores more than the method's budget (plus one forward for the
  methods that evict after attending), and sliding-window layers never more than their window.
- A model without RoPE gets a clear ``ValueError`` for re-indexed positions and works otherwise.
- Quantized storage (``kv_bits``) with nothing evicted reads what KIVI's cache reads (``tests/references/kivi.py``)
  on every architecture; an evicting method at 4 bits (H2O, and LESS with its own quantized layer) runs on each
  within its budget.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

import kvcompress
from kvcompress.core.model_spec import ModelSpec
from tests.helpers import cache_logits, duo_params_for, own_logits
from tests.models.zoo import ARCHITECTURES, zoo_model
from tests.references.kivi import KiviReferenceCache
from tests.test_cache import EVICTING, HEAD_SPLIT, PREFILLED, UNEVEN, method_of
from tests.test_equivalence import NO_EVICTION
from tests.test_quantized import forced_logits

PROMPT = 24  # longer than the sliding window
NEW = 4
ONE_PER_METHOD = sorted(
    key
    for key in EVICTING
    if key == method_of(key)
    or key in ("pod-snapkv", "h2o-kv4", "snapkv-kv8", "less-kv4", "pod-kv4", "streaming-kv4", "cascade-kv4", *UNEVEN)
)
CACHE_POSITIONS = {"streaming", "cascade", "streaming_oneshot"}  # re-index positions inside the cache


@pytest.fixture(scope="module")
def models():
    return {kind: zoo_model(kind) for kind in ARCHITECTURES}


@pytest.fixture(scope="module")
def references(models):
    """The model's own greedy run (SDPA, DynamicCache) per architecture."""
    return {kind: own_logits(model, prompt(model), new_tokens=NEW) for kind, model in models.items()}


def prompt(model, length=PROMPT):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ARCHITECTURES)
@pytest.mark.parametrize("method", sorted(NO_EVICTION))
def test_budget_above_length_gives_the_models_own_logits(kind, method, models, references):
    model = models[kind]
    ids = prompt(model)
    if kind == "gpt2-no-rope" and method in CACHE_POSITIONS:
        with pytest.raises(ValueError, match="no rotary position embedding"):
            kvcompress.cache_for(model, method, **NO_EVICTION[method])
        return
    if method == "kvzip" and any(window is not None for window in ModelSpec.of(model).windows):
        with pytest.raises(ValueError, match="sliding-window"):
            kvcompress.cache_for(model, method, **NO_EVICTION[method])
        return
    reference, ref_sequences = references[kind]
    cache = kvcompress.cache_for(model, method, **duo_params_for(model, method, NO_EVICTION[method]))
    logits, sequences = cache_logits(model, ids, cache, new_tokens=NEW)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(sequences, ref_sequences)


@pytest.mark.parametrize("kind", ARCHITECTURES)
@pytest.mark.parametrize("key", [*ONE_PER_METHOD, *sorted(PREFILLED), *sorted(HEAD_SPLIT)])
def test_a_real_budget_runs_and_stores_what_the_method_promises(kind, key, models):
    model, method, params = models[kind], method_of(key), (EVICTING | PREFILLED | HEAD_SPLIT)[key]
    params = duo_params_for(model, method, params)
    pair_level = method == "kvzip" and params.get("level", "pair") == "pair"  # (the head level reconstructs nothing)
    if pair_level and any(window is not None for window in ModelSpec.of(model).windows):
        with pytest.raises(ValueError, match="sliding-window"):  # (its reconstruction attends over every token)
            kvcompress.cache_for(model, method, **params)
        return
    if kind == "gpt2-no-rope" and method in CACHE_POSITIONS:
        if method == "cascade":  # it re-indexes positions by design
            with pytest.raises(ValueError, match="no rotary position embedding"):
                kvcompress.cache_for(model, method, **params)
            return
        params = {**params, "position_mode": "original"}
    cache = kvcompress.cache_for(model, method, **params)
    logits, _ = cache_logits(model, prompt(model), cache, new_tokens=NEW)
    assert bool(logits.isfinite().all())
    stored = cache.tokens_stored()
    budget = params.get("budget")
    if budget is not None and method != "pod":  # pod stores every value; its keys are checked in tests/methods
        one_shot = cache.compressed_layers[0].policy.one_shot
        assert max(stored) <= budget + (NEW if one_shot else 0) or params.get("allocation", "uniform") != "uniform"
    if pair_level:  # the prefilled prompt's pairs less floor(half) of them, then the tokens fed after it
        layers = cache.compressed_layers
        rows = len(layers) * layers[0].valid.shape[1]  # the prompt's last token and NEW - 1 decoded went in after
        pairs = sum(int(layer.valid.sum()) for layer in layers)
        assert pairs == rows * (PROMPT - 1) - int(rows * (PROMPT - 1) * 0.5) + rows * NEW
    windows = cache.model_spec.windows
    for layer, window in enumerate(windows):
        if window is not None:
            assert stored[layer] <= window - 1, (layer, stored)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_quantized_storage_reads_what_kivi_reads(kind, models):
    """``full`` at 4 bits (key groups of 8 tokens, the newest 16 exact), prompt in one forward then one token per
    forward: every step's logits equal those of the independent KIVI reference. The residual window (16) is longer
    than the sliding layers' window (8), so a sliding layer's stored tokens are all exact, in both caches; where the
    model has a global layer its keys are quantized (the logits move away from the model's own), and where every
    layer slides nothing is (they stay the model's own)."""
    model = models[kind]
    ids = prompt(model, length=40)
    bits, group, residual = 4, 8, 16
    cache = kvcompress.cache_for(model, "full", kv_bits=bits, kv_group=group, kv_residual=residual)
    reference = KiviReferenceCache(model.config.num_hidden_layers, bits, group, residual)
    ours, theirs, exact = (
        forced_logits(model, ids, c, 20) for c in (cache, reference, DynamicCache(config=model.config))
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    if any(window is None for window in ModelSpec.of(model).windows):
        assert float((ours - exact).abs().max()) > 1e-3
    else:
        torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)
