"""RoPE helpers: re-rotating keys and queries that were already rotated at one position to another.

Keys are stored rotated at the position they were written with (``original`` mode). Methods that re-index
positions inside the cache (StreamingLLM, Cascading KV: ``cache`` mode) rotate a copy by the difference between
the wanted and the stored position at attention time. Rotations compose, so ``R(a + d) x == R(d) R(a) x`` and the
result equals rotating the un-rotated key at the new position (up to float rounding); the model's
``attention_scaling`` factor was applied once already and is not applied again.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

PositionMode = Literal["original", "cache"]
POSITION_MODES: tuple[str, ...] = ("original", "cache")


def find_inv_freq(model: nn.Module) -> torch.Tensor:
    """Return the inverse frequencies of the model's rotary embedding (the global one for hybrid models)."""
    for name, buffer in model.named_buffers():
        if name.endswith("rotary_emb.inv_freq"):
            return buffer.detach().float()
    raise ValueError(
        f"{type(model).__name__} has no rotary embedding buffer 'rotary_emb.inv_freq'; "
        "position_mode='cache' needs a RoPE model (use position_mode='original')"
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., L, head_dim]``, already RoPE-rotated) further by ``delta`` positions (``[..., L]``)."""
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(x.device)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin
