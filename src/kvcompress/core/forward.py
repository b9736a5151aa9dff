"""``ForwardPass``: one forward of the model through a cache, and the work its layers share.

A cache owns one ``ForwardPass`` for all its layers (a layer outside a cache has its own), open from the first
layer's ``update`` to the end of the last layer's attention. Nothing a forward builds outlives it; a forward that
stopped before its last layer (an exception in the model) is closed when the next one opens. ``stacked`` keeps the
layers' buffers of one kind as views of one buffer, so an operation over every layer is one operation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


class ForwardPass:
    """One forward through ``layers`` (in forward order: the first opens it, the last closes it)."""

    def __init__(self, layers: Sequence[object]) -> None:
        self.layers = list(layers)
        self.is_open = False
        self._tables: dict[Hashable, object] = {}  # this forward's shared work (``cached``)
        self._jobs: dict[Hashable, Callable[[], None]] = {}  # work for the end of this forward (``at_end``)
        self._stacks: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # name: (buffer, its slices)
        # called as each forward opens, before any layer stores a token (``core.replay``)
        self.on_open: Callable[[], None] | None = None

    @property
    def shared(self) -> bool:
        """Whether several layers run in this pass (a layer alone has nothing to share)."""
        return len(self.layers) > 1

    def begin(self, layer: object) -> None:
        """``layer`` takes this forward's tokens: the first layer opens a new forward (closing one left open); any
        layer opens one if none is open."""
        if layer is self.layers[0] or not self.is_open:
            if self.is_open:
                self.close()
            if self.on_open is not None:
                self.on_open()
            self.is_open = True

    def end(self, layer: object) -> None:
        if layer is self.layers[-1]:
            self.close()

    def close(self) -> None:
        """Run the jobs in order of registration (and those they register), then drop the forward's tables."""
        jobs = self._jobs
        while jobs:
            jobs.pop(next(iter(jobs)))()
        self._tables.clear()
        self.is_open = False

    def reset(self) -> None:
        """Drop an open forward's jobs and tables, and the stacked buffers (the layers were emptied)."""
        self._jobs.clear()
        self._tables.clear()
        self._stacks.clear()
        self.is_open = False

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` once per forward and ``key`` (naming all the result depends on beyond the forward's own
        inputs); outside a forward, each time."""
        if not self.is_open:
            return build()
        if key not in self._tables:
            self._tables[key] = build()
        return self._tables[key]

    def at_end(self, key: Hashable, job: Callable[[], None]) -> None:
        """Run ``job()`` when the forward closes; a ``key`` registered already keeps its first job."""
        if key not in self._jobs:
            self._jobs[key] = job

    def stacked(
        self, name: str, tensors: list[torch.Tensor], dim: int = 0, make: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """``(buffer, slices)``: one buffer whose slices along ``dim`` are ``tensors``: the one made last time under
        ``name`` while the tensors are still its slices; else a new one (one copy of the tensors, which must agree),
        whose slices the caller gives the layers in place of ``tensors`` (or ``None`` without ``make``)."""
        known = self._stacks.get(name)
        if known is not None and len(known[1]) == len(tensors) and all(map(operator.is_, tensors, known[1])):
            return known
        if not make:
            return None
        buffer, size = torch.cat(tensors, dim), tensors[0].shape[dim]
        # ``narrow``, not ``chunk``: the slices of a multi-output view may not be written in place under autograd
        stacked = buffer, [buffer.narrow(dim, i * size, size) for i in range(len(tensors))]
        self._stacks[name] = stacked
        return stacked

    def unstack(self, name: str) -> None:
        """Forget the buffer stacked under ``name`` (the layers replaced theirs)."""
        self._stacks.pop(name, None)


def agree(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` may be stacked: one shape, dtype and device."""
    first = tensors[0]
    return all(t.shape == first.shape and t.dtype == first.dtype and t.device == first.device for t in tensors)


def from_host(values, device: torch.device, dtype: torch.dtype | None = torch.long) -> torch.Tensor:
    """A tensor of host ``values`` (a list of Python numbers, or a NumPy array) on ``device``, copied without
    blocking (``torch.tensor(values, device=gpu)`` would wait for the GPU's queue); ``dtype`` None keeps a NumPy
    array's own."""
    return torch.as_tensor(values, dtype=dtype, device="cpu").to(device, non_blocking=True)
