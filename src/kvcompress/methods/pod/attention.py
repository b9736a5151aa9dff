"""PoD attention: this layer's logits on proximal tokens mixed with the block start's on distant tokens (one
softmax, or the Eq. 4 gate), reading the block start's query and keys lent earlier in the forward (``PoDLayer.step``).

The explicit softmax, in query chunks, where statistics, ``tau`` or ``combine="lse"`` ask for it; else fused calls
(``_fused``): ``grouped_attention`` (the ring's step; CPU forwards when the sharing heads are whole groups) runs Eq. 4
literally, one call over the proximal keys with the layer's logits and one over the distant keys with the block
start's, each with its log-sum-exp (``attention_part``: the CPU's ``FLASH``, elsewhere explicit logits), repeating no
key per query head; other layouts on the CPU make the same two calls with keys repeated per query head (2x faster
than the one SDPA); elsewhere and under autograd, one masked SDPA over keys laid out twice. All equal the explicit
mixed softmax (tests).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.softmax import row_chunks
from kvcompress.methods.pod.layer import PoDLayer, PoDStep, QueryLayout
from kvcompress.methods.pod.ring import ring_plan

if TYPE_CHECKING:  # annotations only: the config module imports this one
    from kvcompress.methods.pod.config import PoDConfig

NO_STATS = StatsRequest()
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # CPU only; returns the LSE


def _masks(layer: PoDLayer, queries: int, mask: torch.Tensor | None, config, first: int = 0) -> tuple:
    """Visible (the core's mask, or causal), proximal and distant keys ``[B, H_kv or 1, q - first, L]`` of the
    query rows ``first ..``."""
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


def _sources(layer: PoDLayer, layout: QueryLayout, query: torch.Tensor) -> list:
    """Per sharing query head: its distant logits' query ``[B, q, d]`` and the block start's keys ``[B, L, d]``."""
    sources = []
    for h in layout.sharing:
        source_query, keys = layer.shared_step(layout.starts[h], query)
        sources.append((source_query[:, h], keys[:, layer.peers[layout.starts[h]].full_pos[h // layout.groups]]))
    return sources


def pod_attention(layer: PoDLayer, query: torch.Tensor, mask, scaling, config: PoDConfig, request: StatsRequest):
    """PoD attention of this forward's queries ``[B, H_q, q, d]`` over the layer's tokens: the output ``[B, H_q, q,
    d]`` and the statistics ``request`` asks for (or None)."""
    batch, q_heads, queries, dim = query.shape
    kv_heads, length = layer.values.shape[1], layer.values.shape[2]
    groups = q_heads // kv_heads
    layout = layer.query_layout(q_heads)
    layer.step = PoDStep(query=query, keys=layer.keys)
    if layer.ring_plan is None:
        layer.ring_plan = ring_plan(layout, config) or False
    scale = dim**-0.5 if scaling is None else scaling
    if (ring := layer.ring) is not None:
        near, distant = (ring.keys, layer.ring_values(), ring.bias), ring.dist[..., :length]
        return grouped_attention(layer, layout, query, near, distant, ring.has_distant(length), scale), None
    # a distant token needs a query at position n_sink + n_recent or beyond (the merges handle rows without one)
    if not layout.sharing or layer.max_position < config.n_sink + config.n_recent:
        keys, positions = layer.own_keys(), layer.forward_positions
        return layer_attention(query, keys, layer.values, mask, scaling, request, positions, layer.forward_pass)
    fused = _fuses(config, request)
    if fused:  # the output from fused kernels; the last rows' statistics, if asked for, from the explicit softmax
        fused_output = _fused(layer, layout, query, mask, config, scale)
        if not request.any:
            return fused_output, None
    sources, share_idx = _sources(layer, layout, query), layout.share_idx
    last_n = min(request.last_queries, queries)
    first = queries - last_n if fused else 0  # rows whose softmax is written out
    visible, proximal, distant = _masks(layer, queries, mask, config, first)
    own_keys, visible_q = layer.own_keys(), _grouped(visible, q_heads)
    value_q = None if fused else _grouped(layer.values, q_heads)  # (the fused output stands: statistics only)
    prox_s, dist_s = (_grouped(allowed, q_heads)[:, share_idx] for allowed in (proximal, distant))
    outputs, last_rows, received = [], [], 0
    for a, b in row_chunks(queries - first, batch * q_heads * length):
        r0, r1 = first + a, first + b
        # each KV head's query heads folded into rows: no key repeated per query head
        folded = query[:, :, r0:r1].reshape(batch, kv_heads, groups * (r1 - r0), dim)
        own = (folded @ own_keys.transpose(-1, -2)).view(batch, q_heads, r1 - r0, length).float() * scale
        dist = torch.stack([(q[:, r0:r1] @ k.transpose(-1, -2)).float() * scale for q, k in sources], dim=1)
        prox_r, dist_r, own_s = prox_s[:, :, a:b], dist_s[:, :, a:b], own[:, share_idx]
        allowed, near = dist_r, own_s.masked_fill(~prox_r, -math.inf)
        if config.tau is not None or config.combine == "lse":
            lse_d = dist.masked_fill(~dist_r, -math.inf).logsumexp(-1)
            gate = torch.sigmoid(near.logsumexp(-1) - lse_d)  # lse_d = -inf (no distant token) -> 1
            if config.tau is not None:
                has_distant = dist_r.any(-1)
                skip = has_distant & (gate >= config.tau)
                layer.gate_counts[0] += int(skip.sum())
                layer.gate_counts[1] += int(has_distant.sum())
                allowed = dist_r & ~skip[..., None]
                gate = torch.where(skip, torch.ones_like(gate), gate)
        far = dist.masked_fill(~allowed, -math.inf)
        mixed_s = torch.where(prox_r, near, far)
        logits = own.masked_fill(~visible_q[:, :, a:b], -math.inf).index_copy(1, share_idx, mixed_s)
        probs = logits.softmax(dim=-1)
        out = None if fused else probs.to(value_q.dtype) @ value_q
        if config.combine == "lse":  # Eq. 4: g o_P + (1 - g) o_D
            o_p, o_d = (x.softmax(-1).nan_to_num(0.0).to(value_q.dtype) @ value_q[:, share_idx] for x in (near, far))
            out = out.index_copy(1, share_idx, torch.lerp(o_d, o_p, gate[..., None].to(value_q.dtype)))
        outputs.append(out)
        if request.received:
            received = received + probs.sum(dim=2)
        if last_n and r1 > queries - last_n:
            last_rows.append(probs[:, :, max(r0, queries - last_n) - r0 :])
    output = fused_output if fused else torch.cat(outputs, dim=2)
    if not request.any:
        return output, None
    stats = AttentionStats(queries, received.view(batch, kv_heads, groups, length) if request.received else None)
    if last_n:
        stats.last = torch.cat(last_rows, dim=2).view(batch, kv_heads, groups, last_n, length)
        stats.last_visible = visible[:, :, queries - last_n - first :]
    return output, stats


def _fused(layer: PoDLayer, layout: QueryLayout, query, mask, config, scale: float) -> torch.Tensor:
    """The mixed softmax's output from fused kernels (the forward's shared masks: ``stream_biases``)."""
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
    share_idx, kv_of = layout.share_idx, layout.share_idx // (q_heads // proximal.shape[1])
    source_query, source_keys = (torch.stack(part, dim=1) for part in zip(*_sources(layer, layout, query), strict=True))
    if kernel:  # Eq. 4 by two calls with their log-sum-exp, keys repeated per query head; block-start heads by SDPA
        out = scaled_dot_product_attention(query, keys_q, value_q, attn_mask=visible_q, scale=scale)
        values, dist_mask = value_q[:, share_idx], distant[:, kv_of]
        prox_bias = additive(proximal[:, kv_of], query.dtype)
        o_prox, lse_prox = attention_part(query[:, share_idx], keys_q[:, share_idx], values, prox_bias, scale)
        o_dist, lse_dist = attention_part(source_query, source_keys, values, additive(dist_mask, query.dtype), scale)
        return out.index_copy(1, share_idx, gate_merge(o_prox, lse_prox, o_dist, lse_dist, dist_mask.any(-1)))
    # elsewhere the mixed softmax as one SDPA call: every key twice, [k_own, 0] and [0, k_start], against the query
    # [q_own, q_start], the mask picking per (query, key) the own copy for proximal tokens (all visible ones at
    # block-start heads) and the block-start copy for distant ones; the layer's values for both. No L x L float tensor.
    source_query = torch.zeros_like(query).index_copy(1, share_idx, source_query)
    zeros = torch.zeros_like(keys_q)
    source_keys = zeros.index_copy(1, share_idx, source_keys)
    keys = torch.cat([torch.cat([keys_q, zeros], dim=-1), torch.cat([zeros, source_keys], dim=-1)], dim=2)
    own_allowed = visible_q.index_copy(1, share_idx, proximal[:, kv_of])
    dist_allowed = torch.zeros_like(own_allowed).index_copy(1, share_idx, distant[:, kv_of])
    query, values = torch.cat([query, source_query], dim=-1), torch.cat([value_q, value_q], dim=2)
    mask = torch.cat([own_allowed, dist_allowed], dim=-1)
    return scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


def _fuses(config: PoDConfig, request: StatsRequest) -> bool:
    """Whether the output comes from fused kernels: the plain mixed softmax, asked at most for the last rows."""
    return config.tau is None and config.combine == "softmax" and not request.received and not request.lse


# --- the output from fused attention calls (``_fused``, the ring's step) ------------------------------------------
class GroupedBiases(NamedTuple):
    """Additive masks (0 or -inf) of the sharing KV heads, query head ``g`` of a group in rows ``g q .. (g + 1) q -
    1``; a leading dimension of 1 is shared."""

    prox: torch.Tensor  # [B or 1, S or 1, G q, P]: the stored proximal keys (``prox_slot`` order) each row sees
    dist: torch.Tensor  # [B or 1, S or 1, G q, L]: the distant keys each row sees
    has_distant: torch.Tensor | None  # [B or 1, S or 1, G q] (None: every row has some)
    # (first, stop): instead every row sees the distant keys [first, stop) and the next q keys causally (``dist``:
    # that [.., G q, q] block's mask)
    split: tuple[int, int] | None = None


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``."""
    return torch.full(allowed.shape, -math.inf, dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def grouped_biases(layer, proximal, distant, groups: int, dtype: torch.dtype) -> GroupedBiases:
    """The sharing heads' biases from the layer's ``[B, H_kv, q, L]`` proximal and distant masks (each row repeated
    for the ``groups`` query heads)."""
    slot = layer.prox_slot  # [B, S, P]: each stored proximal key's slot, -1 for none
    index = slot.clamp(min=0)[:, :, None].expand(-1, -1, proximal.shape[2], -1)
    prox_seen = (layer.heads_of(proximal, "prox").gather(3, index) & (slot >= 0)[:, :, None]).repeat(1, 1, groups, 1)
    dist_mask = layer.heads_of(distant, "prox").repeat(1, 1, groups, 1)
    return GroupedBiases(additive(prox_seen, dtype), additive(dist_mask, dtype), dist_mask.any(-1))


def stream_biases(layer, queries: int, groups: int, dtype: torch.dtype) -> GroupedBiases | None:
    """The biases ``[1, 1, G q, ...]`` of this forward's rows while ``layer`` holds the stream as it came
    (``PoDLayer.on_stream``: token ``i`` at slot ``i`` and position ``i`` in every layer and head), else None: the
    forward's first sharing layer builds them, the others reuse them."""
    if not layer.on_stream or layer.forward_positions is None:
        return None
    config = layer.policy.config
    stored = layer.prox_slot.shape[-1]
    key = ("pod-stream-biases", layer.seen, queries, stored, groups, dtype, config.n_sink, config.n_recent)
    return layer.forward_pass.cached(key, lambda: _stream(layer, queries, groups, dtype, config))


def _stream(layer, queries: int, groups: int, dtype: torch.dtype, config) -> GroupedBiases:
    query_pos = torch.arange(layer.seen - queries, layer.seen, device=layer.device)[:, None]

    def near_and_far(key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [q, n] each
        seen = key_pos <= query_pos
        near = (key_pos < config.n_sink) | (query_pos - key_pos < config.n_recent)
        return seen & near, seen & ~near

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [q, ...] -> [1, 1, G q, ...]: the same rows per query head
        return tensor.repeat(groups, *([1] * (tensor.dim() - 1)))[None, None]

    prox_seen, _ = near_and_far(layer.prox_slot[0, 0])  # a stored proximal key's slot is its position here
    prox = rows(additive(prox_seen, dtype))
    stop = layer.seen - queries - config.n_recent  # distant to every query before it, to query i up to stop + i
    if stop > config.n_sink:  # an unmasked call and a small causal one instead of one [G q, L] mask
        causal = torch.ones(queries, queries, dtype=torch.bool, device=layer.device).tril()
        return GroupedBiases(prox, rows(additive(causal, dtype)), None, (config.n_sink, stop))
    _, distant = near_and_far(torch.arange(layer.seen, device=layer.device))
    return GroupedBiases(prox, rows(additive(distant, dtype)), rows(distant.any(-1)))


def attention_part(query, keys, values, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``query`` ``[B, n, R, d]`` over ``keys``/``values`` ``[B, n, L, d]`` under an additive ``mask`` (or
    None): the output (zero for a row that sees nothing) and the log-sum-exp ``[B, n, R]``."""
    if FLASH is not None and query.device.type == "cpu":
        return FLASH(query, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    logits = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        logits.add_(mask)
    lse = logits.logsumexp(-1)
    weights = (logits - lse.clamp(min=torch.finfo(logits.dtype).min)[..., None]).exp_()
    return torch.matmul(weights.to(values.dtype), values), lse


def gate_merge(o_near, lse_near, o_far, lse_far, has_distant: torch.Tensor | None) -> torch.Tensor:
    """Eq. 4: ``g o_P + (1 - g) o_D``, ``g = sigmoid(LSE_P - LSE_D)``; rows without a distant token (False in
    ``has_distant``; None: none) take ``o_P``."""
    if has_distant is not None:
        lse_far = lse_far.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_near - lse_far)[..., None].to(o_near.dtype)
    return torch.lerp(o_far, o_near, gate)


def fold_heads(layer, query: torch.Tensor, kind: str, groups: int) -> torch.Tensor:
    """The query heads of the KV heads of ``kind``, each KV head's ``G`` folded into rows: ``[B, n, G q, d]``."""
    batch, heads, queries, dim = query.shape
    return layer.heads_of(query.reshape(batch, heads // groups, groups * queries, dim), kind)


def grouped_attention(layer, layout, query, near, distant, has_distant, scale, full_mask=None, split=None):
    """The mixed softmax when the sharing heads are whole groups (``layout.runs``), from the layer's stores: the
    sharing heads' queries over ``near`` (proximal keys, values, additive mask) with their own logits and over the
    block start's keys under ``distant`` (one call per run; ``split``: ``GroupedBiases``), merged by Eq. 4; the
    block-start KV heads over their full keys under ``full_mask`` (None: causal, or all for a single query)."""
    batch, _, queries, dim = query.shape
    groups = layout.groups
    o_near, lse_near = attention_part(fold_heads(layer, query, "prox", groups), *near, scale)
    parts = []
    for first, count, head, start, row in layout.runs:
        source, keys = layer.shared_step(start, query)
        source = source.narrow(1, head * groups, count * groups).reshape(batch, count, groups * queries, dim)
        keys, values = keys.narrow(1, row, count), layer.values.narrow(1, head, count)
        mask = distant if distant.shape[1] == 1 else distant.narrow(1, first, count)
        if split is None:
            parts.append(attention_part(source, keys, values, mask, scale))
            continue
        (low, high), block = split, slice(split[1], split[1] + mask.shape[-1])  # an unmasked call and a causal one
        o_all, lse_all = attention_part(source, keys[:, :, low:high], values[:, :, low:high], None, scale)
        o_new, lse_new = attention_part(source, keys[:, :, block], values[:, :, block], mask, scale)
        parts.append((gate_merge(o_all, lse_all, o_new, lse_new, None), torch.logaddexp(lse_all, lse_new)))
    o_far, lse_far = parts[0] if len(parts) == 1 else (torch.cat(p, dim=1) for p in zip(*parts, strict=True))
    mixed = gate_merge(o_near, lse_near, o_far, lse_far, has_distant)  # [B, S, G q, d]
    if not layer.head_lists["full"]:
        return mixed.reshape(batch, -1, queries, dim)
    full_query, full_values = fold_heads(layer, query, "full", groups), layer.heads_of(layer.values, "full")
    if queries == 1 and full_mask is None:
        out, _ = attention_part(full_query, layer.keys, full_values, None, scale)
    else:
        full_query = full_query.reshape(batch, -1, queries, dim)
        positions = layer.forward_positions
        out, _ = layer_attention(
            full_query, layer.keys, full_values, full_mask, scale, NO_STATS, positions, layer.forward_pass
        )
        out = out.reshape(batch, -1, groups * queries, dim)
    if layout.ordered is not None:
        parts = [out, mixed] if layout.ordered == "full-first" else [mixed, out]
        return torch.cat(parts, dim=1).reshape(batch, -1, queries, dim)
    output = query.new_empty(batch, layer.values.shape[1], groups * queries, dim)
    output.index_copy_(1, layer.prox_heads, mixed).index_copy_(1, layer.full_heads, out)
    return output.reshape(batch, -1, queries, dim)
