"""LESS's folds of one cache, gathered over a forward and done together.

Each LESS layer folds what it evicts into its state (``[H | z] += ψ(k)ᵀ [v | 1]``, Eqs. 4–5). Per layer that is a
dozen small operations (ψ is a two-layer MLP), each costing far more than its arithmetic on a decoding step. The
state is read only by the layer's next attention, so a cache's layers hand their evicted keys and values to one
``PendingFolds`` and the last layer of the forward folds them all at once: ψ of every layer's victims as one
batched MLP (the layers' ψ weights stacked), one outer product, then one addition per layer. Anything that reads a
state first folds what is pending (``flush``), so the order of additions is all that changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcompress.methods.less.kernels import psi_features

if TYPE_CHECKING:  # annotations only: the layer module imports this one
    from kvcompress.methods.less.layer import LessLayer


class PendingFolds:
    """Evicted tokens of the LESS layers of one cache, staged until the forward's last layer or the next read."""

    def __init__(self, layers: list[LessLayer]) -> None:
        self.layers = layers
        self.staged: list[tuple[LessLayer, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._weights: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None

    def stage(self, layer: LessLayer, keys: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Queue ``layer``'s evicted ``keys``/``values`` ``[B, H_kv, e, D]`` (``weight`` ``[B, H_kv, e]``: 0 for
        slots that hold no token, ``None``: all real); the forward's last layer folds the queue."""
        self.staged.append((layer, keys, values, weight))
        if layer is self.layers[-1]:
            self.flush()

    def flush_for(self, layer: LessLayer) -> None:
        """Fold what is staged if some of it is ``layer``'s (about to be read); the others' can wait."""
        if any(staged is layer for staged, *_ in self.staged):
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Fold everything staged: together where the layers' shapes agree (a decoding step), else one by one."""
        staged, self.staged = self.staged, []
        if not staged:
            return
        shapes = {(keys.shape, weight is None) for _, keys, _, weight in staged}
        if len(staged) == 1 or len(shapes) > 1:
            for layer, keys, values, weight in staged:
                layer.fold(keys, values, weight)
            return
        layers = [layer for layer, *_ in staged]
        keys = torch.cat([keys for _, keys, _, _ in staged], dim=1)  # [B, n * H_kv, e, D]
        values = torch.cat([values for _, _, values, _ in staged], dim=1)
        features = psi_features(keys, *self._stacked(layers))
        if staged[0][3] is not None:
            features = features * torch.cat([weight for *_, weight in staged], dim=1)[..., None]
        update = outer_update(features, values)  # [B, n * H_kv, R, D + 1]
        heads = staged[0][1].shape[1]
        for i, layer in enumerate(layers):
            layer.low_rank_state().add_(update[:, i * heads : (i + 1) * heads])

    def _stacked(self, layers: list[LessLayer]) -> tuple[torch.Tensor, ...]:
        """ψ's weights of ``layers`` stacked along the heads (built once per set of layers: kernels are frozen)."""
        key = tuple(id(layer) for layer in layers)
        if self._weights is None or self._weights[0] != key:
            policies = [layer.policy for layer in layers]
            parts = [p.weights.psi for p in policies]
            self._weights = (key, tuple(torch.cat(column, dim=0) for column in zip(*parts, strict=True)))
        return self._weights[1]


def outer_update(features: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``ψ(k)ᵀ [v | 1]`` ``[B, H, R, D + 1]`` summed over the tokens of ``features`` ``[B, H, e, R]`` and
    ``values`` ``[B, H, e, D]``: what the tokens add to ``[H | z]``."""
    values = values.float()
    ones = values.new_ones(*values.shape[:-1], 1)
    return features.transpose(-1, -2) @ torch.cat([values, ones], dim=-1)
