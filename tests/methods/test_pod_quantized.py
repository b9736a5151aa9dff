"""PoD over quantized slots (``kv_bits`` 8 and 4, ``kvcompress.methods.pod.quantized``): at every forward and layer
PoD's attention equals an explicit mixed softmax written here over the dequantized view of the slots (the block
start's view and query taken when it attended, the proximal keys exact as the model gave them), while decoding
through the ring, in chunks, with SnapKV's eviction and with padding; the proximal keys stored bit for bit; the
bytes against the arithmetic; a decoding step reads nothing back."""

from __future__ import annotations

import math

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.pod.config import PoDPolicy
from kvcompress.methods.pod.quantized import PoDQuantizedLayer
from kvcompress.methods.snapkv import SnapKVConfig
from tests.methods.test_pod import NR, NS, STARTS, ids_of, model  # noqa: F401  (the module's tiny model)
from tests.methods.test_pod_ring import READS

QUANTIZED = {"kv_group": 8, "kv_residual": 8}


class Recorder:
    """Wraps ``PoDQuantizedLayer.update`` (the exact keys the model gives, by stream index) and ``PoDPolicy.attend``
    (each call checked against ``reference``; the layer's query and dequantized view kept for the later layers of
    its blocks)."""

    def __init__(self, monkeypatch, query_source: str = "block_start") -> None:
        self.exact: dict[int, torch.Tensor] = {}  # layer -> [B, H, T, d] keys as the model gave them
        self.lent: dict[int, tuple] = {}  # layer -> (query, view keys) of this forward
        self.checked: list[tuple[int, int]] = []  # (layer, queries) of each call compared
        self.query_source = query_source
        update, attend = PoDQuantizedLayer.update, PoDPolicy.attend

        def recording_update(layer, key_states, value_states, *args, **kwargs):
            known = self.exact.get(layer.index)
            self.exact[layer.index] = key_states if known is None else torch.cat([known, key_states], dim=2)
            return update(layer, key_states, value_states, *args, **kwargs)

        def checked_attend(policy, layer, query, key, value, mask, scaling):
            output, stats = attend(policy, layer, query, key, value, mask, scaling)
            if not isinstance(layer, PoDQuantizedLayer):  # (the 16-bit cache a test compares with)
                return output, stats
            keys, values = (tensor.clone() for tensor in layer.slots.view(layer.view_width))
            self.lent[layer.index] = (query, keys)
            expected = self.reference(layer, query, mask, scaling, keys, values)
            torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
            self.checked.append((layer.index, query.shape[2]))
            return output, stats

        monkeypatch.setattr(PoDQuantizedLayer, "update", recording_update)
        monkeypatch.setattr(PoDPolicy, "attend", checked_attend)

    def reference(self, layer, query, mask, scaling, keys, values) -> torch.Tensor:
        """The mixed softmax, one query head at a time: at a head starting its block here, its own logits over the
        view's keys; elsewhere its own logits over the exact keys at proximal tokens and the block start's query
        times the block start's view keys at distant ones; values from the view."""
        batch, q_heads, queries, dim = query.shape
        kv_heads = values.shape[1]
        groups = q_heads // kv_heads
        scale = dim**-0.5 if scaling is None else scaling
        token_idx, rope_pos = layer.token_idx, layer.rope_pos
        if mask is None:  # (the core passes none for a plain causal forward)
            visible = token_idx[:, :, None, :] <= token_idx[:, :, -queries:, None]
        else:
            visible = mask.expand(batch, kv_heads, queries, -1)
        pos_k, pos_q = rope_pos[:, :, None, :], rope_pos[:, :, -queries:, None]
        proximal = (pos_k < NS) | (pos_q - pos_k < NR)
        full = layer.full_heads.tolist()
        exact = self.exact[layer.index]
        outputs = []
        for h in range(q_heads):
            g = h // groups
            starts = layer.head_starts
            start = starts[h] if len(starts) == q_heads else starts[g * len(starts) // kv_heads]
            if g in full:
                own_keys = keys[:, full.index(g)]
            else:  # the exact key of each slot's token
                own_keys = exact[:, g].gather(1, token_idx[:, g].clamp(min=0)[..., None].expand(-1, -1, dim))
            logits = query[:, h] @ own_keys.transpose(-1, -2) * scale
            if start != layer.index:
                source_query, source_keys = self.lent[start]
                source = source_query[:, h] if self.query_source == "block_start" else query[:, h]
                peer = layer.peers[start]
                far = source @ source_keys[:, peer.full_heads.tolist().index(g)].transpose(-1, -2) * scale
                logits = torch.where(proximal[:, g], logits, far)
            logits = logits.masked_fill(~visible[:, g], -math.inf)
            outputs.append(logits.softmax(-1) @ values[:, g])
        return torch.stack(outputs, 1)


def run(lm, cache, ids, mask=None) -> torch.Tensor:
    """A prompt in chunks of 10, single tokens, a chunk of 5, single tokens again; logits of every forward."""

    def forward(first: int, stop: int) -> torch.Tensor:
        kwargs = {} if mask is None else {"attention_mask": mask[:, :stop]}
        return lm(ids[:, first:stop], **kwargs, **cache_argument(lm, cache)).logits

    with torch.no_grad():
        steps = [forward(t, t + 10) for t in range(0, 30, 10)]
        steps += [forward(t, t + 1) for t in range(30, 42)]
        steps.append(forward(42, 47))
        steps += [forward(t, t + 1) for t in range(47, 60)]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"query_source": "own"},
        {"base": SnapKVConfig(budget=24, window=4)},
        {"block_size": 2},
        {"starts": ((0, 0, 0, 0), (0, 1, 0, 0), (2, 1, 0, 2), (2, 1, 3, 2)), "grouping": "query_head"},
    ],
    ids=["block-start-query", "own-query", "snapkv", "uniform-blocks", "query-head-grouping"],
)
def test_attention_equals_the_mixed_softmax_over_the_dequantized_view(model, monkeypatch, bits, params):  # noqa: F811
    recorder = Recorder(monkeypatch, params.get("query_source", "block_start"))
    params = {"n_sink": NS, "n_recent": NR, **({} if "block_size" in params else {"starts": STARTS}), **params}
    cache = kvcompress.cache_for(model, "pod", kv_bits=bits, **QUANTIZED, **params)
    logits = run(model, cache, ids_of(60, seed=40, batch=2))
    assert all(type(layer) is PoDQuantizedLayer for layer in cache.compressed_layers)
    assert len(recorder.checked) == 4 * (3 + 12 + 1 + 13)
    if "grouping" not in params:  # (a KV head keeping its keys with sharing query heads: no ring)
        assert any(layer.ring is not None for layer in cache.compressed_layers)  # the last steps used the ring
    exact = run(model, kvcompress.cache_for(model, "pod", **params), ids_of(60, seed=40, batch=2))
    assert float((logits - exact).abs().max()) > 1e-3  # (quantization happened)
    torch.testing.assert_close(logits[:, :10], exact[:, :10], rtol=1e-5, atol=1e-5)  # the first forward: exact


