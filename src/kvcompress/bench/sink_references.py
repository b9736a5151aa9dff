"""Reference sink caches for the cache-op benchmark (the paper's Table 4 comparison): concat and circular."""

from __future__ import annotations

import torch


class ConcatSinkCache:
    """The usual sink cache: concatenate the new tokens, then cut out the oldest non-sink ones by concatenation.

    Keeps the first ``sinks`` tokens and the last ``window`` tokens, in stream order (StreamingLLM's
    ``StartRecentKVCache`` evicting after the append; stored keys are not re-rotated).
    """

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        if self.keys.shape[-2] > self.sinks + self.window:
            sinks, recent = self.sinks, -self.window
            self.keys = torch.cat([self.keys[:, :, :sinks], self.keys[:, :, recent:]], dim=-2)
            self.values = torch.cat([self.values[:, :, :sinks], self.values[:, :, recent:]], dim=-2)
        return self.keys, self.values


class CircularSinkCache:
    """A sink cache in a buffer of ``sinks + window`` slots allocated once; a new token overwrites the oldest slot.

    Slot order is not stream order once the window wraps (attention does not care, given correct positions).
    ``update`` returns the occupied slots.
    """

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.seen = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            shape = (*keys.shape[:2], self.sinks + self.window, keys.shape[-1])
            self.keys = keys.new_empty(shape)
            self.values = values.new_empty(shape)
        for i in range(keys.shape[-2]):  # one slot per token; decoding writes one
            self.keys[:, :, self._slot(self.seen)] = keys[:, :, i]
            self.values[:, :, self._slot(self.seen)] = values[:, :, i]
            self.seen += 1
        stored = min(self.seen, self.sinks + self.window)
        return self.keys[:, :, :stored], self.values[:, :, :stored]

    def _slot(self, token: int) -> int:
        if token < self.sinks:
            return token
        return self.sinks + (token - self.sinks) % self.window
