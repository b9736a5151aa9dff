"""``preset="kvpress"``: one argument sets kvpress's settings; given parameters win; other names are refused; a
method's own ``preset`` parameter (NaCl) is not taken for the library preset."""

from __future__ import annotations

import pytest

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
