"""A decoding step's attention read from the quantized slots' codes (``QuantizedSlotBuffers``), with no dequantized
copy of the cache.

A key stored per channel reads back as ``k_c = scale_c * code_c + min_c`` (one ``scale`` and ``min`` per channel
and key group of ``G`` slots), so a query's logit is ``q · k = (q * scale) · code + q · min``: the scales are
folded into the query once per key group (``[B H, groups, G_q, d]``, ``G_q`` query heads per KV head) and each
group's logits are one product of that query with the group's codes, plus ``q · min``. A value stored per token in
groups of channels reads back as ``v = scale_t * code + min_t``, so the output is ``Σ_t (p_t scale_t) code_t +
Σ_t p_t min_t``: the probabilities are multiplied by each token's scales (one weight row per channel group) and
one product with the codes gives every channel group's sums, of which each channel keeps its own group's.

The codes are unpacked (``core.kivi.unpacked_part``: a shift and a mask per run of channels) and converted to
float32 once: the operand of the products, as large as the dequantized keys and values, without the multiply-add
per element that dequantizing costs. Reading each byte as ``byte >> (bits * i)`` and folding ``2**bits`` into the
weights would save the mask, but the differences it takes are not exact in float32 (logits off by 1e-4 on a tiny
model, beyond the reference test's tolerance) and saved no measurable time. All of it in float32 (the model's
dtype may be bf16), the output cast to the query's dtype.

The exact tokens (the residual window's ring, or the step's own token without one) are what attention reads for
their slots, as ``QuantizedSlotBuffers.view`` does: their logits (one product with the ring's exact keys) are
written over those slots' logits, their probabilities are taken out of the codes' sums and applied to the exact
values. A buffer column one past the slots read takes the ring entries whose token is no longer stored there (the
view's spare slot), and is masked out before the softmax.

Per step and layer this is about twenty tensor operations; what grows with the cache is one float32 copy of the
codes' parts (the operand of the products, as large as the dequantized keys and values the view would build) and the
logits; no host read, no loop over heads or tokens (the loop is over the ``8 / bits`` parts of a byte).

Statistics are the softmax's rows over the slots read (``received`` and ``last`` of a one-query step, the
log-normaliser), as ``core.softmax`` gives them for a decoding query.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.kivi import unpacked_part


def code_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` ``[..., w]`` packed codes as float32 ``[..., w * 8 / bits]`` in channel order (``core.kivi``'s
    packing: the ``8 / bits`` runs of channels side by side)."""
    runs = 8 // bits
    if runs == 1:
        return packed.float()
    width = packed.shape[-1]
    out = torch.empty(*packed.shape[:-1], width * runs, dtype=torch.float32, device=packed.device)
    for index in range(runs):
        out[..., index * width : (index + 1) * width].copy_(unpacked_part(packed, bits, index))
    return out


