"""``DecodeGraph`` on a CUDA device: a real CUDA graph of the decoding step, replayed, gives what eager decoding
gives (the CPU tests replay ``make_fx`` traces, the same contract: ``tests/test_decode_graph.py``).

Skipped where no CUDA device is present (CI); run on a GPU machine with ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.decode_graph import GRAPHED_METHODS, DecodeGraph
from kvcompress.generation import cache_argument
from kvcompress.models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BATCH, PROMPT, BUDGET, STEPS = 2, 40, 16, 24


def _graph(model, method: str, capture: str | None) -> DecodeGraph:
    cache = kvcompress.cache_for(model, method, budget=BUDGET)
    ids = torch.randint(3, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return DecodeGraph(model, cache, capture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", sorted(GRAPHED_METHODS))
def test_a_replayed_cuda_graph_reproduces_eager_decoding(method, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("llama", seed=0).to("cuda", dtype)
    with torch.inference_mode():
        graphed, eager = _graph(model, method, "cuda"), _graph(model, method, None)
        token = torch.full((BATCH, 1), 5, device="cuda")
        for step in range(STEPS):
            positions = torch.full((BATCH, 1), PROMPT + step, device="cuda")
            expected = eager(token, positions)
            torch.testing.assert_close(graphed(token, positions), expected)
            token = expected[:, -1:].argmax(-1)
        assert graphed.replays >= STEPS - 6
        for ours, theirs in zip(graphed.layers, eager.layers, strict=True):
            assert ours.seen == theirs.seen == int(ours.seen_tensor)
            assert torch.equal(ours.kept().token_idx, theirs.kept().token_idx)
