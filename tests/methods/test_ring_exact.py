"""The cascade's exact prefill (``methods/cascade/ring_decode.py``: a forward's tokens planned once, stepped in turn)
keeps what feeding the tokens one at a time keeps, and what the per-sequence tensor path keeps, with the same
logits."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument
from kvcompress.methods.cascade import ring_decode
from kvcompress.models.testing import tiny_model
from tests.helpers import per_sequence_path

# the rings fill and turn to ring angles token by token, then chunks push tokens down the rings
CHUNKS = (1,) * 24 + (30, 1, 1, 17, 1)


def _run(model, ids, chunks, reference: bool, per_row_positions: bool, **params):
    cache = kvcompress.cache_for(model, "cascade", budget=14, sinks=2, cascades=3, **params)
    for layer in cache.layers:
        per_sequence_path(layer, reference)
    logits, start = [], 0
    for size in chunks:
        extra = {}
        if per_row_positions:  # position_ids [B, q]: the rotations are built per sequence
            extra["position_ids"] = torch.arange(start, start + size).expand(ids.shape[0], -1)
        out = model(input_ids=ids[:, start : start + size], **cache_argument(model, cache), use_cache=True, **extra)
        logits.append(out.logits)
        start += size
    return torch.cat(logits, 1), cache


@pytest.fixture
def lean_forwards(monkeypatch) -> list[int]:
    """The number of tokens of each forward of several tokens that a layer ran through the planned steps."""
    counts = []
    steps = ring_decode.RingDecode._step_tokens

    def spy(self, query, *args):
        if query.shape[2] > 1:
            counts.append(query.shape[2])
        return steps(self, query, *args)

    monkeypatch.setattr(ring_decode.RingDecode, "_step_tokens", spy)
    return counts


@pytest.mark.parametrize("logits", ["one-matmul", "per-run"])  # the two ways to the logits of the frames
@pytest.mark.parametrize("tie", ["incoming", "resident"])
@pytest.mark.parametrize("per_row_positions", [False, True], ids=["shared-positions", "per-row-positions"])
@pytest.mark.parametrize("batch", [1, 2])
def test_lean_steps_equal_one_token_at_a_time_and_the_per_sequence_path(
    batch, per_row_positions, tie, logits, lean_forwards, monkeypatch
):
    if logits == "per-run":
        monkeypatch.setattr(ring_decode, "DENSE_FRAME_SLOTS", {"cpu": 0})
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (batch, sum(CHUNKS)), generator=torch.Generator().manual_seed(4))
    lean_logits, lean = _run(model, ids, CHUNKS, False, per_row_positions, tie=tie)
    layers = model.config.num_hidden_layers
    assert lean_forwards == [30] * layers + [17] * layers  # both chunks took the lean steps in every layer
    lean_forwards.clear()
    single_logits, single = _run(model, ids, (1,) * sum(CHUNKS), False, per_row_positions, tie=tie)
    reference_logits, reference = _run(model, ids, CHUNKS, True, per_row_positions, tie=tie)
    assert lean_forwards == []
    for other in (single_logits, reference_logits):
        torch.testing.assert_close(lean_logits, other, rtol=1e-4, atol=1e-4)
    for ours, one, theirs in zip(lean.layers, single.layers, reference.layers, strict=True):
        assert torch.equal(ours._tok, one._tok) and torch.equal(ours._tok, theirs._tok)
        assert ours._rings == one._rings  # the same layout (``schedule.Rings``) per sequence
        cascade = slice(ours.sinks, ours.capacity)
        torch.testing.assert_close(ours._score[:, cascade], theirs._score[:, cascade], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)


def test_another_head_reduction_takes_the_same_steps(lean_forwards):
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(6))
    logits, _ = _run(model, ids, CHUNKS, False, False, reduction="max")
    reference_logits, _ = _run(model, ids, CHUNKS, True, False, reduction="max")
    layers = model.config.num_hidden_layers
    assert lean_forwards == [30] * layers + [17] * layers  # every head reduction takes the planned steps
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
