"""``StreamRecord``: each sequence's RoPE positions and ranks by stream index, one record for a cache's ragged pools.

A token's RoPE position and its rank among its sequence's real tokens (``-1`` for padding) depend on its sequence
and its stream index only: they are the same in every layer and KV head. So the ragged pools of a cache
(``core.ragged``) store, per slot, its stream index alone, and share one record of ``[B, C]`` positions and ranks
(int32, ``C`` stream indices of room): 8 bytes per sequence and stream index for the whole cache, instead of 8
bytes per stored (layer, head, token) slot.

The record is written once per forward: ``length`` (on the host) is the number of stream indices recorded; the
first pool to register a forward's tokens writes them, and the pools of the later layers find them recorded. A
decoding step (one real token per sequence) writes its column at once: three small writes per step for the whole
cache. The record grows geometrically (one growth step of ``core.capacity``), copying itself once per growth.
"""

from __future__ import annotations

import torch

from kvcompress.core.capacity import headroom

EMPTY = -1
INDEX = torch.int32  # stream indices, positions and ranks: below 2**31


class StreamRecord:
    """Positions and ranks by stream index for ``batch`` sequences (see the module docstring)."""

    def __init__(self, positions: torch.Tensor, rank: torch.Tensor, real_seen: torch.Tensor, length: int) -> None:
        self.positions, self.rank = positions, rank  # [B, C] int32 (EMPTY past ``length``)
        self._real_seen = real_seen  # [B] long: real tokens seen per sequence
        self.length = length  # stream indices recorded (host)

    @classmethod
    def from_slots(
        cls, token_idx: torch.Tensor, rope_pos: torch.Tensor, rank: torch.Tensor, real_seen: torch.Tensor, length: int
    ) -> StreamRecord:
        """The record of a slot layout ``[B, H, W]`` holding stream indices ``0 .. length`` (every occupied slot's
        position and rank written at its stream index; a stream index no slot holds stays ``EMPTY``)."""
        batch = token_idx.shape[0]
        capacity = length + headroom(length)
        positions = torch.full((batch, capacity), EMPTY, dtype=INDEX, device=token_idx.device)
        ranks = positions.clone()
        token = token_idx.reshape(batch, -1)  # every head's slots (a stream index held by several: one value)
        where = torch.where(token >= 0, token, capacity - 1)  # free slots write the last column, reset below
        positions.scatter_(1, where, rope_pos.reshape(batch, -1).to(INDEX))
        ranks.scatter_(1, where, rank.reshape(batch, -1).to(INDEX))
        positions[:, length:] = EMPTY
        ranks[:, length:] = EMPTY
        return cls(positions, ranks, real_seen.clone(), length)

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def real_seen(self) -> torch.Tensor:
        """``[B]`` real tokens seen per sequence."""
        return self._real_seen

    def record(self, first: int, count: int, positions: torch.Tensor | None, real: torch.Tensor | None) -> None:
        """Stream indices ``first .. first + count``: RoPE positions ``[B, count]`` (``None``: the stream indices)
        and realness ``[B, count]`` (``None``: all real). Already recorded (an earlier layer's pool wrote this
        forward): nothing to do."""
        if first + count <= self.length:
            return
        if first != self.length:
            raise ValueError(f"stream index {first}: the record holds {self.length} (a forward was skipped)")
        self.length += count
        if count == 1 and real is None:  # a decoding step: one column, written in place
            if first >= self.positions.shape[1]:
                self._grow(first + 1 + headroom(first + 1))
            if positions is None:
                self.positions[:, first] = first
            else:
                self.positions[:, first : first + 1] = positions
            self.rank[:, first] = self._real_seen
            self._real_seen = self._real_seen + 1
            return
        stream = torch.arange(first, first + count, device=self.device).expand(self.batch, count)
        positions = stream if positions is None else positions.expand(self.batch, count)
        if real is None:
            rank = self._real_seen[:, None] + torch.arange(count, device=self.device)
            self._real_seen = self._real_seen + count
        else:
            rank = torch.where(real, self._real_seen[:, None] + real.long().cumsum(-1) - 1, EMPTY)
            self._real_seen = self._real_seen + real.long().sum(-1)
        self._write(first, positions, rank)

    def move_batch(self, sequences: torch.Tensor) -> None:
        """Hold, as sequence ``i``, a copy of sequence ``sequences[i]``'s record (``RaggedPool.move_batch``)."""
        self.positions, self.rank = self.positions[sequences], self.rank[sequences]
        self._real_seen = self._real_seen[sequences]

    def _write(self, first: int, positions: torch.Tensor, rank: torch.Tensor) -> None:
        stop = first + positions.shape[1]
        if stop > self.positions.shape[1]:
            self._grow(stop + headroom(stop))
        self.positions[:, first:stop] = positions
        self.rank[:, first:stop] = rank

    def _grow(self, capacity: int) -> None:
        def grown(tensor: torch.Tensor) -> torch.Tensor:
            fresh = tensor.new_full((self.batch, capacity), EMPTY)
            fresh[:, : tensor.shape[1]] = tensor
            return fresh

        self.positions, self.rank = grown(self.positions), grown(self.rank)

    def lookup(self, token: torch.Tensor, batch_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and ranks (long) of the stream indices ``token`` of sequences ``batch_of`` (same shape; an
        ``EMPTY`` token gives ``EMPTY``)."""
        held = token >= 0
        where = token.clamp(min=0).long()
        position = self.positions[batch_of, where].long().masked_fill(~held, EMPTY)
        rank = self.rank[batch_of, where].long().masked_fill(~held, EMPTY)
        return position, rank

    def nbytes(self) -> int:
        """Bytes of the recorded stream indices (``length`` of them per sequence)."""
        return self.length * self.batch * (self.positions.element_size() + self.rank.element_size())

    def allocated_nbytes(self) -> int:
        return self.positions.nbytes + self.rank.nbytes
