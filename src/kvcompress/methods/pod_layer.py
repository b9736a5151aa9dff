"""PoD's cache layer and attention (see ``kvcompress.methods.pod`` for the method, its spec and choices).

``PoDLayer`` stores values of every token in every layer, keys of every token only for the KV heads that start a
block at this layer, and keys of proximal tokens (sinks + recent window) for the other KV heads. ``pod_attention``
mixes this layer's logits on proximal tokens with the block-start layer's logits on distant tokens (both exact:
one softmax, or the Eq. 4 gate), reading the block start's query and keys that it exposed earlier in the same
forward (``PoDLayer.step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.attention import CHUNK_ELEMENTS, attention_with_stats, sdpa
from kvcompress.cache import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.methods.base import AttentionStats, Policy, Selection, StatsRequest
from kvcompress.methods.pod import PoDConfig


@dataclass
class PoDStep:
    """What a layer exposes to the later layers of its blocks during one forward: its (positioned) query and the
    keys of its full-key KV heads (``full_pos[g]``: row of KV head ``g`` in ``keys``, -1 if it keeps proximal keys
    only)."""

    query: torch.Tensor  # [B, H_q, q, d]
    keys: torch.Tensor  # [B, S, L, d]
    full_pos: list[int]


class PoDLayer(CompressedLayer):
    """A cache layer with PoD's storage: values of every token; for KV heads that start a block here the keys of
    every token (``keys``, ``[B, S, L, d]``); for the other KV heads the keys of proximal tokens only
    (``prox_keys``, ``[B, H - S, P, d]``, ``prox_slot`` = their slot in ``values``, -1 for padding entries)."""

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        self.index = policy.layer_idx
        self.peers: list[CompressedLayer] = []
        self.head_starts: tuple[int, ...] = ()
        self.step: PoDStep | None = None
        self.last_selection: Selection | None = None
        self.gate_counts = [0, 0]  # rows whose distant part the tau gate skipped, rows where it could

    def connect_block(self, peers: list[CompressedLayer], index: int, head_starts: tuple[int, ...]) -> None:
        self.peers, self.index, self.head_starts = peers, index, tuple(head_starts)

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        kv_heads = key_states.shape[1]
        if len(self.head_starts) == 1:  # one partition for every head (block_size)
            self.head_starts = self.head_starts * kv_heads
        row = self.head_starts
        if len(row) % kv_heads:
            raise ValueError(f"pod starts have {len(row)} heads per layer; the model has {kv_heads} KV heads")
        groups = len(row) // kv_heads
        full = [g for g in range(kv_heads) if any(row[g * groups + k] == self.index for k in range(groups))]
        prox = [g for g in range(kv_heads) if g not in full]
        self.full_heads = torch.tensor(full, dtype=torch.long, device=self.device)
        self.prox_heads = torch.tensor(prox, dtype=torch.long, device=self.device)
        self.full_pos = [full.index(g) if g in full else -1 for g in range(kv_heads)]
        self.keys = key_states[:, self.full_heads, :0]
        self.prox_keys = key_states[:, self.prox_heads, :0]
        self.prox_slot = torch.zeros(key_states.shape[0], len(prox), 0, dtype=torch.long, device=self.device)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store values of the new tokens, their keys where this layer keeps them; return this step's keys (tagged
        with the layer) and all values. PoD's attention (``pod_attention``) reads the layer's stores directly."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, count, _ = key_states.shape
        old = self.values.shape[2]
        new_idx = torch.arange(self.seen, self.seen + count, device=self.device).expand(batch, heads, count)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.token_idx = torch.cat([self.token_idx, new_idx], dim=-1)
        self.rope_pos = torch.cat([self.rope_pos, new_idx], dim=-1)
        self.valid = torch.cat([self.valid, torch.ones_like(new_idx, dtype=torch.bool)], dim=-1)
        for name, value in self.policy.init_state(self, key_states).items():
            previous = self.state.get(name)
            self.state[name] = value if previous is None else torch.cat([previous, value], dim=2)
        self.keys = torch.cat([self.keys, key_states[:, self.full_heads]], dim=-2)
        self.prox_keys = torch.cat([self.prox_keys, key_states[:, self.prox_heads]], dim=-2)
        slots = torch.arange(old, old + count, device=self.device).expand(batch, len(self.prox_heads), count)
        self.prox_slot = torch.cat([self.prox_slot, slots], dim=-1)
        self.seen += count
        self.new_tokens = count
        self.step = None
        setattr(key_states, LAYER_ATTRIBUTE, self)
        return key_states, self.values

    def own_keys(self) -> torch.Tensor:
        """A transient ``[B, H_kv, L, d]`` key tensor: full keys where stored, proximal keys at their slots, zeros
        elsewhere (those slots are distant, never read with this layer's logits at this head)."""
        batch, heads, length, dim = self.values.shape
        out = self.keys.new_zeros(batch, heads, length, dim)
        if len(self.full_heads):
            out = out.index_copy(1, self.full_heads, self.keys)
        if len(self.prox_heads):
            slot = torch.where(self.prox_slot >= 0, self.prox_slot, length)
            scattered = self.keys.new_zeros(batch, len(self.prox_heads), length + 1, dim)
            scattered = scattered.scatter(2, slot[..., None].expand(*slot.shape, dim), self.prox_keys)
            out = out.index_copy(1, self.prox_heads, scattered[:, :, :length])
        return out

    def _pack_proximal(self, keep: torch.Tensor, slot: torch.Tensor) -> None:
        """Keep the proximal entries marked in ``keep`` ``[B, H - S, P]`` (stream order), re-packed to the max count."""
        count = int(keep.sum(-1).max()) if keep.numel() else 0
        if keep.numel() and count == keep.shape[-1] and bool(keep.all()):
            self.prox_slot = slot
            return
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :count]
        kept = keep.gather(-1, order)
        self.prox_slot = torch.where(kept, slot.gather(-1, order), -1)
        keys = self.prox_keys.gather(2, order[..., None].expand(*order.shape, self.prox_keys.shape[-1]))
        self.prox_keys = keys * kept[..., None].to(keys.dtype)

    def trim_proximal(self) -> None:
        """Drop the keys of tokens that left every future query's proximal window (non-start KV heads only)."""
        if not len(self.prox_heads) or not self.prox_slot.shape[-1]:
            return
        config = self.policy.config
        heads = self.prox_heads
        slot = self.prox_slot
        safe = slot.clamp(min=0)
        pos = self.rope_pos[:, heads].gather(-1, safe)
        real = (slot >= 0) & self.valid[:, heads].gather(-1, safe)
        newest = self.rope_pos[:, heads, -1:]
        keep = real & ((pos < config.n_sink) | (newest - pos < config.n_recent))
        self._pack_proximal(keep, slot)

    def after_attention(self, stats: AttentionStats | None) -> None:
        super().after_attention(stats)
        self.trim_proximal()

    def apply(self, selection: Selection) -> None:
        index = selection.indices
        length = self.values.shape[2]

        def take(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            shaped = rows.reshape(*rows.shape, *([1] * (tensor.dim() - 3)))
            return tensor.gather(2, shaped.expand(*rows.shape, *tensor.shape[3:]))

        prox_index = index[:, self.prox_heads]
        self.values = take(self.values, index)
        self.token_idx, self.rope_pos, self.valid = (
            take(self.token_idx, index),
            take(self.rope_pos, index),
            take(self.valid, index),
        )
        if selection.valid is not None:
            self.valid = self.valid & selection.valid
        self.state = {name: take(value, index) for name, value in self.state.items()}
        self.keys = take(self.keys, index[:, self.full_heads])
        if len(self.prox_heads):
            inverse = torch.full((*prox_index.shape[:2], length + 1), -1, dtype=torch.long, device=self.device)
            positions = torch.arange(prox_index.shape[-1], device=self.device).expand_as(prox_index)
            inverse = inverse.scatter(2, prox_index, positions)
            old = torch.where(self.prox_slot >= 0, self.prox_slot, length)
            new_slot = inverse.gather(2, old)
            self._pack_proximal(new_slot >= 0, new_slot)

    def block_selection(self, base: Policy) -> Selection | None:
        """The base method's selection, per KV head taken from the head's block-start layer (computed there in this
        same step, earlier in the forward), so a block keeps one token set per KV head."""
        kv_heads = self.values.shape[1]
        groups = len(self.head_starts) // kv_heads
        starts = [self.head_starts[g * groups] for g in range(kv_heads)]
        own = base.select(self) if self.index in starts else None
        rows = [own if start == self.index else self.peers[start].last_selection for start in starts]
        if all(r is None for r in rows):
            self.last_selection = None
            return None
        if any(r is None for r in rows) or len({r.indices.shape[-1] for r in rows}) != 1:
            raise RuntimeError("pod: the base method selected different token counts along a block")
        indices = torch.stack([r.indices[:, g] for g, r in enumerate(rows)], dim=1)
        valids = [
            r.valid[:, g] if r.valid is not None else torch.ones_like(indices[:, g], dtype=torch.bool)
            for g, r in enumerate(rows)
        ]
        self.last_selection = Selection(indices=indices, valid=torch.stack(valids, dim=1))
        return self.last_selection

    # --- transformers' layer API and accounting ------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.prox_keys = self.prox_slot = None
        self.step = self.last_selection = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.is_initialized:
            indices = indices.to(self.device)
            self.prox_keys = self.prox_keys.index_select(0, indices)
            self.prox_slot = self.prox_slot.index_select(0, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.is_initialized:
            self.prox_keys = self.prox_keys.repeat_interleave(repeats, dim=0)
            self.prox_slot = self.prox_slot.repeat_interleave(repeats, dim=0)

    def kv_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.prox_keys))

    def metadata_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return super().metadata_nbytes() + self.prox_slot.numel() * self.prox_slot.element_size()


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
    keys = layer.own_keys()
    value = layer.values
    visible = _visible(layer, queries, mask)
    sharing = [h for h in range(q_heads) if starts[h] != layer.index]
    pos_k = layer.rope_pos[:, :, None, :]
    pos_q = layer.rope_pos[:, :, -queries:, None]
    proximal = ((pos_k < config.n_sink) | (pos_q - pos_k < config.n_recent)) & visible
    distant = visible & ~proximal
    if not sharing or not bool(distant[:, [h // groups for h in sharing]].any()):
        if request.any:
            return attention_with_stats(query, keys, value, visible, scaling, request)
        return sdpa(query, keys, value, mask, scaling), None

    scale = dim**-0.5 if scaling is None else scaling
    share_idx = torch.tensor(sharing, device=query.device)
    keys_q, value_q = _grouped(keys, q_heads), _grouped(value, q_heads)
    visible_q = _grouped(visible, q_heads)
    prox_s = _grouped(proximal, q_heads)[:, share_idx]
    dist_s = _grouped(distant, q_heads)[:, share_idx]
    sources = []  # per sharing head: (distant query [B, q, d], distant keys [B, L, d])
    for h in sharing:
        step = layer.peers[starts[h]].step
        if step is None or step.keys.shape[2] != length:
            raise RuntimeError(f"pod: layer {starts[h]} (block start of layer {layer.index}) has no matching step")
        source_query = step.query if config.query_source == "block_start" else query
        sources.append((source_query[:, h], step.keys[:, step.full_pos[h // groups]]))
    if config.tau is None and config.combine == "softmax" and not request.any:
        if torch.is_grad_enabled() and query.requires_grad:
            return _mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, sharing, sources, scale), None
        if _FLASH is not None:
            return _two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, sharing, sources, scale), None
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * q_heads * length))
    outputs, last_rows, received = [], [], None
    last_n = min(request.last_queries, queries)
    skipped = eligible = 0
    for r0 in range(0, queries, chunk):
        r1 = min(r0 + chunk, queries)
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
    output = torch.cat(outputs, dim=2)
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


def _two_call_merge(query, keys_q, value_q, visible_q, proximal, distant, sharing, sources, scale) -> torch.Tensor:
    """Inference path (no autograd): Eq. 4 literally, with two fused attention calls that return their
    log-sum-exp: ``o_P, LSE_P`` over proximal tokens with own logits, ``o_D, LSE_D`` over distant tokens with the
    block start's logits, ``o = g o_P + (1 - g) o_D``, ``g = sigmoid(LSE_P - LSE_D)`` (``g = 1`` without distant
    tokens). Block-start heads run plain SDPA. Equal to the mixed softmax (tests)."""
    batch, q_heads, queries, dim = query.shape
    length = keys_q.shape[2]
    groups = q_heads // proximal.shape[1]
    share_idx = torch.tensor(sharing, device=query.device)
    kv_of = share_idx // groups
    out = torch.nn.functional.scaled_dot_product_attention(
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
    lse_dist = lse_dist.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_prox - lse_dist)[..., None].to(query.dtype)
    mixed = gate * o_prox + (1 - gate) * torch.where(has_distant[..., None], o_dist, torch.zeros_like(o_dist))
    return out.index_copy(1, share_idx, mixed)


def _mixed_sdpa(query, keys_q, value_q, visible_q, proximal, distant, sharing, sources, scale) -> torch.Tensor:
    """The mixed softmax as one fused SDPA call: every key appears twice, once as ``[k_own, 0]`` and once as
    ``[0, k_start]``, against the query ``[q_own, q_start]``; the mask picks, per (query, key), the own copy for
    proximal tokens (all visible tokens at block-start heads) and the block-start copy for distant tokens. Values
    are the layer's own for both copies. Exactly the single softmax over mixed logits, with no ``L x L`` tensor
    of floats (autograd included)."""
    batch, q_heads, queries, dim = query.shape
    length = keys_q.shape[2]
    heads = len(sharing)
    groups = q_heads // proximal.shape[1]
    share_idx = torch.tensor(sharing, device=query.device)
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
    return torch.nn.functional.scaled_dot_product_attention(
        torch.cat([query, source_query], dim=-1),
        keys,
        torch.cat([value_q, value_q], dim=2),
        attn_mask=torch.cat([own_allowed, dist_allowed], dim=-1),
        scale=scale,
    )


def pod_stats(cache) -> dict[str, float]:
    """τ-gate counters of a PoD cache: rows skipped, rows eligible (non-start heads with distant tokens), fraction."""
    skipped = sum(getattr(layer, "gate_counts", (0, 0))[0] for layer in cache.compressed_layers)
    eligible = sum(getattr(layer, "gate_counts", (0, 0))[1] for layer in cache.compressed_layers)
    return {"skipped": skipped, "eligible": eligible, "fraction": skipped / eligible if eligible else 0.0}
