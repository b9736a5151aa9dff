"""A decoding step's moves of the old tokens down the rings, for every cascade layer of a cache at once
(``moved_every_ring``, by the executor ``executor.apply_moves`` on the layers' stacked buffers).

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
from kvcompress.methods.cascade.executor import apply_moves

STACKED = ("ring-kv", "ring-meta", "ring-score")  # the names of the cascade layers' stacked buffers


def moved_every_ring(layer, step, meta: torch.Tensor) -> bool:
    """Whether the old tokens of every cascade layer of ``layer``'s cache have been moved for this decoding step
    (``ring_decode.Step``; by the first layer of the forward, shared through ``ForwardPass.cached``); ``meta`` the
    new token's slot record ``[B, 1, 2]``."""
    forward, rings = layer.forward_pass, layer.ring_layers
    return forward.cached(("ring-moves", step.before), lambda: _move_all(rings, layer, step, meta))


def _move_all(rings: list, trigger, step, meta: torch.Tensor) -> bool:
    if trigger is not rings[0] or not all(_ready(layer, trigger, step.before) for layer in rings):
        return False
    forward = trigger.forward_pass
    joint = [
        forward.stacked(name, [_buffers(layer)[i] for layer in rings], make=False) for i, name in enumerate(STACKED)
    ]
    if any(found is None for found in joint):  # not views of one buffer yet: stacked once this forward is over
        forward.at_end("ring-stack", lambda: stack_rings(rings))
        return False
    kv, meta_buffer, score = (buffer for buffer, _ in joint)  # [L B, ...]
    new_meta = meta.expand(len(rings), -1, -1, -1).flatten(0, 1)  # [L B, 1, 2]
    buffers = (kv, meta_buffer, score if trigger.rule.needs_scores else None)
    apply_moves(buffers, step.columns, trigger.rule.config.tie, (None, new_meta, None))
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


def _ready(layer, trigger, state) -> bool:
    """Whether ``layer`` will take this decoding step in the same state."""
    return (
        layer.is_initialized
        and layer._kv is not None
        and layer._in_step
        and layer._all_real
        and not layer.force_tensor_path
        and getattr(layer, "_sliding_window", None) is None
        and (layer is trigger or (layer._pending is None and layer._shared == state))
    )  # (the trigger has planned its step from ``state``: its counters moved on already)
