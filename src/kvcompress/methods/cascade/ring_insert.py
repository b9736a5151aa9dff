"""The per-sequence tensor path of a cascade insertion (Algorithm 1 for a batch out of step: padding, or forced).

A mixin of ``CascadeLayer`` (``kvcompress.methods.cascade.layer``), whose docstring describes the slot layout; the
in-step path (Python counters, the same schedule for the whole batch) lives there.
"""

from __future__ import annotations

import torch

from kvcompress.core.rope import rotate_by


class RingInsert:
    """Mixin of ``CascadeLayer``: one token per sequence inserted from per-sequence counter tensors."""

    def _insert_tensors(
        self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None
    ) -> None:
        """Insert one token per sequence: ``kv`` ``[B, H_kv, 1, dk + dv]`` (key un-rotated), ``meta`` ``[B, 1, 2]``,
        ``real`` ``[B]`` (False: padding, nothing happens), ``score`` ``[B]`` initial EMA (None: 0).

        Algorithm 1. The token travels down the cascades while each one is accepting and full
        (overwrite the oldest slot, pass the evicted token on: b); it stops at the first cascade that appends (a),
        eager-adds into an empty ring (c) or selects between the arriving token and its newest one (d).
        Every cascade is touched at most once, so all decisions come from the counters before the step.
        """
        self._leave_step()
        sinks, width, slots = self.sinks, self.width, self.capacity
        config = self.rule.config
        seen, count, start = self._n_real, self._count, self._start
        batch = seen.shape[0]
        into_cascades = real if self._sinks_full else real & (seen >= sinks)
        accepting = ((seen - sinks)[:, None] % self._period) == 0  # the global clock
        if not self._filled:
            accepting = accepting | (seen < self.full_capacity)[:, None]
        full = count == width
        passes = accepting & full  # (b): evict the oldest, carry it on to the next cascade
        select = ~accepting & (count > 0)  # (d)
        if self.cascades > 1:
            reached = torch.cat([into_cascades[:, None], passes[:, :-1]], 1).cumprod(1).bool()
        else:
            reached = into_cascades[:, None]
        self._count = count + (reached & ~(passes | select)).long()
        self._start = (start + (reached & passes).long()) % width
        depth = int(reached.sum(1).max())  # cascades the deepest sequence reaches: only those columns move
        reached, select = reached[:, :depth], select[:, :depth]
        # (b) oldest slot = start + count (mod W) when full; (a) next free; (c) start; (d) newest slot
        first_slot, start, count = self._first_slot[:depth], start[:, :depth], count[:, :depth]
        dest = first_slot + (start + count - select.long()) % width  # [B, depth]
        evicted = first_slot[:-1] + start[:, :-1]  # [B, depth - 1]: the oldest slots the chain passes through
        write = reached
        new_score = torch.zeros(batch, 1, device=self.device) if score is None else score.float()[:, None]
        if self.rule.needs_scores and depth:
            scores, seq = self._score.view(-1), self._bases()[1][:, None]
            evicted_score = scores[seq + evicted]
            arriving = torch.cat([new_score, evicted_score], 1)
            resident = scores[seq + dest]
            loses = arriving < resident if config.tie == "incoming" else arriving <= resident
            write = reached & ~(select & loses)
        dest = torch.where(write, dest, slots)  # columns that write nothing write the scratch slot
        lead = 1 if depth else 0  # columns that take the new token
        if not self._sinks_full:
            to_sink = real & (seen < sinks)
            dest = torch.cat([torch.where(to_sink, seen, slots)[:, None], dest], 1)
            self._n_sink = self._n_sink + to_sink.long()
            lead += 1  # the new token is also the item of the sink column
            self._sinks_full = bool((self._n_sink == sinks).all())
        self._n_real = seen + real.long()
        if not self._filled:
            self._filled = bool((self._n_real >= self.full_capacity).all())
        if not lead:
            return  # padding only
        # items: the new token (lead columns), then the tokens evicted from cascades 0..N-2; moved as whole rows of
        # flattened buffers (index_select / index_copy_ copy contiguous rows, unlike gather / scatter)
        heads, width_kv = self._kv.shape[1], self._kv.shape[-1]
        rows, seq = self._bases()
        kv_rows = self._kv.view(-1, width_kv)
        items = kv.expand(batch, heads, lead, width_kv)
        if depth > 1:
            moved = kv_rows.index_select(0, (rows[:, :, None] + evicted[:, None, :]).flatten())
            items = torch.cat([items, moved.view(batch, heads, -1, width_kv)], 2)
        if self.inv_freq is not None and self.cascades > 1:  # each key from where it was (0: the new one) to its slot
            source = torch.cat([torch.zeros_like(dest[:, :lead]), evicted], 1)
            keys = rotate_by(items[..., : self._key_dim], (dest - source)[:, None], self.inv_freq)
            items = torch.cat([keys, items[..., self._key_dim :]], -1)
        kv_rows.index_copy_(0, (rows[:, :, None] + dest[:, None, :]).flatten(), items.reshape(-1, width_kv))
        meta_rows = self._meta.view(-1, 2)
        meta_items = meta.expand(batch, lead, 2)
        if depth > 1:
            moved = meta_rows.index_select(0, (seq[:, None] + evicted).flatten()).view(batch, -1, 2)
            meta_items = torch.cat([meta_items, moved], 1)
        meta_rows.index_copy_(0, (seq[:, None] + dest).flatten(), meta_items.reshape(-1, 2))
        if self.rule.needs_scores and depth:
            score_items = torch.cat([new_score.expand(batch, lead), evicted_score], 1)
            self._score.view(-1).index_copy_(0, (seq[:, None] + dest).flatten(), score_items.flatten())

    def _bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row offsets of each (sequence, head) in the flattened key/value buffer and of each sequence in the
        flattened per-slot buffers (cached per batch size)."""
        batch, heads = self._kv.shape[:2]
        if getattr(self, "_bases_for", None) != batch:
            slots = self.capacity + 1
            sequences = torch.arange(batch, device=self.device)
            self._row_base = (sequences[:, None] * heads + torch.arange(heads, device=self.device)) * slots
            self._seq_base = sequences * slots
            self._bases_for = batch
        return self._row_base, self._seq_base
