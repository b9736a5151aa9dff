"""LESS's folds of one forward (``[H | z] += ψ(k)ᵀ [v | 1]``, Eqs. 4–5), gathered from its layers, done at its end.

Per layer a fold is a dozen small operations (ψ is a two-layer MLP), each costing far more than its arithmetic on a
decoding step. A state is read only by its layer's next attention, so the layers stage their evicted keys and values
(``stage``) and the forward folds them all when it closes: ψ as one batched MLP over every layer's victims (the ψ
weights views of one buffer), one outer product, one addition and one ratio ``H / z`` (the states and ratios views
of one buffer where their shapes agree). Whatever reads a state first folds what is staged (``settle``), so only the
order of additions changes.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward import agree
from kvcompress.core.grad_mode import without_grad
from kvcompress.methods.less.kernels import psi_features
from kvcompress.methods.less.low_rank_slots import state_ratio

FOLDS = "less-folds"  # the forward's job and its staged folds


def stage(layer, keys: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None) -> None:
    """Leave ``layer``'s fold of its evicted ``keys``/``values`` ``[B, H_kv, e, D]`` (``weight`` ``[B, H_kv, e]``:
    0 for slots that hold no token, ``None``: all real) to the end of the forward, or fold them now (a layer outside
    an open forward of several layers)."""
    forward = layer.forward_pass
    if not (forward.shared and forward.is_open):
        fold(forward, [(layer, keys, values, weight)])
        return
    forward.cached(FOLDS, list).append((layer, keys, values, weight))
    layer.staged = True
    forward.at_end(FOLDS, lambda: fold_staged(forward))


def settle(layer) -> None:
    """Fold what is staged if some of it is ``layer``'s (about to be read); the others' folds come with it."""
    if layer.staged:
        layer.forward_pass.run_now(FOLDS)


@without_grad
def fold_staged(forward) -> None:
    """Fold everything staged in ``forward``: together where the layers' shapes agree (a decoding step), else one by
    one."""
    waiting = forward.cached(FOLDS, list)
    staged = list(waiting)
    waiting.clear()
    for layer, *_ in staged:
        layer.staged = False
    if len({(keys.shape, weight is None) for _, keys, _, weight in staged}) == 1:
        fold(forward, staged)
    else:
        for item in staged:
            fold(forward, [item])


def fold(forward, staged: list) -> None:
    """Add ``ψ(k)ᵀ [v | 1]`` of each ``(layer, keys, values, weight)`` in ``staged`` (as ``stage`` takes them, all of
    one shape) to the layer's state."""
    layers = [layer for layer, *_ in staged]
    keys = _joined([keys for _, keys, _, _ in staged])  # [B, n * H_kv, e, D]
    values = _joined([values for _, _, values, _ in staged])
    psi = _stacked_psi(forward, layers) if len(layers) > 1 else layers[0].policy.weights.psi
    features = psi_features(keys, *psi)
    if staged[0][3] is not None:
        features = features * _joined([weight for *_, weight in staged])[..., None]
    _add(forward, layers, outer_update(features, values))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)


def _add(forward, layers: list, update: torch.Tensor) -> None:
    """Add ``update`` ``[B, n * H_kv, R, D + 1]`` to the states of ``layers``: one addition and one ratio for the
    whole cache where every layer folded and the states are stacked (a decoding step), else one per layer."""
    every = len(layers) == len(forward.layers) and all(a is b for a, b in zip(layers, forward.layers, strict=True))
    states = [layer.stored_low_rank for layer in layers] if every else []
    if every and all(state is not None for state in states) and agree(states):
        state, views = forward.stacked("less-state", states, dim=1)
        ratios = [
            state_ratio(own) if layer.stored_ratio is None else layer.stored_ratio
            for layer, own in zip(layers, states, strict=True)
        ]
        ratio, ratio_views = forward.stacked("less-ratio", ratios, dim=1)
        state.add_(update)
        state_ratio(state, out=ratio)
        for layer, view, ratio_view in zip(layers, views, ratio_views, strict=True):
            layer.stored_low_rank, layer.stored_ratio = view, ratio_view
        return
    heads = update.shape[1] // len(layers)
    for i, layer in enumerate(layers):
        layer.stored_low_rank.add_(update[:, i * heads : (i + 1) * heads])
        layer.stored_ratio = None


def _stacked_psi(forward, layers: list) -> tuple[torch.Tensor, ...]:
    """ψ's weights of ``layers`` stacked along the heads: the policies hold views of them (kernels are frozen)."""
    policies = [layer.policy for layer in layers]
    columns = zip(*(policy.weights.psi for policy in policies), strict=True)
    stacked = [forward.stacked(f"less-psi-{i}", list(column)) for i, column in enumerate(columns)]
    for index, policy in enumerate(policies):
        own = policy.weights.psi
        if any(own[i] is not views[index] for i, (_, views) in enumerate(stacked)):
            policy.weights = policy.weights._replace(psi=tuple(views[index] for _, views in stacked))
    return tuple(buffer for buffer, _ in stacked)


def outer_update(features: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``ψ(k)ᵀ [v | 1]`` ``[B, H, R, D + 1]`` summed over the tokens of ``features`` ``[B, H, e, R]`` and
    ``values`` ``[B, H, e, D]``: what the tokens add to ``[H | z]``."""
    values = values.float()
    ones = values.new_ones(*values.shape[:-1], 1)
    return features.transpose(-1, -2) @ torch.cat([values, ones], dim=-1)
