"""PoD attention: this layer's logits on proximal tokens mixed with the block-start layer's logits on distant
tokens (both exact: one softmax, or the Eq. 4 gate), reading the block start's query and keys exposed earlier in
the same forward (``PoDLayer.step``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.softmax import row_chunks
from kvcompress.methods.pod.fused import (
    FLASH,
    grouped_biases,
    mixed_sdpa,
    two_call_merge,
    two_call_merge_grouped,
    whole_groups,
)
from kvcompress.methods.pod.layer import PoDLayer, PoDStep
from kvcompress.methods.pod.ring_attention import ring_attention, ring_plan
from kvcompress.methods.pod.stream_masks import stream_biases

if TYPE_CHECKING:  # annotations only: the config module imports the policy, which imports this module
    from kvcompress.methods.pod.config import PoDConfig


def _visible(layer: PoDLayer, queries: int, mask: torch.Tensor | None, first: int = 0) -> torch.Tensor:
    """Boolean ``[B, H_kv or 1, q - first, L]`` visibility of the query rows ``first ..`` (the core's mask, or
    causal when it passed ``None``)."""
    if mask is not None:
        return mask[:, :, first:]
    query_idx = torch.arange(layer.seen - queries + first, layer.seen, device=layer.device)
    return layer.token_idx[:, :, None, :] <= query_idx[None, None, :, None]


def _masks(layer: PoDLayer, queries: int, mask: torch.Tensor | None, config, first: int = 0) -> tuple:
    """Visible, proximal and distant keys ``[B, H_kv or 1, q - first, L]`` of the query rows ``first ..``."""
    visible = _visible(layer, queries, mask, first)
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
    starts, sharing = layer.query_layout(q_heads)
    layer.step = PoDStep(query=query, keys=layer.keys, full_pos=layer.full_pos)
    if layer.ring_plan is None:
        layer.ring_plan = ring_plan(layer, query, config, starts, sharing) or False
    if layer.ring is not None:
        scale = dim**-0.5 if scaling is None else scaling
        return ring_attention(layer, layer.ring_plan, query, config, scale), None
    value = layer.values
    # a distant token needs a query at RoPE position n_sink + n_recent or beyond: decided on the host (the merges
    # below also handle rows that have none)
    if not sharing or layer.max_position < config.n_sink + config.n_recent:
        positions = layer.forward_positions
        return layer_attention(query, layer.own_keys(), value, mask, scaling, request, positions, layer.forward_pass)

    scale = dim**-0.5 if scaling is None else scaling
    share_idx = layer.head_index(sharing)
    sources = []  # per sharing head: (distant query [B, q, d], distant keys [B, L, d])
    for h in sharing:
        step = layer.peers[starts[h]].step
        if step is None or step.keys.shape[2] != length:
            raise RuntimeError(f"pod: layer {starts[h]} (block start of layer {layer.index}) has no matching step")
        source_query = step.query if config.query_source == "block_start" else query
        sources.append((source_query[:, h], step.keys[:, step.full_pos[h // groups]]))
    fused = _fuses(config, request)
    if fused:  # the output from fused kernels; the last rows' statistics, if asked for, from the explicit softmax
        fused_output = _fused(layer, query, mask, config, (sharing, starts, share_idx), sources, scale)
        if not request.any:
            return fused_output, None
    last_n = min(request.last_queries, queries)
    first = queries - last_n if fused else 0  # rows whose softmax is written out
    visible, proximal, distant = _masks(layer, queries, mask, config, first)
    own_keys, visible_q = layer.own_keys(), _grouped(visible, q_heads)
    value_q = None if fused else _grouped(layer.values, q_heads)  # (the fused output stands: statistics only)
    prox_s = _grouped(proximal, q_heads)[:, share_idx]
    dist_s = _grouped(distant, q_heads)[:, share_idx]
    outputs, last_rows, received = [], [], None
    skipped = eligible = 0
    for r0, r1 in ((first + a, first + b) for a, b in row_chunks(queries - first, batch * q_heads * length)):
        own = _grouped_logits(query[:, :, r0:r1], own_keys).float() * scale  # [B, H_q, R, L]
        dist = torch.stack([(q[:, r0:r1] @ k.transpose(-1, -2)).float() * scale for q, k in sources], dim=1)
        prox_r, dist_r = prox_s[:, :, r0 - first : r1 - first], dist_s[:, :, r0 - first : r1 - first]
        own_s = own[:, share_idx]
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
        logits = own.masked_fill(~visible_q[:, :, r0 - first : r1 - first], -math.inf).index_copy(1, share_idx, mixed_s)
        probs = logits.softmax(dim=-1)
        out = None if fused else probs.to(value.dtype) @ value_q
        if config.combine == "lse":
            p_prox = own_s.masked_fill(~prox_r, -math.inf).softmax(-1)
            p_dist = dist.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0)
            o_prox, o_dist = (
                p_prox.to(value.dtype) @ value_q[:, share_idx],
                p_dist.to(value.dtype) @ value_q[:, share_idx],
            )
            g = gate[..., None].to(value.dtype)
            out = out.index_copy(1, share_idx, g * o_prox + (1 - g) * o_dist)
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


def _fused(layer, query, mask, config, heads, sources, scale) -> torch.Tensor:
    """The mixed softmax's output (no statistics) from fused attention kernels (``kvcompress.methods.pod.fused``):
    two calls returning their log-sum-exp on the CPU without autograd (grouped where ``whole_groups`` holds, with
    the forward's shared masks while the layer holds the stream as it came), one masked SDPA otherwise. ``heads``:
    the sharing query heads, every query head's block start and the sharing heads as a device tensor."""
    sharing, starts, share_idx = heads
    q_heads, queries = query.shape[1], query.shape[2]
    groups = q_heads // layer.values.shape[1]
    training = torch.is_grad_enabled() and query.requires_grad
    if FLASH is not None and query.device.type == "cpu" and not training and whole_groups(sharing, starts, groups):
        biases = stream_biases(layer, queries, groups, query.dtype)
        if biases is not None:
            return two_call_merge_grouped(layer, query, biases, None, sources, scale)
        visible, proximal, distant = _masks(layer, queries, mask, config)
        biases = grouped_biases(layer, proximal, distant, groups, query.dtype)
        full_visible = visible if visible.shape[1] == 1 else layer.heads_of(visible, "full")
        return two_call_merge_grouped(layer, query, biases, full_visible, sources, scale)
    visible, proximal, distant = _masks(layer, queries, mask, config)
    keys_q, value_q, visible_q = _repeated(layer, visible, q_heads)
    merge = two_call_merge if FLASH is not None and query.device.type == "cpu" and not training else mixed_sdpa
    return merge(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale)


def _grouped_logits(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query`` ``[B, H_q, R, d]`` against ``keys`` ``[B, H_kv, L, d]``: ``[B, H_q, R, L]``, each KV head's query
    heads folded into rows (no key repeated per query head)."""
    batch, q_heads, rows, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    folded = query.reshape(batch, kv_heads, q_heads // kv_heads * rows, dim)
    return (folded @ keys.transpose(-1, -2)).view(batch, q_heads, rows, length)


def _repeated(layer: PoDLayer, visible: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """The layer's own keys, its values and ``visible``, each KV head repeated for its query heads."""
    return _grouped(layer.own_keys(), heads), _grouped(layer.values, heads), _grouped(visible, heads)
