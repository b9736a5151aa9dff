"""The slot buffers of one cache layer: keys, values and per-slot bookkeeping, written in place.

A slot holds one token of one sequence and KV head. Writes go to a range of slots (a dense layer appends) or to
given slots (a holed layer refills the victims'); freeing marks slots; ``compact`` gathers the occupied slots to the
front in stream order; ``grow``/``shrink`` reallocate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

FREE = -1


@dataclass
class StreamView:
    """A layer's stored tokens in stream order (``[B, H_kv, L, ...]``), for inspection."""

    keys: torch.Tensor
    values: torch.Tensor
    token_idx: torch.Tensor
    rope_pos: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    state: dict[str, torch.Tensor]


class SlotBuffers:
    """Keys ``[B, H, C, d]``, values, and per slot (``[B, H, C]``): ``token_idx`` (the token's stream index, padding
    included; ``FREE``), ``rope_pos`` (the ``position_ids`` its key was rotated with), ``rank`` (among its
    sequence's real tokens; ``FREE`` for padding), ``valid`` (a real token) and the method's state ``[B, H, C, ...]``;
    ``real_seen`` ``[B]`` counts each sequence's real tokens. ``key_heads`` ``[K]``: the KV heads whose keys are
    stored (PoD's), keys then ``[B, K, C, d]``, written by ranges only; ``None``: every head's."""

    writes_kv = True  # the writes store the keys and values given (False: a subclass stores them its own way)

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        real_seen: torch.Tensor,
        key_heads: torch.Tensor | None = None,
    ):
        self.tensors = tensors
        self.state = state
        self.real_seen = real_seen
        self.key_heads = key_heads
        # writes a decoding step defers until something reads them (each one op per layer and step):
        self._real_lag = 0  # real tokens written but not yet added to ``real_seen``
        self._default_rope: tuple[torch.Tensor, int] | None = None  # slots whose RoPE position is their stream index
        self._rank_is_token = False  # no padding stored: every rank equals its token index (written when read)

    @property
    def real_seen(self) -> torch.Tensor:
        if self._real_lag:
            self._real_seen += self._real_lag
            self._real_lag = 0
        return self._real_seen

    @real_seen.setter
    def real_seen(self, value: torch.Tensor) -> None:
        self._real_seen, self._real_lag = value, 0

    def add_real(self, count: int) -> None:
        """``count`` more real tokens than ``real_seen`` holds (written by replayed steps)."""
        self._real_lag += count

    @property
    def rope_pos(self) -> torch.Tensor:
        self._write_default_rope()
        return self.tensors["rope_pos"]

    @property
    def rank(self) -> torch.Tensor:
        self._write_lagging_rank()
        return self.tensors["rank"]

    def _write_lagging_rank(self) -> None:
        """Write the ranks a layer without padding skipped: its stream index (``FREE`` in a free slot in both)."""
        if self._rank_is_token:
            self._rank_is_token = False
            self.tensors["rank"].copy_(self.tensors["token_idx"])

    def _write_default_rope(self) -> None:
        """Write a deferred RoPE position (a reused slot's stream index, unless ``register`` gave the model's)."""
        if self._default_rope is not None:
            slots, seen = self._default_rope
            self._default_rope = None
            self.tensors["rope_pos"].scatter_(2, slots, _per_slot(seen, slots))

    @classmethod
    def empty(cls, key_states: torch.Tensor, value_states: torch.Tensor) -> SlotBuffers:
        batch, heads = key_states.shape[:2]
        long = {"dtype": torch.long, "device": key_states.device}
        tensors = {
            "keys": key_states.new_empty(batch, heads, 0, key_states.shape[-1]),
            "values": value_states.new_empty(batch, heads, 0, value_states.shape[-1]),
            **{name: torch.empty(batch, heads, 0, **long) for name in ("token_idx", "rope_pos", "rank")},
            "valid": torch.empty(batch, heads, 0, dtype=torch.bool, device=key_states.device),
        }
        return cls(tensors, {}, torch.zeros(batch, **long))

    keys = property(lambda self: self.tensors["keys"])
    values = property(lambda self: self.tensors["values"])
    token_idx = property(lambda self: self.tensors["token_idx"])
    valid = property(lambda self: self.tensors["valid"])

    @property
    def capacity(self) -> int:
        return self.tensors["keys"].shape[2]

    def _all(self) -> dict[str, torch.Tensor]:
        self._write_default_rope()
        self._write_lagging_rank()
        return {**self.tensors, **{f"state.{name}": value for name, value in self.state.items()}}

    def _put_all(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: value for name, value in tensors.items() if not name.startswith("state.")}
        self.state = {name[6:]: value for name, value in tensors.items() if name.startswith("state.")}

    def resize(self, capacity: int, keep: int) -> None:
        """Reallocate every buffer with ``capacity`` slots, keeping the first ``keep`` (the rest is free)."""
        resized = {}
        for name, tensor in self._all().items():
            fill = FREE if name in ("token_idx", "rank") else 0
            resized[name] = tensor.new_full((*tensor.shape[:2], capacity, *tensor.shape[3:]), fill)
            if keep:
                resized[name][:, :, :keep] = tensor[:, :, :keep]
        self._put_all(resized)

    def grow(self, capacity: int) -> None:
        self.resize(capacity, self.capacity)

    def shrink(self, capacity: int) -> None:
        if capacity < self.capacity:
            self.resize(capacity, capacity)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (select, repeat) to every buffer."""
        self._put_all({name: fn(tensor) for name, tensor in self._all().items()})
        self.real_seen = fn(self.real_seen)

    def _new_state(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name not in self.state:
            self.state[name] = value.new_zeros(*value.shape[:2], self.capacity, *value.shape[3:])
        return self.state[name]

    def write_range(
        self,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        seen: int | torch.Tensor,
        state: dict[str, torch.Tensor],
        no_padding: bool = False,
    ) -> None:
        """Write ``q`` new real tokens (stream indices ``seen ..``) into slots ``start .. start + q``. ``no_padding``:
        the layer never stored padding (one token's bookkeeping written as scalars, its rank left lagging)."""
        count = keys.shape[2]
        stop = start + count
        if self.writes_kv:
            self.keys[:, :, start:stop] = keys
            self.values[:, :, start:stop] = values
        if count == 1 and no_padding:
            self.token_idx[:, :, start].fill_(seen)
            self.rope_pos[:, :, start].fill_(seen)
            self.valid[:, :, start].fill_(True)
            self._rank_is_token = True
        else:
            index = stream_range(seen, count, keys.device)
            self.token_idx[:, :, start:stop] = index
            self.rope_pos[:, :, start:stop] = index
            self.valid[:, :, start:stop] = True
            self.rank[:, :, start:stop] = self.real_seen[:, None, None] + torch.arange(count, device=keys.device)
        self._real_lag += count
        for name, value in state.items():
            self._new_state(name, value)[:, :, start:stop] = value

    def write_at(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        seen: int | torch.Tensor,
        state: dict[str, torch.Tensor],
        reused_real: bool = False,
    ) -> None:
        """Write ``q`` new real tokens into ``slots`` ``[B, H, q]``. ``reused_real``: one token per row into slots
        still holding an evicted real token, in a layer that never stored padding (validity and rank left as they
        are, the RoPE position deferred)."""
        count = keys.shape[2]
        if self.writes_kv:
            rows = slots[..., None].expand_as(keys)
            self.keys.scatter_(2, rows, keys)
            self.values.scatter_(2, rows if values.shape == keys.shape else slots[..., None].expand_as(values), values)
        if reused_real and count == 1:
            self.token_idx.scatter_(2, slots, _per_slot(seen, slots))
            self._write_default_rope()  # the previous step's, if any, first
            self._default_rope = (slots, seen)  # ``register`` writes the model's position instead
            self._rank_is_token = True
        else:
            index = stream_range(seen, count, keys.device).expand_as(slots)
            self.token_idx.scatter_(2, slots, index)
            self.rope_pos.scatter_(2, slots, index)
            self.valid.scatter_(2, slots, True)
            ranks = self.real_seen[:, None, None] + torch.arange(count, device=keys.device)
            self.rank.scatter_(2, slots, ranks.expand_as(slots))
        self._real_lag += count
        for name, value in state.items():
            target = self._new_state(name, value)
            per_slot = slots if value.dim() == 3 else slots.view(*slots.shape, *[1] * (value.dim() - 3))
            target.scatter_(2, per_slot.expand_as(value), value)

    def register(self, slots: torch.Tensor | int, positions: torch.Tensor | None, real: torch.Tensor | None) -> None:
        """Record the RoPE positions ``[B, q]`` and realness ``[B, q]`` of the tokens just written to ``slots``
        (an integer: one real token written to that slot of every row)."""
        if isinstance(slots, int):
            if positions is not None:
                self.rope_pos[:, :, slots].copy_(positions.view(-1, 1))
            return
        shape = slots.shape
        if positions is not None:
            if self._default_rope is not None and self._default_rope[0] is slots:
                self._default_rope = None
            self.rope_pos.scatter_(2, slots, positions.view(-1, 1, shape[-1]).expand(shape))
        if real is not None:
            self.real_seen -= shape[-1]
            rank = self.real_seen[:, None] + real.long().cumsum(-1) - 1
            self.real_seen += real.long().sum(-1)
            self.valid.scatter_(2, slots, real[:, None, :].expand(shape))
            self.rank.scatter_(2, slots, torch.where(real, rank, FREE)[:, None, :].expand(shape))

    def free_at(self, slots: torch.Tensor) -> None:
        self.token_idx.scatter_(2, slots, FREE)
        self.rank.scatter_(2, slots, FREE)
        self.valid.scatter_(2, slots, False)

    def free_mask(self, dropped: torch.Tensor, width: int) -> None:
        self.token_idx[:, :, :width].masked_fill_(dropped, FREE)
        self.rank[:, :, :width].masked_fill_(dropped, FREE)
        self.valid[:, :, :width].masked_fill_(dropped, False)

    def compact(self, width: int, ordered: bool, shrink: bool, used: int | None = None) -> tuple[int, bool]:
        """Move the occupied slots of ``[0, width)`` to the front in stream order; returns the slots now in use
        (the most of any row) and whether rows hold different counts. ``used``: every row holds that many (known: no
        host read). ``shrink``: give back the room beyond one slot."""
        token_idx = self.token_idx[:, :, :width]
        occupied = token_idx >= 0
        ragged = False
        if used is None:
            counts = occupied.sum(-1)
            used = int(counts.max()) if counts.numel() else 0
            ragged = bool((counts != used).any())
        if ordered:
            position = torch.arange(width, device=token_idx.device)
            key = torch.where(occupied, position, width + position)
        else:
            key = torch.where(occupied, token_idx, token_idx.new_tensor(torch.iinfo(torch.long).max))
        order = key.argsort(dim=-1, stable=True)[..., :used]
        if shrink and used + 1 < self.capacity:  # gathered straight into new buffers of that size
            old = self._all()
            self.resize(used + 1, 0)
            for name, tensor in self._all().items():
                self._gathered(old[name], name, order, width, out=tensor[:, :, :used])
            return used, ragged
        for name, tensor in self._all().items():
            tensor[:, :, :used] = self._gathered(tensor, name, order, width)
        self.token_idx[:, :, used:] = FREE
        self.rank[:, :, used:] = FREE
        self.valid[:, :, used:] = False
        return used, ragged

    def stream_view(self, width: int) -> StreamView:
        token_idx = self.token_idx[:, :, :width]
        key = torch.where(token_idx >= 0, token_idx, token_idx.new_tensor(torch.iinfo(torch.long).max))
        order = key.argsort(dim=-1)[..., : int((token_idx >= 0).sum(-1).max()) if width else 0]
        gathered = {name: self._gathered(tensor, name, order, width) for name, tensor in self._all().items()}
        named = {name: tensor for name, tensor in gathered.items() if not name.startswith("state.")}
        return StreamView(**named, state={name: gathered[f"state.{name}"] for name in self.state})

    def _gathered(self, tensor: torch.Tensor, name: str, order: torch.Tensor, width: int, out=None) -> torch.Tensor:
        """The slots ``order`` ``[B, H, n]`` of ``tensor``'s first ``width`` (the key heads' rows for keys)."""
        index = order if name != "keys" or self.key_heads is None else order.index_select(1, self.key_heads)
        index = index.view(*index.shape, *[1] * (tensor.dim() - 3)).expand(*index.shape, *tensor.shape[3:])
        if out is not None and tensor.requires_grad:  # a cache recorded for a backward pass: ``out=`` records nothing
            return out.copy_(tensor[:, :, :width].gather(2, index))
        return torch.gather(tensor[:, :, :width], 2, index, out=out)

    @staticmethod
    def _bytes_per_slot(tensor: torch.Tensor) -> int:
        return tensor.shape[0] * tensor.shape[1] * math.prod(tensor.shape[3:]) * tensor.element_size()

    def kv_bytes_per_slot(self) -> int:
        return self._bytes_per_slot(self.keys) + self._bytes_per_slot(self.values)

    def metadata_bytes_per_slot(self) -> int:
        tensors = [self.token_idx, self.rope_pos, self.rank, self.valid, *self.state.values()]
        return sum(self._bytes_per_slot(t) for t in tensors)


def _per_slot(seen: int | torch.Tensor, slots: torch.Tensor) -> int | torch.Tensor:
    """A stream index (an int, or a device scalar: ``layer.seen_step``) to scatter into ``slots``."""
    return seen if isinstance(seen, int) else seen.expand_as(slots)


def stream_range(
    seen: int | torch.Tensor, count: int, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Stream indices ``seen .. seen + count`` (``seen``: an int, or a device scalar: ``layer.seen_step``)."""
    if isinstance(seen, int):
        return torch.arange(seen, seen + count, dtype=dtype, device=device)
    return (seen + torch.arange(count, device=device)).to(dtype)
