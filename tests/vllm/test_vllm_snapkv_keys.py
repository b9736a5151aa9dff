"""Block SnapKV reads keys back from vLLM's paged CPU cache: every layout vLLM writes, learnt from its writer."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvcompress.vllm.layout import KeyLayout  # noqa: E402


# vec: x86 without AMX, head sizes divisible by 32; vec16: head sizes divisible by 16 only (48, 80, ...). The
# other layouts (amx, neon, vsx, vxe, rvv) are learnt the same way on the machines whose vLLM build has them.
@pytest.mark.parametrize("isa,head_size", [("vec", 64), ("vec", 128), ("vec16", 48), ("vec16", 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_keys_read_back_what_the_cpu_kernel_wrote(isa, head_size, dtype):
    num_blocks, heads, block, tokens = 5, 3, 128, 300
    kv_cache = torch.zeros(num_blocks, heads, block, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block, head_size).chunk(2, dim=2)
    keys, values = torch.randn(2, tokens, heads, head_size, dtype=dtype)
    blocks = torch.tensor([3, 1, 4])  # a request's blocks, out of order in the pool
    slots = blocks.repeat_interleave(block)[:tokens] * block + torch.arange(tokens) % block
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    read = KeyLayout(isa, dtype, heads, block, head_size).read(kv_cache, blocks, tokens)
    assert torch.equal(read, keys.permute(1, 0, 2).float())


def test_a_layout_this_vllm_cannot_write_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"^kvcompress: snapkv cannot read keys back in vLLM's 'nonesuch' CPU KV"
    ) as error:
        KeyLayout("nonesuch", torch.float32, 2, 128, 64)
    assert "\n" not in str(error.value)


def test_a_quantised_cache_is_refused():
    with pytest.raises(ValueError, match=r"floating-point cache \(--kv-cache-dtype auto\), not torch.uint8"):
        KeyLayout("vec", torch.uint8, 2, 128, 64)


@pytest.fixture(scope="module")
def head_48_model(model_dir, tmp_path_factory):
    """A random 2-layer Llama with head size 48 (vLLM's CPU attention picks the ``vec16`` layout), SmolLM2's
    tokenizer."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("head-48")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for path in Path(model_dir).iterdir():
        if "token" in path.name or path.name == "special_tokens_map.json":
            shutil.copy(path, folder / path.name)
    return str(folder)


def test_snapkv_compresses_where_vllm_picks_the_vec16_layout(head_48_model):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from tests.vllm.engine import close, make_llm, prompt, trace_blocks

    assert _get_attn_isa(torch.float32, 128, 48) == "vec16"  # the layout vLLM picks for this model
    llm = make_llm(head_48_model, {"method": "snapkv", "budget": 3 * 128}, max_model_len=1024)
    try:
        trace = trace_blocks(llm, [prompt(500, seed=31)], max_tokens=8)
    finally:
        close(llm)
    (live,) = trace.live_blocks.values()
    assert max(live) >= 5 and live[-1] == 3  # a prompt of 5+ blocks, compressed to the budget


def test_a_step_that_selects_votes_with_the_window_before_it_and_opens_the_next(monkeypatch):
    """window = one block, re-selecting every block: the query of the selecting step is the first of the next
    window, never part of the one the selection uses."""
    from kvcompress.vllm import snapkv
    from kvcompress.vllm.config import BlockPolicyConfig
    from kvcompress.vllm.policies import make_policy

    policy = make_policy(BlockPolicyConfig("snapkv", 3 * 128, window=128, reselect_blocks=1), 128)
    used = []
    monkeypatch.setattr(snapkv, "select_blocks", lambda policy, layout, row, queries, *args: used.append(queries))
    stash = snapkv.ObservationStash(128)
    for position in range(128):  # the window's decode steps, one query each (value = its position)
        step = snapkv.SnapKVStep(policy, None, [snapkv.StashRow(7, 0, 1, 1000 + position)], [], [])
        snapkv.run_step(step, stash, torch.full((1, 1, 1), float(position)), None, 1.0)
    select = snapkv.SelectRow(7, 1128, 2, 8, 9, torch.arange(9), 2)
    step = snapkv.SnapKVStep(policy, None, [snapkv.StashRow(7, 0, 1, 1128)], [select], [])
    snapkv.run_step(step, stash, torch.full((1, 1, 1), 128.0), None, 1.0)
    assert used[0].flatten().tolist() == list(range(128))
    assert stash.queries[7].flatten().tolist() == [128.0]


@pytest.mark.parametrize("prompt_len", [1040, 1100, 1000])  # the window straddling a block boundary, or not
def test_a_prompt_prefilled_in_one_step_keeps_the_papers_blocks_through_the_prefill_selection(prompt_len):
    """The prefill selection at the end of the prompt's step, then the prompt's selection from its scores, keep the
    same blocks, per KV head and in the same order, as SnapKV's one selection over the whole prompt."""
    from kvcompress.vllm import snapkv
    from kvcompress.vllm.config import BlockPolicyConfig
    from kvcompress.vllm.policies import make_policy

    torch.manual_seed(3)
    heads, head_size, block = 2, 64, 128
    policy = make_policy(BlockPolicyConfig("snapkv", 4 * block), block)
    blocks = torch.tensor([9, 3, 7, 1, 4, 8, 2, 6, 5])[: -(-prompt_len // block)]
    kv_cache = torch.zeros(10, heads, block, 2 * head_size)
    key_cache, value_cache = kv_cache.view(10, heads, 2 * block, head_size).chunk(2, dim=2)
    keys = torch.randn(prompt_len, heads, head_size) * 2
    slots = blocks.repeat_interleave(block)[:prompt_len] * block + torch.arange(prompt_len) % block
    ops.cpu_attn_reshape_and_cache(keys, torch.randn_like(keys), key_cache, value_cache, slots, "vec")
    layout = KeyLayout("vec", torch.float32, heads, block, head_size)
    queries = torch.randn(32, 3 * heads, head_size)
    lo, first_hi = policy.worker_range(prompt_len, prompt_len)
    front, prefill_hi = policy.prefill_front, int(policy.prefill_hi(prompt_len))

    paper = kv_cache.clone()  # one selection over the whole prompt
    snapkv.select_blocks(
        policy, layout, snapkv.SelectRow(0, prompt_len, lo, lo, first_hi, blocks, lo), queries, paper, 0.125
    )
    row = snapkv.SelectRow(0, prompt_len, front, front, prefill_hi, blocks, front)
    scores = snapkv.select_blocks(policy, layout, row, queries, kv_cache, 0.125)
    assert scores is not None and prefill_hi == first_hi
    final = snapkv.SelectRow(0, prompt_len, lo, prefill_hi, first_hi, blocks, front)
    snapkv.select_blocks(policy, layout, final, None, kv_cache, 0.125, prior=scores)
    assert torch.equal(kv_cache[blocks[:lo]], paper[blocks[:lo]])  # the selected blocks, in order
    assert torch.equal(kv_cache[blocks[first_hi:]], paper[blocks[first_hi:]])  # the window's blocks


def test_a_prompt_within_the_budget_is_left_in_place_by_the_prompts_selection():
    """Prompts of 1 to 10 blocks under a 10-block budget: the prompt's selection (as the tracker builds it) moves
    nothing, whether the observation window straddles a block boundary or not."""
    from kvcompress.vllm import snapkv
    from kvcompress.vllm.config import BlockPolicyConfig
    from kvcompress.vllm.policies import make_policy

    heads, head_size, block = 2, 64, 128
    policy = make_policy(BlockPolicyConfig("snapkv", 10 * block), block)
    layout = KeyLayout("vec", torch.float32, heads, block, head_size)
    kv_cache = torch.randn(12, heads, block, 2 * head_size)
    before_cache = kv_cache.clone()
    for prompt_len in list(range(1, 10 * block + 1, 7)) + [129, 1153, 1200, 1232, 1280]:
        lo, after = policy.worker_range(prompt_len, prompt_len)
        blocks = torch.arange(11, 11 - -(-prompt_len // block), -1)
        row = snapkv.SelectRow(0, prompt_len, int(lo), int(policy.prefill_hi(prompt_len)), int(after), blocks, 9)
        assert lo == after, prompt_len
        assert snapkv.select_blocks(policy, layout, row, torch.randn(32, 6, head_size), kv_cache, 0.125) is None
    assert torch.equal(kv_cache, before_cache)
