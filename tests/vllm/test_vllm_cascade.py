"""Block cascade in the worker against independent references: the acceptance rule and the EMA (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import math  # noqa: E402

import torch  # noqa: E402

from kvcompress.vllm.config import BlockPolicyConfig  # noqa: E402
from kvcompress.vllm.policies import make_policy  # noqa: E402
from kvcompress.vllm.scores import RefillRow, _ema_weights, cascade_refill, decay  # noqa: E402

KV_HEADS = 3


def _reference(initial: list[list[int]], leaving: list[int], score, sinks: int) -> list[list[int]]:
    """The cascades of one KV head after ``leaving`` blocks leave cascade 0, written from the paper's rule.

    ``initial[i]``: the blocks of cascade ``i + 1`` in slot order; ``score(block)``: its EMA. Cascade ``i`` keeps a
    write pointer advanced by each block it accepts (the paper's circular buffer); the clock counts the blocks that
    left cascade 0.
    """
    rings = [list(ring) for ring in initial]
    pointer = [0] * len(rings)
    for clock, incoming in enumerate(leaving):
        for i, ring in enumerate(rings):
            if clock % 2 ** (i + 1) == 0:  # accepts: into the oldest slot, the displaced block moves on
                slot = pointer[i] % len(ring)
                ring[slot], incoming = incoming, ring[slot]
                pointer[i] += 1
            else:  # competes with the newest slot; the loser is dropped
                newest = (pointer[i] - 1) % len(ring)
                if score(incoming) >= score(ring[newest]):
                    ring[newest] = incoming
                break
    return rings


@pytest.mark.parametrize("cascades,ring_blocks", [(2, 1), (3, 2), (4, 1)])
def test_cascade_blocks_follow_the_papers_acceptance_rule_per_kv_head(cascades, ring_blocks):
    block = 4
    sinks = 1
    policy = make_policy(
        BlockPolicyConfig("cascade", (sinks + cascades * ring_blocks) * block, cascades=cascades), block
    )
    assert (policy.cascades, policy.ring_blocks) == (cascades, ring_blocks)
    front = policy.sink_blocks  # sinks + the slots of cascades 1 .. N-1
    num_blocks = front + 40
    generator = torch.Generator().manual_seed(cascades)
    block_scores = torch.rand(num_blocks, KV_HEADS, generator=generator)
    block_scores[7, :] = block_scores[6, :]  # a tie: the incoming block wins
    kv_cache = torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1).repeat(1, KV_HEADS, block, 2)
    scores = block_scores.clone()
    blocks = torch.arange(num_blocks)
    for logical in range(front, num_blocks):  # one block leaves cascade 0 at each boundary
        row = RefillRow(blocks[sinks:front], blocks[logical : logical + 1], "r", sinks, logical)
        cascade_refill(scores, kv_cache, row, policy, None)
    initial = [list(range(sinks + i * ring_blocks, sinks + (i + 1) * ring_blocks)) for i in range(cascades - 1)]
    for head in range(KV_HEADS):
        expected = _reference(
            initial, list(range(front, num_blocks)), lambda b, h=head: float(block_scores[b, h]), sinks
        )
        held = kv_cache[sinks:front, head, 0, 0].long().tolist()
        assert held == [b for ring in expected for b in ring], head
        # each slot carries its block's score
        torch.testing.assert_close(scores[sinks:front, head], block_scores[torch.tensor(held), head])


def test_cascade_gamma_and_ema_closed_form_match_the_token_by_token_ema():
    policy = make_policy(BlockPolicyConfig("cascade", 9 * 128, cascades=4), 128)
    assert policy.ring_blocks == 2 and policy.budget_blocks == 9
    assert policy.gamma == pytest.approx(math.exp(-4 * math.log(100) / (4 * 2 * 128)))
    gamma, q = policy.gamma, 37
    per_query = torch.rand(q, 5)  # attention mass of 5 blocks from each of q queries
    ema = torch.rand(5)
    expected = ema.clone()
    for m in range(q):  # the paper's update, one token step at a time
        expected = gamma * expected + (1 - gamma) * per_query[m]
    scores = ema.clone().unsqueeze(1)  # [blocks, 1 head]
    table = torch.arange(5).unsqueeze(0)
    decay(scores, torch.tensor([0, q]), torch.tensor([5 * 128]), table, gamma, 128)
    scores[:, 0] += (_ema_weights(q, gamma, "cpu").unsqueeze(1) * per_query).sum(dim=0)
    torch.testing.assert_close(scores[:, 0], expected)
