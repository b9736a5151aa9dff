"""PoD attention: this layer's logits on proximal tokens mixed with the block-start layer's logits on distant
tokens (both exact: one softmax, or the Eq. 4 gate), reading the block start's query and keys exposed earlier in
the same forward (``PoDLayer.step``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvcompress.core.attention import attention_with_stats, sdpa
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.softmax import row_chunks
from kvcompress.methods.pod.layer import PoDLayer, PoDStep

if TYPE_CHECKING:  # annotations only: the config module imports the policy, which imports this module
    from kvcompress.methods.pod.config import PoDConfig


def _visible(layer: PoDLayer, queries: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``[B, H_kv or 1, q, L]`` visibility (the core's mask, or causal when it passed ``None``)."""
    if mask is not None:
        return mask
    query_idx = torch.arange(layer.seen - queries, layer.seen, device=layer.device)
    return layer.token_idx[:, :, None, :] <= query_idx[None, None, :, None]


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
    starts = layer.head_starts
    if len(starts) == kv_heads:
        starts = tuple(s for s in starts for _ in range(groups))
    elif len(starts) != q_heads:
        raise ValueError(f"pod starts have {len(starts)} heads per layer; the model has {q_heads} query heads")
    layer.step = PoDStep(query=query, keys=layer.keys, full_pos=layer.full_pos)
    value = layer.values
    visible = _visible(layer, queries, mask)
    sharing = [h for h in range(q_heads) if starts[h] != layer.index]
    pos_k = layer.rope_pos[:, :, None, :]
    pos_q = layer.rope_pos[:, :, -queries:, None]
    proximal = ((pos_k < config.n_sink) | (pos_q - pos_k < config.n_recent)) & visible
    distant = visible & ~proximal
    # a distant token needs a query at RoPE position n_sink + n_recent or beyond: decided on the host (the merges
    # below also handle rows that have none)
    if not sharing or layer.max_position < config.n_sink + config.n_recent:
        keys = layer.own_keys()
        if request.any:
            return attention_with_stats(query, keys, value, visible, scaling, request)
        return sdpa(query, keys, value, mask, scaling), None

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
        fused_output = _fused(layer, query, visible, proximal, distant, (sharing, starts, share_idx), sources, scale)
        if not request.any:
            return fused_output, None
    keys_q, value_q, visible_q = _repeated(layer, visible, q_heads)
    prox_s = _grouped(proximal, q_heads)[:, share_idx]
    dist_s = _grouped(distant, q_heads)[:, share_idx]
    outputs, last_rows, received = [], [], None
    last_n = min(request.last_queries, queries)
    skipped = eligible = 0
    first = queries - last_n if fused else 0  # rows whose softmax is written out
    for r0, r1 in ((first + a, first + b) for a, b in row_chunks(queries - first, batch * q_heads * length)):
        own = (query[:, :, r0:r1] @ keys_q.transpose(-1, -2)).float() * scale  # [B, H_q, R, L]
        dist = torch.stack([(q[:, r0:r1] @ k.transpose(-1, -2)).float() * scale for q, k in sources], dim=1)
        prox_r, dist_r = prox_s[:, :, r0:r1], dist_s[:, :, r0:r1]
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
        logits = own.masked_fill(~visible_q[:, :, r0:r1], -math.inf).index_copy(1, share_idx, mixed_s)
        probs = logits.softmax(dim=-1)
        out = probs.to(value.dtype) @ value_q
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
            stats.last_visible = visible[:, :, queries - last_n :]
    return output, stats


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fuses(config: PoDConfig, request: StatsRequest) -> bool:
    """Whether the output comes from fused kernels: the plain mixed softmax, asked at most for the last rows."""
    return config.tau is None and config.combine == "softmax" and not request.received and not request.lse


def _fused(layer, query, visible, proximal, distant, heads, sources, scale) -> torch.Tensor:
    """The mixed softmax's output (no statistics) from fused attention kernels: two calls returning their
    log-sum-exp on the CPU (``_two_call_merge``, grouped where ``_whole_groups`` holds), one masked SDPA
    elsewhere and under autograd (``_mixed_sdpa``). ``heads``: the sharing query heads, every query head's block
    start and the sharing heads as a device tensor."""
    sharing, starts, share_idx = heads
    q_heads = query.shape[1]
    groups = q_heads // layer.values.shape[1]
    training = torch.is_grad_enabled() and query.requires_grad
    if _FLASH is not None and query.device.type == "cpu" and not training:  # CPU-only kernel returning the LSE
        if _whole_groups(sharing, starts, groups):
            return _two_call_merge_grouped(layer, query, visible, proximal, distant, sources, scale)
        keys_q, value_q, visible_q = _repeated(layer, visible, q_heads)
        return _two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale)
    keys_q, value_q, visible_q = _repeated(layer, visible, q_heads)
    return _mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale)


