"""Attention over the ring storage where the batch's one plan (``ring_decode``) does not apply: per-sequence layouts
(padding, a reordered batch), a sliding window, no RoPE; ``prefill="chunked"`` and streaming's forwards of several
tokens; the EMA fold. Each query is turned to every frame (``schedule.offsets``, per sequence) against the keys at
their angles."""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, Selection
from kvcompress.core.rope import rotate_by
from kvcompress.core.sdpa import scaled_dot_product_attention


class RingAttention:
    """Mixin of ``CascadeLayer``: positions, masks and attention of the ring storage."""

    # --- positions and attention ----------------------------------------------------------------------------
    def ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot ``[B, S + |C|]``: the rank (RoPE position) of its token inside the cache (``schedule.ranks``:
        sinks first, then the cascades from the oldest to the newest, each in ring order), and whether the slot is
        occupied."""
        return self._slot_numbers()[0], self._tok >= 0

    def _cache_logits(self, query: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, H_kv, G, n, S + |C|]`` of un-rotated queries ``[B, H_kv, G, n, d]`` at ranks ``top``
        ``[B, n]`` against the stored keys at their ranks: each query turned to every frame (``schedule.offsets``:
        the sinks', then each ring's), one matmul per frame over its slots."""
        keys = self._k
        batch, kv_heads, groups, count, dim = query.shape
        slots = self.capacity
        if self.inv_freq is None:
            logits = query.reshape(batch, kv_heads, groups * count, dim) @ keys.transpose(-1, -2)
            return logits.view(batch, kv_heads, groups, count, slots)
        offset = self._counters()[5]  # [B, 1 + N]
        at = top[:, :, None] - offset[:, None, :]  # [B, n, 1 + N]
        turned = rotate_by(query[:, :, :, :, None, :], at[:, None, None], self.inv_freq, exact=True)  # [B,H,G,n,F,d]
        bounds = [(0, self.sinks)] + [
            (self.sinks + i * self.width, self.sinks + (i + 1) * self.width) for i in range(self.cascades)
        ]
        blocks = [
            turned[:, :, :, :, frame].reshape(batch, kv_heads, groups * count, dim)
            @ keys[:, :, lo:hi].transpose(-1, -2)
            for frame, (lo, hi) in enumerate(bounds)
            if hi > lo
        ]
        return torch.cat(blocks, -1).view(batch, kv_heads, groups, count, slots)

    def attend(self, query, key, value, mask, scaling) -> tuple[torch.Tensor, None]:
        return self.cascade_attention(query, scaling), None

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key  # positions are assigned inside cascade_attention, token by token

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> None:
        self._sliding_window = sliding_window  # applied inside cascade_attention, by stream index as the model does
        return None  # built inside cascade_attention from the occupied slots

    def _in_window(self, query_tok: torch.Tensor) -> torch.Tensor | None:
        """``[B, n, S + |C|]``: stored keys inside the model's sliding window of queries at stream indices
        ``query_tok`` ``[B, n]`` (``None``: no sliding window in this layer)."""
        window = getattr(self, "_sliding_window", None)
        if window is None:
            return None
        return self._tok[:, None, :] > query_tok[:, :, None] - window

    def _grouped_queries(self, query: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, q, d]`` queries as the model rotated them -> un-rotated ``[B, H_kv, G, q, d]``."""
        batch, q_heads, count, dim = query.shape
        if self.inv_freq is not None:
            query = rotate_by(query, -pos[:, None, :], self.inv_freq)
        kv_heads = self._kv.shape[1]
        return query.reshape(batch, kv_heads, q_heads // kv_heads, count, dim)

    def cascade_attention(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Insert this forward's tokens, attend, update the EMA; returns ``[B, H, q, d]``.

        ``prefill="exact"``: token by token (insert, attend, EMA), identical to feeding one token at a time: the
        planned steps while the batch is in step (``ring_decode``), else one insertion and one attention per token.
        ``prefill="chunked"`` with several tokens: the later official strided variant (module docstring).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("cascade_attention() needs the tokens of this forward: call update() first")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        count, planned = query.shape[2], self._steps_alone(pending)
        if planned and count == 1 and self.attend_first:
            return self._decode_circular(query, pending, scale)
        if planned and (count == 1 or self.rule.config.prefill == "exact") and not self.attend_first:
            return self._step_tokens(query, pending, scale)
        kv, meta, pos, real = self._prepared(pending)
        queries = self._grouped_queries(query, pos)
        if (self.rule.config.prefill == "chunked" and count > 1) or self.attend_first:
            return self._chunk_attention(queries, kv, meta, real, scale)
        outputs = []
        for m in range(count):
            self._insert_tokens(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m : m + 1], None)
            outputs.append(self._attend(queries[:, :, :, m : m + 1], real[:, m], meta[:, m : m + 1, 0], scale))
        batch, q_heads, _, dim = query.shape
        return torch.cat(outputs, 3).reshape(batch, q_heads, count, -1)

    def _attend(self, query: torch.Tensor, real: torch.Tensor, query_tok: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per sequence (``[B, H_kv, G, 1, d]`` un-rotated, stream index ``query_tok`` ``[B, 1]``) over
        the cache, at the newest rank; folds its attention into the EMA. Returns ``[B, H_kv, G, 1, d_v]``."""
        occupied = self._tok >= 0
        top = (occupied.sum(1, keepdim=True) - 1).clamp(min=0)  # the query's rank: its own key's, the largest
        logits = self._cache_logits(query, top).float() * scale  # [B, H_kv, G, 1, L]
        window = self._in_window(query_tok)
        if window is not None:
            occupied = occupied & window[:, 0]
        visible = occupied | ~real[:, None]  # a padding query (stored nowhere) reads anything finite
        probs = logits.masked_fill(~visible[:, None, None, None], float("-inf")).softmax(-1)
        batch, kv_heads, groups = probs.shape[:3]
        output = probs.to(self._kv.dtype).view(batch, kv_heads, groups, -1) @ self._v
        if self.rule.needs_scores:
            self._fold_scores(probs[:, :, :, 0], real)
        return output[:, :, :, None]

    def _fold_scores(self, probs: torch.Tensor, real: torch.Tensor | None) -> None:
        """EMA step ``mu <- gamma mu + (1 - gamma) rho(s)`` over the cascade slots (sinks have no score).
        ``probs`` is ``[B, H_kv, G, S + |C|]``."""
        gamma = self.rule.gamma
        cascade = self._score[:, self.sinks : self.capacity]
        if self.rule.config.reduction == "mean":  # the sum, with 1 / heads folded into the EMA weight
            received = probs[..., self.sinks :].flatten(1, 2).sum(1)
            weight = (1.0 - gamma) / (probs.shape[1] * probs.shape[2])
        else:
            received, weight = self.rule.reduce_heads(probs[..., self.sinks :]), 1.0 - gamma
        if real is None or self._all_real:
            cascade.mul_(gamma).add_(received, alpha=weight)
        else:
            cascade.copy_(torch.where(real[:, None], cascade * gamma + received * weight, cascade))

    def _chunk_attention(
        self, queries: torch.Tensor, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The later official strided prefill (not v1): the chunk attends to the frozen cache and causally to
        itself, the EMA advances in closed form, then the chunk is inserted token by token."""
        batch, kv_heads, groups, count, dim = queries.shape
        stored = (self._tok >= 0).sum(1)
        rank = stored[:, None] + (real.long().cumsum(1) - 1).clamp(min=0)  # [B, q]
        chunk_keys, values = kv[..., : self._key_dim], kv[..., self._key_dim :]
        chunk_queries = queries
        if self.inv_freq is not None:
            chunk_keys = rotate_by(chunk_keys, rank[:, None], self.inv_freq)
            chunk_queries = rotate_by(queries, rank[:, None, None], self.inv_freq)
        visible = self._chunk_visible(meta, real)  # [B, q, L + q]
        if self.rule.needs_scores:
            output, scores = self._chunk_softmax(queries, chunk_queries, chunk_keys, values, rank, visible, real, scale)
        else:
            output, scores = self._chunk_sdpa(chunk_queries, chunk_keys, values, visible, scale), None
        self._insert_tokens(kv, meta, real, scores)
        return output.reshape(batch, kv_heads * groups, count, -1)

    def _chunk_visible(self, meta: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """``[B, q, L + q]``: the stored keys (inside the sliding window, if any) and the chunk's own, causally."""
        count = meta.shape[1]
        step = torch.arange(count, device=self.device)
        causal = (step[None, :] <= step[:, None])[None] & (real[:, None, :] | (step[None, :] == step[:, None]))
        stored = (self._tok >= 0)[:, None, :].expand(-1, count, -1)
        window = self._in_window(meta[:, :, 0])
        if window is not None:
            stored = stored & window
            causal = causal & (step[None, :] > step[:, None] - self._sliding_window)[None]
        return torch.cat([stored, causal], 2)

    def _chunk_sdpa(self, queries, chunk_keys, values, visible, scale) -> torch.Tensor:
        """Without scores to collect: SDPA over the stored keys rotated from their angles to their ranks (one
        rotation of at most ``S + |C|`` keys per forward) and the chunk's own keys; ``[B, H_kv, G q, d]``."""
        keys = self._k
        if self.inv_freq is not None:
            rank, angle = self._slot_numbers()
            keys = rotate_by(keys, (rank - angle)[:, None], self.inv_freq, exact=True)
        batch, kv_heads, groups, count, dim = queries.shape
        output = scaled_dot_product_attention(
            queries.reshape(batch, kv_heads * groups, count, dim),
            torch.cat([keys, chunk_keys], 2),
            torch.cat([self._v, values.to(self._kv.dtype)], 2),
            attn_mask=visible[:, None],
            scale=scale,
            enable_gqa=groups > 1,
        )
        return output.reshape(batch, kv_heads, groups * count, -1)

    def _chunk_softmax(self, queries, chunk_queries, chunk_keys, values, rank, visible, real, scale):
        """With the EMA: the explicit softmax over the ring (queries rotated per cascade) and the chunk, the EMA
        advanced in closed form; returns the output ``[B, H_kv, G q, d]`` and the chunk tokens' initial scores."""
        batch, kv_heads, groups, count, dim = queries.shape
        slots = self.capacity
        cache_logits = self._cache_logits(queries, rank)  # [B, H_kv, G, q, L]
        own_logits = chunk_queries.reshape(batch, kv_heads, groups * count, dim) @ chunk_keys.transpose(-1, -2)
        own_logits = own_logits.view(batch, kv_heads, groups, count, count)
        logits = torch.cat([cache_logits, own_logits], -1).float() * scale
        probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
        weights = probs.to(self._kv.dtype).reshape(batch, kv_heads, groups * count, slots + count)
        output = weights[..., :slots] @ self._v + weights[..., slots:] @ values
        gamma = self.rule.gamma
        received = self.rule.reduce_heads(probs)  # [B, q, L + q]
        later = real.sum(1, keepdim=True) - real.long().cumsum(1)  # real queries after query m
        weight = real * (1.0 - gamma) * gamma ** later.float()  # [B, q]
        decay = gamma ** real.sum(1).float()
        cascade = self._score[:, self.sinks : slots]
        into_cache = torch.einsum("bq,bql->bl", weight, received[:, :, self.sinks : slots])
        cascade.copy_(cascade * decay[:, None] + into_cache)
        return output, torch.einsum("bq,bqj->bj", weight, received[:, :, slots:])

    def after_attention(self, stats: AttentionStats | None) -> None:
        """For callers that drive the layer by hand (tests, benchmarks): insert tokens that did not attend
        through ``cascade_attention``, then fold ``stats.received`` (``[B, H_kv, G, S + |C|]``) into the EMA."""
        if self._pending is not None:
            self._insert_pending()
        if stats is not None and stats.received is not None and self.rule.needs_scores:
            self._fold_scores(stats.received.float(), None)

    def apply(self, selection: Selection) -> None:
        raise NotImplementedError("a cascade layer evicts while inserting; it takes no Selection")
