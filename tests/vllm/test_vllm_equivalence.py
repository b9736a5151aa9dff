"""With a budget at least the request's length, the plugin changes nothing: greedy outputs equal vLLM's own."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

from tests.vllm.conftest import reference_outputs  # noqa: E402
from tests.vllm.engine import close, greedy, make_llm, manager, prompt  # noqa: E402

MAX_TOKENS = 48
SINGLE = [prompt(220, seed=1)]
CONCURRENT = [prompt(120, seed=2), prompt(330, seed=3), prompt(40, seed=4)]
POLICIES = [  # budgets of 8 blocks (1024 tokens): every request here fits
    {"method": "streaming", "budget": 1024},
    {"method": "window", "budget": 1024},
    {"method": "snapkv", "budget": 1024},
]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    return reference_outputs(model_dir, [SINGLE, CONCURRENT], MAX_TOKENS, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("policy", POLICIES, ids=[p["method"] for p in POLICIES])
def test_budget_covering_the_request_gives_vllms_own_greedy_output(policy, model_dir, reference):
    llm = make_llm(model_dir, policy)
    assert type(manager(llm)).__name__ == "BlockEvictionManager"  # the policy is really in place
    try:
        single, concurrent = greedy(llm, SINGLE, MAX_TOKENS), greedy(llm, CONCURRENT, MAX_TOKENS)
    finally:
        close(llm)
    assert single == reference[0]
    assert concurrent == reference[1]
