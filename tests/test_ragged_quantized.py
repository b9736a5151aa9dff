"""Quantized ragged storage (``core/ragged_quantized.py``): per-head budgets stored as codes (``kv_bits`` 8, 4, 2).

- The pool alone, against an independent reference built here from the exact keys and values each row was given
  (``tests/references/kivi.py``'s min-max round trip over each key group's members and each value's channel
  groups, the newest tokens exact): what the pool reads (``dense``) through the move, decoding steps that seal key
  groups, take blocks and grow the pool, and a forward of several tokens (its own tokens exact); and the pool's
  attention equal to an explicit softmax per row over what it reads (1e-5).
- A model: the kept sets per head equal those at 16 bits (the prompt is scored before it is quantized), the pool's
  attention equals attention over its dequantized blocks at every decoding step and forward of several tokens, for
  SnapKV with AdaKV's allocation, KVzip's head budgets and DuoAttention, with left-padded batches of 2; with
  nothing evicted the cache reads what KIVI's cache reads (the reference cache); bytes are the codes, scales,
  minima and the exact window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcompress
from kvcompress.core.ragged import RaggedPool
from kvcompress.core.ragged_layer import RaggedLayer
from kvcompress.core.ragged_quantized import QuantizedRaggedPool
from kvcompress.core.ragged_stream import StreamRecord
from kvcompress.generation import cache_argument, prefill
from tests.helpers import duo_pattern_file, kept_tokens, tiny_tokenizer_dir
from tests.references.kivi import KiviReferenceCache, minmax_roundtrip
from tests.test_quantized import forced_logits, token_ids
from tests.test_ragged import inputs, run


# --- the pool against a reference built from the exact tokens ------------------------------------------------
def expected_reads(rows: list[list[tuple[int, torch.Tensor, torch.Tensor]]], bits, group, residual, seen, fresh):
    """What each row's tokens read: ``rows[r]`` lists (virtual index, exact key, exact value) in order; a token of
    virtual index below the window's start is read back from KIVI's arithmetic over its key group's members (the
    row's tokens of the same ``index // group``) and over its value's channel groups; the window and the forward's
    ``fresh`` newest tokens read exactly."""
    window = max(0, -(-(seen - residual) // group) * group) if residual else seen
    out = []
    for tokens in rows:
        keys = torch.stack([key for _, key, _ in tokens])
        values = torch.stack([value for _, _, value in tokens])
        index = torch.tensor([v for v, _, _ in tokens])
        read_keys, read_values = keys.clone(), values.clone()
        exact_from = min(window, seen - fresh)
        for g in sorted({int(v) // group for v in index.tolist() if v < exact_from}):
            members = (index // group) == g
            read = members & (index < exact_from)  # (a member of the forward's own reads exactly)
            read_keys[read] = minmax_roundtrip(keys[members], bits, dim=0)[read[members]]
        old = index < exact_from
        grouped = values[old].unflatten(-1, (-1, group))
        read_values[old] = minmax_roundtrip(grouped, bits, dim=-1).flatten(-2)
        out.append((read_keys, read_values))
    return out


def explicit_attention(query, keys, values, scale):
    """``query`` ``[G, d]`` over one row's ``keys``/``values`` ``[n, d]``: softmax in float32, one row at a time."""
    return torch.softmax(query.float() @ keys.float().T * scale, dim=-1) @ values.float()


