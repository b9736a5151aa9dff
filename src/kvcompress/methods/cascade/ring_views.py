"""Stream-order views of the cascade storage (the ``CompressedLayer`` contract), batch operations and accounting."""

from __future__ import annotations

import torch

from kvcompress.core.forward import from_host
from kvcompress.core.rope import rotate_by
from kvcompress.core.slots import StreamView
from kvcompress.methods.cascade.ring_moves import STACKED
from kvcompress.methods.cascade.schedule import ranks, slot_angle


class RingViews:
    """Mixin of ``CascadeLayer``: keys, values, positions and validity in stream order (copies; the empty slots
    first), batch operations, bytes."""

    def _slot_numbers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's rank among the stored tokens (``-1``: empty) and its key's angle, ``[B, slots]``."""
        slots, layout = self.capacity, self._layout
        values = [ranks(layout, r)[:slots] + [slot_angle(layout, r, s) for s in range(slots)] for r in self._rows()]
        table = from_host(values, self.device).expand(len(self._rings), -1)
        return table[:, :slots], table[:, slots:]

    def _order(self) -> torch.Tensor:
        return self._tok.argsort(dim=1, stable=True)  # empty slots (-1) first, then stream order

    def _view(self, slot_values: torch.Tensor) -> torch.Tensor:
        """A per-slot ``[B, S + |C|]`` tensor in stream order, expanded to ``[B, H_kv, S + |C|]``."""
        return slot_values.gather(1, self._order())[:, None].expand(-1, self._kv.shape[1], -1)

    def _gathered(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return rows.gather(2, order[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[-1]))

    def _drop(self, value: None) -> None:
        if value is not None:
            raise AttributeError("a cascade layer's keys and values are read-only views of its slot buffer")
        self._leave_group()
        self._kv = None

    def _keys(self) -> torch.Tensor | None:
        """Stored keys rotated at ``rope_pos`` as the model wrote them."""
        if self._kv is None:
            return None
        order = self._order()
        keys = self._gathered(self._k, order)
        if self.inv_freq is None:
            return keys
        turn = (self._pos - self._slot_numbers()[1]).gather(1, order)  # from the stored angle to the model's position
        return rotate_by(keys, turn[:, None], self.inv_freq, exact=True)

    keys = property(_keys, _drop)
    values = property(lambda self: None if self._kv is None else self._gathered(self._v, self._order()), _drop)
    valid = property(lambda self: self._view(self._tok >= 0))
    rope_pos = property(lambda self: self._view(torch.where(self._tok >= 0, self._pos, 0)))
    state = property(lambda self: {"score": self._view(self._score[:, : self.capacity])})
    rows = property(lambda self: (self._tok.shape[0], self._kv.shape[1]))
    # every slot of the sinks and rings (the views hold the free ones too, ``token_idx`` -1)
    view_width = property(lambda self: self._tok.shape[1] if self.is_initialized else 0)

    @property
    def rank(self) -> torch.Tensor:
        """Each real token's rank among the stored real tokens of its sequence (``-1``: no token)."""
        valid = self.valid
        return torch.where(valid, valid.cumsum(-1) - 1, -1)

    @property
    def token_idx(self) -> torch.Tensor:
        """Stream indices in stream order; the ``E`` empty slots come first, numbered ``-E .. -1``."""
        ordered = self._tok.gather(1, self._order())
        empty = ordered < 0
        filler = torch.arange(ordered.shape[1], device=self.device) - empty.sum(1, keepdim=True)
        return torch.where(empty, filler, ordered)[:, None].expand(-1, self._kv.shape[1], -1)

    @property
    def occupied(self) -> int:
        """Slots holding a token, the most of any row (a host read; the rings never read it)."""
        return self.stored_length()

    @occupied.setter
    def occupied(self, value: int) -> None:
        """(The generic layer's initialisation and reset write 0 here: nothing to keep.)"""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view_width + query_length, 0  # (the mask is built from the slots: any size, no host read)

    def cascade_tokens(self) -> list[list[list[int]]]:
        """Per sequence, per cascade: the stream indices it holds, oldest first (sinks not included)."""
        tok, width = self._tok.tolist(), self.width
        return [
            [
                [tok[b][self.sinks + i * width + (start + r) % width] for r in range(count)]
                for i, (count, start) in enumerate(zip(rings.count, rings.start, strict=True))
            ]
            for b, rings in enumerate(self._rings)
        ]

    def kept(self) -> StreamView:
        return StreamView(self.keys, self.values, self.token_idx, self.rope_pos, self.valid, self.rank, self.state)

    # --- transformers' layer API -----------------------------------------------------------------------------
    def stored_length(self) -> int:
        """Occupied slots of the fullest sequence (a host read: for accounting, not the decoding path)."""
        return int((self._tok >= 0).sum(-1).max()) if self.is_initialized else 0

    def reset(self) -> None:
        self._drop(None)
        self._pending = None
        self.is_initialized = False
        self.seen = self.new_tokens = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reorder(indices.tolist(), lambda tensor: tensor.index_select(0, indices.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = [row for row in range(len(self._rings)) for _ in range(repeats)] if self.is_initialized else []
        self._reorder(rows, lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def _reorder(self, rows: list[int], reorder) -> None:
        """The sequences ``rows`` (a reordered or repeated batch): the schedule runs once per sequence from now on."""
        if not self.is_initialized:
            return
        self._leave_step()
        self._leave_group()
        self._rings = [self._rings[row] for row in rows]  # (``indices`` read on the host: one read per reorder)
        for name in ("_kv", "_meta", "_score", "_sink_keys"):
            setattr(self, name, reorder(getattr(self, name)))

    def _leave_group(self) -> None:
        """This layer's buffers are about to be replaced: the stacked buffer of the cache's cascade layers goes
        (``ring_moves``: stacked again at the next decoding step that finds them apart)."""
        if self.ring_layers is not None:
            for name in STACKED:
                self.forward_pass.unstack(name)

    # --- accounting (the scratch slot excluded from the keys and values) --------------------------------------
    def kv_nbytes(self) -> int:
        """Bytes of the stored tokens' keys and values (occupied slots of the fullest sequence)."""
        return self.allocated_nbytes() * self.stored_length() // self.capacity if self.is_initialized else 0

    def allocated_nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes if self.is_initialized else 0

    def metadata_nbytes(self) -> int:
        """Per slot the stream index, RoPE position and EMA; per sequence the rings' counts and starts, the sinks
        stored and the real tokens seen (int64). Held whole: ``allocated_metadata_nbytes`` is the same."""
        if not self.is_initialized:
            return 0
        return self._meta.nbytes + self._score.nbytes + len(self._rings) * (2 * self.cascades + 2) * 8

    def allocated_metadata_nbytes(self) -> int:
        return self.metadata_nbytes()
