"""What a layer tells ``kvcompress.decode_graph`` about replaying its decoding step (a CUDA graph runs fixed
kernels on fixed addresses with every Python number baked in).

``SlotReplay`` is the slot layer's (``CompressedLayer``): a steady step reuses the victim's slot; bound to a graph
the layer counts its tokens on the device (``seen_tensor``) and copies its victims to one buffer
(``free_buffer``) the next step reads. Layers with another storage override these methods (the circular sink
cache: ``methods.cascade.ring_replay``).
"""

from __future__ import annotations

import torch


class SlotReplay:
    """Mixin of ``CompressedLayer``."""

    replay_managed: tuple[str, ...] = ()  # Python attributes ``replayed_python_step`` advances (not a fixed delta)

    def replay_steady(self) -> bool:
        """Whether the next decoding step runs the same operations as the last: one token per sequence into the
        victim's slot (nothing grows), no padding stored, no sliding window."""
        return (
            self.is_initialized
            and not self.dense
            and self._free is not None
            and self._free.shape[-1] == 1
            and self.all_valid
            and self.sliding_window is None
            and self.occupied < self.slots.capacity
        )

    def bind_replay_buffers(self) -> None:
        """Keep the per-step numbers on the device from now on (the tokens seen; the victims' buffer)."""
        if self.seen_tensor is None:
            self.seen_tensor = torch.tensor(self.seen, device=self.device)
            self.free_buffer = self._free.clone()
        if self._free is not self.free_buffer:
            self._free = self.free_buffer.copy_(self._free)

    def replay_state(self) -> tuple:
        """What must not change for a captured step to apply again (tensors compared by identity)."""
        return (self.slots.keys, self.occupied, self._free is self.free_buffer)

    def replayed_python_step(self) -> None:
        """The Python side of a replayed step that is not a fixed change of whole numbers (none here)."""
