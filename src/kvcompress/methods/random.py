"""Random eviction: each KV head keeps a uniformly random subset of the tokens seen.

Every token draws a fixed score from a hash of (seed, layer, head, RoPE position), and the layer keeps the
highest scores. At every step the kept set is therefore a uniform random subset of all tokens seen so far, and a
sequence gets the same draw alone or in a padded batch. Exception, as for every decode-time method: the tokens of
the forward being processed are kept while they fit in the budget, so the subset is uniform over the older tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import MAX_SEED, check_budget, ints, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.forward import ForwardPass
from kvcompress.core.hashing import hash_uniform
from kvcompress.core.selection import keep_top

LAYER_BLOCK = 64  # layers whose draws are computed together


def layer_draws(
    positions: torch.Tensor, seed: int, layer: int, heads: int, forward: ForwardPass | None = None
) -> torch.Tensor:
    """``[B or 1, heads, q]``: ``hash_uniform(seed, layer, head, position)`` for the RoPE positions ``[B or 1, q]``
    of a forward's tokens (the model's ``position_ids``). The hash takes some twenty small ops: they run once per
    ``forward`` for a block of ``LAYER_BLOCK`` layers where it is given (``kvcompress.core.forward``)."""
    block = layer // LAYER_BLOCK

    def build() -> torch.Tensor:
        layers = torch.arange(block * LAYER_BLOCK, (block + 1) * LAYER_BLOCK, device=positions.device)
        head = torch.arange(heads, device=positions.device)[:, None]
        return hash_uniform(seed, layers[:, None, None, None], head, positions[None, :, None, :])

    draws = build() if forward is None else forward.cached(("draws", seed, block, heads, positions.device), build)
    return draws[layer % LAYER_BLOCK]


class RandomPolicy(Policy):
    def init_state(self, layer, keys):
        return {"draw": torch.zeros(keys.shape[:3], dtype=torch.float64, device=keys.device)}

    def observe(self, layer, stats):
        new = layer.new_index()
        draw, seed = layer.state["draw"], self.config.seed
        if layer.new_positions is not None:  # the model's positions: draws computed once per forward for all layers
            draws = layer_draws(layer.new_positions, seed, self.layer_idx, new.shape[1], layer.forward_pass)
            draw.scatter_(-1, new, draws.expand_as(new))
            return
        positions = layer.rope_pos.gather(-1, new)
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        draw.scatter_(-1, new, hash_uniform(seed, self.layer_idx, heads, positions))

    def select(self, layer):
        return keep_top(layer, layer.state["draw"], self.config.budget)


@dataclass(frozen=True)
class RandomConfig(MethodConfig):
    """Keep a uniformly random subset of the tokens seen."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head
    seed: int = param(0, ints(0, MAX_SEED))  # seed of the per-token draws

    name = "random"
    paper = "-"
    policy_class = RandomPolicy
