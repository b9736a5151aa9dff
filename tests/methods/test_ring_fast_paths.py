"""The ring storage's fast paths keep what its per-sequence tensor path keeps and give the same logits.

Fast paths: a forward's tokens planned from the in-step Python counters (``methods/cascade/ring_decode.py``; the
circular sink cache attends before inserting, the cascade inserts first), and a whole forward's moves composed
into one (``schedule.play``). ``tests.helpers.per_sequence_path`` switches a layer to the per-token,
per-sequence reference path.
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument
from kvcompress.methods.cascade import ring_decode
from kvcompress.models.testing import tiny_model
from tests.helpers import per_sequence_path

CACHES = {
    "streaming": ("streaming", {"budget": 12, "sinks": 2}),
    "streaming-no-sinks": ("streaming", {"budget": 9, "sinks": 0}),
    "cascade-3": ("cascade", {"budget": 14, "sinks": 2, "cascades": 3}),
    "cascade-1": ("cascade", {"budget": 9, "sinks": 1, "cascades": 1}),
    # the chunk inserted at once after the chunk attention (``schedule.play``): selections, ties, eager fill
    "cascade-3-chunked": ("cascade", {"budget": 14, "sinks": 2, "cascades": 3, "prefill": "chunked"}),
    "cascade-2-chunked-resident-ties": (
        "cascade",
        {"budget": 12, "sinks": 1, "cascades": 2, "prefill": "chunked", "tie": "resident", "eager_fill": True},
    ),
}
CHUNKS = {
    "one-by-one": (1,) * 40,
    "mixed": (7, 1, 1, 13, 1, 1, 1, 5, 1, 1, 4, 1, 1),
    "longer-than-the-ring": (25, 1, 1, 30, 1, 1),
}


def _run(model, method: str, params: dict, ids: torch.Tensor, chunks, reference: bool):
    cache = kvcompress.cache_for(model, method, **params)
    for layer in cache.layers:
        per_sequence_path(layer, reference)
    logits, start = [], 0
    for size in chunks:
        out = model(input_ids=ids[:, start : start + size], **cache_argument(model, cache), use_cache=True)
        logits.append(out.logits)
        start += size
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("logits", ["one-matmul", "per-run"])  # the cascade's two ways to its decoding logits
@pytest.mark.parametrize("batch", [1, 2])  # 2: the model's position_ids are one row [1, q] for the whole batch
@pytest.mark.parametrize("chunks", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("name", CACHES)
def test_fast_paths_equal_the_per_sequence_path(name, chunks, batch, logits, monkeypatch):
    if logits == "per-run":
        monkeypatch.setattr(ring_decode, "DENSE_FRAME_SLOTS", {"cpu": 0})
    model = tiny_model("llama")
    method, params = CACHES[name]
    ids = torch.randint(0, model.config.vocab_size, (batch, sum(chunks)), generator=torch.Generator().manual_seed(3))
    fast_logits, fast = _run(model, method, params, ids, chunks, reference=False)
    reference_logits, reference = _run(model, method, params, ids, chunks, reference=True)
    torch.testing.assert_close(fast_logits, reference_logits, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(fast.layers, reference.layers, strict=True):
        assert ours._in_step and not theirs._in_step
        assert torch.equal(ours._tok, theirs._tok)  # the same tokens in the same slots
        cascade = slice(ours.sinks, ours.capacity)  # (sinks have no EMA; the scratch slot holds nothing)
        torch.testing.assert_close(ours._score[:, cascade], theirs._score[:, cascade], rtol=1e-5, atol=1e-6)
        # later layers' inputs differ by the float rounding of the earlier layers' attention (other op order)
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "per-sequence"])
def test_sinks_do_not_drift_in_a_long_stream(reference):
    """One ring keeps its sinks at angle j + F and rewrites them from a copy whenever F changes: after hundreds of
    overwrites they are still the keys the model wrote (a rotation accumulated step by step would drift)."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(5))
    cache = kvcompress.cache_for(model, "streaming", budget=8, sinks=2)
    for layer in cache.layers:
        per_sequence_path(layer, reference)
    sinks_at = {}
    for step in range(ids.shape[1]):
        model(input_ids=ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True)
        if step in (20, 399):
            sinks_at[step] = [layer.keys[:, :, :2].clone() for layer in cache.layers]
    assert cache.layers[0]._shared.passed[0] == 400 - 8  # every token after the ring filled overwrote one
    for early, late in zip(sinks_at[20], sinks_at[399], strict=True):
        torch.testing.assert_close(late, early, rtol=1e-5, atol=1e-5)