def test_two_bits_without_a_residual_window_attend_over_the_dequantized_view(model, monkeypatch):  # noqa: F811
    """``kv_residual=0``: every token quantized when written (its key group sealed at each write), 2 bits."""
    recorder = Recorder(monkeypatch)
    params = {"starts": STARTS, "n_sink": NS, "n_recent": NR, "base": SnapKVConfig(budget=24, window=4)}
    cache = kvcompress.cache_for(model, "pod", kv_bits=2, kv_group=8, kv_residual=0, **params)
    run(model, cache, ids_of(60, seed=47, batch=2))
    assert len(recorder.checked) == 4 * (3 + 12 + 1 + 13)
    assert any(layer.ring is not None for layer in cache.compressed_layers)
    assert all(layer.slots.ring is None for layer in cache.compressed_layers)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("base", [None, SnapKVConfig(budget=20, window=4)], ids=["pod", "snapkv"])
def test_a_padded_batch_attends_over_the_dequantized_view(model, monkeypatch, bits, base):  # noqa: F811
    """Two prompts of different lengths (the shorter left padded) and a row that waits two steps while decoding."""
    recorder = Recorder(monkeypatch)
    ids = ids_of(60, seed=41, batch=2)
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :9] = 0
    mask[0, 50:52] = 0
    cache = kvcompress.cache_for(
        model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, base=base, kv_bits=bits, **QUANTIZED
    )
    run(model, cache, ids, mask)
    assert len(recorder.checked) == 4 * (3 + 12 + 1 + 13)


