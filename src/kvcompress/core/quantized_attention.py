"""A decoding step's attention read from the quantized slots' codes (``QuantizedSlotBuffers``), with no dequantized
view of the cache kept beyond the step.

The codes of slots ``[0, width)`` (keys in whole key groups) are unpacked straight into one float32 buffer
(``core.kivi.unpack_into``: one op per run of channels, keys and values side by side) and dequantized in place, one
multiply-add for the keys (``scale * code + min``, per channel and key group) and a multiply then an add for the
values (per token and channel group: PyTorch's CPU ``addcmul`` with both parameters broadcast along the innermost
dimension is about three times slower than ``mul_`` and ``add_``, whose kernels vectorize that broadcast, while for
the keys, broadcast along the tokens, it is the faster); the exact tokens (the residual window's ring, or the
step's own token without one) are copied over their slots' rows (one ``index_copy_`` each for keys and values; an
entry whose token is no longer stored lands in a spare row past ``width``, which nothing reads). Then one product
gives the logits, one softmax the probabilities, one product the output: the arithmetic of attention over
``QuantizedSlotBuffers.view`` (what a forward of several tokens reads; equal to float32 rounding), in about a dozen
tensor operations per layer, with no loop over heads, tokens or key groups and no host read.

Considered and measured (``h2o`` at 512 tokens, 4 bits, SmolLM2-135M, one thread, decoding steps interleaved in one
process): the previous reading folded the key groups' scales into the query (one small product per key group, the
logits then transposed into place) and the values' scales into the probabilities (one product for every channel
group, of which each channel kept its own), and attended the exact tokens apart (their logits scattered over their
slots', their probabilities gathered and taken out): about forty operations, most of them small, each touching
memory the model's weight products have just pushed out of the caches. Dequantizing in place costs two multiply-adds
over the unpacked buffer, which is in cache right after the unpack; reading each byte as ``byte >> (bits * i)``
with ``2**bits`` folded into the weights would save the mask but is not exact in float32. Measured the same way and
left (in-model interleaved ratios against this reading, loaded machine): folding only the values' scales and
minima into the probabilities (the codes unpacked one channel group per matrix, one batched product over the
groups, the exact tokens as scale 1 and minimum 0): 2.6-4 % slower, the batched product of ``[3, 513] x [513, 32]``
matrices alone costing twice the ``[3, 513] x [513, 64]`` one; unpacking into a ``uint8`` buffer converted to
float32 in one op: 2 % slower; the unpacking and dequantization merged into one mixed-dtype ``addcmul`` per run of
channels (PyTorch casts the ``uint8`` operand into a temporary first): 4 % slower; a float32 buffer reused across
layers instead of allocated per layer, and the ring's keys and values allocated as halves of one tensor so that one
``index_copy_`` copies both: no difference. All of it in float32 (the model's dtype may be bf16), the
output cast to the query's dtype, the query's scaling applied in the logits' product (``baddbmm``'s ``alpha``).

What grows with the cache per step and layer is that float32 buffer (as large as the layer's dequantized keys and
values, freed at the step's end) and the logits.

Statistics are the softmax's rows over the slots read (``received`` and ``last`` of a one-query step, the
log-normaliser), as ``core.softmax`` gives them for a decoding query.

**A forward of several tokens** (a prompt chunk) reads the codes too (``quantized_chunk_attention``), so that no
float copy as large as the layer's stored keys and values exists while a long prompt is prefilled: queries go in
row chunks whose float32 logits over the slots read hold at most ``CODES_LOGITS`` numbers (and at most
``core.softmax.CAUSAL_ROWS`` rows, as the view's chunked softmax takes them), and for each row chunk
the slots are read ``CODES_BLOCK`` at a time (whole key groups): the block's codes unpacked and dequantized into a
block-sized float32 buffer, the exact tokens (the residual window's ring, the forward's own tokens) copied over
their rows, one product writing the block's logits; after the softmax, the same blocks' values, one product each
accumulating the output. The arithmetic is that of attention over the dequantized view (the keys and values each
query sees are the view's, dequantized in float32), in float32; the statistics (mass received, the last queries'
rows, the log-normalisers) are those of ``core.softmax.chunked_softmax`` over the view. Reading each block again
for every row chunk costs a dequantization of the layer per row chunk (about 3 ms for 8,704 slots of SmolLM2's 3
heads at 4 bits on one CPU thread, where a row chunk's two products and softmax take 12.5 ms at 26 rows, the
rows ``CODES_LOGITS`` allows there); small row chunks keep the logits in cache, which pays that back: 0.6 ms a
row with the dequantization at 26 rows, where the view's 128-row chunks take 0.65 ms a row without it
(``torch.bmm`` and softmax timed alone, SmolLM2's shapes, one thread). Folding the keys' scales into the
queries instead (one scaled copy of the queries per key group) would hold ``rows x groups x d`` numbers, twice
the logits at ``d = 64``, ``group = 32``.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, StatsRequest
from kvcompress.core.kivi import unpack_into
from kvcompress.core.softmax import CAUSAL_ROWS, causal_mask, grouped

CODES_LOGITS = 1 << 21  # float32 logits of a row chunk of a forward of several tokens read from the codes (8 MiB)
CODES_BLOCK = 2048  # slots read (dequantized) at a time by such a forward (rounded to whole key groups)


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
    grouped_values.mul_(value_scale).add_(value_min)  # (see ``dequantize_in_place``)

    # the exact tokens over their slots' rows (those no longer stored, slot ``width``, into a row not read)
    exact_keys, exact_values, exact_slots = exact
    rows_of = torch.arange(0, rows * spare, spare, device=exact_slots.device).view(batch, heads, 1)
    into = (rows_of + exact_slots).flatten()
    keys.view(-1, dim).index_copy_(0, into, exact_keys.flatten(0, 2).float())
    values.view(-1, value_dim).index_copy_(0, into, exact_values.flatten(0, 2).float())

    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(rows, groups_q, dim).float()
    logits = q.new_empty(rows, groups_q, width)  # (the scaling in the product: one operation less)
    logits.baddbmm_(q, keys.view(rows, spare, dim)[:, :width].transpose(1, 2), beta=0, alpha=scale)
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


def quantized_chunk_attention(
    slots,
    width: int,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    request: StatsRequest,
    exact: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, AttentionStats | None]:
    """Attention of the queries ``query`` ``[B, H_q, q, d]`` over slots ``[0, width)`` of ``slots`` (a
    ``QuantizedSlotBuffers``) under ``mask`` ``[B, H_kv or 1, q, width]`` (``None``: plain causal, the queries being
    the last ``q`` slots), read from the codes a block of slots at a time (see the module docstring).

    ``exact``: for each set of tokens read exactly (the ring, the forward's own tokens), keys ``[B, H_kv, E, d]``,
    values ``[B, H_kv, E, d_v]`` and slots ``[B, H_kv, E]`` (a slot outside ``[0, width)``: not read); a later set
    is copied over an earlier one. Returns ``[B, H_q, q, d_v]`` in the query's dtype and the statistics ``request``
    asks for (``None`` if none), those of ``core.attention.attention_with_stats`` (every row sees a key)."""
    batch, q_heads, queries, dim = query.shape
    heads = slots.token_idx.shape[1]
    groups_q = q_heads // heads
    value_dim = slots.ring_values_dim()
    reader = _BlockReader(slots, width, exact)
    causal = mask is None and queries > 1
    scale = dim**-0.5 if scaling is None else scaling
    last_n = min(request.last_queries, queries)
    output = query.new_empty(batch, heads, groups_q, queries, value_dim, dtype=torch.float32)
    mass = query.new_zeros(batch, heads, groups_q, width, dtype=torch.float32) if request.received else None
    lses, last_rows = [], []
    step = min(CAUSAL_ROWS, max(1, CODES_LOGITS // max(1, batch * q_heads * width)))
    for start in range(0, queries, step):
        stop = min(start + step, queries)
        rows = stop - start
        seen = width - queries + stop if causal else width  # slots any query of the chunk sees
        q = grouped(query[:, :, start:stop], heads).reshape(batch * heads, groups_q * rows, dim).float() * scale
        logits = q.new_empty(batch * heads, groups_q * rows, seen)
        for first, stop_slot in reader.blocks(seen):  # (in place into the slice: ``bmm(out=...)`` of a strided
            # slice would compute into a temporary as large as the block's logits, then copy)
            logits[:, :, first:stop_slot].baddbmm_(q, reader.keys(first, stop_slot).transpose(1, 2), beta=0)
        shaped = logits.view(batch, heads, groups_q, rows, seen)
        if causal:  # only the chunk's own slots can be in a query's future: the block right of the diagonal
            future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
            shaped[..., seen - rows :].masked_fill_(future, float("-inf"))
        elif mask is not None:
            shaped.masked_fill_(~mask[:, :, None, start:stop, :seen], float("-inf"))
        if request.lse:
            lses.append(shaped.logsumexp(dim=-1))
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)  # in place: the logits are not needed
        out = None
        for first, stop_slot in reader.blocks(seen):
            values = reader.values(first, stop_slot)
            if out is None:
                out = torch.bmm(probs[:, :, first:stop_slot], values)
            else:
                out.baddbmm_(probs[:, :, first:stop_slot], values)
        output[:, :, :, start:stop] = out.view(batch, heads, groups_q, rows, value_dim)
        if mass is not None:
            mass[..., :seen].add_(shaped.sum(dim=-2))
        if last_n and stop > queries - last_n:
            kept = shaped[:, :, :, max(start, queries - last_n) - start :]
            last_rows.append(torch.nn.functional.pad(kept, (0, width - seen)))
    output = output.view(batch, q_heads, queries, value_dim).to(query.dtype)
    if not request.any:
        return output, None
    stats = AttentionStats(query_count=queries, received=mass)
    if request.lse:
        stats.lse = torch.cat(lses, dim=-1).reshape(batch, q_heads, queries)
    if last_n:
        visible = causal_mask(queries, width, query.device) if causal else mask
        stats.last = torch.cat(last_rows, dim=3)
        stats.last_visible = None if visible is None else visible[:, :, queries - last_n :]
    return output, stats


class _BlockReader:
    """Keys and values of blocks of slots of a ``QuantizedSlotBuffers``, as attention reads them: dequantized in
    float32 into buffers of ``CODES_BLOCK`` slots (reused from block to block), the exact tokens copied over."""

    def __init__(self, slots, width: int, exact: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.slots, self.width, self.exact = slots, width, exact
        group = slots.group
        self.block = max(group, CODES_BLOCK // group * group)
        batch, heads = slots.token_idx.shape[:2]
        key_dim, value_dim = slots.key_scale.shape[-1], slots.ring_values_dim()
        rows = min(self.block, -(-width // group) * group)
        self.spare = rows  # the row exact tokens outside the block are copied to (nothing reads it)
        self.key_buffer = slots.key_scale.new_empty(batch, heads, rows + 1, key_dim, dtype=torch.float32)
        self.value_buffer = slots.key_scale.new_empty(batch, heads, rows + 1, value_dim, dtype=torch.float32)
        self.rows_of = torch.arange(batch * heads, device=slots.token_idx.device).view(batch, heads, 1) * (rows + 1)
        self.flat_exact = [(k.flatten(0, 2).float(), v.flatten(0, 2).float(), where) for k, v, where in exact]
        self._targets: dict[int, list[torch.Tensor]] = {}

    def blocks(self, seen: int):
        return ((first, min(first + self.block, seen)) for first in range(0, seen, self.block))

    def _into(self, first: int) -> list[torch.Tensor]:
        """Rows of the buffers each exact token of the block starting at ``first`` goes to (the spare row if not
        in the block), flattened over (sequence, head) rows; computed once per block."""
        if first not in self._targets:
            stop = min(first + self.block, self.width)
            targets = []
            for _, _, where in self.flat_exact:
                inside = (where >= first) & (where < stop)
                targets.append((self.rows_of + torch.where(inside, where - first, self.spare)).flatten())
            self._targets[first] = targets
        return self._targets[first]

    def keys(self, first: int, stop: int) -> torch.Tensor:
        """``[B H, stop - first, d]`` float32 keys of slots ``[first, stop)`` (``first`` a multiple of the group)."""
        slots, group = self.slots, self.slots.group
        first_group, stop_group = first // group, -(-stop // group)
        columns = (stop_group - first_group) * group
        buffer = self.key_buffer
        unpack_into(slots.keys[:, :, first : first + columns], slots.bits, buffer[:, :, :columns])
        grouped_keys = buffer[:, :, :columns].unflatten(2, (-1, group))
        key_min = slots.key_min[:, :, first_group:stop_group, None].float()
        key_scale = slots.key_scale[:, :, first_group:stop_group, None].float()
        torch.addcmul(key_min, grouped_keys, key_scale, out=grouped_keys)
        flat = buffer.view(-1, buffer.shape[-1])
        for (keys, _, _), into in zip(self.flat_exact, self._into(first), strict=True):
            flat.index_copy_(0, into, keys)
        return buffer.flatten(0, 1)[:, : stop - first]

    def values(self, first: int, stop: int) -> torch.Tensor:
        """``[B H, stop - first, d_v]`` float32 values of slots ``[first, stop)``."""
        slots, buffer = self.slots, self.value_buffer
        count = stop - first
        unpack_into(slots.tensors["values"][:, :, first:stop], slots.bits, buffer[:, :, :count])
        value_scale = slots.tensors["value_scale"][:, :, first:stop, :, None].float()
        grouped_values = buffer[:, :, :count].unflatten(-1, (value_scale.shape[-2], -1))
        value_min = slots.tensors["value_min"][:, :, first:stop, :, None].float()
        grouped_values.mul_(value_scale).add_(value_min)
        flat = buffer.view(-1, buffer.shape[-1])
        for (_, values, _), into in zip(self.flat_exact, self._into(first), strict=True):
            flat.index_copy_(0, into, values)
        return buffer.flatten(0, 1)[:, :count]
