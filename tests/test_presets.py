"""``preset="kvpress"``: one argument sets kvpress's settings; given parameters win; other names are refused; a
method's own ``preset`` parameter (NaCl) is not taken for the library preset; a method spec (``eval``,
``leaderboard``, ``generate``) takes it as ``snapkv:preset=kvpress``."""

from __future__ import annotations

import pytest

from kvcompress.eval.configs import expand_configs
from kvcompress.params import parse_method_spec
from kvcompress.registry import make_config


def test_kvpress_preset_sets_the_press_settings_and_parameters_given_override_them():
    snapkv = make_config("snapkv", preset="kvpress", budget=128)
    assert (snapkv.window, snapkv.kernel, snapkv.pooling, snapkv.budget) == (64, 5, "avg", 128)
    assert make_config("snapkv", preset="kvpress", budget=128, window=16).window == 16
    knorm = make_config("knorm", preset="kvpress", budget=32)
    assert (knorm.one_shot, knorm.recent) == (True, 0)
    streaming = make_config("streaming_oneshot", preset="kvpress", budget=32)
    assert (streaming.position_mode, streaming.sinks) == ("original", 4)


def test_unknown_presets_and_methods_without_a_counterpart_are_refused_by_name():
    with pytest.raises(ValueError, match="preset must be one of kvpress"):
        make_config("snapkv", preset="vllm", budget=128)
    with pytest.raises(ValueError, match="no settings for method 'h2o'"):
        make_config("h2o", preset="kvpress", budget=128)


def test_a_method_with_its_own_preset_parameter_takes_the_value():
    assert make_config("nacl", ratio=0.2, preset="official-128k").preset == "official-128k"
    with pytest.raises(ValueError, match="preset"):
        make_config("nacl", ratio=0.2, preset="kvpress")


def test_a_method_spec_takes_the_preset_as_the_cli_and_evaluation_pass_it_on():
    name, params = parse_method_spec("snapkv:preset=kvpress,window=16")
    assert (name, params) == ("snapkv", {"preset": "kvpress", "window": 16})
    snapkv = make_config(name, **params, ratio=0.5)
    assert (snapkv.window, snapkv.kernel, snapkv.pooling) == (16, 5, "avg")
    (config,) = expand_configs(["snapkv:preset=kvpress"], [0.5])
    assert config.label == "snapkv(preset=kvpress)"
    assert make_config(config.method, **config.cache_params()).kernel == 5
    assert parse_method_spec("nacl:preset=official-128k") == ("nacl", {"preset": "official-128k"})
    with pytest.raises(ValueError, match="preset must be one of kvpress; got 'vllm'"):
        parse_method_spec("snapkv:preset=vllm")
    with pytest.raises(ValueError, match="no settings for method 'h2o'"):
        parse_method_spec("h2o:preset=kvpress")
