"""Ring angles: one RoPE frame per cascade while decoding, instead of two.

With several cascades a key is stored rotated at its slot index (``CascadeLayer``), and inside one ring the slots
before the ring's start hold tokens one ring width later in rank than their slot says: each ring is two frames, and
a decoding query is rotated to each (9 at budget 512 with 4 rings, 27 query rows per KV head in the logits matmul).
While a batch decodes in step the layer stores ring ``k``'s keys at *ring angles* instead: slot + ``laps[k]`` + ``W``
for the ring offsets before the start, slot + ``laps[k]`` from the start on. Ring order then follows the angle
across the wrap, so a ring is one frame; ``laps[k]`` grows by ``W`` each time the ring's start wraps to 0, which keeps
every stored angle where it was. A token moving between rings is turned from its old angle to its new one (all
Python integers, the same for every sequence of the batch). The sinks join the oldest ring's frame: they are kept
at angle j + ``sigma`` (``sigma``: that ring's rank offset, which grows by one whenever the ring overwrites a token)
and rewritten from their copy at angle j whenever ``sigma`` changes (no accumulated rounding); so a full cascade of
``N`` rings is ``N`` frames. Ring angles start once every sink is stored.

Everything else (prefill, the per-sequence tensor path, the stream-order views) reads keys at slot angles, so the
layer turns the rings back (``to_slot_angles``) before any of it, and to ring angles again at the next decoding
step: at most ``2 N`` slice rotations each way, with float64 angles, only when the kind of forward changes.
"""

from __future__ import annotations

from itertools import pairwise

from kvcompress.core.rotation import frame_rotation


class RingAngles:
    """Mixin of ``CascadeLayer``: the ring-angle storage of the in-step decoding step (see the module docstring).
    ``_laps``: ``None`` while keys sit at slot angles, else each ring's lap offset (Python integers)."""

    _laps: list[int] | None = None

    def _uses_ring_angles(self) -> bool:
        return self.cascades > 1 and self.inv_freq is not None

    def angle_shift(self, slot: int, starts, laps) -> int:
        """Angle minus slot index of ``slot`` for ring starts ``starts`` and lap offsets ``laps`` (``None``: slot
        angles)."""
        if laps is None or slot >= self.capacity:
            return 0
        if slot < self.sinks:  # the oldest ring's frame: its first slot's angle minus its rank
            last = self.cascades - 1
            return laps[last] + last * self.width + starts[last]
        ring, offset = divmod(slot - self.sinks, self.width)
        return laps[ring] + (self.width if offset < starts[ring] else 0)

    def to_ring_angles(self) -> None:
        """Turn the stored rings from slot angles to ring angles (``laps`` = 0), if they are not there already."""
        if self._laps is not None or not self._uses_ring_angles() or not self._in_step or self._py_seen < self.sinks:
            return
        self._turn_rings(1)
        self._laps = [0] * self.cascades
        self._sink_keys.copy_(self._kv[:, :, : self.sinks, : self._key_dim])
        self.place_sinks(self.angle_shift(0, self._py_start, self._laps))

    def to_slot_angles(self) -> None:
        """Turn the stored rings back to slot angles (before any path but the in-step decoding step reads them)."""
        if self._laps is None:
            return
        self._turn_rings(-1)
        self._kv[:, :, : self.sinks, : self._key_dim] = self._sink_keys
        self._laps = None

    def place_sinks(self, shift: int) -> None:
        """Write the sinks' keys at angle j + ``shift`` from their copy at angle j."""
        if self.sinks:
            rotation = frame_rotation(self.forward_pass, shift, self.inv_freq, self._key_dim, self.dtype)
            self._kv[:, :, : self.sinks, : self._key_dim] = self._sink_keys @ rotation

    def _turn_rings(self, sign: int) -> None:
        """Rotate each ring's occupied slots by ``sign`` times their ring-angle shift (for ``to_slot_angles``,
        ``_laps`` are the current ones; for ``to_ring_angles``, zeros)."""
        laps, starts = self._laps or [0] * self.cascades, self._py_start
        for ring, (count, start) in enumerate(zip(self._py_count, starts, strict=True)):
            first = self.sinks + ring * self.width
            wrapped = max(0, start + count - self.width)  # offsets [0, wrapped) come after the start in ring order
            parts = ((0, wrapped, laps[ring] + self.width), (start, min(start + count, self.width), laps[ring]))
            for lo, hi, shift in parts:
                if hi > lo and shift:
                    keys = self._kv[:, :, first + lo : first + hi, : self._key_dim]
                    rotation = frame_rotation(self.forward_pass, sign * shift, self.inv_freq, self._key_dim, self.dtype)
                    keys.copy_(keys @ rotation)

    def _step_turns(self, moves: list[tuple[int, bool]], before: tuple, after: tuple) -> tuple[int, ...]:
        """How far each column of an in-step insertion turns its key: 0 for the new token (written at its angle),
        then old angle to new angle for each token moved on (``before`` / ``after``: starts and laps around the
        step)."""
        dests = [dest for dest, _ in moves]
        moved = (
            dest + self.angle_shift(dest, *after) - source - self.angle_shift(source, *before)
            for source, dest in pairwise(dests)
        )
        return (0, *moved)
