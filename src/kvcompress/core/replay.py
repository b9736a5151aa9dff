"""Static decoding steps: what lets ``kvcompress.decode_graph`` capture a layer's decoding step once and replay it.

A captured step runs fixed kernels on fixed addresses and no Python. A layer *bound* to one (``ReplayBinding.bind``)
is in its static form: a steady step (``replay_steady``) writes its token into its victim's slot; its per-step
numbers are device scalars the step advances (``replay_counters``); its victims go to one buffer (``free_buffer``).
While the graph replays, the Python integers fall behind (the binding is ``stale``): the first read of a layer's
``seen``, or a forward that is not the graph's (which also unbinds), sets them with one host read for all layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ReplayBinding:
    """The layers of one cache bound to a captured decoding step, and whether their Python integers are behind."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.bound = False
        self.stale = False  # a replay advanced the device counters since the Python integers were last set
        self.stepping = False  # the graph's own step runs in Python (its first static step, the capture)
        self._forward = layers[0].forward_pass if layers else None

    def bind(self) -> None:
        """Put every layer in its static form (device counters written from the Python integers)."""
        for layer in self.layers:
            layer.bind_replay_buffers(self)
        self.bound = True
        if self._forward is not None:
            self._forward.on_open = self._forward_opens

    @contextmanager
    def own_step(self) -> Iterator[None]:
        """The graph's own step runs in Python within this block (its first bound step, the capture): the forward it
        opens keeps the layers bound."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def replayed(self) -> None:
        self.stale = True

    def sync(self) -> None:
        """Set the layers' Python integers from their device counters (one host read for all layers)."""
        if not self.stale:
            return
        self.stale = False
        layers = self._own()
        counters = [layer.replay_counters() for layer in layers]
        values = iter(torch.stack([c.reshape(()) for layer_counters in counters for c in layer_counters]).tolist())
        for layer, layer_counters in zip(layers, counters, strict=True):
            layer.sync_replayed([next(values) for _ in layer_counters])

    def unbind(self) -> None:
        """Back to the eager form: the Python integers up to date, the device counters dropped."""
        if not self.bound:
            return
        self.sync()
        for layer in self._own():
            layer.unbind_replay_buffers()
        self.bound = False
        if self._forward is not None and self._forward.on_open == self._forward_opens:
            self._forward.on_open = None

    def holds(self) -> bool:
        """Whether every layer is still bound here (a reset layer has left)."""
        return self.bound and all(layer.replay_binding is self for layer in self.layers)

    def _own(self) -> list:
        return [layer for layer in self.layers if layer.replay_binding is self]

    def _forward_opens(self) -> None:
        """A forward opens: the graph's own steps keep the binding, any other leaves the graph."""
        if not self.stepping:
            self.unbind()


class SlotReplay:
    """Mixin of ``CompressedLayer``: its static form (``seen_tensor``, ``free_buffer``)."""

    replay_binding: ReplayBinding | None = None  # set while bound to a captured step
    seen_tensor: torch.Tensor | None = None  # ``seen`` as a device scalar while bound
    free_buffer: torch.Tensor | None = None  # the buffer the victims' slots are copied to while bound

    def replay_steady(self) -> bool:
        """Whether the next decoding step runs the same operations as the last: one token per sequence into the
        victim's slot, no padding stored, no sliding window."""
        if self._free is None:  # (set only when a one-token step left one victim a row in a holed layer)
            return False
        return self.all_valid and self.sliding_window is None and self.occupied < self.slots.capacity

    @property
    def seen(self) -> int:
        binding = self.replay_binding
        if binding is not None and binding.stale:
            binding.sync()
        return self._seen

    @seen.setter
    def seen(self, value: int) -> None:
        self._seen = value

    @property
    def seen_step(self) -> int | torch.Tensor:
        return self.seen if self.seen_tensor is None else self.seen_tensor

    def bind_replay_buffers(self, binding: ReplayBinding) -> None:
        self.replay_binding = binding
        if self.seen_tensor is None:
            self.seen_tensor = torch.tensor(self.seen, device=self.device)
            self.free_buffer = self._free.clone()
        if self._free is not self.free_buffer:
            self._free = self.free_buffer.copy_(self._free)

    def replay_counters(self) -> list[torch.Tensor]:
        return [self.seen_tensor]

    def sync_replayed(self, values: list[int]) -> None:
        """The Python integers from ``replay_counters``' values (each replayed step stored one real token)."""
        replayed = values[0] - self._seen
        self._seen = values[0]
        self.slots.add_real(replayed)

    def unbind_replay_buffers(self) -> None:
        self.replay_binding = self.seen_tensor = self.free_buffer = None

    def replay_state(self) -> tuple:
        """What must not change for a captured step to apply again (tensors compared by identity)."""
        return (self.slots.keys, self.occupied, self._free is self.free_buffer)


def last_index(tensor: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
    """``tensor[..., index]`` for an index computed from ``seen_step`` (indexing with a 0-dim tensor would read it
    back to the host)."""
    return tensor[..., index] if isinstance(index, int) else tensor.index_select(-1, index.view(1))[..., 0]


def put_last_index(tensor: torch.Tensor, index: int | torch.Tensor, value: torch.Tensor) -> None:
    """``tensor[..., index] = value`` for an index computed from ``seen_step`` (see ``last_index``)."""
    if isinstance(index, int):
        tensor[..., index] = value
    else:
        tensor.index_copy_(-1, index.view(1), value[..., None])
