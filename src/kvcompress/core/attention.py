"""The one attention function kvcompress registers with ``transformers``' ``AttentionInterface``.

The model calls ``cache.update()`` and then this function with the stored keys: it finds the layer behind them,
records the new tokens' positions and padding, attends (plain SDPA, or the chunked softmax where the method asks for
statistics), then lets the layer evict. The mask function registered under the same name hands the 2D padding mask
through unchanged: after eviction the stored keys no longer line up with the sequence, so the layer builds its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from kvcompress.core.cache import watch_inputs
from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.forward import ForwardPass
from kvcompress.core.grad_mode import recorded_as_computed
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.softmax import causal_mask, chunked_softmax

ATTENTION_NAME = "kvcompress"


def padding_mask_passthrough(*, attention_mask: torch.Tensor | None = None, **_: object) -> torch.Tensor | None:
    """Mask function: return the 2D ``[B, tokens seen]`` padding mask (True = real token) as it came."""
    return attention_mask


def kvcompress_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for models prepared by ``prepare_model``; returns ``[B, q, H, d]`` like the built-in functions."""
    layer: CompressedLayer | None = getattr(key, LAYER_ATTRIBUTE, None)
    sliding_window = kwargs.get("sliding_window")
    if layer is None:
        return _uncompressed_attention(query, key, value, attention_mask, scaling, sliding_window)
    queries, padding = query.shape[2], None  # the new tokens' [B, q] 2D padding mask where some is padding
    if attention_mask is not None and attention_mask.dim() == 2:  # (one host read per forward)
        real = ("all-real", queries, attention_mask.shape[-1])
        if not layer.forward_pass.cached(real, lambda: bool(attention_mask[:, -queries:].all())):
            padding = attention_mask[:, -queries:]
    with recorded_as_computed():  # a backward pass reads what this step saw, whatever later steps write in place
        output = attend_layer(layer, query, key, value, padding, kwargs.get("position_ids"), scaling, sliding_window)
    return output.transpose(1, 2).contiguous(), None


def attend_layer(
    layer: CompressedLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One layer's step after ``layer.update``: record positions and padding, attend, evict; ``[B, H, q, d]``."""
    forward = layer.forward_pass
    if not forward.is_open:  # a layer driven on its own
        forward.begin(layer)
    layer.register_new_tokens(position_ids, padding)
    query, key = layer.positioned(query, key)
    mask = layer.attention_mask(query.shape[2], sliding_window)
    custom = layer.attend(query, key, value, mask, scaling)
    if custom is None:
        request = layer.policy.stats if layer.policy.wants_stats(layer) else StatsRequest()
        custom = layer_attention(query, key, value, mask, scaling, request, position_ids, forward)
    output, stats = custom
    layer.after_attention(stats)
    layer.expire_window()
    for observer in layer.observers:
        observer(layer)
    layer.end_forward()
    forward.end(layer)
    return output


def layer_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    request: StatsRequest,
    position_ids: torch.Tensor | None,
    forward: ForwardPass | None = None,
) -> tuple[torch.Tensor, AttentionStats | None]:
    """A layer's attention under its own ``mask`` (``None``: plain causal; a layer's mask leaves every query its own
    key): SDPA, or the explicit softmax where statistics are asked for. A plain causal chunk after earlier keys
    reads one additive mask shared by the forward's layers (``causal_bias``)."""
    bias = None
    if mask is None and position_ids is not None and forward is not None and 1 < query.shape[2] < key.shape[2]:
        if not (request.received or request.lse):  # (the explicit softmax skips hidden keys without a mask)
            bias = causal_bias(query.shape[2], key.shape[2], query, forward)
    if request.any:
        return attention_with_stats(query, key, value, mask, scaling, request, True, bias)
    return sdpa(query, key, value, mask if bias is None else bias, scaling), None


