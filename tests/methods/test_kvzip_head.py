"""KVzip's head level (``kvzip`` with ``level="head"``): the shipped head scores, the kept share, the refusals.

Its kept sets against an independent reference are in ``tests/references/test_kept_sets.py`` (``kvzip-head``
cases), its head scores against the reference reconstruction scores in ``tests/references/test_kvzip.py``, its
logits with nothing evicted in ``tests/test_equivalence.py`` and its save/load round trip in
``tests/test_persist.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcompress
from kvcompress.generation import prefill
from kvcompress.methods.duo.patterns import load_pattern, resolve_path
from kvcompress.methods.kvzip import KVzipConfig
from kvcompress.methods.kvzip.head import KIND, head_ranks, streaming_count
from tests.helpers import duo_pattern_file, kvzip_head_file


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "layers", "kv_heads"), [("smollm2-135m", 30, 3), ("qwen2.5-coder-0.5b", 24, 2)])
def test_the_shipped_scores_are_found_by_layer_count(name, layers, kv_heads):
    path = resolve_path(None, layers, KIND)
    assert path.name == f"{name}.json" and path.parent.name == "kvzip"
    pattern = load_pattern(str(path), KIND)
    assert (pattern.layers, pattern.kv_heads, pattern.sink_size, pattern.recent_size) == (layers, kv_heads, 128, 256)
    assert pattern.meta["calibration"].startswith("KVzip head scores") and pattern.meta["model"] == name
    assert ((pattern.scores > 0) & (pattern.scores <= 1)).all()  # (largest attention probabilities)


@pytest.mark.parametrize("tokens", [1024, 4096, 16384])
def test_the_split_keeps_at_most_the_ratio_with_the_fewest_streaming_heads(tokens):
    """At ratio 0.5 on SmolLM2's 90 heads with a 384-token window: at most half the pairs, and one streaming head
    fewer would keep more (the pairs counted directly)."""
    count = streaming_count(0.5, tokens, 128, 256, 90)

    def kept(streaming: int) -> int:
        return (90 - streaming) * tokens + streaming * min(tokens, 384)

    assert kept(count) <= 0.5 * 90 * tokens < kept(count - 1)


def test_head_ranks_order_scores_with_the_earlier_pair_first_among_equals():
    scores = np.array([[0.5, 0.1], [0.1, 0.9]])
    assert head_ranks(scores).tolist() == [[2, 0], [1, 3]]


def test_the_top_scored_heads_keep_everything(tiny_llama):
    """Tiny pattern scores ``[[0, 3], [2, 1]]``: at ratio 0.5 a 30-token prompt (window 6) has 3 streaming heads,
    so only layer 0's head 1 keeps all 30 tokens."""
    cache = kvcompress.cache_for(
        tiny_llama, "kvzip", level="head", ratio=0.5, pattern=kvzip_head_file(), sink_size=2, recent_size=4
    )
    prefill(tiny_llama, ids_of(1, 30), cache)
    counts = [layer.valid.sum(-1)[0].tolist() for layer in cache.compressed_layers]
    assert counts == [[6, 30], [6, 6]]


# ------------------------------------------------------------------------------------------- refusals


def test_a_model_without_shipped_scores_is_refused_with_the_calibration_command(tiny_llama):
    with pytest.raises(ValueError, match=r"kvzip \(level='head'\) has no shipped .*2-layer.*train kvzip-calibrate"):
        kvcompress.cache_for(tiny_llama, "kvzip", level="head", ratio=0.5)


def test_scores_of_another_model_are_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"have 3 layers, but the model has 2.*kvzip-calibrate"):
        kvcompress.cache_for(tiny_llama, "kvzip", level="head", ratio=0.5, pattern=kvzip_head_file(3, 2))
    cache = kvcompress.cache_for(tiny_llama, "kvzip", level="head", ratio=0.5, pattern=kvzip_head_file(2, 3))
    with pytest.raises(ValueError, match=r"give layer 0 3 KV heads, but the model has 2.*kvzip-calibrate"):
        prefill(tiny_llama, ids_of(1, 12), cache)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"level": "heads"}, r"level must be one of pair, head; got 'heads'"),
        ({"level": "head", "allocation": "layer"}, r"allocation is a parameter of kvzip's pair level"),
        ({"level": "head", "chunk_size": 512}, r"chunk_size is a parameter of kvzip's pair level"),
        ({"sink_size": 4}, r"sink_size is a parameter of kvzip's head level, not of level='pair'"),
        ({"level": "head", "recent_size": -1}, r"recent_size must be an integer"),
        ({"level": "head", "pattern": "/nonexistent/scores.json"}, r"pattern='/nonexistent/scores.json' does not"),
        ({"level": "head", "pattern": duo_pattern_file()}, r"format is 'kvcompress-duo-pattern', not"),
    ],
)
def test_bad_parameters_are_refused_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        KVzipConfig(ratio=0.5, **params)
