"""SnapKV (Li et al., 2024, arXiv:2404.14469): one-shot compression of the prompt.

The last ``window`` prompt tokens (the observation window, where the question usually sits) vote for the earlier
tokens: their attention rows are summed, averaged over the query heads of each KV head, smoothed with a 1D max
pool of width ``kernel``, and each KV head keeps its top tokens plus the whole window. The cache is compressed
once, after the prompt; decoding then appends without eviction. The budget is in tokens or a ratio of the prompt
(it bounds the compressed prompt: decoding adds one token per step, as in the paper).

Pooling covers the prefix only (the tokens before the window), zero-padded at its edges, as the authors' code and
kvpress do: the window's own (large) votes never leak onto the last ``kernel // 2`` prefix tokens. The paper's text
does not say; pooling the whole row would keep those edge tokens whatever they received.

``allocation`` shares the budget among layers (``pyramid``: PyramidKV, whose schedule counts the window in every
layer's budget, kvpress's ``PyramidKVPress``) or among a layer's heads (``adakv``), see
``kvcompress.methods.allocation``; the window stays protected in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.checks import check_budget, check_ratio, ints, number, one_of, param
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.core.selection import keep_top, ratio_budget, recent_mask
from kvcompress.methods.allocation import ALLOCATIONS, allocated_keep, allocated_layer_class


class SnapKVPolicy(Policy):
    one_shot = True
    latest_stats_only = True  # the votes of the prompt's last ``window`` queries, from the last forward

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.stats = StatsRequest(last_queries=config.window)

    def init_state(self, layer, keys):
        return {"vote": torch.zeros(keys.shape[:3], device=keys.device)}

    def observe(self, layer, stats):
        if stats.query_count < 2 or layer.compressed:
            return
        votes = stats.last.sum(dim=3).mean(dim=2)  # [B, H_kv, L]
        prefix = votes.shape[-1] - self.config.window  # the window is the last columns: the layer is dense here
        if self.config.kernel > 1 and prefix > 0:
            pool = F.max_pool1d if self.config.pooling == "max" else F.avg_pool1d
            kernel = self.config.kernel
            pooled = pool(votes[..., :prefix].reshape(-1, 1, prefix), kernel, 1, kernel // 2)
            votes = torch.cat([pooled.reshape(*votes.shape[:2], prefix), votes[..., prefix:]], dim=-1)
        layer.state["vote"] = votes

    def select(self, layer, keep: int | torch.Tensor | None = None):
        """Keep the top-voted tokens plus the window: ``keep`` tokens (an int or ``[B]`` counts; a composing method
        such as PoD passes its own), else the config's budget or ratio."""
        window = recent_mask(layer, self.config.window)
        if keep is None and self.config.allocation != "uniform":
            return allocated_keep(self, layer, layer.state["vote"], window, self.config.window)
        if keep is None:
            n_valid = layer.view_width if layer.all_valid else layer.valid.sum(-1).amax(1)  # all_valid: no host read
            keep = self.config.budget if self.config.ratio is None else ratio_budget(n_valid, self.config.ratio)
        return keep_top(layer, layer.state["vote"], keep, window)


@dataclass(frozen=True)
class SnapKVConfig(MethodConfig):
    """Observation-window voting with pooling, top-k per KV head, once after the prompt."""

    budget: int | None = param(None, check_budget)  # tokens kept per layer and KV head (give this or ratio)
    ratio: float | None = param(None, check_ratio)  # fraction of the prompt kept, in (0, 1] (give this or budget)
    window: int = param(32, ints(1, "budget"))  # observation window: last prompt tokens that vote, always kept
    kernel: int = param(7, ints(1))  # pooling width (odd)
    pooling: str = one_of("max", "avg")  # "max" or "avg"
    allocation: str = one_of(*ALLOCATIONS)  # pyramid: PyramidKV, per layer; adakv: per head (allocation.py)
    beta: int = param(20, ints(1, 10_000))  # pyramid's steepness (kvpress PyramidKVPress)
    alpha_safeguard: float = param(0.2, number(0, 1))  # adakv: a head keeps this share of its uniform count (kvpress)
    ragged: bool = True  # adakv: heads store their own counts (False: one slot buffer as wide as the fullest head)

    name = "snapkv"
    paper = "https://arxiv.org/abs/2404.14469"
    policy_class = SnapKVPolicy

    def validate(self) -> None:
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("snapkv needs exactly one of budget (tokens, >= 1) or ratio (in (0, 1])")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd integer >= 1, got {self.kernel}")

    def layer_class(self):
        return allocated_layer_class(self)
