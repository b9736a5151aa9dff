"""Shared pieces of the one-shot baselines (``*_oneshot``): a ratio-or-tokens budget per sequence.

The one-shot variants of H2O, TOVA, Scissorhands and StreamingLLM compress once after the prompt, like SnapKV and
NaCl, at the same kept count: ``max(1, floor(ratio * n))`` of a sequence's ``n`` real prompt tokens, or a fixed
number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, check_ratio, param
from kvcompress.core.contract import LayerView, MethodConfig
from kvcompress.core.selection import ratio_budget


def kept_per_sequence(n_real: torch.Tensor | int, ratio: float | None, budget: int | None) -> torch.Tensor | int:
    """Tokens kept per sequence (``[B]``) from the real prompt lengths ``n_real`` (``[B]``, or one int for all)."""
    if isinstance(n_real, int):
        return min(n_real, budget) if budget is not None else min(ratio_budget(n_real, ratio), n_real)
    if budget is not None:
        return torch.clamp(n_real, max=budget)
    return torch.minimum(ratio_budget(n_real, ratio), n_real)


def share_of(count: torch.Tensor | int, fraction: float) -> torch.Tensor | int:
    """``floor(fraction * count)`` in float64, of ``[B]`` counts or an int."""
    return int(count * fraction) if isinstance(count, int) else (count.double() * fraction).floor().long()


def prompt_lengths(layer: LayerView) -> torch.Tensor | int:
    """Each sequence's real tokens (``[B]``), or one int (no host read) where every slot of the view holds one."""
    return layer.view_width if layer.all_valid else layer.valid[:, 0].sum(-1)


def check_ratio_or_budget(method: str, ratio: object, budget: object) -> None:
    if (budget is None) == (ratio is None):
        raise ValueError(f"{method} needs exactly one of ratio (in (0, 1]) or budget (tokens, >= 1)")


@dataclass(frozen=True)
class OneShotConfig(MethodConfig):
    """The budget of a one-shot config: ``ratio`` or ``budget``, exactly one."""

    ratio: float | None = param(None, check_ratio)  # kept fraction of the prompt, in (0, 1] (give this or budget)
    budget: int | None = param(None, check_budget)  # or: tokens kept per layer and KV head

    def validate(self) -> None:
        check_ratio_or_budget(self.name, self.ratio, self.budget)
