"""StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): attention sinks plus a window of recent tokens.

The budget counts sinks and recent tokens together (4 sinks + 252 recent for a budget of 256). As in the paper,
positions are re-indexed inside the cache by default (``position_mode="cache"``): a token's RoPE position is its
rank in the cache at every step, so the model never sees positions beyond the cache size. ``original`` keeps the
positions the keys were written with.

Fast path: in ``cache`` position mode (with at least one non-sink slot) the cache layer is the circular sink cache
of the Cascading KV Cache (``CircularSinkLayer``: the cascade storage with one cascade, a buffer of ``budget`` slots
allocated once, one slot written per token, keys rotated to their ranks without re-rotating the whole cache). It
attends to the same tokens at the same positions as the generic layer (the tests compare logits and stored tokens);
``circular=False`` switches back to the generic layer (cat + gather, re-rotation every step).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import check_budget, ints, one_of, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.rope import POSITION_MODES
from kvcompress.core.selection import keep_top, sink_mask
from kvcompress.methods.cascade.circular import CircularSinkLayer, QuantizedCircularSinkLayer


class StreamingPolicy(Policy):
    per_head = False
    position_mode = property(lambda self: self.config.position_mode)

    def select(self, layer):
        budget, sinks = self.config.budget, self.config.sinks  # scores are stream indices: see window
        recent = budget - sinks
        return keep_top(
            layer, layer.token_idx[:, :1], budget, sink_mask(layer, sinks), newest_kept=recent, distinct=True
        )


@dataclass(frozen=True)
class StreamingConfig(MethodConfig):
    """Attention sinks + recent window."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head, sinks included
    sinks: int = param(4, ints(0, "budget"))  # first tokens always kept (the paper's 4 attention sinks)
    position_mode: str = one_of(*POSITION_MODES, default="cache")  # re-indexed in the cache (paper) or kept
    circular: bool = True  # store in a ring buffer where it applies (fast); False: the generic layer (reference)

    name = "streaming"
    paper = "https://arxiv.org/abs/2309.17453"
    policy_class = StreamingPolicy

    def layer_class(self) -> type[CompressedLayer]:
        if self.circular and self.position_mode == "cache" and self.sinks < self.budget:
            return CircularSinkLayer if self.kv_bits == 16 else QuantizedCircularSinkLayer
        return CompressedLayer
