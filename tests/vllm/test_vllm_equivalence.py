"""With a budget at least the request's length, the plugin changes nothing: greedy outputs equal vLLM's own.

The prompts straddle block boundaries (127-129, 255-257, 1151-1153 tokens) and reach the budget exactly
(1232 prompt + 48 generated tokens = 1280, ten blocks); 1200 tokens under snapkv's 1280 is a prompt of ten
blocks whose observation window sits in its last block, which an earlier version compressed anyway.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from transformers import AutoTokenizer  # noqa: E402

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
]


@pytest.fixture(scope="module")
def prompts(model_dir):
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt(1400, seed=11)).input_ids
    assert len(ids) >= max(BOUNDARY_LENGTHS)
    return CONCURRENT + [{"prompt_token_ids": ids[:n]} for n in BOUNDARY_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts, tmp_path_factory):
    return reference_outputs(model_dir, [prompts], MAX_TOKENS, tmp_path_factory.mktemp("reference"), 1536)[0]


@pytest.mark.parametrize("policy", POLICIES, ids=["-".join(map(str, p.values())) for p in POLICIES])
def test_budget_covering_the_request_gives_vllms_own_greedy_output(policy, model_dir, prompts, reference):
    llm = make_llm(model_dir, policy, max_model_len=1536)
    assert type(manager(llm)).__name__ == "BlockEvictionManager"  # the policy is really in place
    try:
        outputs = greedy(llm, prompts, MAX_TOKENS)
    finally:
        close(llm)
    for length, output, expected in zip(["text"] * len(CONCURRENT) + BOUNDARY_LENGTHS, outputs, reference, strict=True):
        assert output == expected, f"prompt of {length} tokens"
