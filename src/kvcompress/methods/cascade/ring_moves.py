"""A decoding step's moves of the old tokens down the rings, for every cascade layer of a cache at once.

The schedule depends only on the token count, so while every layer is in the same in-step state the first cascade
layer of a forward moves the old tokens of all of them (one gather, rotation and scatter per tensor) and each layer
writes its new key and value. The layers' buffers are then views of one buffer per tensor (``ForwardPass.stacked``,
``[L B, ...]``), stacked at the end of the first in-step forward finding them apart, given back when a layer
replaces its buffers.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward import agree
from kvcompress.methods.cascade.executor import apply_moves

STACKED = ("ring-kv", "ring-meta", "ring-score")  # the names of the cascade layers' stacked buffers


def moved_every_ring(layer, step, meta: torch.Tensor) -> bool:
    """Whether the forward's first layer moved every cascade layer's old tokens for ``step``; ``meta`` ``[B, 1, 2]``:
    the new token's slot record."""
    forward, rings = layer.forward_pass, layer.ring_layers
    return forward.cached(("ring-moves", step.before), lambda: _move_all(rings, layer, step, meta))


def _move_all(rings: list, trigger, step, meta: torch.Tensor) -> bool:
    if trigger is not rings[0] or not all(_ready(layer, trigger, step.before) for layer in rings):
        return False
    forward, per_layer = trigger.forward_pass, [(layer._kv, layer._meta, layer._score) for layer in rings]
    joint = [forward.stacked(name, [buffers[i] for buffers in per_layer], make=False) for i, name in enumerate(STACKED)]
    if any(found is None for found in joint):  # not views of one buffer yet: stacked once this forward is over
        forward.at_end("ring-stack", lambda: stack_rings(rings))
        return False
    kv, meta_buffer, score = (buffer for buffer, _ in joint)  # [L B, ...]
    new_meta = meta.expand(len(rings), -1, -1, -1).flatten(0, 1)  # [L B, 1, 2]
    buffers = (kv, meta_buffer, score if trigger.rule.needs_scores else None)
    apply_moves(buffers, step.columns, trigger.rule.config.tie, (None, new_meta, None))
    return True


def stack_rings(rings: list) -> None:
    """Make the cascade layers' buffers views of one buffer per tensor (one copy) where they agree in shape."""
    if not all(layer.is_initialized and layer._kv is not None for layer in rings):
        return
    forward = rings[0].forward_pass
    per_layer = [(layer._kv, layer._meta, layer._score) for layer in rings]
    if not all(agree([buffers[i] for buffers in per_layer]) for i in range(len(STACKED))):
        return
    views = [forward.stacked(name, [buffers[i] for buffers in per_layer])[1] for i, name in enumerate(STACKED)]
    for layer, kv, meta, score in zip(rings, *views, strict=True):
        layer._kv, layer._meta, layer._score = kv, meta, score


def _ready(layer, trigger, state) -> bool:
    """Whether ``layer`` takes this step in the trigger's state (whose counters moved on already)."""
    return (
        layer.is_initialized
        and layer._kv is not None
        and layer._in_step
        and layer._forward_unpadded
        and getattr(layer, "_sliding_window", None) is None
        and (layer is trigger or (layer._pending is None and layer._shared == state))
    )
