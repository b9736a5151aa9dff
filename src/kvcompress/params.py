"""Parameters from text: ``key=value`` pairs (CLI ``-p``, eval method specs) parsed by each parameter's type.

A method parameter's text is converted by the type its config field declares: booleans accept
``true/false/1/0/yes/no`` (case-insensitive) and nothing else, integers and floats must parse (floats must be
finite), ``none``/``null`` is ``None`` where the field allows it, and text fields stay text. Anything else is a
``ValueError`` that names the parameter, the value and what is allowed. Range checks stay with the configs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

from kvcompress.presets import preset_params
from kvcompress.registry import METHODS

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
NONE = ("none", "null")


def split_pairs(items: Sequence[str], option: str = "--param") -> dict[str, str]:
    """``["sinks=4", "position_mode=original"]`` -> ``{"sinks": "4", "position_mode": "original"}`` (text)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{option} takes key=value, got {item!r}")
        if key.strip() in pairs:
            raise ValueError(f"{key.strip()} is given twice in {option} ({pairs[key.strip()]!r} and {value.strip()!r})")
        pairs[key.strip()] = value.strip()
    return pairs


def _allowed_types(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def parse_typed(name: str, text: str, annotation: Any) -> object:
    """Convert ``text`` to a value of ``annotation`` (a config field's type); ``ValueError`` names ``name``."""
    allowed = _allowed_types(annotation)
    if type(None) in allowed and text.lower() in NONE:
        return None
    if str in allowed or any(getattr(kind, "__name__", "") == "PathLike" for kind in allowed):
        return text
    if any(typing.get_origin(kind) is tuple for kind in allowed):
        try:
            return _tuples(json.loads(text))
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a JSON list, e.g. [0, 8], got {text!r}") from None
    if bool in allowed:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        raise ValueError(f"{name} must be true/false (also 1/0, yes/no), got {text!r}")
    if int in allowed:
        try:
            return int(text)
        except ValueError:
            if float not in allowed:
                raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if float in allowed:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {text!r}")
        return value
    raise ValueError(f"{name} cannot be given as text (type {annotation}); got {text!r}")


def _tuples(value: object) -> object:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def method_fields(method: str) -> dict[str, Any]:
    """The parameters of a registry method and their declared types."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}; got {method!r}")
    config = METHODS[method]
    hints = typing.get_type_hints(config)
    return {field.name: hints[field.name] for field in dataclasses.fields(config)}


def method_params(method: str, pairs: dict[str, str]) -> dict[str, object]:
    """Typed parameters of ``method`` from text pairs; unknown names are a ``ValueError`` listing the known ones.
    ``preset=NAME`` is one of them for every method: ``make_config``'s ``preset`` (``kvcompress.presets``: another
    library's settings, e.g. ``snapkv:preset=kvpress``), checked here, or the method's own field where it has one."""
    fields = method_fields(method)
    if "preset" not in fields:
        fields["preset"] = str
        if "preset" in pairs:
            preset_params(pairs["preset"], method)  # a preset unknown, or without settings for the method, raises
    unknown = sorted(set(pairs) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"its parameters are {', '.join(sorted(fields)) or 'none'}"
        )
    return {key: parse_typed(key, text, fields[key]) for key, text in pairs.items()}


def split_spec(spec: str, option: str = "method parameters") -> tuple[str, dict[str, str]]:
    """``"h2o:heavy_ratio=0.25;budget=64"`` -> ``("h2o", {"heavy_ratio": "0.25", "budget": "64"})`` (text): the
    parameters separated by ``;`` (as in a command line's list of methods, where ``,`` separates methods) or ``,``."""
    name, _, rest = spec.strip().partition(":")
    items = [part.strip() for part in rest.replace(";", ",").split(",") if part.strip()]
    return name.strip(), split_pairs(items, option)


def parse_method_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"h2o:heavy_ratio=0.25,budget=64"`` -> ``("h2o", {"heavy_ratio": 0.25, "budget": 64})``."""
    try:
        name, pairs = split_spec(spec)
        return name, method_params(name, pairs)
    except ValueError as error:
        raise ValueError(f"{error} (in {spec!r})") from None
