"""How a PoD layer decodes with its proximal keys in a ring (``kvcompress.methods.pod.ring``): when a step may use
it, building it from the packed keys on the first such step (reading the position once), leaving it for anything
else, and the stream indices, positions and validity of the ring steps, written into the slots only when something
reads them (the layer's deferred write, ``CompressedLayer._settle``)."""

from __future__ import annotations

import torch

from kvcompress.methods.pod.ring import ProximalRing


class RingSteps:
    """The ring half of ``PoDLayer`` (a mixin: it reads and sets the layer's stores)."""

    ring: ProximalRing | None
    _ring_key: torch.Tensor | None
    _pending: int

    def _ring_step(self, count: int, key_states: torch.Tensor) -> bool:
        """Whether this forward's new key goes to the ring: one token, no padding, a global layer, no statistics
        asked, no autograd, and past the first distant position (decided on the host)."""
        config = self.policy.config
        wants_stats = self.policy.wants_stats(self) and self.policy.stats.any
        return (
            count == 1
            and bool(self.ring_plan)
            and self.all_valid
            and self.sliding_window is None
            and not wants_stats
            and not key_states.requires_grad
            and self.max_position >= config.n_sink + config.n_recent
        )

    def _write_ring(self, position_ids: torch.Tensor | None) -> None:
        key, self._ring_key = self._ring_key, None
        if not self.all_valid:  # a padding token came: the packed keys, which the masks read
            self.leave_ring()
            self._append_proximal(key)
            return
        if self.ring is None:
            position = self.seen - 1 if position_ids is None else self._decoding_position(position_ids)
            if position is None:  # rows at different positions: the packed keys, from now on
                self.ring_plan = False
                self._append_proximal(key)
                return
            self.ring = ProximalRing(self, position)
            self.prox_keys, self.prox_slot = self.ring.keys, None
        length = self.values.shape[2]
        self.ring.advance(key, self.heads_of(self.values, "prox").narrow(2, length - 1, 1), length - 1, length)

    def _decoding_position(self, position_ids: torch.Tensor) -> int | None:
        """The new token's position if every row has the same (one host read per forward), else None."""

        def read() -> int | None:
            positions = position_ids[..., -1]
            positions = positions[0] if positions.dim() == 2 and position_ids.dim() == 3 else positions
            largest, smallest = torch.stack([positions.max(), positions.min()]).tolist()
            return largest if largest == smallest else None

        return self.forward_pass.cached("pod-decoding-position", read)

    def leave_ring(self) -> None:
        """Turn the ring back into the packed proximal keys (before anything else reads or moves them)."""
        if self.ring is not None:
            self._settle()
            self.prox_keys, self.prox_slot = self.ring.packed()
            self.ring = None

    def _settle(self) -> None:
        """Write the ring steps' bookkeeping into their slots (the last ``_pending`` ones): stream indices, positions
        consecutive from the first one's (as the ring takes them), all real. (PoD never leaves an evicted token's
        slot for the next one, the other deferred write of ``CompressedLayer``: it compacts at once.)"""
        self._stale = False
        count, self._pending = self._pending, 0
        if not count:
            return
        slots, stop = self.slots, self.occupied
        first = self.seen - count
        index = torch.arange(first, self.seen, device=self.device)
        slots.token_idx[:, :, stop - count : stop] = index
        slots.rope_pos[:, :, stop - count : stop] = index + (self._pending_position - first)
        slots.valid[:, :, stop - count : stop] = True
        slots.rank[:, :, stop - count : stop] = index  # no padding stored: a real token's rank is its stream index
        slots.real_seen += count
