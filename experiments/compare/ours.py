"""kvcompress's side of the comparison: our methods on the shared samples, one JSON row per evaluation.

Each evaluation mirrors kvpress's pipeline in query-agnostic mode: the context is prefilled in **one forward**
(``prefill(..., chunk_size=None)``: every context token attends to the whole context, and the cache compresses
after the forward, as kvpress's forward hooks do), the kept context indices of every layer and KV head are read
from the cache, then ``generate`` feeds the question and decodes greedily. The CPU time of the prefill (with the
compression) is recorded. Decode-time methods (``streaming``, ``tova``, ``knorm``) keep evicting while the
question and answer are fed, so their cache stays at the budget; the one-shot ones (``snapkv``, ``*_oneshot``)
append without eviction, as every kvpress prefill press does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

import kvcompress
from experiments.compare.samples import read_samples
from kvcompress.eval.tasks.prompting import decode_answer, prefill_prompt
from kvcompress.models import load_model
from kvcompress.results import read_rows

OURS_FILE = "kvcompress.jsonl"

# label -> (method, parameters other than budget); the kvpress press each one is compared with is in COUNTERPARTS.
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("full", {}),
    "streaming": ("streaming", {}),
    "streaming_oneshot:position_mode=original": ("streaming_oneshot", {"position_mode": "original"}),
    "snapkv:window=64;kernel=5;pooling=avg": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg"}),
    "tova": ("tova", {}),
    "tova_oneshot": ("tova_oneshot", {}),
    "knorm": ("knorm", {}),
    "h2o_oneshot": ("h2o_oneshot", {}),
    "h2o_oneshot:heavy_ratio=1.0": ("h2o_oneshot", {"heavy_ratio": 1.0}),
    # preset="kvpress" (kvcompress.presets): one argument for kvpress's settings
    "streaming_oneshot:preset=kvpress": ("streaming_oneshot", {"preset": "kvpress"}),
    "snapkv:preset=kvpress": ("snapkv", {"preset": "kvpress"}),
    "tova_oneshot:preset=kvpress": ("tova_oneshot", {"preset": "kvpress"}),
    "knorm:preset=kvpress": ("knorm", {"preset": "kvpress"}),
}
COUNTERPARTS = {
    "full": "full",
    "streaming": "StreamingLLMPress",
    "streaming_oneshot:position_mode=original": "StreamingLLMPress",
    "snapkv:window=64;kernel=5;pooling=avg": "SnapKVPress",
    "tova": "TOVAPress",
    "tova_oneshot": "TOVAPress",
    "knorm": "KnormPress",
    "h2o_oneshot": "ObservedAttentionPress",
    "h2o_oneshot:heavy_ratio=1.0": "ObservedAttentionPress",
    "streaming_oneshot:preset=kvpress": "StreamingLLMPress",
    "snapkv:preset=kvpress": "SnapKVPress",
    "tova_oneshot:preset=kvpress": "TOVAPress",
    "knorm:preset=kvpress": "KnormPress",
}


def kept_indices(cache) -> list[list[list[int]]]:
    """Context indices kept by every layer and KV head of a batch-1 cache (``[layer][head] -> sorted list``)."""
    kept = []
    for layer in cache.compressed_layers:
        heads = []
        for h in range(layer.token_idx.shape[1]):
            heads.append(sorted(layer.token_idx[0, h][layer.valid[0, h]].tolist()))
        kept.append(heads)
    return kept


def evaluate(model, tokenizer, sample: dict[str, Any], label: str, budget: int | None) -> dict[str, Any]:
    """One row: prefill the context in one forward, record time and kept sets, answer the question."""
    method, params = METHODS[label]
    cache = kvcompress.cache_for(model, method, **params, **({} if budget is None else {"budget": budget}))
    context = torch.tensor([sample["context_ids"]])
    question = torch.tensor([sample["question_ids"]])
    cpu, wall = time.process_time(), time.perf_counter()
    prompt = prefill_prompt(model, context, question, cache, "agnostic", None)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    kept = kept_indices(cache)
    stored = max(len(h) for layer in kept for h in layer)
    # No early stop: decode like kvpress's generate_answer (until EOS or max_new_tokens), so answers compare.
    text = decode_answer(model, tokenizer, prompt, cache, sample["max_new_tokens"])
    return {
        "side": "kvcompress",
        "sample": sample["id"],
        "method": label,
        "budget": budget,
        "context_tokens": context.shape[1],
        "stored": stored,
        "prefill_cpu_s": round(cpu, 4),
        "prefill_wall_s": round(wall, 4),
        "prediction": text,
        "kept": kept,
    }


def run_ours(
    out_dir: str | Path, methods: list[str] | None = None, threads: int = 1, samples: int | None = None
) -> Path:
    """Evaluate ``methods`` (labels of ``METHODS``; default all) on the samples in ``out_dir`` (the first
    ``samples`` of them; default all); resumable."""
    methods = list(METHODS) if methods is None else methods
    for label in methods:
        if label not in METHODS:
            raise ValueError(f"methods must be drawn from {', '.join(METHODS)}; got {label!r}")
    torch.set_num_threads(threads)
    spec = read_samples(out_dir)
    if samples is not None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be an integer >= 1 or None (all), got {samples!r}")
        spec["samples"] = spec["samples"][:samples]
    path = Path(out_dir) / OURS_FILE
    done = {(row["sample"], row["method"], row["budget"]) for row in read_rows(path)}
    jobs = [(s, label, None) for s in spec["samples"] for label in methods if label == "full"]
    jobs += [(s, label, b) for s in spec["samples"] for b in spec["budgets"] for label in methods if label != "full"]
    todo = [j for j in jobs if (j[0]["id"], j[1], j[2]) not in done]
    print(f"{len(jobs)} evaluations, {len(jobs) - len(todo)} already in {path}", flush=True)
    if not todo:
        return path
    model, tokenizer = load_model(spec["model"])
    with path.open("a") as handle, Progress() as bar:
        job = bar.add_task("kvcompress", total=len(todo))
        for sample, label, budget in todo:
            row = evaluate(model, tokenizer, sample, label, budget)
            row["env"] = {
                "transformers": __import__("transformers").__version__,
                "torch": torch.__version__,
                "kvcompress": kvcompress.__version__,
                "threads": torch.get_num_threads(),
            }
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            bar.update(job, advance=1, description=f"{sample['id']} {label} {budget}")
    return path
