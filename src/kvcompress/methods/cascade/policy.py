"""The cascade's per-layer policy: the EMA constants and the head reduction (the layer does storage and attention)."""

from __future__ import annotations

import torch

from kvcompress.core.contract import Policy


class CascadePolicy(Policy):
    position_mode = "cache"  # ranks inside the cache (the cache computes the model's RoPE frequencies for it)
    per_head = False  # homogeneous heads: every KV head keeps the same tokens

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.gamma = config.ema_gamma
        # the EMA matters only where branch (d) compares scores
        self.needs_scores = config.cascades > 1 and config.select_tokens

    def reduce_heads(self, probs: torch.Tensor) -> torch.Tensor:
        """Reduce attention ``[B, H_kv, G, ..., L]`` over all query heads (``H_kv x G``) to ``[B, ..., L]``."""
        flat, how = probs.flatten(1, 2), self.config.reduction
        if how == "median":
            return flat.median(1).values  # lower median for an even head count
        return getattr(flat, "amax" if how == "max" else how)(1)  # "mean" or "max"
