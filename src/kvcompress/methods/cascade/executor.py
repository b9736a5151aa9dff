"""The executor of the cascade's moves (``schedule.play``) on the slot buffers.

A move is a column: slot ``written[c]`` takes item ``read[c]`` of the *pool*, the stored slots before the moves
(``0 .. slots``, ``slots`` the scratch slot) then the new tokens (``slots + 1 + t``), every item read before any
write, each key turned by its column's angle. A selection column writes only where the arriving item's score beats
the resident's (``tie``), a losing write going to the scratch slot. One gather and one scatter per tensor; with one
sequence (or a batch-wide move with no selection) the scatter is an ``index_copy_`` along the slots. An ``Executor``
is made once per forward for a set of buffers, so the steps of a forward's tokens share its views.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvcompress.core.rope import turn_in_place


@dataclass(frozen=True)
class Columns:
    """Moves as device tables, batch-wide or per sequence (unused columns read and write the scratch slot).
    Batch-wide: ``written`` ``[m]``, the first ``k`` columns taking new tokens ``take`` ``[k]`` (``None``: all, in
    order), the rest stored slots ``read`` ``[m - k]``; ``select``: the last column is a selection, ``lost``
    ``written`` with the scratch slot last (where a losing arrival goes) and ``last`` the selection's slot;
    ``fresh``: the first new token's slot. Per sequence: ``read``, ``written``, ``select`` ``[n, m]``. ``cos`` /
    ``sin`` (None: no RoPE) turn each column's key: ``[m, 1, 1, h]`` batch-wide, ``[n, 1, m, h]`` per sequence."""

    read: torch.Tensor
    written: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    select: bool | torch.Tensor
    take: torch.Tensor | None = None
    k: int = 1
    fresh: int = -1
    lost: torch.Tensor | None = None
    last: int = -1

    @cached_property
    def stored_only(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Batch-wide, the caller writing the new tokens' kv: the stored columns' slots, cos and sin."""
        cut = lambda table: None if table is None else table[self.k :]  # noqa: E731
        return self.written[self.k :], cut(self.cos), cut(self.sin)


def arrival_wins(arriving: torch.Tensor, resident: torch.Tensor, tie: str) -> torch.Tensor:
    """Whether an arriving item's score takes a selection slot from the resident's (``tie``: who wins equal ones)."""
    return arriving >= resident if tie == "incoming" else arriving > resident


class Executor:
    """Applies moves to one set of buffers: kv ``[n, H, slots + 1, dk + dv]``, meta ``[n, slots + 1, 2]``, score
    ``[n, slots + 1]`` (None: no scores kept). Made once per forward: a forward's steps share its views."""

    def __init__(self, kv: torch.Tensor, meta: torch.Tensor, score: torch.Tensor | None, tie: str) -> None:
        self.kv, self.meta, self.score, self.tie = kv, meta, score, tie
        self.by_column = kv.permute(2, 0, 1, 3)  # [slots + 1, n, H, dk + dv]: a column's rows are contiguous
        self.zeros: dict[int, torch.Tensor] = {}

    def apply(self, columns: Columns, new_kv, new_meta: torch.Tensor, new_score=None) -> None:
        """The new tokens: kv ``[n, H, q, dk + dv]`` (None: the caller writes them), meta ``[n, q, 2]``, score
        ``[n, q]`` (None: 0)."""
        if columns.written.dim() == 2:
            _per_sequence(self.kv, self.meta, self.score, new_kv, new_meta, new_score, columns, self.tie)
            return
        meta, score, read, take, k = self.meta, self.score, columns.read, columns.take, columns.k
        if take is not None:
            new_meta = new_meta.index_select(1, take)
            new_score = None if new_score is None else new_score.index_select(1, take)
        items = self.by_column.index_select(0, read)  # [m - k, n, H, dk + dv]
        if new_kv is None:
            lead, (kv_written, cos, sin) = k, columns.stored_only  # (the kv columns start at the first stored one)
        else:
            arriving = new_kv.permute(2, 0, 1, 3)  # (in the buffer's dtype)
            items = torch.cat([arriving if take is None else arriving.index_select(0, take), items], 0)
            lead, kv_written, cos, sin = 0, columns.written, columns.cos, columns.sin
        if cos is not None:
            turn_in_place(items, cos, sin)
        meta_items = torch.cat([new_meta, meta.index_select(1, read)], 1)  # [n, m, 2]
        written = columns.written
        if score is not None:
            if new_score is None and k not in self.zeros:  # the arriving items' scores: zeros made once, never written
                self.zeros[k] = score.new_zeros(score.shape[0], k)
            arriving_score = self.zeros[k] if new_score is None else new_score.float()
            score_items = torch.cat([arriving_score, score.index_select(1, read)], 1)
        if columns.select:  # the last column writes the scratch slot where the arriving item loses
            wins = arrival_wins(score_items[:, -1], score[:, columns.last], self.tie)  # [n]
            if score.shape[0] > 1:  # column c of sequence b to slot slots[b, c]
                slots, kv = torch.where(wins[:, None], written, columns.lost), self.kv  # [n, m]
                index = slots[:, None, lead:, None].expand(-1, kv.shape[1], -1, kv.shape[3])
                kv.scatter_(2, index, items.permute(1, 2, 0, 3))
                meta.scatter_(1, slots[:, :, None].expand(-1, -1, 2), meta_items)
                score.scatter_(1, slots, score_items)
                return
            written = torch.where(wins, written, columns.lost)
            kv_written = written if lead == 0 else written[lead:]
        self.by_column.index_copy_(0, kv_written, items)
        meta.index_copy_(1, written, meta_items)
        if score is not None:
            score.index_copy_(1, written, score_items)


def _per_sequence(kv, meta, score, new_kv, new_meta, new_score, columns: Columns, tie: str) -> None:
    batch, heads, scratch, width = kv.shape[0], kv.shape[1], kv.shape[2] - 1, kv.shape[3]
    read, written = columns.read, columns.written
    count = read.shape[1]
    arrives = read > scratch  # [n, m]: the column takes a new token
    stored, fresh = read.clamp(max=scratch), (read - scratch - 1).clamp(min=0)
    at = lambda index: index[:, None, :, None].expand(batch, heads, count, width)  # noqa: E731
    new_kv = new_kv.expand(batch, heads, -1, width).to(kv.dtype)
    items = torch.where(at(arrives), new_kv.gather(2, at(fresh)), kv.gather(2, at(stored)))  # [n, H, m, dk + dv]
    if columns.cos is not None:
        turn_in_place(items, columns.cos, columns.sin)
    pairs = lambda index: index[:, :, None].expand(-1, -1, 2)  # noqa: E731
    new_meta = new_meta.expand(batch, -1, 2)
    meta_items = torch.where(pairs(arrives), new_meta.gather(1, pairs(fresh)), meta.gather(1, pairs(stored)))
    if score is not None:
        arriving = score.new_zeros(new_meta.shape[:2]) if new_score is None else new_score.float()
        score_items = torch.where(arrives, arriving.gather(1, fresh), score.gather(1, stored))
        loses = columns.select & ~arrival_wins(score_items, score.gather(1, written), tie)
        written = torch.where(loses, scratch, written)
    kv.scatter_(2, at(written), items)
    meta.scatter_(1, pairs(written), meta_items)
    if score is not None:
        score.scatter_(1, written, score_items)