def quantized_one_query(
    slots,
    width: int,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    request: StatsRequest,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, AttentionStats | None]:
    """Attention of one query per row ``query`` ``[B, H_q, 1, d]`` over slots ``[0, width)`` of ``slots`` (a
    ``QuantizedSlotBuffers``) under ``mask`` ``[B, H_kv or 1, 1, width]`` (``None``: every slot visible).

    ``exact``: keys ``[B, H_kv, E, d]``, values ``[B, H_kv, E, d_v]`` and slots ``[B, H_kv, E]`` (``width``: not
    stored) of the tokens read exactly. Returns ``[B, H_q, 1, d_v]`` in the query's dtype and the statistics
    ``request`` asks for (``None`` if none)."""
    batch, q_heads, _, dim = query.shape
    heads = slots.token_idx.shape[1]
    rows, groups_q = batch * heads, q_heads // heads
    group, bits = slots.group, slots.bits
    scale = dim**-0.5 if scaling is None else scaling
    key_groups = min(-(-(width + 1) // group), slots.capacity // group)
    columns = key_groups * group
    q = query.reshape(rows, groups_q, dim).float() * scale

    # logits of the stored slots: (q * scale) · code + q · min, per key group
    key_scale = slots.key_scale[:, :, :key_groups].reshape(rows, key_groups, 1, dim).float()
    key_min = slots.key_min[:, :, :key_groups].reshape(rows, key_groups, dim).float()
    folded = (q[:, None] * key_scale).reshape(rows * key_groups, groups_q, dim)
    offset = torch.bmm(key_min, q.transpose(1, 2)).reshape(rows * key_groups, groups_q, 1)
    codes = code_columns(slots.keys[:, :, :columns].reshape(rows, columns, -1), bits).view(
        rows * key_groups, group, dim
    )
    grouped = torch.baddbmm(offset, folded, codes.transpose(1, 2))  # [rows · groups, G_q, G]
    logits = grouped.new_empty(rows, groups_q, max(columns, width + 1))
    logits[:, :, :columns].view(rows, groups_q, key_groups, group).copy_(
        grouped.view(rows, key_groups, groups_q, group).transpose(1, 2)
    )
    logits = logits[:, :, : width + 1]

    # the exact tokens' logits over their slots' (the spare column takes the tokens no longer stored)
    exact_keys, exact_values, exact_slots = exact
    count = exact_slots.shape[-1]
    target = exact_slots.reshape(rows, 1, count).expand(rows, groups_q, count)
    exact_logits = torch.bmm(q, exact_keys.reshape(rows, count, dim).float().transpose(1, 2))
    logits.scatter_(2, target, exact_logits)
    logits[:, :, width] = float("-inf")
    if mask is not None:
        logits[:, :, :width].view(batch, heads, groups_q, width).masked_fill_(~mask, float("-inf"))
    top = logits.amax(dim=-1) if request.lse else None
    probs = logits.softmax(dim=-1)  # [rows, G_q, width + 1], 0 in the spare column

    # values: Σ_t p_t (scale_t * code_t + min_t) over the stored slots, Σ p_t v_t over the exact ones
    exact_probs = probs.gather(2, target)
    stored = probs.scatter(2, target, 0.0)[:, :, :width]
    value_scale = slots.tensors["value_scale"][:, :, :width].reshape(rows, width, -1).float()
    value_min = slots.tensors["value_min"][:, :, :width].reshape(rows, width, -1).float()
    value_groups = value_scale.shape[-1]
    by_group = value_scale.transpose(1, 2).contiguous()  # [rows, groups, width]
    weights = (stored[:, :, None, :] * by_group[:, None]).view(rows, groups_q * value_groups, width)
    values = code_columns(slots.tensors["values"][:, :, :width].reshape(rows, width, -1), bits)
    sums = torch.bmm(weights, values)  # [rows, G_q · groups, d_v]: every group's weights
    value_dim = sums.shape[-1]
    sums = sums.view(rows, groups_q, value_groups, value_groups, value_dim // value_groups)
    output = sums.diagonal(dim1=2, dim2=3).transpose(-1, -2).reshape(rows, groups_q, value_dim)  # own group's
    minima = torch.bmm(stored, value_min)  # [rows, G_q, groups]
    output += (
        minima[..., None]
        .expand(rows, groups_q, value_groups, value_dim // value_groups)
        .reshape(rows, groups_q, value_dim)
    )
    output.baddbmm_(exact_probs, exact_values.reshape(rows, count, -1).float())
    output = output.view(batch, q_heads, 1, value_dim).to(query.dtype)
    if not request.any:
        return output, None
    seen = probs[:, :, :width].unflatten(0, (batch, heads))  # [B, H_kv, G_q, width]
    stats = AttentionStats(query_count=1)
    if request.received:
        stats.received = seen
    if request.last_queries:
        stats.last = seen.unsqueeze(3)
        stats.last_visible = mask
    if request.lse:
        stats.lse = (top - probs.amax(dim=-1).log()).view(batch, q_heads, 1)
    return output, stats
