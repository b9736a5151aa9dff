"""``without_grad``: ``torch.no_grad`` for functions that run at every layer of every decoding step."""

from __future__ import annotations

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
