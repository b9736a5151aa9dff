"""``decode``: decode step time, tokens/s, stored KV bytes and peak RSS against logical context length.

For each method one cache is grown through the context lengths in turn (1K, 2K, 4K, 8K, 16K by default): the
prompt is extended to the next length with a chunked prefill (``kvcompress.generation.prefill``; bounded methods
evict between chunks, so reaching a long logical context costs ``O(L x (chunk + budget))``, not ``O(L^2)``), then
``steps`` single-token decode forwards are timed (after ``warmup_steps`` untimed ones) and the median is reported.
Token ids are random (timing does not depend on the text). The logical context at a measurement is the prompt
length; the decode steps themselves add ``warmup_steps + steps`` tokens before the next extension.

``full`` is our cache without eviction; ``DynamicCache (sdpa)`` is transformers' own cache with SDPA attention,
the reference for our bookkeeping overhead. One-shot methods (``snapkv``) are not in the default list: they
compress the prompt once and then grow like the full cache while decoding.

``buzz`` is sized by its peak (``budget_kind="peak"``: ``k + w + T = budget``); it evicts once per cycle of
``T - a' + 1`` steps, so the median step is a non-evicting one and ``cpu_mean_ms`` (the mean over the timed steps)
shows the evictions only when the timed steps cover a cycle: ``bench cache-op`` gives its amortised cost.
``cascade`` reaches each context with its chunked prefill (the later official variant; its default exact prefill
inserts the prompt token by token); decode steps are single tokens, the same in both modes.

SmolLM2's trained context is 8K. Positions beyond it still run (RoPE extrapolates); the model's output there is
meaningless, which does not matter for a timing benchmark. ``streaming`` re-indexes positions inside the cache
(on the circular sink cache its keys are rotated to their ranks as they are read), as does ``cascade``; the other
methods keep original positions.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

import kvcompress
from kvcompress.bench.common import (
    DECODE_TIME_METHODS,
    MIB,
    check_int,
    check_methods,
    current_rss,
    load_bench_model,
    peak_rss,
    random_prompt,
    reset_peak_rss,
    set_threads,
    time_calls,
    touch_weights,
)
from kvcompress.bench.model_cli import int_list, model_bench_parser, run_model_bench
from kvcompress.bench.table import Column, markdown_table
from kvcompress.generation import cache_argument, prefill

logger = logging.getLogger(__name__)

DECODE_METHODS: tuple[str, ...] = DECODE_TIME_METHODS
DYNAMIC = "DynamicCache (sdpa)"
CONTEXTS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
Row = dict[str, object]


def _check_contexts(contexts: Sequence[int]) -> list[int]:
    contexts = list(contexts)
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in contexts):
        raise ValueError(f"contexts must be a non-empty list of integers >= 1, got {contexts!r}")
    if contexts != sorted(set(contexts)):
        raise ValueError(f"contexts must be strictly increasing, got {contexts!r}")
    return contexts


def _dynamic_prefill(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, chunk_size: int) -> None:
    for start in range(0, ids.shape[1], chunk_size):
        piece = ids[:, start : start + chunk_size]
        model(input_ids=piece, use_cache=True, logits_to_keep=1, **cache_argument(model, cache))


def _bench_method(
    model: PreTrainedModel,
    method: str,
    budget: int,
    ids: torch.Tensor,
    contexts: list[int],
    steps: int,
    warmup_steps: int,
    chunk_size: int,
    on_row: Callable[[Row], None] | None,
) -> list[Row]:
    if method == DYNAMIC:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)

        def extend(new_ids: torch.Tensor) -> None:
            _dynamic_prefill(model, new_ids, cache, chunk_size)

        def kv_bytes() -> int:
            return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

        kv_allocated = kv_bytes  # (concatenated: allocated as stored)

        def stored() -> int:
            return cache.get_seq_length()

        params: dict[str, object] = {}
    else:
        params = {} if method == "full" else {"budget": budget}
        if method == "buzz":  # peak-sized (k + w + T = budget): never stores more than the fixed-size caches
            params["budget_kind"] = "peak"
        if method == "cascade":  # reach the context with the chunked prefill; single-token steps are the same
            params["prefill"] = "chunked"
        cache = kvcompress.cache_for(model, method, **params)

        def extend(new_ids: torch.Tensor) -> None:
            prefill(model, new_ids, cache, chunk_size=chunk_size)

        def kv_bytes() -> int:
            return cache.nbytes()

        def kv_allocated() -> int:
            return cache.allocated_nbytes()

        def stored() -> int:
            return cache.tokens_stored()[0]

    rows: list[Row] = []
    position = 0
    reset_peak_rss()
    for context in contexts:
        start = time.perf_counter()
        extend(ids[:, position:context])
        prefill_s = time.perf_counter() - start
        position = context
        decode_ids = ids[:, context : context + warmup_steps + steps]

        def step(i: int, decode_ids: torch.Tensor = decode_ids) -> None:
            model(input_ids=decode_ids[:, i : i + 1], use_cache=True, **cache_argument(model, cache))

        timing = time_calls(step, steps, warmup_steps)
        position = context + warmup_steps + steps
        rows.append(
            {
                "method": method,
                "budget": budget if params.get("budget") else None,
                "context": context,
                "step_ms": timing.median * 1e3,
                "p10_ms": timing.p10 * 1e3,
                "p90_ms": timing.p90 * 1e3,
                "tokens_per_s": 1.0 / timing.median,
                "cpu_ms": timing.cpu_median * 1e3,
                "cpu_mean_ms": timing.cpu_mean * 1e3,  # includes eviction bursts (BUZZ) that the median skips
                "steps": timing.count,
                "stored_tokens": stored(),
                "kv_mib": kv_bytes() / MIB,
                "kv_allocated_mib": kv_allocated() / MIB,
                "rss_mib": current_rss() / MIB,
                "peak_rss_mib": peak_rss() / MIB,
                "prefill_s": prefill_s,
            }
        )
        if on_row is not None:
            on_row(rows[-1])
        logger.info("decode %s @ %d: %.1f ms/step", method, context, timing.median * 1e3)
    if method == DYNAMIC:
        kvcompress.prepare_model(model)
    return rows


def run_decode(
    model: str | PreTrainedModel = "smollm2-135m",
    methods: Sequence[str] = DECODE_METHODS,
    *,
    budget: int = 512,
    contexts: Sequence[int] = CONTEXTS,
    steps: int = 16,
    warmup_steps: int = 2,
    chunk_size: int = 512,
    dynamic: bool = True,
    threads: int = 1,
    seed: int = 0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Decode step time vs logical context for each method (and transformers' ``DynamicCache`` if ``dynamic``).

    ``model`` is a registry name (loaded with ``kvcompress.models.load_model``) or a loaded model. Bounded methods
    run at ``budget`` tokens per layer and KV head; ``full`` (and ``DynamicCache``) keep everything. ``on_row`` is
    called with each row as it is measured (to save partial results of a long run).

    Row keys: ``method``, ``budget``, ``context``, ``step_ms``, ``p10_ms``, ``p90_ms``, ``tokens_per_s``, ``steps``,
    ``stored_tokens`` (layer 0, per head), ``kv_mib`` (stored keys + values, all layers), ``kv_allocated_mib`` (the
    same as allocated: stored plus the room kept, ``kvcompress.core.capacity``), ``rss_mib``,
    ``peak_rss_mib`` (high-water mark since this method's cache was created), ``prefill_s`` (time to extend the
    prompt to this context), ``cpu_ms`` (median process CPU time per step: robust to other processes' load), and,
    added at the end, ``vs_first`` / ``cpu_vs_first`` (over this method's own step at its second context, 2K by
    default, or its first if it has one) and ``vs_full`` / ``cpu_vs_full`` (over ``full`` at the same context).
    """
    set_threads(threads)
    contexts = _check_contexts(contexts)
    for name, value, low in (("steps", steps, 1), ("warmup_steps", warmup_steps, 0), ("chunk_size", chunk_size, 1)):
        check_int(value, name, low)
    check_methods(methods, kvcompress.METHODS)
    model, _ = load_bench_model(model)
    touch_weights(model)
    names = list(methods) + ([DYNAMIC] if dynamic else [])
    ids = random_prompt(model, contexts[-1] + warmup_steps + steps, seed)
    rows: list[Row] = []
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        for method in names:
            rows += _bench_method(model, method, budget, ids, contexts, steps, warmup_steps, chunk_size, on_row)
            gc.collect()  # the method's cache is gone with _bench_method's frame
    add_ratios(rows)
    return rows


