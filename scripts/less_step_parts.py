"""Where LESS's decoding step spends its time beyond its base policy's, part by part, inside real decoding steps.

LESS runs its base policy's step (H2O by default) plus its own parts: φ of the query, the attention over the stored
keys and the state's rows (Eq. 3, in place of the base policy's softmax), the copy of the evicted tokens and the
folds (a prefill chunk's or a masked step's attention reads the state and mixes it in apart instead). Each is
a few small operations per layer, so what they cost depends on running between the model's own layers (caches
cold), which a micro-benchmark does not reproduce. This script wraps each part's function (the library's code is
not copied), decodes a LESS cache and an H2O cache step by step in turns after the same prompt, and prints each
part's median wall time per layer and call, beside the whole step's CPU time of LESS, H2O and a ``DynamicCache``
holding as many tokens, and the time per layer that 10 % of the ``DynamicCache`` step leaves.

    python scripts/less_step_parts.py [--prompt 2048] [--budget 512] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from transformers import DynamicCache

import kvcompress
import kvcompress.core.attention as attention_module
import kvcompress.methods.less.layer as layer_module
import kvcompress.methods.less.policy as policy_module
from kvcompress.bench.common import random_prompt, set_threads
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model

TIMES: dict[str, list[float]] = defaultdict(list)
CURRENT = ["less"]


def timed(name: str, function: Callable, per_layer: int = 1) -> Callable:
    """``function``, recording its wall time (µs, divided by ``per_layer``) under ``name``."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        TIMES[f"{CURRENT[0]}: {name}"].append((time.perf_counter() - start) * 1e6 / per_layer)
        return result

    return wrapper


def wrap_parts(layers: int) -> None:
    policy_module.attention_with_stats = timed("softmax with log-normaliser", policy_module.attention_with_stats)
    policy_module.phi_features = timed("phi of the query", policy_module.phi_features)
    policy_module.phi_head_major = timed("phi of the query (a decoding step's)", policy_module.phi_head_major)
    policy_module.head_matmul = timed("state read", policy_module.head_matmul)
    policy_module.mix_low_rank = timed("Eq. 3 mix", policy_module.mix_low_rank)
    slots = policy_module.low_rank_slots_attention
    policy_module.low_rank_slots_attention = timed("softmax over the stored keys and the state's rows", slots)
    evict = layer_module.LessLayer.before_eviction
    layer_module.LessLayer.before_eviction = timed("copy of the evicted tokens", evict)
    layer_module.fold_staged = timed("folds (a step's, per layer)", layer_module.fold_staged, layers)
    base_attention = attention_module.attention_with_stats
    attention_module.attention_with_stats = timed("softmax (H2O's own)", base_attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    set_threads(1)
    model, _ = load_model(args.model)
    kvcompress.prepare_model(model)
    ids = random_prompt(model, args.prompt + args.steps + 4, 0)
    layers = model.config.num_hidden_layers
    caches = {}
    with torch.inference_mode():
        for method in ("less", "h2o"):
            cache = kvcompress.cache_for(model, method, budget=args.budget)
            model.set_attn_implementation(attention_module.ATTENTION_NAME)
            prefill(model, ids[:, : args.prompt], cache, chunk_size=512)
            for t in range(args.prompt, args.prompt + 3):  # the state filled, the kernels loaded
                model(input_ids=ids[:, t : t + 1], **cache_argument(model, cache))
            caches[method] = cache
        held = caches["h2o"].compressed_layers[0].values.shape[2]
        dynamic = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        model(input_ids=ids[:, :held], **cache_argument(model, dynamic), use_cache=True, logits_to_keep=1)
        wrap_parts(layers)
        steps: dict[str, list[float]] = defaultdict(list)
        for step in range(args.steps):
            t = args.prompt + 3 + step
            for method, cache in caches.items():
                CURRENT[0] = method
                model.set_attn_implementation(attention_module.ATTENTION_NAME)
                start = time.process_time()
                model(input_ids=ids[:, t : t + 1], **cache_argument(model, cache))
                steps[method].append(time.process_time() - start)
            model.set_attn_implementation("sdpa")
            start = time.process_time()
            model(input_ids=ids[:, held : held + 1], **cache_argument(model, dynamic), use_cache=True)
            steps["DynamicCache"].append(time.process_time() - start)
            dynamic.crop(-1)
    print(f"{args.model}, prompt {args.prompt}, budget {args.budget}, {args.steps} steps, 1 torch thread")
    for name, values in steps.items():
        print(f"step CPU time, {name}: {statistics.median(values) * 1e3:.1f} ms")
    allowance = statistics.median(steps["DynamicCache"]) * 0.10 / layers * 1e6
    print(f"10 % of the DynamicCache step, per layer: {allowance:.0f} µs")
    for name, values in sorted(TIMES.items()):
        print(f"{name}: {statistics.median(values):.1f} µs per layer")


if __name__ == "__main__":
    main()
