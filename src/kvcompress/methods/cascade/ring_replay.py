"""The circular sink cache's decoding step in a replayable form (``kvcompress.decode_graph``).

A replayed step (a CUDA graph) runs fixed kernels with every Python number baked in. The in-step decoding step of
one ring (``RingDecode._decode_circular``) takes three numbers that change every step from Python integers: the
new token's real-token index (its key's angle and the query's), the slot it overwrites (sinks + the ring's start)
and the sinks' frame ``F``. Once the ring is full and has overwritten a token, every step is the same operations
with those three numbers; bound to a graph (``bind_replay_buffers``) the layer keeps the index and the start on the
device too and this step reads them there. The layout (``schedule.Rings``) advances by the schedule's step as in the
eager step, and after each replay ``replayed_python_step`` takes that step (``DecodeGraph`` adds the whole-number
changes it observed, the sinks' frame).
"""

from __future__ import annotations

import torch

from kvcompress.core.rotation import frame_rotation_at, rotation_to_tensor, turn
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.methods.cascade.schedule import advance


class CircularReplay:
    """Mixin of ``CircularSinkLayer`` (before ``CascadeLayer``): its ``SlotReplay`` methods."""

    replay_managed = ("_replay_seen",)  # advanced by ``replayed_python_step`` (with the layout ``_rings``)

    def replay_steady(self) -> bool:
        return (
            self.is_initialized
            and self._in_step
            and self._all_real
            and not self.force_tensor_path
            and self.inv_freq is not None
            and self._pending is None
            and getattr(self, "_sliding_window", None) is None
            and self._shared.count[0] == self.width
            and self._shared.seen >= self.sinks
            and self._sinks_full
        )

    def bind_replay_buffers(self) -> None:
        if not self._replay_bound():
            self.seen_tensor = torch.tensor(self._shared.seen, device=self.device)  # the next token's real index
            self.start_tensor = torch.tensor(self._shared.start[0], device=self.device)
            self._replay_seen = self._shared.seen

    def _replay_bound(self) -> bool:
        """Whether the device counters hold the ring's state: only the replayable step moved it since they were
        made (any other path, a prompt chunk say, advances the layout alone; the counters are then dropped)."""
        if self.seen_tensor is not None and self._replay_seen != self._shared.seen:
            self.seen_tensor = None
        return self.seen_tensor is not None

    def replay_state(self) -> tuple:
        bound = self._replay_bound()  # False after another path moved the ring (the captured step is then stale)
        return (self._kv, self.capacity, self._in_step, self._all_real, self._shared.count[0], bound, self.seen_tensor)

    def replayed_python_step(self) -> None:
        self._set_shared(advance(self._layout, self._shared)[0])  # the schedule's step, as the eager step takes it
        self._replay_seen += 1

    def _decode_circular_replayable(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """``_decode_circular`` of a full ring with the per-step numbers read on the device: attend with the new
        token in the scratch slot, copy it over the oldest ring token, rewrite the sinks at the next frame."""
        sinks, width, spare, dim = self.sinks, self.width, self.capacity, self._key_dim
        seen, source = self.seen_tensor, pending.source
        key = ("replay-rotation", self.inv_freq.data_ptr(), dim, pending.keys.dtype)
        rotation = self.forward_pass.cached(key, lambda: rotation_to_tensor(source, seen, self.inv_freq, dim, key[-1]))
        self._kv[:, :, spare : spare + 1, :dim] = turn(pending.keys, rotation)
        self._kv[:, :, spare : spare + 1, dim:] = pending.values
        if query.dtype != pending.keys.dtype:
            rotation = rotation_to_tensor(source, seen, self.inv_freq, dim, query.dtype)
        q_heads, kv_heads = query.shape[1], self._kv.shape[1]
        stored = self._kv[:, :, : spare + 1]
        output = scaled_dot_product_attention(
            turn(query, rotation), stored[..., :dim], stored[..., dim:], scale=scale, enable_gqa=q_heads != kv_heads
        )
        dest = (self.start_tensor + sinks).view(1)
        self._kv.index_copy_(2, dest, self._kv[:, :, spare : spare + 1])
        self._meta.index_copy_(1, dest, torch.stack([seen.expand_as(pending.pos), pending.pos], -1))
        self.start_tensor.add_(1).remainder_(width)
        seen.add_(1)
        self._set_shared(advance(self._layout, self._shared)[0])
        self._replay_seen += 1
        if sinks:  # the next frame: F = real tokens seen - sinks - width
            frame = self.forward_pass.cached(
                ("replay-frame", self.inv_freq.data_ptr(), dim, self.dtype),
                lambda: frame_rotation_at(seen - (sinks + width), self.inv_freq, dim, self.dtype),
            )
            self._kv[:, :, :sinks, :dim].copy_(self._sink_keys @ frame)
        return output
