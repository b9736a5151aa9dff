"""Validation helpers for method configs: each raises ``ValueError`` naming the parameter and its allowed range."""

from __future__ import annotations

import math


def check_budget(budget: object, name: str = "budget") -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{name} must be an integer >= 1 (tokens kept per layer and KV head), got {budget!r}")


def check_int_range(value: object, name: str, low: int, high: int | float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        upper = "inf" if high == math.inf else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")


def check_ratio(ratio: object, name: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name} must be a fraction of the prompt in (0, 1], got {ratio!r}")


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
