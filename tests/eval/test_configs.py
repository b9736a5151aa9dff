from __future__ import annotations

import pytest

from kvcompress.eval.configs import EvalConfig, expand_configs, parse_budget, parse_method


def test_parse_method_reads_typed_parameters():
    assert parse_method("h2o:heavy_ratio=0.25, budget=64") == ("h2o", {"heavy_ratio": 0.25, "budget": 64})
    assert parse_method("streaming:position_mode=original") == ("streaming", {"position_mode": "original"})
    with pytest.raises(ValueError, match="method must be one of"):
        parse_method("nope")
    with pytest.raises(ValueError, match="key=value"):
        parse_method("h2o:heavy")


def test_parse_budget_accepts_tokens_and_ratios_only():
    assert parse_budget("128") == 128 and parse_budget("0.25") == 0.25 and parse_budget(64.0) == 64
    for bad in ("0", "-3", "1.5", "abc", True):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_expand_configs_runs_full_once_and_kept_ratios_for_every_budgeted_method():
    configs = expand_configs(["full", "window", "snapkv", "h2o:heavy_ratio=0.25"], [64, 0.5])
    assert configs == [
        EvalConfig("full", (), None),
        EvalConfig("window", (), 64),
        EvalConfig("window", (), 0.5),
        EvalConfig("snapkv", (), 64),
        EvalConfig("snapkv", (), 0.5),
        EvalConfig("h2o", (("heavy_ratio", 0.25),), 64),
        EvalConfig("h2o", (("heavy_ratio", 0.25),), 0.5),
    ]
    assert configs[4].cache_params() == {"ratio": 0.5}  # a ratio method takes the kept ratio itself
    assert configs[2].cache_params(compressed_tokens=1001) == {"budget": 500}  # floor(0.5 * 1001), as ratios round
    assert configs[6].cache_params(compressed_tokens=1) == {"heavy_ratio": 0.25, "budget": 1}
    with pytest.raises(ValueError, match="compressed tokens"):
        configs[2].cache_params()
    assert configs[5].label == "h2o(heavy_ratio=0.25)"


def test_expand_configs_keeps_a_budget_fixed_in_the_method_string():
    assert expand_configs(["tova:budget=10"], [64, 128]) == [EvalConfig("tova", (), 10)]


def test_expand_configs_rejects_bad_method_parameters_before_running():
    with pytest.raises(ValueError, match="unknown parameter"):
        expand_configs(["window:sinks=4"], [64])
