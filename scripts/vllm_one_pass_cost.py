"""CPU time of the scored policies' attention per layer call: vLLM's CPU kernel + the second scoring pass against the
one torch pass (output and block mass together), for decode batches and a prompt.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python scripts/vllm_one_pass_cost.py [--repeats 20]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64), float32, vLLM's ``vec`` layout, 128-token
blocks. Decode: R requests of ``kept`` cached tokens each, one query each. Prefill: one prompt of ``tokens`` tokens.
Prints one markdown row per case: process CPU milliseconds per call, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from vllm import _custom_ops as ops

from kvcompress.vllm.layout import KeyLayout
from kvcompress.vllm.scores import add_attention_mass

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, ISA = 9, 3, 64, 128, "vec"


def _case(lengths: list[int], query_lens: list[int]):
    blocks_per = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks_per)
    kv_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    key_cache, value_cache = kv_cache.view(num_blocks, KV_HEADS, 2 * BLOCK, HEAD_SIZE).chunk(2, dim=2)
    table = torch.zeros(len(lengths), max(blocks_per), dtype=torch.int32)
    first = 0
    for i, (n, b) in enumerate(zip(lengths, blocks_per, strict=True)):
        ids = torch.arange(first, first + b)
        table[i, :b] = ids
        slots = ids.repeat_interleave(BLOCK)[:n] * BLOCK + torch.arange(n) % BLOCK
        ops.cpu_attn_reshape_and_cache(
            torch.randn(n, KV_HEADS, HEAD_SIZE), torch.randn(n, KV_HEADS, HEAD_SIZE), key_cache, value_cache, slots, ISA
        )
        first += b
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), torch.tensor(query_lens).cumsum(0).to(torch.int32)])
    query = torch.randn(int(starts[-1]), HEADS, HEAD_SIZE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return kv_cache, key_cache, value_cache, query, starts, seq_lens, table, num_blocks


def _cpu_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    layout = KeyLayout(ISA, torch.float32, KV_HEADS, BLOCK, HEAD_SIZE)
    scale = HEAD_SIZE**-0.5
    cases = {
        "decode, 12 requests x 385 tokens": ([385] * 12, [1] * 12),
        "decode, 12 requests x 1025 tokens": ([1025] * 12, [1] * 12),
        "prefill, one prompt of 1000 tokens": ([1000], [1000]),
    }
    print(
        "| case | kernel ms | second pass ms | kernel + second pass ms | one pass ms | one pass / (kernel + second) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (lengths, query_lens) in cases.items():
        k, s, o = _row(lengths, query_lens, layout, scale, args.repeats)
        print(f"| {name} | {k:.2f} | {s:.2f} | {k + s:.2f} | {o:.2f} | {o / (k + s):.2f} |", flush=True)


def _row(lengths, query_lens, layout, scale, repeats) -> tuple[float, float, float]:
    """CPU ms of the kernel, the second pass and the one pass for one case."""
    kv_cache, key_cache, value_cache, query, starts, seq_lens, table, num_blocks = _case(lengths, query_lens)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        len(lengths), HEADS, KV_HEADS, HEAD_SIZE, seq_lens, torch.float32, starts, True, -1, ISA, False
    )
    output = torch.empty_like(query)
    scores = torch.zeros(num_blocks, KV_HEADS)

    def kernel():
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, starts, seq_lens, scale, True, None, -1, table, 0, metadata, None
        )

    def second():
        add_attention_mass(scores, layout, kv_cache, query, starts, seq_lens, table, scale)

    def one():
        add_attention_mass(scores, layout, kv_cache, query, starts, seq_lens, table, scale, output=output)

    return tuple(_cpu_ms(fn, repeats) for fn in (kernel, second, one))


if __name__ == "__main__":
    main()
