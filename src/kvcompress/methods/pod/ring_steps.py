"""How a PoD layer decodes with its proximal keys in a ring (``kvcompress.methods.pod.ring``): when a step may use
it, building it from the packed keys on the first such step (reading the position once), leaving it for anything
else, and the stream indices, positions and validity of the ring steps, appended only when something reads them."""

from __future__ import annotations

import torch

from kvcompress.methods.pod.ring import ProximalRing


def _settled(name: str) -> property:
    """A per-token store of the layer (kept as ``name``) that ring steps append to when it is next read."""

    def get(self) -> torch.Tensor:
        self._settle()
        return getattr(self, name)

    def put(self, value: torch.Tensor) -> None:
        setattr(self, name, value)

    return property(get, put)


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
            and self.all_real
            and self.sliding_window is None
            and not wants_stats
            and not key_states.requires_grad
            and self.max_position >= config.n_sink + config.n_recent
        )

    def _write_ring(self, position_ids: torch.Tensor | None) -> None:
        key, self._ring_key = self._ring_key, None
        if not self.all_real:  # a padding token came: the packed keys, which the masks read
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

    # a ring step appends to these when they are next read (three fewer copies a step)
    token_idx = _settled("_token_idx")
    rope_pos = _settled("_rope_pos")
    valid = _settled("_valid")

    def _settle(self) -> None:
        """Append the ring steps' tokens: the last ``_pending`` stream indices, at consecutive positions from the
        first one's (as the ring takes them), all real."""
        count, self._pending = self._pending, 0
        if not count:
            return
        batch, heads = self._token_idx.shape[:2]
        new_idx = torch.arange(self.seen - count, self.seen, device=self.device).expand(batch, heads, count)
        self._token_idx = torch.cat([self._token_idx, new_idx], dim=-1)
        positions = new_idx + (self._pending_position - (self.seen - count))
        self._rope_pos = torch.cat([self._rope_pos, positions], dim=-1)
        self._valid = torch.cat([self._valid, torch.ones_like(new_idx, dtype=torch.bool)], dim=-1)
