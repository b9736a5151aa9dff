"""PoD's mixed softmax from fused attention kernels (the output only; ``pod_attention`` dispatches here).

Eq. 4 literally: one attention call over the proximal keys with the layer's own logits and one over the distant
keys with the block start's, each returning its log-sum-exp, merged by the gate ``g = sigmoid(LSE_P - LSE_D)``. On
the CPU the calls are its fused kernel (``FLASH``); a decoding step on its ring elsewhere takes the logits, their
log-sum-exp and one matmul in float32 (``attention_part``). ``grouped_attention`` reads the layer's stores without
repeating any key per query head (the ring's step, and CPU forwards when the sharing heads are whole groups);
``two_call_merge`` repeats keys per query head (CPU, other layouts); ``mixed_sdpa`` is one masked SDPA over keys
laid out twice (elsewhere and under autograd). All equal the explicit mixed softmax (tests).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvcompress.core.attention import layer_attention
from kvcompress.core.contract import StatsRequest
from kvcompress.core.sdpa import scaled_dot_product_attention

NO_STATS = StatsRequest()
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # CPU only; returns the LSE


class GroupedBiases(NamedTuple):
    """Additive masks (0 or -inf) of the sharing KV heads, their query heads folded into rows (``G q`` rows, query
    head ``g`` of a group in rows ``g q .. (g + 1) q - 1``); a leading dimension of 1 is shared."""

    prox: torch.Tensor  # [B or 1, S or 1, G q, P]: the stored proximal keys (``prox_slot`` order) each row sees
    dist: torch.Tensor  # [B or 1, S or 1, G q, L]: the distant keys each row sees
    has_distant: torch.Tensor | None  # [B or 1, S or 1, G q] (None: every row has some)
    # (first, stop): instead, every row sees the distant keys [first, stop) and, from ``stop``, the next q keys
    # causally (query row i the first i + 1 of them; ``dist`` is then that [.., G q, q] block's mask)
    split: tuple[int, int] | None = None


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``."""
    return torch.full(allowed.shape, -math.inf, dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def grouped_biases(layer, proximal, distant, groups: int, dtype: torch.dtype) -> GroupedBiases:
    """The sharing heads' biases from the layer's ``[B, H_kv or 1, q, L]`` proximal and distant masks."""
    batch, shared = layer.prox_slot.shape[:2]
    queries = proximal.shape[2]

    def by_row(allowed: torch.Tensor) -> torch.Tensor:  # [B, S, q, n] -> [B, S, G q, n]
        rows = allowed[:, :, None].expand(-1, -1, groups, -1, -1)
        return rows.reshape(batch, shared, groups * queries, allowed.shape[-1])

    slot = layer.prox_slot  # [B, S, P]: each stored proximal key's slot, -1 for none
    gathered = layer.heads_of(proximal, "prox").gather(3, slot.clamp(min=0)[:, :, None].expand(-1, -1, queries, -1))
    dist_mask = by_row(layer.heads_of(distant, "prox"))
    prox_seen = by_row(gathered & (slot >= 0)[:, :, None])
    return GroupedBiases(additive(prox_seen, dtype), additive(dist_mask, dtype), dist_mask.any(-1))


def stream_biases(layer, queries: int, groups: int, dtype: torch.dtype) -> GroupedBiases | None:
    """The biases of this forward's ``queries`` rows (``[1, 1, G q, ...]``) while ``layer`` holds the stream as it
    came (``PoDLayer.on_stream``: no token evicted, no padding, positions = stream indices), else None.

    Then every layer and KV head stores token ``i`` at slot ``i`` with position ``i`` and the masks depend on the
    positions alone: the forward's first sharing layer builds them, the others reuse them (``ForwardPass.cached``),
    sparing each layer its ``[B, H_kv, q, L]`` masks and float biases."""
    if not layer.on_stream or layer.forward_positions is None:
        return None
    config = layer.policy.config
    stored = layer.prox_slot.shape[-1]
    key = ("pod-stream-biases", layer.seen, queries, stored, groups, dtype, config.n_sink, config.n_recent)
    return layer.forward_pass.cached(key, lambda: _stream(layer, queries, groups, dtype))


def _stream(layer, queries: int, groups: int, dtype: torch.dtype) -> GroupedBiases:
    config = layer.policy.config
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
    None): the output and the log-sum-exp ``[B, n, R]`` (a zero output for a row that sees nothing)."""
    if FLASH is not None and query.device.type == "cpu":
        return FLASH(query, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    logits = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        logits.add_(mask)
    lse = logits.logsumexp(-1)
    weights = (logits - lse.clamp(min=torch.finfo(logits.dtype).min)[..., None]).exp_()
    return torch.matmul(weights.to(values.dtype), values), lse


def gate_merge(o_near, lse_near, o_far, lse_far, has_distant: torch.Tensor | None) -> torch.Tensor:
    """Eq. 4: ``g o_P + (1 - g) o_D`` with ``g = sigmoid(LSE_P - LSE_D)``; rows without a distant token (False in
    ``has_distant``; None: there are none) take ``o_P`` (``g = 1``: their distant call saw no key)."""
    if has_distant is not None:
        lse_far = lse_far.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_near - lse_far)[..., None].to(o_near.dtype)
    return torch.lerp(o_far, o_near, gate)


def fold_heads(layer, query: torch.Tensor, kind: str, groups: int) -> torch.Tensor:
    """The query heads of the layer's KV heads of ``kind``, each KV head's ``G`` folded into rows: ``[B, n, G q, d]``
    (KV head ``g`` serves query heads ``g G .. g G + G - 1``, as ``repeat_kv`` lays them)."""
    batch, _, queries, dim = query.shape
    run = layer.head_runs[kind]
    if run is not None:
        heads = query.narrow(1, run[0] * groups, run[1] * groups)
    else:
        index = [h * groups + k for h in layer.head_lists[kind] for k in range(groups)]
        heads = query.index_select(1, layer.head_index(index))
    return heads.reshape(batch, -1, groups * queries, dim)


def grouped_attention(layer, layout, query, near, distant, has_distant, scale, full_mask=None, split=None):
    """The mixed softmax when the sharing heads are whole groups (``layout.runs``), reading the layer's stores as
    they are: the sharing KV heads' query heads, folded into rows, over ``near`` (their proximal keys, values and
    additive mask) with their own logits and over the block start's keys under ``distant`` (one call per run of KV
    heads the block start holds side by side; ``split``: see ``GroupedBiases``), merged by Eq. 4; the block-start
    KV heads over their full keys under ``full_mask`` (None: causal, or every key for a single query)."""
    batch, _, queries, dim = query.shape
    groups = layout.groups
    o_near, lse_near = attention_part(fold_heads(layer, query, "prox", groups), *near, scale)
    parts = []
    for first, count, head, start, row in layout.runs:
        step = layer.shared_step(start)
        source = step.query if layer.policy.config.query_source == "block_start" else query
        source = source.narrow(1, head * groups, count * groups).reshape(batch, count, groups * queries, dim)
        keys, values = step.keys.narrow(1, row, count), layer.values.narrow(1, head, count)
        mask = distant if distant.shape[1] == 1 else distant.narrow(1, first, count)
        parts.append(_distant_part(source, keys, values, mask, scale, split))
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


def _distant_part(query, keys, values, mask, scale: float, split) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_part`` over the distant keys; with ``split`` an unmasked call over the keys every row sees and a
    call over the causal block, merged."""
    if split is None:
        return attention_part(query, keys, values, mask, scale)
    first, stop = split
    block = slice(stop, stop + mask.shape[-1])
    o_all, lse_all = attention_part(query, keys[:, :, first:stop], values[:, :, first:stop], None, scale)
    o_new, lse_new = attention_part(query, keys[:, :, block], values[:, :, block], mask, scale)
    lse = torch.logaddexp(lse_all, lse_new)
    output = o_all * (lse_all - lse).exp()[..., None] + o_new * (lse_new - lse).exp()[..., None]
    return output.to(o_all.dtype), lse


