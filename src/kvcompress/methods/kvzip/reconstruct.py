"""KVzip's reconstruction passes, their scores, and the eviction they decide (see ``kvcompress.methods.kvzip``)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AutoTokenizer

from kvcompress.core.contract import KeepMask
from kvcompress.core.sdpa import attention_after_past
from kvcompress.core.selection import keep_top
from kvcompress.methods.allocation import heads_share, places
from kvcompress.methods.oneshot import kept_per_sequence

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk repeated after a later chunk's prompt
QUERY_BLOCK = 256  # reconstruction queries whose logits are computed at once


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"kvzip needs the model's tokenizer to write its reconstruction prompt and found none at {path!r}; "
            "pass tokenizer=<folder of the tokenizer>"
        ) from error


def prompt_ids(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the first chunk's prompt, a later chunk's prompt, and the assistant header after them."""
    if tokenizer.chat_template is None:
        suffix = "\n"
    else:  # the text the template puts after a user turn, found around a marker as kvpress does
        marker = "dummy context"
        separator = "\n" + "#" * len(marker)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        suffix = text.split(separator)[1]
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    return encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(suffix)


def reconstruction_chunks(
    context: torch.Tensor, tokenizer, chunk_size: int, prefix: int = 0
) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, ids)`` per chunk of ``context[:, prefix:]``: the context span ``[start, end)`` and the
    reconstruction ids ``[B, q]``."""
    first, later, suffix = prompt_ids(tokenizer)
    chunks, length = [], context.shape[1]
    for start in range(prefix, length, chunk_size):
        end = min(length, start + chunk_size)
        prompt = first if start == prefix else later
        lead = torch.tensor(prompt, dtype=context.dtype, device=context.device).expand(context.shape[0], -1)
        parts = [lead]
        if start > prefix:  # the previous chunk's last tokens
            parts.append(context[:, start - min(OVERLAP, chunk_size) : start])
        parts += [torch.tensor(suffix, dtype=context.dtype, device=context.device).expand(context.shape[0], -1)]
        chunks.append((start, end, torch.cat([*parts, context[:, start:end]], dim=1)))
    return chunks


def score_chunk(
    policy,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    own_key: torch.Tensor,
    own_value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """One reconstruction forward's attention, and its scores folded into ``policy.scores``; ``[B, H_q, q, d]``.

    ``key``/``value`` are the stored context's (every token visible to every reconstruction query), ``own_key``/
    ``own_value`` the forward's own (``[B, H_kv, q, d]``, seen causally; never stored: ``kvzip.layer``). The score
    of a context token of the chunk is the largest probability any query of its KV head's group gives it under a
    softmax over the first ``sinks`` context tokens, the chunk's own context tokens and the reconstruction tokens
    (kvpress's subsample). When those are every context token (one chunk covering the context, no prefix) that
    softmax is the attention's own, and its log-normaliser comes with the attention output from one fused pass
    (``attention_after_past``); the scores then need only the logits of the context columns. Otherwise the
    log-normaliser is taken over the subsampled columns' logits. Since ``exp`` is increasing, the largest
    probability is ``exp`` of the largest logit minus its row's log-normaliser: one ``exp`` per token, not per
    logit. Logits in float32, ``QUERY_BLOCK`` queries at a time (the peak is a block's logits)."""
    length, start, end, sinks = policy.scoring
    batch, query_heads, count, dim = query.shape
    heads = key.shape[1]
    groups = query_heads // heads
    device = key.device
    scale = dim**-0.5 if scaling is None else scaling
    whole = sinks == 0 and start == 0 and end == length
    output, lse = attention_after_past(query, key, value, own_key, own_value, scale)
    if whole:  # one more channel: ones under the keys, the row's -lse beside the query, so the matmul subtracts it
        keys = torch.cat([key.float(), key.new_ones(*key.shape[:-1], 1, dtype=torch.float32)], dim=-1)
    else:  # the subsample the softmax runs over: the sinks, the chunk's context tokens, the reconstruction's own
        keys = torch.cat([key[:, :, :sinks], key[:, :, start:end], own_key], dim=2).float()
        visible = sinks + end - start  # columns every query sees; the own columns after them causally
        own_columns = torch.arange(count, device=device)
    keys = keys.transpose(-1, -2)  # [B, H, d (+1), c]
    best = None
    for row in range(0, count, QUERY_BLOCK):
        stop = min(count, row + QUERY_BLOCK)
        rows = (query[:, :, row:stop].float() * scale).reshape(batch, heads, groups * (stop - row), dim)
        if whole:  # every context column is visible to every reconstruction query
            rows = torch.cat([rows, -lse[:, :, row:stop].reshape(batch, heads, -1, 1)], dim=-1)
            peak = (rows @ keys).view(batch, heads, groups, stop - row, -1).amax(dim=(2, 3))
        else:
            logits = (rows @ keys).view(batch, heads, groups, stop - row, -1)  # [B, H, G, r, c]
            ahead = own_columns[None, :] > torch.arange(row, stop, device=device)[:, None]  # [r, q]: the future
            logits[..., visible:].masked_fill_(ahead, -torch.inf)
            normaliser = logits.logsumexp(-1, keepdim=True)
            peak = (logits[..., sinks:visible] - normaliser).amax(dim=(2, 3))
        best = peak if best is None else torch.maximum(best, peak)
    policy.scores[:, :, start:end] = best.exp()
    return output


@torch.no_grad()
def compress_by_reconstruction(config, model, cache, input_ids: torch.Tensor, attention_mask) -> None:
    """Score every layer by reconstructing ``input_ids`` (the context in ``cache``), then evict (once)."""
    layers = cache.compressed_layers
    policies = [layer.policy for layer in layers]
    if policies[0].done:
        return
    length = layers[0].seen
    if config.prefix >= length:
        raise ValueError(f"prefix must be below the context's {length} tokens, got {config.prefix}")
    if length != input_ids.shape[1] or (attention_mask is not None and not bool(attention_mask.bool().all())):
        raise ValueError(
            "kvzip compresses a context prefilled alone into an empty cache, without padding: call "
            "prefill(model, context_ids, cache) once on a fresh cache, with sequences of one length"
        )
    path = config.tokenizer or getattr(model.config, "name_or_path", "") or ""
    tokenizer = load_tokenizer(path)
    for policy, layer in zip(policies, layers, strict=True):
        policy.scores = torch.zeros(*layer.slots.token_idx.shape[:2], length, device=layer.device)
    # (the keyword the installed transformers takes a cache by: ``kvcompress.generation.cache_argument``'s rule)
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    try:
        for start, end, ids in reconstruction_chunks(input_ids, tokenizer, config.chunk_size, config.prefix):
            for policy in policies:
                policy.scoring = (length, start, end, min(config.n_sink, start))
            count = ids.shape[1]
            positions = torch.arange(length, length + count, device=ids.device)[None].expand(ids.shape[0], -1)
            model(input_ids=ids, position_ids=positions, **{keyword: cache}, use_cache=True, logits_to_keep=1)
    finally:
        for policy in policies:
            policy.scoring = policy.chunk = None
    for policy in policies:  # the sinks above every probability (kvpress 0.5.5: the largest score + 1)
        policy.scores[..., : config.n_sink] = 2.0
    evict(config, layers)
    for policy in policies:
        policy.done, policy.scores = True, None


def evict(config, layers) -> None:
    """Evict by the reconstruction scores under ``config.allocation`` (see the package docstring)."""
    scores = [layer.policy.scores for layer in layers]
    batch, heads, length = scores[0].shape
    n = torch.full((batch,), length, device=scores[0].device)
    if config.ratio is not None:
        removed = 1 - config.ratio
        per_layer = heads * length - int(heads * length * removed)
        overall = len(layers) * heads * length - int(len(layers) * heads * length * removed)
    else:
        per_layer = heads * min(config.budget, length)
        overall = len(layers) * per_layer
    if config.allocation == "uniform":
        keep = kept_per_sequence(n, config.ratio, config.budget)
        rules = [keep_top(layer, score, keep) for layer, score in zip(layers, scores, strict=True)]
    elif config.allocation == "layer":
        total = torch.full((batch,), per_layer, device=n.device)
        rules = [heads_share(layer, score, None, total) for layer, score in zip(layers, scores, strict=True)]
    else:
        rules = global_masks(scores, overall)
    for layer, rule in zip(layers, rules, strict=True):
        layer.apply(rule)
        layer.compact(shrink=True)


def global_masks(scores: list[torch.Tensor], keep: int) -> list[KeepMask]:
    """Per layer, what one ranking over every layer and head keeps (``keep`` pairs per sequence): layer-major,
    then token-major flattening, so a stable sort evicts the lower layer, the older token, the lower head first."""
    stacked = torch.stack(scores, 1)  # [B, layers, H, L]
    batch, count, heads, length = stacked.shape
    flat = stacked.transpose(2, 3).reshape(batch, -1)
    order = flat.argsort(dim=-1, stable=True)
    kept = (places(order) >= flat.shape[-1] - keep).view(batch, count, length, heads).transpose(2, 3)
    return [KeepMask(kept[:, i]) for i in range(count)]
