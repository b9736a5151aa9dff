"""The speed benchmark's ``prefill`` section: a long prompt in chunks, each method against a ``DynamicCache``.

Every method's cache and a ``DynamicCache`` are fed the same chunks, chunk by chunk and interleaved (each side on
its own attention). One-shot methods (SnapKV, NaCl, ...) compress after the last chunk and that chunk's time includes
it, as ``kvcompress.generation.prefill(chunk_size=...)`` does. Peak memory comes from a child process
(``kvcompress.bench.prefill_peaks``: large allocations mapped one by one, so the resident set counts live tensors);
a model given as an object (tests) is measured in this process instead, without the mapping (``peaks_mapped``
False: the peaks then include heap fragmentation).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from functools import partial

import torch
from transformers import DynamicCache, PreTrainedModel

from kvcompress.bench.common import MIB, bench_cache, random_prompt
from kvcompress.bench.pairs import summary, timed, use_attention
from kvcompress.bench.prefill_peaks import measure_peaks, peaks_in_child
from kvcompress.bench.prompt_chunks import chunked_prefills
from kvcompress.core.attention import ATTENTION_NAME
from kvcompress.generation import cache_argument

Row = dict[str, object]


def prefill_rows(
    model: PreTrainedModel,
    methods: Sequence[str],
    prompt: int,
    budget: int,
    chunk: int,
    seed: int,
    source: dict[str, object] | None = None,
) -> list[Row]:
    """Chunk-by-chunk prefill of every method against a DynamicCache, then each one's peak memory (``source``:
    ``model``, ``device``, ``dtype``, ``random_weights``, ``threads`` to load the model again in a child process)."""
    ids = random_prompt(model, prompt, seed)
    caches = {m: bench_cache(model, m, budget) for m in methods}
    dynamic = DynamicCache(config=model.config)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    dynamic_times = []
    for start, run_chunk in chunked_prefills(model, ids, caches, chunk):
        use_attention(model, "sdpa")
        piece = ids[:, start : start + chunk]
        dynamic_times.append(timed(partial(_dynamic_chunk, model, piece, dynamic), model.device))
        use_attention(model, ATTENTION_NAME)
        for method in methods:
            times[method].append(timed(partial(run_chunk, method), model.device))
    stored = {method: max(cache.tokens_stored()) for method, cache in caches.items()}
    del caches, dynamic
    gc.collect()
    if source is not None:
        peaks = peaks_in_child(methods=methods, prompt=prompt, budget=budget, chunk=chunk, seed=seed, **source)
    else:
        peaks = {**measure_peaks(model, ids, methods, budget, chunk), "mapped": 0}
    whole = sum(t[1] for t in dynamic_times)
    one_pass = peaks["one_pass_dynamic"]
    return [
        {
            "section": "prefill",
            "method": method,
            "prompt": prompt,
            "budget": budget,
            "chunk": chunk,
            **summary(times[method], dynamic_times),
            "whole_cpu_ratio": sum(t[1] for t in times[method]) / whole,  # the one-shot compression included
            "stored_tokens": stored[method],
            "peak_mib": peaks[method] / MIB,
            "one_pass_dynamic_peak_mib": one_pass / MIB,
            "peak_ratio": peaks[method] / max(one_pass, 1),
            "peaks_mapped": bool(peaks["mapped"]),
        }
        for method in methods
    ]


def _dynamic_chunk(model: PreTrainedModel, piece: torch.Tensor, dynamic: DynamicCache) -> None:
    model(input_ids=piece, **cache_argument(model, dynamic), logits_to_keep=1)
