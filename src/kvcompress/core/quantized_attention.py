"""A decoding step's attention read from the quantized slots' codes (``QuantizedSlotBuffers``), with no dequantized
view of the cache kept beyond the step.

The codes of slots ``[0, width)`` (keys in whole key groups) are unpacked straight into one float32 buffer
(``core.kivi.unpack_into``: one op per run of channels, keys and values side by side) and dequantized in place, one
multiply-add for the keys (``scale * code + min``, per channel and key group) and one for the values (per token and
channel group); the exact tokens (the residual window's ring, or the step's own token without one) are copied over
their slots' rows (one ``index_copy_`` each for keys and values; an entry whose token is no longer stored lands in
a spare row past ``width``, which nothing reads). Then one product gives the logits, one softmax the
probabilities, one product the output: the arithmetic of attention over ``QuantizedSlotBuffers.view`` (what a
forward of several tokens reads), in about a dozen tensor operations per layer, with no loop over heads, tokens or
key groups and no host read.

Considered and measured (``h2o`` at 512 tokens, 4 bits, SmolLM2-135M, one thread, decoding steps interleaved in one
process): the previous reading folded the key groups' scales into the query (one small product per key group, the
logits then transposed into place) and the values' scales into the probabilities (one product for every channel
group, of which each channel kept its own), and attended the exact tokens apart (their logits scattered over their
slots', their probabilities gathered and taken out): about forty operations, most of them small, each touching
memory the model's weight products have just pushed out of the caches. Dequantizing in place costs two multiply-adds
over the unpacked buffer, which is in cache right after the unpack; reading each byte as ``byte >> (bits * i)``
with ``2**bits`` folded into the weights would save the mask but is not exact in float32. All of it in float32 (the
model's dtype may be bf16), the output cast to the query's dtype.

What grows with the cache per step and layer is that float32 buffer (as large as the layer's dequantized keys and
values, freed at the step's end) and the logits.

Statistics are the softmax's rows over the slots read (``received`` and ``last`` of a one-query step, the
log-normaliser), as ``core.softmax`` gives them for a decoding query.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.kivi import unpack_into


def quantized_one_query(
    slots,
    width: int,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    request: StatsRequest,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, AttentionStats | None]:
    """Attention of one query per row ``query`` ``[B, H_q, 1, d]`` over slots ``[0, width)`` of ``slots`` (a
    ``QuantizedSlotBuffers``) under ``mask`` ``[B, H_kv or 1, 1, width]`` (``None``: every slot visible).

    ``exact``: keys ``[B, H_kv, E, d]``, values ``[B, H_kv, E, d_v]`` and slots ``[B, H_kv, E]`` (``width``: not
    stored) of the tokens read exactly. Returns ``[B, H_q, 1, d_v]`` in the query's dtype and the statistics
    ``request`` asks for (``None`` if none)."""
    batch, q_heads, _, dim = query.shape
    heads = slots.token_idx.shape[1]
    rows, groups_q = batch * heads, q_heads // heads
    group, bits = slots.group, slots.bits
    key_groups = min(-(-width // group), slots.capacity // group)
    columns = key_groups * group  # (>= width: whole key groups)
    spare = columns + 1  # rows of the buffer: whole key groups, then a spare row (``width <= columns``)
    value_dim = slots.ring_values_dim()

    # codes unpacked into one float32 buffer, then dequantized in place
    buffer = query.new_empty(2 if dim == value_dim else 1, batch, heads, spare, dim, dtype=torch.float32)
    keys = buffer[0]
    if dim == value_dim:
        values = buffer[1]
    else:
        values = query.new_empty(batch, heads, spare, value_dim, dtype=torch.float32)
    unpack_into(slots.keys[:, :, :columns], bits, keys[:, :, :columns])
    unpack_into(slots.tensors["values"][:, :, :width], bits, values[:, :, :width])
    grouped_keys = keys[:, :, :columns].unflatten(2, (key_groups, group))
    key_min = slots.key_min[:, :, :key_groups, None].float()
    torch.addcmul(key_min, grouped_keys, slots.key_scale[:, :, :key_groups, None].float(), out=grouped_keys)
    value_scale = slots.tensors["value_scale"][:, :, :width, :, None].float()
    grouped_values = values[:, :, :width].unflatten(-1, (value_scale.shape[-2], -1))
    value_min = slots.tensors["value_min"][:, :, :width, :, None].float()
    torch.addcmul(value_min, grouped_values, value_scale, out=grouped_values)

    # the exact tokens over their slots' rows (those no longer stored, slot ``width``, into a row not read)
    exact_keys, exact_values, exact_slots = exact
    rows_of = torch.arange(0, rows * spare, spare, device=exact_slots.device).view(batch, heads, 1)
    into = (rows_of + exact_slots).flatten()
    keys.view(-1, dim).index_copy_(0, into, exact_keys.flatten(0, 2).float())
    values.view(-1, value_dim).index_copy_(0, into, exact_values.flatten(0, 2).float())

    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, groups_q, dim).float() * scale
    logits = torch.bmm(q, keys.view(rows, spare, dim)[:, :width].transpose(1, 2))  # [rows, G_q, width]
    if mask is not None:
        logits.view(batch, heads, groups_q, width).masked_fill_(~mask, float("-inf"))
    top = logits.amax(dim=-1) if request.lse else None
    probs = logits.softmax(dim=-1)
    output = torch.bmm(probs, values.view(rows, spare, value_dim)[:, :width])
    output = output.view(batch, q_heads, 1, value_dim).to(query.dtype)
    if not request.any:
        return output, None
    seen = probs.unflatten(0, (batch, heads))  # [B, H_kv, G_q, width]
    stats = AttentionStats(query_count=1)
    if request.received:
        stats.received = seen
    if request.last_queries:
        stats.last = seen.unsqueeze(3)
        stats.last_visible = mask
    if request.lse:
        stats.lse = (top - probs.amax(dim=-1).log()).view(batch, q_heads, 1)
    return output, stats
