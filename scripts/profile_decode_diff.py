"""Where one method's decoding step spends time that another's does not: ``torch.profiler`` self CPU time by operation
and input shape, per step, for two methods after the same prompt, and their difference.

``count_decode_ops.py`` counts operations; this script weighs them inside real decoding steps, where the model's own
layers stream their weights through the caches between two of a cache's operations, so a small operation costs
what it costs cold. Each method's cache is prefilled in chunks and decoded a few tokens, then ``--steps`` steps of
each are profiled in turns (one step of one, one of the other, so a noisy stretch of the shared machine falls on
both); the rows with the largest differences are printed (milliseconds per step; calls per step). The profiler
adds a little to every call, so the totals run above the benchmark's and the differences, not the absolute times,
are what to read.

    python scripts/profile_decode_diff.py [--methods "h2o,h2o:kv_bits=4"] [--prompt 2048] [--budget 512] [--steps 30]
        [--rows 30]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import kvcompress
from kvcompress.bench.common import bench_cache, random_prompt, set_threads
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model

Row = tuple[str, str]  # operation, input shapes
WARM_STEPS = 8  # decoding steps before the profiled ones (past the first steps' one-off work)


def ready_cache(model, ids: torch.Tensor, method: str, args):
    """``method``'s cache after the prompt (prefilled in chunks) and a few decoding steps (their one-off work)."""
    cache = bench_cache(model, method, args.budget)
    prefill(model, ids[:, : args.prompt], cache, chunk_size=args.chunk)
    for token in range(args.prompt, args.prompt + WARM_STEPS):
        model(input_ids=ids[:, token : token + 1], **cache_argument(model, cache))
    return cache


def profile_step(model, ids: torch.Tensor, cache, token: int, into: dict[Row, list[float]], steps: int) -> None:
    """Profile one decoding step; add each (operation, input shapes)'s self CPU ms and calls per step to ``into``."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        model(input_ids=ids[:, token : token + 1], **cache_argument(model, cache))
    for event in profiler.key_averages(group_by_input_shape=True):
        row = into[(event.key, str(event.input_shapes))]
        row[0] += event.self_cpu_time_total / 1000 / steps
        row[1] += event.count / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--methods",
        default="h2o,less",
        help="two method specs (name or name:key=value;...): the second's extra time is printed",
    )
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens before the profiled steps")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--steps", type=int, default=30, help="profiled decoding steps per method")
    parser.add_argument("--rows", type=int, default=30, help="rows printed (largest differences first)")
    args = parser.parse_args()
    first, second = args.methods.split(",")
    set_threads(1)
    model, _ = load_model(args.model)
    kvcompress.prepare_model(model)
    ids = random_prompt(model, args.prompt + WARM_STEPS + args.steps, 0)
    profiles: list[dict[Row, list[float]]] = [defaultdict(lambda: [0.0, 0.0]) for _ in range(2)]
    with torch.inference_mode():
        caches = [ready_cache(model, ids, method, args) for method in (first, second)]
        for step in range(args.steps):  # the two methods' steps in turns (which goes first alternates too)
            token = args.prompt + WARM_STEPS + step
            for side in (0, 1) if step % 2 == 0 else (1, 0):
                profile_step(model, ids, caches[side], token, profiles[side], args.steps)
    totals = [sum(ms for ms, _ in rows.values()) for rows in profiles]
    print(f"self CPU per step: {first} {totals[0]:.2f} ms, {second} {totals[1]:.2f} ms ({totals[1] - totals[0]:+.2f})")
    print(f"{second} - {first}:")
    none = (0.0, 0.0)
    diffs = {
        row: (
            profiles[1].get(row, none)[0] - profiles[0].get(row, none)[0],
            profiles[1].get(row, none)[1] - profiles[0].get(row, none)[1],
        )
        for row in profiles[0].keys() | profiles[1].keys()
    }
    for (name, shapes), (ms, calls) in sorted(diffs.items(), key=lambda item: -abs(item[1][0]))[: args.rows]:
        print(f"  {ms:+7.3f} ms  {calls:+6.1f} calls  {name:24s} {shapes[:90]}")


if __name__ == "__main__":
    main()
