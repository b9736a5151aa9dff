"""A decoding step's moves of the old tokens down the rings: one layer's (``shift_chain``), or every cascade layer's
of a cache at once (``moved_every_ring``).

A decoding step of a full cascade passes old tokens down the rings (ring 0's oldest into ring 1, ...): the same
slots in every layer, since the schedule depends only on the token count. Only the new token's key and value are
per layer. So while every layer is in the same in-step state, the first cascade layer of a forward moves the old
tokens of all of them (one gather, one rotation and one scatter per tensor for the whole model instead of one set
per layer) and writes the new token's slot record; each layer then only writes its new key and value. For this the
layers' buffers are views of one buffer per tensor (``ForwardPass.stacked``: ``[L B, H_kv, slots, dk + dv]``,
``[L B, slots, 2]``, ``[L B, slots]``), stacked with one copy at the end of the first in-step forward that finds
them apart (after a reset, a reordered batch or the prompt) and given back whole when a layer replaces its buffers.

Layers of one cache are driven by the model's forward, first layer to last: a layer that decodes while an earlier
layer has not (or a state that differs between layers) makes every layer move its own tokens.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward import agree
from kvcompress.core.rope import turn_in_place

STACKED = ("ring-kv", "ring-meta", "ring-score")  # the names of the cascade layers' stacked buffers

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


def moved_every_ring(layer, state: tuple, dests: list[int], turns: tuple, select: bool, meta) -> bool:
    """Whether the old tokens of every cascade layer of ``layer``'s cache have been moved for this decoding step
    (by the first layer of the forward; shared through ``ForwardPass.cached``): ``state`` = (seen, counts, starts,
    laps) before the step, ``turns`` how far each column's key turns, ``meta`` the new token's slot record
    ``[B, 1, 2]``."""
    forward, rings = layer.forward_pass, layer.ring_layers
    return forward.cached(("ring-moves", state), lambda: _move_all(rings, layer, state, dests, turns, select, meta))


def _move_all(rings: list, trigger, state: tuple, dests: list[int], turns: tuple, select: bool, meta) -> bool:
    if trigger is not rings[0] or not all(_ready(layer, trigger, state) for layer in rings):
        return False
    forward = trigger.forward_pass
    joint = [
        forward.stacked(name, [_buffers(layer)[i] for layer in rings], make=False) for i, name in enumerate(STACKED)
    ]
    if any(found is None for found in joint):  # not views of one buffer yet: stacked once this forward is over
        forward.at_end("ring-stack", lambda: stack_rings(rings))
        return False
    kv, meta_buffer, score = (buffer for buffer, _ in joint)  # [L B, ...]
    count = kv.shape[0]
    new_meta = meta.expand(len(rings), -1, -1, -1).flatten(0, 1)  # [L B, 1, 2]
    keeps_scores = trigger.rule.needs_scores
    if len(dests) == 1:  # a sink or an append: only the new token's record
        meta_buffer[:, dests[0]] = new_meta[:, 0]
        if keeps_scores:
            score[:, dests[0]] = 0.0
        return True
    tables = trigger._shared_move_tables(dests, turns)
    new = (None, new_meta, score.new_zeros(count) if keeps_scores else None)
    buffers = (kv, meta_buffer, score if keeps_scores else None)
    shift_chain(buffers, dests, tables, select, trigger.rule.config.tie, new)
    return True


def stack_rings(rings: list) -> None:
    """Make the cascade layers' buffers views of one buffer per tensor (one copy), where they agree in shape."""
    if not all(layer.is_initialized and layer._kv is not None for layer in rings):
        return
    forward = rings[0].forward_pass
    per_layer = [_buffers(layer) for layer in rings]
    if not all(agree([buffers[i] for buffers in per_layer]) for i in range(len(STACKED))):
        return
    views = [forward.stacked(name, [buffers[i] for buffers in per_layer])[1] for i, name in enumerate(STACKED)]
    for layer, kv, meta, score in zip(rings, *views, strict=True):
        layer._kv, layer._meta, layer._score = kv, meta, score


def _buffers(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer._kv, layer._meta, layer._score


def _ready(layer, trigger, state: tuple) -> bool:
    """Whether ``layer`` will take this decoding step in the same state."""
    return (
        layer.is_initialized
        and layer._kv is not None
        and layer._in_step
        and layer._all_real
        and not layer.force_tensor_path
        and getattr(layer, "_sliding_window", None) is None
        and (layer is trigger or (layer._pending is None and _state(layer) == state))
    )  # (the trigger has planned its step from ``state``: its counters moved on already)


def _state(layer) -> tuple:
    laps = None if layer._laps is None else tuple(layer._laps)
    return layer._py_seen, tuple(layer._py_count), tuple(layer._py_start), laps
