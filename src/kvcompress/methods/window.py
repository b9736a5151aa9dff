"""Local window: keep only the most recent tokens, no sinks.

The "local" / "window attention" baseline of StreamingLLM (Xiao et al., 2023, arXiv:2309.17453) and BUZZ. Keys
keep their original RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import check_budget, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.selection import keep_top


class WindowPolicy(Policy):
    per_head = False

    def select(self, layer):
        budget = self.config.budget  # scores are stream indices: distinct, and the newest rank highest
        return keep_top(layer, layer.token_idx[:, :1], budget, newest_kept=budget, distinct=True)


@dataclass(frozen=True)
class WindowConfig(MethodConfig):
    """Keep the ``budget`` most recent tokens per layer."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head

    name = "window"
    paper = "https://arxiv.org/abs/2309.17453"
    policy_class = WindowPolicy
