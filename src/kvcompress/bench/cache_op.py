"""``cache-op``: latency of one KV-cache update per method, in the Cascading KV Cache paper's Table 4 setup.

Setup (paper §4.5 and its code, ``bench_against_naive``): 4 sink tokens, a window of 1024, batch 8, 32 heads, head
dim 128, fp32 random keys and values; 100 tokens of warm-up, then 4,096 timed tokens, one token per update. The
paper times the cache operation only: no attention, RoPE or model.

What one update is here:

- our methods: ``CompressedLayer.update()`` (append, return what attention sees) + ``after_attention(stats)`` (the
  method folds in the attention statistics and evicts). Methods that read attention get synthetic statistics of the
  right shape (a softmax over random logits, one query per KV head: the paper's 32 heads are all KV heads), built
  once outside the timed region. The layer is built from ``config.policy(0)`` as ``CompressedCache`` does;
- ``concat sink (reference)``: the usual sink cache (StreamingLLM's ``StartRecentKVCache``, HF's old ``SinkCache``):
  ``torch.cat`` the new token, then ``torch.cat`` the sinks with the most recent ``window`` tokens;
- ``circular sink (reference)``: a buffer of ``sinks + window`` slots allocated once, the new token overwrites the
  oldest non-sink slot in place (what the paper's circular buffers do, without cascades or scores): the floor;
- ``DynamicCache (transformers)``: ``DynamicCache.update`` (concatenation, no eviction: it grows);
- ``cascade (decode step)`` and ``cascade N=1 (decode step)``: the cascade layers' decoding step as a model runs
  it (``update``, then the attention function with a query and its RoPE position): the in-step fast path, where
  insertion, attention over the rings and the EMA are done together (the plain ``cascade`` rows drive the rings
  without a query, through their per-token tensor path). Attention is included on both sides;
- ``streaming + positioned()``: our ``streaming`` update plus the attention-side work its re-indexed positions cost
  every step (``register_new_tokens`` + ``positioned``, which re-rotates every stored key), for comparison;
- ``buzz`` evicts in bursts (once per cycle of ``T - a' + 1`` updates, ``a'`` = middle length after an eviction), so
  its median update is the cheap non-evicting one: it is timed over whole eviction cycles (from just after an
  eviction to an eviction, at least ``tokens`` updates; ``time_whole_cycles``) and rows carry the mean CPU per update
  (``cpu_mean_us``, the amortised cost), the number of evicting updates, and the average and peak stored length.
  ``buzz`` is sized by its *peak* (``budget_kind="peak"``: ``k + w + T = sinks + window``, never more than the
  fixed-size caches store); ``buzz (average budget)`` is sized by its steady-state *average* (the paper's notion of
  cache budget), whose peak is about 1.4x that.

Each ``N = 4`` cascade row is timed in alternation with its own ``N = 1`` row when both run (one update of each in
turn, ``time_alternating``), and carries their ratio (``cpu_vs_own_n1``, median CPU time over median CPU time): on a
shared machine the load drifts over the seconds one row takes, and two rows timed one after the other measure it
as much as the caches (the same pair timed in turn gave 0.8x to 1.5x from run to run on a loaded 2-core VM).

Bounded caches start full (``sinks + window`` tokens stored, written in one untimed update), so every timed update
is an eviction step; unbounded ones (``full``, ``snapkv`` after its one-shot compression, ``DynamicCache``) start
from the same tokens and grow. Budgets: ``sinks + window`` tokens per layer and head for every method (for
``streaming`` that is ``sinks`` sinks + ``window`` recent tokens, as in the paper).

The full setup stores 8 x 32 x 1028 x 128 fp32 = 134 MB per tensor, and a concatenating cache rewrites it every
step (about 0.2 s per update on a 2-core VM): the default therefore times 64 tokens after 8 warm-up tokens at the
paper's shapes; ``--tokens 4096 --warmup 100`` reproduces the paper's count where time allows, and ``--quick``
runs small shapes for CI.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

import torch

from kvcompress.bench.cache_op_steps import (
    BUZZ_AVERAGE,
    CACHE_OP_METHODS,
    CASCADES,
    CIRCULAR_SINK,
    CONCAT_SINK,
    DECODE_STEPS,
    DYNAMIC,
    QUICK,
    STREAMING_POSITIONED,
    CacheOpSetup,
    cascade_decode_step,
    cascade_step,
    evicts_in_bursts,
    layer_step,
    reference_step,
    stored_tokens,
    time_whole_cycles,
)
from kvcompress.bench.common import Timing, check_methods, environment, set_threads, time_calls
from kvcompress.bench.table import Column, markdown_table, save_outputs

OWN_N1 = {"cascade": "cascade N=1", "cascade (decode step)": "cascade N=1 (decode step)"}  # timed in alternation


def time_alternating(fns: Sequence[Callable[[int], object]], count: int, warmup: int = 0) -> list[Timing]:
    """``time_calls`` of several functions, one call of each in turn (the same load for all); one summary each."""
    for i in range(warmup):
        for fn in fns:
            fn(i)
    samples: list[list[float]] = [[] for _ in fns]
    cpu_samples: list[list[float]] = [[] for _ in fns]
    for i in range(warmup, warmup + count):
        for fn, wall, cpu in zip(fns, samples, cpu_samples, strict=True):
            cpu_start, start = time.process_time(), time.perf_counter()
            fn(i)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    return [Timing.of(wall, cpu) for wall, cpu in zip(samples, cpu_samples, strict=True)]


def run_cache_op(
    methods: Sequence[str] = CACHE_OP_METHODS,
    *,
    batch: int = 8,
    heads: int = 32,
    head_dim: int = 128,
    sinks: int = 4,
    window: int = 1024,
    warmup: int = 8,
    tokens: int = 64,
    references: bool = True,
    threads: int = 1,
    seed: int = 0,
) -> list[dict[str, object]]:
    """Time one cache update per method (and the references); returns one row per cache, slowest last.

    Row keys: ``cache``, ``kind`` (``kvcompress`` / ``reference`` / ``transformers``), ``bounded``,
    ``median_us``, ``p10_us``, ``p90_us``, ``steps``, ``stored`` (tokens stored per head at the end),
    ``cpu_us`` (median process CPU time per update), ``vs_concat_sink`` and ``vs_streaming`` (median ratios, from
    this run; missing when that cache did not run) and the same ratios of CPU time, ``cpu_vs_...``. Our layers'
    rows add ``cpu_mean_us`` (mean CPU time per update: the amortised cost) and ``cpu_mean_vs_streaming``,
    ``evictions`` (timed updates after which the layer stored no more than before), ``avg_stored`` and
    ``peak_stored`` (over the timed updates). ``buzz`` is timed over whole eviction cycles (``time_whole_cycles``):
    its ``steps`` is at least ``tokens``. An ``N = 4`` cascade row timed in alternation with its own ``N = 1`` row
    adds ``cpu_vs_own_n1``.
    """
    set_threads(threads)
    setup = CacheOpSetup(batch, heads, head_dim, sinks, window, warmup, tokens)
    check_methods(sorted(set(methods)), CACHE_OP_METHODS)
    plan: list[tuple[str, str]] = []  # (row, kind)
    if references:
        plan += [(name, "reference") for name in (CONCAT_SINK, CIRCULAR_SINK)]
        plan.append((DYNAMIC, "transformers"))
    builders: dict[str, Callable] = {
        **dict.fromkeys(CASCADES, cascade_step),
        **dict.fromkeys(DECODE_STEPS, cascade_decode_step),
        **dict.fromkeys((CONCAT_SINK, CIRCULAR_SINK, DYNAMIC), reference_step),
    }
    plan += [(method, "kvcompress") for method in methods]
    if "streaming" in methods:
        plan.append((STREAMING_POSITIONED, "kvcompress"))
    if "buzz" in methods:
        plan.append((BUZZ_AVERAGE, "kvcompress"))

    kinds = dict(plan)
    pairs = {name: own for name, own in OWN_N1.items() if name in kinds and own in kinds}
    rows_by_name: dict[str, dict[str, object]] = {}
    with torch.no_grad():  # the mode generate runs in (inference_mode spares small ops more)
        for name, _ in plan:
            if name in rows_by_name:  # (an N = 1 row timed with its N = 4 row)
                continue
            names = [name, pairs[name]] if name in pairs else [name]
            built = [_build(other, builders, setup, seed) for other in names]
            if len(built) > 1:
                timings = time_alternating([step for _, step in built], setup.tokens, setup.warmup)
            elif evicts_in_bursts(built[0][0]):
                timings = [time_whole_cycles(built[0][1], built[0][1].sizes, setup.tokens, setup.warmup)]
            else:
                timings = [time_calls(built[0][1], setup.tokens, setup.warmup)]
            for other, (cache, step), timing in zip(names, built, timings, strict=True):
                rows_by_name[other] = _row(other, kinds[other], cache, step, timing, setup)
            if len(names) > 1:
                rows_by_name[name]["cpu_vs_own_n1"] = timings[0].cpu_median / timings[1].cpu_median
            del built
            gc.collect()
    rows = [rows_by_name[name] for name, _ in plan]
    by_name = {row["cache"]: row["median_us"] for row in rows}
    by_cpu = {row["cache"]: row["cpu_us"] for row in rows}
    for row in rows:
        for key, reference in (("vs_concat_sink", CONCAT_SINK), ("vs_streaming", "streaming")):
            if reference in by_name:
                row[key] = row["median_us"] / by_name[reference]
                row["cpu_" + key] = row["cpu_us"] / by_cpu[reference]
    streaming_mean = next((row["cpu_mean_us"] for row in rows if row["cache"] == "streaming"), None)
    for row in rows:
        if streaming_mean and "cpu_mean_us" in row:
            row["cpu_mean_vs_streaming"] = row["cpu_mean_us"] / streaming_mean
    return rows


def _build(name: str, builders: dict[str, Callable], setup: CacheOpSetup, seed: int):
    """The cache of the row ``name`` and its timed update (each row from the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    if name == STREAMING_POSITIONED:
        return layer_step("streaming", setup, generator, positioned=True)
    if name == BUZZ_AVERAGE:
        return layer_step("buzz", setup, generator, budget_kind="average")
    return builders.get(name, layer_step)(name, setup, generator)


def _row(name: str, kind: str, cache, step, timing: Timing, setup: CacheOpSetup) -> dict[str, object]:
    count = timing.count
    stored = stored_tokens(cache)
    row: dict[str, object] = {
        "cache": name,
        "kind": kind,
        "bounded": stored <= setup.capacity,
        "median_us": timing.median * 1e6,
        "p10_us": timing.p10 * 1e6,
        "p90_us": timing.p90 * 1e6,
        "cpu_us": timing.cpu_median * 1e6,
        "steps": timing.count,
        "stored": stored,
    }
    sizes = getattr(step, "sizes", None)
    if sizes is not None:
        timed = sizes[-count - 1 :]  # the length before the first timed update, then after each
        row["cpu_mean_us"] = timing.cpu_mean * 1e6
        row["evictions"] = sum(after <= before for before, after in pairwise(timed))
        row["avg_stored"] = sum(timed[1:]) / count
        row["peak_stored"] = max(timed[1:])
        row["bounded"] = row["peak_stored"] <= setup.capacity
    return row


CACHE_OP_COLUMNS: tuple[Column, ...] = (
    ("cache", "cache", ""),
    ("bounded", "bounded", ""),
    ("median_us", "median µs / update", ".0f"),
    ("p10_us", "p10 µs", ".0f"),
    ("p90_us", "p90 µs", ".0f"),
    ("vs_concat_sink", "× concat sink", ".3g"),
    ("vs_streaming", "× our streaming", ".3g"),
    ("cpu_us", "median CPU µs", ".0f"),
    ("cpu_vs_concat_sink", "CPU × concat sink", ".3g"),
    ("cpu_vs_streaming", "CPU × our streaming", ".3g"),
    ("cpu_vs_own_n1", "CPU × own N=1 (alternating)", ".3g"),
    ("cpu_mean_us", "mean CPU µs (amortised)", ".0f"),
    ("cpu_mean_vs_streaming", "mean CPU × our streaming", ".3g"),
    ("evictions", "evicting updates", "d"),
    ("avg_stored", "avg stored", ".1f"),
    ("peak_stored", "peak stored", "d"),
    ("stored", "stored tokens (end)", "d"),
)


def cache_op_table(rows: Sequence[dict[str, object]]) -> str:
    """The markdown table of ``run_cache_op`` rows."""
    return markdown_table(rows, CACHE_OP_COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcompress.bench.cache_op", description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(CACHE_OP_METHODS), help="comma-separated method names")
    parser.add_argument("--batch", type=int, default=CacheOpSetup.batch)
    parser.add_argument("--heads", type=int, default=CacheOpSetup.heads)
    parser.add_argument("--head-dim", type=int, default=CacheOpSetup.head_dim)
    parser.add_argument("--sinks", type=int, default=CacheOpSetup.sinks)
    parser.add_argument("--window", type=int, default=CacheOpSetup.window)
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed updates (default {CacheOpSetup.warmup})")
    parser.add_argument("--tokens", type=int, default=None, help=f"timed updates (default {CacheOpSetup.tokens})")
    parser.add_argument("--quick", action="store_true", help="small shapes for CI (batch 1, 8 heads, dim 64, 256)")
    parser.add_argument("--no-references", action="store_true", help="time only our methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for cache_op.json, cache_op.md")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else CacheOpSetup()
    shape = {
        name: getattr(args, name) if not args.quick else getattr(base, name)
        for name in ("batch", "heads", "head_dim", "window")
    }
    warmup = args.warmup if args.warmup is not None else base.warmup
    tokens = args.tokens if args.tokens is not None else base.tokens
    methods = [m for m in args.methods.split(",") if m]
    rows = run_cache_op(
        methods,
        **shape,
        sinks=args.sinks,
        warmup=warmup,
        tokens=tokens,
        references=not args.no_references,
        threads=args.threads,
        seed=args.seed,
    )
    meta = {
        "benchmark": "cache-op",
        **shape,
        "sinks": args.sinks,
        "warmup": warmup,
        "tokens": tokens,
        **environment(args.threads),
    }
    table = cache_op_table(rows)
    setup = (
        f"batch {shape['batch']}, {shape['heads']} heads, head dim {shape['head_dim']}, {args.sinks} sinks + "
        f"window {shape['window']}, fp32, {warmup} warm-up + {tokens} timed updates"
    )
    print(f"cache-op: {setup}; {meta['machine']}\n")
    print(table)
    if args.out is not None:
        from kvcompress.bench.plots import plot_cache_op

        save_outputs(args.out, "cache_op", rows, meta, table)
        plot_cache_op(rows, args.out / "cache_op.png", setup=setup, machine=str(meta["machine"]))


if __name__ == "__main__":
    main()
