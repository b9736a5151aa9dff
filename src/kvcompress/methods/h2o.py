"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023, arXiv:2306.14048).

Each KV head keeps its ``recent`` most recent tokens plus the tokens with the largest attention mass received so
far (accumulated over every query since the token arrived), and evicts at every step while decoding. With
grouped-query attention, the mass is summed over the query heads that share a KV head. The paper's default split
is half heavy hitters, half recent tokens. During a prefill the mass is accumulated over all the prompt's queries
(the paper's one-shot prompt step); with a chunked prefill, eviction runs between chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, number, param
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.core.selection import keep_top, recent_mask


class H2OPolicy(Policy):
    stats = StatsRequest(received=True)
    batchable = True

    def init_state(self, layer, keys):
        return {"mass": torch.zeros(keys.shape[:3], device=keys.device)}

    def observe(self, layer, stats):
        layer.state["mass"].add_(stats.received.sum(dim=2))

    def select(self, layer):
        recent = self.config.budget - self.config.heavy
        return keep_top(layer, layer.state["mass"], self.config.budget, recent_mask(layer, recent), newest_kept=recent)


@dataclass(frozen=True)
class H2OConfig(MethodConfig):
    """Heavy hitters by accumulated attention + recent window, per KV head."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head
    heavy_ratio: float = param(0.5, number(0, 1))  # budget share of the heavy hitters; the rest is the recent window

    name = "h2o"
    paper = "https://arxiv.org/abs/2306.14048"
    policy_class = H2OPolicy

    @property
    def heavy(self) -> int:
        return int(self.budget * self.heavy_ratio)
