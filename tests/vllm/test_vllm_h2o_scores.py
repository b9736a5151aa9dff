"""Block H2O in the worker against plain PyTorch: the attention mass per block read from vLLM's paged CPU cache, the
refill of the heavy slots, and the policy's block arithmetic (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvcompress.vllm.config import BlockPolicyConfig  # noqa: E402
from kvcompress.vllm.layout import KeyLayout  # noqa: E402
from kvcompress.vllm.policies import make_policy  # noqa: E402
from kvcompress.vllm.scores import RefillRow, add_attention_mass, refill  # noqa: E402

BLOCK, HEADS, KV_HEADS = 128, 6, 2


def _paged(isa: str, head_size: int, requests: dict[str, tuple[list[int], torch.Tensor]], num_blocks: int = 9):
    """A CPU KV cache written by vLLM's own writer: each request's keys ``[T, H_kv, D]`` into its blocks."""
    kv_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * head_size)
    key_cache, value_cache = kv_cache.view(num_blocks, KV_HEADS, 2 * BLOCK, head_size).chunk(2, dim=2)
    for blocks, keys in requests.values():
        slots = torch.tensor(blocks).repeat_interleave(BLOCK)[: len(keys)] * BLOCK + torch.arange(len(keys)) % BLOCK
        ops.cpu_attn_reshape_and_cache(keys, torch.randn_like(keys), key_cache, value_cache, slots, isa)
    return kv_cache


def _reference_mass(queries, keys, scale):
    """Plain attention: probabilities of ``queries`` ``[q, H, D]`` (the last q positions) over ``keys``
    ``[T, H_kv, D]``, causal, summed over the queries and the query heads of each KV head: ``[H_kv, T]``."""
    num_tokens, group = len(keys), HEADS // KV_HEADS
    expanded = keys.repeat_interleave(group, dim=1)  # [T, H, D]
    logits = torch.einsum("qhd,thd->hqt", queries, expanded) * scale
    positions = torch.arange(num_tokens - len(queries), num_tokens).view(-1, 1)
    logits = logits.masked_fill(torch.arange(num_tokens) > positions, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=1).view(KV_HEADS, group, num_tokens).sum(dim=1)


@pytest.mark.parametrize("isa,head_size", [("vec", 64), ("vec16", 48)])
def test_attention_mass_per_block_equals_plain_pytorch(isa, head_size):
    torch.manual_seed(0)
    # decode: 300 kept tokens in blocks 5, 2, 7 (one query); prefill chunk: 200 tokens in blocks 1, 4, 70 queries;
    # decode: 129 tokens, a block boundary straddled by one token.
    requests = {
        "decode": ([5, 2, 7], torch.randn(300, KV_HEADS, head_size), 1),
        "prefill": ([1, 4], torch.randn(200, KV_HEADS, head_size), 70),
        "boundary": ([8, 3], torch.randn(129, KV_HEADS, head_size), 1),
    }
    kv_cache = _paged(isa, head_size, {name: (b, k) for name, (b, k, _) in requests.items()})
    queries = {name: torch.randn(q, HEADS, head_size) for name, (_, _, q) in requests.items()}
    query = torch.cat(list(queries.values()))
    starts = torch.tensor([0, 1, 71, 72])
    seq_lens = torch.tensor([len(k) for _, k, _ in requests.values()])
    table = torch.tensor([[5, 2, 7], [1, 4, 0], [8, 3, 0]], dtype=torch.int32)
    scale = head_size**-0.5
    scores = torch.zeros(9, KV_HEADS)
    layout = KeyLayout(isa, torch.float32, KV_HEADS, BLOCK, head_size)
    add_attention_mass(scores, layout, kv_cache, query, starts, seq_lens, table, scale)

    expected = torch.zeros(9, KV_HEADS)
    for name, (blocks, keys, _) in requests.items():
        mass = _reference_mass(queries[name], keys, scale)  # [H_kv, T]
        for index, block in enumerate(blocks):
            expected[block] += mass[:, index * BLOCK : (index + 1) * BLOCK].sum(dim=1)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # every query's probabilities sum to one per query head: the total mass is the number of query-head rows
    assert scores.sum().item() == pytest.approx(HEADS * (1 + 70 + 1), rel=1e-5)


def test_refill_keeps_each_heads_best_blocks_in_the_slots_and_moves_their_scores():
    torch.manual_seed(1)
    kv_cache = torch.randn(10, KV_HEADS, BLOCK, 2 * 64)
    scores = torch.rand(10, KV_HEADS)
    scores[[3, 6, 2, 5], 0] = torch.tensor([3.0, 0.0, 5.0, 0.5])  # head 0: slot 6 loses to leaving block 2
    scores[[3, 6], 1] = 4.0  # head 1: both slots stay
    scores[[2, 5], 1] = 1.0
    before_cache, before_scores = kv_cache.clone(), scores.clone()
    slots, leaving = torch.tensor([3, 6]), torch.tensor([2, 5])
    refill(scores, kv_cache, RefillRow(slots, leaving))
    for head in range(KV_HEADS):
        candidates = torch.cat([slots, leaving])
        best = set(candidates[before_scores[candidates, head].topk(2).indices].tolist())
        held = set()
        for slot in slots.tolist():  # each slot now holds one candidate's slab, whole
            (source,) = [c for c in candidates.tolist() if torch.equal(kv_cache[slot, head], before_cache[c, head])]
            assert scores[slot, head] == before_scores[source, head]
            held.add(source)
        assert held == best, head
    assert torch.equal(kv_cache[[3, 6], 1], before_cache[[3, 6], 1])  # head 1 kept its slots in place
    assert torch.equal(kv_cache[6, 0], before_cache[2, 0])  # head 0: the winner overwrote the loser
    assert torch.equal(kv_cache[3, 0], before_cache[3, 0])


@pytest.mark.parametrize("budget_blocks,sinks,recent", [(3, 1, 0), (5, 1, 0), (6, 0, 0), (6, 1, 2)])
def test_h2o_blocks_hold_the_budget_and_never_evict_sinks_or_recent_blocks(budget_blocks, sinks, recent):
    config = BlockPolicyConfig("h2o", budget_blocks * BLOCK, sink_blocks=sinks, recent_blocks=recent)
    policy = make_policy(config, BLOCK)
    assert policy.first_sink_blocks == sinks and policy.heavy_blocks >= 1 and policy.recent_blocks >= 1
    assert sinks + policy.heavy_blocks + policy.recent_blocks == budget_blocks
    if not recent:
        assert policy.recent_blocks == -(-(budget_blocks - sinks) // 2)  # H2O's even split, recent rounded up
    for context in range(0, 20 * BLOCK, 37):
        lo, hi = policy.worker_range(context, 0)
        blocks = context // BLOCK + 1  # the block being written included
        held = blocks - (hi - lo)
        assert held == min(blocks, budget_blocks)
        assert lo == sinks + policy.heavy_blocks and (hi == lo or blocks - hi == policy.recent_blocks)
    with pytest.raises(ValueError, match=rf"h2o needs at least {sinks + max(recent, 1) + 1} blocks"):
        make_policy(BlockPolicyConfig("h2o", (sinks + max(recent, 1)) * BLOCK, sinks, recent_blocks=recent), BLOCK)