def test_a_full_cascade_decodes_in_one_frame_per_ring():
    """Keys sit at their ring's angle (``schedule.slot_angle``): one frame per ring, each full ring one run of slots
    whatever its start, the sinks in the oldest ring's frame; a prefill chunk between decoding steps and the
    per-sequence path (the same convention) give the same logits."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(8))
    method, params = CACHES["cascade-3"]
    chunks = (1,) * 30 + (9,) + (1,) * 31
    fast_logits, fast = _run(model, method, params, ids, chunks, reference=False)
    reference_logits, reference = _run(model, method, params, ids, chunks, reference=True)
    torch.testing.assert_close(fast_logits, reference_logits, rtol=1e-4, atol=1e-4)
    layer, stored = fast.layers[0], params["budget"]
    assert max(layer._shared.passed) > layer.width  # ring 0 wrapped more than once
    targets, runs = layer._frames(stored - 1, layer._shared)
    width = layer.width
    assert len(targets) == params["cascades"]  # one frame per ring, the sinks in the oldest ring's
    rings = [(2 + i * width, 2 + (i + 1) * width) for i in range(params["cascades"])]
    assert runs == [(0, 2, 0)] + [(lo, hi, (i + 1) % params["cascades"]) for i, (lo, hi) in enumerate(rings)]
    torch.testing.assert_close(layer.keys, reference.layers[0].keys, rtol=1e-5, atol=1e-5)


@pytest.fixture
def moved(monkeypatch) -> list[bool]:
    """The decisions, one per in-step decoding step: did the first layer move every layer's tokens?"""
    decisions = []
    move_all = ring_decode._move_all
    monkeypatch.setattr(ring_decode, "_move_all", lambda *a: decisions.append(move_all(*a)) or decisions[-1])
    return decisions


def stacked(cache) -> bool:
    """Whether the cascade layers' buffers are views of one buffer per tensor (``ring_decode``)."""
    buffers = [(layer._kv, layer._meta, layer._score) for layer in cache.layers]
    found = [
        cache.forward_pass.stacked(name, [b[i] for b in buffers], make=False)
        for i, name in enumerate(ring_decode.STACKED)
    ]
    return all(item is not None for item in found)


