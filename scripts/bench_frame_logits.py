"""How the cascade's decoding logits cost grows with its RoPE frames (docs/results/performance.md, section 0).

A decoding step of the cascade (budget 512 = 4 sinks + 4 rings of 127 slots, SmolLM2's 3 KV heads, 3 query heads
per KV head, head dim 64) rotates the query to one target per frame and computes the logits of every stored slot.
Today: 9 frames (the sinks, then each ring split at its start), every frame against every slot in one matmul and a
gather of each slot's frame. The alternative weighed: keys stored at an angle that follows their ring order, so each
ring is one frame (5 frames), and each ring's logits come from its own slots in one batched matmul (no redundant
multiply-adds, no gather). Both are timed here warm, interleaved call by call, 1 thread:

    python scripts/bench_frame_logits.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BATCH, KV_HEADS, GROUPS, DIM, SINKS, RINGS, WIDTH = 1, 3, 3, 64, 4, 4, 127
SLOTS = SINKS + RINGS * WIDTH


def today(queries: torch.Tensor, kv: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """9 frames: ``[B, H, G 9, d] @ [B, H, d, slots]``, then each slot takes its frame's logit."""
    frames = queries.shape[2] // GROUPS
    keys = kv[:, :, :SLOTS, :DIM].flatten(0, 1).transpose(1, 2)
    every = torch.bmm(queries.flatten(0, 1), keys).view(BATCH, KV_HEADS, GROUPS, frames, SLOTS)
    return every.gather(3, frame.expand(BATCH, KV_HEADS, GROUPS, 1, SLOTS)).view(BATCH, KV_HEADS, GROUPS, SLOTS)


def per_ring(queries: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """5 frames: the sinks' logits, and each ring's from its own slots in one batched matmul."""
    sink_query, ring_queries = queries[:, :, :, 0], queries[:, :, :, 1:]  # [B, H, G, d], [B, H, G, N, d]
    ring_keys = kv[:, :, SINKS:SLOTS, :DIM].unflatten(2, (RINGS, WIDTH)).flatten(0, 2).transpose(1, 2)
    rings = torch.bmm(ring_queries.transpose(2, 3).reshape(-1, GROUPS, DIM), ring_keys)  # [B H N, G, W]
    rings = rings.view(BATCH, KV_HEADS, RINGS, GROUPS, WIDTH).transpose(2, 3).flatten(3)
    sinks = sink_query @ kv[:, :, :SINKS, :DIM].transpose(-1, -2)
    return torch.cat([sinks, rings], -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls of each layout")
    calls = parser.parse_args().calls
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(BATCH, KV_HEADS, SLOTS + 1, 2 * DIM, generator=generator)  # keys and values side by side
    nine = torch.randn(BATCH, KV_HEADS, GROUPS * 9, DIM, generator=generator)
    five = torch.randn(BATCH, KV_HEADS, GROUPS, 1 + RINGS, DIM, generator=generator)
    frame = torch.randint(0, 9, (1, 1, 1, 1, SLOTS), generator=generator)
    sides = {
        "9 frames, one matmul + gather": lambda: today(nine, kv, frame),
        "5 frames, per ring": lambda: per_ring(five, kv),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for call in range(calls + 50):
        for name in sides if call % 2 else reversed(list(sides)):
            start = time.process_time_ns()
            sides[name]()
            if call >= 50:
                times[name].append((time.process_time_ns() - start) / 1e3)
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10)
        print(
            f"{name:32s} median {statistics.median(values):7.1f} us CPU (p10 {deciles[0]:.1f}, p90 {deciles[-1]:.1f})"
        )
    ratios = [b / a for a, b in zip(*times.values(), strict=True)]
    deciles = statistics.quantiles(ratios, n=10)
    print(f"per ring / today: median {statistics.median(ratios):.3f} (p10 {deciles[0]:.3f}, p90 {deciles[-1]:.3f})")


if __name__ == "__main__":
    main()
