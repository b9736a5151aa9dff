"""Validation of method configs, each field's check declared with it (``param``, ``ints``, ``number``, ``one_of``):
``ValueError`` naming the parameter, the value and what is allowed. Every range has an upper bound, so no parameter
reaches torch's allocator or overflows an ``int64``."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_TOKENS = 2**20  # token counts (budgets, windows, sinks, histories): the longest context a cache is built for
MAX_SEED = 2**63 - 1  # seeds are hashed as int64
Check = Callable[[object, str, object], None]  # (value, field name, config): raises ValueError


def param(default: Any, check: Check) -> Any:
    """A config field ``check`` validates before ``validate`` (skipped for None where None is the default)."""
    return dataclasses.field(default=default, metadata={"check": check})


def ints(low: int, high: int | str = MAX_TOKENS) -> Check:
    """An integer in ``[low, high]``; ``high`` may name the field that bounds it (``"budget"``; None: no bound)."""

    def check(value: object, name: str, config: object) -> None:
        bound = getattr(config, high) if isinstance(high, str) else high
        named = isinstance(high, str) and bound is not None
        check_int_range(value, name, low, MAX_TOKENS if bound is None else bound, high if named else "")

    return check


def number(low: float, high: float, ends: str = "[]", meaning: str = "") -> Check:
    return lambda value, name, config: check_number(value, name, low, high, ends, meaning)


def one_of(*choices: str, default: str | None = None) -> Any:
    """A text field, one of ``choices``; its default is the first unless given."""
    return param(choices[0] if default is None else default, lambda value, name, c: check_choice(value, name, choices))


def check_budget(budget: object, name: str = "budget", config: object = None) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_TOKENS:
        raise ValueError(
            f"{name} must be an integer in [1, {MAX_TOKENS}] (tokens kept per layer and KV head), got {budget!r}"
        )


def check_int_range(value: object, name: str, low: int, high: int = MAX_TOKENS, high_name: str = "") -> None:
    """An integer in ``[low, high]``; ``high_name`` says which parameter sets the upper bound (``"budget"``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        upper = f"{high_name} = {high}" if high_name else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {upper}], got {value!r}")


def check_number(value: object, name: str, low: float, high: float, ends: str = "[]", meaning: str = "") -> None:
    """A finite real number between ``low`` and ``high``, each included where ``ends`` has a square bracket."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and _finite(value)
    if not ok or value < low or value > high or (value == low and ends[0] == "(") or (value == high and ends[1] == ")"):
        raise ValueError(f"{name} must be a number in {ends[0]}{low}, {high}{ends[1]}{meaning}, got {value!r}")


def check_ratio(ratio: object, name: str = "ratio", config: object = None) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name} must be a fraction of the prompt in (0, 1], got {ratio!r}")


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_path(value: object, name: str, kind: str, what: str) -> None:
    """``value`` is a path (text or ``os.PathLike``) to an existing ``kind`` (``"file"`` or ``"folder"``)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{name} must be the path of {what}, got {value!r}")
    path = Path(value)
    if not (path.is_file() if kind == "file" else path.is_dir()):
        state = "is not a file" if path.is_dir() else "is not a folder" if path.exists() else "does not exist"
        raise ValueError(f"{name}={str(value)!r} {state}; give the path of {what}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False
