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
    """``function`` run without recording gradients. ``@torch.no_grad()`` builds and enters a context object at every
    call, a few microseconds at every layer of every step; this enters one only where gradients are on (a forward
    outside ``torch.no_grad`` or ``torch.inference_mode``) and otherwise calls ``function`` as it is."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        with torch.no_grad():
            return function(*args, **kwargs)

    return wrapper


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def recorded_as_computed() -> contextlib.AbstractContextManager:
    """Every tensor autograd saves for the backward pass inside this block is saved as a copy: a compressed cache
    writes its slots, rings and states in place at later steps, which would otherwise change (and invalidate) what an
    earlier step's backward reads. The backward pass then sees exactly the values of the forward. Callers enter it
    only where gradients are on (``torch.is_grad_enabled()``): elsewhere nothing is saved and no context is needed."""
    return torch.autograd.graph.saved_tensors_hooks(_snapshot, _unchanged)
