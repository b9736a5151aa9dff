"""A decoding step of a layer (update -> attention -> eviction) compiles into one graph: no host synchronisation,
no data-dependent Python branch on the per-token path."""

from __future__ import annotations

import pytest
import torch

from kvcompress.core.attention import attend_layer
from kvcompress.core.layer import CompressedLayer
from kvcompress.registry import make_config

B, H, G, D, PROMPT = 2, 2, 2, 16, 20
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))

# the list, then the other methods that compile too (cascade with N > 1 does not: its token selection
# branches on the data, and BUZZ checks whether a segment is full)
COMPILED = {
    "streaming": {"budget": 8},
    "window": {"budget": 8},
    "h2o": {"budget": 8},
    "tova": {"budget": 8},
    "knorm": {"budget": 8},
    "random": {"budget": 8},
    "snapkv": {"budget": 8, "window": 4},  # after its one-shot compression
    "scissorhands": {"budget": 8, "history": 4},
    "less": {"budget": 8},
    "nacl": {"budget": 8},  # after its one-shot compression
    "cascade": {"budget": 12, "sinks": 4, "cascades": 1},
}


def _layer(method: str) -> CompressedLayer:
    config = make_config(method, **COMPILED[method])
    return (config.layer_class() or CompressedLayer)(config.policy(0), INV_FREQ)


def _inputs(position: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    tokens = position.shape[1]
    key, value = (torch.randn(B, H, tokens, D, generator=generator) for _ in range(2))
    return key, value, torch.randn(B, H * G, tokens, D, generator=generator), position


def _step(layer: CompressedLayer, key, value, query, position) -> torch.Tensor:
    keys, values = layer.update(key, value)
    return attend_layer(layer, query, keys, values, None, position, None)


@pytest.mark.parametrize("method", sorted(COMPILED))
def test_a_decoding_step_compiles_without_graph_breaks(method):
    eager, compiled = _layer(method), _layer(method)
    for layer in (eager, compiled):  # prompt and first steps eagerly: growth, compression, reaching the budget
        _step(layer, *_inputs(torch.arange(PROMPT).expand(B, -1), 1))
        for t in range(PROMPT, PROMPT + 3):
            _step(layer, *_inputs(torch.tensor([[t]] * B), t))
    torch._dynamo.reset()
    step = torch.compile(_step, fullgraph=True, backend="eager")  # fullgraph: any graph break raises
    for t in range(PROMPT + 3, PROMPT + 9):
        inputs = _inputs(torch.tensor([[t]] * B), t)
        torch.testing.assert_close(step(compiled, *inputs), _step(eager, *inputs))
    assert compiled.stored_length() == eager.stored_length()
    assert torch.equal(compiled.kept().token_idx, eager.kept().token_idx)
