"""PoD's masks while every layer holds the stream as it came, shared by the layers of a forward.

While no token was evicted (a prefill before a one-shot base method compresses, or PoD alone), no padding is
stored and the model's positions are the stream indices, every layer and KV head stores token ``i`` at slot ``i``
with RoPE position ``i``, and its sharing heads store the same proximal keys. The masks of the grouped two-call
merge then depend on the positions alone: the forward's first sharing layer builds them once, one row per query
row, and the others read them (kept on the forward's ``position_ids``). Per layer this saves building the
``[B, H_kv, q, L]`` proximal and distant masks and their float ``[B, S, G q, L]`` biases.
"""

from __future__ import annotations

import torch

from kvcompress.methods.pod.fused import GroupedBiases, additive


def stream_biases(layer, queries: int, groups: int, dtype: torch.dtype) -> GroupedBiases | None:
    """The biases of this forward's ``queries`` rows (``[1, 1, G q, ...]``), or None where ``layer`` does not hold
    the stream as it came (``PoDLayer.on_stream``) or the forward gave no positions to keep them on."""
    positions = layer.forward_positions
    if not layer.on_stream or positions is None:
        return None
    config = layer.policy.config
    stored = layer.prox_slot.shape[-1]
    key = ("pod-stream-biases", layer.seen, queries, stored, groups, dtype, config.n_sink, config.n_recent)
    return layer.forward_pass.cached(key, lambda: _build(layer, queries, groups, dtype))


def _build(layer, queries: int, groups: int, dtype: torch.dtype) -> GroupedBiases:
    config = layer.policy.config
    query_pos = torch.arange(layer.seen - queries, layer.seen, device=layer.device)[:, None]

    def near_and_far(key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [q, n] each
        seen = key_pos <= query_pos
        near = (key_pos < config.n_sink) | (query_pos - key_pos < config.n_recent)
        return seen & near, seen & ~near

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [q, ...] -> [1, 1, G q, ...]: the same rows per query head
        return tensor.repeat(groups, *([1] * (tensor.dim() - 1)))[None, None]

    prox_seen, _ = near_and_far(layer.prox_slot[0, 0])  # a stored proximal key's slot is its position here
    prox = rows(additive(prox_seen, dtype))
    stop = layer.seen - queries - config.n_recent  # distant to every query before it, to query i up to stop + i
    if stop > config.n_sink:  # two unmasked-or-small calls instead of one [G q, L] mask
        causal = torch.ones(queries, queries, dtype=torch.bool, device=layer.device).tril()
        every = torch.ones(groups * queries, dtype=torch.bool, device=layer.device)[None, None]
        return GroupedBiases(prox, rows(additive(causal, dtype)), every, (config.n_sink, stop))
    _, distant = near_and_far(torch.arange(layer.seen, device=layer.device))
    has_distant = distant.any(-1)
    return GroupedBiases(prox, rows(additive(distant | ~has_distant[:, None], dtype)), rows(has_distant))