@pytest.mark.parametrize("bits,residual", [(8, 16), (4, 16), (4, 8), (2, 8)])
def test_pool_reads_what_the_reference_reads_and_attends_over_it(bits, residual):
    """Uneven rows moved into the pool (quantized at the move), then 60 decoding steps (every ``group`` of them
    seals a key group per row; rows take new blocks; the pool grows), then a forward of 5 tokens and 20 more
    steps: after every forward each row reads what the reference says, and the decoding step and the forward of
    several tokens give the explicit softmax over it per row."""
    torch.manual_seed(2)
    group, batch, heads, groups, dim, width = 8, 2, 3, 2, 16, 50
    keys, values = torch.randn(batch, heads, width, dim), torch.randn(batch, heads, width, dim)
    valid = torch.rand(batch, heads, width) < torch.tensor([0.25, 0.6, 0.95])[:, None]  # uneven rows
    valid[..., -1] = True
    # rows of 1 and 2 tokens: fewer than the window, their first key group after the window's first
    valid[0, 0, :-1], valid[1, 0, :-2] = False, False
    token_idx = torch.arange(width).expand(batch, heads, width).clone()
    record = StreamRecord.from_slots(token_idx, token_idx, token_idx, torch.tensor([width, width]), width)
    options = {"bits": bits, "group": group, "residual": residual, "seen": width}
    pool = QuantizedRaggedPool.from_rows(keys, values, token_idx, valid, record, **options)
    assert pool.block % group == 0 and len(set(pool.offsets.tolist())) > 1  # rows start at different offsets
    rows = []  # per row: (virtual index, key, value): a row's tokens numbered as the stream's last ones
    for b in range(batch):
        for h in range(heads):
            kept = valid[b, h].nonzero().flatten()
            first = width - len(kept)
            rows.append([(first + i, keys[b, h, t], values[b, h, t]) for i, t in enumerate(kept.tolist())])

    def check(seen: int, fresh: int) -> None:
        read_keys, read_values, tokens, *_, read_valid = pool.dense()
        expected = expected_reads(rows, bits, group, residual, seen, fresh)
        for row, (want_keys, want_values) in enumerate(expected):
            b, h = divmod(row, heads)
            torch.testing.assert_close(read_keys[b, h][read_valid[b, h]], want_keys, rtol=0, atol=1e-6)
            torch.testing.assert_close(read_values[b, h][read_valid[b, h]], want_values, rtol=0, atol=1e-6)

    def attend(query: torch.Tensor, first: int, plain: bool) -> None:
        output = pool.attend(query, 0.3, plain, first)
        read_keys, read_values, tokens, *_, read_valid = pool.dense()
        for b in range(batch):
            for h in range(heads):
                row_tokens = tokens[b, h][read_valid[b, h]]
                for i in range(query.shape[2]):
                    seen = row_tokens <= first + i
                    k, v = read_keys[b, h][read_valid[b, h]][seen], read_values[b, h][read_valid[b, h]][seen]
                    want = explicit_attention(query[b, h * groups : (h + 1) * groups, i], k, v, 0.3)
                    torch.testing.assert_close(output[b, h * groups : (h + 1) * groups, i], want, rtol=1e-5, atol=1e-5)

    check(width, 0)
    seen, capacities = width, {pool.capacity}
    for count, steps in ((1, 60), (5, 1), (1, 20)):
        for _ in range(steps):
            new_keys, new_values = torch.randn(batch, heads, count, dim), torch.randn(batch, heads, count, dim)
            flat = pool.append(new_keys, new_values)
            pool.register(flat, seen, None, None)
            for row in range(batch * heads):
                b, h = divmod(row, heads)
                rows[row] += [(seen + i, new_keys[b, h, i], new_values[b, h, i]) for i in range(count)]
            seen += count
            check(seen, count)  # (the forward's own tokens exact while it runs)
            attend(torch.randn(batch, heads * groups, count, dim), seen - count, plain=count == 1)
            pool.end_forward()
            capacities.add(pool.capacity)
    check(seen, 0)
    assert len(capacities) > 1 and pool.used > pool.rows  # rows took blocks, the pool grew


def test_residual_zero_quantizes_each_token_when_written():
    """``kv_residual=0``: every stored token reads back quantized (its value on its own channel groups' grid) once
    its forward is over, the forward's own token exact while it runs; the step equals the explicit softmax."""
    torch.manual_seed(3)
    batch, heads, dim, width = 1, 2, 16, 30
    keys = torch.randn(batch, heads, width, dim)
    valid = torch.rand(batch, heads, width) < 0.5
    token_idx = torch.arange(width).expand(batch, heads, width).clone()
    record = StreamRecord.from_slots(token_idx, token_idx, token_idx, torch.tensor([width]), width)
    pool = QuantizedRaggedPool.from_rows(keys, keys, token_idx, valid, record, bits=4, group=8, residual=0, seen=width)
    for step in range(12):
        new = torch.randn(batch, heads, 1, dim)
        flat = pool.append(new, new)
        pool.register(flat, width + step, None, None)
        read_keys, read_values, _, _, _, read_valid = pool.dense()
        query = torch.randn(1, heads, 1, dim)
        output = pool.attend(query, 0.25, True, width + step)
        for h in range(heads):
            assert torch.equal(read_values[0, h][read_valid[0, h]][-1], new[0, h, 0])  # its own forward: exact
            keys_read, values_read = read_keys[0, h][read_valid[0, h]], read_values[0, h][read_valid[0, h]]
            want = explicit_attention(query[0, h], keys_read, values_read, 0.25)
            torch.testing.assert_close(output[0, h], want, rtol=1e-5, atol=1e-5)
        pool.end_forward()
        _, read_values, _, _, _, read_valid = pool.dense()
        last = read_values[0, 0][read_valid[0, 0]][-1]
        assert not torch.equal(last, new[0, 0, 0])
        torch.testing.assert_close(
            last, minmax_roundtrip(new[0, 0, 0].unflatten(-1, (2, 8)), 4, -1).flatten(), rtol=0, atol=1e-6
        )


