"""kvpress's presses on a leaderboard's own samples, run in kvpress's environment (``leaderboard --kvpress``).

    /path/to/kvpress-venv/bin/python .../kvcompress/eval/kvpress_side.py SAMPLES.json OUT.jsonl

This file is run as a script by the other environment's Python and imports nothing of kvcompress (kvpress 0.5.5
pins an older ``transformers``): only the standard library, torch, transformers and kvpress. ``SAMPLES.json``
(written by ``kvcompress.eval.kvpress_columns``) holds the local model folder, the kept ratios, the presses and
each sample's token ids; for every sample x press x kept ratio the context is prefilled under ``with press(model)``
as kvpress's pipeline does (``model.model(input_ids=context_ids, past_key_values=cache)``: one forward, the
compression in the layers' hooks; KVzip's reconstruction when the block ends), then the question is answered with
the pipeline's own ``generate_answer`` (greedy, the question at its positions after the compressed context). One
JSON row per evaluation is appended to ``OUT.jsonl``; a rerun skips the rows already there.

A press is named by its kvpress class (``KeyDiffPress``) or a wrapper around one (``AdaKVPress(SnapKVPress)``),
with kvpress's defaults otherwise. Kept ratio -> kvpress ``compression_ratio``: kvpress keeps
``int(n * (1 - compression_ratio))`` of ``n`` context tokens; ``1 - (floor(kept * n) + 0.5) / n`` makes that land
on ``floor(kept * n)``, the count kvcompress's ratio methods keep, where a plain ``1 - kept`` can land one lower by
floating-point rounding.

Bytes (``kv_bytes``): the keys and values the cache holds after compression (a press that only masks, such as
AdaKV or KVzip in kvpress, holds every context token) plus one token's worth per question and answer token, the
tokens the answer adds, as kvcompress counts its own rows at the end of the answer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
from transformers.utils import logging as hf_logging


def compression_ratio(kept: float, context_tokens: int) -> float:
    """The kvpress ``compression_ratio`` that keeps ``floor(kept * context_tokens)`` tokens."""
    count = max(1, math.floor(kept * context_tokens))
    return 1.0 - (count + 0.5) / context_tokens


def make_press(kvpress, name: str, ratio: float):
    """``KeyDiffPress`` or ``Wrapper(Inner)``, e.g. ``AdaKVPress(ExpectedAttentionPress)``."""
    match = re.fullmatch(r"(\w+)(?:\((\w+)\))?", name)
    if not match or not all(hasattr(kvpress, part) for part in match.groups() if part):
        raise ValueError(f"press must be a kvpress class name or Wrapper(Inner) of two; got {name!r}")
    outer, inner = match.groups()
    if inner is None:
        return getattr(kvpress, outer)(compression_ratio=ratio)
    return getattr(kvpress, outer)(getattr(kvpress, inner)(compression_ratio=ratio))


def done_rows(path: Path) -> set[str]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from an interrupted run: that evaluation runs again
            done.add(json.dumps([row["sample"], row["press"], row["kept"]]))
    return done


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvpress  # only in kvpress's environment (importing this module elsewhere needs no kvpress)

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    spec = json.loads(args.samples.read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    models, pipes = {}, {}
    for name in spec["presses"]:
        make_press(kvpress, name, 0.5)  # a misspelt press fails before any work
    env = {"kvpress": getattr(kvpress, "__version__", "?"), "transformers": transformers.__version__}
    jobs = [(s, p, k) for s in spec["samples"] for p in spec["presses"] for k in spec["kept"]]
    done = done_rows(args.out)
    todo = [j for j in jobs if json.dumps([j[0]["id"], j[1], j[2]]) not in done]
    print(f"kvpress: {len(jobs)} evaluations, {len(jobs) - len(todo)} already in {args.out}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with args.out.open("a") as handle:
        for number, (sample, name, kept) in enumerate(todo, 1):
            impl = "eager" if name.startswith("ObservedAttention") else "sdpa"  # it needs the attention weights
            if impl not in models:
                models[impl] = AutoModelForCausalLM.from_pretrained(
                    spec["model_dir"], dtype=torch.float32, attn_implementation=impl
                ).eval()
                pipes[impl] = pipeline("kv-press-text-generation", model=models[impl], tokenizer=tokenizer)
            model, pipe = models[impl], pipes[impl]
            context = torch.tensor([sample["context_ids"]])
            question = torch.tensor([sample["question_ids"]])
            n = context.shape[1]
            ratio = compression_ratio(kept, n)
            press, cache = make_press(kvpress, name, ratio), DynamicCache()
            wall = time.perf_counter()
            with torch.no_grad(), press(model):
                model.model(input_ids=context, past_key_values=cache)
            prefill_s = time.perf_counter() - wall
            held = cache_bytes(cache)
            wall = time.perf_counter()
            with torch.no_grad():
                text = pipe.generate_answer(
                    question_ids=question, cache=cache, context_length=n, max_new_tokens=sample["max_new_tokens"]
                )
            decode_s = time.perf_counter() - wall
            new_tokens = len(tokenizer.encode(text, add_special_tokens=False))
            per_token = spec["bytes_per_token"]
            row = {
                "sample": sample["id"],
                "press": name,
                "kept": kept,
                "compression_ratio": ratio,
                "context_tokens": n,
                "kv_bytes": held + per_token * (question.shape[1] + max(new_tokens, 1) - 1),
                "prefill_s": round(prefill_s, 4),
                "decode_s": round(decode_s, 4),
                "new_tokens": new_tokens,
                "prediction": text,
                "env": env,
            }
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            elapsed = time.monotonic() - start
            print(
                f"kvpress {number}/{len(todo)}: {sample['id']} {name} kept {kept} {text[:40]!r} "
                f"({elapsed:.0f} s, ~{elapsed / number * (len(todo) - number):.0f} s left)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
