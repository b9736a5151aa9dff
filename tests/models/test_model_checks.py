"""RoPE per layer, and what a cache checks about the model it serves.

- ``layer_inv_freqs`` + ``rotate_by`` move a key the model rotated at ``a`` to exactly where the model rotates it
  at ``a + d``, layer by layer: Gemma-3's two layer types (two bases, one linearly scaled), partial rotary (Phi-3,
  GPT-NeoX: the pass-through dimensions untouched), llama3 and yarn (attention factor applied once).
- Length-dependent RoPE (dynamic, longrope) and models without RoPE are refused for ``position_mode="cache"``
  with a ``ValueError`` that says why; without RoPE the original-position methods run.
- A cache built for one model refuses another (more layers, fewer layers, other head shapes) with a ``ValueError``.
- Original-position methods warn once past ``max_position_embeddings``; re-indexing methods do not.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvcompress
from kvcompress.core.rope import layer_inv_freqs, layer_types, rotate_by
from tests.helpers import cache_logits
from tests.models.zoo import ARCHITECTURES, COMMON, zoo_model

ROPE_MODELS = [kind for kind in ARCHITECTURES if kind != "gpt2-no-rope"]


@pytest.mark.parametrize("kind", ROPE_MODELS)
def test_each_layer_moves_keys_exactly_as_the_model_rotates_them(kind):
    model = zoo_model(kind)
    rotary = next(module for name, module in model.named_modules() if name.endswith("rotary_emb"))
    apply = sys.modules[type(model).__module__].apply_rotary_pos_emb
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 16, generator=generator)
    start = torch.randint(0, 200, (2, 9), generator=generator)
    target = torch.randint(0, 200, (2, 9), generator=generator)
    types = layer_types(model.config)
    for layer, inv_freq in enumerate(layer_inv_freqs(model)):
        extra = (types[layer],) if kind.startswith("gemma3") else ()

        def rotated(positions, extra=extra):
            cos, sin = rotary(x, positions, *extra)
            return apply(x, x, cos, sin)[0]

        moved = rotate_by(rotated(start), (target - start)[:, None, :], inv_freq)
        torch.testing.assert_close(moved, rotated(target), rtol=1e-4, atol=1e-4, msg=f"layer {layer}")
    if kind == "gemma3-hybrid":  # the two layer types really differ
        first, second = layer_inv_freqs(model)[:2]
        assert not torch.allclose(first, second)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_for_cache_positions_and_runs_otherwise(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64)
    config = LlamaConfig(**COMMON, head_dim=16, rope_parameters=params)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}'.*frequencies change with the sequence length"):
        kvcompress.cache_for(model, "streaming", budget=8)
    cache = kvcompress.cache_for(model, "streaming", budget=8, position_mode="original")
    cache_logits(model, torch.randint(3, 128, (1, 12)), cache, new_tokens=2)


def test_a_model_without_rope_is_refused_clearly_and_runs_original_positions():
    model = zoo_model("gpt2-no-rope")
    for method in ("streaming", "cascade", "streaming_oneshot"):
        with pytest.raises(ValueError, match="GPT2LMHeadModel has no rotary position embedding.*position_mode"):
            kvcompress.cache_for(model, method, budget=8)
    cache = kvcompress.cache_for(model, "streaming", budget=8, position_mode="original")
    cache_logits(model, torch.randint(3, 128, (1, 12)), cache, new_tokens=2)
    assert max(cache.tokens_stored()) <= 8


@pytest.mark.parametrize(
    ("built_for", "used_with", "message"),
    [
        ("llama-gqa", "gemma3-hybrid", "continued by .*4 layers.*num_hidden_layers 2 vs 4"),
        ("gemma3-hybrid", "llama-gqa", "continued by .*2 layers.*num_hidden_layers 4 vs 2"),
        ("llama-gqa", "phi3-partial", "continued by .*4 KV heads of dimension 16.*num_key_value_heads 2 vs 4"),
    ],
)
def test_a_cache_refuses_another_model(built_for, used_with, message):
    cache = kvcompress.cache_for(zoo_model(built_for), "window", budget=8)
    other = zoo_model(used_with)
    kvcompress.prepare_model(other)
    with pytest.raises(ValueError, match=f"built for .*{message}"):
        cache_logits(other, torch.randint(3, 128, (1, 12)), cache, new_tokens=2)


@pytest.mark.parametrize(("method", "warns"), [("h2o", True), ("window", True), ("streaming", False)])
def test_original_positions_past_the_trained_length_warn_once(method, warns):
    model = zoo_model("llama-gqa")  # 256 trained positions
    cache = kvcompress.cache_for(model, method, budget=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_logits(model, torch.randint(3, 128, (1, 250)), cache, new_tokens=12)
    past = [w for w in caught if "trained on 256 positions" in str(w.message)]
    assert len(past) == (1 if warns else 0)
