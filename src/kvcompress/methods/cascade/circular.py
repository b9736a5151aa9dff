"""``streaming`` in ``cache`` position mode on the cascade storage with one cascade: the circular sink cache.

Its decoding step attends before inserting and can be replayed (``kvcompress.decode_graph``): once the ring is full
a step changes three numbers, the new token's real-token index, the slot it overwrites and the sinks' frame ``F``;
bound to a captured step (``core.replay.ReplayBinding``) the layer keeps the first on the device (the others follow
from it) and advances it there; ``sync_replayed`` sets the Python integers from it when the graph is left.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import Policy
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.rotation import frame_rotation_at, rotation_to, turn
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.methods.cascade.config import CascadeConfig
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.quantized import QuantizedRings
from kvcompress.methods.cascade.schedule import Rings, advance


class CircularSinkLayer(CascadeLayer):
    """Sinks plus one ring of ``budget - sinks`` slots, no scores. ``streaming`` evicts *after* attending, so every
    forward runs as the cascade's chunked prefill: attend to the frozen ring and causally inside the forward (ranks
    ``stored, stored + 1, ...``), then insert: the generic ``streaming`` layer's attention set, order and positions,
    up to float rounding."""

    attend_first = True
    # the ring cannot drop tokens by age: on a model's sliding-window layers the generic streaming layer runs instead
    sliding_layer_class = CompressedLayer

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        config = policy.config
        ring = CascadeConfig(budget=config.budget, sinks=config.sinks, cascades=1, prefill="chunked")
        super().__init__(policy, inv_freq, rule=ring.policy(policy.layer_idx))

    def _decode_circular(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """One token of a batch in step: the new token goes to a spare slot (its own while the ring fills, else the
        scratch slot), the query attends to the occupied prefix with one SDPA (one frame: key and query at the
        real-token index ``p``, turned by one rotation), then the token is copied over the oldest ring token. Bound
        to a captured step the ring is full and ``p`` is read on the device."""
        bound, dim, forward = self.seen_tensor is not None, self._key_dim, self.forward_pass
        after, moves = advance(self._layout, self._shared)
        if bound:
            seen, spare = self.seen_tensor, self.capacity
            dest = ((seen - self.sinks).remainder(self.width) + self.sinks).view(1)  # the full ring's oldest token
            tag = ("replay-rotation", self.inv_freq.data_ptr(), dim)
            build = lambda dtype: rotation_to(pending.source, (seen,), self.inv_freq, dim, dtype)  # noqa: E731
            rotation = lambda dtype: forward.cached((*tag, dtype), lambda: build(dtype))  # noqa: E731
        else:
            seen, dest = self._shared.seen, moves.dests[0]  # a sink, an append or the oldest ring token's slot
            spare = self.capacity if self._shared.count[0] == self._layout.width else dest  # (full: the scratch slot)
            rotation = lambda dtype: self._rotation(pending, (seen,), dim, dtype)  # noqa: E731
        self._kv[:, :, spare : spare + 1, :dim] = turn(pending.keys, rotation(pending.keys.dtype))  # (no out=: graphs)
        self._kv[:, :, spare : spare + 1, dim:] = pending.values
        stored = self._kv[:, :, : spare + 1]
        query, gqa = turn(query, rotation(query.dtype)), query.shape[1] != stored.shape[1]
        output = scaled_dot_product_attention(query, stored[..., :dim], stored[..., dim:], scale=scale, enable_gqa=gqa)
        rings = self._rings
        self._set_shared(after)
        if not bound:
            if dest != spare:
                self._kv[:, :, dest] = self._kv[:, :, spare]
            self._meta[:, dest] = self._shared_meta(pending)[:, 0]
            self._sync_sinks(rings)
            return output
        self._kv.index_copy_(2, dest, self._kv[:, :, spare : spare + 1])
        self._meta.index_copy_(1, dest, torch.stack([seen.expand_as(pending.pos), pending.pos], -1))
        seen.add_(1)
        if self.sinks:  # the next frame: F = real tokens seen - sinks - width
            frame = forward.cached(
                ("replay-frame", self.inv_freq.data_ptr(), dim, self.dtype),
                lambda: frame_rotation_at(seen - (self.sinks + self.width), self.inv_freq, dim, self.dtype),
            )
            self._kv[:, :, : self.sinks, :dim].copy_(self._sink_keys @ frame)
        return output

    # --- replay (``kvcompress.decode_graph``) ---------------------------------------------------------------------

    def replay_steady(self) -> bool:
        return (
            self.is_initialized
            and self._in_step
            and self._forward_unpadded
            and self.inv_freq is not None
            and self._pending is None
            and getattr(self, "_sliding_window", None) is None
            and self._shared.count[0] == self.width
            and self._shared.seen >= self.sinks
        )

    def bind_replay_buffers(self, binding) -> None:
        self.replay_binding = binding
        if self.seen_tensor is None:
            self.seen_tensor = torch.tensor(self._shared.seen, device=self.device)  # the next token's real index

    def sync_replayed(self, values: list[int]) -> None:
        """Each replayed step took one real token into the full ring, overwriting one."""
        self._seen += values[0] - self._shared.seen
        width = self._layout.width
        self._set_shared(Rings(values[0], (width,), (values[0] - self.sinks - width,), width))

    def replay_state(self) -> tuple:
        return (self._kv, self.capacity, self._in_step, self._forward_unpadded, self._shared.count[0])


class QuantizedCircularSinkLayer(QuantizedRings, CircularSinkLayer):
    """Streaming's circular sink ring stored quantized (``kv_bits`` below 16; ``methods.cascade.quantized``)."""
