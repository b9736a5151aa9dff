"""Random eviction: each KV head keeps a uniformly random subset of the tokens seen.

Every token draws a fixed score from a hash of (seed, layer, head, RoPE position), and the layer keeps the
highest scores. At every step the kept set is therefore a uniform random subset of all tokens seen so far, and a
sequence gets the same draw alone or in a padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.methods.base import MethodConfig, Policy, check_budget, check_int_range, keep_top

_MASK31 = 0x7FFFFFFF


def hash_uniform(seed: int, layer: int, head: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Deterministic uniform [0, 1) numbers from integer keys (a 31-bit multiply-xorshift hash)."""
    x = (position * 0x9E3779B1 + head * 0x85EBCA77 + (seed * 0x27D4EB2F + layer * 0x165667B1)) & _MASK31
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 15)) * multiplier) & _MASK31
    return (x ^ (x >> 16)).double() / (_MASK31 + 1)


class RandomPolicy(Policy):
    def init_state(self, layer, keys):
        return {"draw": torch.zeros(keys.shape[:3], dtype=torch.float64, device=keys.device)}

    def observe(self, layer, stats):
        count = layer.new_tokens
        positions = layer.rope_pos[..., -count:]
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        layer.state["draw"][..., -count:] = hash_uniform(self.config.seed, self.layer_idx, heads, positions)

    def select(self, layer):
        return keep_top(layer, layer.state["draw"], self.config.budget)


@dataclass(frozen=True)
class RandomConfig(MethodConfig):
    """Keep a uniformly random subset of the tokens seen."""

    budget: int = 1024  # tokens kept per layer and KV head
    seed: int = 0  # seed of the per-token draws

    name = "random"
    paper = "-"
    policy_class = RandomPolicy

    def validate(self) -> None:
        check_budget(self.budget)
        check_int_range(self.seed, "seed", 0)
