"""Feeding tokens through a compressed cache: chunked prefill and streaming next-token loss.

``model.generate(ids, past_key_values=cache)`` (``cache=cache`` from transformers 5.24) needs nothing from here.
These helpers cover what ``generate`` does not: a prefill in chunks with eviction between them (peak memory
bounded by chunk + budget for methods that evict as they go; one-shot methods compress once at the end), the
token-by-token (or chunk-by-chunk) loss along a long stream used by streaming perplexity, and ``cache_argument``,
the keyword the installed transformers takes a cache by.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext

import torch
from rich.progress import track
from torch.nn import functional as F
from transformers import Cache, PreTrainedModel

from kvcompress.core.cache import CompressedCache


def cache_argument(model: PreTrainedModel, cache: Cache) -> dict[str, Cache]:
    """The keyword that hands ``cache`` to ``model`` and its ``generate``: ``cache`` where the installed
    transformers takes it (5.24 deprecates ``past_key_values``), else ``past_key_values``. Use as
    ``model(ids, **cache_argument(model, cache))``; the answer is looked up once per model class."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch, as ``generate`` computes them (padding at position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_input_ids(input_ids: object, least: int = 1) -> None:
    """``input_ids`` must be a ``[batch, tokens]`` integer tensor of at least ``least`` tokens (``ValueError``)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        found = f"a tensor of shape {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else "not a tensor"
        raise ValueError(f"input_ids must be an integer tensor [batch, tokens]; got {found}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] < least:
        raise ValueError(
            f"input_ids must hold at least {least} token{'s' if least > 1 else ''} per sequence; got shape "
            f"{list(input_ids.shape)}"
        )


def check_attention_mask(attention_mask: torch.Tensor, batch: int, total: int, seen: int) -> None:
    """A ``[batch, total]`` mask: the tokens the cache has ``seen`` and the new ones (``ValueError`` otherwise)."""
    if tuple(attention_mask.shape) != (batch, total):
        earlier = f" ({seen} the cache has seen + {total - seen} new)" if seen else ""
        shape = list(attention_mask.shape)
        raise ValueError(f"attention_mask must have shape [batch, tokens] = [{batch}, {total}]{earlier}; got {shape}")


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an integer >= 1 or None (one pass), got {chunk_size!r}")


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: CompressedCache,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Run the prompt through the model into ``cache`` and return the last position's logits ``[B, vocab]``.

    ``chunk_size`` splits the prompt into forwards of that many tokens; methods that evict as they go do so
    between chunks, one-shot methods (SnapKV, NaCl) compress once after the last chunk. In one forward a one-shot
    method compresses each layer right after that layer's attention (as NaCl's paper does), so the full prompt's
    keys never sit in every layer at once. The remainder goes in
    the first chunk, so the last chunk is always full and an observation window of up to ``chunk_size`` prompt
    tokens lies inside it. The cache may already hold earlier tokens (then ``attention_mask`` covers them too).
    A method that compresses with more passes of the model over the prompt (KVzip) runs them before returning.
    """
    _check_chunk_size(chunk_size)
    check_input_ids(input_ids)
    seen = cache.get_seq_length()
    total = seen + input_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones(input_ids.shape[0], total, dtype=torch.long, device=input_ids.device)
    check_attention_mask(attention_mask, input_ids.shape[0], total, seen)
    positions = positions_from_mask(attention_mask)
    length = input_ids.shape[1]
    step = chunk_size or length
    bounds = [0, *range(length % step or step, length + 1, step)]
    logits = None
    several_chunks = len(bounds) > 2
    with cache.deferred_compression() if several_chunks else nullcontext():
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            with cache.more_prompt() if stop < length else nullcontext():  # (SnapKV's window: the last chunk)
                out = model(
                    input_ids=input_ids[:, start:stop],
                    attention_mask=attention_mask[:, : seen + stop],
                    position_ids=positions[:, seen + start : seen + stop],
                    **cache_argument(model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits = out.logits[:, -1]
    if isinstance(cache, CompressedCache):  # a method compressing with more passes over the prompt (KVzip)
        cache.config.after_prefill(model, cache, input_ids, attention_mask)
    return logits


@torch.no_grad()
def stream_nll(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: CompressedCache,
    chunk_size: int = 1,
    progress: bool = False,
) -> torch.Tensor:
    """Negative log-likelihood of every next token of one stream (``[1, T]`` ids) fed through ``cache``.

    Tokens are fed ``chunk_size`` at a time (1 = token by token, what the papers did); the cache evicts after
    every forward. Returns ``[T - 1]`` float32 losses: entry ``t`` is ``-log p(x[t+1] | x[..t])``.
    """
    _check_chunk_size(chunk_size)
    check_input_ids(input_ids, least=2)  # (the first token has no loss: one token gives nothing to score)
    if input_ids.shape[0] != 1:
        raise ValueError(f"stream_nll takes one stream (input_ids of shape [1, T]); got batch {input_ids.shape[0]}")
    length = input_ids.shape[1]
    losses = torch.empty(length - 1)
    starts = range(0, length - 1, chunk_size)
    if progress:
        starts = track(starts, description=f"stream ({length} tokens)", transient=True)
    for start in starts:
        stop = min(start + chunk_size, length - 1)
        logits = model(input_ids=input_ids[:, start:stop], use_cache=True, **cache_argument(model, cache)).logits[0]
        targets = input_ids[0, start + 1 : stop + 1]
        losses[start:stop] = F.cross_entropy(logits.float(), targets, reduction="none").cpu()
    return losses
