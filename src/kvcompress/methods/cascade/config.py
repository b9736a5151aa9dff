"""Cascading KV Cache (Willette et al., 2024, arXiv:2406.17808 v1, "Training-Free Exponential Extension of Sliding
Window Context with Cascading KV Cache").

A sink cache whose window of ``|C|`` slots is split into ``N`` circular buffers ("cascades") of ``W = |C|/N`` slots.
Cascade ``i`` (0-based) accepts only every ``b^i``-th token (``b = 2``), so the cache spans about ``W (2^N - 1)``
tokens at a sink cache's memory. When cascade ``i`` does not accept, the token evicted from cascade ``i-1`` competes
with cascade ``i``'s newest token: the larger exponential moving average (EMA) of received attention stays, the other
is dropped. Positions are re-indexed inside the cache every step (StreamingLLM style: none exceeds ``S + |C| - 1``).

As in v1 of the paper: acceptance by the global clock ``(p - S) mod b^i == 0``; Algorithm 1's four insertion cases
plus its eager add into an empty cascade; the EMA ``mu <- gamma mu + (1 - gamma) s`` of post-softmax attention over
sinks + cache (+ self), sinks dropped, reduced over all query heads, new tokens entering with 0, in fp32;
homogeneous heads (one decision per token for all KV heads); positions = ranks 0.. in stream order, the query at its
own key's rank; per step: insert, attend, EMA. ``eager_fill`` (fill every cascade until the cache is full) is the
authors' later code, off by default.

Choices where the paper is silent or differs from its code (all overridable):

- ``budget`` counts the sinks: ``budget = S + |C|`` (the paper keeps ``S`` sinks beside a window of ``|C|``, "window
  1024 => 1028 tokens"). Every cascade has ``W = floor(|C| / N)`` slots: ``used_budget = S + N W`` are stored (at
  most ``N - 1`` fewer than asked, never more).
- a forward that fits in the first cascade (``W`` slots) is kept whole; a longer one meets the acceptance schedule.
- ties go to the incoming token (``tie="incoming"``: the authors' code; Algorithm 1's strict ``>`` is
  ``tie="resident"``). ``select_tokens=False`` is Tab. 3's "w/o token selection" ablation (the incoming token
  always wins).
- ``gamma=None`` computes ``exp(-N ln(100) / |C|)`` (App. B Eq. 14), not Table 6's truncated values.
- ``prefill="exact"`` (default, v1) runs a forward's tokens exactly as token-by-token decoding (inside each layer
  token ``m`` is inserted, attends and updates the EMA before token ``m + 1``; the MLPs still run batched).
  ``prefill="chunked"`` is the later official strided variant: a chunk of ``q`` tokens attends causally to itself
  plus the frozen cache, the EMA advances in closed form with query ``m`` weighted ``(1 - gamma) gamma^(q-1-m)``
  (the chunk's own keys start from 0), then the chunk is inserted token by token with those scores.
- batches: per-sequence bookkeeping; the clock and the sinks count each sequence's real tokens, so left padding
  changes nothing; padding is never stored and its queries update no score.
- with ``N = 1`` (or ``select_tokens=False``) scores are never consulted and the EMA is not computed: a circular
  sink cache.
- sliding-window layers of hybrid models (Gemma-3's local layers; none in the paper): the budget is
  ``min(budget, window)``. A budget holding the window leaves nothing to choose: the generic ``CompressedLayer``
  keeps the window (the model's own result). A smaller budget runs the rings; stored tokens outside the window are
  masked by stream index as the model does (their EMA decays, so they lose the next comparisons; sinks stay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcompress.core.checks import check_budget, check_int_range, ints, number, one_of, param
from kvcompress.core.contract import MethodConfig
from kvcompress.core.layer import CompressedLayer
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.policy import CascadePolicy
from kvcompress.methods.cascade.quantized import QuantizedCascadeLayer


@dataclass(frozen=True)
class CascadeConfig(MethodConfig):
    """Sinks + N cascading circular sub-caches with attention-EMA token selection."""

    budget: int = param(2052, check_budget)  # per layer and KV head: sinks + |C| (paper: S = 4, |C| = 2048)
    sinks: int = 4  # S attention sinks, never evicted, in addition to the cascades (paper: 4)
    cascades: int = 4  # N sub-caches of |C| / N slots each (paper: 4; 2 for MMLU; ablation 1, 2, 4, 8)
    base: int = param(2, ints(2))  # cascade i accepts every base^i-th token (paper: 2; ablation 3, 4)
    gamma: float | None = param(None, number(0, 1, "[)", " or None (exp(-N ln(100) / |C|))"))  # EMA (paper Eq. 14)
    reduction: str = one_of("mean", "median", "max")  # head reduction before the EMA (paper: mean)
    tie: str = one_of("incoming", "resident")  # equal scores: incoming wins (authors' code), or resident (Alg. 1)
    select_tokens: bool = True  # False: no token selection, the incoming token always wins (Tab. 3 ablation)
    eager_fill: bool = False  # True: every cascade accepts until the cache is full (later official code, not v1)
    prefill: str = one_of("exact", "chunked")  # multi-token forwards: as token by token (v1) or later variant

    name = "cascade"
    paper = "https://arxiv.org/abs/2406.17808"
    policy_class = CascadePolicy

    @property
    def width(self) -> int:
        """``W = floor(|C| / N)``: the slots of one cascade (``|C| = budget - sinks``, all cascades together)."""
        return (self.budget - self.sinks) // self.cascades

    @property
    def used_budget(self) -> int:
        """``S + N W``: slots stored per layer and KV head (``budget`` rounded down)."""
        return self.sinks + self.cascades * self.width

    @property
    def ema_gamma(self) -> float:
        return math.exp(-math.log(100.0) / self.width) if self.gamma is None else float(self.gamma)

    @property
    def span(self) -> int:
        """Approximate context length ``W (b^N - 1) / (b - 1)`` (paper Eq. 4, excluding the sinks)."""
        return self.width * (self.base**self.cascades - 1) // (self.base - 1)

    def layer_class(self) -> type[CascadeLayer]:
        return CascadeLayer if self.kv_bits == 16 else QuantizedCascadeLayer

    def connect(self, layers: list[CompressedLayer]) -> None:
        """The cascade layers (``N > 1``) share one buffer: a decoding step moves all their tokens (``ring_decode``)."""
        rings = [layer for layer in layers if isinstance(layer, CascadeLayer) and layer.cascades > 1]
        if len(rings) > 1:
            for layer in rings:
                layer.ring_layers = rings

    def sliding_layer_class(self, window: int) -> type[CompressedLayer]:
        """On a sliding-window layer: the generic layer keeping the window when the budget holds it, else the rings."""
        return CompressedLayer if self.budget >= window else self.layer_class()

    def validate(self) -> None:
        check_int_range(self.sinks, "sinks", 0, self.budget - 1, "budget - 1")
        check_int_range(self.cascades, "cascades", 1, self.budget - self.sinks, "budget - sinks")
        if (self.cascades - 1) * math.log2(self.base) >= 62:
            raise ValueError(
                f"base ** (cascades - 1) must stay below 2**62 (the last cascade's acceptance stride), "
                f"got base={self.base}, cascades={self.cascades}"
            )
