"""The executor of the cascade's moves (``schedule.play``) on the slot buffers.

A move is a column: slot ``written[c]`` takes item ``read[c]`` of the *pool*, the stored slots before the moves
(``0 .. slots``, ``slots`` the scratch slot) then the new tokens (``slots + 1 + t``), every item read before any
write, each key turned by its column's angle. A selection column writes only where the arriving item's score beats
the resident's (``tie``), a losing write going to the scratch slot. One gather and one scatter per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.rope import turn_in_place


@dataclass(frozen=True)
class Columns:
    """Moves as device tables, batch-wide or per sequence (unused columns read and write the scratch slot).
    Batch-wide: ``written`` ``[m]``, the first ``k`` columns taking new tokens ``take`` ``[k]`` (``None``: all, in
    order), the rest stored slots ``read`` ``[m - k]``; ``select``: the last column is a selection; ``fresh``: the
    first new token's slot. Per sequence: ``read``, ``written``, ``select`` ``[n, m]``. ``cos`` / ``sin`` (None: no
    RoPE) turn each column's key: ``[m, 1, 1, h]`` batch-wide, ``[n, 1, m, h]`` per sequence."""

    read: torch.Tensor
    written: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    select: bool | torch.Tensor
    take: torch.Tensor | None = None
    k: int = 1
    fresh: int = -1


def _wins(arriving: torch.Tensor, resident: torch.Tensor, tie: str) -> torch.Tensor:
    return arriving >= resident if tie == "incoming" else arriving > resident


def apply_moves(buffers: tuple, columns: Columns, tie: str, new: tuple) -> None:
    """``buffers``: kv ``[n, H, slots + 1, dk + dv]``, meta ``[n, slots + 1, 2]``, score ``[n, slots + 1]`` (None: no
    scores kept); ``new`` tokens: kv ``[n, H, q, dk + dv]`` (None: the caller writes them), meta, score (None: 0)."""
    (_batch_wide if columns.written.dim() == 1 else _per_sequence)(*buffers, *new, columns, tie)


def _batch_wide(kv, meta, score, new_kv, new_meta, new_score, columns: Columns, tie: str) -> None:
    batch, heads, scratch, width = kv.shape[0], kv.shape[1], kv.shape[2] - 1, kv.shape[3]
    read, written, take, fresh = columns.read, columns.written, columns.take, columns.k
    if take is not None:
        new_meta = new_meta.index_select(1, take)
        new_score = None if new_score is None else new_score.index_select(1, take)
    by_column = kv.permute(2, 0, 1, 3)  # [slots, n, H, dk + dv]: a column's rows are contiguous
    items = by_column.index_select(0, read)  # [m - k, n, H, dk + dv]
    lead = 0 if new_kv is None else fresh  # the kv columns start at the new tokens or at the first stored one
    if new_kv is not None:
        arriving = new_kv.permute(2, 0, 1, 3)  # (in the buffer's dtype)
        items = torch.cat([arriving if take is None else arriving.index_select(0, take), items], 0)
    if columns.cos is not None:
        turn_in_place(items, columns.cos[fresh - lead :], columns.sin[fresh - lead :])
    meta_items = torch.cat([new_meta, meta.index_select(1, read)], 1)  # [n, m, 2]
    if score is not None:
        arriving_score = score.new_zeros(batch, fresh) if new_score is None else new_score.float()
        score_items = torch.cat([arriving_score, score.index_select(1, read)], 1)
    if not columns.select:
        by_column.index_copy_(0, written[fresh - lead :], items)
        meta.index_copy_(1, written, meta_items)
        if score is not None:
            score.index_copy_(1, written, score_items)
        return
    wins = _wins(score_items[:, -1], score.index_select(1, written[-1:])[:, 0], tie)
    last = torch.where(wins, written[-1], scratch)  # losers write the scratch slot
    slots = torch.cat([written[:-1].expand(batch, -1), last[:, None]], 1)  # [n, m]
    kv_slots = slots[:, fresh - lead :]
    count = kv_slots.shape[1]
    kv.scatter_(2, kv_slots[:, None, :, None].expand(batch, heads, count, width), items.permute(1, 2, 0, 3))
    meta.scatter_(1, slots[:, :, None].expand(batch, -1, 2), meta_items)
    score.scatter_(1, slots, score_items)


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
        loses = columns.select & ~_wins(score_items, score.gather(1, written), tie)
        written = torch.where(loses, scratch, written)
    kv.scatter_(2, at(written), items)
    meta.scatter_(1, pairs(written), meta_items)
    if score is not None:
        score.scatter_(1, written, score_items)
