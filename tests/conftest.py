"""Shared fixtures: tiny random models (mechanics only) and helpers to drive one cache layer by hand."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def tiny(kind: str):
    from kvcompress.models import tiny_model

    return tiny_model(kind, seed=0)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny("qwen2")
