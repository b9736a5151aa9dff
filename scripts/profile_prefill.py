"""Profile one method's chunked prefill against a one-pass ``DynamicCache`` prefill of the same prompt.

    python scripts/profile_prefill.py [--method h2o] [--prompt 1024] [--budget 256] [--chunk 512]

Prints each side's process CPU time for two alternating repetitions (1 torch thread), then the ``cProfile`` of one
more prefill of ours, sorted by internal time (where an explicit softmax, a mask or the linears spend it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="h2o")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model(args.model)
    kvcompress.prepare_model(model)
    ids = random_prompt(model, args.prompt, 0)

    def ours() -> None:
        model.set_attn_implementation(ATTENTION_NAME)
        prefill(model, ids, kvcompress.cache_for(model, args.method, budget=args.budget), chunk_size=args.chunk)

    def dynamic() -> None:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        for _ in range(2):
            times = []
            for run in (dynamic, ours):
                start = time.process_time()
                run()
                times.append(time.process_time() - start)
            ours_line = f"{args.method} in {args.chunk}-token chunks {times[1]:.2f} s"
            print(f"CPU time: DynamicCache one pass {times[0]:.2f} s, {ours_line}")
        profile = cProfile.Profile()
        profile.enable()
        ours()
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
