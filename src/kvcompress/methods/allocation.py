"""Budget allocation, an axis of its own: how the tokens a one-shot scorer keeps are shared among layers and heads.

A one-shot scorer (``snapkv``, ``keydiff``, ``expected_attention``) gives every stored token of a layer a score per
KV head; its ``allocation`` parameter says how many of them each layer and head keeps:

- ``uniform`` (default): every layer and KV head keeps the same count, ``max(1, floor(ratio * n))`` of a
  sequence's ``n`` prompt tokens (or ``min(budget, n)``).
- ``pyramid`` (PyramidKV, Cai et al., 2024, arXiv:2406.02069): the counts shrink linearly from the first layer to
  the last and average the uniform count. The schedule is kvpress 0.5.5's ``PyramidKVPress.get_layer_budget``
  (itself KVCache-Factory's formula, always applying the ratio): with ``a = ratio * n`` (unfloored; ``min(budget,
  n)`` for a token budget) and the scorer's protected window ``w`` (SnapKV's ``window``; 0 for scorers without
  one), ``min = a / beta``, ``max = 2 a - min``; if ``max >= n - w`` then ``max = n - w`` and ``min = 2 a - max``;
  unless ``n >= max >= min >= w`` every layer keeps ``round(a)`` (the fall-back kvpress takes); otherwise layer
  ``i`` of ``L`` keeps ``round(max - i (max - min) / (L - 1))``. ``round`` is Python's (halves to even), as in
  kvpress. A one-layer model keeps ``round(a)``.
- ``adakv`` (AdaKV, Feng et al., 2024, arXiv:2407.11550; kvpress ``AdaKVPress``): a layer keeps ``H * k`` tokens
  (``k`` the uniform count, ``H`` its KV heads), chosen by one top-k over the scores of all its heads, after each
  head's ``floor(alpha_safeguard * k)`` best tokens (at least one when ``alpha_safeguard > 0``, as kvpress 0.5.5)
  are set aside as kept (kvpress's safeguard, default 0.20).
  Heads then keep different counts.

Ties: among equal scores the older token goes first (then the lower head, for ``adakv``), as everywhere in
kvcompress; kvpress's ``topk`` leaves ties unspecified. Tokens a scorer protects (SnapKV's window, the sinks of
expected attention) rank above every score in each allocation.

Memory of uneven heads (``adakv``, and ``kvzip``'s head-level budgets): once a layer has compressed, its kept real
tokens move into ragged storage (``kvcompress.core.ragged``): blocks of 16-256 tokens, each owned by one sequence
and KV head, so the layer holds the sum of its heads' counts plus at most one block of slack per head (the block is
at most 1/32 of a head's mean count: ~1.6 % slack on average). ``CompressedCache.nbytes()`` reports the blocks held;
the layer then only appends, and a decoding step attends over every head's blocks at once (batched products and a
per-head segment softmax, no loop over heads). ``ragged=False`` keeps the slot layout instead: one buffer as wide
as the layer's fullest head, the shorter heads' extra slots masked (the bytes of heads x the fullest head). Beam
search and ``num_return_sequences > 1`` work on both: a ragged cache copies each new sequence's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, ints, number, one_of, param
from kvcompress.core.contract import Keep, KeepMask
from kvcompress.core.eviction import lowest_victims, ranked_scores
from kvcompress.core.forward import from_host
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.ragged_layer import RaggedLayer
from kvcompress.core.selection import keep_top
from kvcompress.methods.oneshot import OneShotConfig, kept_per_sequence, prompt_lengths

ALLOCATIONS = ("uniform", "pyramid", "adakv")


@dataclass(frozen=True)
class ScorerConfig(OneShotConfig):
    """The budget fields of a one-shot scorer (its own fields follow them)."""

    budget: int | None = param(None, check_budget)  # or: tokens per layer and KV head (on average: pyramid, adakv)
    allocation: str = one_of(*ALLOCATIONS)  # per layer (pyramid), per head (adakv); methods/allocation.py
    beta: int = param(20, ints(1, 10_000))  # pyramid's steepness (kvpress PyramidKVPress)
    alpha_safeguard: float = param(0.2, number(0, 1))  # adakv: a head keeps this share of its uniform count (kvpress)
    ragged: bool = True  # adakv: heads store their own counts (False: one slot buffer as wide as the fullest head)

    def layer_class(self):
        return allocated_layer_class(self)


def allocated_layer_class(config) -> type[CompressedLayer] | None:
    """The layer of a scorer config: ragged storage under ``adakv`` (unless ``ragged=False``), else the standard."""
    return RaggedLayer if config.allocation == "adakv" and config.ragged else None


def pyramid_count(n: int, average: float, window: int, beta: int, layer: int, layers: int) -> int:
    """Tokens layer ``layer`` of ``layers`` keeps of ``n`` under PyramidKV's schedule (see the module docstring),
    ``average`` the uniform share ``ratio * n`` (unfloored) or ``min(budget, n)``; at least 1, at most ``n``."""
    share = (window + average) - window  # kvpress's arithmetic, step by step (the roundings then agree)
    low = share / beta
    high = share * 2 - low
    if high >= n - window:
        high = n - window
        low = share * 2 - high
    if layers < 2 or not n >= high >= low >= window:
        count = round(average)
    else:
        steps = (high - low) / (layers - 1)
        count = round(high - layer * steps)
    return max(1, min(n, count))


def allocated_keep(
    policy, layer: CompressedLayer, scores: torch.Tensor, protected: torch.Tensor | None, window: int = 0
) -> Keep | KeepMask | None:
    """What ``layer`` keeps of its prompt under ``policy.config``'s allocation, from ``scores`` ``[B, H or 1, W]``
    (higher kept) and ``protected`` tokens; ``window``: the scorer's protected window (pyramid's ``w``)."""
    config = policy.config
    # uniform and pyramid: an int where every sequence holds the same count (no host read); adakv shares tensors
    n_real = prompt_lengths(layer) if config.allocation != "adakv" else layer.valid[:, 0].sum(-1)
    keep = kept_per_sequence(n_real, config.ratio, config.budget)
    if config.allocation == "pyramid":
        layers = getattr(policy, "layer_count", None)
        if layers is None:
            raise ValueError("allocation='pyramid' needs the model's layer count: build the cache with cache_for")

        def count(n: int) -> int:
            average = n * config.ratio if config.ratio is not None else min(config.budget, n)
            return pyramid_count(n, average, window, config.beta, policy.layer_idx, layers)

        # per-sequence lengths: once per prompt, so host reads are fine here
        keep = count(n_real) if isinstance(n_real, int) else from_host(list(map(count, n_real.tolist())), layer.device)
    if config.allocation != "adakv":
        return keep_top(layer, scores, keep, protected)
    heads = layer.slots.token_idx.shape[1]
    floor = (keep * config.alpha_safeguard).floor().long()
    if config.alpha_safeguard > 0:  # kvpress 0.5.5: at least one token per head
        floor = floor.clamp(min=1)
    return heads_share(layer, scores, protected, heads * keep, floor)


def heads_share(
    layer: CompressedLayer,
    scores: torch.Tensor,
    protected: torch.Tensor | None,
    total: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> KeepMask:
    """Keep ``total`` ``[B]`` tokens of each sequence over all the layer's heads by one top-k of ``scores``, after
    each head's ``floor`` ``[B]`` best tokens are kept first; ties evict the older token, then the lower head."""
    ranked = ranked_scores(Keep(scores, 0, protected), layer)
    batch, heads, width = ranked.shape
    if floor is not None and bool((floor > 0).any()):
        order = lowest_victims(ranked, layer.token_idx, width, layer.ordered)
        place = places(order)
        best = (place >= width - floor[:, None, None]) & layer.valid
        ranked = ranked.masked_fill(best, torch.inf)
    # token-major flattening: a stable sort then evicts the older token first among equal scores, then the lower head
    # (a one-shot layer compresses while dense: its slots are in stream order)
    flat = ranked.transpose(1, 2).reshape(batch, width * heads)
    order = flat.argsort(dim=-1, stable=True)
    place = places(order)
    dropped = place < (width * heads - total)[:, None]
    return KeepMask(~dropped.reshape(batch, width, heads).transpose(1, 2))


def places(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order`` along its last dimension: each position's place in the order."""
    steps = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, steps)
