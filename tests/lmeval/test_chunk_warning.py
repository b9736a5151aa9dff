"""The lm-eval model warns when its chunks are as long as an evicting method's budget (the method degenerates)."""

from __future__ import annotations

import logging

import pytest

import kvcompress

pytest.importorskip("lm_eval")
from kvcompress.lmeval.model import _warn_if_chunks_fill_the_budget  # noqa: E402


@pytest.mark.parametrize(
    ("method", "budget", "chunk", "warns"),
    [("h2o", 128, 128, True), ("streaming", 64, None, True), ("h2o", 128, 32, False), ("snapkv", 128, 128, False)],
)
def test_warns_only_when_chunks_fill_an_evicting_budget(caplog, method, budget, chunk, warns):
    with caplog.at_level(logging.WARNING, logger="kvcompress.lmeval.model"):
        _warn_if_chunks_fill_the_budget(kvcompress.make_config(method, budget=budget), chunk)
    assert ("keeps only the last chunk" in caplog.text) == warns
