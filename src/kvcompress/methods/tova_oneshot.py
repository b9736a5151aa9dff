"""One-shot TOVA / MSRNN: the TOVA rule (Oren et al., 2024, arXiv:2401.06104) applied once, after the prompt.

The baseline NaCl calls MSRNN, at the same ratio budget: the layer keeps the prompt tokens
that receive the most attention from the last prompt token (NaCl's proxy score with the current token as the only
proxy), averaged over all heads of the layer as in TOVA, so every head keeps the same tokens; decoding then
appends without eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.selection import keep_top
from kvcompress.methods.oneshot import OneShotConfig, kept_per_sequence, prompt_lengths
from kvcompress.methods.tova import TOVAPolicy


class OneShotTOVAPolicy(TOVAPolicy):
    one_shot = True
    latest_stats_only = True  # the last prompt token's attention: the last forward's

    # the compression may run after a chunked prefill, so the scores travel with the slots (per-slot state)
    def init_state(self, layer, keys):
        return {"attention": torch.zeros(keys.shape[:3], device=keys.device)}

    def observe(self, layer, stats):
        super().observe(layer, stats)
        layer.state["attention"], self.current = self.current, None

    def select(self, layer):
        keep = kept_per_sequence(prompt_lengths(layer), self.config.ratio, self.config.budget)
        return keep_top(layer, layer.state["attention"][:, :1], keep)


@dataclass(frozen=True)
class OneShotTOVAConfig(OneShotConfig):
    """Top tokens by the last prompt token's attention, averaged over heads, once after the prompt."""

    name = "tova_oneshot"
    paper = "https://arxiv.org/abs/2401.06104"
    policy_class = OneShotTOVAPolicy
