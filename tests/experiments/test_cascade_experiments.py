"""The Cascade experiment driver's graded passkey score."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import kvcompress
from experiments.cascade import key_nll


def test_key_nll_through_a_full_cache_equals_one_forward_per_left_padded_prompt(tiny_llama):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 120, (n,), generator=generator) for n in (20, 27, 23)]
    keys = torch.randint(1, 120, (3, 4), generator=generator)
    got = key_nll(tiny_llama, prompts, keys, kvcompress.cache_for(tiny_llama, "full"))
    tiny_llama.set_attn_implementation("sdpa")
    expected = []
    with torch.no_grad():
        for prompt, key in zip(prompts, keys, strict=True):
            logits = tiny_llama(torch.cat([prompt, key])[None]).logits[0, -key.numel() - 1 : -1]
            expected.append(F.cross_entropy(logits, key).item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-4)
