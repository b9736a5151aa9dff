"""Selection helpers shared by the methods: ratio budgets, top-k keep-sets, sink and recent-window masks."""

from __future__ import annotations

import math

import torch

from kvcompress.core.contract import Selection
from kvcompress.core.layer import CompressedLayer


def ratio_budget(n_tokens: torch.Tensor, ratio: float) -> torch.Tensor:
    """Tokens kept for a prompt of ``n_tokens`` at a ratio: ``max(1, floor(ratio * n))`` (kvpress rounds likewise)."""
    return torch.clamp((n_tokens.to(torch.float64) * ratio).floor().long(), min=1)


def keep_top(
    layer: CompressedLayer,
    scores: torch.Tensor,
    keep: torch.Tensor | int,
    protected: torch.Tensor | None = None,
) -> Selection | None:
    """Keep, per sequence and head, the ``keep`` highest-scoring valid tokens; ``protected`` tokens first.

    ``scores`` is ``[B, H_kv or 1, L]``; ``keep`` an int or ``[B]`` counts. Returns ``None`` when no sequence holds
    more valid tokens than it may keep (nothing to evict). Equal scores go to the newer token (a stable sort over
    the reversed stream order), so selections are deterministic.
    """
    valid = layer.valid
    n_valid = valid.sum(-1).amax(1)  # [B]; equal across heads
    keep = torch.as_tensor(keep, device=valid.device).expand_as(n_valid)
    keep = torch.minimum(keep, n_valid)
    if bool((n_valid <= keep).all()) and valid.shape[-1] == int(keep.max()):
        return None
    heads = valid.shape[1]
    scores = scores.to(torch.float64).expand(-1, heads, -1)
    ranked = scores.masked_fill(~valid, -math.inf)
    if protected is not None:
        ranked = ranked.masked_fill(protected & valid, math.inf)
    k = int(keep.max())
    length = ranked.shape[-1]
    newest_first = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    order = length - 1 - newest_first  # best first
    slot_ok = torch.arange(k, device=valid.device)[None, None, :] < keep[:, None, None]
    indices, perm = order.sort(dim=-1)
    slot_ok = slot_ok.expand_as(order).gather(-1, perm) & valid.gather(-1, indices)
    return Selection(indices=indices, valid=slot_ok)


def sink_mask(layer: CompressedLayer, sinks: int) -> torch.Tensor:
    """Boolean ``[B, H_kv, L]``: the first ``sinks`` valid tokens of each sequence."""
    valid = layer.valid
    rank = valid.cumsum(-1) - 1
    return valid & (rank < sinks)


def recent_mask(layer: CompressedLayer, recent: int | torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, H_kv, L]``: the last ``recent`` valid tokens of each sequence (an int, or ``[B]`` counts)."""
    valid = layer.valid
    from_end = valid.flip(-1).cumsum(-1).flip(-1) - 1
    if isinstance(recent, torch.Tensor):
        recent = recent[:, None, None]
    return valid & (from_end < recent)
