"""PoD's mixed softmax from fused attention kernels (the output only; ``pod_attention`` dispatches here).

On the CPU without autograd, Eq. 4 literally: two kernel calls returning their log-sum-exp, one over the proximal
keys with the layer's own logits and one over the distant keys with the block start's, merged by the gate
(``two_call_merge``; ``two_call_merge_grouped`` reads the layer's stores without repeating any key per query head).
Elsewhere and under autograd, one masked SDPA over keys laid out twice (``mixed_sdpa``). All equal the explicit
mixed softmax (tests)."""

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
    dist: torch.Tensor  # [B or 1, S or 1, G q, L]: the distant keys; rows without any see every key (dropped)
    has_distant: torch.Tensor  # [B or 1, S or 1, G q]
    # (first, stop): instead, every row sees the distant keys [first, stop) and, from ``stop``, the next q keys
    # causally (query row i the first i + 1 of them; ``dist`` is then that [.., G q, q] block's mask)
    split: tuple[int, int] | None = None


def two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
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
    o_prox, lse_prox = FLASH(
        query[:, share_idx], keys_q[:, share_idx], values, 0.0, False, attn_mask=prox_bias, scale=scale
    )
    dist_mask = distant[:, kv_of]
    has_distant = dist_mask.any(-1)  # [B, S, q]
    dist_bias = torch.zeros(dist_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~dist_mask, -math.inf)
    dist_bias = dist_bias.masked_fill(~has_distant[..., None], 0.0)  # rows without distant tokens: dropped below
    source_query = torch.stack([q for q, _ in sources], dim=1)
    source_keys = torch.stack([k for _, k in sources], dim=1)
    o_dist, lse_dist = FLASH(source_query, source_keys, values, 0.0, False, attn_mask=dist_bias, scale=scale)
    return out.index_copy(1, share_idx, gated(o_prox, lse_prox, o_dist, lse_dist, has_distant))


def gated(o_prox, lse_prox, o_dist, lse_dist, has_distant) -> torch.Tensor:
    """Eq. 4: ``g o_P + (1 - g) o_D`` with ``g = sigmoid(LSE_P - LSE_D)``; rows without distant tokens take
    ``o_P`` (``g = 1``, whatever the distant call returned for them)."""
    lse_dist = lse_dist.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_prox - lse_dist)[..., None].to(o_prox.dtype)
    return gate * o_prox + (1 - gate) * torch.where(has_distant[..., None], o_dist, torch.zeros_like(o_dist))


