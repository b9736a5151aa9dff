"""The cascade's rings and streaming's circular ring stored quantized (``methods/cascade/quantized.py``): what is
stored against KIVI's arithmetic on the 16-bit run's exact keys (``tests/references/kivi.py``), attention equal to
the full-precision rings' over the dequantized storage, the same tokens kept as at 16 bits, bytes, padding, and
decoding graphs."""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompress
from kvcompress.decode_graph import DecodeGraph
from kvcompress.generation import cache_argument
from kvcompress.methods.cascade.circular import CircularSinkLayer, QuantizedCircularSinkLayer
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.quantized import QuantizedCascadeLayer, QuantizedRings
from kvcompress.models.testing import tiny_model
from tests.helpers import cache_logits
from tests.references.kivi import minmax_roundtrip

GROUP, RESIDUAL = 4, 8
METHODS = {
    # one ring of 27 slots: six key groups of 4 and one of 3
    "streaming": {"budget": 31, "sinks": 4},
    # four rings of 8 slots, keys per token
    "cascade": {"budget": 36, "sinks": 4, "cascades": 4},
    "cascade-fixed": {"budget": 36, "sinks": 4, "cascades": 4, "select_tokens": False},
}


def method_of(key: str) -> str:
    return key.split("-")[0]


def make(model, key: str, bits: int, **extra):
    params = dict(METHODS[key], **extra)
    if bits < 16:
        params.update(kv_bits=bits, kv_group=GROUP, kv_residual=RESIDUAL)
    return kvcompress.cache_for(model, method_of(key), **params)


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def feed(model, cache, ids: torch.Tensor, chunks, mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
    """Logits of the forwards of ``chunks`` tokens each of ``ids``, which follow ``offset`` tokens the cache has
    seen (``mask`` ``[B, >= offset + len(ids)]``: the 2D attention mask of the whole stream)."""
    logits, start = [], offset
    with torch.no_grad():
        for size in chunks:
            extra = {} if mask is None else {"attention_mask": mask[:, : start + size]}
            part = ids[:, start - offset : start - offset + size]
            out = model(input_ids=part, **cache_argument(model, cache), use_cache=True, **extra)
            logits.append(out.logits)
            start += size
    return torch.cat(logits, 1)


def float_twin(cache):
    """A copy of ``cache`` whose ring layers are the full-precision ones holding the quantized layers' dequantized
    storage (their ``_kv`` as a forward reads it)."""
    twin = copy.deepcopy(cache)
    for layer in twin.layers:
        if isinstance(layer, QuantizedRings):
            kv = layer._dequantized().clone()
            layer.__class__ = CircularSinkLayer if isinstance(layer, CircularSinkLayer) else CascadeLayer
            layer.__dict__["ring_layers"] = None
            layer._kv, layer._returned, layer._views = kv, None, None
    return twin


def test_classes_by_bits():
    model = tiny_model()
    for bits, classes in [
        (16, (CircularSinkLayer, CascadeLayer)),
        (4, (QuantizedCircularSinkLayer, QuantizedCascadeLayer)),
    ]:
        for key, kind in zip(("streaming", "cascade"), classes, strict=True):
            assert type(make(model, key, bits).layers[0]) is kind


# --- what is stored -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunks", [(10,) + (1,) * 45, (30, 17, 1, 1, 9)], ids=["decoding", "chunks"])
def test_streaming_ring_holds_kivi_groups_of_the_exact_keys(bits, chunks):
    """Layer 0's keys and values do not depend on attention, so the 16-bit ring holds the exact ones at the same
    slots: the quantized ring reads KIVI's per-channel groups of ring slots rounded once from them, the values per
    token, the sinks and the newest ``kv_residual`` tokens exact."""
    model = tiny_model()
    ids = ids_of(1, sum(chunks))
    exact, quantized = make(model, "streaming", 16), make(model, "streaming", bits)
    seen = 0
    for size in chunks:
        feed(model, exact, ids[:, seen : seen + size], (size,))
        feed(model, quantized, ids[:, seen : seen + size], (size,))
        seen += size
        ours, theirs = quantized.layers[0], exact.layers[0]
        assert torch.equal(ours._tok, theirs._tok)
        read, full = ours._dequantized()[:, :, : ours.capacity], theirs._kv[:, :, : theirs.capacity]
        dim, sinks, width, tok = ours._key_dim, ours.sinks, ours._layout.width, theirs._tok[0]
        expected = full.clone()
        ring_tokens = min(seen, ours.capacity) - sinks
        for first in range(0, max(ring_tokens, 0), GROUP):
            slots = list(range(sinks + first, min(sinks + first + GROUP, sinks + width, ours.capacity)))
            members = tok[slots]
            if (members < 0).any() or members.max() - members.min() != len(slots) - 1:
                # a group the ring is rewriting: its slots of the former lap were sealed with tokens gone since
                expected[:, :, slots, :dim] = read[:, :, slots, :dim]
                continue
            block = full[:, :, slots, :dim]
            expected[:, :, slots, :dim] = minmax_roundtrip(block, bits, dim=2)
        for slot in range(sinks, ours.capacity):
            if tok[slot] >= 0:
                for channel in range(0, expected.shape[-1] - dim, GROUP):
                    part = slice(dim + channel, dim + channel + GROUP)
                    expected[:, :, slot, part] = minmax_roundtrip(full[:, :, slot, part], bits, dim=-1)
        newest = (tok >= seen - RESIDUAL) | (torch.arange(tok.shape[0]) < sinks)
        expected[:, :, newest] = full[:, :, newest]  # exact: the sinks and the residual window
        occupied = tok >= 0
        scale = float(full.abs().max()) * torch.finfo(full.dtype).eps * 4
        torch.testing.assert_close(read[:, :, occupied], expected[:, :, occupied], rtol=0, atol=scale)
        assert torch.equal(read[:, :, newest], full[:, :, newest])


@pytest.mark.parametrize("bits", [8, 4])
def test_cascade_first_ring_holds_per_token_codes_of_the_exact_keys(bits):
    """Without selection the schedule is the 16-bit one; layer 0's first ring (keys never turned since written)
    reads its keys and values rounded once per token, the sinks and the residual window exact; the other rings
    within the rounding of their moves."""
    model = tiny_model()
    ids = ids_of(1, 60)
    exact, quantized = make(model, "cascade-fixed", 16), make(model, "cascade-fixed", bits)
    for cache in (exact, quantized):
        feed(model, cache, ids, (12,) + (1,) * 48)
    ours, theirs = quantized.layers[0], exact.layers[0]
    assert torch.equal(ours._tok, theirs._tok)
    read, full = ours._dequantized()[:, :, : ours.capacity], theirs._kv[:, :, : theirs.capacity]
    sinks, width, tok = ours.sinks, ours._layout.width, theirs._tok[0]
    expected = full.clone()
    for slot in range(sinks, sinks + width):
        for channel in range(0, full.shape[-1], GROUP):
            part = slice(channel, channel + GROUP)
            expected[:, :, slot, part] = minmax_roundtrip(full[:, :, slot, part], bits, dim=-1)
    window = tok >= 60 - RESIDUAL
    window[:sinks] = True
    expected[:, :, window] = full[:, :, window]
    first = slice(0, sinks + width)
    scale = float(full.abs().max()) * torch.finfo(full.dtype).eps * 4
    torch.testing.assert_close(read[:, :, first], expected[:, :, first], rtol=0, atol=scale)
    assert torch.equal(read[:, :, window], full[:, :, window])
    step = (full.amax(2, keepdim=True) - full.amin(2, keepdim=True)) / (2**bits - 1)
    assert float((read - full).abs().max()) < float(step.max()) * 4  # older rings: a few roundings at most


# --- attention over the dequantized storage --------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("key", ["streaming", "cascade"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_forward_attends_over_the_dequantized_storage(key, bits, batch):
    """The next forward (one token, then several) of the quantized cache gives the logits of the full-precision
    rings holding its dequantized storage, and keeps the same tokens; with ``batch`` 2 the second sequence is
    left-padded."""
    model = tiny_model()
    ids = ids_of(batch, 61, seed=3)
    mask = torch.ones(batch, 61, dtype=torch.long)
    mask[1:, :5] = 0
    quantized = make(model, key, bits)
    feed(model, quantized, ids, (13,) + (1,) * 40, mask)
    for size in (1, 6, 1):
        start = int(quantized.layers[0].seen)
        twin = float_twin(quantized)
        part = ids[:, start : start + size]
        expected = feed(model, twin, part, (size,), mask, start)
        got = feed(model, quantized, part, (size,), mask, start)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(quantized.layers, twin.layers, strict=True):
            assert torch.equal(ours._tok, theirs._tok) and ours._rings == theirs._rings


@pytest.mark.parametrize("key", ["streaming", "cascade-fixed"])
def test_the_same_tokens_are_kept_as_at_16_bits(key):
    """The schedule depends on the token count alone (streaming; the cascade without selection): every layer
    keeps the 16-bit run's tokens after every forward. (With selection the EMA scores come from attention over
    the dequantized keys, and a selection may go the other way.)"""
    model = tiny_model()
    ids = ids_of(2, 65, seed=5)
    exact, quantized = make(model, key, 16), make(model, key, 4)
    start = 0
    for size in (9, 1, 1, 20, 1, 1, 1, 30, 1):
        for cache in (exact, quantized):
            feed(model, cache, ids[:, start : start + size], (size,))
        start += size
        for ours, theirs in zip(quantized.layers, exact.layers, strict=True):
            assert torch.equal(ours._tok, theirs._tok)


@pytest.mark.parametrize("key", ["streaming", "cascade"])
def test_a_padded_batch_equals_single_runs(key):
    """Codes, key groups and the residual window are per sequence: a left-padded batch reads what each sequence
    alone reads (greedy generation through ``generate``)."""
    model = tiny_model()
    long, short = ids_of(1, 40, seed=7), ids_of(1, 27, seed=8)
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    batch[0], mask[0] = long[0], 1
    batch[1, 13:], mask[1, 13:] = short[0], 1
    batched, _ = cache_logits(model, batch, make(model, key, 4), mask, 10)
    for row, ids in ((0, long), (1, short)):
        alone, _ = cache_logits(model, ids, make(model, key, 4), None, 10)
        torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-4, atol=1e-4)


