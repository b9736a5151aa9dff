"""Work shared by every layer of one forward, kept on the model's ``position_ids`` tensor.

Every layer of a forward gets the same ``position_ids`` tensor (transformers builds a new one per forward), so
what depends only on it and on Python values (rotation matrices, per-token draws, slot tables of layers in the same
state) is built by the first layer that asks and read by the others. A ``position_ids`` tensor is assumed not to
be modified in place between forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

_CACHE = "_kvcompress_forward_cache"
T = TypeVar("T")


def forward_cached(position_ids: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
    """``build()`` once per ``position_ids`` tensor and ``key``; the stored result afterwards."""
    cache = getattr(position_ids, _CACHE, None)
    if cache is None:
        cache = {}
        setattr(position_ids, _CACHE, cache)
    if key not in cache:
        cache[key] = build()
    return cache[key]


def from_host(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of Python ``values`` on ``device`` without waiting for it: built on the CPU and copied with
    ``non_blocking`` (``torch.tensor(values, device=gpu)`` would make the host wait for the GPU's queue)."""
    return torch.tensor(values, dtype=dtype, device="cpu").to(device, non_blocking=True)
