"""LESS's folds of one cache, gathered over a forward and done together.

Each LESS layer folds what it evicts into its state (``[H | z] += ψ(k)ᵀ [v | 1]``, Eqs. 4–5). Per layer that is a
dozen small operations (ψ is a two-layer MLP), each costing far more than its arithmetic on a decoding step. The
state is read only by the layer's next attention, so a cache's layers hand their evicted keys and values to one
``PendingFolds`` and the last layer of the forward folds them all at once: ψ of every layer's victims as one
batched MLP (the layers' ψ weights stacked), one outer product, then one addition: the layers' states are views of
one buffer where their shapes agree, so the addition and the ratios ``H / z`` a decoding step reads
(``LessLayer.ratio``) are one operation each for the whole cache. Anything that reads a state first folds what is
pending (``flush``), so the order of additions is all that changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcompress.core.grad_mode import without_grad
from kvcompress.methods.less.kernels import psi_features
from kvcompress.methods.less.low_rank_slots import state_ratio

if TYPE_CHECKING:  # annotations only: the layer module imports this one
    from kvcompress.methods.less.layer import LessLayer


class PendingFolds:
    """Evicted tokens of the LESS layers of one cache, staged until the forward's last layer or the next read."""

    def __init__(self, layers: list[LessLayer]) -> None:
        self.layers = layers
        self.staged: list[tuple[LessLayer, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._staged_ids: set[int] = set()  # ``id`` of the layers with something in ``staged``
        self._weights: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None
        self._states: list[torch.Tensor] | None = None  # the layers' views of ``_stacked_state`` (``_stack``)
        self._stacked_state: torch.Tensor | None = None  # [B, n * H_kv, R, D + 1]: every layer's [H | z]
        self._stacked_ratio: torch.Tensor | None = None  # [B, n * H_kv, R, D]: every layer's H / z
        self._ratios: list[torch.Tensor] = []

    def stage(self, layer: LessLayer, keys: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Queue ``layer``'s evicted ``keys``/``values`` ``[B, H_kv, e, D]`` (``weight`` ``[B, H_kv, e]``: 0 for
        slots that hold no token, ``None``: all real); the forward's last layer folds the queue."""
        self.staged.append((layer, keys, values, weight))
        self._staged_ids.add(id(layer))
        if layer is self.layers[-1]:
            self.flush()

    def flush_for(self, layer: LessLayer) -> None:
        """Fold what is staged if some of it is ``layer``'s (about to be read); the others' can wait."""
        if id(layer) in self._staged_ids:
            self.flush()

    @without_grad
    def flush(self) -> None:
        """Fold everything staged: together where the layers' shapes agree (a decoding step), else one by one."""
        staged, self.staged = self.staged, []
        self._staged_ids.clear()
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
        self._add(layers, outer_update(features, values))

    def _add(self, layers: list[LessLayer], update: torch.Tensor) -> None:
        """Add ``update`` ``[B, n * H_kv, R, D + 1]`` to the states of ``layers``: one addition and one ratio for the
        whole cache where every layer folded and the states are stacked (a decoding step), else one per layer."""
        every = len(layers) == len(self.layers) and all(a is b for a, b in zip(layers, self.layers, strict=True))
        if every and self._stack():
            self._stacked_state.add_(update)
            state_ratio(self._stacked_state, out=self._stacked_ratio)
            for layer, state, ratio in zip(self.layers, self._states, self._ratios, strict=True):
                layer.share_state(state, ratio)  # a layer that folded alone since holds its own ratio
            return
        heads = update.shape[1] // len(layers)
        for i, layer in enumerate(layers):
            layer.add_to_state(update[:, i * heads : (i + 1) * heads])

    def _stack(self) -> bool:
        """Whether the layers' states are views of one buffer, made so (one copy) where they are not yet but agree in
        shape; a layer replaces its state when its batch changes or it resets, and is stacked again here."""
        states = [layer.low_rank_state() for layer in self.layers]
        if self._states is not None and all(a is b for a, b in zip(states, self._states, strict=True)):
            return True
        if any(state is None for state in states) or len({state.shape for state in states}) > 1:
            return False
        self._stacked_state = torch.cat(states, dim=1)
        self._stacked_ratio = state_ratio(self._stacked_state)
        heads = states[0].shape[1]
        self._states, self._ratios = (
            [stacked[:, i * heads : (i + 1) * heads] for i in range(len(states))]
            for stacked in (self._stacked_state, self._stacked_ratio)
        )
        return True

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
