"""``without_grad``: ``torch.no_grad`` for functions that run at every layer of every decoding step;
``recorded_as_computed``: what a backward pass through a compressed cache reads, saved as a copy."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def without_grad(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run without recording gradients: a ``torch.no_grad`` context (microseconds per call) entered only
    where gradients are on."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        with torch.no_grad():
            return function(*args, **kwargs)

    return wrapper


def recorded_as_computed() -> contextlib.AbstractContextManager:
    """Every tensor autograd saves inside this block is saved as a copy: a compressed cache writes its slots, rings
    and states in place at later steps, which would otherwise change what an earlier step's backward reads. Where
    gradients are off, nothing (a null context)."""
    if not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda tensor: tensor)
