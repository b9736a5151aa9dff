"""Deterministic per-token random numbers: the same draw for a token alone or in a padded batch."""

from __future__ import annotations

import torch

from kvcompress.core.forward_cache import forward_cached

_MASK31 = 0x7FFFFFFF


def hash_uniform(seed: int, layer: int, head: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Deterministic uniform [0, 1) numbers from integer keys (a 31-bit multiply-xorshift hash)."""
    key = (seed * 0x27D4EB2F + layer * 0x165667B1) & _MASK31  # reduced first: any int64 seed stays in range
    x = (position * 0x9E3779B1 + head * 0x85EBCA77 + key) & _MASK31
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 15)) * multiplier) & _MASK31
    return (x ^ (x >> 16)).double() / (_MASK31 + 1)


LAYER_BLOCK = 64  # layers whose draws are computed together


def layer_draws(positions: torch.Tensor, seed: int, layer: int, heads: int) -> torch.Tensor:
    """``[B or 1, heads, q]``: ``hash_uniform(seed, layer, head, position)`` for the RoPE positions ``[B or 1, q]``
    of a forward's tokens (the model's ``position_ids``). The hash takes some twenty small ops: they run once per
    forward for a block of ``LAYER_BLOCK`` layers (``kvcompress.core.forward_cache``)."""
    block = layer // LAYER_BLOCK

    def build() -> torch.Tensor:
        layers = torch.arange(block * LAYER_BLOCK, (block + 1) * LAYER_BLOCK, device=positions.device)
        head = torch.arange(heads, device=positions.device)[:, None]
        return hash_uniform(seed, layers[:, None, None, None], head, positions[None, :, None, :])

    return forward_cached(positions, ("draws", seed, block, heads), build)[layer % LAYER_BLOCK]
