"""Peak memory of a long prompt's prefill: a one-pass ``DynamicCache`` and each method's chunked prefill.

The speed benchmark's ``prefill`` section measures these in a child process of its own
(``python -m kvcompress.bench.prefill_peaks``), which maps every allocation of 1 MiB or more one by one from its
start (``map_large_allocations``). The resident set then counts the live tensors, not how fragmented malloc's heap
has become: unmapped, the same one-pass prefill read 610 to 1,072 MiB in different runs; mapped from the start,
three 4K runs agree within 2 %. (The page faults of that mode would tilt timings, so the timed
pass stays in the benchmark's own process.) A method's peak is the resident-set growth of each chunk plus what its
cache had allocated before it; one method at a time, so only its cache is held.

    python -m kvcompress.bench.prefill_peaks --methods full,snapkv --prompt 8192  # prints JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

import kvcompress
from kvcompress.bench.common import (
    PeakMemory,
    bench_cache,
    current_rss,
    load_bench_model,
    map_large_allocations,
    peak_rss,
    random_prompt,
    reset_peak_rss,
    set_threads,
    touch_weights,
)
from kvcompress.bench.pairs import use_attention
from kvcompress.bench.prompt_chunks import chunked_prefills
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument


def measure_peaks(
    model: PreTrainedModel, ids: torch.Tensor, methods: Sequence[str], budget: int, chunk: int
) -> dict[str, int]:
    """Peak bytes of a one-pass ``DynamicCache`` prefill of ``ids`` (key ``"one_pass_dynamic"``) and of each
    method's prefill in ``chunk``-token forwards."""
    use_attention(model, "sdpa")
    with PeakMemory() as one_pass:
        fresh = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_argument(model, fresh), use_cache=True, logits_to_keep=1)
    del fresh
    gc.collect()
    use_attention(model, ATTENTION_NAME)
    peaks = {"one_pass_dynamic": one_pass.extra}
    for method in methods:
        caches = {method: bench_cache(model, method, budget)}
        peaks[method] = 0
        for _, run_chunk in chunked_prefills(model, ids, caches, chunk):
            held = sum(layer.allocated_nbytes() for layer in caches[method].layers)
            reset_peak_rss()
            before = current_rss()
            run_chunk(method)
            peaks[method] = max(peaks[method], held + peak_rss() - before)
        del caches
        gc.collect()
    return peaks


def peaks_in_child(
    model: str, methods: Sequence[str], prompt: int, budget: int, chunk: int, seed: int, **load: object
) -> dict[str, int]:
    """``measure_peaks`` in a fresh process (``load``: ``device``, ``dtype``, ``random_weights``, ``threads``)."""
    command = [sys.executable, "-m", "kvcompress.bench.prefill_peaks", "--model", model, "--methods", ",".join(methods)]
    command += [f"--prompt={prompt}", f"--budget={budget}", f"--chunk={chunk}", f"--seed={seed}"]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in load.items() if key != "random_weights"]
    command += ["--random-weights"] if load.get("random_weights") else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"prefill peaks: the child process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    mapped = map_large_allocations()  # first: every later large allocation is mapped
    prog, about = "python -m kvcompress.bench.prefill_peaks", __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=about)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="full")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--random-weights", action="store_true")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    model, _ = load_bench_model(args.model, args.device, args.dtype, args.random_weights)
    touch_weights(model)
    kvcompress.prepare_model(model)
    ids = random_prompt(model, args.prompt, args.seed)
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        peaks = measure_peaks(model, ids, [m for m in args.methods.split(",") if m], args.budget, args.chunk)
    print(json.dumps({**peaks, "mapped": int(mapped)}))


if __name__ == "__main__":
    main()
