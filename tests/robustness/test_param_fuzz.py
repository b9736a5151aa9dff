"""Every parameter of every registered method, fuzzed: a value is either refused with a ``ValueError`` that names
the parameter, or it runs a tiny generate on a tiny random model. Values come as Python objects (the API) and as
``-p`` text (parsed by the field's declared type, as the CLI does). Invalid values of each type (wrong types, NaN,
infinities, integers past int64, text that is no number or boolean) are checked exhaustively without hypothesis."""

from __future__ import annotations

import functools
import json
import math
import re
import types
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import params as text_params
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import tiny_model
from kvcompress.registry import METHODS, method_defaults
from tests.helpers import duo_pattern_file, tiny_tokenizer_dir

# parameters a method needs before anything runs, and groups of which at most one may be given
BASE: dict[str, dict[str, object]] = {
    "snapkv": {"budget": 12, "window": 4},
    "nacl": {"budget": 8},
    "h2o_oneshot": {"budget": 8},
    "tova_oneshot": {"budget": 8},
    "scissorhands_oneshot": {"budget": 8},
    "streaming_oneshot": {"budget": 8},
    "pod": {"block_size": 1},
    "keydiff": {"budget": 8},
    "expected_attention": {"budget": 8},
    "compactor": {"budget": 8},
    "kvzip": {"budget": 8, "tokenizer": tiny_tokenizer_dir()},
    "duo": {"pattern": duo_pattern_file()},
}
EXCLUSIVE = ({"budget", "ratio"}, {"similarity", "starts", "block_size"}, {"head_compression_ratio", "threshold"})
PROMPT = torch.arange(3, 23)[None]  # 20 tokens of the tiny vocabulary
NEW_TOKENS = 3
INVALID_TEXT = {  # -p text every field of that type refuses
    bool: ["maybe", "2", "tru", "", "1.0"],
    int: ["abc", "1.5", "1e3", "true", "", "nan"],
    float: ["abc", "nan", "inf", "-inf", "1e400", "", "true"],
}
INVALID_VALUE = {  # Python values every field of that type refuses
    bool: [0, 1, "no", "yes", 1.0, [True]],
    int: [1.5, True, False, "3", 2**63, -(2**63) - 1, 10**30, [1]],
    float: [math.nan, math.inf, -math.inf, True, "0.5", 10**400, [0.5]],
    str: [1, 2.5, True, ["a"], b"a"],
}


def kinds(annotation: object) -> tuple[object, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def parameters() -> list[tuple[str, str, object]]:
    return [(method, name, hint) for method in METHODS for name, hint in text_params.method_fields(method).items()]


def build(method: str, field: str, value: object) -> kvcompress.MethodConfig:
    base = dict(BASE.get(method, {}))
    for group in EXCLUSIVE:
        if field in group:
            base = {key: val for key, val in base.items() if key not in group}
    return kvcompress.make_config(method, **{**base, field: value})


def assert_refused_by_name(method: str, field: str, value: object, text: bool = False) -> None:
    with pytest.raises(ValueError) as error:
        if text:
            value = text_params.method_params(method, {field: value})[field]
        build(method, field, value)
    assert field in str(error.value), (method, field, value, str(error.value))


@pytest.mark.parametrize(("method", "field", "hint"), parameters(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_value_of_a_wrong_type_is_refused_naming_the_parameter(method, field, hint):
    allowed = kinds(hint)
    for kind, values in INVALID_VALUE.items():
        if kind in allowed and kind is not str:
            for value in values:
                if not any(other is not kind and _matches(value, other) for other in allowed):
                    assert_refused_by_name(method, field, value)
    if str not in allowed and not any(typing.get_origin(kind) is tuple for kind in allowed):
        for kind, texts in INVALID_TEXT.items():
            if kind in allowed:
                for text in texts:
                    if not any(_parses(text, other) for other in allowed if other is not kind):
                        assert_refused_by_name(method, field, text, text=True)


def _matches(value: object, kind: object) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(kind, type) and isinstance(value, kind) and kind is not bool


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _parses(text: str, kind: object) -> bool:
    return kind is type(None) and text.lower() in text_params.NONE


def choices(method: str, field: str) -> list[str]:
    """The choices a text field's error message lists (``must be one of a, b, c``), else its default only."""
    try:
        build(method, field, "\x00not-a-choice")
    except ValueError as error:
        found = re.search(r"must be one of ([\w.\-, ]+?)(?:;|$| \()", str(error))
        if found:
            return [choice.strip() for choice in found.group(1).split(",")]
    default = method_defaults(method)[field]
    return [default] if isinstance(default, str) else []


def value_strategy(method: str, field: str, hint: object) -> st.SearchStrategy:
    options = []
    for kind in kinds(hint):
        if kind is bool:
            options.append(st.booleans())
        elif kind is int:
            options.append(st.integers(-2, 40) | st.sampled_from([2**20 + 1, 2**63 - 1, 2**63, 10**30]))
        elif kind is float:
            options.append(st.floats(-0.5, 1.5) | st.sampled_from([math.nan, math.inf, 1e300, 0.0, 1.0, 3]))
        elif kind is str:
            options.append(st.sampled_from(choices(method, field) or ["x"]) | st.text(max_size=6))
        elif kind is type(None):
            options.append(st.none())
        elif typing.get_origin(kind) is tuple:
            options.append(st.lists(st.integers(-3, 3) | st.none(), max_size=3).map(tuple))
        else:  # a method config (less.base, pod.base) or kernels object
            options.append(st.sampled_from([kvcompress.make_config("window", budget=8), "h2o", 3]))
    return st.one_of(options)


def as_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "no"
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return "none" if value is None else str(value)


@functools.cache
def model():
    return tiny_model("llama", seed=3)


def run_generate(config: kvcompress.MethodConfig) -> torch.Tensor:
    lm = model()
    cache = kvcompress.cache_for(lm, config)
    if type(config).after_prefill is not kvcompress.MethodConfig.after_prefill:  # KVzip compresses in prefill
        prefill(lm, PROMPT[:, :-1], cache)
    return lm.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        **cache_argument(lm, cache),
    )


@pytest.mark.parametrize("method", list(METHODS))
@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_each_value_is_refused_by_name_or_runs_a_tiny_generate(method, data):
    fields = text_params.method_fields(method)
    if not fields:
        assert run_generate(build_default(method)).shape == (1, PROMPT.shape[1] + NEW_TOKENS)
        return
    field = data.draw(st.sampled_from(sorted(fields)), label="parameter")
    value = data.draw(value_strategy(method, field, fields[field]), label="value")
    as_cli_text = data.draw(st.booleans(), label="given as -p text")
    try:
        if as_cli_text:
            value = text_params.method_params(method, {field: as_text(value)})[field]
        config = build(method, field, value)
        output = run_generate(config)
    except ValueError as error:
        assert field in str(error), (method, field, value, str(error))
        return
    assert output.shape == (1, PROMPT.shape[1] + NEW_TOKENS)


def build_default(method: str) -> kvcompress.MethodConfig:
    return kvcompress.make_config(method, **BASE.get(method, {}))
