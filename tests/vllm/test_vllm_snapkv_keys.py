"""Block SnapKV reads keys back from vLLM's paged CPU cache: its layout assumption, checked against the kernel."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvcompress.vllm.snapkv import KEY_LAYOUT_ISAS, _prompt_keys  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_keys_read_back_what_the_cpu_kernel_wrote(dtype):
    num_blocks, heads, block, head_size, tokens = 5, 3, 128, 64, 300
    kv_cache = torch.zeros(num_blocks, heads, block, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block, head_size).chunk(2, dim=2)
    keys, values = torch.randn(2, tokens, heads, head_size, dtype=dtype)
    blocks = torch.tensor([3, 1, 4])  # a request's blocks, out of order in the pool
    slots = blocks.repeat_interleave(block)[:tokens] * block + torch.arange(tokens) % block
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, KEY_LAYOUT_ISAS[0], k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    read = _prompt_keys(kv_cache, blocks, tokens)
    assert torch.equal(read, keys.permute(1, 0, 2).float())
