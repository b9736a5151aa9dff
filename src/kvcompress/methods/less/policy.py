"""LESS's policy: the base policy's decisions and statistics, plus the low-rank attention term.

``mix_low_rank``: Eq. 3 in log-sum-exp form. The sparse part enters as its softmax output and log-normaliser,
the low-rank part as ``num = φ(q) H`` and ``den = φ(q) zᵀ``: ``out = e^{lse_s - lse} out_s + e^{lse_lr - lse}
num / den`` with ``lse = logaddexp(lse_s, log den)``; equal to ``(φH + Σ e^s v) / (φzᵀ + Σ e^s)`` but safe for any
logit size. Choice: where ``den == 0`` (nothing evicted, or ψ ≡ 0) the low-rank term is exactly absent
(``log 0 = -inf``) instead of the official code's ``max(den, 1e-6)`` floor, so LESS equals its base policy exactly
then; the floor only ever added a ≤1e-6 phantom mass.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvcompress.core.attention import attention_with_stats, sdpa
from kvcompress.core.contract import Policy
from kvcompress.core.softmax import chunked_softmax, grouped
from kvcompress.methods.less.kernels import LayerKernels

if TYPE_CHECKING:  # annotations only: the config module imports this one
    from kvcompress.methods.less.config import LessConfig


class LessPolicy(Policy):
    """The base policy's decisions and statistics, plus the low-rank attention term (``attend``)."""

    def __init__(self, config: LessConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.base = config.base_config.policy(layer_idx)
        self.stats = self.base.stats
        self.position_mode = self.base.position_mode
        self.per_head = self.base.per_head
        self.one_shot = self.base.one_shot
        self.kernels: LayerKernels | None = None

    def layer_kernels(self, q_heads: int, kv_heads: int, head_dim: int, device: torch.device) -> LayerKernels:
        """This layer's kernels on ``device`` (the model's): a copy where the loaded or built ones are elsewhere,
        so kernels shared between caches stay where they are."""
        if self.kernels is None:
            kernels = self.config.kernels_for(self.layer_idx, q_heads, kv_heads, head_dim)
            if kernels.phi_w1.device != device:  # each tensor copied straight to ``device`` (no copy where it is)
                memo = {id(t): _moved(t, device) for t in (*kernels.parameters(), *kernels.buffers())}
                kernels = copy.deepcopy(kernels, memo)
            self.kernels = kernels
        return self.kernels

    def init_state(self, layer, keys):
        return self.base.init_state(layer, keys)

    def observe(self, layer, stats):
        self.base.observe(layer, stats)

    def select(self, layer):
        return self.base.select(layer)

    def attend(self, layer, query, key, value, mask, scaling):
        kernels = self.layer_kernels(query.shape[1], key.shape[1], key.shape[-1], query.device)
        if not layer.folded:
            return None  # nothing folded yet: exactly the base policy's attention
        if self.stats.any:
            output, stats = attention_with_stats(query, key, value, mask, scaling, self.stats)
        else:
            output, stats = sdpa(query, key, value, mask, scaling), None
        kv_heads = key.shape[1]
        lse = cached_logsumexp(query, key, mask, scaling)  # [B, H_q, q]
        with torch.no_grad():
            features = grouped(kernels.phi(query), kv_heads)  # [B, H_kv, G, q, R]
        num = features @ layer.low_rank_h[:, :, None]  # [B, H_kv, G, q, D]
        den = (features * layer.low_rank_z[:, :, None, None]).sum(-1)  # [B, H_kv, G, q]
        mixed = mix_low_rank(lse, output.float(), num.flatten(1, 2), den.flatten(1, 2))
        return mixed.to(query.dtype), stats


def cached_logsumexp(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Log-normaliser ``[B, H_q, q]`` of the softmax over the stored keys (float32, in query chunks)."""
    return chunked_softmax(query, key, mask, scaling, lse=True).lse


def mix_low_rank(
    lse_sparse: torch.Tensor, out_sparse: torch.Tensor, num: torch.Tensor, den: torch.Tensor
) -> torch.Tensor:
    """Eq. 3 in log-sum-exp form (float32).

    ``lse_sparse`` ``[...]`` and ``out_sparse`` ``[..., D]``: log-normaliser and softmax output of the cached tokens;
    ``num`` ``[..., D]`` = ``φ(q) H`` and ``den`` ``[...]`` = ``φ(q) zᵀ`` of the low-rank state.
    """
    positive = den > 0
    safe_den = torch.where(positive, den, torch.ones_like(den))
    lse_lr = torch.where(positive, safe_den.log(), torch.full_like(den, -math.inf))
    lse = torch.logaddexp(lse_sparse, lse_lr)
    weight_sparse = torch.exp(lse_sparse - lse)[..., None]
    weight_lr = torch.exp(lse_lr - lse)[..., None]
    return weight_sparse * out_sparse + weight_lr * (num / safe_den[..., None])


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    moved = tensor.to(device).detach()
    return nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
