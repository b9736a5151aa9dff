"""With a real budget: live KV blocks stay at the budget, and freed blocks are reused without changing outputs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from tests.vllm.engine import close, make_llm, manager, prompt, trace_blocks  # noqa: E402

BLOCK = 128  # vLLM's CPU block size (tokens)


def test_streaming_holds_its_budget_in_blocks_over_2k_generated_tokens(short_model_dir):
    budget_blocks, generated = 3, 2100
    policy = {"method": "streaming", "budget": budget_blocks * BLOCK}
    llm = make_llm(short_model_dir, policy, max_model_len=2400, dtype="bfloat16")  # short prompts: bf16 decodes faster
    try:
        trace = trace_blocks(llm, [prompt(100, seed=5), prompt(60, seed=6)], max_tokens=generated)
    finally:
        close(llm)
    for request_id, live in trace.live_blocks.items():
        assert len(trace.outputs[request_id]) == generated
        assert trace.logical_blocks[request_id] >= generated // BLOCK  # it went through 17+ blocks...
        assert max(live) == budget_blocks  # ...holding at most the budget at any step
        assert live[-1] == budget_blocks


# Prompts of 3-4 blocks, three requests at once. vLLM hands freed blocks out again at once (LIFO), and the small
# pool leaves it no choice; the reference run evicts the same blocks from attention but never frees them, so no
# block ever holds two requests' KV there. The log-probabilities are compared, not only the tokens: with the
# block table left uncompacted (the kernel reading evicted blocks' stale ids) the greedy tokens of this test
# stayed the same while the log-probabilities moved by up to 0.45; with compaction they are bitwise equal.
REUSE_CASES = {
    "streaming": ({"method": "streaming", "budget": 2 * BLOCK}, 12, 100),
    "snapkv": ({"method": "snapkv", "budget": 3 * BLOCK}, 14, 60),
    # Selecting again at every generated block: each request passes three re-selections.
    "snapkv-reselect": ({"method": "snapkv", "budget": 3 * BLOCK, "reselect_blocks": 1}, 16, 400),
    # One sink, one heavy slot, one recent block: every block boundary refills the slot by accumulated attention,
    # scores kept by physical block id (reset when a freed block is handed out again).
    "h2o": ({"method": "h2o", "budget": 3 * BLOCK}, 12, 300),
    # One sink, two sub-caches of one block: every block boundary runs the acceptance rule on EMA scores.
    "cascade": ({"method": "cascade", "budget": 3 * BLOCK}, 12, 300),
    # One sink, a middle of three slots, a window of one block: blocks leaving the window fill the slots, then
    # BUZZ's eviction (hive maxima, old blocks thinned) runs at every boundary that overfills the middle.
    "buzz": ({"method": "buzz", "budget": 5 * BLOCK}, 16, 600),
    # The same h2o in one torch pass (vLLM's kernel not called).
    "h2o-one-pass": ({"method": "h2o", "budget": 3 * BLOCK, "scoring": "one_pass"}, 12, 300),
}


def _run(model_dir, policy, prompts, generated, pool=None, free=True):
    llm = make_llm(model_dir, policy, num_gpu_blocks_override=pool)
    if not free:
        manager(llm).remove_skipped_blocks = lambda *args, **kwargs: None
    try:
        return trace_blocks(llm, prompts, max_tokens=generated)
    finally:
        close(llm)


@pytest.mark.parametrize("method", sorted(REUSE_CASES))
def test_outputs_do_not_change_when_a_small_pool_reuses_freed_blocks(method, short_model_dir):
    policy, small_pool, generated = REUSE_CASES[method]
    prompts = [prompt(300, seed=7), prompt(380, seed=8), prompt(340, seed=9)]
    kept = _run(short_model_dir, policy, prompts, generated, free=False)
    reused = _run(short_model_dir, policy, prompts, generated, pool=small_pool)
    assert kept.reused_blocks == 0 and reused.reused_blocks > 0
    assert kept.preemptions == reused.preemptions == 0  # a recomputed request would change its output
    assert reused.outputs == kept.outputs
    assert reused.logprobs == kept.logprobs
    if policy["method"] in ("h2o", "cascade", "buzz"):
        budget_blocks = policy["budget"] // BLOCK
        for live in reused.live_blocks.values():
            assert max(live[1:]) == budget_blocks  # the budget, from the first decode step on
    if policy.get("reselect_blocks"):  # generation bounded: budget + R blocks, + 1 in a selecting step
        for live in reused.live_blocks.values():
            assert max(live[-2 * BLOCK :]) == 3 + 1 + 1


def test_streaming_holds_budget_plus_one_chunk_during_a_chunked_prefill_and_admits_on_that(short_model_dir):
    """Prompts of 8 blocks, prefilled 256 tokens (2 blocks) a step, in a pool of 9 usable blocks.

    A request holds at most its budget (3 blocks) plus one chunk plus the block a chunk may straddle into,
    never its prompt; vLLM is told so, and admits a second request while the first is prefilling. Told the
    whole prompt (vLLM's default for full attention) it runs one request at a time here.
    """
    policy = {"method": "streaming", "budget": 3 * BLOCK}
    prompts = [prompt(800, seed=s) for s in (21, 22, 23)]

    def run(tell_vllm: bool):
        llm = make_llm(
            short_model_dir, policy, max_model_len=1280, num_gpu_blocks_override=10, max_num_batched_tokens=256
        )
        if not tell_vllm:
            manager(llm).max_admission_blocks_per_request = None
        try:
            return trace_blocks(llm, prompts, max_tokens=16)
        finally:
            close(llm)

    told, untold = run(True), run(False)
    assert all(max(live) > 3 for live in told.live_blocks.values())  # prefill chunks really passed through
    assert max(max(live) for live in told.live_blocks.values()) <= 3 + 2 + 1
    assert all(len(out) == 16 for out in told.outputs.values()) and len(told.outputs) == 3
    assert max(untold.running) == 1
    assert max(told.running) >= 2


def test_snapkv_survives_preemption_in_a_tiny_pool_holding_only_what_it_reads(short_model_dir):
    """Three requests of 4 blocks in a pool of 9: vLLM preempts and recomputes. Each request ends holding
    the blocks its worker reads (the manager's count matches the policy's arithmetic), and all finish."""
    policy = {"method": "snapkv", "budget": 3 * BLOCK}
    llm = make_llm(short_model_dir, policy, num_gpu_blocks_override=10)
    try:
        trace = trace_blocks(llm, [prompt(380, seed=s) for s in (41, 42, 43)], max_tokens=300)
    finally:
        close(llm)
    assert trace.preemptions > 0
    assert all(len(out) == 300 for out in trace.outputs.values()) and len(trace.outputs) == 3
    for live in trace.live_blocks.values():
        assert max(live[-BLOCK:]) <= 3 + -(-300 // BLOCK) + 1  # the budget + what was generated since selecting


# Prompts of 8+ blocks prefilled 256 tokens (2 blocks) a step; the bound each policy states for a step of 2 blocks.
CHUNKED_PEAKS = {
    "h2o": ({"method": "h2o", "budget": 3 * BLOCK}, 3 + 2 + 1),
    "cascade": ({"method": "cascade", "budget": 3 * BLOCK}, 3 + 2 + 1),
    "buzz": ({"method": "buzz", "budget": 3 * BLOCK}, 3 + 2 + 1),
    "snapkv": ({"method": "snapkv", "budget": 3 * BLOCK}, 3 + 2 + 2),
}


@pytest.mark.parametrize("method", sorted(CHUNKED_PEAKS))
def test_a_chunked_prefill_holds_the_budget_plus_one_step_not_the_prompt(method, short_model_dir):
    policy, bound = CHUNKED_PEAKS[method]
    llm = make_llm(short_model_dir, policy, max_model_len=1280, max_num_batched_tokens=256)
    try:
        trace = trace_blocks(llm, [prompt(800, seed=s) for s in (21, 22)], max_tokens=16)
    finally:
        close(llm)
    assert all(len(out) == 16 for out in trace.outputs.values()) and len(trace.outputs) == 2
    for request_id, live in trace.live_blocks.items():
        assert trace.logical_blocks[request_id] >= 8  # the prompts really are 8+ blocks
        assert 3 < max(live) <= bound, (request_id, live)
        # the budget (snapkv appends its 16 generated tokens, which may open one more block)
        assert live[-1] == 3 if method != "snapkv" else live[-1] in (3, 4)
