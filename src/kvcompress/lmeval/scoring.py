"""Log-likelihood of continuations through a compressed cache: what lm-eval's ``loglikelihood`` requests need.

For each request (context tokens, continuation tokens) the model sees the context and all but the last
continuation token, as in lm-eval's ``hf`` model. Here they go through a fresh compressed cache in two phases:

1. the context except its last token is prefilled in chunks of ``chunk_size`` (``kvcompress.generation.prefill``:
   evicting methods evict between chunks, one-shot methods compress once after the last chunk);
2. the scored part (the last context token, then the continuation but its last token) is fed ``chunk_size`` tokens
   per forward; each forward attends to the compressed cache plus its own tokens, and the cache evicts after it.
   The log-probability of every continuation token is read from these forwards.

A batch is left-padded in phase 1 (contexts end together) and right-padded in phase 2; right padding comes after
every real token of its row, so it changes no real token's logits. Chunk boundaries in phase 1 count from the
padded length, so an evicting method's scores can depend on the batch composition; ``batch_size=1`` makes every
request independent of the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

from kvcompress.core.cache import CompressedCache
from kvcompress.generation import cache_argument, positions_from_mask, prefill


@dataclass(frozen=True)
class Scored:
    """One request's answer: summed log-probability, whether greedy decoding gives the continuation, KV bytes."""

    logprob: float
    greedy: bool
    kv_bytes: int  # stored KV bytes of this row after scoring (the batch's cache bytes / batch size)


def split_request(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], list[int]]:
    """``(prefix, scored)`` token lists: what phase 1 prefills and what phase 2 feeds (lm-eval's left truncation)."""
    if not continuation:
        raise ValueError("continuation must hold at least one token")
    if len(continuation) > max_length:
        raise ValueError(f"continuation of {len(continuation)} tokens is longer than max_length={max_length}")
    tokens = [*context, *continuation][-(max_length + 1) :]
    inputs = tokens[:-1]
    cut = len(inputs) - len(continuation)
    return inputs[:cut], inputs[cut:]


@torch.no_grad()
def score_batch(
    model: PreTrainedModel,
    make_cache: Callable[[], CompressedCache],
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_length: int,
    chunk_size: int | None,
    pad_id: int = 0,
) -> list[Scored]:
    """Score ``(context, continuation)`` token lists in one batch through one fresh cache from ``make_cache``."""
    splits = [split_request(ctx, cont, max_length) for ctx, cont in requests]
    width = max(len(prefix) for prefix, _ in splits)
    length = max(len(scored) for _, scored in splits)
    rows, masks = [], []
    for prefix, scored in splits:
        pad_left, pad_right = width - len(prefix), length - len(scored)
        rows.append([pad_id] * pad_left + prefix + scored + [pad_id] * pad_right)
        masks.append([0] * pad_left + [1] * (len(prefix) + length))
    device = model.device
    ids = torch.tensor(rows, device=device)
    mask = torch.tensor(masks, device=device)
    cache = make_cache()
    if width:
        prefill(model, ids[:, :width], cache, mask[:, :width], chunk_size)
    targets = torch.tensor([list(cont) + [pad_id] * (length - len(cont)) for _, cont in requests], device=device)
    picked, greedy = _score(model, ids, mask, targets, cache, chunk_size)
    per_row = cache.nbytes() // len(requests)
    answers = []
    for row, (_, cont) in enumerate(requests):
        n = len(cont)
        answers.append(Scored(float(picked[row, :n].sum()), bool((greedy[row, :n] == targets[row, :n]).all()), per_row))
    return answers


def _score(model, ids, mask, targets, cache, chunk_size):
    """Phase 2: log-probability of each target and the greedy token at every scored position (``[B, n]`` each)."""
    positions = positions_from_mask(mask)
    total = ids.shape[1]
    width = total - targets.shape[1]
    step = chunk_size or total - width
    logprobs, greedy = [], []
    for start in range(width, total, step):
        stop = min(start + step, total)
        logits = model(
            input_ids=ids[:, start:stop],
            attention_mask=mask[:, :stop],
            position_ids=positions[:, start:stop],
            **cache_argument(model, cache),
            use_cache=True,
        ).logits
        chunk = F.log_softmax(logits.float(), dim=-1)
        logprobs.append(chunk.gather(-1, targets[:, start - width : stop - width, None]).squeeze(-1))
        greedy.append(chunk.argmax(dim=-1))
    return torch.cat(logprobs, dim=1), torch.cat(greedy, dim=1)
