"""The one exact softmax over stored keys, in query chunks of at most ``CHUNK_ELEMENTS`` float32 logits (no
``T x T`` matrix per head), giving what the caller asks for: the output, each row's log-normaliser, the (optionally
weighted) mass each key receives, or the probability rows of the last queries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 logits per query chunk (~64 MB)
# query rows per chunk of a plain causal softmax: each chunk sees only the keys up to its last query, so smaller
# chunks skip more of the hidden upper triangle (128: a quarter of a 512-token prefill chunk's logits and masking)
CAUSAL_ROWS = 128

# A mask: boolean [B, H_kv or 1, q, L] (True = visible), a function (start, stop) -> the rows start..stop of it,
# or None for plain causal attention of the last q of L positions.
Mask = torch.Tensor | Callable[[int, int], torch.Tensor] | None


@dataclass
class SoftmaxParts:
    """What ``chunked_softmax`` computed; fields not asked for are ``None``."""

    output: torch.Tensor | None = None  # [B, H_q, q, d] in the value dtype
    lse: torch.Tensor | None = None  # [B, H_q, q] float32 log-normaliser of each row
    received: torch.Tensor | None = None  # [B, H_kv, G, L] float32 attention mass received (rows weighted)
    last: torch.Tensor | None = None  # [B, H_kv, G, n, L] float32 probability rows of the last n queries


def grouped(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H_q, ...]`` -> ``[B, H_kv, G, ...]``: the query heads sharing a KV head together (``repeat_kv`` order)."""
    return tensor.view(tensor.shape[0], kv_heads, tensor.shape[1] // kv_heads, *tensor.shape[2:])


def row_chunks(
    rows: int, elements_per_row: int, budget: int | None = None, most: int | None = None
) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of row chunks of at most ``budget`` (``CHUNK_ELEMENTS``) elements and ``most`` rows."""
    step = max(1, (CHUNK_ELEMENTS if budget is None else budget) // max(1, elements_per_row))
    step = step if most is None else min(step, most)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def causal_mask(queries: int, length: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q, L]``: the last ``q`` of ``L`` positions each see themselves and everything before."""
    key_idx = torch.arange(length, device=device)
    query_idx = torch.arange(length - queries, length, device=device)
    return (key_idx[None, :] <= query_idx[:, None])[None, None]


def chunked_softmax(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: Mask,
    scaling: float | None,
    *,
    value: torch.Tensor | None = None,
    lse: bool = False,
    received: bool = False,
    row_weight: torch.Tensor | None = None,
    last_n: int = 0,
    chunk_elements: int | None = None,
    rows_see_keys: bool = False,
) -> SoftmaxParts:
    """Softmax of ``query`` ``[B, H_q, q, d]`` over ``key`` ``[B, H_kv, L, d]`` (float32 logits), in query chunks.

    ``mask=None`` with several queries is plain causal attention of the last ``q`` of ``L`` positions: a chunk then
    computes logits only against the keys up to its last query and masks only its diagonal block. ``value``
    ``[B, H_kv, L, d]`` asks for the output; ``lse`` for the row log-normalisers; ``received`` for the mass each key
    receives, summed over rows (weighted by ``row_weight`` ``[B, q]`` if given; a row that sees no key counts for
    nothing); ``last_n`` for the probability rows of the last ``n`` queries. ``rows_see_keys``: the mask leaves every
    row a key (no row to zero after the softmax)."""
    batch, q_heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    if queries == 1 and mask is None and row_weight is None:
        return _one_query(query, key, scale, value, lse, received, last_n)
    groups = q_heads // kv_heads
    keys_t = _flat(key).transpose(1, 2)  # a view: the query heads of a group are folded into rows, never keys copied
    values = None if value is None else _flat(value)
    causal = mask is None and queries > 1
    outputs, lses, last_rows = [], [], []
    mass = torch.zeros(batch, kv_heads, groups, length, device=query.device) if received else None
    chunks = row_chunks(queries, batch * q_heads * length, chunk_elements, CAUSAL_ROWS if causal else None)
    for start, stop in chunks:
        rows = stop - start
        seen = length - queries + stop if causal else length  # keys any query of the chunk sees
        group_rows = grouped(query[:, :, start:stop], kv_heads).reshape(batch * kv_heads, groups * rows, dim)
        # the queries scaled, not the logits: rows x d values instead of rows x L (as SDPA does)
        logits = torch.bmm(group_rows * scale, keys_t[:, :, :seen]).view(batch, kv_heads, groups, rows, seen).float()
        if causal:  # only the chunk's own keys can be in a query's future: the block right of the diagonal
            future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
            logits[..., seen - rows :].masked_fill_(future, float("-inf"))
        elif mask is not None:  # None: one query that sees every key
            rows_mask = mask(start, stop) if callable(mask) else mask[:, :, start:stop]
            logits.masked_fill_(~rows_mask[:, :, None], float("-inf"))  # logits is this chunk's own tensor
        if lse:
            lses.append(logits.logsumexp(dim=-1))
        # in place, as logits are not needed, unless recorded for a backward pass (the same values, out of place)
        grad = logits.requires_grad
        probs = logits.softmax(dim=-1) if grad else torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        if mask is not None and not rows_see_keys:  # a row that sees nothing is all zero
            probs = probs.nan_to_num(0.0) if grad else probs.nan_to_num_(0.0)
        if values is not None:
            flat = probs.to(values.dtype).view(batch * kv_heads, groups * rows, seen)
            outputs.append(torch.bmm(flat, values[:, :seen]).view(batch, kv_heads, groups, rows, -1))
        if received and row_weight is None:
            mass[..., :seen].add_(probs.sum(dim=-2))
        elif received:  # the weighted column sums as one product: no weighted copy of the probabilities
            weight = row_weight[:, None, None, None, start:stop].to(probs.dtype)  # [B, 1, 1, 1, rows]
            mass[..., :seen].add_((weight @ probs).squeeze(-2))
        if last_n and stop > queries - last_n:
            rows_kept = probs[:, :, :, max(start, queries - last_n) - start :]
            last_rows.append(torch.nn.functional.pad(rows_kept, (0, length - seen)))
    return SoftmaxParts(
        None if value is None else _joined(outputs, 3).reshape(batch, q_heads, queries, -1),
        _joined(lses, -1).reshape(batch, q_heads, queries) if lse else None,
        mass,
        _joined(last_rows, 3) if last_rows else None,
    )


def _one_query(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    value: torch.Tensor | None,
    lse: bool,
    received: bool,
    last_n: int,
) -> SoftmaxParts:
    """``chunked_softmax`` for one query that sees every key (a decoding step): the probabilities are the received
    mass and the last row as they are."""
    batch, q_heads = query.shape[:2]
    kv_heads, length = key.shape[1], key.shape[2]
    logits = one_query_logits(query, key, scale)
    top = logits.amax(dim=-1) if lse else None
    probs = logits.softmax(dim=-1)
    row_lse = None
    if lse and logits.requires_grad:  # recorded for a backward pass: the same values, out of place
        row_lse = (top - probs.amax(dim=-1).log()).view(batch, q_heads, 1)
    elif lse:  # a row's largest probability is e^(max logit - lse) >= 1 / L: no underflow, half logsumexp's ops
        row_lse = top.sub_(probs.amax(dim=-1).log_()).view(batch, q_heads, 1)
    output = None if value is None else torch.bmm(probs.to(value.dtype), _flat(value)).view(batch, q_heads, 1, -1)
    probs = probs.view(batch, kv_heads, -1, length)
    return SoftmaxParts(output, row_lse, probs if received else None, probs.unsqueeze(3) if last_n else None)


def one_query_logits(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · q kᵀ`` ``[B H_kv, G, L]`` in float32, ``query`` ``[B, H_q, 1, D]``, ``key`` ``[B, H_kv, L, D]``: one
    product that also scales (``baddbmm`` with ``beta = 0`` never reads its input: an uninitialised scalar)."""
    batch, q_heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group_rows = query.reshape(batch * kv_heads, q_heads // kv_heads, dim)
    unread = query.new_empty(()).expand(group_rows.shape[0], group_rows.shape[1], length)
    logits = torch.baddbmm(unread, group_rows, _flat(key).transpose(1, 2), beta=0, alpha=scale)
    return logits if logits.dtype == torch.float32 else logits.float()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, d]`` -> ``[B * H, L, d]``: batched 3D matmuls are faster than broadcast 4D ones on CPU."""
    return tensor.flatten(0, 1)


def head_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` for ``[B, H, m, k]`` and ``[B, H, k, n]`` (no broadcasting) as one 3D batched matmul."""
    batch, heads = left.shape[:2]
    return torch.bmm(_flat(left), _flat(right)).view(batch, heads, left.shape[2], right.shape[3])


def _joined(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
