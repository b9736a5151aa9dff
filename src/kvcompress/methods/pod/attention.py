"""PoD attention: this layer's logits on proximal tokens mixed with the block-start layer's logits on distant
tokens (both exact: one softmax, or the Eq. 4 gate), reading the block start's query and keys lent earlier in the
same forward (``PoDLayer.step``). The output comes from fused kernels (``kvcompress.methods.pod.fused``) where
nothing else is asked; the explicit softmax below gives the statistics, the ``tau`` gate and ``combine="lse"``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.softmax import row_chunks
from kvcompress.methods.pod.fused import (
    FLASH,
    grouped_attention,
    grouped_biases,
    mixed_sdpa,
    stream_biases,
    two_call_merge,
)
from kvcompress.methods.pod.layer import PoDLayer, PoDStep, QueryLayout
from kvcompress.methods.pod.ring import ring_plan

if TYPE_CHECKING:  # annotations only: the config module imports the policy, which imports this module
    from kvcompress.methods.pod.config import PoDConfig


def _masks(layer: PoDLayer, queries: int, mask: torch.Tensor | None, config, first: int = 0) -> tuple:
    """Visible, proximal and distant keys ``[B, H_kv or 1, q - first, L]`` of the query rows ``first ..`` (visible:
    the core's mask, or causal when it passed ``None``)."""
    if mask is not None:
        visible = mask[:, :, first:]
    else:
        query_idx = torch.arange(layer.seen - queries + first, layer.seen, device=layer.device)
        visible = layer.token_idx[:, :, None, :] <= query_idx[None, None, :, None]
    pos_k = layer.rope_pos[:, :, None, :]
    pos_q = layer.rope_pos[:, :, layer.rope_pos.shape[-1] - queries + first :, None]
    proximal = ((pos_k < config.n_sink) | (pos_q - pos_k < config.n_recent)) & visible
    return visible, proximal, visible & ~proximal


def _grouped(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H_kv or 1, ...]`` -> ``[B, heads, ...]`` (each KV head repeated for its query heads)."""
    if tensor.shape[1] == heads:
        return tensor
    if tensor.shape[1] == 1:
        return tensor.expand(-1, heads, *tensor.shape[2:])
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _sources(layer: PoDLayer, layout: QueryLayout, query: torch.Tensor, config) -> list:
    """Per sharing query head: its distant logits' query ``[B, q, d]`` and the block start's keys ``[B, L, d]``."""
    sources = []
    for h in layout.sharing:
        start = layout.starts[h]
        step = layer.shared_step(start)
        source_query = step.query if config.query_source == "block_start" else query
        sources.append((source_query[:, h], step.keys[:, layer.peers[start].full_pos[h // layout.groups]]))
    return sources


def pod_attention(
    layer: PoDLayer,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    config: PoDConfig,
    request: StatsRequest,
) -> tuple[torch.Tensor, AttentionStats | None]:
    """PoD attention of this forward's queries ``[B, H_q, q, d]`` over the layer's tokens; ``[B, H_q, q, d]``."""
    batch, q_heads, queries, dim = query.shape
    kv_heads, length = layer.values.shape[1], layer.values.shape[2]
    groups = q_heads // kv_heads
    layout = layer.query_layout(q_heads)
    layer.step = PoDStep(query=query, keys=layer.keys)
    if layer.ring_plan is None:
        layer.ring_plan = ring_plan(layout, config) or False
    scale = dim**-0.5 if scaling is None else scaling
    if layer.ring is not None:
        ring = layer.ring
        near, distant = (ring.keys, ring.values, ring.bias), ring.distant(length)
        return grouped_attention(layer, layout, query, near, distant, ring.has_distant(length), scale), None
    # a distant token needs a query at RoPE position n_sink + n_recent or beyond: decided on the host (the merges
    # below also handle rows that have none)
    if not layout.sharing or layer.max_position < config.n_sink + config.n_recent:
        keys, positions = layer.own_keys(), layer.forward_positions
        return layer_attention(query, keys, layer.values, mask, scaling, request, positions, layer.forward_pass)
    fused = _fuses(config, request)
    if fused:  # the output from fused kernels; the last rows' statistics, if asked for, from the explicit softmax
        fused_output = _fused(layer, layout, query, mask, config, scale)
        if not request.any:
            return fused_output, None
    sources, share_idx = _sources(layer, layout, query, config), layout.share_idx
    last_n = min(request.last_queries, queries)
    first = queries - last_n if fused else 0  # rows whose softmax is written out
    visible, proximal, distant = _masks(layer, queries, mask, config, first)
    own_keys, visible_q = layer.own_keys(), _grouped(visible, q_heads)
    value_q = None if fused else _grouped(layer.values, q_heads)  # (the fused output stands: statistics only)
    prox_s = _grouped(proximal, q_heads)[:, share_idx]
    dist_s = _grouped(distant, q_heads)[:, share_idx]
    outputs, last_rows, received = [], [], None
    skipped = eligible = 0
    for a, b in row_chunks(queries - first, batch * q_heads * length):
        r0, r1 = first + a, first + b
        # each KV head's query heads folded into rows: no key repeated per query head
        folded = query[:, :, r0:r1].reshape(batch, kv_heads, groups * (r1 - r0), dim)
        own = (folded @ own_keys.transpose(-1, -2)).view(batch, q_heads, r1 - r0, length).float() * scale
        dist = torch.stack([(q[:, r0:r1] @ k.transpose(-1, -2)).float() * scale for q, k in sources], dim=1)
        prox_r, dist_r, own_s = prox_s[:, :, a:b], dist_s[:, :, a:b], own[:, share_idx]
        allowed = dist_r
        if config.tau is not None or config.combine == "lse":
            lse_p = own_s.masked_fill(~prox_r, -math.inf).logsumexp(-1)
            lse_d = dist.masked_fill(~dist_r, -math.inf).logsumexp(-1)
            gate = torch.sigmoid(lse_p - lse_d)  # lse_d = -inf (no distant token) -> 1
            if config.tau is not None:
                has_distant = dist_r.any(-1)
                skip = has_distant & (gate >= config.tau)
                skipped += int(skip.sum())
                eligible += int(has_distant.sum())
                allowed = dist_r & ~skip[..., None]
                gate = torch.where(skip, torch.ones_like(gate), gate)
        mixed_s = torch.where(prox_r, own_s, dist).masked_fill(~(prox_r | allowed), -math.inf)
        logits = own.masked_fill(~visible_q[:, :, a:b], -math.inf).index_copy(1, share_idx, mixed_s)
        probs = logits.softmax(dim=-1)
        out = None if fused else probs.to(value_q.dtype) @ value_q
        if config.combine == "lse":
            p_prox = own_s.masked_fill(~prox_r, -math.inf).softmax(-1).to(value_q.dtype)
            p_dist = dist.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0).to(value_q.dtype)
            shared_values = value_q[:, share_idx]
            g = gate[..., None].to(value_q.dtype)
            out = out.index_copy(1, share_idx, g * (p_prox @ shared_values) + (1 - g) * (p_dist @ shared_values))
        outputs.append(out)
        if request.received:
            mass = probs.sum(dim=2)
            received = mass if received is None else received + mass
        if last_n and r1 > queries - last_n:
            last_rows.append(probs[:, :, max(r0, queries - last_n) - r0 :])
    layer.gate_counts[0] += skipped
    layer.gate_counts[1] += eligible
    output = fused_output if fused else torch.cat(outputs, dim=2)
    stats = None
    if request.any:
        stats = AttentionStats(query_count=queries)
        if request.received:
            stats.received = received.view(batch, kv_heads, groups, length)
        if last_n:
            stats.last = torch.cat(last_rows, dim=2).view(batch, kv_heads, groups, last_n, length)
            stats.last_visible = visible[:, :, queries - last_n - first :]
    return output, stats


def _fuses(config: PoDConfig, request: StatsRequest) -> bool:
    """Whether the output comes from fused kernels: the plain mixed softmax, asked at most for the last rows."""
    return config.tau is None and config.combine == "softmax" and not request.received and not request.lse


def _fused(layer: PoDLayer, layout: QueryLayout, query, mask, config, scale: float) -> torch.Tensor:
    """The mixed softmax's output (no statistics) from fused kernels: on the CPU without autograd two calls
    returning their log-sum-exp (grouped where the sharing heads are whole groups, with the forward's shared masks
    while the layer holds the stream as it came), one masked SDPA otherwise."""
    q_heads, queries = query.shape[1], query.shape[2]
    kernel = FLASH is not None and query.device.type == "cpu" and not (torch.is_grad_enabled() and query.requires_grad)
    if kernel and layout.runs is not None:
        biases, full_mask = stream_biases(layer, queries, layout.groups, query.dtype), None
        if biases is None:
            visible, proximal, distant = _masks(layer, queries, mask, config)
            biases = grouped_biases(layer, proximal, distant, layout.groups, query.dtype)
            full_mask = visible if visible.shape[1] == 1 else layer.heads_of(visible, "full")
        slot = layer.prox_slot.clamp(min=0)[..., None]
        near_values = layer.heads_of(layer.values, "prox").gather(2, slot.expand(*slot.shape[:3], query.shape[-1]))
        near, dist, has_distant = (layer.prox_keys, near_values, biases.prox), biases.dist, biases.has_distant
        return grouped_attention(layer, layout, query, near, dist, has_distant, scale, full_mask, biases.split)
    visible, proximal, distant = _masks(layer, queries, mask, config)
    keys_q, value_q, visible_q = (_grouped(t, q_heads) for t in (layer.own_keys(), layer.values, visible))
    merge = two_call_merge if kernel else mixed_sdpa
    sources = _sources(layer, layout, query, config)
    return merge(query, keys_q, value_q, visible_q, proximal, distant, layout.share_idx, sources, scale)
