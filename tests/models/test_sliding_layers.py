"""Sliding-window layers of a hybrid model (the tiny Gemma-3: layers 0 and 2 slide over 8 tokens, 1 and 3 are
global) under the two methods with their own storage. The cascade keeps the window itself on a sliding layer when
its budget holds the window and runs its rings at a smaller budget; PoD splits its layer blocks by layer kind.
Every method's window bound and no-eviction logits on this model are in ``test_architectures``."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.core.layer import CompressedLayer
from kvcompress.generation import cache_argument
from kvcompress.methods.cascade import CascadeLayer
from kvcompress.methods.pod.grouping import split_by_kind
from tests.models.zoo import SLIDING_WINDOW, zoo_model

SLIDING = (0, 2)
PROMPT, LENGTH = 12, 30


@pytest.fixture(scope="module")
def gemma():
    model = zoo_model("gemma3-hybrid")
    assert [i for i, w in enumerate(kvcompress.cache_for(model, "full").model_spec.windows) if w] == list(SLIDING)
    return model


def ids_of(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def stepwise(model, cache, ids, check=None) -> torch.Tensor:
    """Logits of a prompt forward then one token per forward; ``check(cache)`` after each forward."""
    logits = [model(ids[:, :PROMPT], **cache_argument(model, cache)).logits]
    for t in range(PROMPT, ids.shape[1]):
        if check is not None:
            check(cache)
        logits.append(model(ids[:, t : t + 1], **cache_argument(model, cache)).logits)
    return torch.cat(logits, 1)


@torch.no_grad()
def one_forward(model, method, ids, **params) -> torch.Tensor:
    cache = kvcompress.cache_for(model, method, **params)
    return model(ids, **cache_argument(model, cache)).logits


def sliding_stores_the_window(cache) -> None:
    """Each sliding layer holds exactly the last ``window - 1`` tokens seen (what transformers' sliding layers keep)."""
    for index in SLIDING:
        layer = cache.compressed_layers[index]
        expected = torch.arange(layer.seen - SLIDING_WINDOW + 1, layer.seen)
        assert torch.equal(layer.kept().token_idx[0, 0], expected), (index, layer.kept().token_idx[0, 0])


def test_cascade_keeps_the_window_on_sliding_layers_when_its_budget_holds_it(gemma):
    params = {"budget": 12, "sinks": 4, "cascades": 2}
    cache = kvcompress.cache_for(gemma, "cascade", **params)
    classes = [type(layer) for layer in cache.compressed_layers]
    assert classes == [CompressedLayer, CascadeLayer, CompressedLayer, CascadeLayer]
    ids = ids_of()
    logits = stepwise(gemma, cache, ids, check=sliding_stores_the_window)
    assert max(cache.tokens_stored()[i] for i in (1, 3)) <= 12
    # exact prefill: one forward of the whole sequence gives the same logits as decoding (window layers included)
    torch.testing.assert_close(logits, one_forward(gemma, "cascade", ids, **params), rtol=1e-4, atol=1e-4)


def test_cascade_below_the_window_runs_its_rings_on_sliding_layers(gemma):
    params = {"budget": SLIDING_WINDOW - 2, "sinks": 2, "cascades": 2}
    cache = kvcompress.cache_for(gemma, "cascade", **params)
    assert all(type(layer) is CascadeLayer for layer in cache.compressed_layers)

    def bounded(cache):
        assert max(cache.tokens_stored()) <= params["budget"], cache.tokens_stored()

    ids = ids_of()
    logits = stepwise(gemma, cache, ids, check=bounded)
    torch.testing.assert_close(logits, one_forward(gemma, "cascade", ids, **params), rtol=1e-4, atol=1e-4)


def test_pod_shares_within_each_layer_kind(gemma):
    params = {"block_size": 4, "n_sink": 2, "n_recent": 4}  # one block of all 4 layers before the split
    cache = kvcompress.cache_for(gemma, "pod", **params)
    ids = ids_of()
    logits = stepwise(gemma, cache, ids, check=sliding_stores_the_window)
    layers = cache.compressed_layers
    # sliding layer 2 shares layer 0's distant attention (inside the window), global layer 3 shares layer 1's
    assert [layer.head_starts[0] for layer in layers] == [0, 1, 0, 1]
    assert [len(layer.prox_heads) for layer in layers] == [0, 0, 2, 2]
    assert layers[2].prox_keys.shape[2] == 4 and layers[2].values.shape[2] == SLIDING_WINDOW - 1  # sinks expired
    assert layers[3].prox_keys.shape[2] == 2 + 4 and layers[3].values.shape[2] == LENGTH
    # decoding with expiring sliding layers equals one forward over the whole sequence
    torch.testing.assert_close(logits, one_forward(gemma, "pod", ids, **params), rtol=1e-4, atol=1e-4)


def test_pod_composed_with_snapkv_bounds_sliding_layers(gemma):
    base = kvcompress.make_config("snapkv", budget=10, window=4)
    cache = kvcompress.cache_for(gemma, "pod", block_size=4, n_sink=2, n_recent=4, base=base)
    stepwise(gemma, cache, ids_of(), check=sliding_stores_the_window)
    assert cache.tokens_stored()[1] <= 10 + LENGTH - PROMPT


def test_blocks_split_by_layer_kind_share_from_their_first_member_of_each_kind():
    # per head: head 0 blocks [0-3][4-5], head 1 [0][1-5]; layers 0, 2 and 4 slide ("s"), the others are global
    starts = ((0, 0), (0, 1), (0, 1), (0, 1), (4, 1), (4, 1))
    kinds = ["s", None, "s", None, "s", None]
    assert split_by_kind(starts, kinds) == ((0, 0), (1, 1), (0, 2), (1, 1), (4, 2), (5, 1))
    assert split_by_kind(starts, [None] * 6) == starts
