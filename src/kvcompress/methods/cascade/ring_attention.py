"""Attention over the ring storage where the planned steps (``ring_decode``) do not apply: per-sequence layouts
(padding, a reordered batch), a sliding window, no RoPE; ``prefill="chunked"`` and streaming's forwards of several
tokens."""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, Selection
from kvcompress.core.forward import from_host
from kvcompress.core.rope import rotate_by
from kvcompress.core.sdpa import scaled_dot_product_attention


class RingAttention:
    """Mixin of ``CascadeLayer``: positions, masks and the general attention of the ring storage."""

    def ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot ``[B, S + |C|]``: the rank (RoPE position) of its token inside the cache (``schedule.ranks``),
        and whether the slot is occupied."""
        return self._slot_numbers()[0], self._tok >= 0

    def attend(self, query, key, value, mask, scaling) -> tuple[torch.Tensor, None]:
        return self.cascade_attention(query, scaling), None

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key  # positions are assigned inside cascade_attention, token by token

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> None:
        self._sliding_window = sliding_window  # applied inside cascade_attention, by stream index as the model does
        return None

    def cascade_attention(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Insert this forward's tokens, attend, update the EMA; returns ``[B, H, q, d]``.

        ``prefill="exact"``: token by token (insert, attend, EMA), identical to feeding one token at a time (the
        planned steps while the batch is in step, else one insertion and one attention per token).
        ``prefill="chunked"`` with several tokens, and streaming (which attends before inserting): the forward
        attends to the frozen cache and causally to itself, then is inserted (``config``).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("cascade_attention() needs the tokens of this forward: call update() first")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        batch, q_heads, count, dim = query.shape
        if self._steps_alone(pending) and (count == 1 or self.rule.config.prefill == "exact"):
            step = self._decode_circular if self.attend_first else self._step_tokens  # (streaming is "chunked")
            return step(query, pending, scale)
        kv, meta, pos, real = self._prepared(pending)
        if self.inv_freq is not None:
            query = rotate_by(query, -pos[:, None, :], self.inv_freq)
        queries = query.reshape(batch, self._kv.shape[1], -1, count, dim)  # un-rotated [B, H_kv, G, q, d]
        if (self.rule.config.prefill == "chunked" and count > 1) or self.attend_first:
            rank = (self._tok >= 0).sum(1, keepdim=True) + (real.long().cumsum(1) - 1).clamp(min=0)
            output, scores = self._attention(queries, rank, self._visible(meta, real, True), real, scale, kv)
            self._insert_tokens(kv, meta, real, scores)
            return output.reshape(batch, q_heads, count, -1)
        outputs = []
        for m in range(count):
            self._insert_tokens(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m : m + 1], None)
            top = ((self._tok >= 0).sum(1, keepdim=True) - 1).clamp(min=0)  # the query's rank: its own key's
            visible = self._visible(meta[:, m : m + 1], real[:, m : m + 1], False)
            outputs.append(self._attention(queries[:, :, :, m : m + 1], top, visible, real[:, m : m + 1], scale)[0])
        return torch.cat(outputs, 3).reshape(batch, q_heads, count, -1)

    def _visible(self, meta: torch.Tensor, real: torch.Tensor, chunk: bool) -> torch.Tensor:
        """What queries at stream indices ``meta[..., 0]`` ``[B, q]`` see: the stored keys inside the model's sliding
        window, if any, then with ``chunk`` the forward's own keys causally (``[B, q, L + q]``; a padding query sees
        itself); without, ``[B, q, L]`` where a padding query (stored nowhere) sees any slot (a finite output)."""
        count = meta.shape[1]
        stored = (self._tok >= 0)[:, None, :]
        window = getattr(self, "_sliding_window", None)
        if window is not None:
            stored = stored & (self._tok[:, None, :] > meta[:, :, None, 0] - window)
        if not chunk:
            return stored | ~real[:, :, None]
        step = torch.arange(count, device=self.device)
        causal = (step[None, :] <= step[:, None])[None] & (real[:, None, :] | (step[None, :] == step[:, None]))
        if window is not None:
            causal = causal & (step[None, :] > step[:, None] - window)[None]
        return torch.cat([stored.expand(-1, count, -1), causal], 2)

    def _attention(self, queries, rank, visible, real, scale, chunk=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Un-rotated queries ``[B, H_kv, G, q, d]`` at ranks ``rank`` ``[B, q]`` over the stored keys at their ranks
        and, given the forward's ``chunk`` ``[B, H_kv, q, dk + dv]`` (keys un-rotated), its own keys at ``rank``;
        ``visible`` from ``_visible``. Without scores to keep, one SDPA over the stored keys turned to their ranks;
        with them, the explicit softmax (each query turned to every frame, ``schedule.offsets``) and the EMA advanced
        in closed form, query ``m`` weighted ``(1 - gamma) gamma^(real queries after m)``. Returns the output
        ``[B, H_kv, G, q, d_v]`` and the chunk's initial scores (``None`` without a chunk or scores)."""
        batch, kv_heads, groups, count, dim = queries.shape
        rows, slots, values = groups * count, self.capacity, self._v
        turned = queries if self.inv_freq is None else rotate_by(queries, rank[:, None, None], self.inv_freq)
        turned = turned.reshape(batch, kv_heads, rows, dim)
        if chunk is not None:
            chunk_keys = chunk[..., :dim]
            if self.inv_freq is not None:
                chunk_keys = rotate_by(chunk_keys, rank[:, None], self.inv_freq)
            values = torch.cat([values, chunk[..., dim:].to(values.dtype)], 2)
        if not self.rule.needs_scores:
            keys = self._k
            if self.inv_freq is not None:  # from its angle to its rank: its frame's offset (``schedule.offsets``)
                sizes = from_host([self.sinks] + [self.width] * self.cascades, self.device)
                turns = self._counters()[3].repeat_interleave(sizes, 1, output_size=slots)
                keys = rotate_by(keys, turns[:, None], self.inv_freq, exact=True)
            if chunk is not None:
                keys = torch.cat([keys, chunk_keys], 2)
            turned = turned.reshape(batch, kv_heads * groups, count, dim)
            output = scaled_dot_product_attention(
                turned, keys, values, attn_mask=visible[:, None], scale=scale, enable_gqa=groups > 1
            )
            return output.view(batch, kv_heads, groups, count, -1), None
        logits = self._cache_logits(queries, rank)
        if chunk is not None:
            own = (turned @ chunk_keys.transpose(-1, -2)).view(batch, kv_heads, groups, count, count)
            logits = torch.cat([logits, own], -1)
        probs = (logits.float() * scale).masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
        output = probs.to(self._kv.dtype).reshape(batch, kv_heads, rows, -1) @ values
        gamma, received = self.rule.gamma, self.rule.reduce_heads(probs)  # [B, q, L (+ q)]
        later = real.sum(1, keepdim=True) - real.long().cumsum(1)  # real queries after query m
        weight = real * (1.0 - gamma) * gamma ** later.float()  # [B, q]
        cascade = self._score[:, self.sinks : slots]
        into_cache = torch.einsum("bq,bql->bl", weight, received[:, :, self.sinks : slots])
        cascade.copy_(cascade * (gamma ** real.sum(1).float())[:, None] + into_cache)
        scores = None if chunk is None else torch.einsum("bq,bqj->bj", weight, received[:, :, slots:])
        return output.view(batch, kv_heads, groups, count, -1), scores

    def _cache_logits(self, query: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, H_kv, G, n, S + |C|]`` of un-rotated queries ``[B, H_kv, G, n, d]`` at ranks ``top``
        ``[B, n]`` against the stored keys: each query turned to every frame (the sinks', then each ring's), one
        matmul per frame over its slots."""
        keys = self._k
        batch, kv_heads, groups, count, dim = query.shape
        if self.inv_freq is None:
            logits = query.reshape(batch, kv_heads, groups * count, dim) @ keys.transpose(-1, -2)
            return logits.view(batch, kv_heads, groups, count, self.capacity)
        at = top[:, :, None] - self._counters()[3][:, None, :]  # [B, n, 1 + N]
        turned = rotate_by(query[:, :, :, :, None, :], at[:, None, None], self.inv_freq, exact=True)  # [B,H,G,n,F,d]
        bounds = [0, self.sinks] + [self.sinks + (i + 1) * self.width for i in range(self.cascades)]
        blocks = [
            turned[:, :, :, :, frame].reshape(batch, kv_heads, -1, dim) @ keys[:, :, lo:hi].transpose(-1, -2)
            for frame, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
            if hi > lo
        ]
        return torch.cat(blocks, -1).view(batch, kv_heads, groups, count, self.capacity)

    def _fold_scores(self, probs: torch.Tensor) -> None:
        """EMA step ``mu <- gamma mu + (1 - gamma) rho(s)`` over the cascade slots (sinks have no score) of one
        query's ``probs`` ``[B, H_kv, G, L]`` over the first ``L`` slots (the empty ones after them hold no score)."""
        gamma = self.rule.gamma
        cascade = self._score[:, self.sinks : probs.shape[-1]]
        if self.rule.config.reduction == "mean":  # the sum, with 1 / heads folded into the EMA weight
            received = probs[..., self.sinks :].flatten(1, 2).sum(1)
            weight = (1.0 - gamma) / (probs.shape[1] * probs.shape[2])
        else:
            received, weight = self.rule.reduce_heads(probs[..., self.sinks :]), 1.0 - gamma
        cascade.mul_(gamma).add_(received, alpha=weight)

    def after_attention(self, stats: AttentionStats | None) -> None:
        """For callers that drive the layer by hand (tests, benchmarks): insert tokens that did not attend
        through ``cascade_attention``, then fold ``stats.received`` (``[B, H_kv, G, S + |C|]``) into the EMA."""
        if self._pending is not None:
            self._insert_pending()
        if stats is not None and stats.received is not None and self.rule.needs_scores:
            self._fold_scores(stats.received.float())

    def apply(self, selection: Selection) -> None:
        raise NotImplementedError("a cascade layer evicts while inserting; it takes no Selection")
