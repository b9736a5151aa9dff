"""``streaming`` in ``cache`` position mode on the cascade storage with one cascade: the circular sink cache."""

from __future__ import annotations

import torch

from kvcompress.core.contract import Policy
from kvcompress.core.layer import CompressedLayer
from kvcompress.methods.cascade.config import CascadeConfig
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.ring_replay import CircularReplay


class CircularSinkLayer(CircularReplay, CascadeLayer):
    """``streaming`` (StreamingLLM, positions re-indexed in the cache) on the cascade storage with ``N = 1``: the
    sinks plus one ring of ``budget - sinks`` slots, allocated once, one slot written per token.

    ``streaming`` evicts *after* attending (a forward's tokens attend to the stored ones and causally to each
    other, then the oldest non-sink tokens beyond the budget go), while the cascade inserts each token before it
    attends. So this layer runs every forward, one token or many, the way the cascade's chunked prefill does:
    attend to the frozen ring and causally inside the forward, at ranks ``stored, stored + 1, ...``, then insert the
    tokens one by one (the ring keeps the sinks and the ``budget - sinks`` newest). That is the generic
    ``streaming`` layer's attention set, order and positions (``tests/methods/test_cascade.py`` checks logits and
    stored tokens against it); only the float rounding differs. The layer keeps the streaming policy it is given;
    the ring runs by the constants of ``CascadeConfig(budget, sinks, cascades=1)``; scores are never computed.
    """

    attend_first = True
    # the ring cannot drop tokens by age: on a model's sliding-window layers the generic streaming layer runs instead
    sliding_layer_class = CompressedLayer

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        config = policy.config
        ring = CascadeConfig(budget=config.budget, sinks=config.sinks, cascades=1, prefill="chunked")
        super().__init__(policy, inv_freq, rule=ring.policy(policy.layer_idx))
