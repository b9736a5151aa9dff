"""Invariant 4: bad input raises an error naming the parameter and the allowed range."""

from __future__ import annotations

import pytest

import kvcompress
from kvcompress.registry import make_config


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_bad_budget_is_rejected_with_range(budget):
    with pytest.raises(ValueError, match=r"budget must be an integer in \[1, 1048576\]"):
        make_config("h2o", budget=budget)


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5])
def test_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(ValueError, match=r"ratio must be a fraction of the prompt in \(0, 1\]"):
        make_config("snapkv", ratio=ratio)


def test_snapkv_needs_budget_or_ratio():
    with pytest.raises(ValueError, match="exactly one of budget"):
        make_config("snapkv")


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"method must be one of .*streaming"):
        make_config("magic", budget=4)


def test_unknown_parameter_lists_the_method_parameters():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) sink .*sinks"):
        make_config("streaming", budget=8, sink=2)


def test_more_sinks_than_budget_is_rejected():
    with pytest.raises(ValueError, match=r"sinks must be an integer in \[0, budget = 8\], got 9"):
        make_config("streaming", budget=8, sinks=9)


def test_bad_position_mode_is_rejected():
    with pytest.raises(ValueError, match="position_mode must be one of original, cache"):
        make_config("streaming", budget=8, position_mode="rank")


def test_unknown_model_lists_the_known_ones():
    from kvcompress.models import load_model

    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("no-such-model")


def test_cache_for_rejects_bad_budget_before_touching_the_model():
    with pytest.raises(ValueError, match="budget"):
        kvcompress.cache_for(object(), "window", budget=0)