def causal_bias(queries: int, length: int, like: torch.Tensor, forward: ForwardPass) -> torch.Tensor:
    """``[1, 1, q, L]`` additive mask (0 or -inf, ``like``'s dtype) of a plain causal chunk after ``L - q`` keys,
    built once per forward (SDPA would otherwise turn a boolean mask into this one in every layer)."""

    def build() -> torch.Tensor:
        hidden = ~causal_mask(queries, length, like.device)
        return torch.zeros(hidden.shape, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))

    return forward.cached(("causal_bias", queries, length, like.dtype, like.device), build)


def sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """PyTorch SDPA with a ``[B, H_kv or 1, q, L]`` boolean mask (``None``: plain causal attention of the last
    ``q`` of ``L`` positions; one query sees every key)."""
    groups = query.shape[1] // key.shape[1]
    if mask is None and 1 < query.shape[2] < key.shape[2]:  # is_causal would align the queries to the first keys
        mask = causal_mask(query.shape[2], key.shape[2], query.device)
    if mask is not None and mask.shape[1] > 1:
        mask = mask.repeat_interleave(groups, dim=1)
    is_causal = mask is None and query.shape[2] > 1 and query.shape[2] == key.shape[2]
    return scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=groups > 1
    )


def _uncompressed_attention(query, key, value, attention_mask, scaling, sliding_window) -> tuple[torch.Tensor, None]:
    """A prepared model with an ordinary cache (or none): causal and padding mask."""
    queries, length = query.shape[2], key.shape[2]
    query_idx = torch.arange(length - queries, length, device=query.device)[None, None, :, None]
    key_idx = torch.arange(length, device=query.device)
    mask = key_idx <= query_idx  # [1, 1, q, L]
    if sliding_window is not None:
        mask = mask & (key_idx > query_idx - sliding_window)
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = mask & (attention_mask[:, None, None, -length:].bool() | (key_idx == query_idx))
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
    return sdpa(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def attention_with_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    request: StatsRequest,
    rows_see_keys: bool = False,
    causal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """Attention plus the requested statistics, in float32 (``rows_see_keys``: see ``chunked_softmax``;
    ``causal``: the additive mask SDPA takes when ``mask`` is ``None``, see ``causal_bias``).

    Mass received (or the rows' log-normalisers) needs every query's probabilities: the chunked softmax gives output
    and mass together. Rows of the last ``n`` queries alone need only that ``n x L`` block, computed beside SDPA."""
    queries, length = query.shape[2], key.shape[2]
    last_n = min(request.last_queries, queries)
    last_visible = None  # (one query with no mask sees every key)
    if last_n and mask is None and queries > 1:  # plain causal: only the last rows' mask, not the ``q x L`` one
        last_visible = causal_mask(last_n, length, query.device)
    elif last_n and mask is not None:
        last_visible = mask[:, :, queries - last_n :]
    options = {"last_n": last_n, "rows_see_keys": rows_see_keys}
    received = lse = None
    if request.received or request.lse:
        parts = chunked_softmax(
            query, key, mask, scaling, value=value, lse=request.lse, received=request.received, **options
        )
        output, received, lse, last = parts.output, parts.received, parts.lse, parts.last
    elif last_n == queries:  # a decoding step: one softmax gives the output and the rows
        parts = chunked_softmax(query, key, last_visible, scaling, value=value, **options)
        output, last = parts.output, parts.last
    else:
        output = sdpa(query, key, value, mask if causal is None else causal, scaling)
        last = chunked_softmax(query[:, :, queries - last_n :], key, last_visible, scaling, **options).last
    return output, AttentionStats(queries, received, last, last_visible, lse)


def register_attention(name: str, attention: Callable, mask: Callable) -> None:
    """Register an attention function and its mask function with ``transformers`` under ``name`` (idempotent)."""
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Switch the model to kvcompress attention (it still works with ordinary caches) and check the inputs of every
    forward through a compressed cache (``core.cache.check_inputs``). Returns the model."""
    register_attention(ATTENTION_NAME, kvcompress_attention, padding_mask_passthrough)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    watch_inputs(model)
    return model