@pytest.mark.parametrize("bits", [8, 4])
def test_proximal_keys_are_stored_exactly(model, monkeypatch, bits):  # noqa: F811
    """The sharing heads' proximal keys (packed after a chunk, in the ring while decoding) are the model's keys of
    those tokens, bit for bit, and they are the sinks and the last ``n_recent`` tokens."""
    recorder = Recorder(monkeypatch)
    ids = ids_of(60, seed=42, batch=2)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, kv_bits=bits, **QUANTIZED)

    def check(seen: int) -> int:
        held = 0
        for layer in cache.compressed_layers:
            layer.leave_ring()
            for row, g in enumerate(layer.prox_heads.tolist()):
                slot = layer.prox_slot[:, row]
                token = layer.token_idx[:, g].gather(1, slot.clamp(min=0))
                expected = recorder.exact[layer.index][:, g].gather(1, token[..., None].expand(-1, -1, 16))
                stored = slot >= 0
                assert torch.equal(layer.prox_keys[:, row][stored], expected[stored])
                assert sorted(token[0][stored[0]].tolist()) == [*range(NS), *range(seen - NR, seen)]
                held += int(stored.sum())
        return held

    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        assert check(30) > 0
        for t in range(30, 45):  # (the first step after leaving builds the ring again)
            model(ids[:, t : t + 1], **cache_argument(model, cache))
        assert any(layer.ring is not None for layer in cache.compressed_layers)
        assert check(45) > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_bytes_are_codes_scales_the_residual_and_the_proximal_keys(model, bits):  # noqa: F811
    """Per layer: the codes of the key heads' keys and of every head's values, a scale and a minimum per token and
    channel group of the values and per key group and channel of the key heads' keys, the residual window's exact
    keys (key heads) and values (every head), and the exact proximal keys of the other heads; at every length."""
    group, residual, dim, heads = 8, 8, 16, 2
    key_heads = [2, 1, 0, 2]  # STARTS: KV heads starting a block at each layer
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, kv_bits=bits, **QUANTIZED)
    ids = ids_of(40, seed=43)

    def expected(n: int) -> int:
        total = 0
        for keys in key_heads:
            codes = n * (keys + heads) * dim * bits // 8
            value_params = 2 * n * heads * (dim // group) * 4
            key_params = 2 * math.ceil(n / group) * keys * dim * 4
            window = min(n, residual) * (keys + heads) * dim * 4
            proximal = (heads - keys) * min(n, NS + NR) * dim * 4
            total += codes + value_params + key_params + window + proximal
        return total

    with torch.no_grad():
        model(ids[:, :6], **cache_argument(model, cache))
        assert cache.nbytes() == expected(6)
        for t in range(6, 40):
            model(ids[:, t : t + 1], **cache_argument(model, cache))
            assert cache.nbytes() == expected(t + 1)
    assert any(layer.ring is not None for layer in cache.compressed_layers)
    assert cache.nbytes() <= cache.allocated_nbytes()
    full = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    with torch.no_grad():
        model(ids, **cache_argument(model, full))
    assert cache.nbytes() < full.nbytes()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_decoding_step_reads_nothing_back(model, bits):  # noqa: F811
    """Decoding steps through the ring over quantized slots, a key group sealed among them, read nothing back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func.overloadpacket.__name__ in READS
            return func(*args, **(kwargs or {}))

    ids = ids_of(50, seed=44)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, kv_bits=bits, **QUANTIZED)
    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        for t in range(30, 32):  # the first step builds the ring (one read of the position)
            model(ids[:, t : t + 1], **cache_argument(model, cache))
        with Reads():
            for t in range(32, 42):  # (the residual window moves by a key group at 40)
                model(ids[:, t : t + 1], **cache_argument(model, cache))
    assert any(layer.ring is not None for layer in cache.compressed_layers)
    assert Reads.count == 0


def test_fork_and_save_load_continue_alike(model, tmp_path):  # noqa: F811
    """A quantized PoD cache decoding through its ring, forked and saved, continues as the cache itself does."""
    ids = ids_of(50, seed=45)
    params = {"starts": STARTS, "n_sink": NS, "n_recent": NR, "kv_bits": 4, **QUANTIZED}
    cache = kvcompress.cache_for(model, "pod", **params)

    def decode(target) -> torch.Tensor:
        steps = [model(ids[:, t : t + 1], **cache_argument(model, target)).logits for t in range(40, 50)]
        return torch.cat(steps, 1)

    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        for t in range(30, 40):
            model(ids[:, t : t + 1], **cache_argument(model, cache))
        assert any(layer.ring is not None for layer in cache.compressed_layers)
        kvcompress.save_cache(cache, tmp_path / "pod.safetensors")
        loaded = kvcompress.load_cache(tmp_path / "pod.safetensors", model)
        assert loaded.nbytes() == cache.nbytes()
        fork = cache.fork()
        expected = decode(cache)
        assert torch.equal(decode(fork), expected)
        assert torch.equal(decode(loaded), expected)


def test_a_block_starts_lent_keys_go_after_the_last_layer_reading_them(model, monkeypatch):  # noqa: F811
    """Over quantized slots a block start lends a dequantized copy of its keys: each goes when the last layer of
    its blocks has attended (STARTS: layer 0's and layer 1's are read up to layer 2, layer 3's by itself), not at
    the end of the forward."""
    from kvcompress.methods.pod.layer import PoDLayer

    held = []
    end_forward = PoDLayer.end_forward

    def recording(layer):
        end_forward(layer)
        held.append((layer.index, [peer.step is not None for peer in layer.peers]))

    monkeypatch.setattr(PoDLayer, "end_forward", recording)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR, kv_bits=4, **QUANTIZED)
    ids = ids_of(31, seed=46)
    with torch.no_grad():
        model(ids[:, :30], **cache_argument(model, cache))
        model(ids[:, 30:], **cache_argument(model, cache))
    expected = [
        (0, [True, False, False, False]),
        (1, [True, True, False, False]),
        (2, [False, False, True, False]),  # (layer 2 starts no block: its step has no reader)
        (3, [False, False, False, False]),
    ]
    assert held == expected * 2
