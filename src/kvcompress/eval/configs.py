"""Method configurations to evaluate: parsing ``"name:key=value,..."`` strings and crossing them with budgets.

A method is given as ``"h2o"`` or ``"h2o:heavy_ratio=0.25"``. Budgets are integers (tokens kept per layer and KV
head, the method's ``budget=``) or floats in ``(0, 1)``: the *kept ratio*, the fraction of the compressed tokens
(the prompt, or the context before the question) that the cache keeps. A method with a ``ratio`` parameter
(SnapKV, the one-shot methods) takes it as that; any other method with a ``budget`` gets, per sample,
``budget = max(1, floor(kept ratio × compressed tokens))``, the rounding of the ratio methods (kvpress rounds
likewise), so every method stores about the same bytes at a kept ratio. A method without a ``budget`` parameter
(``full``) is run once, whatever the budgets; a method whose parameters already fix ``budget`` or ``ratio`` is not
crossed with the budgets either.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvcompress.params import parse_method_spec
from kvcompress.registry import METHODS, make_config


@dataclass(frozen=True)
class EvalConfig:
    """One cache configuration of a run: a registry method, its extra parameters and the budget (or ratio)."""

    method: str
    params: tuple[tuple[str, object], ...] = ()  # extra parameters, sorted by name (budget/ratio excluded)
    budget: int | float | None = None  # tokens kept (int), prompt fraction (float < 1) or None (no budget)

    @property
    def param_dict(self) -> dict[str, object]:
        return dict(self.params)

    def cache_params(self, compressed_tokens: int | None = None) -> dict[str, object]:
        """Keyword arguments for ``kvcompress.cache_for(model, self.method, **...)``.

        A kept ratio becomes the method's ``ratio``, or, for a method with a ``budget`` only, the budget it gives
        for ``compressed_tokens`` (required then)."""
        params = self.param_dict
        if isinstance(self.budget, float):
            if "ratio" in _fields(self.method):
                params["ratio"] = self.budget
            elif compressed_tokens is None:
                raise ValueError(f"{self.method} has no ratio: a kept ratio needs the number of compressed tokens")
            else:
                params["budget"] = max(1, math.floor(self.budget * compressed_tokens))
        elif self.budget is not None:
            params["budget"] = self.budget
        return params

    @property
    def label(self) -> str:
        """Method name with its extra parameters, e.g. ``h2o(heavy_ratio=0.25)`` (the budget is not in it)."""
        return method_label(self.method, self.param_dict)

    def key(self) -> str:
        """A canonical string identifying this configuration (method, parameters and budget)."""
        return json.dumps([self.method, self.param_dict, self.budget], sort_keys=True)


def method_label(method: str, params: dict[str, object]) -> str:
    if not params:
        return method
    return method + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"


def parse_method(spec: str) -> tuple[str, dict[str, object]]:
    """``"h2o:heavy_ratio=0.25,budget=64"`` -> ``("h2o", {"heavy_ratio": 0.25, "budget": 64})``, typed."""
    return parse_method_spec(spec)


def parse_budget(value: str | int | float) -> int | float:
    """An int >= 1 (tokens) or a float in (0, 1) (a prompt ratio); ``"0.1"`` and ``"128"`` are accepted."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"budget must be an integer >= 1 or a ratio in (0, 1); got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"budget must be an integer >= 1 or a ratio in (0, 1); got {value!r}")
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, float) and 0 < value < 1:
        return value
    raise ValueError(f"budget must be an integer >= 1 or a ratio in (0, 1); got {value!r}")


def _fields(method: str) -> set[str]:
    return {field.name for field in dataclasses.fields(METHODS[method])}


def expand_configs(methods: Sequence[str], budgets: Sequence[int | float | str]) -> list[EvalConfig]:
    """Cross method strings with budgets into validated ``EvalConfig``s, in the order given.

    Each config is checked by building the method config once, so a bad parameter fails before any model work.
    """
    parsed_budgets = [parse_budget(b) for b in budgets]
    configs: list[EvalConfig] = []
    for spec in methods:
        name, params = parse_method(spec)
        fields = _fields(name)
        fixed = {"budget", "ratio"} & set(params)
        if fixed or not ({"budget", "ratio"} & fields) or not parsed_budgets:
            budget = params.pop("budget", None)
            if budget is None and "ratio" in params:
                budget = float(params.pop("ratio"))  # type: ignore[arg-type]
            candidates: list[int | float | None] = [budget]
        else:
            candidates = [b for b in parsed_budgets if isinstance(b, float) or "budget" in fields]
        for budget in candidates:
            config = EvalConfig(name, tuple(sorted(params.items())), budget)
            make_config(name, **config.cache_params(compressed_tokens=4096))  # a bad parameter raises ValueError
            if config not in configs:
                configs.append(config)
    return configs
