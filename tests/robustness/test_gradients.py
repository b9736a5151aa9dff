"""Gradients on: a forward outside ``torch.no_grad`` (a notebook's default) works for every method, computes the same
values as without gradients, and ``loss.backward()`` through a compressed cache gives the gradient of what the
forward computed (the model's own cache's gradient where nothing is evicted, a masked softmax's in the statistics)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import kvcompress
from kvcompress.core.softmax import chunked_softmax
from kvcompress.generation import cache_argument
from kvcompress.models.testing import tiny_model
from tests.test_cache import EVICTING as CACHE_TESTS
from tests.test_cache import HEAD_SPLIT, method_of
from tests.test_equivalence import NO_EVICTION

# every method (several settings of some) evicting from a 24-token prompt and the 4 tokens decoded after it
# kvzip compresses inside generation.prefill (it reconstructs the whole context there), which runs without gradients:
# a backward pass through its selection is not offered
PREFILL_ONLY = {"kvzip"}
EVICTING = {
    key: params
    for key, params in {**CACHE_TESTS, **HEAD_SPLIT, "full": {}, "pod": {"block_size": 2, "n_recent": 4}}.items()
    if method_of(key) not in PREFILL_ONLY
}
PROMPT, STEPS = 24, 4


def test_every_registered_method_is_covered():
    assert {method_of(key) for key in EVICTING} == set(kvcompress.METHODS) - PREFILL_ONLY


def run_steps(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """The prompt in one forward, then one token per forward (teacher forcing): the logits of every forward."""
    logits = [model(ids[:, :PROMPT], use_cache=True, **cache_argument(model, cache)).logits[:, -1]]
    for step in range(PROMPT, ids.shape[1]):
        logits.append(model(ids[:, step : step + 1], use_cache=True, **cache_argument(model, cache)).logits[:, -1])
    return torch.stack(logits, 1)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1], ids[0, PROMPT:])


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("key", sorted(EVICTING))
def test_backward_through_an_evicting_cache_for_every_method(key, ids):
    model, method = tiny_model("llama"), method_of(key)
    with torch.no_grad():
        expected = run_steps(model, kvcompress.cache_for(model, method, **EVICTING[key]), ids)
    cache = kvcompress.cache_for(model, method, **EVICTING[key])
    assert torch.is_grad_enabled()
    logits = run_steps(model, cache, ids)  # gradients on, as in a notebook
    if method != "full":  # something was evicted (PoD: keys shared between layers)
        config = model.config
        full_bytes = (PROMPT + STEPS) * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
        assert cache.nbytes() < full_bytes
    # Quantized storage: under no_grad a decoding step attends from the codes (scales folded into the query and the
    # probabilities), with gradients on from the dequantized view: the same sums in another order, compared at the
    # bound the codes path is tested at against the view (tests/test_quantized.py).
    atol = 1e-5 if EVICTING[key].get("kv_bits", 16) < 16 else 1e-6
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-5, atol=atol)
    next_token_loss(logits, ids).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values())
    for layer in (0, 1):  # the keys of both layers receive a gradient through the cache
        assert grads[f"model.layers.{layer}.self_attn.k_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("method", sorted(set(NO_EVICTION) - PREFILL_ONLY))
def test_gradients_without_eviction_equal_the_models_own_cache(method, ids):
    reference = tiny_model("llama")  # the model's own attention and DynamicCache
    loss = next_token_loss(_own_steps(reference, ids), ids)
    loss.backward()
    model = tiny_model("llama")
    cache = kvcompress.cache_for(model, method, **NO_EVICTION[method])
    next_token_loss(run_steps(model, cache, ids), ids).backward()
    for (name, mine), (_, theirs) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(
            mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{method} {name}: {m}"
        )


def _own_steps(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids[:, :PROMPT], use_cache=True)
    logits, past = [out.logits[:, -1]], out.past_key_values
    for step in range(PROMPT, ids.shape[1]):
        out = model(ids[:, step : step + 1], use_cache=True, **cache_argument(model, past))
        logits.append(out.logits[:, -1])
        past = out.past_key_values
    return torch.stack(logits, 1)


@pytest.mark.parametrize(
    "queries, mask_kind, weighted", [(1, None, False), (40, None, False), (40, "random", True), (40, "random", False)]
)
def test_chunked_softmax_under_autograd_is_the_masked_softmax(queries, mask_kind, weighted):
    """Output, log-normalisers and received mass with gradients on equal those without, and their gradients are
    those of a plain masked softmax (rows that see no key count for nothing in both)."""
    gen = torch.Generator().manual_seed(3)
    batch, q_heads, kv_heads, length, dim = 2, 4, 2, 40, 8
    query = torch.randn(batch, q_heads, queries, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    if mask_kind is None:
        mask = None
        visible = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)[None, None]
    else:
        mask = torch.rand(batch, kv_heads, queries, length, generator=gen) > 0.5
        mask[:, :, 0] = False  # a row that sees nothing
        visible = mask.repeat_interleave(q_heads // kv_heads, dim=1)
    weight = torch.rand(batch, queries, generator=gen) if weighted else None
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    asked = {"lse": True, "received": True, "row_weight": weight, "chunk_elements": batch * q_heads * length * 7}
    parts = chunked_softmax(*inputs[:2], mask, None, value=inputs[2], **asked)  # in several query chunks
    with torch.no_grad():
        plain = chunked_softmax(query, key, mask, None, value=value, **asked)
    for name in ("output", "lse", "received"):
        assert torch.equal(getattr(parts, name).detach(), getattr(plain, name)), name

    ref_inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    q, k, v = ref_inputs[0], *(t.repeat_interleave(q_heads // kv_heads, dim=1) for t in ref_inputs[1:])
    logits = (q @ k.transpose(-1, -2) * dim**-0.5).masked_fill(~visible, float("-inf"))
    probs = logits.softmax(-1).nan_to_num(0.0)
    rows = probs if weight is None else probs * weight[:, None, :, None]
    received = rows.sum(-2).view(batch, kv_heads, -1, length)
    lse = logits.logsumexp(-1)
    seen = visible.expand_as(logits).any(-1)
    torch.testing.assert_close(parts.output, probs @ v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts.received, received, rtol=1e-5, atol=1e-6)

    upstream = [torch.randn(t.shape, generator=gen) for t in (parts.output, parts.received, lse)]
    seen_lse = torch.where(seen, parts.lse, 0.0), torch.where(seen, lse, 0.0)
    mine = (parts.output * upstream[0]).sum() + (parts.received * upstream[1]).sum() + (seen_lse[0] * upstream[2]).sum()
    theirs = (probs @ v * upstream[0]).sum() + (received * upstream[1]).sum() + (seen_lse[1] * upstream[2]).sum()
    mine.backward()
    theirs.backward()
    for name, a, b in zip(("query", "key", "value"), inputs, ref_inputs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