def test_a_decoding_step_moves_every_layer_at_once_until_the_batch_is_reordered(moved):
    """The cascade layers of one cache share a buffer and the first layer of a decoding step moves the old tokens of
    all of them (``ring_decode``); reordering the batch (beam search) gives the shared buffer up and each layer moves
    its own. Both keep what the per-sequence path keeps."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    method, params = CACHES["cascade-3"]
    caches = {}
    for reference in (False, True):
        cache = kvcompress.cache_for(model, method, **params)
        for layer in cache.layers:
            per_sequence_path(layer, reference)
        caches[reference] = cache
    for step in range(ids.shape[1]):
        if step == 25:
            for cache in caches.values():
                cache.reorder_cache(torch.tensor([1, 0]))
        logits = {}
        for reference, cache in caches.items():
            row = ids[:, step : step + 1] if step < 25 else ids.flip(0)[:, step : step + 1]
            logits[reference] = model(input_ids=row, **cache_argument(model, cache), use_cache=True).logits
        torch.testing.assert_close(logits[False], logits[True], rtol=1e-4, atol=1e-4)
    # one decision per in-step decoding step, by the first layer; the first token finds the later layers not
    # initialised yet, the second their buffers apart (stacked when that forward closes); reordering leaves the
    # in-step path (the schedule per sequence) and the shared buffer
    assert moved == [False, False] + [True] * 23
    assert not stacked(caches[False]) and not caches[False].forward_pass._stacks
    for ours, theirs in zip(caches[False].layers, caches[True].layers, strict=True):
        assert torch.equal(ours._tok, theirs._tok)
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)


def test_a_reset_cache_shares_its_buffer_again_and_odd_layers_stay_alone(moved):
    """After ``reset`` the layers share a buffer again from their first decoding steps and decode as before; layers
    whose buffers cannot be stacked (another shape) each move their own tokens."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    method, params = CACHES["cascade-3"]
    cache = kvcompress.cache_for(model, method, **params)
    runs = []
    for _ in range(2):
        logits = [
            model(input_ids=ids[:, step : step + 1], **cache_argument(model, cache), use_cache=True).logits
            for step in range(ids.shape[1])
        ]
        runs.append(torch.cat(logits, 1))
        cache.reset()
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
    assert moved == ([False, False] + [True] * (ids.shape[1] - 2)) * 2  # as in the test above
    model(input_ids=ids[:, :1], **cache_argument(model, cache), use_cache=True)
    assert not stacked(cache)
    second = cache.layers[1]
    second._kv = second._kv[:, :1].clone()  # another shape (one KV head)
    ring_decode.stack_rings(cache.layers)
    assert not stacked(cache)
    second._kv = cache.layers[0]._kv.clone()
    ring_decode.stack_rings(cache.layers)
    assert stacked(cache)


@pytest.mark.parametrize("tie", ["incoming", "resident"])
def test_a_chunk_inserted_at_once_equals_one_by_one_insertions_with_tied_scores(tie):
    """``prefill="chunked"`` inserts its chunk at once (``schedule.play``): the same slots, scores and
    counters as inserting the tokens one by one, with scores that tie (both tie rules) and keys equal up to the
    rounding of one turn instead of several."""
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    params = {"budget": 14, "sinks": 2, "cascades": 3, "prefill": "chunked", "tie": tie}
    layers = []
    for _ in range(2):
        cache = kvcompress.cache_for(model, "cascade", **params)
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
        layers.append(cache.layers[0])
    count, generator = 9, torch.Generator().manual_seed(5)
    kv = torch.randn(2, *layers[0]._kv.shape[1:2], count, layers[0]._kv.shape[-1], generator=generator)
    tok = torch.arange(10, 10 + count).expand(2, count)
    meta = torch.stack([tok, tok], -1)
    scores = torch.randint(0, 3, (2, count), generator=generator).float() / 4  # few values: many ties
    for layer in layers:
        draw = torch.randint(0, 3, (2, layer.capacity - layer.sinks), generator=generator)
        layer._score[:, layer.sinks : layer.capacity] = draw / 4  # seeded: a draw may leave the two rows alike
    layers[1]._score.copy_(layers[0]._score)
    layers[0]._insert_tokens(kv, meta, torch.ones(2, count, dtype=torch.bool), scores)
    for m in range(count):
        real = torch.ones(2, 1, dtype=torch.bool)
        layers[1]._insert_tokens(kv[:, :, m : m + 1], meta[:, m : m + 1], real, scores[:, m : m + 1])
    ours, theirs = layers
    assert ours._rings == theirs._rings
    assert torch.equal(ours._tok, theirs._tok) and not torch.equal(ours._tok[0], ours._tok[1])  # rows differ
    cascade = slice(ours.sinks, ours.capacity)
    assert torch.equal(ours._score[:, cascade], theirs._score[:, cascade])
    torch.testing.assert_close(ours._kv[:, :, : ours.capacity], theirs._kv[:, :, : ours.capacity])
