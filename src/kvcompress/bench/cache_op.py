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
- ``streaming + positioned()``: our ``streaming`` update plus the attention-side work its re-indexed positions cost
  every step (``register_new_tokens`` + ``positioned``, which re-rotates every stored key), for comparison;
- ``buzz`` evicts in bursts (once per cycle of ``T - a' + 1`` updates, ``a'`` = middle length after an eviction), so
  its median update is the cheap non-evicting one: it is timed over whole eviction cycles (from just after an
  eviction to an eviction, at least ``tokens`` updates; ``time_whole_cycles``) and rows carry the mean CPU per update
  (``cpu_mean_us``, the amortised cost), the number of evicting updates, and the average and peak stored length.
  ``buzz`` is sized by its *peak* (``budget_kind="peak"``: ``k + w + T = sinks + window``, never more than the
  fixed-size caches store); ``buzz (average budget)`` is sized by its steady-state *average* (the paper's notion of
  cache budget), whose peak is about 1.4x that.

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
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from transformers import DynamicCache

from kvcompress.bench.common import Timing, environment, set_threads, time_calls
from kvcompress.bench.table import Column, markdown_table, save_outputs
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.layer import CompressedLayer
from kvcompress.registry import make_config

CACHE_OP_METHODS: tuple[str, ...] = (
    "full",
    "window",
    "streaming",
    "h2o",
    "tova",
    "scissorhands",
    "snapkv",
    "random",
    "knorm",
    "buzz",
    "cascade",
    "cascade N=1",
)
CASCADES = {"cascade": 4, "cascade N=1": 1}  # N = 4 (paper's Tab. 4 row, scores included); N = 1: our circular sink
CONCAT_SINK = "concat sink (reference)"
CIRCULAR_SINK = "circular sink (reference)"
DYNAMIC = "DynamicCache (transformers)"
STREAMING_POSITIONED = "streaming + positioned()"
BUZZ_AVERAGE = "buzz (average budget)"
_POOL = 16  # distinct new tokens, reused in turn (a fresh random token per step would time the RNG too)


