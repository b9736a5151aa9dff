"""The one executor of the cascade's moves (``schedule.Moves``) on the slot buffers.

A step's moves are columns: column 0 writes the new token, column ``c > 0`` the token that slot ``read[c - 1]`` held
before the step, into slot ``written[c]``; every token moved is read before any slot is written, and each key is
turned by its column's angle on the way (the rotation from where it was stored to where it is stored next). A
selection column writes only where the arriving token's score beats the resident's (``tie``: which wins equal
scores); a losing write goes to the scratch slot after the rings. Every move of every sequence, head and tensor is
one gather and one scatter per tensor: no loop over heads, tokens or sequences, nothing read back to the host.

The slots are either the same for the whole batch (one schedule for every sequence: ``read`` ``[m - 1]``, ``written``
``[m]``, moved as whole contiguous columns with ``index_select`` / ``index_copy_``) or per sequence (under padding
the schedule runs once per sequence: ``[n, m - 1]`` and ``[n, m]``, columns a sequence does not use pointing at the
scratch slot).
"""

from __future__ import annotations

import torch

from kvcompress.core.rope import turn_in_place

# per buffer: kv [n, H, slots + 1, dk + dv], meta [n, slots + 1, 2], score [n, slots + 1] or None (no scores kept)
Buffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# the new token: kv [n, H, 1, dk + dv] (None: each layer writes its own key and value), meta [n, 1, 2], score [n]
New = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def apply_moves(
    buffers: Buffers,
    read: torch.Tensor,
    written: torch.Tensor,
    turn: tuple[torch.Tensor, torch.Tensor] | None,
    select: bool | torch.Tensor,
    tie: str,
    new: New,
) -> None:
    """Apply one step's moves (see the module docstring). ``turn``: cos / sin of each column's turn, ``[m, 1, 1, h]``
    for batch-wide slots, ``[n, 1, m, h]`` per sequence (``None``: keys are not rotated). ``select``: batch-wide,
    whether the last column is a selection; per sequence, a ``[n, m]`` mask of selection columns."""
    if read.dim() == 1:
        _batch_wide(buffers, read, written, turn, bool(select), tie, new)
    else:
        _per_sequence(buffers, read, written, turn, select, tie, new)


def _wins(arriving: torch.Tensor, resident: torch.Tensor, tie: str) -> torch.Tensor:
    return arriving >= resident if tie == "incoming" else arriving > resident


def _batch_wide(buffers: Buffers, read, written, turn, select: bool, tie: str, new: New) -> None:
    kv, meta, score = buffers
    new_kv, new_meta, new_score = new
    batch, heads, scratch, width = kv.shape[0], kv.shape[1], kv.shape[2] - 1, kv.shape[3]
    by_column = kv.permute(2, 0, 1, 3)  # [slots, n, H, dk + dv]: a column's rows are contiguous
    items = by_column.index_select(0, read)  # [m - 1, n, H, dk + dv]
    lead = 0 if new_kv is None else 1  # the kv columns start at the new token or at the first moved one
    if new_kv is not None:
        items = torch.cat([new_kv.permute(2, 0, 1, 3), items], 0)
    if turn is not None:
        turn_in_place(items, turn[0][1 - lead :], turn[1][1 - lead :])
    meta_items = torch.cat([new_meta, meta.index_select(1, read)], 1)  # [n, m, 2]
    score_items = None if score is None else torch.cat([new_score[:, None], score.index_select(1, read)], 1)
    if not select:
        by_column.index_copy_(0, written[1 - lead :], items)
        meta.index_copy_(1, written, meta_items)
        if score_items is not None:
            score.index_copy_(1, written, score_items)
        return
    wins = _wins(score_items[:, -1], score.index_select(1, written[-1:])[:, 0], tie)
    last = torch.where(wins, written[-1], scratch)  # losers write the scratch slot
    slots = torch.cat([written[:-1].expand(batch, -1), last[:, None]], 1)  # [n, m]
    kv_slots = slots[:, 1 - lead :]
    count = kv_slots.shape[1]
    kv.scatter_(2, kv_slots[:, None, :, None].expand(batch, heads, count, width), items.permute(1, 2, 0, 3))
    meta.scatter_(1, slots[:, :, None].expand(batch, -1, 2), meta_items)
    score.scatter_(1, slots, score_items)


def _per_sequence(buffers: Buffers, read, written, turn, select: torch.Tensor, tie: str, new: New) -> None:
    kv, meta, score = buffers
    new_kv, new_meta, new_score = new
    batch, heads, scratch, width = kv.shape[0], kv.shape[1], kv.shape[2] - 1, kv.shape[3]
    moved = read.shape[1]
    items = kv.gather(2, read[:, None, :, None].expand(batch, heads, moved, width))  # [n, H, m - 1, dk + dv]
    items = torch.cat([new_kv.expand(batch, heads, 1, width).to(kv.dtype), items], 2)
    if turn is not None:
        turn_in_place(items, *turn)
    meta_items = torch.cat([new_meta.expand(batch, 1, 2), meta.gather(1, read[:, :, None].expand(-1, -1, 2))], 1)
    if score is not None:
        score_items = torch.cat([new_score[:, None], score.gather(1, read)], 1)
        loses = select & ~_wins(score_items, score.gather(1, written), tie)
        written = torch.where(loses, scratch, written)
    count = written.shape[1]
    kv.scatter_(2, written[:, None, :, None].expand(batch, heads, count, width), items)
    meta.scatter_(1, written[:, :, None].expand(-1, -1, 2), meta_items)
    if score is not None:
        score.scatter_(1, written, score_items)
