"""PoD's proximal ring while decoding (``kvcompress.methods.pod.ring``): the same logits, kept tokens and bytes as
the packed proximal keys it replaces, across its wrap-around, a chunk after it and SnapKV's compression; and a
decoding step that reads nothing back."""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.knorm import KnormConfig
from kvcompress.methods.snapkv import SnapKVConfig
from tests.methods.test_pod import NR, NS, STARTS, ids_of, model  # noqa: F401  (the module's tiny model)

READS = {"_local_scalar_dense", "item", "is_nonzero"}


def decode(lm, cache, ids, ring: bool, offset: int = 0):
    """Logits of every forward: a chunked prompt, single tokens, a chunk of 5, single tokens again (``ring``
    False: every layer keeps its packed proximal keys; ``offset``: the positions the model is given, past the
    stream indices)."""

    def forward(first: int, stop: int) -> torch.Tensor:
        positions = torch.arange(first + offset, stop + offset)[None].expand(ids.shape[0], -1)
        return lm(ids[:, first:stop], position_ids=positions, **cache_argument(lm, cache)).logits

    with torch.no_grad():
        steps = [forward(t, t + 10) for t in range(0, 30, 10)]
        for layer in cache.compressed_layers:
            layer.ring_plan = layer.ring_plan if ring else False
        steps += [forward(t, t + 1) for t in range(30, 50)]
        steps.append(forward(50, 55))
        steps += [forward(t, t + 1) for t in range(55, 70)]
    return torch.cat(steps, 1)


@pytest.mark.parametrize(
    ("params", "offset"),
    [
        ({}, 0),
        ({"query_source": "own"}, 0),
        ({"base": SnapKVConfig(budget=20, window=4)}, 0),
        ({"block_size": 2}, 0),
        ({}, 7),
        ({"base": KnormConfig(budget=100, recent=2)}, 7),  # a base writing per-token state at every ring step
    ],
    ids=["block-start-query", "own-query", "snapkv", "uniform-blocks", "positions-offset", "state-base"],
)
def test_ring_decoding_equals_the_packed_proximal_keys(model, params, offset):  # noqa: F811
    ids = ids_of(70, seed=30, batch=2)
    params = {"n_sink": NS, "n_recent": NR, **({"starts": STARTS} if "block_size" not in params else {}), **params}
    ringed = kvcompress.cache_for(model, "pod", **params)
    logits = decode(model, ringed, ids, ring=True, offset=offset)
    assert any(layer.ring is not None for layer in ringed.compressed_layers)  # the last steps used it
    packed = kvcompress.cache_for(model, "pod", **params)
    expected = decode(model, packed, ids, ring=False, offset=offset)
    assert all(layer.ring is None for layer in packed.compressed_layers)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert ringed.nbytes() == packed.nbytes()
    for a, b in zip(ringed.compressed_layers, packed.compressed_layers, strict=True):
        assert torch.equal(a.token_idx, b.token_idx) and torch.equal(a.valid, b.valid)
        assert torch.equal(a.rope_pos, b.rope_pos)
        a.leave_ring()
        for row in range(a.prox_slot.shape[1]):  # the same proximal tokens, whatever their order
            held = [sorted(layer.prox_slot[0, row][layer.prox_slot[0, row] >= 0].tolist()) for layer in (a, b)]
            assert held[0] == held[1]


def test_ring_decoding_step_reads_nothing_back(model):  # noqa: F811
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func.overloadpacket.__name__ in READS
            return func(*args, **(kwargs or {}))

    ids = ids_of(40, seed=31)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        for t in range(30, 32):  # the first step builds the ring (one read of the position)
            model(ids[:, t : t + 1], **cache_argument(model, cache))
        with Reads():
            model(ids[:, 32:33], **cache_argument(model, cache))
    assert any(layer.ring is not None for layer in cache.compressed_layers)
    assert Reads.count == 0


def test_rows_at_different_positions_keep_the_packed_keys(model):  # noqa: F811
    ids = ids_of(31, seed=32, batch=2)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        positions = torch.tensor([[30], [31]])
        model(ids[:, 30:31], position_ids=positions, **cache_argument(model, cache))
    assert all(layer.ring is None for layer in cache.compressed_layers)


def test_interleaved_heads_and_split_runs_equal_the_packed_proximal_keys():
    """Three KV heads; at layer 1 the middle one starts a block and the outer two share from layer 0: the sharing
    query heads are not consecutive, the distant keys come in two runs and the output is scattered by head."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    params = {"starts": ((0, 0, 0), (0, 1, 0)), "n_sink": NS, "n_recent": NR}
    ids = ids_of(70, seed=33)
    ringed = kvcompress.cache_for(lm, "pod", **params)
    logits = decode(lm, ringed, ids, ring=True)
    plan = ringed.compressed_layers[1].ring_plan
    assert ringed.compressed_layers[1].head_runs["prox"] is None and len(plan.runs) == 2 and plan.ordered is None
    assert ringed.compressed_layers[1].ring is not None
    expected = decode(lm, kvcompress.cache_for(lm, "pod", **params), ids, ring=False)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_padding_token_while_decoding_leaves_the_ring(model):  # noqa: F811
    ids = ids_of(45, seed=34, batch=2)

    def run(ring: bool):
        cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
        mask = torch.ones(2, 45, dtype=torch.long)
        mask[1, 40] = 0  # the second row's token 40 is padding
        with torch.no_grad():
            prefill(model, ids[:, :30], cache, chunk_size=10)
            for layer in cache.compressed_layers:
                layer.ring_plan = layer.ring_plan if ring else False
            steps = []
            for t in range(30, 45):
                step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **cache_argument(model, cache))
                steps.append(step.logits)
                if t == 39:
                    assert any(layer.ring is not None for layer in cache.compressed_layers) == ring
        assert all(layer.ring is None for layer in cache.compressed_layers)
        return torch.cat(steps, 1)

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-5)


def test_decoding_steps_append_in_place(model):  # noqa: F811
    """A decoding step writes the new token's value (and key, where the layer keeps keys) into room left behind the
    stored ones: no copy of the layer's store per step (nor of a layer's keys where it keeps every head's); the
    stored bytes count the tokens, the allocated the room."""
    ids = ids_of(40, seed=32)
    cache = kvcompress.cache_for(model, "pod", starts=STARTS, n_sink=NS, n_recent=NR)
    with torch.no_grad():
        prefill(model, ids[:, :30], cache, chunk_size=10)
        model(ids[:, 30:31], **cache_argument(model, cache))
        before = [(layer.values.data_ptr(), layer.keys.data_ptr()) for layer in cache.compressed_layers]
        for t in range(31, 33):
            model(ids[:, t : t + 1], **cache_argument(model, cache))
    assert [(layer.values.data_ptr(), layer.keys.data_ptr()) for layer in cache.compressed_layers] == before
    assert not cache.compressed_layers[0].head_lists["prox"]  # the first layer starts every block
    assert cache.compressed_layers[0].own_keys() is cache.compressed_layers[0].keys  # its keys as stored, no copy
    for layer in cache.compressed_layers:
        assert layer.values.shape[2] == 33
        assert layer.allocated_nbytes() > layer.kv_nbytes()  # the room (at most one forward: 10 tokens)
        assert layer.allocated_nbytes() - layer.kv_nbytes() <= 10 * layer.values[:, :, :1].numel() * 4 * 2
