"""Attention with each row's log-normaliser from PyTorch's fused kernels, for a caller that merges attention parts
or scores keys by their probabilities (KVzip's reconstruction: ``kvcompress.methods.kvzip.reconstruct``).

``F.scaled_dot_product_attention`` returns the output alone; the private ATen kernels behind it return the
log-normaliser too: on a CPU the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), on CUDA the
memory-efficient one (``_scaled_dot_product_efficient_attention``, any float dtype). Elsewhere the exact chunked
softmax (``kvcompress.core.softmax``) computes both.
"""

from __future__ import annotations

import torch

from kvcompress.core.softmax import chunked_softmax


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[B, H_q, q, d]`` over ``key``/``value`` ``[B, H_kv, n, d]``, causally over its own
    ``q`` keys (``causal``) or over every key: the output ``[B, H_q, q, d]`` and each row's float32 log-normaliser
    ``[B, H_q, q]`` in one pass. CUDA's kernel takes as many key heads as query heads: the query heads of a KV head
    become that head's rows where no mask tells them apart (``causal=False``), and the keys are repeated where one
    does."""
    if query.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        output, lse = flash(query, key, value, 0.0, causal, scale=scale)[:2]
        return output, lse.float()
    batch, q_heads, count, dim = query.shape
    kv_heads = key.shape[1]
    if query.is_cuda:
        groups = q_heads // kv_heads
        if causal:
            rows, key, value = query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        else:
            rows = query.reshape(batch, kv_heads, groups * count, dim)
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        output, lse = efficient(rows, key, value, None, True, 0.0, causal, scale=scale)[:2]
        # (the kernel's log-normalisers may be padded past the last row)
        return output.reshape(query.shape), lse[..., : rows.shape[2]].reshape(batch, q_heads, count).float()
    return chunked_attention_with_lse(query, key, value, scale, causal)


def chunked_attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` on devices without such a kernel (MPS, XPU, ...): the exact chunked softmax."""
    mask = None if causal else (lambda start, stop: query.new_ones(1, 1, stop - start, key.shape[2], dtype=torch.bool))
    parts = chunked_softmax(query, key, mask, scale, value=value, lse=True, rows_see_keys=True)
    return parts.output, parts.lse
