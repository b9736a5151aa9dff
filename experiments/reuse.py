"""A context compressed once and reused (docs/results/frontier.md, "Contexts compressed once and reused").

    python -m experiments.reuse runs/frontier [SAMPLES]  # reads runs/frontier/samples.json (experiments.compare)

For each sample (the first SAMPLES, default 1) and method (ratio 0.5; H2O and the cascade at half the context's
tokens), the context is prefilled and compressed once; then the cache is forked and saved to a safetensors file and
loaded back. Each of the three (original, fork, loaded) answers the sample's question greedily; the script prints
the key and value bytes each holds and has allocated (one number when the three agree), the file's size, the times,
whether the three answers are the same tokens and the largest difference of their first logits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill
from kvcompress.models import load_model

METHODS = {
    "compactor": lambda n: {"ratio": 0.5},
    "keydiff adakv": lambda n: {"ratio": 0.5, "allocation": "adakv"},
    "kvzip": lambda n: {"ratio": 0.5},
    "h2o": lambda n: {"budget": n // 2},
    "cascade": lambda n: {"budget": n // 2},
}


@torch.no_grad()
def answer(model, cache, question: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``question`` and the first next-token logits."""
    tokens = torch.tensor([question])
    out, first = [], None
    for _ in range(steps):
        logits = model(input_ids=tokens, **cache_argument(model, cache), use_cache=True).logits[:, -1]
        first = logits if first is None else first
        tokens = logits.argmax(-1, keepdim=True)
        out.append(int(tokens))
    return out, first


def allocated(cache) -> int:
    """Bytes of the key and value buffers as allocated (capacity), all layers."""
    return sum(layer.allocated_nbytes() for layer in cache.compressed_layers)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(out: str, count: int = 1) -> int:
    torch.set_num_threads(1)
    spec = json.loads((Path(out) / "samples.json").read_text())
    model, _ = load_model(spec["model"])
    print(
        "| method | context tokens | K/V bytes held, `nbytes()` | K/V buffers allocated | file bytes | compress s "
        "| fork s | save s | load s | same answer (fork, loaded) | largest first-logit difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    folder = Path(tempfile.mkdtemp(prefix="kvcompress-reuse-"))
    for sample in spec["samples"][:count]:
        context, question = sample["context_ids"], sample["question_ids"]
        steps = min(sample["max_new_tokens"], 12)
        for name, params in METHODS.items():
            method, *rest = name.split()
            extra = {"allocation": rest[0]} if rest else {}
            cache = kvcompress.cache_for(model, method, **{**params(len(context)), **extra})
            ids = torch.tensor([context])
            _, compress = timed(lambda cache=cache, ids=ids: prefill(model, ids, cache))
            fork, fork_s = timed(cache.fork)
            path = folder / f"{method}.safetensors"
            _, save_s = timed(lambda cache=cache, path=path: kvcompress.save_cache(cache, path))
            loaded, load_s = timed(lambda path=path: kvcompress.load_cache(path, model))
            held = {cache.nbytes(), fork.nbytes(), loaded.nbytes()}
            buffers = {allocated(cache), allocated(fork), allocated(loaded)}
            answers = [answer(model, c, question, steps) for c in (cache, fork, loaded)]
            same = all(a[0] == answers[0][0] for a in answers)
            worst = max((a[1] - answers[0][1]).abs().max().item() for a in answers)
            print(
                f"| {name} | {len(context)} | {'/'.join(map(str, sorted(held)))} | "
                f"{'/'.join(map(str, sorted(buffers)))} | {path.stat().st_size} | "
                f"{compress:.2f} | {fork_s:.3f} | {save_s:.3f} | {load_s:.3f} | {same} | {worst:.1e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", nargs="?", default="runs/frontier", help="a folder holding experiments.compare's samples.json"
    )
    parser.add_argument("samples", nargs="?", type=int, default=1, help="how many of its samples (the first)")
    args = parser.parse_args()
    if not (Path(args.out) / "samples.json").is_file():
        parser.error(
            f"{args.out!r} holds no samples.json: run `python -m experiments.compare samples --out {args.out}` first"
        )
    if args.samples < 1:
        parser.error(f"samples must be at least 1, got {args.samples}")
    sys.exit(main(args.out, args.samples))
