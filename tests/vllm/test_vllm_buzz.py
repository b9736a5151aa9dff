"""Block BUZZ in the worker against an independent reference of the paper's rule, and its block arithmetic (no
engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402

from kvcompress.vllm.carry import LayerCarry  # noqa: E402
from kvcompress.vllm.config import BlockPolicyConfig  # noqa: E402
from kvcompress.vllm.policies import make_policy  # noqa: E402
from kvcompress.vllm.scores import RefillRow, buzz_refill  # noqa: E402

KV_HEADS = 3
BLOCK = 4


def _reference(leaving: list[int], score, threshold: int, stride: int) -> list[list[int]]:
    """The middle of one KV head (old blocks, then new) after each block of ``leaving`` left the window, written
    from the paper's Algorithm 1 with blocks as tokens: the new buffer grows until old + new exceeds ``T``; then old
    blocks 0, ŝ, 2ŝ, ... and the first best-scored block of each hive of ``s`` new blocks survive, thinned again by
    every ŝ-th until they fit (Remark 2)."""
    old_stride = (stride + 1) // 2
    old: list[int] = []
    new: list[int] = []
    history = []
    for block in leaving:
        new.append(block)
        if len(old) + len(new) > threshold:
            hives = [new[i : i + stride] for i in range(0, len(new), stride)]
            survivors = old[::old_stride] + [max(hive, key=lambda b: (score(b), -hive.index(b))) for hive in hives]
            while len(survivors) > threshold:
                survivors = survivors[::old_stride]
            old, new = survivors, []
        history.append(old + new)
    return history


@pytest.mark.parametrize(
    "budget_blocks,recent,stride",
    [(3, 0, 5), (5, 0, 5), (8, 0, 5), (14, 2, 3), (12, 1, 4), (20, 0, 5)],
)
def test_buzz_blocks_follow_the_papers_segmented_heavy_hitters_per_kv_head(budget_blocks, recent, stride):
    sinks = 1
    config = BlockPolicyConfig("buzz", budget_blocks * BLOCK, recent_blocks=recent, stride=stride)
    policy = make_policy(config, BLOCK)
    threshold, window = policy.threshold, policy.recent_blocks
    assert sinks + threshold + window == budget_blocks and threshold >= 1 and window >= 1
    front = policy.sink_blocks  # sinks + the T slots
    num_blocks = front + 60
    generator = torch.Generator().manual_seed(budget_blocks)
    block_scores = torch.rand(num_blocks, KV_HEADS, generator=generator)
    block_scores[front + 5 : front + 7, 0] = 2.0  # a tie inside a hive: the earliest wins
    kv_cache = torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1).repeat(1, KV_HEADS, BLOCK, 2)
    scores = block_scores.clone()
    blocks = torch.arange(num_blocks)
    carry = LayerCarry()
    references = [
        _reference(list(range(sinks, num_blocks)), lambda b, h=head: float(block_scores[b, h]), threshold, stride)
        for head in range(KV_HEADS)
    ]
    for logical in range(front, num_blocks):  # one block leaves the window at each boundary
        row = RefillRow(blocks[sinks:front], blocks[logical : logical + 1], "r", sinks, logical)
        buzz_refill(scores, kv_cache, row, policy, carry)
        left = logical - sinks + 1
        middle = policy.middle_blocks(left)
        for head in range(KV_HEADS):
            expected = references[head][left - 1]
            assert middle == len(expected)
            held = kv_cache[sinks : sinks + middle, head, 0, 0].long().tolist()
            assert held == expected, (logical, head)
            # each slot carries its block's score, and the carry records which block each slot holds
            torch.testing.assert_close(scores[sinks : sinks + middle, head], block_scores[torch.tensor(held), head])
            assert carry.origin["r"][head, sinks : sinks + middle].tolist() == expected
    # blocks leaving several at once (a prompt's end) go through the rule one by one: the same slots
    kv_batch, scores_batch = (
        torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1).repeat(1, KV_HEADS, BLOCK, 2),
        block_scores.clone(),
    )
    buzz_refill(scores_batch, kv_batch, RefillRow(blocks[sinks:front], blocks[front:], "r", sinks, front), policy, None)
    assert torch.equal(kv_batch[sinks:front], kv_cache[sinks:front])


@pytest.mark.parametrize("budget_blocks,recent,stride", [(3, 0, 5), (5, 0, 5), (8, 0, 5), (14, 2, 3), (20, 0, 5)])
def test_buzz_block_ranges_hold_the_budget_and_hide_exactly_the_unused_slots(budget_blocks, recent, stride):
    policy = make_policy(BlockPolicyConfig("buzz", budget_blocks * BLOCK, recent_blocks=recent, stride=stride), BLOCK)
    sinks, threshold, window = policy.first_sink_blocks, policy.threshold, policy.recent_blocks
    contexts = torch.arange(0, 300 * BLOCK, 3)
    lo_all, hi_all = policy.worker_range(contexts, torch.zeros_like(contexts))
    history = _reference(list(range(2000)), lambda b: 0.0, threshold, stride)
    for i, context in enumerate(contexts.tolist()):
        blocks = context // BLOCK + 1  # the block being written included
        left = max(blocks - window - sinks, 0)
        middle = len(history[left - 1]) if left else 0
        lo, hi = policy.worker_range(context, 0)
        assert (lo, hi) == (sinks + middle, sinks + left) == (int(lo_all[i]), int(hi_all[i]))
        s_lo, s_hi = policy.scheduler_range(context, 0)
        if s_hi > s_lo:  # the scheduler never frees a block the worker reads
            assert lo <= s_lo and s_hi <= hi
        held = blocks - (s_hi - s_lo)
        assert held == min(blocks, budget_blocks)
        assert blocks - (hi - lo) == min(blocks, sinks + middle + window)  # what the kernel attends to


def test_buzz_window_follows_theorem_3_1_where_the_budget_holds_it():
    # s = 5: T / w = 26 / 6; one sink block. 20 blocks: w = 3 (3 + 13 <= 19), T = 16; 6 blocks and fewer: w = 1.
    for budget_blocks, window in [(3, 1), (5, 1), (6, 1), (7, 1), (12, 2), (20, 3)]:
        policy = make_policy(BlockPolicyConfig("buzz", budget_blocks * 128), 128)
        assert policy.recent_blocks == window, budget_blocks
        assert policy.threshold == budget_blocks - 1 - window
    with pytest.raises(ValueError, match="buzz needs at least 3 blocks"):
        make_policy(BlockPolicyConfig("buzz", 2 * 128), 128)
    with pytest.raises(ValueError, match="stride must be >= 3"):
        BlockPolicyConfig("buzz", 640, stride=2)
