"""The parallel ("masked") form of LESS, used to train the kernels and to check them against real decoding.

Eviction in a real cache is permanent, so a token's fate is one number, ``evict_at[j]``: the first query row that no
longer sees token ``j`` (``S`` if none). Row ``i`` attends to ``{j <= i : evict_at[j] > i}`` and its state holds
``{j : evict_at[j] <= i}``, so ``H_i`` is a cumulative sum of ``ψ(k_j)ᵀ v_j`` ordered by eviction row (``O(S R D)``,
no ``S x S`` low-rank matrix): the paper's masked form (§3.2). ``eviction_times`` runs the base policy's own cache
layer token by token, so training sees exactly the masks decoding will produce. ``masked_forward`` runs a model so
(an attention function switched in for one forward); ``CaptureRun`` records each layer's post-RoPE Q, K, V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvcompress.core.attention import attention_with_stats, register_attention
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.softmax import chunked_softmax, grouped
from kvcompress.methods.full import FullConfig
from kvcompress.methods.less.config import LessConfig
from kvcompress.methods.less.kernels import LayerKernels
from kvcompress.methods.less.policy import mix_low_rank


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_at: torch.Tensor | None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the cached tokens in float32, ``(lse [B, H_q, S], out [B, H_q, S, D])``: row ``i`` sees
    ``{j <= i : evict_at[j] > i}`` (``evict_at`` ``[B, H_kv, S]``; ``None`` = nothing evicted)."""
    length = query.shape[2]
    idx = torch.arange(length, device=query.device)

    def visible(start: int, stop: int) -> torch.Tensor:
        rows = idx[start:stop]
        seen = (idx[None, :] <= rows[:, None])[None, None]  # [1, 1, c, S]
        if evict_at is not None:
            seen = seen & (evict_at[:, :, None, :] > rows[None, None, :, None])
        return seen

    parts = chunked_softmax(query.float(), key.float(), visible, scaling, value=value.float(), lse=True)
    return parts.lse, parts.output


