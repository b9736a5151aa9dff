"""PoD's decoding step while a layer's proximal keys are in its ring (``kvcompress.methods.pod.ring``): one query
per sequence, no padding, the plain mixed softmax. Each part is one attention call that also returns its
log-sum-exp: the CPU's fused kernel, elsewhere (no such kernel with a mask on a GPU) the logits, their
log-sum-exp and one matmul, in float32. The layer's head layout is planned once (``RingPlan``); a step makes only
views of the stores, four or five attention calls and the Eq. 4 merge."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.methods.pod.fused import FLASH, whole_groups


@dataclass(frozen=True)
class RingPlan:
    """A layer's head layout for ``ring_attention`` (Python values, fixed for the cache's life)."""

    groups: int  # query heads per KV head
    share_rows: tuple[int, int] | None  # (first, count) of the sharing query heads if consecutive (else a copy)
    full_rows: tuple[int, int] | None  # the same for the block-start query heads ((0, 0): none)
    runs: tuple[tuple[int, int, int, int, int], ...]  # (first sharing index, count, KV head, block start, key row)
    ordered: str | None  # "full-first" / "shared-first": the two parts concatenate into head order; None: scatter


def ring_plan(layer, query: torch.Tensor, config, starts: tuple[int, ...], sharing: list[int]) -> RingPlan | None:
    """The layer's plan, or None where its decoding steps cannot use the ring: another attention form (``tau``,
    ``combine="lse"``), or sharing query heads that are not whole groups of its proximal-only KV heads."""
    if config.tau is not None or config.combine != "softmax":
        return None
    groups = query.shape[1] // layer.values.shape[1]
    prox, full = layer.head_lists["prox"], layer.head_lists["full"]
    if not sharing or not whole_groups(sharing, starts, groups) or sorted({h // groups for h in sharing}) != prox:
        return None
    runs: list[list[int]] = []
    for index, head in enumerate(prox):
        start = starts[head * groups]
        row = layer.peers[start].full_pos[head]
        last = runs[-1] if runs else None
        if last and last[3] == start and last[2] + last[1] == head and last[4] + last[1] == row:
            last[1] += 1
        else:
            runs.append([index, 1, head, start, row])
    ordered = None
    if _run(full) and _run(prox):
        ordered = "full-first" if not prox or (full and full[-1] < prox[0]) else "shared-first"
    return RingPlan(groups, _rows(prox, groups), _rows(full, groups), tuple(tuple(r) for r in runs), ordered)


def _run(heads: list[int]) -> bool:
    return heads == list(range(heads[0], heads[0] + len(heads))) if heads else True


def _rows(heads: list[int], groups: int) -> tuple[int, int] | None:
    """The query heads of KV ``heads`` as ``(first, count)`` if consecutive, else None."""
    if not heads:
        return (0, 0)
    return (heads[0] * groups, len(heads) * groups) if _run(heads) else None


def ring_attention(layer, plan: RingPlan, query: torch.Tensor, config, scale: float) -> torch.Tensor:
    """The step's output ``[B, H_q, 1, d]``: the sharing KV heads over the ring with their own query rows and over
    the stored distant tokens with their block start's query and keys (one call per run of KV heads the block start
    holds side by side), merged by Eq. 4; the block-start KV heads over their full keys. Each KV head's query heads
    are folded into query rows (one query sees every key: no mask, no key repeated)."""
    ring = layer.ring
    batch, _, _, dim = query.shape
    length, groups = layer.values.shape[2], plan.groups
    shared = ring.keys.shape[1]
    rows = _query_rows(layer, query, plan.share_rows, "prox", groups)
    o_near, lse_near = _attention(rows, ring.keys, ring.values, ring.bias, scale)
    parts, distant = [], ring.distant(length)
    for first, count, head, start, row in plan.runs:
        step = layer.peers[start].step
        if step is None or step.keys.shape[2] != length:
            raise RuntimeError(f"pod: layer {start} (block start of layer {layer.index}) has no matching step")
        source = step.query if config.query_source == "block_start" else query
        source = source.narrow(1, head * groups, count * groups).reshape(batch, count, groups, dim)
        keys, values = step.keys.narrow(1, row, count), layer.values.narrow(1, head, count)
        parts.append(_attention(source, keys, values, distant.narrow(1, first, count), scale))
    o_far, lse_far = parts[0] if len(parts) == 1 else (torch.cat(p, dim=1) for p in zip(*parts, strict=True))
    has_distant = ring.has_distant(length)
    if has_distant is not None:  # rows without a distant token take the proximal part alone
        lse_far = lse_far.masked_fill(~has_distant, -math.inf)
    gate = torch.sigmoid(lse_near - lse_far)[..., None].to(o_near.dtype)
    mixed = torch.lerp(o_far, o_near, gate)  # [B, S, G, d]
    if plan.full_rows == (0, 0):
        return mixed.reshape(batch, shared * groups, 1, dim)
    full_rows = _query_rows(layer, query, plan.full_rows, "full", groups)
    full_values = layer.heads_of(layer.values, "full")
    out, _ = _attention(full_rows, layer.keys, full_values, None, scale)  # [B, F, G, d]
    if plan.ordered is not None:
        parts = [out, mixed] if plan.ordered == "full-first" else [mixed, out]
        return torch.cat(parts, dim=1).reshape(batch, -1, 1, dim)
    output = query.new_empty(batch, layer.values.shape[1], groups, dim)
    output.index_copy_(1, layer.prox_heads, mixed).index_copy_(1, layer.full_heads, out)
    return output.reshape(batch, -1, 1, dim)


def _attention(query, keys, values, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``query`` ``[B, n, G, d]`` over ``keys``/``values`` ``[B, n, L, d]`` under an additive ``mask``
    ``[B, n, 1, L]`` (or None): the output and the log-sum-exp ``[B, n, G]`` (-inf and a zero output for a row that
    sees nothing)."""
    if FLASH is not None and query.device.type == "cpu":
        return FLASH(query, keys, values, 0.0, False, attn_mask=mask, scale=scale)
    logits = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        logits.add_(mask)
    lse = logits.logsumexp(-1)
    weights = (logits - lse.clamp(min=torch.finfo(logits.dtype).min)[..., None]).exp_()
    return torch.matmul(weights.to(values.dtype), values), lse


def _query_rows(layer, query: torch.Tensor, rows: tuple[int, int] | None, kind: str, groups: int) -> torch.Tensor:
    """The query heads of the layer's KV heads of ``kind``, folded per KV head: ``[B, n, G, d]``."""
    batch, _, _, dim = query.shape
    if rows is not None:
        return query.narrow(1, *rows).reshape(batch, -1, groups, dim)
    heads = layer.head_lists[kind]
    index = layer.head_index([h * groups + k for h in heads for k in range(groups)])
    return query.index_select(1, index).reshape(batch, len(heads), groups, dim)