# --- with a model --------------------------------------------------------------------------------------------
METHODS = {
    "snapkv": {"ratio": 0.5, "window": 4, "allocation": "adakv"},
    "kvzip": {"ratio": 0.5, "allocation": "global", "tokenizer": tiny_tokenizer_dir()},
    "duo": {"pattern": duo_pattern_file(2, 2, 4, 8), "sink_size": 4, "recent_size": 8},
}


def compare_with_dequantized_blocks(monkeypatch) -> list[int]:
    """Wrap ``QuantizedRaggedPool.attend``: each call's output is compared with attention, explicit per row, over
    what the pool reads (``dense``: the dequantized blocks, the exact window and the forward's own tokens); returns
    the query counts of the calls compared."""
    checked: list[int] = []
    original = QuantizedRaggedPool.attend

    def attend(pool, query, scale, plain, first):
        output = original(pool, query, scale, plain, first)
        read_keys, read_values, tokens, _, _, read_valid = pool.dense()
        batch, q_heads, count, _ = query.shape
        groups = q_heads // pool.heads
        for b in range(batch):
            for h in range(pool.heads):
                visible = read_valid[b, h]
                for i in range(count):
                    # a query sees the real tokens up to itself, and itself (even as padding)
                    sees = (tokens[b, h] <= first + i) & (visible | (tokens[b, h] == first + i))
                    sees &= tokens[b, h] >= 0
                    want = explicit_attention(
                        query[b, h * groups : (h + 1) * groups, i],
                        read_keys[b, h][sees],
                        read_values[b, h][sees],
                        scale,
                    )
                    got = output[b, h * groups : (h + 1) * groups, i].float()
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        checked.append(count)
        return output

    monkeypatch.setattr(QuantizedRaggedPool, "attend", attend)
    return checked


def read_everything(layer) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values, *_ = layer.pool.dense()
    return keys, values


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("bits", [8, 4])
def test_model_kept_sets_and_attention_over_the_dequantized_blocks(method, bits, monkeypatch, tiny_llama):
    """A left-padded batch of 2 (KVzip: unpadded, its reconstruction takes no padding), a question of 6 tokens,
    then 24 greedy steps: every layer is ragged and quantized, each head keeps the tokens it keeps at 16 bits,
    every forward's attention equals the explicit softmax over the dequantized blocks, and the logits moved away
    from the 16-bit cache's (quantization happened) but stay finite."""
    params = METHODS[method]
    padded = method != "kvzip"
    context, mask, question = inputs(tiny_llama, padded=padded, length=80)
    full = kvcompress.cache_for(tiny_llama, method, **params)
    full_logits, _ = run(tiny_llama, full, context, mask, question, 24)
    checked = compare_with_dequantized_blocks(monkeypatch)
    cache = kvcompress.cache_for(tiny_llama, method, kv_bits=bits, kv_group=8, kv_residual=16, **params)
    logits, _ = run(tiny_llama, cache, context, mask, question, 24)
    assert all(
        isinstance(layer, RaggedLayer) and type(layer.pool) is QuantizedRaggedPool for layer in cache.compressed_layers
    )
    for ours, theirs in zip(cache.compressed_layers, full.compressed_layers, strict=True):
        assert kept_tokens(ours) == kept_tokens(theirs)
    assert 6 in checked and checked.count(1) == 24 * len(cache.compressed_layers)
    assert torch.isfinite(logits).all()
    assert float((logits - full_logits).detach().abs().max()) > 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_nothing_evicted_reads_what_kivi_reads(bits, tiny_qwen2):
    """KeyDiff keeping every token (ratio 1.0, AdaKV's allocation): every row holds the stream, so its key groups
    are KIVI's groups of stream indices; the prompt in one forward, then one token per forward: every step's
    logits equal those of the independent KIVI reference cache (and not the full-precision cache's)."""
    ids = token_ids(2, 70)
    cache = kvcompress.cache_for(
        tiny_qwen2, "keydiff", ratio=1.0, allocation="adakv", kv_bits=bits, kv_group=8, kv_residual=16
    )
    ours = forced_logits(tiny_qwen2, ids, cache, 37)
    assert all(type(layer.pool) is QuantizedRaggedPool for layer in cache.compressed_layers)
    assert all(not layer.pool.offsets.any() for layer in cache.compressed_layers)
    layers = tiny_qwen2.config.num_hidden_layers
    reference = forced_logits(tiny_qwen2, ids, KiviReferenceCache(layers, bits, 8, 16), 37)
    exact = forced_logits(tiny_qwen2, ids, kvcompress.cache_for(tiny_qwen2, "full"), 37)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-4)
    assert float((ours - exact).abs().max()) > 1e-3


