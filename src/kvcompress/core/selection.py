"""Selection helpers shared by the methods: ratio budgets, keep rules, sink and recent-window masks."""

from __future__ import annotations

import torch

from kvcompress.core.contract import Keep, LayerView


def ratio_budget(n_tokens: torch.Tensor | int, ratio: float) -> torch.Tensor | int:
    """Tokens kept of ``n_tokens`` (``[B]`` or an int) at a ratio: ``max(1, floor(ratio * n))``, float64 (kvpress)."""
    if isinstance(n_tokens, int):
        return max(1, int(n_tokens * ratio))  # (non-negative: truncation is the floor)
    return torch.clamp((n_tokens.to(torch.float64) * ratio).floor().long(), min=1)


def keep_top(
    layer: LayerView,
    scores: torch.Tensor,
    keep: torch.Tensor | int,
    protected: torch.Tensor | None = None,
    *,
    newest_kept: int = 0,
    distinct: bool = False,
) -> Keep | None:
    """The ``Keep`` rule of the ``keep`` (an int or ``[B]`` counts) highest ``scores``, ``protected`` first, or
    ``None`` when the layer holds no more than ``keep`` tokens."""
    nothing_to_evict = not isinstance(keep, torch.Tensor) and layer.occupied <= keep
    return None if nothing_to_evict else Keep(scores, keep, protected, newest_kept, distinct)


def sink_mask(layer: LayerView, sinks: int) -> torch.Tensor:
    """Boolean ``[B, H_kv, W]``: the first ``sinks`` real tokens of each sequence."""
    if layer.all_valid:  # no padding: a token's rank among real tokens is its stream index
        return layer.token_idx < sinks
    return layer.valid & (layer.rank < sinks)


def recent_mask(layer: LayerView, recent: int | torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, H_kv, W]``: the last ``recent`` real tokens seen of each sequence (an int, or ``[B]`` counts)."""
    if isinstance(recent, torch.Tensor):
        recent = recent[:, None, None]
    elif layer.all_valid:  # no padding: ranks are stream indices and every token seen is real
        return layer.token_idx >= layer.seen_step - recent
    return layer.valid & (layer.rank >= layer.real_count()[..., None] - recent)
