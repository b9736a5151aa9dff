"""Choosing victims: the lowest-scoring tokens of a ``Keep`` rule, without sorting while decoding.

Scores are ranked in their own dtype (integers as float64 in a layer storing padding; elsewhere as integers, whose
largest value stands for ``+inf``): padding first, then by score, protected tokens last; equal scores evict the older
token first. One victim per row (a decoding step) is an ``argmin``; several a stable sort.
"""

from __future__ import annotations

import math

import torch

from kvcompress.core.contract import Keep, LayerView, Policy

_LAST = torch.iinfo(torch.long).max


def protects_forward(policy: Policy, rule: Keep, new_tokens: int) -> bool:
    """Whether this forward's ``new_tokens`` rank above every unprotected token (below the rule's protected ones).

    A decode-time method never evicts the tokens of the forward being processed (a question after a compressed
    context, the token just decoded) while ``count`` leaves room for them; a longer forward (a prompt chunk) is
    ranked like every other token. Not needed when the rule protects as many newest tokens itself."""
    return not (policy.one_shot or isinstance(rule.count, torch.Tensor)) and rule.newest_kept < new_tokens <= rule.count


def ranked_scores(rule: Keep, layer: LayerView, protect_new: bool = False) -> torch.Tensor:
    """``[B, H, W]`` scores of the rule with padding at ``-inf`` and protected real tokens at ``+inf``; with
    ``protect_new`` this forward's real tokens at the largest finite value (above every score, below protected)."""
    if layer.all_valid:  # no padding stored and no free slot in the view (see ``LayerView.all_valid``)
        return _ranked_all_valid(rule.scores, rule.protected, layer, protect_new)
    scores = rule.scores if rule.scores.is_floating_point() else rule.scores.double()
    valid = layer.valid
    padding = ~valid
    ranked = scores.expand_as(valid).masked_fill(padding, -math.inf)
    if protect_new:
        ranked.scatter_(-1, layer.new_index().expand(*ranked.shape[:2], -1), torch.finfo(ranked.dtype).max)
        ranked.masked_fill_(padding, -math.inf)  # a new token that is padding stays first to go
    if rule.protected is not None:
        ranked = ranked.masked_fill(rule.protected & valid, math.inf)
    return ranked


def _ranked_all_valid(
    scores: torch.Tensor, protected: torch.Tensor | None, layer: LayerView, protect_new: bool
) -> torch.Tensor:
    """``ranked_scores`` when every slot in the view holds a real token: two ops at most."""
    shape = (*layer.rows, scores.shape[-1])
    ranked = scores.expand(shape)
    floating = ranked.is_floating_point()
    last = math.inf if floating else torch.iinfo(ranked.dtype).max
    if protect_new:
        top = torch.finfo(ranked.dtype).max if floating else last - 1
        ranked = ranked.scatter(-1, layer.new_index().expand(*shape[:2], -1), top)
    if protected is not None:
        ranked = ranked.masked_fill(protected, last)
    return ranked


def lowest_victims(
    ranked: torch.Tensor, token_idx: torch.Tensor, count: int, ordered: bool, untied: bool = False
) -> torch.Tensor:
    """``[B, H, count]`` positions of the lowest ``ranked`` values per row, older tokens first among equals.

    ``ordered``: positions are in stream order already (then ties need no token index); ``untied``: the lowest
    value of a row is unique, or ``ordered`` holds (then ``argmin``, which takes the first position, suffices)."""
    if count == 1 and untied:
        return ranked.argmin(dim=-1, keepdim=True)
    if count == 1:
        low = ranked.amin(dim=-1, keepdim=True)
        return torch.where(ranked == low, token_idx, _LAST).argmin(dim=-1, keepdim=True)
    if ordered:
        return ranked.sort(dim=-1, stable=True).indices[..., :count]
    by_token = token_idx.argsort(dim=-1)
    order = ranked.gather(-1, by_token).sort(dim=-1, stable=True).indices[..., :count]
    return by_token.gather(-1, order)


def victims_of_rule(
    rule: Keep, layer: LayerView, protect_new: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The victims of ``rule`` (``None``: nothing to evict; ``protect_new``: see ``ranked_scores``) and, for
    per-sequence counts, the tokens that stay in their slots but no longer count as kept (a sequence keeping fewer
    than the longest row: ``[B, H, W]``)."""
    count = rule.count
    if not isinstance(count, torch.Tensor):
        excess = layer.occupied - count
        if excess <= 0:
            return None, None
        # every slot holds a real token: the minimum is an unprotected real token's score, distinct or first in order
        untied = layer.all_valid and (rule.distinct or layer.ordered)
        ranked = ranked_scores(rule, layer, protect_new)
        return lowest_victims(ranked, layer.token_idx, excess, layer.ordered, untied), None
    # per-sequence counts (a one-shot ratio): once per prompt, so host syncs are fine
    most = int(count.max())
    excess = max(0, layer.occupied - most)
    ranked = ranked_scores(rule, layer)
    width = ranked.shape[-1]
    order = lowest_victims(ranked, layer.token_idx, width, layer.ordered)
    place = torch.empty_like(order).scatter_(-1, order, torch.arange(width, device=order.device).expand_as(order))
    invalidate = (place >= excess) & (place < excess + (most - count)[:, None, None])
    return (order[..., :excess] if excess else None), invalidate
