"""BUZZ's per-layer policy: segmented local heavy hitters, stride thinning, optional log-n attention scaling."""

from __future__ import annotations

import math

import torch

from kvcompress.core.attention import attention_with_stats
from kvcompress.core.contract import KeepMask, Policy, StatsRequest
from kvcompress.methods.nacl.policy import reduce_groups


class BuzzPolicy(Policy):
    stats = StatsRequest(received=True)
    position_mode = property(lambda self: self.config.position_mode)

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks, self.window, self.threshold, self.stride = config.resolved()
        new_stride, old_stride = self.stride, (self.stride + 1) // 2  # s and ŝ
        self.new_stride, self.old_stride = (old_stride, new_stride) if config.swap_strides else (new_stride, old_stride)

    def init_state(self, layer, keys):
        shape = keys.shape[:3]
        return {
            "score": torch.zeros(shape, device=keys.device),  # accumulated received attention (float32)
            "old": torch.zeros(shape, dtype=torch.bool, device=keys.device),  # survived at least one eviction
        }

    def observe(self, layer, stats):
        group = reduce_groups(stats.received, self.config.group_reduce)
        if self.config.score_mode == "current":
            layer.state["score"] = group.clone()
        else:
            layer.state["score"].add_(group)

    def select(self, layer):
        k, w, limit = self.sinks, self.window, self.threshold
        if layer.valid.shape[-1] <= k + w + limit:  # fast path: even if all stored slots were real, M <= T
            return None
        stretch = layer.new_tokens - w  # a forward longer than the window but within w + T is kept whole
        if 0 < stretch <= limit:
            w, limit = w + stretch, limit - stretch
        valid, old, score = layer.valid, layer.state["old"], layer.state["score"]
        rank = valid.cumsum(-1) - 1  # rank among the real tokens of the row
        count = valid.sum(-1, keepdim=True)  # [B, H, 1]; the same for every head of a sequence
        evict = count - k - w > limit
        if not bool(evict.any()):
            return None
        middle = valid & (rank >= k) & (rank < count - w)  # neither a sink nor in the window
        old = old & middle
        new = middle & ~old
        n_old = old.sum(-1, keepdim=True)
        keep_old = old & ((rank - k) % self.old_stride == 0)
        new_rank = rank - k - n_old
        stride = self.new_stride
        keep_new = local_max(score, new, new_rank, stride) if self.config.local_max else new & (new_rank % stride == 0)
        survivors = keep_old | keep_new
        if limit == 0:  # a forward of exactly w + T tokens: the middle gives all its room to it
            survivors = torch.zeros_like(survivors)
        elif self.config.prefill_mode == "loop":  # extra passes thin the (all old) survivors by old_stride each
            kept = survivors.sum(-1, keepdim=True)
            every = torch.ones_like(kept)
            while bool((over := kept > limit).any()):
                every = torch.where(over, every * self.old_stride, every)
                kept = torch.where(over, -(-kept // self.old_stride), kept)
            survivors &= (survivors.cumsum(-1) - 1) % every == 0
        keep = torch.where(evict, (valid & ~middle) | survivors, valid)
        layer.state["old"] = torch.where(evict, survivors, layer.state["old"])
        return KeepMask(keep)

    def attend(self, layer, query, key, value, mask, scaling):
        if not self.config.log_n:
            return None
        if not self.config.log_n_per_row:
            n = layer.valid[:, 0].sum(-1, keepdim=True)  # [B, 1] real keys of each sequence in this call
        elif mask is None:
            queries, length = query.shape[2], key.shape[2]
            n = torch.arange(length - queries + 1, length + 1, device=query.device).expand(query.shape[0], queries)
        else:
            n = mask[:, 0].sum(-1)  # [B, q]; every KV head sees as many real keys
        factor = n[:, None, :, None].to(torch.float64).log() / math.log(self.config.log_n_base)
        return attention_with_stats(query * factor.to(query.dtype), key, value, mask, scaling, self.stats)


def local_max(score: torch.Tensor, new: torch.Tensor, new_rank: torch.Tensor, stride: int) -> torch.Tensor:
    """Algorithm 2 for every row at once: ``[B, H, L]`` mask of the earliest highest-scoring token of each hive.

    Hive ``c`` of a row holds its new tokens of rank ``c·s … c·s + s − 1`` (the last may be short).
    """
    length = score.shape[-1]
    hives = (length + stride - 1) // stride
    hive = torch.where(new, new_rank.div(stride, rounding_mode="floor"), hives)  # non-new tokens: a spare hive
    masked = score.masked_fill(~new, -math.inf)
    best = torch.full((*score.shape[:-1], hives + 1), -math.inf, dtype=score.dtype, device=score.device)
    best = best.scatter_reduce(-1, hive, masked, "amax")
    position = torch.arange(length, device=score.device).expand_as(hive)
    candidate = torch.where(new & (masked == best.gather(-1, hive)), position, length)
    first = torch.full_like(best, length, dtype=torch.long).scatter_reduce(-1, hive, candidate, "amin")
    return new & (position == first.gather(-1, hive))
