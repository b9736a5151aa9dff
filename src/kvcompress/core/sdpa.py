"""PyTorch's scaled dot-product attention as every kvcompress attention path calls it: never cuDNN's backend.

On CUDA, cuDNN's SDPA backend builds a graph for each new key length, and a compressed cache's key length changes
every step; the flash and memory-efficient backends have no per-shape setup. Backends the user disabled stay
disabled; elsewhere than CUDA the call is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, **kwargs)`` without the cuDNN backend on CUDA."""
    if not query.is_cuda:
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    with sdpa_kernel(_enabled_backends_but_cudnn()):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)


def _enabled_backends_but_cudnn() -> list[SDPBackend]:
    enabled = (
        (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
    )
    return [backend for backend, on in enabled if on] or [SDPBackend.MATH]
