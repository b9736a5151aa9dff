"""LESS's decoding step with φ and ψ's GELUs on oneDNN's kernel against the step as the library runs it (PyTorch's
own kernel, given a transposed view: ``kernels._gelu``), side by side in one process.

Issue 50's rule: a micro-optimisation stays if it buys >= 3 % on the step it targets. On a CPU, PyTorch hands the
exact GELU of a contiguous float32 tensor to oneDNN, whose setup per call costs several times the arithmetic of a
decoding step's φ and ψ. This script gives one of two LESS caches plain ``F.gelu`` on the contiguous products (by
patching ``kernels._gelu`` in this process only), prefills both and a ``DynamicCache`` with the same prompt, then
decodes them step by step in turns (the order reversed every round, so a noisy stretch of a shared machine falls on
all three) and prints each side's median CPU time per step, its ratio to the ``DynamicCache`` step, and the median
of the per-step ratios ``oneDNN / library`` (above 1: the library's GELU buys that much).

    python scripts/less_gelu_ab.py [--prompt 2048] [--budget 512] [--steps 150]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvcompress
import kvcompress.methods.less.kernels as kernels
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.bench.pairs import use_attention
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model

LIBRARY = kernels._gelu


def onednn_gelu(inputs: torch.Tensor) -> torch.Tensor:
    return F.gelu(inputs)  # contiguous: oneDNN's kernel on a CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model(args.model)
    ids = random_prompt(model, args.prompt + args.steps + 8, 0)
    sides: dict[str, list] = {}
    with torch.no_grad():
        for name in ("library", "oneDNN"):
            cache = kvcompress.cache_for(model, "less", budget=args.budget)
            use_attention(model, ATTENTION_NAME)
            prefill(model, ids[:, : args.prompt], cache, chunk_size=512)
            sides[name] = [cache, args.prompt]
        use_attention(model, "sdpa")
        dynamic = DynamicCache(config=model.config)
        model(input_ids=ids[:, : args.budget], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)
        sides["DynamicCache"] = [dynamic, args.budget]
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for step in range(args.steps + 4):  # the first 4 rounds untimed
            for name in names if step % 2 == 0 else names[::-1]:
                cache, position = sides[name]
                use_attention(model, "sdpa" if name == "DynamicCache" else ATTENTION_NAME)
                kernels._gelu = onednn_gelu if name == "oneDNN" else LIBRARY
                start = time.process_time()
                model(input_ids=ids[:, position : position + 1], **cache_argument(model, cache), use_cache=True)
                elapsed = time.process_time() - start
                kernels._gelu = LIBRARY
                if name == "DynamicCache":
                    cache.crop(args.budget - cache.get_seq_length())
                else:
                    sides[name][1] = position + 1
                if step >= 4:
                    times[name].append(elapsed)
    dynamic_times = times["DynamicCache"]
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, dynamic_times, strict=True))
        print(f"{name:13s} {statistics.median(values) * 1e3:7.2f} ms a step, {ratio:.3f} x DynamicCache")
    ratios = sorted(a / b for a, b in zip(times["oneDNN"], times["library"], strict=True))
    quartile = len(ratios) // 4
    print(
        f"oneDNN / library, median of {len(ratios)} steps: {statistics.median(ratios):.4f} "
        f"(IQR {ratios[quartile]:.4f}-{ratios[-quartile - 1]:.4f})"
    )


if __name__ == "__main__":
    main()