def _two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
    """Inference path (no autograd): Eq. 4 literally, with two fused attention calls that return their
    log-sum-exp: ``o_P, LSE_P`` over proximal tokens with own logits, ``o_D, LSE_D`` over distant tokens with the
    block start's logits, ``o = g o_P + (1 - g) o_D``, ``g = sigmoid(LSE_P - LSE_D)`` (``g = 1`` without distant
    tokens). Block-start heads run plain SDPA. Equal to the mixed softmax (tests)."""
    batch, q_heads, queries, dim = query.shape
    length = keys_q.shape[2]
    groups = q_heads // proximal.shape[1]
    kv_of = share_idx // groups
    out = scaled_dot_product_attention(
        query, keys_q, value_q, attn_mask=visible_q.expand(batch, q_heads, queries, length), scale=scale
    )
    values = value_q[:, share_idx]
    prox_bias = torch.zeros(proximal[:, kv_of].shape, dtype=query.dtype, device=query.device)
    prox_bias = prox_bias.masked_fill(~proximal[:, kv_of], -math.inf)
    o_prox, lse_prox = _FLASH(
        query[:, share_idx], keys_q[:, share_idx], values, 0.0, False, attn_mask=prox_bias, scale=scale
    )
    dist_mask = distant[:, kv_of]
    has_distant = dist_mask.any(-1)  # [B, S, q]
    dist_bias = torch.zeros(dist_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~dist_mask, -math.inf)
    dist_bias = dist_bias.masked_fill(~has_distant[..., None], 0.0)  # rows without distant tokens: dropped below
    source_query = torch.stack([q for q, _ in sources], dim=1)
    source_keys = torch.stack([k for _, k in sources], dim=1)
    o_dist, lse_dist = _FLASH(source_query, source_keys, values, 0.0, False, attn_mask=dist_bias, scale=scale)
    return out.index_copy(1, share_idx, _gated(o_prox, lse_prox, o_dist, lse_dist, has_distant))


def _gated(o_prox, lse_prox, o_dist, lse_dist, has_distant) -> torch.Tensor:
    """Eq. 4: ``g o_P + (1 - g) o_D`` with ``g = sigmoid(LSE_P - LSE_D)``; rows without distant tokens take
    ``o_P`` (``g = 1``, whatever the distant call returned for them)."""
    lse_dist = lse_dist.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_prox - lse_dist)[..., None].to(o_prox.dtype)
    return gate * o_prox + (1 - gate) * torch.where(has_distant[..., None], o_dist, torch.zeros_like(o_dist))


