"""Misuse at the API boundary (``cache_for``, ``prefill``, ``stream_nll``, a model's forward and ``generate`` through
a compressed cache) is one ``ValueError`` that says what is wrong, raised before the model runs, instead of a
failure deep inside torch or transformers, or a silently wrong result."""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill, stream_nll
from kvcompress.models.testing import tiny_model
from tests.robustness.test_gradients import EVICTING
from tests.test_cache import method_of

IDS = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def generate(model, ids, cache, **options):
    options = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, **options}
    return model.generate(ids, **cache_argument(model, cache), **options)


def h2o(model):
    return kvcompress.cache_for(model, "h2o", budget=8)


def test_cache_for_refuses_what_is_not_a_model():
    with pytest.raises(ValueError, match="model must be a transformers causal language model.*got str"):
        kvcompress.cache_for("smollm2-135m", "h2o", budget=8)


@pytest.mark.parametrize("ids", [IDS[:, :0], torch.zeros(0, 5, dtype=torch.long)])
def test_prefill_of_no_tokens(model, ids):
    with pytest.raises(ValueError, match=r"input_ids must hold at least 1 token per sequence; got shape"):
        prefill(model, ids, h2o(model))


@pytest.mark.parametrize("ids", [IDS[0], IDS.float()])
def test_prefill_of_ids_that_are_no_batch_of_token_ids(model, ids):
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor \[batch, tokens\]"):
        prefill(model, ids, h2o(model))


@pytest.mark.parametrize("length", [0, 1])
def test_stream_nll_needs_two_tokens(model, length):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        stream_nll(model, IDS[:, :length], h2o(model))


def test_prefill_with_a_mask_of_the_wrong_length(model):
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[batch, tokens\] = \[1, 12\]; got \[1, 5\]"):
        prefill(model, IDS, h2o(model), attention_mask=torch.ones(1, 5, dtype=torch.long))
    cache = h2o(model)
    prefill(model, IDS, cache)
    with pytest.raises(ValueError, match=r"= \[1, 17\] \(12 the cache has seen \+ 5 new\); got \[1, 5\]"):
        prefill(model, IDS[:, :5], cache, attention_mask=torch.ones(1, 5, dtype=torch.long))


def test_generate_of_no_tokens(model):
    with pytest.raises(ValueError, match=r"input_ids is empty \(shape \[1, 0\]\)"):
        generate(model, IDS[:, :0], h2o(model))


def test_generate_and_forward_with_a_mask_of_the_wrong_length(model):
    with pytest.raises(ValueError, match="position_ids cover 5 tokens but the forward brings 12.*attention_mask"):
        generate(model, IDS, h2o(model), attention_mask=torch.ones(1, 5, dtype=torch.long))
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[0, 0] = 0  # (a mask with padding reaches the forward as it is)
    with pytest.raises(ValueError, match="attention_mask covers 5 tokens but the forward needs 12"):
        model(IDS, attention_mask=mask, **cache_argument(model, h2o(model)))


@pytest.mark.parametrize("second", [IDS, IDS[:, :5], torch.cat([IDS, IDS], 1)])
def test_a_second_generate_on_a_used_cache_names_reset(model, second):
    cache = h2o(model)
    generate(model, IDS, cache)
    with pytest.raises(ValueError, match=r"holds the 14 tokens of an earlier generate: call cache.reset\(\)"):
        generate(model, second, cache)


def test_generate_after_prefill_continues_the_prompt(model):
    """The use the check must leave alone: a prompt prefilled in chunks, then generated from."""
    cache = h2o(model)
    prefill(model, IDS[:, :-1], cache, chunk_size=4)
    out = generate(model, IDS, cache, attention_mask=torch.ones_like(IDS))
    assert torch.equal(out[:, :12], IDS) and out.shape[1] == 15


@pytest.mark.parametrize("key", sorted(EVICTING))
def test_reset_makes_a_used_cache_generate_as_a_fresh_one(key):
    model, method, params = tiny_model("llama"), method_of(key), EVICTING[key]
    long = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    cache = kvcompress.cache_for(model, method, **params)
    generate(model, long, cache, max_new_tokens=4)
    cache.reset()
    again = generate(model, IDS, cache, output_logits=True, return_dict_in_generate=True)
    fresh = generate(
        model, IDS, kvcompress.cache_for(model, method, **params), output_logits=True, return_dict_in_generate=True
    )
    assert torch.equal(again.sequences, fresh.sequences)
    torch.testing.assert_close(torch.stack(again.logits), torch.stack(fresh.logits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", sorted(EVICTING))
def test_a_one_token_prompt_generates_with_every_method(key):
    model = tiny_model("llama")
    cache = kvcompress.cache_for(model, method_of(key), **EVICTING[key])
    out = generate(model, IDS[:, :1], cache, max_new_tokens=12)
    assert out.shape == (1, 13)


def test_a_cache_continued_by_another_model_is_refused(model):
    cache = h2o(model)
    model(IDS, **cache_argument(model, cache))
    other = kvcompress.prepare_model(tiny_model("qwen2"))  # the same layer count, heads and head size
    with pytest.raises(ValueError, match="built for LlamaForCausalLM .* continued by Qwen2ForCausalLM .*'llama' vs"):
        other(IDS[:, :1], **cache_argument(other, cache))


def test_a_cache_continued_by_another_configuration_is_refused(model):
    cache = h2o(model)
    model(IDS, **cache_argument(model, cache))
    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}  # the same shapes, other positions
    other = kvcompress.prepare_model(type(model)(config).eval())
    with pytest.raises(ValueError, match="rope_parameters"):
        other(IDS[:, :1], **cache_argument(other, cache))


def test_a_copy_of_the_model_may_continue_its_cache(model):
    cache = h2o(model)
    model(IDS, **cache_argument(model, cache))
    twin = copy.deepcopy(model)
    twin(IDS[:, :1], **cache_argument(twin, cache))
    assert cache.get_seq_length() == 13
