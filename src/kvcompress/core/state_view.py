"""``layer.state``: a compressed layer's per-token method state, seen through the slots attention sees."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcompress.core.layer import CompressedLayer


class StateView:
    """``layer.state``: the method's per-token tensors as views over the slots attention sees."""

    def __init__(self, layer: CompressedLayer) -> None:
        self.layer = layer

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.layer._view(self.layer.slots.state[name])

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self[name].copy_(value)  # broadcast over heads where ``value`` has one

    def __contains__(self, name: object) -> bool:
        return name in self.layer.slots.state

    def keys(self):
        return self.layer.slots.state.keys()

    def items(self):
        return [(name, self[name]) for name in self.layer.slots.state]

    def values(self):
        return [self[name] for name in self.layer.slots.state]