def whole_groups(sharing: list[int], starts: tuple[int, ...], groups: int) -> bool:
    """Whether every sharing KV head shares with all its query heads, from one block start (the default grouping):
    then the sharing KV heads are those storing proximal keys only, and their query heads fold into rows."""
    kv_heads = {h // groups for h in sharing}
    if len(kv_heads) * groups != len(sharing):
        return False
    return all(len({starts[g * groups + k] for k in range(groups)}) == 1 for g in kv_heads)


def grouped_biases(layer, proximal, distant, groups: int, dtype: torch.dtype) -> GroupedBiases:
    """The sharing heads' biases from the layer's ``[B, H_kv or 1, q, L]`` proximal and distant masks."""
    batch, shared = layer.prox_slot.shape[:2]
    queries = proximal.shape[2]

    def by_row(allowed: torch.Tensor) -> torch.Tensor:  # [B, S, q, n] -> [B, S, G q, n]
        rows = allowed[:, :, None].expand(-1, -1, groups, -1, -1)
        return rows.reshape(batch, shared, groups * queries, allowed.shape[-1])

    slot = layer.prox_slot  # [B, S, P]: each stored proximal key's slot, -1 for none
    safe = slot.clamp(min=0)
    prox_seen = (
        layer.heads_of(proximal, "prox").gather(3, safe[:, :, None].expand(-1, -1, queries, -1))
        & (slot >= 0)[:, :, None]
    )
    dist_mask = by_row(layer.heads_of(distant, "prox"))
    has_distant = dist_mask.any(-1)  # [B, S, G q]
    return GroupedBiases(
        additive(by_row(prox_seen), dtype), additive(dist_mask | ~has_distant[..., None], dtype), has_distant
    )


def distant_attention(query, keys, values, biases: GroupedBiases, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp of the rows ``query`` over their distant ``keys``: one masked call, or with
    ``biases.split`` an unmasked call over the keys every row sees and a call over the causal block, merged."""
    if biases.split is None:
        return FLASH(query, keys, values, 0.0, False, attn_mask=biases.dist, scale=scale)
    first, stop = biases.split
    block = slice(stop, stop + biases.dist.shape[-1])
    o_all, lse_all = FLASH(query, keys[:, :, first:stop], values[:, :, first:stop], 0.0, False, scale=scale)
    o_new, lse_new = FLASH(
        query, keys[:, :, block], values[:, :, block], 0.0, False, attn_mask=biases.dist, scale=scale
    )
    lse = torch.logaddexp(lse_all, lse_new)
    output = o_all * (lse_all - lse).exp()[..., None] + o_new * (lse_new - lse).exp()[..., None]
    return output.to(o_all.dtype), lse


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``."""
    return torch.full(allowed.shape, -math.inf, dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


def two_call_merge_grouped(layer, query, biases: GroupedBiases, full_visible, sources, scale) -> torch.Tensor:
    """``two_call_merge`` when ``whole_groups`` holds, reading the layer's stores as they are: the heads that
    start a block attend over their full keys (one SDPA, grouped-query; ``full_visible`` None: plain causal), the
    sharing ones over their stored proximal keys only (``prox_keys``, with the values of those slots) and over the
    block start's keys for the distant part, each KV head's query heads folded into query rows (``biases``). No key
    or value is repeated per query head."""
    batch, q_heads, queries, dim = query.shape
    groups = q_heads // layer.values.shape[1]
    share_q, full_q = (layer.head_index(_query_heads(layer, kind, groups)) for kind in ("prox", "full"))
    shared, full = len(layer.prox_heads), len(layer.full_heads)

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [B, S, G, q, x] -> [B, S, G * q, x]
        return tensor.reshape(batch, shared, groups * queries, tensor.shape[-1])

    safe = layer.prox_slot.clamp(min=0)
    prox_values = layer.heads_of(layer.values, "prox").gather(2, safe[..., None].expand(*safe.shape, dim))
    o_prox, lse_prox = FLASH(
        rows(query[:, share_q]), layer.prox_keys, prox_values, 0.0, False, attn_mask=biases.prox, scale=scale
    )
    source_query = rows(torch.stack([q for q, _ in sources], dim=1))
    source_keys = torch.stack([sources[i * groups][1] for i in range(shared)], dim=1)
    values = layer.heads_of(layer.values, "prox")
    o_dist, lse_dist = distant_attention(source_query, source_keys, values, biases, scale)
    mixed = gated(o_prox, lse_prox, o_dist, lse_dist, biases.has_distant)
    mixed = mixed.reshape(batch, len(share_q), queries, dim)
    if not full:
        return mixed
    full_values = layer.heads_of(layer.values, "full")
    positions = layer.forward_positions
    out, _ = layer_attention(
        query[:, full_q], layer.keys, full_values, full_visible, scale, NO_STATS, positions, layer.forward_pass
    )
    return torch.empty_like(query).index_copy_(1, share_q, mixed).index_copy_(1, full_q, out)


def _query_heads(layer, kind: str, groups: int) -> list[int]:
    """The query heads of the layer's KV heads of ``kind`` (``"prox"`` or ``"full"``), in ``repeat_kv`` order: KV
    head ``g`` serves ``g·G … g·G + G − 1``."""
    heads = [g for g, row in enumerate(layer.full_pos) if (row < 0) == (kind == "prox")]
    return [g * groups + k for g in heads for k in range(groups)]


def mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, share_idx, sources, scale) -> torch.Tensor:
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
