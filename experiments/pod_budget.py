"""PoD by name at a budget on SmolLM2 (``docs/results/pod.md``): ``cache_for(model, "pod", ratio=...)`` with the
shipped grouping, a 4K-token prompt, the achieved KV bytes against the request and the full cache, and the next
token against the full cache's.

    python -m experiments.pod_budget --tokens 4096 --ratio 0.5 --ratio 0.2

The prompt is Paul Graham essays from the shared data (``$KVCOMPRESS_DATA``) concatenated, prefilled in chunks of
512 tokens (the compression runs once, after the last chunk).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kvcompress
from kvcompress.eval.data import data_root
from kvcompress.generation import prefill
from kvcompress.machine import machine_description
from kvcompress.methods.pod.budget import budget_report
from kvcompress.models import load_model


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    texts = [path.read_text() for path in sorted((data_root() / "paul_graham_essays").glob("*.txt"))]
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"--tokens {tokens}: the essays give only {ids.shape[1]} tokens")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ratio", type=float, action="append", default=None)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    ids = prompt_ids(tokenizer, args.tokens)
    with torch.no_grad():
        full = prefill(model, ids, kvcompress.cache_for(model, "full"), chunk_size=args.chunk)
        for ratio in args.ratio or [0.5]:
            cache = kvcompress.cache_for(model, "pod", ratio=ratio)
            cpu = time.process_time()
            logits = prefill(model, ids, cache, chunk_size=args.chunk)
            row = {"tokens": args.tokens, "ratio": ratio, **budget_report(cache)}
            row["tokens_stored_max"] = max(cache.tokens_stored())
            row["same_next_token"] = bool(logits.argmax(-1).eq(full.argmax(-1)).all())
            row["prefill_cpu_s"] = round(time.process_time() - cpu, 1)
            row["machine"] = machine_description(1)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
