"""A prompt fed to several caches chunk by chunk, as ``kvcompress.generation.prefill(chunk_size=...)`` feeds it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext

import torch
from transformers import PreTrainedModel

from kvcompress.generation import prefill


def chunked_prefills(
    model: PreTrainedModel, ids: torch.Tensor, caches: dict, chunk: int
) -> Iterator[tuple[int, Callable[[str], None]]]:
    """``(start, run_chunk)`` for each chunk of ``ids``: ``run_chunk(method)`` feeds that chunk to
    ``caches[method]`` (more prompt follows every chunk but the last; a one-shot method compresses after the last)."""
    prompt = ids.shape[1]
    deferred = {m: ExitStack() for m in caches}
    for method, cache in caches.items():
        deferred[method].enter_context(cache.deferred_compression())
    mask = torch.ones_like(ids)
    for start in range(0, prompt, chunk):
        piece, last = ids[:, start : start + chunk], start + chunk >= prompt

        def run_chunk(method: str, piece=piece, start=start, last=last) -> None:
            cache = caches[method]
            with nullcontext() if last else cache.more_prompt():
                prefill(model, piece, cache, attention_mask=mask[:, : start + piece.shape[1]], chunk_size=chunk)
            if last:
                deferred[method].close()

        yield start, run_chunk
