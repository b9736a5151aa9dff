"""With a budget at least the request's length, the plugin changes nothing: greedy outputs equal vLLM's own.

Engines (SmolLM2-135M's first two layers, ``short_model_dir``: what is checked, greedy tokens equal to vLLM's own
run of the same model, does not depend on the depth, and a budget of four blocks fails it): every policy and
scoring mode at a ten-block budget. The prompts straddle block boundaries
(127-129, 255-257, 1151-1153 tokens) and reach the budget exactly (1232 prompt + 48 generated tokens = 1280, ten
blocks); 1200 tokens under snapkv's 1280 is a prompt of ten blocks whose observation window sits in its last block,
which an earlier version compressed anyway.

Arithmetic (no engine): at every budget from the smallest a policy accepts to 14 blocks, for requests of every
length up to the budget straddling each block boundary, and prompts of one token, half the request or all but
its last token, no step hides a block from the kernel, the scheduler frees nothing, no block leaves a scored
policy's window (no refill) and SnapKV's selections move nothing. A budget counts whole blocks (a token budget is
rounded down: it caps memory), and cascade's is the blocks its N sub-caches use (``1 + N W``; the blocks N does
not divide are not used, as in kvcompress's per-token ``cascade``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kvcompress.vllm.config import BlockPolicyConfig  # noqa: E402
from kvcompress.vllm.policies import make_policy  # noqa: E402
from tests.vllm.conftest import reference_outputs  # noqa: E402
from tests.vllm.engine import close, greedy, make_llm, manager, prompt  # noqa: E402

MAX_TOKENS = 48
BUDGET = 1280  # ten blocks of 128 tokens
CONCURRENT = [prompt(120, seed=2), prompt(330, seed=3), prompt(40, seed=4)]
BOUNDARY_LENGTHS = [127, 128, 129, 255, 256, 257, 1151, 1152, 1153, 1200, BUDGET - MAX_TOKENS]
POLICIES = [
    {"method": "streaming", "budget": BUDGET},
    {"method": "window", "budget": BUDGET},
    {"method": "snapkv", "budget": BUDGET},
    {"method": "h2o", "budget": BUDGET},
    {"method": "cascade", "budget": BUDGET, "cascades": 3},  # 1 sink + 3 cascades of 3 blocks: the 10 blocks
    {"method": "buzz", "budget": BUDGET},  # 1 sink + a middle of 8 blocks + a window of 1
    {"method": "h2o", "budget": BUDGET, "scoring": "one_pass"},
    {"method": "cascade", "budget": BUDGET, "cascades": 3, "scoring": "one_pass"},
    {"method": "buzz", "budget": BUDGET, "stride": 5, "scoring": "one_pass"},
    {"method": "snapkv", "budget": BUDGET, "reselect_blocks": 1},
]


@pytest.fixture(scope="module")
def prompts(short_model_dir):
    ids = AutoTokenizer.from_pretrained(short_model_dir)(prompt(1400, seed=11)).input_ids
    assert len(ids) >= max(BOUNDARY_LENGTHS)
    return CONCURRENT + [{"prompt_token_ids": ids[:n]} for n in BOUNDARY_LENGTHS]


@pytest.fixture(scope="module")
def reference(short_model_dir, prompts, tmp_path_factory):
    return reference_outputs(short_model_dir, [prompts], MAX_TOKENS, tmp_path_factory.mktemp("reference"), 1536)[0]


@pytest.mark.parametrize("policy", POLICIES, ids=["-".join(map(str, p.values())) for p in POLICIES])
def test_budget_covering_the_request_gives_vllms_own_greedy_output(policy, short_model_dir, prompts, reference):
    llm = make_llm(short_model_dir, policy, max_model_len=1536)
    assert type(manager(llm)).__name__ == "BlockEvictionManager"  # the policy is really in place
    try:
        outputs = greedy(llm, prompts, MAX_TOKENS)
    finally:
        close(llm)
    for length, output, expected in zip(["text"] * len(CONCURRENT) + BOUNDARY_LENGTHS, outputs, reference, strict=True):
        assert output == expected, f"prompt of {length} tokens"


BLOCK = 128
ARITHMETIC_POLICIES = [
    {"method": "streaming"},
    {"method": "streaming", "sink_blocks": 0},
    {"method": "window"},
    {"method": "snapkv"},
    {"method": "snapkv", "window": 1},
    {"method": "snapkv", "window": 128},
    {"method": "snapkv", "reselect_blocks": 1},
    {"method": "snapkv", "reselect_blocks": 2, "window": 128},
    {"method": "h2o"},
    {"method": "h2o", "recent_blocks": 2},
    {"method": "h2o", "sink_blocks": 0},
    {"method": "cascade"},
    {"method": "cascade", "cascades": 2},
    {"method": "cascade", "cascades": 3, "sink_blocks": 0},
    {"method": "buzz"},
    {"method": "buzz", "stride": 3},
    {"method": "buzz", "recent_blocks": 2},
]


def _request_lengths(blocks: int) -> list[int]:
    """Lengths (prompt + output tokens) up to ``blocks`` whole blocks, on each side of every block boundary."""
    lengths = {n for k in range(1, blocks + 1) for n in (k * BLOCK - 1, k * BLOCK, k * BLOCK + 1)}
    return sorted(n for n in lengths if 2 <= n <= blocks * BLOCK)


@pytest.mark.parametrize("params", ARITHMETIC_POLICIES, ids=lambda p: "-".join(map(str, p.values())))
def test_at_every_budget_covering_the_request_nothing_is_evicted_or_moved(params):
    checked = 0
    for budget_blocks in range(1, 15):
        try:
            policy = make_policy(BlockPolicyConfig(budget=budget_blocks * BLOCK, **params), BLOCK)
        except ValueError:  # below what the method needs
            continue
        used = policy.budget_blocks  # cascade: 1 + N W; every other policy: the budget
        if params["method"] == "cascade":
            assert used == policy.first_sink_blocks + policy.cascades * policy.ring_blocks
        else:
            assert used == budget_blocks
        for length in _request_lengths(used):
            cached = torch.arange(length)  # tokens cached before each step (the last token's KV is never computed)
            for prompt_len in sorted({1, length // 2, length - 1}):
                compressed = torch.where(cached >= prompt_len, prompt_len, 0)  # what the worker's tracker passes
                lo, hi = policy.worker_range(cached, compressed)
                assert bool((torch.as_tensor(hi) <= torch.as_tensor(lo)).all()), (budget_blocks, length, prompt_len)
                freed = policy.scheduler_range(cached, torch.tensor(prompt_len))
                assert bool((torch.as_tensor(freed[1]) <= torch.as_tensor(freed[0])).all())
                if policy.scored:  # no block ever leaves the window: nothing is refilled
                    assert bool((torch.as_tensor(policy.leaving_hi(cached)) == policy.leaving_hi(0)).all())
                if policy.one_shot:
                    prefill = cached[cached <= prompt_len]
                    assert bool((policy.prefill_hi(prefill) == policy.prefill_front).all())  # no prefill selection
                    decoding = cached[cached > prompt_len]
                    assert not policy.reselects(decoding, torch.full_like(decoding, prompt_len)).any()
                    # the prompt's selection (first decode step): no candidate beyond the blocks it keeps in place
                    lo_, after = (int(v) for v in policy.worker_range(prompt_len, prompt_len))
                    front, before = policy.prefill_front, int(policy.prefill_hi(prompt_len))
                    assert min(front, after) + max(after - before, 0) <= lo_
                checked += 1
    assert checked > 100
