"""BUZZ parameter estimation: Theorem 3.1 and the (k, w, T, s) that hit a target average or peak cache size.

Theorem 3.1 of BUZZ (Zhao et al., 2024, arXiv:2410.23079) sets the threshold from the window and the stride,
``T / w = (s² + 1) / (s + 1)`` for odd ``s`` and ``s − 1`` for even ``s``: the steady-state number of sampled history
tokens ``a*`` (the fixed point of ``a = a/ŝ + (T − a)/s``) then equals ``w``.

Sizes are what a layer stores between decoding steps (what a ``streaming`` or ``h2o`` cache keeps constant):
*peak* = ``k + w + T`` (the step triggering an eviction attends one more, as a fixed-budget cache attends ``budget +
1``); *average* over steady decoding = ``k + w + (a' + T) / 2``, ``a'`` the middle length right after an eviction,
from the exact integer recurrence (ceil counts, trigger at ``M = T + 1``), not the theorem's real-valued fixed point
(about one token lower).
"""

from __future__ import annotations

import math
from functools import lru_cache

from kvcompress.core.checks import check_choice, check_int_range


def theorem_ratio(stride: int) -> float:
    """T / w from Theorem 3.1 (Eq. 6): ``(s² + 1) / (s + 1)`` for odd ``s``, ``s − 1`` for even ``s``."""
    check_int_range(stride, "stride", 3)  # s <= 2 never shrinks the cache
    return (stride * stride + 1) / (stride + 1) if stride % 2 else float(stride - 1)


def middle_after_eviction(old: int, new: int, stride: int) -> int:
    """Old tokens after one eviction: ``⌈n_old / ŝ⌉ + ⌈n_new / s⌉``."""
    return -(-old // ((stride + 1) // 2)) + -(-new // stride)  # ŝ = ⌊(s + 1) / 2⌋


def steady_sizes(sinks: int, window: int, threshold: int, stride: int) -> tuple[float, int, int]:
    """(average, minimum, peak) stored length per layer and head in steady decoding, from the middle lengths right
    after each eviction (the last 8 of 200 cycles)."""
    after = [0]
    for _ in range(200):
        after.append(middle_after_eviction(after[-1], threshold + 1 - after[-1], stride))
    cycle = after[-8:]
    steps = sum(threshold - a + 1 for a in cycle)  # a cycle holds a', a' + 1, ..., T after its steps
    total = sum((a + threshold) * (threshold - a + 1) / 2 for a in cycle)
    return sinks + window + total / steps, sinks + window + min(cycle), sinks + window + threshold


def threshold_for(window: int, stride: int, tw_ratio: float | None = None) -> int:
    """T = round(r · w) with r = ``tw_ratio`` or Theorem 3.1's ratio; at least 1."""
    ratio = theorem_ratio(stride) if tw_ratio is None else tw_ratio
    return max(1, round(ratio * window))


@lru_cache(maxsize=1024)
def buzz_params(
    budget: int, kind: str = "average", sinks: int = 4, stride: int = 5, tw_ratio: float | None = None
) -> tuple[int, int, int, int]:
    """(k, w, T, s) whose steady-state ``kind`` stored length is closest to ``budget``. Peak: the largest ``w`` with
    ``k + w + T <= budget``. Average: the ``w`` whose simulated average is nearest (ties to the smaller ``w``), from
    the guess ``w = (B − k) / (1.5 + r/2)`` (``k + w + (a* + T) / 2`` with ``a* = w``, ``T = r w``)."""
    check_choice(kind, "budget_kind", ("average", "peak"))
    ratio = theorem_ratio(stride) if tw_ratio is None else tw_ratio
    if budget < sinks + 1 + threshold_for(1, stride, ratio):
        raise ValueError(
            f"budget must be at least sinks + 1 + T(w=1) = {sinks + 1 + threshold_for(1, stride, ratio)} "
            f"for sinks={sinks}, stride={stride}, T/w={ratio:.3g}; got {budget!r}"
        )
    if kind == "peak":
        window = max(1, math.floor((budget - sinks) / (1 + ratio)) + 1)
        while window > 1 and sinks + window + threshold_for(window, stride, ratio) > budget:
            window -= 1
    else:
        guess = max(1, round((budget - sinks) / (1.5 + ratio / 2)))
        average = lambda w: steady_sizes(sinks, w, threshold_for(w, stride, ratio), stride)[0]  # noqa: E731
        window = min(range(max(1, guess - 6), guess + 7), key=lambda w: (abs(average(w) - budget), w))
    return sinks, window, threshold_for(window, stride, ratio), stride
