"""PoD's proximal keys while decoding one token per forward: a ring written in place.

Packed proximal keys (``PoDLayer.prox_keys``) are trimmed after each forward (a host read per layer, masks rebuilt
every step). Decoding without padding, one token enters the recent window per step and one leaves it, so the keys
live in a ring: the stored sinks first (no new token is a sink), entry ``sinks + pos % n_recent`` the recent token
at ``pos``, overwriting the token just become distant, whose slot opens in the distant mask. A step writes one key,
its value (a copy: no gather), one slot number and one mask entry, and reads nothing. Positions are read once, when
the ring is built; each decoding token is then taken to be one position past the previous one (what ``generate``
gives). Several tokens, padding, an eviction or a batch reorder turn the ring back into the packed keys
(``PoDLayer.leave_ring``).
"""

from __future__ import annotations

import math

import torch


def ring_plan(layout, config):
    """The layer's ``QueryLayout`` if its decoding steps may use the ring (no ``tau``, ``combine="softmax"``, the
    sharing query heads whole groups), else None."""
    if config.tau is not None or config.combine != "softmax" or not layout.sharing or layout.runs is None:
        return None
    return layout


class ProximalRing:
    """``keys`` and ``values`` ``[B, S, W, d]`` (``W = sinks + n_recent``) of the ``S`` sharing KV heads, each
    entry's slot (``slot``; 0: none), ``bias`` ``[B, S, 1, W]`` (0 at a held entry, else -inf), ``dist`` ``[B, S, 1,
    capacity + 1]`` (0 at stored distant tokens' slots, else -inf; the last column takes writes opening nothing)."""

    def __init__(self, layer, position: int) -> None:
        """The ring of ``layer``'s packed proximal keys as they stand for the query at ``position - 1``."""
        config = layer.policy.config
        self.n_sink, self.n_recent = config.n_sink, config.n_recent
        self.position = position - 1
        slot, (safe, rope_pos, valid, pos, real) = layer.prox_slot, layer.proximal_entries()
        sink = real & (pos < self.n_sink)
        # the sinks first, in their stored order, as many entries as a row holds at most (one host read per ring)
        self.sinks = int(sink.sum(-1).amax()) if sink.numel() else 0
        width = self.sinks + self.n_recent
        recent = real & ~sink & (pos >= position - self.n_recent)
        entry = torch.where(sink, sink.cumsum(-1) - 1, self.sinks + pos % self.n_recent)
        entry = torch.where(sink | recent, entry, width)  # width: a discarded entry
        batch, shared, _, dim = layer.prox_keys.shape
        keys = layer.prox_keys.new_zeros(batch, shared, width + 1, dim)
        keys.scatter_(2, entry[..., None].expand(*entry.shape, dim), layer.prox_keys)
        length = layer.values.shape[2]
        self.capacity = 2 * length
        self.keys = keys[:, :, :width].contiguous()

        def placed(fill: int, source: torch.Tensor) -> torch.Tensor:  # [B, S, W]: ``source`` at entries, else ``fill``
            empty = torch.full((batch, shared, width + 1), fill, dtype=torch.long, device=slot.device)
            return empty.scatter_(2, entry, source)[:, :, :width].contiguous()

        # leaving: until a step writes an entry, the slot its token opens when it leaves (none: the sink column)
        self.slot, self.leaving = placed(0, safe), placed(self.capacity, safe)
        values = layer.heads_of(layer.values, "prox")
        self.values = values.gather(2, self.slot[..., None].expand(*self.slot.shape, values.shape[-1]))
        held = placed(0, torch.ones_like(safe)).bool()[:, :, None]
        self.bias = torch.full(held.shape, -math.inf, dtype=keys.dtype, device=keys.device).masked_fill_(held, 0.0)
        distant = valid & (rope_pos >= self.n_sink) & (rope_pos <= self.position - self.n_recent)
        self.dist = torch.full((batch, shared, 1, self.capacity + 1), -math.inf, dtype=keys.dtype, device=keys.device)
        self.dist[:, :, 0, :length].masked_fill_(distant, 0.0)
        self.written = [False] * self.n_recent  # recent entries a decoding step wrote (known to hold a token)
        self.always_distant: bool | None = None  # every row sees a distant token (None: not checked yet)

    def advance(self, key: torch.Tensor, value: torch.Tensor, slot: int, length: int) -> None:
        """Write the new token (``[B, S, 1, d]``, at ``slot`` of ``length``); the token it replaces becomes distant."""
        self.position += 1
        recent = self.position % self.n_recent
        entry = self.sinks + recent
        if length > self.capacity:
            old, self.capacity = self.capacity, 2 * length
            dist = self.dist.new_full((*self.dist.shape[:3], self.capacity + 1), -math.inf)
            dist[..., :old] = self.dist[..., :old]
            self.dist = dist
            self.leaving.masked_fill_(self.leaving == old, self.capacity)
        source = self.slot if self.written[recent] else self.leaving
        self.dist.scatter_(3, source.narrow(2, entry, 1).unsqueeze(-1), 0.0)  # the leaving token's slot opens
        self.keys.narrow(2, entry, 1).copy_(key)
        self.values.narrow(2, entry, 1).copy_(value)
        self.slot.narrow(2, entry, 1).fill_(slot)
        if not self.written[recent]:
            self.bias.narrow(3, entry, 1).fill_(0.0)
            self.written[recent] = True

    def has_distant(self, length: int) -> torch.Tensor | None:
        """``[B, S, 1]`` rows that see a distant token, or None when all do (read once per ring: nothing is evicted
        while it lives)."""
        if self.always_distant:
            return None
        has = (self.dist[..., :length] == 0).any(-1)
        if self.always_distant is None:
            self.always_distant = bool(has.all())
        return None if self.always_distant else has

    def metadata_nbytes(self) -> int:
        """Bytes of the slots, masks and values' copy (the keys are the layer's ``prox_keys``)."""
        return sum(t.numel() * t.element_size() for t in (self.slot, self.leaving, self.bias, self.dist, self.values))