# --- bytes, errors, graphs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("key", ["streaming", "cascade"])
def test_bytes_are_codes_parameters_window_and_sinks(key, bits):
    model = tiny_model()  # 2 KV heads of 16 channels, float32
    for tokens in (3, 10, 80):
        cache = make(model, key, bits)
        feed(model, cache, ids_of(1, tokens), (tokens,))
        layer = cache.layers[0]
        stored = int((layer._tok >= 0).sum())
        sinks = min(stored, 4)
        ring = stored - sinks
        heads, dim, element = 2, 16, 4
        codes = 2 * dim * bits // 8  # key and value codes of a token
        value_params = 2 * (dim // GROUP) * element
        if key == "streaming":  # per channel: a scale and a minimum per channel of each key group
            per_token, key_params = codes + value_params, -(-ring // GROUP) * 2 * dim * element
        else:  # per token: as the values
            per_token, key_params = codes + 2 * value_params, 0
        window = min(ring, RESIDUAL)
        expected = heads * (ring * per_token + key_params + (window + sinks) * 2 * dim * element)
        assert layer.kv_nbytes() == expected
        assert layer.kv_nbytes() <= layer.allocated_nbytes()
        if tokens == 80 and bits == 4:  # (at 8 bits groups of 4 float32 parameters cost more than they save)
            full = make(model, key, 16)
            feed(model, full, ids_of(1, tokens), (tokens,))
            assert cache.nbytes() < full.nbytes()


def test_kv_residual_zero_is_refused_on_one_ring():
    model = tiny_model()
    with pytest.raises(ValueError, match="kv_residual=0 is not supported by 'streaming'"):
        cache = kvcompress.cache_for(model, "streaming", budget=31, kv_bits=4, kv_group=4, kv_residual=0)
        feed(model, cache, ids_of(1, 5), (5,))


@pytest.mark.parametrize("key", ["streaming", "cascade"])
def test_decode_graph_decodes_a_quantized_ring_eagerly(key):
    model = tiny_model("llama", seed=0)
    caches = [make(model, key, 4), make(model, key, 4)]
    ids = ids_of(2, 40, seed=1)
    for cache in caches:
        feed(model, cache, ids, (40,))
    graphed, eager = DecodeGraph(model, caches[0], capture="trace"), DecodeGraph(model, caches[1], capture=None)
    token = torch.full((2, 1), 5)
    with torch.no_grad():
        for step in range(8):
            position = torch.full((2, 1), 40 + step)
            expected = eager(token, position)
            torch.testing.assert_close(graphed(token, position), expected, rtol=0, atol=0)
            token = expected[:, -1:].argmax(-1)
    assert graphed.replays == 0 and graphed.replay is None


@pytest.mark.parametrize("key", ["streaming", "cascade"])
def test_a_decoding_step_reuses_one_buffer_and_reads_nothing_back(key, monkeypatch):
    """Per decoding step: the layers dequantize into one buffer of the cache, allocated once (no allocation
    proportional to the cache), none is held between forwards, and no tensor is read on the host."""
    from kvcompress.methods.cascade import quantized as module

    model = tiny_model()
    cache = make(model, key, 4)
    ids = ids_of(1, 60, seed=9)
    feed(model, cache, ids, (30, 1))
    buffer = module._SCRATCH[cache.forward_pass]["buffer"]

    def refuse(*args, **kwargs):
        raise AssertionError("a host read during a decoding step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    feed(model, cache, ids[:, 31:], (1,) * 29)
    monkeypatch.undo()
    holder = module._SCRATCH[cache.forward_pass]
    assert holder["buffer"] is buffer and holder["owner"] is None
    for layer in cache.layers:
        assert layer._kv.untyped_storage().nbytes() == layer._kv.element_size()  # (a stand-in of one number)
        assert layer._views is None and layer._returned is None


@pytest.mark.parametrize("bits", [8, 4])
def test_a_decoding_step_of_the_ring_reads_the_codes(bits, monkeypatch):
    """Streaming's decoding step attends from the codes (``_decode_codes``, no dequantized storage built): its
    logits are those of the same step over the dequantized storage, and it leaves the same codes, residual window
    and sinks, step after step (the ring filling, wrapping, key groups sealed)."""
    model = tiny_model("llama", seed=2)
    ids = ids_of(1, 80, seed=11)
    codes, storage = make(model, "streaming", bits), make(model, "streaming", bits)
    for cache in (codes, storage):
        feed(model, cache, ids, (6,))
    for layer in storage.layers:
        layer._codes_step_possible = lambda count: False  # (every forward over the dequantized storage)
    built = []
    original = QuantizedRings._materialize
    monkeypatch.setattr(QuantizedRings, "_materialize", lambda layer: (built.append(layer), original(layer))[1])
    grown = 0
    for start in range(6, 80):
        built.clear()
        capacity = codes.layers[0].capacity
        got = feed(model, codes, ids[:, start:], (1,), offset=start)
        if codes.layers[0].capacity == capacity:
            assert not built, "a decoding step built the dequantized storage"
        else:  # (a step that grows the ring reads the dequantized storage)
            grown += 1
        built.clear()
        expected = feed(model, storage, ids[:, start:], (1,), offset=start)
        assert len(built) == len(storage.layers)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(codes.layers, storage.layers, strict=True):
            assert ours._rings == theirs._rings and torch.equal(ours._meta, theirs._meta)
        ours, theirs = codes.layers[0], storage.layers[0]  # (its keys and values do not depend on attention)
        for name, tensor in ours._codes.items():
            assert torch.equal(tensor, theirs._codes[name]), name
        assert torch.equal(ours._exact, theirs._exact) and torch.equal(ours._sink_exact, theirs._sink_exact)
    assert grown == 2 and codes.layers[0].capacity == 31  # 6 -> 22 -> 31 slots; the other steps read the codes
