"""``speed``: every compressed cache against transformers' ``DynamicCache``, pair by pair in one process.

    python -m kvcompress.bench.speed [--sections decode,full,prefill,generate] [--out DIR]

Each comparison interleaves the two sides call by call (alternating which goes first) on the same loaded model, so
both see the same machine load; each call's process CPU time is recorded beside its wall time (with one torch
thread CPU time is the work done, not the waiting for a core), and a row reports the median of the per-pair CPU-time
ratios with their 10th and 90th percentiles. Ratios are ours over ``DynamicCache``'s: below 1 is faster. Both sides
run under ``torch.no_grad()``, the mode ``generate`` runs in (``torch.inference_mode()`` spares each small operation
some bookkeeping, which favours a cache of many small operations over ``DynamicCache``).

Sections:

- ``decode``: a single-token decode step of each decode-time method at ``--budget`` tokens after a chunked prefill
  of each ``--prompts`` length, against a ``DynamicCache`` holding the same number of tokens (the physical limit:
  it is cropped back after each step, outside the timed region).
- ``full``: our ``full`` cache against a ``DynamicCache`` holding the same prompt, decode step by decode step.
- ``prefill``: the longest prompt in ``--chunk``-token forwards, chunk by chunk against a ``DynamicCache`` fed the
  same chunks (each side on its own attention; one-shot methods compress with the last chunk, as ``prefill`` does):
  median per-chunk ratio and whole-prefill ratio; peak memory of each method's prefill (the resident-set growth of
  each chunk plus what its cache had allocated before it) against a one-pass ``DynamicCache`` prefill, measured
  in a child process that maps large allocations one by one (``kvcompress.bench.prefill_peaks``).
- ``generate``: ``model.generate`` of ``--new-tokens`` tokens end to end (prefill included) for
  ``--generate-methods`` (``streaming`` and ``h2o``) at ``--generate-budget`` (prefilled in ``--chunk``-token
  chunks, as ``kvcompress generate`` does) against ``DynamicCache`` (one-pass prefill, its fastest), for each prompt
  length and batch size; tokens/s ratios (above 1 is faster).
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

import kvcompress
from kvcompress.bench.common import (
    DECODE_TIME_METHODS,
    bench_cache,
    load_bench_model,
    random_prompt,
    set_threads,
    touch_weights,
)
from kvcompress.bench.model_cli import int_list, method_names, publish
from kvcompress.bench.pairs import timed_pairs, use_attention
from kvcompress.bench.speed_prefill import prefill_rows
from kvcompress.bench.table import Column, markdown_table, partial_writer
from kvcompress.generation import cache_argument, prefill

logger = logging.getLogger(__name__)
Row = dict[str, object]
SECTIONS = ("decode", "full", "prefill", "generate")
DECODE_METHODS = (*DECODE_TIME_METHODS[1:], "cascade", "less", "pod")  # every method evicting while decoding
# (+ the cascade's later official strided prefill, its documented fast option: a method spec with a parameter)
PREFILL_METHODS = (
    "full",
    *DECODE_METHODS,
    "cascade:prefill=chunked",
    "snapkv",
    "nacl",
    "streaming_oneshot",
    "tova_oneshot",
)
GENERATE_METHODS = ("streaming", "h2o")


def dynamic_prefill(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, chunk: int) -> None:
    use_attention(model, "sdpa")
    for start in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, start : start + chunk], **cache_argument(model, cache), use_cache=True, logits_to_keep=1)


def decode_row(model: PreTrainedModel, method: str, prompt: int, budget: int, steps: int, chunk: int, seed: int) -> Row:
    """One decode comparison: ``method`` after a ``prompt``-token prefill vs a DynamicCache of as many tokens."""
    ids = random_prompt(model, prompt + steps + 2, seed)
    cache = bench_cache(model, method, budget)
    prefill(model, ids[:, :prompt], cache, chunk_size=chunk)
    held = max(cache.tokens_stored())
    dynamic = DynamicCache(config=model.config)
    dynamic_prefill(model, ids[:, :held], dynamic, chunk)

    def token(i: int) -> torch.Tensor:
        return ids[:, prompt + i : prompt + i + 1]

    def crop() -> None:
        if method != "full":
            dynamic.crop(held - dynamic.get_seq_length())  # a negative count: drop the step's token again

    result = timed_pairs(
        model,
        lambda i: model(input_ids=token(i), **cache_argument(model, cache), use_cache=True),
        lambda i: model(input_ids=token(i), **cache_argument(model, dynamic), use_cache=True),
        steps,
        after_theirs=crop,
    )
    return {
        "section": "decode" if method != "full" else "full",
        "method": method,
        "prompt": prompt,
        "budget": None if method == "full" else budget,
        "stored_tokens": held,
        **result,
    }


def generate_row(
    model: PreTrainedModel,
    method: str,
    prompt: int,
    batch: int,
    budget: int,
    new_tokens: int,
    chunk: int,
    rounds: int,
    seed: int,
) -> Row:
    """``generate`` end to end with ``method`` vs DynamicCache; ``cpu_ratio`` < 1 means more tokens/s."""
    ids = random_prompt(model, prompt * batch, seed).view(batch, prompt)
    options = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": 0,
    }

    def ours(_: int) -> None:
        cache = kvcompress.cache_for(model, method, budget=budget)
        model.generate(ids, **cache_argument(model, cache), prefill_chunk_size=chunk, **options)

    def theirs(_: int) -> None:
        model.generate(ids, **cache_argument(model, DynamicCache(config=model.config)), **options)

    result = timed_pairs(model, ours, theirs, rounds, warmup=0)
    result["tokens_per_s_ratio"] = 1 / result["cpu_ratio"]
    return {"section": "generate", "method": method, "prompt": prompt, "batch": batch, "budget": budget, **result}


def run_speed(
    model: str | PreTrainedModel = "smollm2-135m",
    sections: Sequence[str] = SECTIONS,
    *,
    methods: Sequence[str] = DECODE_METHODS,
    prefill_methods: Sequence[str] = PREFILL_METHODS,
    budget: int = 512,
    prompts: Sequence[int] = (2048, 8192),
    steps: int = 24,
    chunk: int = 512,
    generate_prompts: Sequence[int] = (1024, 4096),
    batches: Sequence[int] = (1, 8),
    generate_budget: int = 256,
    generate_methods: Sequence[str] = GENERATE_METHODS,
    new_tokens: int = 64,
    rounds: int = 2,
    threads: int = 1,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    random_weights: bool = False,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """All comparisons of the chosen ``sections`` (see the module docstring); one row per comparison."""
    set_threads(threads)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"sections must be among {', '.join(SECTIONS)}; got {', '.join(unknown)}")
    load = {"device": device, "dtype": dtype, "random_weights": random_weights, "threads": threads}
    source = {"model": model, **load} if isinstance(model, str) else None  # the prefill peaks' child loads it again
    model, _ = load_bench_model(model, device, dtype, random_weights)
    touch_weights(model)
    kvcompress.prepare_model(model)
    jobs: list[Callable[[], Row | list[Row]]] = []
    if "decode" in sections:
        jobs += [lambda m=m, p=p: decode_row(model, m, p, budget, steps, chunk, seed) for p in prompts for m in methods]
    if "full" in sections:
        jobs += [lambda p=p: decode_row(model, "full", p, budget, steps, chunk, seed) for p in prompts]
    if "prefill" in sections:
        jobs.append(lambda: prefill_rows(model, prefill_methods, max(prompts), budget, chunk, seed, source))
    if "generate" in sections:
        jobs += [
            lambda m=m, p=p, b=b: generate_row(model, m, p, b, generate_budget, new_tokens, chunk, rounds, seed)
            for p in generate_prompts
            for b in batches
            for m in generate_methods
        ]
    rows: list[Row] = []
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        for job in jobs:
            produced = job()
            for row in produced if isinstance(produced, list) else [produced]:
                rows.append(row)
                logger.info("%s", {k: v for k, v in row.items() if k in ("section", "method", "prompt", "cpu_ratio")})
                if on_row is not None:
                    on_row(row)
            gc.collect()
    return rows


COLUMNS: dict[str, tuple[Column, ...]] = {
    "decode": (("method", "method", ""), ("prompt", "prompt", "d"), ("stored_tokens", "tokens held", "d")),
    "full": (("method", "method", ""), ("prompt", "prompt", "d"), ("stored_tokens", "tokens held", "d")),
    "prefill": (
        ("method", "method", ""),
        ("prompt", "prompt", "d"),
        ("whole_cpu_ratio", "whole prefill CPU ×", ".3f"),
        ("peak_mib", "peak MiB", ".0f"),
        ("one_pass_dynamic_peak_mib", "one-pass DynamicCache peak MiB", ".0f"),
        ("peak_ratio", "peak × one-pass", ".2f"),
    ),
    "generate": (
        ("method", "method", ""),
        ("prompt", "prompt", "d"),
        ("batch", "batch", "d"),
        ("tokens_per_s_ratio", "tokens/s × DynamicCache (CPU)", ".2f"),
    ),
}
RATIO_COLUMNS: tuple[Column, ...] = (
    ("ours_cpu_ms", "ours CPU ms", ".1f"),
    ("dynamic_cpu_ms", "DynamicCache CPU ms", ".1f"),
    ("cpu_ratio", "CPU × DynamicCache (median)", ".3f"),
    ("cpu_ratio_p10", "p10", ".3f"),
    ("cpu_ratio_p90", "p90", ".3f"),
    ("wall_ratio", "wall × DynamicCache", ".3f"),
    ("pairs", "pairs", "d"),
)


def speed_tables(rows: Sequence[Row]) -> str:
    """One markdown table per section present in ``rows``."""
    parts = []
    for section, columns in COLUMNS.items():
        chosen = [row for row in rows if row["section"] == section]
        if chosen:
            parts.append(f"### {section}\n\n" + markdown_table(chosen, (*columns, *RATIO_COLUMNS)))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.bench.speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name, local path or HF id")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated among {', '.join(SECTIONS)}")
    parser.add_argument("--methods", default=",".join(DECODE_METHODS), help="decode-section methods")
    parser.add_argument("--prefill-methods", default=",".join(PREFILL_METHODS))
    parser.add_argument("--budget", type=int, default=512, help="tokens per layer and KV head (decode, prefill)")
    parser.add_argument("--prompts", default="2048,8192", help="prompt lengths (decode, full; prefill: the longest)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode pairs per comparison")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--generate-prompts", default="1024,4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--generate-budget", type=int, default=256)
    parser.add_argument("--generate-methods", default=",".join(GENERATE_METHODS), help="generate-section methods")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed generate pairs per comparison")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda: GPU times include its queue)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--random-weights", action="store_true", help="--model: a folder with a config.json")
    parser.add_argument("--out", type=Path, default=None, help="folder for speed.json/.md (+ partial .jsonl)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = run_speed(
        args.model,
        method_names(args.sections),
        methods=method_names(args.methods),
        prefill_methods=method_names(args.prefill_methods),
        budget=args.budget,
        prompts=int_list(args.prompts),
        steps=args.steps,
        chunk=args.chunk,
        generate_prompts=int_list(args.generate_prompts),
        batches=int_list(args.batches),
        generate_budget=args.generate_budget,
        generate_methods=method_names(args.generate_methods),
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        threads=args.threads,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        random_weights=args.random_weights,
        on_row=partial_writer(args.out, "speed"),
    )
    publish("speed", args, rows, speed_tables(rows), lambda path, machine: None)


if __name__ == "__main__":
    main()
