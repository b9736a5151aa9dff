"""``rotate_by`` (the re-rotation behind ``position_mode="cache"``) against transformers' own rotary embedding.

A vector rotated by the model (its ``rotary_emb`` cos/sin and its ``apply_rotary_pos_emb``) at position ``a`` and
then moved by ``d`` with ``rotate_by`` and the frequencies the library reads from the model (``layer_inv_freqs``)
equals the vector the model rotates at ``a + d`` (``attention_scaling``, e.g. YaRN's, applied once). Checked for
every static RoPE type (``default``, ``linear``, ``llama3``, ``yarn``), for partial rotary (Phi-3's
``partial_rotary_factor``: only the rotary dimensions move) and for per-layer-type frequencies (Gemma-3's sliding
and full layers rotate with different bases).

``dynamic`` and ``longrope`` pick their frequencies from the largest position of each call, so a key rotated before
the switch and one rotated after it were rotated with different frequencies and no single ``rotate_by`` moves both:
the library refuses them in ``cache`` mode (``ValueError`` naming the RoPE type) and accepts them in ``original``
mode, where no key is re-rotated. Both behaviours are checked here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Phi3Config, Phi3ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as apply_partial_rotary_pos_emb

import kvcompress
from kvcompress.core.rope import layer_inv_freqs, rotate_by
from kvcompress.generation import cache_argument

ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 8,
        "long_factor": [float(i + 1) for i in range(8)],
    },
}
SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "pad_token_id": 0}


def model_with_rope(tiny_llama, rope_parameters):
    config = copy.deepcopy(tiny_llama.config)
    config.rope_parameters = rope_parameters
    with torch.random.fork_rng(devices=[]):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def assert_moves_like_the_model(rotate, inv_freq, head_dim=16):
    """``rotate(x, positions)``: the model's rotation; moving ``rotate(x, a)`` by ``b - a`` gives ``rotate(x, b)``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, head_dim, generator=generator)
    start = torch.randint(0, 300, (2, 9), generator=generator)
    target = torch.randint(0, 300, (2, 9), generator=generator)
    moved = rotate_by(rotate(x, start), (target - start)[:, None, :], inv_freq)
    torch.testing.assert_close(moved, rotate(x, target), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
def test_rotate_by_moves_a_model_rotated_vector_like_the_model_itself(rope, tiny_llama):
    model = model_with_rope(tiny_llama, ROPE_TYPES[rope])
    rotary = model.model.rotary_emb
    if rope == "yarn":
        assert rotary.attention_scaling != 1.0  # the case where scaling must not be applied twice

    def rotate(x, positions):
        return apply_rotary_pos_emb(x, x, *rotary(x, positions))[0]

    assert_moves_like_the_model(rotate, layer_inv_freqs(model)[0])


def test_rotate_by_moves_only_the_rotary_dimensions_of_a_partial_rotary_model():
    config = Phi3Config(**SMALL, num_hidden_layers=1, num_key_value_heads=1, partial_rotary_factor=0.5)
    with torch.random.fork_rng(devices=[]):
        model = Phi3ForCausalLM(config).eval()
    rotary = model.model.rotary_emb
    inv_freq = layer_inv_freqs(model)[0]
    assert 2 * inv_freq.shape[-1] == 8  # half of the 16 dimensions rotate

    def rotate(x, positions):
        return apply_partial_rotary_pos_emb(x, x, *rotary(x, positions))[0]

    assert_moves_like_the_model(rotate, inv_freq)


def test_rotate_by_uses_each_layer_types_frequencies():
    config = Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    with torch.random.fork_rng(devices=[]):
        model = Gemma3ForCausalLM(config).eval()
    rotary = model.model.rotary_emb
    assert not torch.equal(layer_inv_freqs(model)[0], layer_inv_freqs(model)[1])  # two bases: the test can tell
    for layer, layer_type in enumerate(config.layer_types):

        def rotate(x, positions, layer_type=layer_type):
            return apply_rotary_pos_emb(x, x, *rotary(x, positions, layer_type))[0]

        assert_moves_like_the_model(rotate, layer_inv_freqs(model)[layer])


@pytest.mark.parametrize("rope", sorted(LENGTH_DEPENDENT))
def test_length_dependent_rope_is_refused_in_cache_mode_only(rope, tiny_llama):
    model = model_with_rope(tiny_llama, LENGTH_DEPENDENT[rope])
    with pytest.raises(ValueError, match=f"rope_type='{rope}'.*position_mode='cache' is not supported"):
        kvcompress.cache_for(model, "streaming", budget=6, sinks=2)
    cache = kvcompress.cache_for(model, "streaming", budget=6, sinks=2, position_mode="original")
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    assert cache.tokens_stored() == [6] * model.config.num_hidden_layers
