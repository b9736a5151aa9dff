"""LESS's policy: the base policy's decisions and statistics, plus the low-rank attention term.

``mix_low_rank`` is Eq. 3 in log-sum-exp form: with the sparse softmax's output and log-normaliser ``lse_s`` and
``num = φ(q) H``, ``den = φ(q) zᵀ``, the low-rank share of the mass is ``w = sigmoid(log den - lse_s)`` and
``out = out_s + w (num / den - out_s)``: ``(φH + Σ e^s v) / (φzᵀ + Σ e^s)``, safe for any logit size. Choice:
``den`` is floored at float32's smallest normal number (1.2e-38), not the official code's ``max(den, 1e-6)``: where
``den == 0`` (nothing evicted, or ψ ≡ 0; ``num`` is 0 too) the share is ``sigmoid(-87.3 - lse_s)``, below half a
float32 step for any row with ``lse_s > -70``, so LESS equals its base policy exactly (the official floor added a
1e-6 phantom mass). A decoding step that sees every stored key takes Eq. 3 as one softmax (``low_rank_slots``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvcompress.core.attention import attention_with_stats
from kvcompress.core.contract import Policy
from kvcompress.core.softmax import grouped, head_matmul
from kvcompress.methods.less.kernels import InferenceWeights, LayerKernels, phi_features, phi_head_major
from kvcompress.methods.less.low_rank_slots import low_rank_slots_attention

if TYPE_CHECKING:  # annotations only: the config module imports this one
    from kvcompress.methods.less.config import LessConfig


class LessPolicy(Policy):
    """The base policy's decisions and statistics, plus the low-rank attention term (``attend``)."""

    NOT_SAVED = ("kernels",)  # a cache file holds the ``weights`` (tensors), not the modules (``kvcompress.persist``)

    def __init__(self, config: LessConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.base = config.base_config.policy(layer_idx)
        # the base policy's settings; its methods are called below (a bound method held as an attribute is code in the
        # policy's state, which a saved cache refuses)
        for name in ("stats", "position_mode", "per_head", "one_shot", "batchable"):
            setattr(self, name, getattr(self.base, name))
        self.kernels: LayerKernels | None = None
        self.weights: InferenceWeights | None = None  # ``LayerKernels.inference_weights``, made once
        self.inert = False  # ψ ≡ 0 (its last matrix is zero, as in ``zero_kernels``): nothing is ever folded
        self.request = dataclasses.replace(self.stats, lse=True)  # what ``attend`` asks of the softmax

    def init_state(self, layer, keys):
        return self.base.init_state(layer, keys)

    def observe(self, layer, stats):
        self.base.observe(layer, stats)

    def select(self, layer):
        return self.base.select(layer)

    def layer_kernels(self, q_heads: int, kv_heads: int, head_dim: int, device: torch.device) -> LayerKernels | None:
        """This layer's kernels on ``device``, copied there if elsewhere (shared kernels stay where they are), and
        their ``weights`` as inference takes them, made once (kernels are frozen while a cache uses them); ``None``
        in a cache loaded from a file, which holds the weights it was saved with."""
        if self.weights is None:
            kernels = self.config.kernels_for(self.layer_idx, q_heads, kv_heads, head_dim)
            self.inert = kernels.psi_is_zero()  # read where the kernels were made or loaded, before any copy
            if kernels.phi_w1.device != device:  # each parameter copied straight to ``device`` (none where it is)
                memo = {id(p): nn.Parameter(p.to(device).detach(), p.requires_grad) for p in kernels.parameters()}
                kernels = copy.deepcopy(kernels, memo)
            self.weights = kernels.inference_weights()
            self.kernels = kernels
        return self.kernels

    def attend(self, layer, query, key, value, mask, scaling):
        self.layer_kernels(query.shape[1], key.shape[1], key.shape[-1], query.device)  # set at the first attention
        if not layer.folded:
            return None  # nothing folded yet: exactly the base policy's attention
        if query.shape[2] == 1 and mask is None:  # a decoding step that sees every stored key
            features = phi_head_major(query, *self.weights.phi)
            ratio = layer.ratio  # (folds what is pending first)
            return low_rank_slots_attention(query, key, value, scaling, features, layer.low_rank, ratio, self.stats)
        # the layer's masks leave every query its own key
        output, stats = attention_with_stats(query, key, value, mask, scaling, self.request, rows_see_keys=True)
        return self.with_low_rank(layer, query, output, stats)

    def with_low_rank(self, layer, query, output, stats):
        """Eq. 3 from the sparse attention's ``output`` ``[B, H_q, q, D]``, its ``stats`` (``lse`` required) and the
        layer's state: the output in the query's dtype and the base policy's statistics (``None`` if it asks none)."""
        features = phi_features(query, *self.weights.phi)  # [B, H_q, q, R]
        kv_heads = layer.low_rank.shape[1]
        state = head_matmul(grouped(features, kv_heads).flatten(2, 3), layer.low_rank)  # [B, H_kv, G q, D + 1]
        state = state.view(*features.shape[:3], -1)  # [B, H_q, q, D + 1]: [φ(q) H | φ(q) zᵀ]
        mixed = mix_low_rank(stats.lse, output.float(), state[..., :-1], state[..., -1])
        return mixed.to(query.dtype), stats if self.stats.any else None


def mix_low_rank(
    lse_sparse: torch.Tensor, out_sparse: torch.Tensor, num: torch.Tensor, den: torch.Tensor
) -> torch.Tensor:
    """Eq. 3 in log-sum-exp form (float32) from the cached tokens' log-normaliser ``lse_sparse`` ``[...]`` and softmax
    output ``out_sparse`` ``[..., D]`` and the state's ``num = φ(q) H`` ``[..., D]`` and ``den = φ(q) zᵀ`` ``[...]``."""
    safe_den = den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # finite logs and gradients at den = 0
    share = torch.sigmoid(safe_den.log() - lse_sparse[..., None])
    return torch.lerp(out_sparse, num / safe_den, share)
