"""Ragged storage (core/ragged.py, core/ragged_layer.py): per-head budgets stored as the sum of the heads' counts.

Exactness: the ragged layer gives the logits and greedy tokens of the slot layout it replaces (``ragged=False``,
heads x the fullest head, the shorter heads' slots masked) through a question forward of several tokens and enough
decoding steps to fill blocks and take new ones, with left-padded batches of 2. The tolerance is the equivalence
tests' (rtol 1e-4, atol 1e-5): both sides compute the same float32 softmax over the same keys, summed in another
order (per block, then the blocks together), so they differ by float32 rounding only (measured: ~5e-6 at most).
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.core.ragged import RaggedPool
from kvcompress.core.ragged_layer import RaggedLayer
from kvcompress.core.ragged_stream import StreamRecord
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import tiny_model
from tests.helpers import duo_pattern_file, kept_tokens, tiny_tokenizer_dir

SCORERS = {
    "snapkv": {"ratio": 0.5, "window": 4, "allocation": "adakv"},
    "keydiff": {"ratio": 0.5, "allocation": "adakv"},
    "expected_attention": {"ratio": 0.4, "allocation": "adakv"},
}


def run(model, cache, context, context_mask, question, steps, chunk=None):
    """Prefill ``context`` (in ``chunk``-token forwards), one forward of ``question``, then ``steps`` greedy steps:
    the logits of each forward's last position ``[B, steps + 1, V]``, and the tokens."""
    prefill(model, context, cache, context_mask, chunk_size=chunk)
    mask = None if context_mask is None else torch.cat([context_mask, torch.ones_like(question)], 1)
    logits = model(question, attention_mask=mask, **cache_argument(model, cache), use_cache=True).logits[:, -1]
    out, tokens = [logits], []
    for _ in range(steps):
        token = out[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = None if mask is None else torch.cat([mask, torch.ones_like(token)], 1)
        out.append(model(token, attention_mask=mask, **cache_argument(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out, 1), torch.cat(tokens, 1)


def inputs(model, padded: bool, length: int = 45):
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(3, model.config.vocab_size, (2, length), generator=generator)
    question = torch.randint(3, model.config.vocab_size, (2, 6), generator=generator)
    mask = None
    if padded:
        mask = torch.ones_like(context)
        mask[0, :7] = 0
        context = context.masked_fill(mask == 0, 0)
    return context, mask, question


def assert_same_as_slots(model, method, params, padded, steps=40, chunk=None):
    context, mask, question = inputs(model, padded)
    ragged = kvcompress.cache_for(model, method, **params)
    slots = kvcompress.cache_for(model, method, ragged=False, **params)
    ragged_logits, ragged_tokens = run(model, ragged, context, mask, question, steps, chunk)
    slot_logits, slot_tokens = run(model, slots, context, mask, question, steps, chunk)
    assert all(isinstance(layer, RaggedLayer) and layer.ragged for layer in ragged.compressed_layers)
    assert not any(isinstance(layer, RaggedLayer) for layer in slots.compressed_layers)
    uneven = [layer.pool.row_counts() for layer in ragged.compressed_layers]
    assert any(len(set(counts.tolist())) > 1 for counts in uneven)  # heads really keep different counts
    for a, b in zip(ragged.compressed_layers, slots.compressed_layers, strict=True):
        assert kept_tokens(a) == kept_tokens(b)  # the same tokens, now and after decoding
        ours, theirs = a.kept(), b.kept()  # their positions and ranks (read from the cache's stream record)
        assert torch.equal(ours.valid, theirs.valid)
        assert torch.equal(ours.rope_pos[ours.valid], theirs.rope_pos[theirs.valid])
        assert torch.equal(ours.rank[ours.valid], theirs.rank[theirs.valid])
    records = {id(layer.pool.record) for layer in ragged.compressed_layers}
    assert len(records) == 1  # one record of positions and ranks for the whole cache
    assert sum(layer.pool.owns_record for layer in ragged.compressed_layers) == 1  # counted once
    torch.testing.assert_close(ragged_logits, slot_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(ragged_tokens, slot_tokens)
    return ragged


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("method", sorted(SCORERS))
def test_adakv_ragged_equals_slot_layout_with_padding(method, model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    cache = assert_same_as_slots(model, method, SCORERS[method], padded=True)
    # 40 steps past a 16-token block: every row took new blocks while decoding
    assert all(layer.pool.used > layer.pool.rows for layer in cache.compressed_layers)


def test_chunked_prefill_compresses_once_then_moves(tiny_qwen2):
    """A prompt prefilled in chunks compresses after the last one (``compress``): the move happens there too."""
    assert_same_as_slots(tiny_qwen2, "keydiff", SCORERS["keydiff"], padded=True, steps=20, chunk=16)


@pytest.mark.parametrize("allocation", ["global", "layer"])
def test_kvzip_head_budgets_ragged_equal_slot_layout(allocation, tiny_llama):
    params = {"ratio": 0.5, "allocation": allocation, "tokenizer": tiny_tokenizer_dir()}
    assert_same_as_slots(tiny_llama, "kvzip", params, padded=False)


def test_everything_kept_is_the_full_cache(tiny_qwen2):
    """Nothing evicted: the ragged cache gives the full cache's logits (the model's own attention is covered for
    adakv and kvzip by tests/test_equivalence.py, which now runs through ragged storage)."""
    context, mask, question = inputs(tiny_qwen2, padded=True)
    full = kvcompress.cache_for(tiny_qwen2, "full")
    ragged = kvcompress.cache_for(tiny_qwen2, "keydiff", ratio=1.0, allocation="adakv")
    full_logits, full_tokens = run(tiny_qwen2, full, context, mask, question, 20)
    logits, tokens = run(tiny_qwen2, ragged, context, mask, question, 20)
    assert all(layer.ragged for layer in ragged.compressed_layers)
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(tokens, full_tokens)


def test_nbytes_are_the_blocks_held(tiny_llama):
    """``nbytes()`` = the kept tokens' key and value bytes plus each head's unfilled part of its last block (at most
    block - 1 tokens per head); the padding a slot layer stores is not moved into the pool."""
    context, mask, question = inputs(tiny_llama, padded=True, length=300)
    cache = kvcompress.cache_for(tiny_llama, "keydiff", ratio=0.5, allocation="adakv")
    prefill(tiny_llama, context, cache, mask)
    token_bytes = 2 * 16 * 4  # key + value, head_dim 16, float32
    total = 0
    for layer in cache.compressed_layers:
        pool = layer.pool
        kept = int(layer.valid.sum())
        assert kept == pool.stored_tokens()  # padding is not moved into the pool
        assert layer.kv_nbytes() == pool.used * pool.block * token_bytes
        assert kept * token_bytes <= layer.kv_nbytes() <= (kept + pool.rows * (pool.block - 1)) * token_bytes
        assert layer.allocated_nbytes() >= layer.kv_nbytes()
        total += layer.kv_nbytes()
    assert cache.nbytes() == total


def test_pool_appends_without_regrowing_each_step():
    """Blocks are taken only when a row's last block is full, the pool grows geometrically, and what was appended
    reads back in order."""
    torch.manual_seed(0)
    batch, heads, dim, width = 2, 3, 8, 40
    keys = torch.randn(batch, heads, width, dim)
    valid = torch.rand(batch, heads, width) < 0.6
    token_idx = torch.arange(width).expand(batch, heads, width).clone()
    record = StreamRecord.from_slots(token_idx, token_idx, token_idx, torch.tensor([width, width]), width)
    pool = RaggedPool.from_rows(keys, keys, token_idx, valid, record)
    counts = valid.flatten(0, 1).sum(-1)
    assert pool.stored_tokens() == int(counts.sum())
    capacities = {pool.capacity}
    new = torch.randn(batch, heads, 300, dim)
    for step in range(300):
        flat = pool.append(new[:, :, step : step + 1], new[:, :, step : step + 1])
        pool.register(flat, width + step, None, None)
        capacities.add(pool.capacity)
    grown = sorted(capacities)
    assert all(after >= 1.125 * before for before, after in zip(grown, grown[1:], strict=False))  # geometric growth
    dense_keys, _, tokens, positions, ranks, dense_valid = pool.dense()
    for row in range(batch * heads):
        b, h = divmod(row, heads)
        kept = keys[b, h][valid[b, h]]
        stored = dense_keys[b, h][dense_valid[b, h]]
        assert torch.equal(stored, torch.cat([kept, new[b, h]]))
        assert tokens[b, h][dense_valid[b, h]][-300:].tolist() == list(range(width, width + 300))
        assert torch.equal(positions[b, h], tokens[b, h]) and torch.equal(ranks[b, h], tokens[b, h])
    assert pool.used * pool.block - pool.stored_tokens() < pool.rows * pool.block


def test_decoding_step_equals_attention_over_each_rows_tokens():
    """A decoding step (``_step``) gives, for every (sequence, query head), the softmax attention over its KV head's
    stored tokens (explicit, one row at a time), through steps that take new blocks and grow the pool; it equals
    the general path (``_attend_rows``, the new token seen by its query) to float32 rounding."""
    torch.manual_seed(1)
    batch, heads, groups, dim, width = 2, 3, 2, 8, 40
    keys, values = torch.randn(batch, heads, width, dim), torch.randn(batch, heads, width, dim)
    valid = torch.rand(batch, heads, width) < torch.tensor([0.2, 0.6, 0.9])[:, None]  # uneven rows
    valid[..., 0] = True
    token_idx = torch.arange(width).expand(batch, heads, width).clone()
    record = StreamRecord.from_slots(token_idx, token_idx, token_idx, torch.tensor([width, width]), width)
    pool = RaggedPool.from_rows(keys, values, token_idx, valid, record)
    stored_keys = [[keys[b, h][valid[b, h]] for h in range(heads)] for b in range(batch)]
    stored_values = [[values[b, h][valid[b, h]] for h in range(heads)] for b in range(batch)]
    capacities = {pool.capacity}
    for step in range(70):
        new_keys, new_values = torch.randn(batch, heads, 1, dim), torch.randn(batch, heads, 1, dim)
        flat = pool.append(new_keys, new_values)
        pool.register(flat, width + step, None, None)
        capacities.add(pool.capacity)
        query = torch.randn(batch, heads * groups, 1, dim)
        output = pool.attend(query, 0.3, True, width + step)
        general = pool.attend(query, 0.3, False, width + step)
        torch.testing.assert_close(output, general, rtol=1e-5, atol=1e-6)
        for b in range(batch):
            for h in range(heads):
                stored_keys[b][h] = torch.cat([stored_keys[b][h], new_keys[b, h]])
                stored_values[b][h] = torch.cat([stored_values[b][h], new_values[b, h]])
                rows = query[b, h * groups : (h + 1) * groups, 0]
                expected = (rows @ stored_keys[b][h].T * 0.3).softmax(-1) @ stored_values[b][h]
                torch.testing.assert_close(output[b, h * groups : (h + 1) * groups, 0], expected, rtol=1e-5, atol=1e-6)
    assert len(capacities) > 1  # the pool grew while stepping


BATCH_MOVES = {  # method and parameters (made when a test runs): a per-head allocation, KVzip's budgets over every
    # head, 4-bit codes, DuoAttention's retrieval and streaming heads
    "snapkv-adakv": lambda: ("snapkv", SCORERS["snapkv"]),
    "kvzip-global": lambda: ("kvzip", {"ratio": 0.5, "allocation": "global", "tokenizer": tiny_tokenizer_dir()}),
    "keydiff-adakv-kv4": lambda: ("keydiff", {**SCORERS["keydiff"], "kv_bits": 4, "kv_group": 8, "kv_residual": 16}),
    "duo": lambda: ("duo", {"pattern": duo_pattern_file(), "sink_size": 2, "recent_size": 6}),
}


@pytest.mark.parametrize("case", sorted(BATCH_MOVES))
def test_a_ragged_cache_repeats_and_reorders_its_batch(case, tiny_llama):
    """Beam search's moves of the batch between decoding steps (``batch_repeat_interleave(2)``, then
    ``reorder_cache`` repeating one sequence and dropping a copy of the other) leave the cache a cache of the moved
    batch would be: its tokens, positions and ranks per row, and its logits over the next steps (the tolerance of
    the module docstring: the batches differ in size, so products may be summed in another order)."""
    method, params = BATCH_MOVES[case]()
    context, mask, question = inputs(tiny_llama, padded=method != "kvzip")
    order = torch.tensor([1, 0, 0, 0])  # [0, 0, 1, 1] after the repeat, then [3, 0, 0, 1]
    moved = kvcompress.cache_for(tiny_llama, method, **params)
    _, tokens = run(tiny_llama, moved, context, mask, question, 20)  # rows fill blocks and take new ones
    moved.batch_repeat_interleave(2)
    moved.reorder_cache(torch.tensor([3, 0, 0, 1]))
    fresh = kvcompress.cache_for(tiny_llama, method, **params)  # the moved batch from the start
    fresh_mask = None if mask is None else mask[order]
    _, fresh_tokens = run(tiny_llama, fresh, context[order], fresh_mask, question[order], 20)
    assert torch.equal(fresh_tokens, tokens[order])
    for a, b in zip(moved.compressed_layers, fresh.compressed_layers, strict=True):
        assert a.ragged and a.pool.batch == 4 and b.ragged
        assert kept_tokens(a) == kept_tokens(b)
        ours, theirs = a.kept(), b.kept()
        assert torch.equal(ours.valid, theirs.valid)
        assert torch.equal(ours.rope_pos[ours.valid], theirs.rope_pos[theirs.valid])
        assert torch.equal(ours.rank[ours.valid], theirs.rank[theirs.valid])
        assert a.pool.used == int(a.pool.row_blocks.sum()) <= a.pool.capacity  # each row owns its copies
    assert sum(layer.pool.owns_record for layer in moved.compressed_layers) == 1
    mask = None if mask is None else torch.cat([mask[order], torch.ones(4, 6 + 20, dtype=mask.dtype)], 1)
    token = tokens[order, -1:]
    for _ in range(20):  # past a block's worth: rows take new blocks after the move
        mask = None if mask is None else torch.cat([mask, torch.ones_like(token)], 1)
        ours = tiny_llama(token, attention_mask=mask, **cache_argument(tiny_llama, moved)).logits[:, -1]
        theirs = tiny_llama(token, attention_mask=mask, **cache_argument(tiny_llama, fresh)).logits[:, -1]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        token = theirs.argmax(-1, keepdim=True)


def test_beam_search_over_a_ragged_cache_returns_the_slot_layouts_beams(tiny_qwen2):
    """``generate`` with beams and several returned sequences (it repeats the prompt's batch, then reorders the
    cache at every step) gives the slot layout's sequences and scores."""
    context, _, _ = inputs(tiny_qwen2, padded=False)
    results = {}
    for ragged in (True, False):
        cache = kvcompress.cache_for(tiny_qwen2, "snapkv", ragged=ragged, **SCORERS["snapkv"])
        settings = {"num_beams": 3, "num_return_sequences": 2, "do_sample": False, "max_new_tokens": 24}
        out = tiny_qwen2.generate(
            context, **cache_argument(tiny_qwen2, cache), **settings, output_scores=True, return_dict_in_generate=True
        )
        results[ragged] = out
        if ragged:
            assert all(layer.ragged and layer.pool.batch == 6 for layer in cache.compressed_layers)
    assert torch.equal(results[True].sequences, results[False].sequences)
    torch.testing.assert_close(results[True].sequences_scores, results[False].sequences_scores, rtol=1e-4, atol=1e-5)


def test_pool_follows_the_model_dtype():
    """A bfloat16 model's pool holds bfloat16 keys, values and bias; the softmax runs in float32 and the logits
    stay finite (not compared with the slot layout: the two sum bfloat16 products in different orders)."""
    model = tiny_model("llama", seed=0).to(torch.bfloat16)
    context, mask, question = inputs(model, padded=True)
    ragged = kvcompress.cache_for(model, "keydiff", **SCORERS["keydiff"])
    logits, _ = run(model, ragged, context, mask, question, 5)
    pool = ragged.compressed_layers[0].pool
    assert pool.keys.dtype == pool.values.dtype == pool.bias.dtype == torch.bfloat16
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_bookkeeping_per_stored_token_is_bounded(tiny_llama):
    """Per stored slot the pool keeps its mask entry (the model's dtype: 4 bytes in float32) and its stream index
    (int32: 4 bytes), plus its block's owner (int64) shared by the block's slots: at most 4 + 4 + ceil(8 / 16) = 9
    bytes with the smallest block, 16 tokens. Positions and ranks are the cache's record: 8 bytes per sequence and
    stream index, counted by one layer (not per layer and head). So the cache's bookkeeping is at most 9 bytes per
    held slot plus 8 bytes per sequence and stream index, against 2 x head_dim x 4 = 128 bytes of key and value per
    slot here (512 on SmolLM2)."""
    context, mask, question = inputs(tiny_llama, padded=True, length=300)
    cache = kvcompress.cache_for(tiny_llama, "keydiff", ratio=0.5, allocation="adakv")
    run(tiny_llama, cache, context, mask, question, 20)
    held = sum(layer.pool.held_slots() for layer in cache.compressed_layers)
    stream = cache.compressed_layers[0].pool.record.length
    assert stream == 300 + 6 + 20  # the prompt, the question and the decoding steps
    for layer in cache.compressed_layers:
        pool = layer.pool
        assert pool.metadata_bytes_per_slot() <= 4 + 4 + 1
        assert layer.metadata_nbytes() == pool.held_slots() * pool.metadata_bytes_per_slot() + pool.record_nbytes()
    assert cache.metadata_nbytes() <= held * 9 + 2 * stream * 8
    assert cache.metadata_nbytes() >= held * 8  # (the bound is not vacuous: every slot has its 8 bytes)