def two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
    """Eq. 4 with keys repeated per query head (``[B, H_q, L, d]``): the block-start heads by plain SDPA, the
    sharing ones by ``attention_part`` over their proximal and distant keys."""
    batch, q_heads, queries, _ = query.shape
    kv_of = share_idx // (q_heads // proximal.shape[1])
    out = scaled_dot_product_attention(
        query, keys_q, value_q, attn_mask=visible_q.expand(batch, q_heads, queries, keys_q.shape[2]), scale=scale
    )
    values = value_q[:, share_idx]
    prox_bias = additive(proximal[:, kv_of], query.dtype)
    o_prox, lse_prox = attention_part(query[:, share_idx], keys_q[:, share_idx], values, prox_bias, scale)
    dist_mask = distant[:, kv_of]
    source_query, source_keys = (torch.stack(part, dim=1) for part in zip(*sources, strict=True))
    o_dist, lse_dist = attention_part(source_query, source_keys, values, additive(dist_mask, query.dtype), scale)
    return out.index_copy(1, share_idx, gate_merge(o_prox, lse_prox, o_dist, lse_dist, dist_mask.any(-1)))


def mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
    """The mixed softmax as one fused SDPA call: every key appears twice, once as ``[k_own, 0]`` and once as
    ``[0, k_start]``, against the query ``[q_own, q_start]``; the mask picks, per (query, key), the own copy for
    proximal tokens (all visible tokens at block-start heads) and the block-start copy for distant tokens. Values
    are the layer's own for both copies. Exactly the single softmax over mixed logits, with no ``L x L`` tensor
    of floats (autograd included)."""
    batch, q_heads, queries, dim = query.shape
    length = keys_q.shape[2]
    heads = share_idx.shape[0]
    kv_of = share_idx // (q_heads // proximal.shape[1])
    source_query, source_keys = (torch.stack(part, dim=1) for part in zip(*sources, strict=True))
    source_query = query.new_zeros(batch, q_heads, queries, dim).index_copy(1, share_idx, source_query)
    source_keys = keys_q.new_zeros(batch, q_heads, length, dim).index_copy(1, share_idx, source_keys)
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
