"""How many slots a cascade layer allocates: the whole budget, or for one ring, what the tokens seen need."""

from __future__ import annotations

import torch


class RingCapacity:
    """Mixin of ``CascadeLayer``: the slot count, the tables that depend on it, and the growth of a single ring."""

    def _set_capacity(self, slots: int) -> None:
        self.capacity = slots
        self.width = (slots - self.sinks) // self.cascades

    def _build_tables(self) -> None:
        """Ring offsets ``[W]``."""
        self._ring = torch.arange(self.width, device=self.device)

    def _grow(self, needed: int) -> None:
        """One ring (``N = 1``) is allocated for the tokens seen, not the budget, so a short prompt never stores
        more than a full cache: before its first wrap the ring holds its tokens in order from its first slot, so
        growing copies the occupied prefix into a larger buffer (by a quarter at least, up to the budget). With several
        cascades each ring's region is fixed by the budget, so they are allocated whole."""
        if self.cascades != 1 or self.capacity >= self.full_capacity or needed <= self.capacity:
            return
        used = self.capacity
        self._set_capacity(min(self.full_capacity, max(needed, used + max(used // 4, 16))))
        slots = self.capacity + 1  # the last slot is scratch space
        kv = self._kv.new_zeros(*self._kv.shape[:2], slots, self._kv.shape[-1])
        kv[:, :, :used] = self._kv[:, :, :used]
        meta = self._meta.new_zeros(self._meta.shape[0], slots, 2)
        meta[..., 0] = -1
        meta[:, :used] = self._meta[:, :used]
        score = self._score.new_zeros(self._score.shape[0], slots)
        score[:, :used] = self._score[:, :used]
        self._kv, self._meta, self._score = kv, meta, score
        self._build_tables()