def add_ratios(rows: list[Row]) -> None:
    """Add ``vs_first`` (step time over the same method's at its second context) and ``vs_full`` in place."""
    by_method: dict[str, list[Row]] = {}
    for row in rows:
        by_method.setdefault(str(row["method"]), []).append(row)
    full = {row["context"]: row["step_ms"] for row in by_method.get("full", [])}
    full_cpu = {row["context"]: row["cpu_ms"] for row in by_method.get("full", [])}
    for method_rows in by_method.values():
        reference_row = method_rows[1 if len(method_rows) > 1 else 0]
        reference, cpu_reference = reference_row["step_ms"], reference_row["cpu_ms"]
        for row in method_rows:
            row["vs_first"] = row["step_ms"] / reference
            row["cpu_vs_first"] = row["cpu_ms"] / cpu_reference
            if row["context"] in full:
                row["vs_full"] = row["step_ms"] / full[row["context"]]
                row["cpu_vs_full"] = row["cpu_ms"] / full_cpu[row["context"]]


DECODE_COLUMNS: tuple[Column, ...] = (
    ("method", "method", ""),
    ("context", "context (tokens)", "d"),
    ("step_ms", "median step (ms)", ".1f"),
    ("p10_ms", "p10 (ms)", ".1f"),
    ("p90_ms", "p90 (ms)", ".1f"),
    ("tokens_per_s", "tokens/s", ".1f"),
    ("cpu_ms", "median CPU / step (ms)", ".1f"),
    ("cpu_mean_ms", "mean CPU / step (ms)", ".1f"),
    ("cpu_vs_first", "CPU × own at 2K", ".2f"),
    ("cpu_vs_full", "CPU × full", ".2f"),
    ("stored_tokens", "stored tokens / layer", "d"),
    ("kv_mib", "stored KV (MiB)", ".1f"),
    ("kv_allocated_mib", "allocated KV (MiB)", ".1f"),
    ("peak_rss_mib", "peak RSS (MiB)", ".0f"),
)


def decode_table(rows: Sequence[Row]) -> str:
    """The markdown table of ``run_decode`` rows."""
    return markdown_table(rows, DECODE_COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = model_bench_parser("decode", __doc__, DECODE_METHODS)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated, increasing")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk used to reach each context")
    parser.add_argument("--no-dynamic", action="store_true", help="skip transformers' DynamicCache reference")
    run_model_bench("decode", parser, argv, run_decode, _decode_options, decode_table, plot_options=("budget",))


def _decode_options(args: argparse.Namespace) -> dict[str, object]:
    """``run_decode``'s own keyword arguments from the parsed command line ``args``."""
    return {
        "contexts": int_list(args.contexts),
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "chunk_size": args.chunk_size,
        "dynamic": not args.no_dynamic,
    }


if __name__ == "__main__":
    main()
