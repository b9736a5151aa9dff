"""The cascade layers of one cache, stored in one joint buffer so that a decoding step moves every layer's tokens
at once.

A decoding step of a full cascade passes old tokens down the rings (ring 0's oldest into ring 1, ...): the same
slots in every layer, since the schedule depends only on the token count. Only the new token's key and value are
per layer. So while every layer is in the same in-step state, the first layer of a forward moves the old tokens of
all layers (one gather, one rotation and one scatter per tensor for the whole model instead of one set per layer) and
writes the new token's slot record; each layer then only writes its new key and value. The layers' buffers are views
of one joint buffer ``[L, B, H_kv, slots, dk + dv]`` (and ``[L, B, slots, 2]``, ``[L, B, slots]``) for this.

Layers of one cache are driven by the model's forward, first layer to last: a layer that decodes while an earlier
layer of the group has not (or a state that differs between layers) makes every layer move its own tokens.
Anything that replaces a layer's buffers (batch reordering, reset) disbands the group for good or until the layers
are initialised again.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward_cache import forward_cached
from kvcompress.core.rope import turn_in_place

Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def shift_chain(buffers, dests: list[int], tables: Tables, select: bool, tie: str, new) -> None:
    """One in-step insertion's moves in one read and one write per tensor.

    ``buffers``: ``kv`` ``[n, H, slots + 1, dk + dv]``, ``meta`` ``[n, slots + 1, 2]``, ``score`` ``[n, slots + 1]``
    or ``None`` (no scores kept), ``n`` sequences (of one layer, or of every layer of a group). Column ``c`` writes
    slot ``dests[c]``: the new token for ``c = 0`` (``new`` = its ``kv`` ``[n, H, 1, dk + dv]`` or ``None`` when each
    layer writes its own, its ``meta`` ``[n, 1, 2]`` and ``score`` ``[n]``), else the token of slot ``dests[c - 1]``.
    ``tables``: slots read, slots written, cos / sin ``[m, 1, 1, d / 2]`` turning each column's key by its move. A
    selection (only ever the last column) writes where the arriving token wins (``tie``: who wins equal scores) and
    into the scratch slot ``slots`` elsewhere."""
    kv, meta, score = buffers
    new_kv, new_meta, new_score = new
    read, written, cos, sin = tables
    batch, heads, scratch, width = kv.shape[0], kv.shape[1], kv.shape[2] - 1, kv.shape[3]
    by_column = kv.permute(2, 0, 1, 3)  # [slots, n, H, dk + dv]: a column's rows are contiguous
    items = by_column.index_select(0, read)  # [m - 1, n, H, dk + dv]
    lead = 0 if new_kv is None else 1  # the kv columns start at the new token or at the first moved one
    if new_kv is not None:
        items = torch.cat([new_kv.permute(2, 0, 1, 3), items], 0)
    if cos is not None:
        turn_in_place(items, cos[1 - lead :], sin[1 - lead :])
    meta_items = torch.cat([new_meta, meta.index_select(1, read)], 1)  # [n, m, 2]
    score_items = None if score is None else torch.cat([new_score[:, None], score.index_select(1, read)], 1)
    if not select:
        by_column.index_copy_(0, written[1 - lead :], items)
        meta.index_copy_(1, written, meta_items)
        if score_items is not None:
            score.index_copy_(1, written, score_items)
        return
    arriving, resident = score_items[:, -1], score[:, dests[-1]]
    wins = arriving >= resident if tie == "incoming" else arriving > resident
    last = torch.where(wins, dests[-1], scratch)  # losers write the scratch slot
    slots = torch.cat([written[:-1].expand(batch, -1), last[:, None]], 1)  # [n, m]
    kv_slots = slots[:, 1 - lead :]
    count = kv_slots.shape[1]
    kv.scatter_(2, kv_slots[:, None, :, None].expand(batch, heads, count, width), items.permute(1, 2, 0, 3))
    meta.scatter_(1, slots[:, :, None].expand(batch, -1, 2), meta_items)
    score.scatter_(1, slots, score_items)


class RingGroup:
    """The cascade layers (``N > 1``) of one cache; see the module docstring."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._joint: tuple[torch.Tensor, ...] | None = None
        self._signature: tuple | None = None
        self._joined: set[int] = set()
        self.generation = 0  # a layer is a member while its ``group_generation`` equals this
        self.broken = False  # some layer's buffers cannot share the joint buffer: every layer on its own

    def buffers(self, layer, kv_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        """``layer``'s ``kv``, ``meta`` and ``score`` buffers: views of the joint buffer, allocated for every layer
        by the first that asks (again after a reset), or ``None`` (the layer allocates its own)."""
        if self.broken:
            return None
        index, signature = self._index[id(layer)], (tuple(kv_shape), dtype, device)
        if self._joint is not None and index not in self._joined and signature != self._signature:
            self.disband(broken=True)  # layers of different shapes, dtypes or devices
            return None
        if self._joint is None or index in self._joined:  # first layer, or initialised again after a reset
            count, (batch, heads, slots, width) = len(self.layers), kv_shape
            kv = torch.zeros(count, batch, heads, slots, width, dtype=dtype, device=device)
            meta = torch.zeros(count, batch, slots, 2, dtype=torch.long, device=device)
            meta[..., 0] = -1
            score = torch.zeros(count, batch, slots, dtype=torch.float32, device=device)
            self._joint, self._signature, self._joined = (kv, meta, score), signature, set()
            self.generation += 1
        self._joined.add(index)
        layer.group_generation = self.generation
        return tuple(buffer[index] for buffer in self._joint)

    def disband(self, broken: bool = False) -> None:
        """Every layer moves its own tokens from now on (its buffers were replaced, or cannot be joined)."""
        self._joint, self._joined = None, set()
        self.generation += 1
        self.broken = self.broken or broken

    def moved(self, layer, state: tuple, dests: list[int], turns: tuple, select: bool, meta, source) -> bool:
        """Whether the old tokens of every layer have been moved for this decoding step (by the first layer of the
        forward; shared through ``forward_cached``): ``state`` = (seen, counts, starts, laps) before the step,
        ``turns`` how far each column's key turns, ``meta`` the new token's slot record ``[B, 1, 2]``."""
        key = ("ring-group-moves", self.generation, state)
        return forward_cached(source, key, lambda: self._move_all(layer, state, dests, turns, select, meta, source))

    def _move_all(self, trigger, state: tuple, dests: list[int], turns: tuple, select: bool, meta, source) -> bool:
        if self._joint is None or trigger is not self.layers[0] or len(self._joined) != len(self.layers):
            return False
        if not all(self._ready(layer, trigger, state) for layer in self.layers):
            return False
        kv, meta_buffer, score = (buffer.flatten(0, 1) for buffer in self._joint)  # [L B, ...]
        count = kv.shape[0]
        new_meta = meta.expand(len(self.layers), -1, -1, -1).flatten(0, 1)  # [L B, 1, 2]
        keeps_scores = trigger.rule.needs_scores
        if len(dests) == 1:  # a sink or an append: only the new token's record
            meta_buffer[:, dests[0]] = new_meta[:, 0]
            if keeps_scores:
                score[:, dests[0]] = 0.0
            return True
        tables = trigger._shared_move_tables(dests, turns, source)
        new = (None, new_meta, score.new_zeros(count) if keeps_scores else None)
        buffers = (kv, meta_buffer, score if keeps_scores else None)
        shift_chain(buffers, dests, tables, select, trigger.rule.config.tie, new)
        return True

    def _ready(self, layer, trigger, state: tuple) -> bool:
        """Whether ``layer`` will take this decoding step in the same state, on the joint buffer."""
        return (
            getattr(layer, "group_generation", None) == self.generation
            and layer._in_step
            and layer._all_real
            and not layer.force_tensor_path
            and getattr(layer, "_sliding_window", None) is None
            and (layer is trigger or (layer._pending is None and _state(layer) == state))
        )  # (the trigger has planned its step from ``state``: its counters moved on already)


def _state(layer) -> tuple:
    laps = None if layer._laps is None else tuple(layer._laps)
    return layer._py_seen, tuple(layer._py_count), tuple(layer._py_start), laps
