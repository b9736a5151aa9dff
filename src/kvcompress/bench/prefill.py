"""``prefill``: time and peak memory of a long prompt prefilled in one pass vs in chunks with eviction between them.

For each method and prompt length the prompt (random token ids) is run through ``kvcompress.generation.prefill``
once with ``chunk_size=None`` (one forward over the whole prompt: every key is stored before the method evicts)
and once in chunks (bounded methods evict between chunks, so the stored cache never exceeds budget + chunk).
Peak memory is the process's resident-set high-water mark during the prefill minus the RSS just before it (the
model's weights are already resident), reset before each run (see ``kvcompress.bench.common``). Each configuration
runs ``repeats`` times on a fresh cache; medians are reported.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

import kvcompress
from kvcompress.bench.common import (
    MIB,
    PeakMemory,
    check_int,
    check_methods,
    load_bench_model,
    random_prompt,
    set_threads,
    touch_weights,
)
from kvcompress.bench.model_cli import int_list, model_bench_parser, run_model_bench
from kvcompress.bench.table import Column, markdown_table
from kvcompress.generation import prefill

logger = logging.getLogger(__name__)

PREFILL_METHODS: tuple[str, ...] = ("full", "streaming", "h2o")
PROMPTS: tuple[int, ...] = (4096, 8192)
Row = dict[str, object]


def run_prefill(
    model: str | PreTrainedModel = "smollm2-135m",
    methods: Sequence[str] = PREFILL_METHODS,
    *,
    budget: int = 512,
    prompt_lengths: Sequence[int] = PROMPTS,
    chunk_size: int = 512,
    repeats: int = 1,
    threads: int = 1,
    seed: int = 0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Prefill time and peak memory, one pass vs chunked, per method and prompt length.

    Row keys: ``method``, ``budget``, ``prompt``, ``mode`` (``one pass`` / ``chunks of N``), ``chunk_size``
    (``None`` for one pass), ``time_s``, ``tokens_per_s``, ``cpu_s`` (process CPU time), ``peak_extra_mib`` (peak
    RSS above the RSS before the prefill), ``peak_rss_mib``, ``kv_mib``, ``kv_allocated_mib`` (stored plus
    the room kept) and ``stored_tokens`` after the prefill, ``repeats``, and
    ``time_vs_one_pass`` / ``cpu_vs_one_pass`` / ``memory_vs_one_pass`` (over one pass, same method and prompt).
    """
    set_threads(threads)
    for name, value in (("chunk_size", chunk_size), ("repeats", repeats), ("budget", budget)):
        check_int(value, name)
    if not prompt_lengths or any(not isinstance(p, int) or p < 2 for p in prompt_lengths):
        raise ValueError(f"prompt_lengths must be integers >= 2, got {list(prompt_lengths)!r}")
    check_methods(methods, kvcompress.METHODS)
    model, _ = load_bench_model(model)
    touch_weights(model)
    ids = random_prompt(model, max(prompt_lengths), seed)
    rows: list[Row] = []
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        for prompt in prompt_lengths:
            for method in methods:
                params = {} if method == "full" else {"budget": budget}
                for chunk in (None, chunk_size):
                    times, cpu_times, extras, peaks = [], [], [], []
                    for _ in range(repeats):
                        cache = kvcompress.cache_for(model, method, **params)
                        gc.collect()
                        with PeakMemory() as memory:
                            cpu_start, start = time.process_time(), time.perf_counter()
                            prefill(model, ids[:, :prompt], cache, chunk_size=chunk)
                            times.append(time.perf_counter() - start)
                            cpu_times.append(time.process_time() - cpu_start)
                        extras.append(memory.extra)
                        peaks.append(memory.peak)
                        kv, stored = cache.nbytes(), cache.tokens_stored()[0]
                        kv_allocated = cache.allocated_nbytes()
                        del cache
                    seconds = statistics.median(times)
                    row = {
                        "method": method,
                        "budget": params.get("budget"),
                        "prompt": prompt,
                        "mode": "one pass" if chunk is None else f"chunks of {chunk}",
                        "chunk_size": chunk,
                        "time_s": seconds,
                        "tokens_per_s": prompt / seconds,
                        "cpu_s": statistics.median(cpu_times),
                        "peak_extra_mib": statistics.median(extras) / MIB,
                        "peak_rss_mib": statistics.median(peaks) / MIB,
                        "kv_mib": kv / MIB,
                        "kv_allocated_mib": kv_allocated / MIB,
                        "stored_tokens": stored,
                        "repeats": repeats,
                    }
                    rows.append(row)
                    logger.info(
                        "prefill %s %d %s: %.1f s, +%.0f MiB",
                        method,
                        prompt,
                        row["mode"],
                        seconds,
                        row["peak_extra_mib"],
                    )
                    if on_row is not None:
                        on_row(row)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[Row]) -> None:
    """Add ``time_vs_one_pass`` and ``memory_vs_one_pass`` to every row, in place."""
    one_pass = {(r["method"], r["prompt"]): r for r in rows if r["chunk_size"] is None}
    for row in rows:
        base = one_pass.get((row["method"], row["prompt"]))
        if base is not None:
            row["time_vs_one_pass"] = row["time_s"] / base["time_s"]
            row["cpu_vs_one_pass"] = row["cpu_s"] / base["cpu_s"]
            # a peak below 1 MiB is noise, not a base for a ratio
            row["memory_vs_one_pass"] = (
                row["peak_extra_mib"] / base["peak_extra_mib"] if base["peak_extra_mib"] >= 1 else None
            )


PREFILL_COLUMNS: tuple[Column, ...] = (
    ("method", "method", ""),
    ("prompt", "prompt (tokens)", "d"),
    ("mode", "mode", ""),
    ("time_s", "time (s)", ".1f"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("time_vs_one_pass", "time × one pass", ".2f"),
    ("cpu_s", "CPU time (s)", ".1f"),
    ("cpu_vs_one_pass", "CPU × one pass", ".2f"),
    ("peak_extra_mib", "peak RSS above start (MiB)", ".0f"),
    ("memory_vs_one_pass", "peak × one pass", ".2f"),
    ("kv_mib", "stored KV after (MiB)", ".1f"),
    ("kv_allocated_mib", "allocated KV after (MiB)", ".1f"),
    ("stored_tokens", "stored tokens / layer", "d"),
)


def prefill_table(rows: Sequence[Row]) -> str:
    """The markdown table of ``run_prefill`` rows."""
    return markdown_table(rows, PREFILL_COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = model_bench_parser("prefill", __doc__, PREFILL_METHODS)
    parser.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="comma-separated prompt lengths")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    run_model_bench("prefill", parser, argv, run_prefill, _prefill_options, prefill_table)


def _prefill_options(args: argparse.Namespace) -> dict[str, object]:
    """``run_prefill``'s own keyword arguments from the parsed command line ``args``."""
    return {"prompt_lengths": int_list(args.prompts), "chunk_size": args.chunk_size, "repeats": args.repeats}


if __name__ == "__main__":
    main()
