"""PoD at a budget: the tokens the composed selection keeps so that the KV bytes meet the request, the shipped
groupings, and the achieved bytes.

A request is a ``ratio`` of the full cache's KV bytes or a ``budget`` per layer and KV head in full tokens (key and
value). PoD stores every kept token's value, and its key at block-start (layer, KV head) pairs (a share ``k``) and
elsewhere for the ``P = n_sink + n_recent`` proximal tokens: ``m`` tokens kept cost on average ``m + k*m + (1 -
k)*min(m, P)`` half-tokens. A request of ``T`` tokens (``budget``, or ``ratio * n``) allows ``2T``: ``m = T`` when
``T <= P``, else ``m = (2T - (1 - k) P) / (1 + k)`` (rounded down, at most ``n``). The proximal keys are an upper
bound (a kept token is proximal only if a sink or recent): the achieved bytes are at most the request.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcompress.files import shipped_folder, shipped_json_meta


def default_similarity(layers: int) -> Path:
    """The shipped calibration file for a model with ``layers`` decoder layers (one must match, and only one)."""
    matches = [name for name, meta in shipped_json_meta("pod").items() if meta.get("layers") == layers]
    if len(matches) != 1:
        names = ", ".join(f"{n} ({m.get('layers')} layers)" for n, m in shipped_json_meta("pod").items()) or "none"
        raise ValueError(
            f"pod has no shipped grouping for a {layers}-layer model (shipped: {names}); give "
            "similarity=<file from `python -m kvcompress.train.pod_calibrate`>, starts=[[...]] or block_size=k"
        )
    return shipped_folder("pod") / f"{matches[0]}.json"


def kept_for_request(target: torch.Tensor, n_real: torch.Tensor, key_share: float, proximal: int) -> torch.Tensor:
    """Tokens ``m`` kept per layer and KV head (``[B]``) for a request of ``target`` full tokens (``[B]``)."""
    target = target.to(torch.float64)
    spread = (2 * target - (1 - key_share) * proximal) / (1 + key_share)
    kept = torch.where(target <= proximal, target, spread).floor().long()
    return torch.minimum(kept.clamp(min=1), n_real)


def budget_report(cache) -> dict[str, float]:
    """Achieved KV bytes against the request and the full cache (``full_bytes``: every token seen, every layer and
    KV head; ``requested_bytes``: ``ratio`` of that, or ``budget`` full tokens per layer and KV head)."""
    config, layers = cache.config, cache.compressed_layers
    first = layers[0].values  # [B, H_kv, L, d]
    token_bytes = 2 * first.shape[0] * first.shape[1] * first.shape[-1] * first.element_size()
    full = sum(layer.seen for layer in layers) * token_bytes
    requested = config.ratio * full if config.ratio is not None else float(full)
    if config.budget is not None:
        requested = config.budget * len(layers) * token_bytes
    stored = cache.nbytes()
    return {
        "stored_bytes": stored,
        "requested_bytes": requested,
        "full_bytes": full,
        "stored_over_full": stored / full,
        "stored_over_request": stored / requested,
    }
