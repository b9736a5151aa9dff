"""Key norm (Devoto et al., 2024, arXiv:2406.11430): keep the keys with the lowest L2 norm.

Low-norm keys tend to receive high attention. The norm is taken of the stored (rotated) key, which RoPE does not
change. Each KV head keeps its own lowest-norm tokens; eviction runs at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import check_budget
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.selection import keep_top


class KnormPolicy(Policy):
    def init_state(self, layer, keys):
        return {"negative_norm": -keys.float().norm(dim=-1)}

    def select(self, layer):
        return keep_top(layer, layer.state["negative_norm"], self.config.budget)


@dataclass(frozen=True)
class KnormConfig(MethodConfig):
    """Keep the lowest-norm keys."""

    budget: int = 1024  # tokens kept per layer and KV head

    name = "knorm"
    paper = "https://arxiv.org/abs/2406.11430"
    policy_class = KnormPolicy

    def validate(self) -> None:
        check_budget(self.budget)
