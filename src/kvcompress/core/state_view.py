"""``layer.state``: a compressed layer's per-token method state, seen through the slots attention sees."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StateView:
    """``layer.state``: the method's per-token tensors (``buffers``, every slot) as views over the slots attention
    sees (``view``: the layer's)."""

    def __init__(self, buffers: dict[str, torch.Tensor], view: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.buffers, self.view = buffers, view

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.view(self.buffers[name])

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self[name].copy_(value)  # broadcast over heads where ``value`` has one

    def __contains__(self, name: object) -> bool:
        return name in self.buffers

    def keys(self):
        return self.buffers.keys()

    def items(self):
        return [(name, self[name]) for name in self.buffers]

    def values(self):
        return [self[name] for name in self.buffers]
