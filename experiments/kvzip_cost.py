"""KVzip's prefill and compression against a full prefill, CPU time, interleaved in one process.

    python -m experiments.kvzip_cost --tokens 1024 --reps 3

A book shipped with the package (its first ``--tokens`` tokens) is prefilled into a full cache and into a KVzip
cache (ratio 0.5) in turn, ``--reps`` times, one torch thread, under ``torch.no_grad`` as ``generate`` runs; prints
each run's wall and CPU seconds and the ratio of the CPU medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvcompress
from kvcompress.eval.data import gutenberg_books
from kvcompress.generation import prefill
from kvcompress.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text = " ".join(gutenberg_books()[1].text.split()[: args.tokens])
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]

    def run(method: str, **params: object) -> tuple[float, float]:
        cache = kvcompress.cache_for(model, method, **params)
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            prefill(model, ids, cache)
        return time.perf_counter() - wall, time.process_time() - cpu

    runs: dict[str, list[tuple[float, float]]] = {"full": [], "kvzip": []}
    for _ in range(args.reps):
        runs["full"].append(run("full"))
        runs["kvzip"].append(run("kvzip", ratio=0.5))
    for name, times in runs.items():
        print(name, "wall", [round(w, 2) for w, _ in times], "cpu", [round(c, 2) for _, c in times])
    ratio = statistics.median(c for _, c in runs["kvzip"]) / statistics.median(c for _, c in runs["full"])
    print(f"{ids.shape[1]} tokens: kvzip / full, CPU time medians: {ratio:.2f}")


if __name__ == "__main__":
    main()