def test_bits_16_keeps_the_plain_pool(tiny_llama):
    context, mask, question = inputs(tiny_llama, padded=True)
    cache = kvcompress.cache_for(tiny_llama, "snapkv", kv_bits=16, **METHODS["snapkv"])
    run(tiny_llama, cache, context, mask, question, 2)
    assert all(type(layer.pool) is RaggedPool for layer in cache.compressed_layers)


@pytest.mark.parametrize("bits,residual", [(4, 16), (8, 32), (4, 0)])
def test_bytes_are_codes_scales_minima_and_the_window(bits, residual, tiny_llama):
    """``nbytes()`` per layer: the owned blocks' slots (each its key's and value's codes, ``bits`` per number, and
    its value's scale and minimum per channel group), one scale and minimum per channel and key group, and the
    exact window (``residual`` keys and values per row), in float32 (tiny model: head_dim 16, 2 KV heads); the
    allocated bytes are the pool's capacity and the whole ring; the layer's bytes at 4 bits are about a quarter of
    the 16-bit pool's where the blocks dominate."""
    context, mask, question = inputs(tiny_llama, padded=True, length=300)
    params = {"ratio": 0.5, "window": 4, "allocation": "adakv"}
    cache = kvcompress.cache_for(tiny_llama, "snapkv", kv_bits=bits, kv_group=8, kv_residual=residual, **params)
    plain = kvcompress.cache_for(tiny_llama, "snapkv", **params)
    run(tiny_llama, cache, context, mask, question, 10)
    run(tiny_llama, plain, context, mask, question, 10)
    dim, group, float_bytes, rows = 16, 8, 4, 2 * 2
    seen = 300 + 6 + 10
    for layer, plain_layer in zip(cache.compressed_layers, plain.compressed_layers, strict=True):
        pool = layer.pool
        slots = pool.used * pool.block
        codes = slots * 2 * dim * bits // 8
        value_params = slots * 2 * (dim // group) * float_bytes
        key_params = slots // group * 2 * dim * float_bytes
        window = rows * min(seen, residual) * 2 * dim * float_bytes
        assert layer.kv_nbytes() == codes + value_params + key_params + window
        assert slots - pool.stored_tokens() < rows * (pool.block + group)  # slack: a block and the leading slots
        allocated = pool.capacity * pool.block
        ring = rows * residual * (2 * dim * float_bytes + 8)
        assert (
            layer.allocated_nbytes()
            == allocated * (2 * dim * bits // 8 + 2 * (dim // group) * float_bytes)
            + (allocated // group * 2 * dim * float_bytes)
            + ring
        )
        assert layer.allocated_nbytes() >= layer.kv_nbytes()
        if bits == 4 and residual == 0:
            # per token: 16 bytes of codes + 16 of value parameters + 16 of key parameters, against 128 at 32 bits
            # (float32 parameters over 16 channels make 4 bits cost 3/8 of float32 here; 4/32 + 2*2/group/... on
            # a bfloat16 model with head_dim 64 and group 32: measured in docs)
            ratio = layer.kv_nbytes() / plain_layer.kv_nbytes()
            expected = (16 + 16 + 16) / 128 * (slots / (plain_layer.pool.used * plain_layer.pool.block))
            assert abs(ratio - expected) < 1e-9
    assert cache.nbytes() < plain.nbytes()


def test_decoding_steps_take_no_host_read(monkeypatch, tiny_llama):
    """After the move, a decoding step of the quantized pool (sealing steps included) reads nothing back from the
    device: ``Tensor.item``, ``tolist``, ``cpu``, ``numpy`` and the conversions to Python numbers are made to fail
    during the steps (the check itself: ``test_the_host_read_check_fails_on_a_read``)."""
    context, _, question = inputs(tiny_llama, padded=False)
    cache = kvcompress.cache_for(tiny_llama, "snapkv", kv_bits=4, kv_group=8, kv_residual=16, **METHODS["snapkv"])
    with torch.no_grad():
        prefill(tiny_llama, context, cache)
        tiny_llama(question, **cache_argument(tiny_llama, cache), use_cache=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read during a decoding step")

    token = question[:, -1:]
    with torch.no_grad():
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
                patch.setattr(torch.Tensor, name, refuse)
            for _ in range(20):  # 20 steps: two seals of key groups of 8
                tiny_llama(token, **cache_argument(tiny_llama, cache), use_cache=True)
    assert all(layer.pool.stream == 45 + 6 + 20 for layer in cache.compressed_layers)


def test_group_must_fit_the_head_dimension(tiny_llama):
    context, mask, question = inputs(tiny_llama, padded=False)
    cache = kvcompress.cache_for(tiny_llama, "snapkv", kv_bits=4, kv_group=32, kv_residual=32, **METHODS["snapkv"])
    with pytest.raises(ValueError, match=r"kv_group must divide the value head dimension \(16\)"):
        run(tiny_llama, cache, context, mask, question, 1)


def test_rows_in_step_with_the_stream():
    """Every row ends on the same offset of its key group as the stream: ``(offset + count) % group == seen %
    group`` (the empty leading slots fewer than a group)."""
    torch.manual_seed(0)
    token_idx = torch.arange(45).expand(1, 4, 45).clone()
    valid = torch.rand(1, 4, 45) < 0.5
    record = StreamRecord.from_slots(token_idx, token_idx, token_idx, torch.tensor([45]), 45)
    keys = torch.randn(1, 4, 45, 8)
    pool = QuantizedRaggedPool.from_rows(keys, keys, token_idx, valid, record, bits=4, group=8, residual=8, seen=45)
    counts = valid[0].sum(-1).numpy()
    assert np.all((pool.offsets + counts) % 8 == 45 % 8) and np.all(pool.offsets < 8)
    assert np.array_equal(pool.row_counts(), counts)


def test_the_host_read_check_fails_on_a_read(monkeypatch, tiny_llama):
    """The check above, with a host read put into the pool's step: it fails."""
    original = QuantizedRaggedPool._step

    def reading(pool, query, scale):
        int(pool.ring_target[0, 0])
        return original(pool, query, scale)

    monkeypatch.setattr(QuantizedRaggedPool, "_step", reading)
    with pytest.raises(AssertionError, match="a host read during a decoding step"):
        test_decoding_steps_take_no_host_read(monkeypatch, tiny_llama)


def test_fork_and_save_load_continue_alike(tmp_path, tiny_llama):
    """A quantized ragged cache forked, and saved then loaded, decodes as the original (through seals)."""
    context, _, question = inputs(tiny_llama, padded=False)
    cache = kvcompress.cache_for(tiny_llama, "snapkv", kv_bits=4, kv_group=8, kv_residual=8, **METHODS["snapkv"])
    ids = torch.cat([question, question.flip(-1), question], -1)
    with torch.no_grad():
        prefill(tiny_llama, context, cache)
        kvcompress.save_cache(cache, tmp_path / "ragged.safetensors")
        loaded = kvcompress.load_cache(tmp_path / "ragged.safetensors", tiny_llama)
        fork = cache.fork()
        expected = forced_logits(tiny_llama, ids, cache, 1)
        assert torch.equal(forced_logits(tiny_llama, ids, fork, 1), expected)
        assert torch.equal(forced_logits(tiny_llama, ids, loaded, 1), expected)
    assert type(loaded.compressed_layers[0].pool) is QuantizedRaggedPool
    assert loaded.nbytes() == cache.nbytes()


def test_chunked_prefill_moves_once_quantized(monkeypatch, tiny_qwen2):
    """A prompt prefilled in chunks of 16 (the slot layer holds it until the last chunk, then compresses): the
    same kept sets as at 16 bits, and every forward after the move attends over the dequantized blocks."""
    params = {"ratio": 0.5, "allocation": "adakv"}
    context, mask, question = inputs(tiny_qwen2, padded=True)
    full = kvcompress.cache_for(tiny_qwen2, "keydiff", **params)
    run(tiny_qwen2, full, context, mask, question, 10, chunk=16)
    checked = compare_with_dequantized_blocks(monkeypatch)
    cache = kvcompress.cache_for(tiny_qwen2, "keydiff", kv_bits=4, kv_group=8, kv_residual=8, **params)
    run(tiny_qwen2, cache, context, mask, question, 10, chunk=16)
    for ours, theirs in zip(cache.compressed_layers, full.compressed_layers, strict=True):
        assert kept_tokens(ours) == kept_tokens(theirs)
    assert checked.count(6) == checked.count(1) / 10 == len(cache.compressed_layers)
