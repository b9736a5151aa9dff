"""KVzip's reconstruction with and without its logit floor (``kvcompress.methods.kvzip.reconstruct.LOGIT_FLOOR``):
CPU time of ``prefill`` (compression included) against a full prefill, the two variants alternating in one process.

    python -m experiments.kvzip_floor --model smollm2-135m --tokens 1024 --reps 6

The floor raises logits more than 87 below their row's largest to that floor before the exponential; without it
(``inf``) most exponentials of a real model's spread land in float32's subnormal range.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcompress
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import prefill
from kvcompress.methods.kvzip import reconstruct
from kvcompress.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text = " ".join(gutenberg_books()[1].text.split()[: args.tokens])
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    floor = reconstruct.LOGIT_FLOOR

    def run(method: str, logit_floor: float = floor, **params: object) -> float:
        reconstruct.LOGIT_FLOOR = logit_floor
        cache = kvcompress.cache_for(model, method, **params)
        cpu = time.process_time()
        with torch.no_grad():
            prefill(model, ids, cache)
        return time.process_time() - cpu

    run("full")  # warm-up, not counted
    variants = [("floor", floor), ("no floor", float("inf"))]
    times: dict[str, list[float]] = {"full": [], **{name: [] for name, _ in variants}}
    for rep in range(args.reps):
        times["full"].append(run("full"))
        for name, value in variants if rep % 2 == 0 else variants[::-1]:
            times[name].append(run("kvzip", value, ratio=0.5))
    reconstruct.LOGIT_FLOOR = floor
    full = statistics.median(times["full"])
    for name, values in times.items():
        ratio = statistics.median(values) / full
        print(f"{name}: CPU s {[round(v, 2) for v in values]}, median / full prefill {ratio:.2f}")


if __name__ == "__main__":
    main()