def _repeated(layer: PoDLayer, visible: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """The layer's own keys, its values and ``visible``, each KV head repeated for its query heads."""
    return _grouped(layer.own_keys(), heads), _grouped(layer.values, heads), _grouped(visible, heads)


def _whole_groups(sharing: list[int], starts: tuple[int, ...], groups: int) -> bool:
    """Whether every sharing KV head shares with all its query heads, from one block start (the default grouping):
    then the sharing KV heads are those storing proximal keys only, and their query heads fold into rows."""
    kv_heads = {h // groups for h in sharing}
    if len(kv_heads) * groups != len(sharing):
        return False
    return all(len({starts[g * groups + k] for k in range(groups)}) == 1 for g in kv_heads)


def _two_call_merge_grouped(layer, query, visible, proximal, distant, sources, scale) -> torch.Tensor:
    """``_two_call_merge`` when ``_whole_groups`` holds, reading the layer's stores as they are: the heads that
    start a block attend over their full keys (one SDPA, grouped-query), the sharing ones over their stored
    proximal keys only (``prox_keys``, with the values of those slots) and over the block start's keys for the
    distant part, each KV head's query heads folded into query rows. No key or value is repeated per query head."""
    batch, q_heads, queries, dim = query.shape
    groups = q_heads // layer.values.shape[1]
    share, full = layer.prox_heads, layer.full_heads
    share_q, full_q = _query_heads(share, groups), _query_heads(full, groups)
    shared = len(share)

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [B, S, G, q, x] -> [B, S, G * q, x]
        return tensor.reshape(batch, shared, groups * queries, tensor.shape[-1])

    def by_row(allowed: torch.Tensor) -> torch.Tensor:  # [B, S, q, n] -> [B, S, G * q, n]
        return rows(allowed[:, :, None].expand(-1, -1, groups, -1, -1))

    def bias(allowed: torch.Tensor) -> torch.Tensor:  # float, -inf where hidden
        return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, -math.inf)

    slot = layer.prox_slot  # [B, S, P]: each stored proximal key's slot, -1 for none
    safe = slot.clamp(min=0)
    prox_values = layer.heads_of(layer.values, "prox").gather(2, safe[..., None].expand(*safe.shape, dim))
    prox_seen = (
        layer.heads_of(proximal, "prox").gather(3, safe[:, :, None].expand(-1, -1, queries, -1))
        & (slot >= 0)[:, :, None]
    )
    o_prox, lse_prox = _FLASH(
        rows(query[:, share_q]),
        layer.prox_keys,
        prox_values,
        0.0,
        False,
        attn_mask=bias(by_row(prox_seen)),
        scale=scale,
    )
    dist_mask = by_row(layer.heads_of(distant, "prox"))
    has_distant = dist_mask.any(-1)  # [B, S, G * q]
    dist_bias = bias(dist_mask).masked_fill_(~has_distant[..., None], 0.0)  # rows without distant: dropped below
    source_query = rows(torch.stack([q for q, _ in sources], dim=1))
    source_keys = torch.stack([sources[i * groups][1] for i in range(shared)], dim=1)
    values = layer.heads_of(layer.values, "prox")
    o_dist, lse_dist = _FLASH(source_query, source_keys, values, 0.0, False, attn_mask=dist_bias, scale=scale)
    mixed = _gated(o_prox, lse_prox, o_dist, lse_dist, has_distant).reshape(batch, len(share_q), queries, dim)
    if not len(full):
        return mixed
    full_visible = visible if visible.shape[1] == 1 else layer.heads_of(visible, "full")
    out = sdpa(query[:, full_q], layer.keys, layer.heads_of(layer.values, "full"), full_visible, scale)
    return torch.empty_like(query).index_copy_(1, share_q, mixed).index_copy_(1, full_q, out)


def _query_heads(kv_heads: torch.Tensor, groups: int) -> torch.Tensor:
    """The query heads of ``kv_heads`` (``repeat_kv`` order: KV head ``g`` serves ``g·G … g·G + G − 1``)."""
    return (kv_heads[:, None] * groups + torch.arange(groups, device=kv_heads.device)).flatten()


def _mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
    """The mixed softmax as one fused SDPA call: every key appears twice, once as ``[k_own, 0]`` and once as
    ``[0, k_start]``, against the query ``[q_own, q_start]``; the mask picks, per (query, key), the own copy for
    proximal tokens (all visible tokens at block-start heads) and the block-start copy for distant tokens. Values
    are the layer's own for both copies. Exactly the single softmax over mixed logits, with no ``L x L`` tensor
    of floats (autograd included)."""
    batch, q_heads, queries, dim = query.shape
    length = keys_q.shape[2]
    heads = share_idx.shape[0]
    groups = q_heads // proximal.shape[1]
    kv_of = share_idx // groups
    source_query = query.new_zeros(batch, q_heads, queries, dim)
    source_keys = keys_q.new_zeros(batch, q_heads, length, dim)
    source_query = source_query.index_copy(1, share_idx, torch.stack([q for q, _ in sources], dim=1))
    source_keys = source_keys.index_copy(1, share_idx, torch.stack([k for _, k in sources], dim=1))
    zeros = keys_q.new_zeros(batch, q_heads, length, dim)
    keys = torch.cat([torch.cat([keys_q, zeros], dim=-1), torch.cat([zeros, source_keys], dim=-1)], dim=2)
    own_allowed = visible_q.expand(batch, q_heads, queries, length)
    own_allowed = own_allowed.index_copy(1, share_idx, proximal[:, kv_of].expand(batch, heads, queries, length))
    dist_allowed = torch.zeros_like(own_allowed)
    dist_allowed = dist_allowed.index_copy(1, share_idx, distant[:, kv_of].expand(batch, heads, queries, length))
    return scaled_dot_product_attention(
        torch.cat([query, source_query], dim=-1),
        keys,
        torch.cat([value_q, value_q], dim=2),
        attn_mask=torch.cat([own_allowed, dist_allowed], dim=-1),
        scale=scale,
    )
