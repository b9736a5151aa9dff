"""KVzip's reconstruction passes, their scores, and the eviction they decide (see ``kvcompress.methods.kvzip``)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AutoTokenizer

from kvcompress.core.contract import KeepMask
from kvcompress.core.forward import from_host
from kvcompress.core.fused_attention import attention_with_lse
from kvcompress.core.selection import keep_top
from kvcompress.methods.allocation import heads_share, places
from kvcompress.methods.oneshot import kept_per_sequence

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk repeated after a later chunk's prompt
# float32 logits of one block of reconstruction queries over the context (about): small enough that the block's
# elementwise passes (row maxima, exp, sums, scores) run in a core's cache (1 MiB: 5-20 % less time than 8 MiB
# for the reconstruction's attention of SmolLM2-135M and Qwen2.5-Coder-0.5B on a CPU with 2 MiB of L2)
BLOCK_BYTES = 2**20
# the same on a GPU, where every operation is a kernel launch of about the same host time whatever its size: a block
# as large as memory comfortably allows, so that a 2,048-token chunk over an 8K context is a few blocks, not hundreds
# (SmolLM2-135M's shapes in bfloat16 on an H200: 1 MiB blocks made the prefill and compression 181x a full
# prefill, 64 MiB 26x; ``experiments.kvzip_cost --device cuda``)
GPU_BLOCK_BYTES = 2**29
# devices where a chunk covering the whole context is scored from the attention's own explicit logits (one query-key
# product for both); elsewhere, and for every chunk of a longer context, beside PyTorch's fused attention
# (``score_chunk``). On a CPU the products dominate, and the fused way costs one more for a whole-context chunk;
# with several chunks it saves more than that (4,096 tokens in 2,048-token chunks: 0.93x the prefill and compression
# of scoring every chunk from explicit logits, SmolLM2-135M, ``scripts/ab_commit.py --prompts``). On a GPU the
# explicit logits' elementwise passes dominate (``experiments.kvzip_cost --device cuda``).
EXPLICIT_LOGITS_DEVICES = ("cpu",)
LOGIT_FLOOR = 87.0  # logits further below their row's maximum count as that far (exp stays a normal float32)
STOP = ("kvzip", "last layer scored")  # the reconstruction forward's job after its last layer (``stop_forward``)


class ReconstructionScored(Exception):
    """A reconstruction forward's last layer is scored: nothing after it (that layer's output projection and MLP,
    the final norm, the LM head) is read, so the forward stops there (``compress_by_reconstruction`` catches it)."""


def stop_forward() -> None:
    raise ReconstructionScored


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
        lead = from_host(prompt, context.device, context.dtype).expand(context.shape[0], -1)
        parts = [lead]
        if start > prefix:  # the previous chunk's last tokens
            parts.append(context[:, start - min(OVERLAP, chunk_size) : start])
        parts += [from_host(suffix, context.device, context.dtype).expand(context.shape[0], -1)]
        chunks.append((start, end, torch.cat([*parts, context[:, start:end]], dim=1)))
    return chunks


def query_block(query_heads: int, columns: int, on_cpu: bool = True) -> int:
    """Reconstruction queries whose logits over ``columns`` context keys are computed at once: about
    ``BLOCK_BYTES`` of float32 logits, 16 to 256 queries, on a CPU; ``GPU_BLOCK_BYTES``, at least 16, elsewhere."""
    if on_cpu:
        return max(16, min(256, BLOCK_BYTES // (4 * query_heads * max(1, columns))))
    return max(16, GPU_BLOCK_BYTES // (4 * query_heads * max(1, columns)))


def score_chunk(
    policy,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    own_key: torch.Tensor,
    own_value: torch.Tensor,
    scaling: float | None,
    attend: bool = True,
) -> torch.Tensor:
    """One reconstruction forward's attention, and its scores folded into ``policy.scores``; ``[B, H_q, q, d]``.

    ``key``/``value`` are the stored context's (every token visible to every reconstruction query), ``own_key``/
    ``own_value`` the forward's own (``[B, H_kv, q, d]``, seen causally; never stored: ``kvzip.layer``). The score
    of a context token of the chunk is the largest probability any query of its KV head's group gives it under a
    softmax over the first ``sinks`` context tokens, the chunk's own context tokens and the reconstruction tokens
    (kvpress's subsample); with one chunk covering the context and no prefix that softmax is the attention's own.
    The largest probability is ``exp`` of the largest logit minus its row's log-normaliser (the max over the group
    and the queries taken before the ``exp``), computed in float32 a block of queries at a time (``query_block``:
    the peak is a block's logits). Two ways, one result to float rounding:

    - One chunk covering the context, on a device in ``EXPLICIT_LOGITS_DEVICES`` (a CPU): the logits over the whole
      context that the scores need are those of the attention itself, so one query-key product gives both
      (``_scores_from_explicit_logits``).
    - Otherwise (several chunks: the scores need only the chunk's and the sinks' columns; or a GPU, where a dozen
      elementwise passes over explicit logits cost far more than one more product): the attention by PyTorch's fused
      kernels with their log-normalisers, the scores from a product over the scored columns alone
      (``_scores_beside_fused_attention``).

    ``attend=False`` (the forward's last layer, whose output nothing reads) scores only: the returned tensor is
    left unwritten."""
    length, start, end, sinks = policy.scoring
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    whole = sinks == 0 and start == 0 and end == length
    parts = query, key, value, own_key, own_value, scale, attend
    if whole and query.device.type in EXPLICIT_LOGITS_DEVICES:
        output, best = _scores_from_explicit_logits(*parts)
    else:
        output, best = _scores_beside_fused_attention(*parts, None if whole else (start, end, sinks))
    policy.scores[:, :, start:end] = best
    return output


def _scores_from_explicit_logits(query, key, value, own_key, own_value, scale, attend):
    """Scores over the whole context and the attention output from one query-key product: the reconstruction
    tokens' own causal part by the fused kernel with its log-normaliser (``attention_with_lse``), the context part as
    explicit logits, exponentiated in place for the output (merged with the own part by their log-normalisers).
    Logits more than ``LOGIT_FLOOR`` (87) below their row's largest are raised to that floor before the ``exp``:
    their probabilities are below ``exp(-87)`` of the row's largest either way, and the ``exp`` of a real model's
    spread (SmolLM2's logits span 150-300 within a row) otherwise lands in float32's subnormal range, several times
    slower on CPU (the scores of SmolLM2 and Qwen2.5-Coder on the shipped books' contexts are bit for bit the same)."""
    batch, query_heads, count, dim = query.shape
    heads, columns = key.shape[1], key.shape[2]
    groups = query_heads // heads
    own_output, own_lse = attention_with_lse(query, own_key, own_value, scale)
    keys, values = key.float().transpose(-1, -2), value.float()  # [B, H, d, n], [B, H, n, d]
    output = torch.empty_like(query)
    block = query_block(query_heads, columns, query.device.type == "cpu")
    best = None
    for row in range(0, count, block):
        stop = min(count, row + block)
        size = groups * (stop - row)
        rows = (query[:, :, row:stop].float() * scale).reshape(batch, heads, size, dim)
        logits = rows @ keys  # [B, H, G*r, n]
        own = own_lse[:, :, row:stop].reshape(batch, heads, size, 1)
        top = logits.amax(-1, keepdim=True)
        probs = logits.sub_(top).clamp_(min=-LOGIT_FLOOR).exp_()  # (in place: the logits are not read again)
        total = torch.logaddexp(probs.sum(-1, keepdim=True).log_().add_(top), own)
        probs.mul_((top - total).exp_())  # the attention's probabilities of the context columns
        peak = probs.view(batch, heads, groups, stop - row, -1).amax(dim=(2, 3))
        if attend:
            own_part = own_output[:, :, row:stop].reshape(batch, heads, size, dim) * (own - total).exp()
            part = (probs @ values).add_(own_part)
            output[:, :, row:stop] = part.view(batch, query_heads, stop - row, dim)
        best = peak if best is None else torch.maximum(best, peak)
    return output, best


def _scores_beside_fused_attention(query, key, value, own_key, own_value, scale, attend, subsample):
    """The attention's context and own parts by fused kernels with their log-normalisers, merged by them; the
    scores from a product of the queries with the scored columns: every context column normalised by the
    attention's log-normaliser (``subsample`` ``None``), or the chunk's ``(start, end)`` columns normalised over
    themselves, the first ``sinks`` columns and the own tokens."""
    batch, query_heads, count, dim = query.shape
    heads = key.shape[1]
    groups = query_heads // heads
    own_output, own_lse = attention_with_lse(query, own_key, own_value, scale)
    output = torch.empty_like(query)
    if attend or subsample is None:
        context_output, context_lse = attention_with_lse(query, key, value, scale, causal=False)
        total = torch.logaddexp(context_lse, own_lse)
        if attend:
            context_part = context_output.float() * (context_lse - total).exp_()[..., None]
            output = context_part.add_(own_output.float() * (own_lse - total).exp_()[..., None]).to(query.dtype)
    keys = key.float().transpose(-1, -2)  # [B, H, d, n]
    start, end, sinks = (0, key.shape[2], 0) if subsample is None else subsample
    normaliser = total if subsample is None else own_lse
    block = query_block(query_heads, end - start + sinks, query.device.type == "cpu")
    best = None
    for row in range(0, count, block):
        stop = min(count, row + block)
        size = groups * (stop - row)
        rows = (query[:, :, row:stop].float() * scale).reshape(batch, heads, size, dim)
        logits = rows @ keys[..., start:end]  # [B, H, G*r, end - start]
        lse = normaliser[:, :, row:stop].reshape(batch, heads, size, 1)
        if subsample is not None:
            lse = torch.logaddexp(lse, logits.logsumexp(-1, keepdim=True))
            if sinks:
                lse = torch.logaddexp(lse, (rows @ keys[..., :sinks]).logsumexp(-1, keepdim=True))
        peak = logits.sub_(lse).view(batch, heads, groups, stop - row, -1).amax(dim=(2, 3))
        best = peak if best is None else torch.maximum(best, peak)
    return output, best.exp_()


@torch.no_grad()
def compress_by_reconstruction(config, model, cache, input_ids: torch.Tensor, attention_mask) -> None:
    """Score every layer by reconstructing ``input_ids`` (the context in ``cache``), then evict (once)."""
    layers = cache.compressed_layers
    policies = [layer.policy for layer in layers]
    if policies[0].done:
        return
    reconstruction_scores(config, model, cache, input_ids, attention_mask)
    for policy in policies:  # the sinks above every probability (kvpress 0.5.5: the largest score + 1)
        policy.scores[..., : config.n_sink] = 2.0
    evict(config, layers)
    for policy in policies:
        policy.done, policy.scores = True, None


@torch.no_grad()
def reconstruction_scores(config, model, cache, input_ids: torch.Tensor, attention_mask) -> list[torch.Tensor]:
    """Every layer's reconstruction scores ``[B, H_kv, n]`` (float32; a ``prefix`` token's 0) of the context
    ``input_ids`` in ``cache`` (prefilled into it alone), also left in each layer's ``policy.scores``; nothing
    evicted (``kvcompress train kvzip-calibrate`` reads them for the head level)."""
    layers = cache.compressed_layers
    policies = [layer.policy for layer in layers]
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
    policies[-1].final = True  # (the forward's last layer: scores only, then the forward stops; ``KVzipPolicy``)
    forward = layers[-1].forward_pass
    # (the keyword the installed transformers takes a cache by: ``kvcompress.generation.cache_argument``'s rule)
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    try:
        for start, end, ids in reconstruction_chunks(input_ids, tokenizer, config.chunk_size, config.prefix):
            for policy in policies:
                policy.scoring = (length, start, end, min(config.n_sink, start))
            count = ids.shape[1]
            positions = torch.arange(length, length + count, device=ids.device)[None].expand(ids.shape[0], -1)
            try:
                model(input_ids=ids, position_ids=positions, **{keyword: cache}, use_cache=True, logits_to_keep=1)
            except ReconstructionScored:  # raised as the last layer closed the forward: its other jobs run now
                forward.close()
    finally:
        for policy in policies:
            policy.scoring = policy.chunk = None
            policy.final = False
    return [policy.scores for policy in policies]


def evict(config, layers) -> None:
    """Evict by the reconstruction scores under ``config.allocation`` (see the package docstring)."""
    scores = [layer.policy.scores for layer in layers]
    batch, heads, length = scores[0].shape
    if config.ratio is not None:
        removed = 1 - config.ratio
        per_layer = heads * length - int(heads * length * removed)
        overall = len(layers) * heads * length - int(len(layers) * heads * length * removed)
    else:
        per_layer = heads * min(config.budget, length)
        overall = len(layers) * per_layer
    if config.allocation == "uniform":
        keep = kept_per_sequence(length, config.ratio, config.budget)  # every sequence: ``length`` real tokens
        rules = [keep_top(layer, score, keep) for layer, score in zip(layers, scores, strict=True)]
    elif config.allocation == "layer":
        total = torch.full((batch,), per_layer, device=scores[0].device)
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
