"""Tensor parallelism 2 on CPU gives the greedy outputs of one rank, for every policy, with blocks evicted.

Qwen2.5-Coder-0.5B (cut to its first layers, ``qwen_model_dir``) has 14 query and 2 KV heads: each rank holds 7
query heads and their KV head, so each per-KV-head decision (SnapKV's selected blocks, H2O's heavy blocks, cascade's
sub-caches, BUZZ's middle) is taken on the rank holding that head, from the same queries and keys as with one rank.
The scheduler, and so the evicted ranges and the freed blocks, is the same process in both runs. Six prompts of
127-1000 tokens, 3-block budgets, steps of 512 tokens: the longer prompts are prefilled over two or three steps and
the batch splits a prompt across steps, the case where an earlier check saw one streaming output of six differ
between TP=1 and TP=2.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from transformers import AutoTokenizer  # noqa: E402

from tests.vllm.engine import close, make_llm, prompt, trace_blocks  # noqa: E402

BLOCK = 128
BUDGET = 3 * BLOCK
LENGTHS = [127, 129, 300, 520, 700, 1000]
MAX_TOKENS = 24
STEP_TOKENS = 512
POLICIES = {
    "full": None,
    "streaming": {"method": "streaming", "budget": BUDGET},
    "window": {"method": "window", "budget": BUDGET},
    "snapkv": {"method": "snapkv", "budget": BUDGET},
    "snapkv-reselect": {"method": "snapkv", "budget": BUDGET, "reselect_blocks": 1},
    "h2o": {"method": "h2o", "budget": BUDGET},
    "cascade": {"method": "cascade", "budget": BUDGET},  # 1 sink + 2 cascades of 1 block
    "buzz": {"method": "buzz", "budget": BUDGET, "stride": 5},  # 1 sink + a middle of 1 slot + a window of 1 block
}


@pytest.fixture(scope="module")
def prompts(qwen_model_dir):
    ids = AutoTokenizer.from_pretrained(qwen_model_dir)(prompt(1400, seed=11)).input_ids
    return [{"prompt_token_ids": ids[:n]} for n in LENGTHS]


def _run(model: str, policy, prompts, tensor_parallel: int):
    kwargs = {"tensor_parallel_size": tensor_parallel, "max_num_batched_tokens": STEP_TOKENS}
    if tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = "mp"  # one worker process per rank, vLLM's CPU TP
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    cores = os.cpu_count() or 1
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % cores) for rank in range(tensor_parallel))
    try:
        llm = make_llm(model, policy, max_model_len=1536, **kwargs)
        try:
            return trace_blocks(llm, prompts, max_tokens=MAX_TOKENS)
        finally:
            close(llm)
    finally:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind if bind is not None else "0"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POLICIES))
def test_two_ranks_give_the_outputs_of_one(name, qwen_model_dir, prompts):
    policy = POLICIES[name]
    one = _run(qwen_model_dir, policy, prompts, 1)
    two = _run(qwen_model_dir, policy, prompts, 2)
    assert len(one.outputs) == len(LENGTHS) and all(len(out) == MAX_TOKENS for out in one.outputs.values())
    different = [LENGTHS[int(r)] for r in one.outputs if one.outputs[r] != two.outputs[r]]
    assert not different, f"{name}: TP=2 differs from TP=1 on the prompts of {different} tokens"
    assert one.live_blocks == two.live_blocks  # the same blocks held at every step
    drift = max(abs(a - b) for r in one.logprobs for a, b in zip(one.logprobs[r], two.logprobs[r], strict=True))
    print(f"{name}: 6/6 outputs equal, largest log-probability difference TP=2 - TP=1 {drift:.2e}")
    if policy is not None:  # blocks really evicted: the longer requests end at their budget
        long_requests = [r for r, n in enumerate(LENGTHS) if n > 2 * BUDGET]
        for r in long_requests:
            assert two.logical_blocks[str(r)] > 3 and two.live_blocks[str(r)][-1] <= 3 + 1
