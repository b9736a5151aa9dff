"""Deterministic per-token random numbers: the same draw for a token alone or in a padded batch."""

from __future__ import annotations

import torch

_MASK31 = 0x7FFFFFFF


def hash_uniform(seed: int, layer: int, head: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Deterministic uniform [0, 1) numbers from integer keys (a 31-bit multiply-xorshift hash)."""
    # reduced first (the seed in Python): any int64 seed stays in range, also when ``layer`` is a tensor
    key = (((seed * 0x27D4EB2F) & _MASK31) + layer * 0x165667B1) & _MASK31
    x = (position * 0x9E3779B1 + head * 0x85EBCA77 + key) & _MASK31
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 15)) * multiplier) & _MASK31
    return (x ^ (x >> 16)).double() / (_MASK31 + 1)
