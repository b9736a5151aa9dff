"""What the cascade's RoPE frames cost in a decoding step (docs/results/performance.md, section 0).

While decoding, keys are stored at ring angles (``methods/cascade/ring_angles.py``), so a decoding query is rotated
to one target per frame (each ring, the sinks in the oldest ring's: 4 frames at budget 512 with 4 rings; 9 with slot
angles before) and one matmul computes every frame's logits for every slot. This times the cascade's decoding step
against a ``DynamicCache`` holding the same tokens, as ``kvcompress.bench.speed`` does (interleaved pairs, CPU time,
1 thread), with the frames as they are and collapsed to ``K`` (the first ``K`` targets, frame ``i`` read as ``i mod
K``): the logits are then wrong, only the cost is measured, to weigh a storage layout with fewer frames before
building it.

    python scripts/bench_cascade_frames.py [--frames 0,4,1] [--prompt 2048] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill
from kvcompress.methods.cascade import ring_decode
from kvcompress.models import load_model

FRAMES = ring_decode.RingDecode._frames


def collapse(k: int) -> None:
    """Make every cascade layer use at most ``k`` frames (0: as built)."""

    def frames(self, top: int, rings=None):
        targets, runs = FRAMES(self, top, rings)
        if k and len(targets) > k:
            return targets[:k], [(lo, hi, index % k) for lo, hi, index in runs]
        return targets, runs

    ring_decode.RingDecode._frames = frames


def ratios(model, ids: torch.Tensor, prompt: int, steps: int) -> list[float]:
    """Per pair: CPU time of a cascade step / a ``DynamicCache`` step holding the same 512 tokens."""
    dynamic = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    model(input_ids=ids[:, :512], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)
    cache = kvcompress.cache_for(model, "cascade", budget=512, prefill="chunked")
    prefill(model, ids[:, :prompt], cache, chunk_size=512)
    ours, theirs = [], []
    for step in range(steps + 4):
        token = ids[:, prompt + step : prompt + step + 1]
        for side in (0, 1) if step % 2 else (1, 0):
            start = time.process_time()
            if side == 0:
                model.set_attn_implementation(ATTENTION_NAME)
                model(input_ids=token, **cache_argument(model, cache), use_cache=True)
                ours.append(time.process_time() - start)
            else:
                model.set_attn_implementation("sdpa")
                model(input_ids=token, **cache_argument(model, dynamic), use_cache=True)
                theirs.append(time.process_time() - start)
                dynamic.crop(-1)
    return [a / b for a, b in zip(ours[4:], theirs[4:], strict=True)]  # 4 warm-up pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", default="0,4,1", help="frame counts to time (0: as built)")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30, help="timed pairs per row")
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model("smollm2-135m")
    kvcompress.prepare_model(model)
    ids = random_prompt(model, args.prompt + args.steps + 8, 0)
    print("frames | CPU x DynamicCache (median) | p10 | p90 | pairs")
    with torch.inference_mode():
        for k in (int(value) for value in args.frames.split(",")):
            collapse(k)
            row = sorted(ratios(model, ids, args.prompt, args.steps))
            p10, p90 = row[len(row) // 10], row[(9 * len(row)) // 10]
            print(f"{k or 'as built'} | {statistics.median(row):.3f} | {p10:.3f} | {p90:.3f} | {len(row)}")


if __name__ == "__main__":
    main()
