"""A whole chunk inserted at once after ``prefill="chunked"``'s chunk attention (the later official variant).

There the chunk's tokens are inserted one after the other with fixed scores (the EMA already advanced in closed
form): no attention between two insertions, so no score changes. While the batch is in step (no padding) the
schedule of every insertion (``_plan_in_step``) is Python integers; only a selection's outcome depends on the
sequence, through scores read once. So the insertions are played out on the host, per sequence, on slot numbers
alone, and the buffer is rewritten once: each slot takes, from the stored slots and the chunk's tokens, the token
that the one-by-one insertion would have left there, its key turned from where it was stored to the slot's angle
(one turn instead of one per move: equal up to rounding), its stream index, position and score with it.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward import from_host
from kvcompress.core.rope import turn_in_place
from kvcompress.methods.cascade.schedule import Rings, angles


class RingChunkInsert:
    """Mixin of ``CascadeLayer``: ``_insert_chunk`` (see the module docstring)."""

    def _inserts_chunk_at_once(self, real: torch.Tensor) -> bool:
        """Whether ``_insert_chunk`` applies: several cascades, the batch in step and every chunk token real."""
        return self.cascades > 1 and self._in_step and not self.force_tensor_path and bool(real.all())

    def _insert_chunk(self, kv: torch.Tensor, meta: torch.Tensor, scores: torch.Tensor | None) -> None:
        """Insert ``q`` tokens (``kv`` ``[B, H_kv, q, dk + dv]``, keys un-rotated; ``meta`` ``[B, q, 2]``; initial
        ``scores`` ``[B, q]``, None: 0) as ``q`` calls of ``_insert`` would."""
        batch, count, capacity, before = kv.shape[0], kv.shape[2], self.capacity, self._rings
        plans = [self._plan_in_step()[0] for _ in range(count)]  # the layout advances as ``count`` insertions
        new_scores = kv.new_zeros(batch, count, dtype=torch.float32) if scores is None else scores.float()
        selects = self.rule.needs_scores and any(select for moves in plans for _, select in moves)
        resident = self._score[:, :capacity].tolist() if selects else [None] * batch  # (host reads, per chunk)
        arriving = new_scores.tolist() if selects else [None] * batch
        sources = [self._played(plans, resident[b], arriving[b]) for b in range(batch)]
        self._rewrite(sources, kv, meta, new_scores, before[0])
        self._sync_sinks(before)

    def _played(self, plans: list, resident: list | None, arriving: list | None) -> list[int]:
        """One sequence's insertions on slot numbers: per slot, the pool index of the token it ends with (``s``:
        stored slot ``s``; ``capacity + 1 + m``: the chunk's token ``m``)."""
        capacity, incoming = self.capacity, self.rule.config.tie == "incoming"
        source = list(range(capacity))
        score = resident
        for m, moves in enumerate(plans):  # column 0 takes the new token, column c what column c - 1's slot held
            items = [capacity + 1 + m, *(source[dest] for dest, _ in moves[:-1])]
            item_scores = None if score is None else [arriving[m], *(score[dest] for dest, _ in moves[:-1])]
            for column, (dest, select) in enumerate(moves):
                if select:  # (only ever the last column) the arriving token is written where it wins
                    mine, theirs = item_scores[column], score[dest]
                    if not (mine >= theirs if incoming else mine > theirs):
                        continue
                source[dest] = items[column]
                if score is not None:
                    score[dest] = item_scores[column]
        return source

    def _rewrite(self, sources: list[list[int]], kv, meta, scores: torch.Tensor, before: Rings) -> None:
        """Every slot takes its token from the pool ``[stored slots (scratch included), chunk tokens]``, the key
        turned from its stored angle (``before``'s; the chunk's keys are un-rotated) to the slot's angle after the
        chunk (a new sink: where a sink is stored, ``_sync_sinks``)."""
        capacity, dim, layout = self.capacity, self._key_dim, self._layout
        batch, heads, _, width = self._kv.shape
        old, target = angles(layout, before)[:capacity], angles(layout, self._shared)[:capacity]
        fill = (self.cascades - 1) * layout.width
        turns = [
            [
                (slot + fill if slot < self.sinks else target[slot]) - (0 if item > capacity else old[item])
                if item != slot or slot >= self.sinks
                else 0  # (a stored sink stays where it is)
                for slot, item in enumerate(row)
            ]
            for row in sources
        ]
        source = from_host(sources, self.device)  # [B, capacity]
        pool = torch.cat([self._kv, kv.to(self._kv.dtype)], 2)
        items = pool.gather(2, source[:, None, :, None].expand(batch, heads, capacity, width))
        if self.inv_freq is not None:
            cos, sin = self._turn_table(from_host(turns, self.device))
            turn_in_place(items[..., :dim], cos[:, None], sin[:, None])
        self._kv[:, :, :capacity] = items
        self._meta[:, :capacity] = torch.cat([self._meta, meta], 1).gather(1, source[..., None].expand(-1, -1, 2))
        if self.rule.needs_scores:
            self._score[:, :capacity] = torch.cat([self._score, scores], 1).gather(1, source)
