"""Interleaved timing of two sides on one model: ours on kvcompress attention, ``DynamicCache``'s on SDPA.

The two sides alternate call by call (and which goes first), so both see the same machine load; each call's
process CPU time is recorded beside its wall time, and a summary is the median of the per-pair ratios (ours over
theirs, below 1 is faster) with their 10th and 90th percentiles.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from kvcompress.core.attention import ATTENTION_NAME

_CPU = torch.device("cpu")


def use_attention(model: PreTrainedModel, name: str) -> None:
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def timed(fn: Callable[[], object], device: torch.device = _CPU) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call; on a GPU, up to the end of the work it queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def timed_pairs(
    model: PreTrainedModel,
    ours: Callable[[int], object],
    theirs: Callable[[int], object],
    count: int,
    warmup: int = 1,
    after_theirs: Callable[[], object] = lambda: None,
) -> dict[str, float]:
    """Interleave ``count`` timed calls of each side (after ``warmup`` untimed pairs); ratios of ours over theirs."""
    ours_t, theirs_t = [], []
    for i in range(warmup + count):
        sides = [(ATTENTION_NAME, ours, ours_t), ("sdpa", theirs, theirs_t)]
        for name, fn, times in sides if i % 2 == 0 else sides[::-1]:
            use_attention(model, name)
            timing = timed(lambda fn=fn, i=i: fn(i), model.device)
            if i >= warmup:
                times.append(timing)
            if fn is theirs:
                after_theirs()
    return summary(ours_t, theirs_t)


def _quantile(values: Sequence[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> dict[str, float]:
    cpu_ratios = [o[1] / t[1] for o, t in zip(ours, theirs, strict=True)]
    return {
        "ours_cpu_ms": statistics.median(o[1] for o in ours) * 1e3,
        "dynamic_cpu_ms": statistics.median(t[1] for t in theirs) * 1e3,
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_p10": _quantile(cpu_ratios, 0.1),
        "cpu_ratio_p90": _quantile(cpu_ratios, 0.9),
        "wall_ratio": statistics.median(o[0] / t[0] for o, t in zip(ours, theirs, strict=True)),
        "pairs": len(cpu_ratios),
    }
