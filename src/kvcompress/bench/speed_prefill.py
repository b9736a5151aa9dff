"""The speed benchmark's ``prefill`` section: a long prompt in chunks, each method against a ``DynamicCache``.

Every method's cache and a ``DynamicCache`` are fed the same chunks, chunk by chunk and interleaved (each side on
its own attention). One-shot methods (SnapKV, NaCl, ...) compress after the last chunk and that chunk's time includes
it, as ``kvcompress.generation.prefill(chunk_size=...)`` does. Peak memory of a method's prefill is the resident-set
growth of each chunk plus what its cache had allocated before it, against a one-pass ``DynamicCache`` prefill. Large
allocations are mapped one by one from the start of the section (``map_large_allocations``: the resident set then
counts live tensors, not heap fragmentation), so the speed benchmark runs this section last.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel

from kvcompress.bench.common import (
    MIB,
    PeakMemory,
    bench_cache,
    current_rss,
    map_large_allocations,
    peak_rss,
    random_prompt,
    reset_peak_rss,
)
from kvcompress.bench.pairs import summary, timed, use_attention
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument, prefill

Row = dict[str, object]


def prefill_rows(
    model: PreTrainedModel, methods: Sequence[str], prompt: int, budget: int, chunk: int, seed: int
) -> list[Row]:
    """Chunk-by-chunk prefill of every method against a DynamicCache, and each one's peak memory."""
    ids = random_prompt(model, prompt, seed)
    mapped = map_large_allocations()
    use_attention(model, "sdpa")
    with PeakMemory() as one_pass:
        fresh = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_argument(model, fresh), use_cache=True, logits_to_keep=1)
    gc.collect()
    caches = {m: bench_cache(model, m, budget) for m in methods}
    deferred = {m: ExitStack() for m in methods}  # one-shot methods compress after the last chunk, as prefill() does
    for method, cache in caches.items():
        deferred[method].enter_context(cache.deferred_compression())
    dynamic = DynamicCache(config=model.config)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    dynamic_times, peaks = [], dict.fromkeys(methods, 0)
    mask = torch.ones_like(ids)
    for start in range(0, prompt, chunk):
        piece, last = ids[:, start : start + chunk], start + chunk >= prompt
        use_attention(model, "sdpa")
        dynamic_times.append(
            timed(
                lambda piece=piece: model(input_ids=piece, **cache_argument(model, dynamic), logits_to_keep=1),
                model.device,
            )
        )
        use_attention(model, ATTENTION_NAME)
        for method, cache in caches.items():
            held = sum(layer.allocated_nbytes() for layer in cache.layers)
            reset_peak_rss()
            before = current_rss()

            def forward(piece=piece, cache=cache, start=start, method=method, last=last) -> None:
                with nullcontext() if last else cache.more_prompt():  # as ``prefill(chunk_size=...)`` feeds them
                    prefill(model, piece, cache, attention_mask=mask[:, : start + piece.shape[1]], chunk_size=chunk)
                if last:
                    deferred[method].close()

            times[method].append(timed(forward, model.device))
            peaks[method] = max(peaks[method], held + peak_rss() - before)
    one_pass_peak = max(one_pass.extra, 1)
    whole = sum(t[1] for t in dynamic_times)
    return [
        {
            "section": "prefill",
            "method": method,
            "prompt": prompt,
            "budget": budget,
            "chunk": chunk,
            **summary(times[method], dynamic_times),
            "whole_cpu_ratio": sum(t[1] for t in times[method]) / whole,  # the one-shot compression included
            "stored_tokens": max(caches[method].tokens_stored()),
            "peak_mib": peaks[method] / MIB,
            "one_pass_dynamic_peak_mib": one_pass.extra / MIB,
            "peak_ratio": peaks[method] / one_pass_peak,
            "large_allocations_mapped": mapped,
        }
        for method in methods
    ]
