"""One timed step of each cache in the cache-op benchmark: our layers driven by hand, and the references."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvcompress.bench.common import DECODE_TIME_METHODS, Timing, check_int
from kvcompress.bench.sink_references import CircularSinkCache, ConcatSinkCache
from kvcompress.core.attention import attend_layer
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.layer import CompressedLayer
from kvcompress.methods.buzz import BuzzPolicy
from kvcompress.registry import make_config

CASCADES = {"cascade": 4, "cascade N=1": 1}  # N = 4 (paper's Tab. 4 row, scores included); N = 1: our circular sink
# the same layers' decoding step as a model runs it: the new token with its query and RoPE position, so the step takes
# the path decoding takes (insertion, attention over the rings and the EMA are done together there); the other rows
# time ``update`` + ``after_attention`` without a query, which the rings serve by their per-token tensor path
DECODE_STEPS = {"cascade (decode step)": 4, "cascade N=1 (decode step)": 1}
_AFTER_SCORED = DECODE_TIME_METHODS.index("scissorhands") + 1  # the one-shot snapkv is listed after the scored ones
CACHE_OP_METHODS: tuple[str, ...] = (
    *DECODE_TIME_METHODS[:_AFTER_SCORED],
    "snapkv",
    *DECODE_TIME_METHODS[_AFTER_SCORED:],
    *CASCADES,
    *DECODE_STEPS,
)
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
            check_int(getattr(self, name), name)
        for name in ("sinks", "warmup"):
            check_int(getattr(self, name), name, 0)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def random(self, tokens: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.batch, self.heads, tokens, self.head_dim, generator=generator).to(self.dtype)


QUICK = CacheOpSetup(batch=1, heads=8, head_dim=64, window=256, warmup=10, tokens=100)


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
        stats.last = torch.randn(*shape, 1, length, generator=generator).softmax(-1)  # sees every key (no mask)
    return stats


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def layer_step(
    method: str, setup: CacheOpSetup, generator: torch.Generator, positioned: bool = False, **overrides: object
):
    """A filled ``CompressedLayer`` and the function doing one timed update on it (``overrides``: config params)."""
    policy = make_config(method, **{**method_params(method, setup), **overrides}).policy(0)
    layer = CompressedLayer(policy, inv_freq(setup.head_dim))
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
    sizes = [layer.stored_length()]  # stored length before the first update, then after each

    def step(i: int) -> None:
        slot = i % _POOL
        layer.update(keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
        if positioned:
            layer.register_new_tokens(None, None)
            layer.positioned(query, layer.keys)
        layer.after_attention(cut(stats, layer.keys.shape[-2]))  # statistics over the slots attention sees
        sizes.append(layer.stored_length())

    step.sizes = sizes
    return layer, step


def cascade_step(method: str, setup: CacheOpSetup, generator: torch.Generator):
    """A cascade layer (``S`` sinks + ``|C| = window`` in ``N`` circular sub-caches) in steady state and one update:
    ``update`` + ``after_attention`` with post-softmax rows over its ``S + |C|`` slots (for ``N > 1`` the EMA with
    its head reduction is part of the update; ``N = 1`` never reads scores). Filled with ``S + span`` tokens, as
    the v1 fill rule fills the deeper cascades only after about ``span`` tokens."""
    config = make_config("cascade", budget=setup.capacity, sinks=setup.sinks, cascades=CASCADES[method])
    policy = config.policy(0)
    layer = config.layer_class()(policy, inv_freq(setup.head_dim))
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


def cascade_decode_step(method: str, setup: CacheOpSetup, generator: torch.Generator):
    """A cascade layer filled as in ``cascade_step`` and one decoding step of it: ``update``, then the attention
    function's step (RoPE positions recorded, the query attends over the rings, the EMA folds its attention)."""
    config = make_config("cascade", budget=setup.capacity, sinks=setup.sinks, cascades=DECODE_STEPS[method])
    layer = config.layer_class()(config.policy(0), inv_freq(setup.head_dim))
    fill = setup.random(setup.sinks + config.span, generator)
    layer.update(fill, fill.clone())
    layer.after_attention(None)
    keys, values, queries = (setup.random(_POOL, generator) for _ in range(3))
    sizes = [layer.stored_length()]

    def step(i: int) -> None:
        slot = i % _POOL
        position = torch.tensor([[layer.seen]])
        stored_keys, stored_values = layer.update(keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
        attend_layer(layer, queries[:, :, slot : slot + 1], stored_keys, stored_values, None, position, None)
        sizes.append(layer.stored_length())

    step.sizes = sizes
    return layer, step


def cut(stats: AttentionStats | None, length: int) -> AttentionStats | None:
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
    return cut


def reference_step(name: str, setup: CacheOpSetup, generator: torch.Generator):
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


def stored_tokens(cache: object) -> int:
    if isinstance(cache, CompressedLayer):
        return cache.stored_length()
    if isinstance(cache, DynamicCache):
        return cache.get_seq_length()
    return int(cache.keys.shape[-2]) if cache.keys is not None else 0
