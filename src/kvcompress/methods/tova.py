"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104).

At every step the layer drops the token that receives the least attention from the current (last) query,
averaged over all heads of the layer, so every head keeps the same tokens. Scores are not accumulated: only the
current query counts. On a multi-token prefill the last prompt token is the current query.

Choice: the paper lets the current token itself be dropped when it receives the least attention; here, as for every
decode-time method, the tokens of the forward being processed are never dropped while they fit in the budget (so a
question fed after a compressed context is kept whole, as TOVAPress in kvpress keeps it); the victim is the least
attended older token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, param
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.core.selection import keep_top


class TOVAPolicy(Policy):
    stats = StatsRequest(last_queries=1)
    per_head = False
    batchable = True  # a decoding step's scores are per row: run for all layers at once
    # the current query's attention [B, 1, L] over the layer's view, from ``observe`` to ``select`` in the same
    # forward: a score that is never accumulated needs no per-slot state
    current: torch.Tensor | None = None

    def observe(self, layer, stats):
        self.current = stats.last[:, :, :, -1].mean(dim=(1, 2))[:, None]

    def select(self, layer):
        current, self.current = self.current, None  # (a prompt's scores are not kept past the forward)
        return keep_top(layer, current, self.config.budget)


@dataclass(frozen=True)
class TOVAConfig(MethodConfig):
    """Evict the token with the lowest current attention, averaged over heads."""

    budget: int = param(1024, check_budget)  # tokens kept per layer

    name = "tova"
    paper = "https://arxiv.org/abs/2401.06104"
    policy_class = TOVAPolicy
