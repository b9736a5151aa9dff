"""One-shot H2O: the H2O rule (Zhang et al., 2023, arXiv:2306.14048) applied once, after the prompt.

The baseline NaCl compares against at the same ratio budget (NaCl §3): every KV head keeps
its most recent tokens plus the tokens with the largest attention mass accumulated over *all* the prompt's queries
(NaCl's proxy score with every prompt token as proxy), once, right after the prefill; decoding then appends. The
mass is summed over the query heads of a KV head, as in ``h2o``. The paper's half heavy / half recent split is
the default. The accumulated mass needs every query's softmax: it is computed exactly in query chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import number, param
from kvcompress.core.selection import keep_top, recent_mask
from kvcompress.methods.h2o import H2OPolicy
from kvcompress.methods.oneshot import OneShotConfig, kept_per_sequence, prompt_lengths, share_of


class OneShotH2OPolicy(H2OPolicy):
    one_shot = True

    def select(self, layer):
        keep = kept_per_sequence(prompt_lengths(layer), self.config.ratio, self.config.budget)
        recent = keep - share_of(keep, self.config.heavy_ratio)
        return keep_top(layer, layer.state["mass"], keep, recent_mask(layer, recent))


@dataclass(frozen=True)
class OneShotH2OConfig(OneShotConfig):
    """Heavy hitters by attention accumulated over the whole prompt + recent window, once after the prompt."""

    heavy_ratio: float = param(0.5, number(0, 1))  # share kept by accumulated attention; the rest are recent

    name = "h2o_oneshot"
    paper = "https://arxiv.org/abs/2306.14048"
    policy_class = OneShotH2OPolicy
