"""Key norm (Devoto et al., 2024, arXiv:2406.11430): keep the keys with the lowest L2 norm.

Low-norm keys tend to receive high attention. The norm is taken of the stored (rotated) key, which RoPE does not
change. Each KV head keeps its own lowest-norm tokens.

Choices where the paper is silent (it compresses a prompt once):

- Decoding (default, ``one_shot=False``): eviction runs after every forward, but never touches the tokens of the
  forward being processed when they fit in the budget (a question fed after a compressed context keeps all its
  tokens; only a prompt chunk longer than the budget is ranked by norm), and the ``recent`` newest tokens are always
  kept (8 by default: the current token and a short local context, which the norm alone would not protect).
- ``one_shot=True``: the paper's and kvpress's setting, the prompt compressed once after the prefill and decoding
  appending without eviction (use ``recent=0`` for kvpress's ``KnormPress``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import check_budget, ints, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.selection import keep_top, recent_mask


class KnormPolicy(Policy):
    batchable = True  # the score is the stored state: a decoding step's selection runs for all layers at once
    one_shot = property(lambda self: self.config.one_shot)

    def init_state(self, layer, keys):
        return {"negative_norm": -keys.float().norm(dim=-1)}

    def select(self, layer):
        budget, recent = self.config.budget, self.config.recent  # (recent <= budget)
        if not self.one_shot and layer.new_tokens <= budget:
            recent = max(recent, layer.new_tokens)  # this forward's tokens are the newest: never evicted
        protected = recent_mask(layer, recent) if recent else None
        return keep_top(layer, layer.state["negative_norm"], budget, protected, newest_kept=recent)


@dataclass(frozen=True)
class KnormConfig(MethodConfig):
    """Keep the lowest-norm keys (plus the newest tokens while decoding)."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head
    recent: int = param(8, ints(0, "budget"))  # newest tokens always kept (the paper has none; 0 = norm only)
    one_shot: bool = False  # True: compress the prompt once, append while decoding (the paper, kvpress)

    name = "knorm"
    paper = "https://arxiv.org/abs/2406.11430"
    policy_class = KnormPolicy
