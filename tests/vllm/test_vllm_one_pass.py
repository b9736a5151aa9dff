"""The scored policies' one-pass attention against vLLM's CPU kernel and against the second pass: the output of every
query equal to the kernel's within float32 rounding, the attention mass per block equal to the second pass's (no
engine: vLLM's own cache writer, scheduler metadata and kernel, called as its backend calls them)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1", reason="the vLLM suite runs in .venv-vllm (bash scripts/test_vllm.sh)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from kvcompress.vllm.layout import KeyLayout  # noqa: E402
from kvcompress.vllm.scores import add_attention_mass  # noqa: E402

BLOCK, HEADS, KV_HEADS, NUM_BLOCKS = 128, 6, 2, 12


def _case(isa: str, head_size: int, dtype=torch.float32):
    """Three decode rows (300 kept tokens, 129: a boundary straddled by one token, 1: a request's first token), a
    prefill chunk of 70 queries over 200 tokens and a whole prompt of 300 (more than one query slice): queries, a
    paged cache written by vLLM's writer, and the metadata the kernel reads."""
    generator = torch.Generator().manual_seed(head_size)
    rows = [([5, 2, 7], 300, 1), ([8, 3], 129, 1), ([1, 4], 200, 70), ([6], 1, 1), ([9, 0, 11], 300, 300)]
    kv_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv_cache.view(NUM_BLOCKS, KV_HEADS, 2 * BLOCK, head_size).chunk(2, dim=2)
    for blocks, length, _ in rows:
        keys = torch.randn(length, KV_HEADS, head_size, generator=generator).to(dtype)
        values = torch.randn(length, KV_HEADS, head_size, generator=generator).to(dtype)
        slots = torch.tensor(blocks).repeat_interleave(BLOCK)[:length] * BLOCK + torch.arange(length) % BLOCK
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    query_lens = torch.tensor([q for _, _, q in rows])
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    query = torch.randn(int(starts[-1]), HEADS, head_size, generator=generator).to(dtype)
    seq_lens = torch.tensor([length for _, length, _ in rows], dtype=torch.int32)
    table = torch.zeros(len(rows), 3, dtype=torch.int32)
    for i, (blocks, _, _) in enumerate(rows):
        table[i, : len(blocks)] = torch.tensor(blocks)
    return kv_cache, key_cache, value_cache, query, starts, seq_lens, table


def _kernel(isa, head_size, key_cache, value_cache, query, starts, seq_lens, table, scale, dtype=torch.float32):
    """vLLM's CPU attention as its backend runs it (scheduler metadata from the builder's call, then the kernel)."""
    metadata = ops.cpu_attn_get_scheduler_metadata(
        len(seq_lens), HEADS, KV_HEADS, head_size, seq_lens, dtype, starts, True, -1, isa, False
    )
    output = torch.zeros_like(query)
    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, output, starts, seq_lens, scale, True, None, -1, table, 0, metadata, None
    )
    return output


@pytest.mark.parametrize("isa,head_size", [("vec", 64), ("vec16", 48)])
@pytest.mark.parametrize("gamma", [None, 0.99], ids=["h2o", "cascade-ema"])
def test_one_pass_gives_the_kernels_output_and_the_second_passs_scores(isa, head_size, gamma):
    kv_cache, key_cache, value_cache, query, starts, seq_lens, table = _case(isa, head_size)
    scale = head_size**-0.5
    layout = KeyLayout(isa, torch.float32, KV_HEADS, BLOCK, head_size)
    expected = _kernel(isa, head_size, key_cache, value_cache, query, starts, seq_lens, table, scale)

    second = torch.zeros(NUM_BLOCKS, KV_HEADS)
    add_attention_mass(second, layout, kv_cache, query, starts, seq_lens, table, scale, {2}, gamma)
    one = torch.zeros(NUM_BLOCKS, KV_HEADS)
    output = torch.full_like(query, float("nan"))
    add_attention_mass(one, layout, kv_cache, query, starts, seq_lens, table, scale, {2}, gamma, output)

    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)  # every row, the skipped one included
    torch.testing.assert_close(one, second, rtol=0, atol=0)  # the same probabilities, the same sums
    assert second[[1, 4]].sum() == 0 and second.sum() > 0  # row 2 (blocks 1 and 4) is skipped: no mass


def test_value_layout_reads_back_what_vllms_writer_wrote():
    for isa, head_size in [("vec", 64), ("vec16", 48)]:
        kv_cache = torch.zeros(2, KV_HEADS, BLOCK, 2 * head_size)
        key_cache, value_cache = kv_cache.view(2, KV_HEADS, 2 * BLOCK, head_size).chunk(2, dim=2)
        keys, values = torch.randn(200, KV_HEADS, head_size), torch.randn(200, KV_HEADS, head_size)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(200), isa)
        layout = KeyLayout(isa, torch.float32, KV_HEADS, BLOCK, head_size)
        blocks = torch.tensor([0, 1])
        assert torch.equal(layout.read_blocks(kv_cache, blocks)[:, :200], keys.transpose(0, 1))
        assert torch.equal(layout.read_blocks(kv_cache, blocks, values=True)[:, :200], values.transpose(0, 1))


@pytest.mark.parametrize("method", ["h2o", "cascade", "buzz"])
def test_one_pass_engine_keeps_the_second_pass_blocks_and_tokens(method, short_model_dir, monkeypatch):
    """A real engine (SmolLM2 cut to 2 layers) evicting at every block boundary: the one-pass attention (vLLM's
    kernel never called) and vLLM's kernel + the second pass generate the same greedy tokens and hold the same
    blocks at every step; their log-probabilities differ by float32 rounding only."""
    from tests.vllm.engine import close, make_llm, prompt, trace_blocks

    kernel_calls = []
    kernel = ops.cpu_attention_with_kv_cache
    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))

    budget = {"h2o": 3, "cascade": 3, "buzz": 5}[method] * BLOCK
    prompts = [prompt(300, seed=7), prompt(380, seed=8), prompt(340, seed=9)]
    traces, calls = {}, {}
    for scoring in ("one_pass", "second_pass"):
        llm = make_llm(short_model_dir, {"method": method, "budget": budget, "scoring": scoring})
        kernel_calls.clear()
        try:
            traces[scoring] = trace_blocks(llm, prompts, max_tokens=400)
        finally:
            close(llm)
        calls[scoring] = len(kernel_calls)
    assert calls["one_pass"] == 0 and calls["second_pass"] > 0  # the engine runs in this process
    one, second = traces["one_pass"], traces["second_pass"]
    assert one.outputs == second.outputs
    assert one.live_blocks == second.live_blocks
    for request_id, logprobs in one.logprobs.items():
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(second.logprobs[request_id]), rtol=0, atol=1e-4)


def test_the_one_pass_cost_script_answers_help_with_its_usage(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[2] / "scripts" / "vllm_one_pass_cost.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
