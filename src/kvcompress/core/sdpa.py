"""PyTorch's scaled dot-product attention as every kvcompress attention path calls it: never cuDNN's backend.

On CUDA, cuDNN's SDPA backend builds a graph for each new key length, and a compressed cache's key length changes
every step; the flash and memory-efficient backends have no per-shape setup. Backends the user disabled stay
disabled; elsewhere than CUDA the call is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvcompress.core.softmax import chunked_softmax


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


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``query`` ``[B, H_q, q, d]`` over its own ``q`` keys and values ``[B, H_kv, q, d]``: the
    output ``[B, H_q, q, d]`` and each row's float32 log-normaliser ``[B, H_q, q]`` in one pass (on CPU PyTorch's
    fused flash kernel returns both; elsewhere ``chunked_softmax``)."""
    if query.device.type != "cpu":
        parts = chunked_softmax(query, key, None, scale, value=value, lse=True)
        return parts.output, parts.lse
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    output, lse = flash(query, key, value, 0.0, True, scale=scale)[:2]
    return output, lse.float()
