"""Every cache layer kind implements ``LayerView`` (what a policy may read and call), for every registered method,
and the stacked view a batchable policy reads at a decoding step has the members ``LayerView`` lists for it."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.core.contract import LayerView
from kvcompress.core.joint_eviction import StackedLayer
from kvcompress.generation import cache_argument
from kvcompress.registry import METHODS
from tests.test_allocated_bytes import params_for

MEMBERS = set(LayerView.__annotations__) | {
    name
    for name, value in vars(LayerView).items()
    if not name.startswith("_") and isinstance(value, property | type(len) | type(lambda: 0))
}
BATCHED = ("policy", "device", "seen", "seen_step", "new_tokens", "occupied", "view_width", "dense", "ordered")
BATCHED += ("all_valid", "rows", "token_idx", "state", "new_index", "real_count")


@pytest.mark.parametrize("method", list(METHODS))
def test_every_layer_is_a_layer_view(method, tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, method, **params_for(method))
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(input_ids=ids, **cache_argument(tiny_llama, cache))
    for layer in cache.layers:
        missing = [name for name in MEMBERS if not hasattr(layer, name)]
        assert not missing, f"{type(layer).__name__} lacks {missing}"
        assert isinstance(layer, LayerView)
        assert tuple(layer.rows) == tuple(layer.token_idx.shape[:2])
        assert layer.token_idx.shape[-1] == layer.view_width
        assert layer.occupied == layer.stored_length() == int((layer.token_idx >= 0).sum(-1).max())


def test_the_stacked_view_has_what_a_batchable_policy_reads(tiny_llama):
    cache = kvcompress.cache_for(tiny_llama, "h2o", budget=8)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(input_ids=ids, **cache_argument(tiny_llama, cache))
        tiny_llama(input_ids=ids[:, :1], **cache_argument(tiny_llama, cache))
    layers = cache.compressed_layers
    stacked = StackedLayer(layers, {"token_idx": torch.cat([layer.slots.token_idx for layer in layers])})
    assert set(BATCHED) <= set(MEMBERS)
    assert all(hasattr(stacked, name) for name in BATCHED)
    assert stacked.rows == (len(layers) * layers[0].rows[0], layers[0].rows[1])
