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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output ``[B, H_q, q, d]`` and each row's float32 log-normaliser ``[B, H_q, q]`` in one pass.

    ``key``/``value`` ``[B, H_kv, L, d]``; ``visible`` boolean ``[B, H_kv or 1, q, L]``, or ``None`` for plain
    causal attention of the last ``q`` of ``L`` positions. On CPU PyTorch's fused flash kernel returns both; plain
    causal attention runs as two unmasked calls (the ``L - q`` earlier keys, the ``q`` newest causally) merged by
    their log-normalisers, faster than one masked call. Elsewhere ``chunked_softmax``."""
    if query.device.type != "cpu":
        parts = chunked_softmax(query, key, visible, scale, value=value, lse=True)
        return parts.output, parts.lse
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if visible is None:
        earlier = key.shape[2] - query.shape[2]
        output, lse = flash(query, key[:, :, earlier:], value[:, :, earlier:], 0.0, True, scale=scale)[:2]
        if earlier == 0:
            return output, lse.float()
        past, past_lse = flash(query, key[:, :, :earlier], value[:, :, :earlier], 0.0, False, scale=scale)[:2]
        total = torch.logaddexp(lse, past_lse)
        output = output * (lse - total).exp()[..., None].to(output.dtype)
        output += past * (past_lse - total).exp()[..., None].to(output.dtype)
        return output, total.float()
    if visible.shape[1] not in (1, query.shape[1]):
        visible = visible.repeat_interleave(query.shape[1] // visible.shape[1], dim=1)
    bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, -torch.inf)
    output, lse = flash(query, key, value, 0.0, False, attn_mask=bias, scale=scale)[:2]
    return output, lse.float()