@dataclass(frozen=True)
class CacheOpSetup:
    """Shapes and counts of the ``cache-op`` benchmark; the defaults are the paper's shapes."""

    batch: int = 8
    heads: int = 32
    head_dim: int = 128
    sinks: int = 4
    window: int = 1024
    warmup: int = 8
    tokens: int = 64
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "head_dim", "window", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("sinks", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def random(self, tokens: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.batch, self.heads, tokens, self.head_dim, generator=generator).to(self.dtype)


QUICK = CacheOpSetup(batch=1, heads=8, head_dim=64, window=256, warmup=10, tokens=100)


# --- references --------------------------------------------------------------------------------------------------


class ConcatSinkCache:
    """The usual sink cache: concatenate the new tokens, then cut out the oldest non-sink ones by concatenation.

    Keeps the first ``sinks`` tokens and the last ``window`` tokens, in stream order (StreamingLLM's
    ``StartRecentKVCache`` evicting after the append; stored keys are not re-rotated).
    """

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        if self.keys.shape[-2] > self.sinks + self.window:
            sinks, recent = self.sinks, -self.window
            self.keys = torch.cat([self.keys[:, :, :sinks], self.keys[:, :, recent:]], dim=-2)
            self.values = torch.cat([self.values[:, :, :sinks], self.values[:, :, recent:]], dim=-2)
        return self.keys, self.values


class CircularSinkCache:
    """A sink cache in a buffer of ``sinks + window`` slots allocated once; a new token overwrites the oldest slot.

    Slot order is not stream order once the window wraps (attention does not care, given correct positions).
    ``update`` returns the occupied slots.
    """

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks, self.window = sinks, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.seen = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            shape = (*keys.shape[:2], self.sinks + self.window, keys.shape[-1])
            self.keys = keys.new_empty(shape)
            self.values = values.new_empty(shape)
        for i in range(keys.shape[-2]):  # one slot per token; decoding writes one
            self.keys[:, :, self._slot(self.seen)] = keys[:, :, i]
            self.values[:, :, self._slot(self.seen)] = values[:, :, i]
            self.seen += 1
        stored = min(self.seen, self.sinks + self.window)
        return self.keys[:, :, :stored], self.values[:, :, :stored]

    def _slot(self, token: int) -> int:
        if token < self.sinks:
            return token
        return self.sinks + (token - self.sinks) % self.window


# --- our layers ----------------------------------------------------------------------------------------------


def method_params(method: str, setup: CacheOpSetup) -> dict[str, object]:
    """The parameters each method runs with: a budget of ``sinks + window`` tokens (``full`` has none)."""
    if method == "full":
        return {}
    if method == "streaming":
        return {"budget": setup.capacity, "sinks": setup.sinks}
    if method == "snapkv":  # its observation window (32 by default) must fit in the budget
        return {"budget": setup.capacity, "window": min(32, setup.capacity)}
    if method == "buzz":  # peak-sized: never stores more than the fixed-size caches (BUZZ_AVERAGE: average-sized)
        return {"budget": setup.capacity, "budget_kind": "peak"}
    return {"budget": setup.capacity}


def evicts_in_bursts(cache: object) -> bool:
    """Whether ``cache`` is a layer of a method that evicts once per cycle (BUZZ) rather than every update."""
    from kvcompress.methods.buzz import BuzzPolicy

    return isinstance(cache, CompressedLayer) and isinstance(cache.policy, BuzzPolicy)


def time_whole_cycles(step: Callable[[int], None], sizes: list[int], tokens: int, warmup: int) -> Timing:
    """Time whole eviction cycles of a bursty method: untimed updates until at least ``warmup`` have run and the
    last one evicted, then timed updates until at least ``tokens`` have run and the last one evicted (``sizes``:
    the stored length after each update, appended by ``step``). The mean is then the amortised cost per update."""
    i = 0
    limit = 1_000_000  # a cycle is T - a' + 1 updates; a layer that never evicts is a bug, not a long cycle
    while i < warmup or sizes[-1] > sizes[-2]:
        step(i)
        i += 1
        if i > limit:
            raise RuntimeError("no eviction within a million updates")
    samples, cpu_samples = [], []
    while len(samples) < tokens or sizes[-1] > sizes[-2]:
        cpu_start, start = time.process_time(), time.perf_counter()
        step(i)
        samples.append(time.perf_counter() - start)
        cpu_samples.append(time.process_time() - cpu_start)
        i += 1
        if len(samples) > limit:
            raise RuntimeError("no eviction within a million updates")
    return Timing.of(samples, cpu_samples)


def synthetic_stats(
    request: StatsRequest,
    setup: CacheOpSetup,
    length: int,
    query_count: int,
    generator: torch.Generator,
) -> AttentionStats | None:
    """Attention statistics of the shapes ``request`` asks for over ``length`` keys: softmaxes of random logits.

    One query head per KV head (``G = 1``) and one attention row (``n = 1``) for ``last``, whatever
    ``query_count`` is: only the shapes matter for timing.
    """
    if not request.any:
        return None
    stats = AttentionStats(query_count=query_count)
    shape = (setup.batch, setup.heads, 1)
    if request.received:
        stats.received = torch.randn(*shape, length, generator=generator).softmax(-1)
    if request.last_queries:
        stats.last = torch.randn(*shape, 1, length, generator=generator).softmax(-1)
        stats.last_visible = torch.ones(setup.batch, 1, 1, length, dtype=torch.bool)
    return stats


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _layer_step(
    method: str, setup: CacheOpSetup, generator: torch.Generator, positioned: bool = False, **overrides: object
):
    """A filled ``CompressedLayer`` and the function doing one timed update on it (``overrides``: config params)."""
    policy = make_config(method, **{**method_params(method, setup), **overrides}).policy(0)
    layer = CompressedLayer(policy, _inv_freq(setup.head_dim))
    fill = setup.random(setup.capacity, generator)
    layer.update(fill, fill.clone())
    layer.after_attention(synthetic_stats(policy.stats, setup, setup.capacity, setup.capacity, generator))
    # in steady state a bounded layer attends over capacity + 1 keys before evicting back to capacity
    # (a layer whose stored length varies, BUZZ, gets views of them cut to its current length: at most k + w + T + 1)
    longest = setup.capacity + 1
    if hasattr(policy, "threshold"):
        longest = max(longest, policy.sinks + policy.window + policy.threshold + 1)
    stats = synthetic_stats(policy.stats, setup, longest, 1, generator)
    keys, values = setup.random(_POOL, generator), setup.random(_POOL, generator)
    query = setup.random(1, generator)
    sizes = [layer.keys.shape[-2]]  # stored length before the first update, then after each (a shape read)

    def step(i: int) -> None:
        slot = i % _POOL
        layer.update(keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
        if positioned:
            layer.register_new_tokens(None, None)
            layer.positioned(query, layer.keys)
        layer.after_attention(_cut(stats, layer.keys.shape[-2]))
        sizes.append(layer.keys.shape[-2])

    step.sizes = sizes
    return layer, step


def _cascade_step(method: str, setup: CacheOpSetup, generator: torch.Generator):
    """A cascade layer (``S`` sinks + ``|C| = window`` in ``N`` circular sub-caches) in steady state and one update:
    ``update`` + ``after_attention`` with post-softmax rows over its ``S + |C|`` slots (for ``N > 1`` the EMA with
    its head reduction is part of the update; ``N = 1`` never reads scores). Filled with ``S + span`` tokens, as
    the v1 fill rule fills the deeper cascades only after about ``span`` tokens."""
    config = make_config("cascade", budget=setup.capacity, sinks=setup.sinks, cascades=CASCADES[method])
    policy = config.policy(0)
    layer = config.layer_class()(policy, _inv_freq(setup.head_dim))
    fill = setup.random(setup.sinks + config.span, generator)
    layer.update(fill, fill.clone())
    layer.after_attention(None)
    received = torch.randn(setup.batch, setup.heads, 1, setup.capacity, generator=generator).softmax(-1)
    stats = AttentionStats(query_count=1, received=received) if policy.needs_scores else None
    keys, values = setup.random(_POOL, generator), setup.random(_POOL, generator)
    sizes = [layer.stored_length()]

    def step(i: int) -> None:
        slot = i % _POOL
        layer.update(keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
        layer.after_attention(stats)
        sizes.append(layer.stored_length())

    step.sizes = sizes
    return layer, step


def _cut(stats: AttentionStats | None, length: int) -> AttentionStats | None:
    """``stats`` over the first ``length`` keys (a view; a no-op for fixed-size caches, built at their length)."""
    if stats is None:
        return None
    full = stats.received if stats.received is not None else stats.last
    if full is None or full.shape[-1] == length:
        return stats
    cut = AttentionStats(query_count=stats.query_count)
    if stats.received is not None:
        cut.received = stats.received[..., :length]
    if stats.last is not None:
        cut.last = stats.last[..., :length]
        cut.last_visible = stats.last_visible[..., :length]
    return cut


def _reference_step(name: str, setup: CacheOpSetup, generator: torch.Generator):
    if name == CONCAT_SINK:
        cache = ConcatSinkCache(setup.sinks, setup.window)
        update = cache.update
    elif name == CIRCULAR_SINK:
        cache = CircularSinkCache(setup.sinks, setup.window)
        update = cache.update
    elif name == DYNAMIC:
        cache = DynamicCache()

        def update(k: torch.Tensor, v: torch.Tensor) -> None:
            cache.update(k, v, 0)

    else:
        raise ValueError(f"unknown reference {name!r}")
    fill = setup.random(setup.capacity, generator)
    update(fill, fill.clone())
    keys, values = setup.random(_POOL, generator), setup.random(_POOL, generator)

    def step(i: int) -> None:
        slot = i % _POOL
        update(keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])

    return cache, step


def _stored(cache: object) -> int:
    if isinstance(cache, CompressedLayer):
        return cache.stored_length()
    if isinstance(cache, DynamicCache):
        return cache.get_seq_length()
    return int(cache.keys.shape[-2]) if cache.keys is not None else 0


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
    its ``steps`` is at least ``tokens``.
    """
    set_threads(threads)
    setup = CacheOpSetup(batch, heads, head_dim, sinks, window, warmup, tokens)
    unknown = sorted(set(methods) - set(CACHE_OP_METHODS))
    if unknown:
        raise ValueError(f"methods must be among {', '.join(CACHE_OP_METHODS)}; got {', '.join(unknown)}")
    plan: list[tuple[str, str, Callable]] = []
    if references:
        plan += [(name, "reference", _reference_step) for name in (CONCAT_SINK, CIRCULAR_SINK)]
        plan.append((DYNAMIC, "transformers", _reference_step))
    plan += [(method, "kvcompress", _cascade_step if method in CASCADES else _layer_step) for method in methods]
    if "streaming" in methods:
        plan.append((STREAMING_POSITIONED, "kvcompress", _layer_step))
    if "buzz" in methods:
        plan.append((BUZZ_AVERAGE, "kvcompress", _layer_step))

    rows = []
    with torch.inference_mode():
        for name, kind, build in plan:
            generator = torch.Generator().manual_seed(seed)
            if name == STREAMING_POSITIONED:
                cache, step = build("streaming", setup, generator, positioned=True)
            elif name == BUZZ_AVERAGE:
                cache, step = build("buzz", setup, generator, budget_kind="average")
            else:
                cache, step = build(name, setup, generator)
            if evicts_in_bursts(cache):
                timing: Timing = time_whole_cycles(step, step.sizes, setup.tokens, setup.warmup)
            else:
                timing = time_calls(step, setup.tokens, setup.warmup)
            count = timing.count
            stored = _stored(cache)
            row = {
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
            rows.append(row)
            del cache, step
            gc.collect()
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
