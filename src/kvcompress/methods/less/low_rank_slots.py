"""A decoding step's attention with LESS's state as ``R`` more slots of one softmax.

Eq. 3 for one query, ``(Σ_i e^{s_i} v_i + φ(q) H) / (Σ_i e^{s_i} + φ(q) zᵀ)``, splits the state by its rows:
``φ(q) H = Σ_r φ_r z_r (H_r / z_r)`` and ``φ(q) zᵀ = Σ_r φ_r z_r``. So it is one softmax over the stored keys' logits
``s_i`` and ``R`` more logits ``log(φ_r z_r)`` whose values are ``H_r / z_r`` (``LessLayer.ratio``): the softmax's
max keeps it safe for any logit size, with no log-normaliser or mix. The base policy's statistics are the softmax
over the stored keys alone, from the logits its own decoding step computes: bit for bit what it would see. Choices:
where ``z_r = 0`` the slot's logit is ``-inf`` and its value 0 (``z`` floored at float32's smallest normal number in
the ratio), so it takes no mass. An empty state gives the base policy's output to float rounding (the softmax runs
over ``R`` more entries); kernels whose ψ is identically zero never fold (``LessPolicy.inert``): bit for bit.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.softmax import one_query_logits


def low_rank_slots_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    features: torch.Tensor,
    low_rank: torch.Tensor,
    ratio: torch.Tensor,
    request: StatsRequest,
) -> tuple[torch.Tensor, AttentionStats]:
    """Eq. 3 for one query per row that sees every stored key, and the base policy's ``request``ed statistics:
    ``query`` ``[B, H_q, 1, D]``, ``key``/``value`` ``[B, H_kv, L, D]``, ``features`` ``[H_q, B, R]`` = ``φ(q)`` heads
    first (``phi_head_major``), the state ``[H | z]`` ``[B, H_kv, R, D + 1]`` and its ``ratio`` ``H / z``; the
    output ``[B, H_q, 1, D]`` in the query's dtype."""
    batch, q_heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    rows = batch * kv_heads
    logits = one_query_logits(query, key, dim**-0.5 if scaling is None else scaling)  # the base policy's own
    features = features.transpose(0, 1).reshape(rows, -1, features.shape[-1])  # [B H_kv, G, R]
    state_logits = features.mul(low_rank[..., -1].reshape(rows, 1, -1)).log_()
    probs = torch.cat([logits, state_logits], dim=-1).softmax(dim=-1)  # [B H_kv, G, L + R]
    output = torch.bmm(probs[..., :length].to(value.dtype), value.flatten(0, 1))
    output = output.float().baddbmm_(probs[..., length:], ratio.flatten(0, 1))
    stats = AttentionStats(query_count=1)
    if request.received or request.last_queries:  # the base policy's view: the sparse softmax of the stored keys
        shares = logits.softmax(dim=-1).view(batch, kv_heads, -1, length)
        stats.received = shares if request.received else None
        stats.last = shares.unsqueeze(3) if request.last_queries else None
    return output.view(batch, q_heads, 1, -1).to(query.dtype), stats


def state_ratio(low_rank: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``H / z`` ``[..., R, D]`` of a state ``[H | z]`` ``[..., R, D + 1]`` (0 where ``z = 0``, since ``H = 0`` there:
    ψ is non-negative); written to ``out`` when given."""
    floor = low_rank[..., -1:].clamp_min(torch.finfo(low_rank.dtype).tiny)
    return torch.div(low_rank[..., :-1], floor, out=out)
