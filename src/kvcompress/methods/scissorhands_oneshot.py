"""One-shot Scissorhands: the Scissorhands rule (Liu et al., 2023, arXiv:2305.17118) applied once, after the prompt.

A NaCl baseline at the same ratio budget: each KV head counts, over the last ``history``
prompt queries, how often a token received less than its row's average attention (rows averaged over the query
heads of the KV head, as in ``scissorhands``), keeps the most recent quarter of the budget, and fills the rest
with the tokens least often below average (ties to the newer token); decoding then appends without eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import ints, number, param
from kvcompress.core.selection import keep_top, recent_mask
from kvcompress.methods.oneshot import OneShotConfig, kept_per_sequence, prompt_lengths, share_of
from kvcompress.methods.scissorhands import ScissorhandsPolicy


class OneShotScissorhandsPolicy(ScissorhandsPolicy):
    one_shot = True

    def select(self, layer):
        keep = kept_per_sequence(prompt_lengths(layer), self.config.ratio, self.config.budget)
        recent = share_of(keep, self.config.recent_share)
        # the score kept by ``ScissorhandsPolicy.observe``: fewer low counts first, ties to the newer token
        return keep_top(layer, layer.state["score"], keep, recent_mask(layer, recent))


@dataclass(frozen=True)
class OneShotScissorhandsConfig(OneShotConfig):
    """Evict the prompt tokens most often below average attention in the last queries, once after the prompt."""

    history: int = param(256, ints(1))  # last prompt queries whose rows are counted
    recent_share: float = param(0.25, number(0, 1))  # share of the kept tokens that are the most recent ones

    name = "scissorhands_oneshot"
    paper = "https://arxiv.org/abs/2305.17118"
    policy_class = OneShotScissorhandsPolicy
