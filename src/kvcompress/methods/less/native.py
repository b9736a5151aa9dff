"""PyTorch's own CPU kernels for LESS's small inference kernels, instead of oneDNN's.

On a CPU, PyTorch hands the exact GELU of a contiguous float32 tensor to oneDNN, whose setup per call costs several
times the arithmetic of a decoding step's φ and ψ (a few hundred elements per layer). ``native_kernels`` turns
oneDNN off around them.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch


class _OneDNNOff(AbstractContextManager):
    """While any thread is inside, PyTorch's CPU operators use their own kernels instead of oneDNN's. The switch
    is process-wide (``torch.backends.mkldnn.enabled``): the first thread in turns oneDNN off, the last one out
    restores what it found."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._found = True

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._found = torch.backends.mkldnn.enabled
                torch.backends.mkldnn.enabled = False
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                torch.backends.mkldnn.enabled = self._found


_ONEDNN_OFF = _OneDNNOff()


def native_kernels(like: torch.Tensor) -> AbstractContextManager:
    """A context running PyTorch's CPU operators on their own kernels, for tensors like ``like``; a no-op
    elsewhere (a GPU, or while ``torch.compile`` traces)."""
    if not like.is_cpu or torch.compiler.is_compiling():
        return nullcontext()
    return _ONEDNN_OFF
