"""Shared fixtures: tiny random models (mechanics only) and helpers to drive one cache layer by hand."""

from __future__ import annotations

import os

import pytest
import torch

from kvcompress.eval.data import DATA_ENV
from kvcompress.models import tiny_model

torch.set_num_threads(1)
os.environ.pop(DATA_ENV, None)  # tasks read the books shipped with the package; a test that needs more says so
# pytest-xdist's workers start with COLUMNS=80, which rich's Console (built when the CLI is imported) would keep
# for good; without it the width follows COLUMNS as each CLI test sets it, as in a single process.
os.environ.pop("COLUMNS", None)


def tiny(kind: str):
    return tiny_model(kind, seed=0)


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny("qwen2")