def low_rank_parallel(
    phi_q: torch.Tensor, psi_k: torch.Tensor, value: torch.Tensor, evict_at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num = φ(q_i) H_i`` ``[B, H_q, n, D]`` and ``den = φ(q_i) z_iᵀ`` ``[B, H_q, n]`` for the last ``n`` rows ``i``
    (``phi_q`` ``[B, H_q, n, R]``: those rows' features), with the state
    ``[H_i | z_i] = Σ_{j : evict_at[j] <= i} ψ(k_j)ᵀ [v_j | 1]`` (Eq. 6): each token's outer product scattered to its
    eviction row, then summed over rows (differentiable in φ and ψ)."""
    batch, kv_heads, length, rank = psi_k.shape
    q_heads, rows = phi_q.shape[1:3]
    value = value.float()
    slot = evict_at.clamp(max=length)  # never evicted: row S, beyond the window
    outer = psi_k[..., :, None] * torch.cat([value, value.new_ones(*value.shape[:-1], 1)], -1)[..., None, :]
    state = outer.new_zeros(batch, kv_heads, length + 1, rank, value.shape[-1] + 1)  # [B, Hkv, S + 1, R, D + 1]
    state = state.scatter_add(2, slot[..., None, None].expand_as(outer), outer).cumsum(2)[:, :, length - rows : length]
    read = torch.einsum("bkgsr,bksrd->bkgsd", grouped(phi_q, kv_heads), state).reshape(batch, q_heads, rows, -1)
    return read[..., :-1], read[..., -1]


def less_masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_at: torch.Tensor | None,
    kernels: LayerKernels | None,
    scaling: float | None = None,
) -> torch.Tensor:
    """The masked (parallel) LESS attention output ``[B, H_q, S, D]`` (float32); ``kernels=None``: sparse only."""
    lse, out = sparse_attention(query, key, value, evict_at, scaling)
    if kernels is None or evict_at is None:
        return out
    num, den = low_rank_parallel(kernels.phi(query), kernels.psi(key), value, evict_at)
    return mix_low_rank(lse, out, num, den)


def eviction_times(
    policy: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Run ``policy``'s cache layer token by token over one layer's post-RoPE ``query`` ``[B, H_q, S, D]``,
    ``key``/``value`` ``[B, H_kv, S, D]`` (positions ``0..S-1``, no padding) and return ``evict_at`` ``[B, H_kv, S]``:
    the first row whose query no longer sees each token (``S`` if kept to the end). The statistics are those the real
    decode hands the policy, so these are the evictions of prefilling token 0 and decoding the rest one by one."""
    if policy.position_mode != "original":
        raise ValueError("the masked LESS form needs a base policy with position_mode='original'")
    batch, kv_heads, length, _ = key.shape
    layer = CompressedLayer(policy)
    evict_at = torch.full((batch, kv_heads, length), length, dtype=torch.long, device=key.device)
    alive = torch.zeros(batch, kv_heads, length, dtype=torch.bool, device=key.device)
    positions = torch.arange(length, device=key.device)[None, :].expand(batch, -1)
    request = policy.stats
    for t in range(length):
        layer.update(key[:, :, t : t + 1], value[:, :, t : t + 1])
        layer.register_new_tokens(positions[:, t : t + 1], None)
        alive[:, :, t] = True
        stats = None
        if request.any:
            mask = layer.attention_mask(1)
            _, stats = attention_with_stats(query[:, :, t : t + 1], layer.keys, layer.values, mask, scaling, request)
        layer.after_attention(stats)
        slots = torch.where(layer.token_idx >= 0, layer.token_idx, length)  # free slots land past the end
        kept = alive.new_zeros(batch, kv_heads, length + 1).scatter_(2, slots, layer.valid)[..., :length]
        evict_at.masked_fill_(alive & ~kept, t + 1)
        alive &= kept
    return evict_at


LESS_ATTENTION = "kvcompress_less"


# The ``less_run`` model keyword: ``run(layer_idx, query, key, value, scaling)`` -> the output ``[B, H_q, S, D]``.
AttentionRun = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


@dataclass
class CaptureRun:
    """Full causal attention that records each layer's post-RoPE ``query``, ``key``, ``value`` (``records[idx]``)."""

    records: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, layer_idx, query, key, value, scaling):
        self.records[layer_idx] = (query, key, value)
        groups = query.shape[1] // key.shape[1]
        return scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=groups > 1)


def _less_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("the masked LESS form takes unpadded windows (no attention_mask with padding)")
    run: AttentionRun = kwargs.get("less_run") or CaptureRun()
    return run(module.layer_idx, query, key, value, scaling).transpose(1, 2).contiguous(), None


@contextmanager
def less_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Switch ``model`` to the LESS masked-form attention function for the block, then back."""
    register_attention(LESS_ATTENTION, _less_attention, lambda **_: None)  # no mask: the runs make their own
    previous = model.config._attn_implementation
    model.set_attn_implementation(LESS_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def masked_forward(model: nn.Module, input_ids: torch.Tensor, run: AttentionRun) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of unpadded windows (positions ``0..S-1``) with every layer's attention by ``run``."""
    with less_attention(model):
        return model(input_ids=input_ids, use_cache=False, less_run=run).logits


def masked_run(config: Any, num_layers: int) -> AttentionRun:
    """The masked (parallel) form of a method config: a ``LessConfig`` (its base policy's evictions + its kernels),
    another evicting config (Baseline, Baseline+: evictions only), or ``full`` (neither)."""
    less = config if isinstance(config, LessConfig) else None
    base = config if less is None else less.base_config
    policies = None if isinstance(config, FullConfig) else [base.policy(i) for i in range(num_layers)]

    def run(layer_idx, query, key, value, scaling):
        evict_at = kernels = None
        if policies is not None:
            evict_at = eviction_times(policies[layer_idx], query, key, value, scaling)
        if less is not None:
            kernels = less.kernels_for(layer_idx, query.shape[1], key.shape[1], key.shape[-1])
        return less_masked_attention(query, key, value, evict_at, kernels, scaling).to(query.dtype)

    return run
