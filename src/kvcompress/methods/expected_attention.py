"""Expected attention (kvpress 0.5.5's ``ExpectedAttentionPress``; Devoto et al., 2025, arXiv:2510.00636): score
each stored key by the attention future queries are expected to pay it, times its value's norm.

The prompt's queries (un-rotated, i.e. before RoPE) are summarised per query head by their mean ``mu`` and
covariance ``S`` (the first ``n_sink`` tokens' queries left out: outliers). Future queries sit at the next
``n_future_positions`` positions, so the statistics are turned by the RoPE rotation averaged over those positions,
``R = mean_t R_t``: ``mu' = R mu``, ``S' = R S R^T``. A Gaussian query gives the expected logit of key ``k``
``mu'.k / sqrt(d) + k^T S' k / (2 d)``; the scores are the softmax of that over the keys (sinks left out), averaged
over the query heads of each KV head, then ``(score + epsilon) * |v|``. The first ``n_sink`` tokens are always kept.
Defaults are kvpress's: ``n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0``.

Choices where the source leaves room:

- kvpress recomputes the pre-RoPE queries from the layer's input; here the model's own (rotated) queries are turned
  back by their RoPE position (exact up to float rounding; the model's ``attention_scaling`` factor, 1 for plain
  RoPE, then sits in ``mu`` and ``S`` once, as kvpress's rotation matrix carries it once). Partial rotary models
  rotate only their rotary dimensions (kvpress assumes full rotary); a model without RoPE (GPT-2) takes its
  queries as they are and turns nothing.
- Statistics are accumulated in float32 over every forward of the prompt (a chunked prefill gives the same mean and
  covariance as one pass: chunks are merged exactly, Chan et al.'s pairwise update); left padding is left out.
  The covariance divides by the query count (kvpress's population covariance).
- The future positions follow the sequence's own real tokens: ``n .. n + n_future_positions - 1`` for a sequence of
  ``n`` prompt tokens (kvpress: the prompt length, the same without padding). The logit scale is ``1/sqrt(d)`` (head
  dimension ``d``), as kvpress writes it, whatever scaling the model's attention uses.
- One-shot, like kvpress: compressed once after the prompt (the context, when it is prefilled alone), decoding
  appends. Budget: ``ratio`` keeps ``max(1, floor(ratio * n))`` tokens per layer and KV head, sinks included (or a
  token ``budget``); ``allocation`` shares it among layers or heads (``kvcompress.methods.allocation``; kvpress's
  leaderboard entry "expected_attention" is ``allocation="adakv"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.core.checks import ints, number, param
from kvcompress.core.contract import Policy
from kvcompress.core.rope import rotate_by, rotate_half
from kvcompress.core.selection import sink_mask
from kvcompress.methods.allocation import ScorerConfig, allocated_keep


class QueryStatistics:
    """Running count, mean ``[B, H_q, d]`` and co-moment ``[B, H_q, d, d]`` of weighted query vectors (float32)."""

    def __init__(self) -> None:
        self.count = self.mean = self.moment = None

    def add(self, queries: torch.Tensor, weight: torch.Tensor, covariance: bool) -> None:
        """Fold in ``queries`` ``[B, H_q, q, d]`` with weights ``[B, q]`` (1 = counted, 0 = left out)."""
        queries = queries.float()
        weight = weight.float()[:, None, :, None]
        count = weight.sum(2)  # [B, 1, 1]
        mean = (queries * weight).sum(2) / count.clamp(min=1)
        moment = None
        if covariance:
            centred = (queries - mean[:, :, None]) * weight.sqrt()
            moment = centred.transpose(-1, -2) @ centred
        if self.count is None:
            self.count, self.mean, self.moment = count, mean, moment
            return
        total = self.count + count
        delta = mean - self.mean
        share = count / total.clamp(min=1)
        if covariance:
            scale = (self.count * share)[..., None]  # n_a n_b / (n_a + n_b)
            self.moment = self.moment + moment + scale * delta[..., :, None] * delta[..., None, :]
        self.mean = self.mean + delta * share
        self.count = total


class AveragedRotation:
    """The RoPE rotation averaged over positions ``start .. start + steps - 1`` (``start`` ``[B]``), its tables made
    once and applied to each statistic (``__call__``); dimensions past the rotary ones pass unchanged (all of them
    without RoPE: ``inv_freq`` None)."""

    def __init__(self, start: torch.Tensor, steps: int, inv_freq: torch.Tensor | None, dim: int) -> None:
        self.rotary = 0 if inv_freq is None else 2 * inv_freq.shape[-1]
        if inv_freq is None:
            return
        positions = start.to(torch.float64)[:, None] + torch.arange(steps, device=start.device, dtype=torch.float64)
        angles = positions[..., None] * inv_freq.to(start.device, torch.float64)  # [B, steps, d_rot / 2]
        cos, sin = angles.cos().mean(1), angles.sin().mean(1)  # [B, d_rot / 2]
        self.cos = torch.cat([cos, cos, cos.new_ones(cos.shape[0], dim - self.rotary)], -1)  # [B, d]
        self.sin = torch.cat([sin, sin, sin.new_zeros(sin.shape[0], dim - self.rotary)], -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, H, d]`` (or ``[B, H, d, e]`` along ``d``) turned by the averaged rotation."""
        if not self.rotary:
            return x
        shape = (x.shape[0], 1, x.shape[2]) + (1,) * (x.dim() - 3)
        cos, sin = self.cos.to(x.dtype).view(shape), self.sin.to(x.dtype).view(shape)
        moved = x.movedim(2, -1)
        half = torch.cat([rotate_half(moved[..., : self.rotary]), moved[..., self.rotary :] * 0], -1).movedim(-1, 2)
        return x * cos + half * sin


class ExpectedAttentionPolicy(Policy):
    one_shot = True
    needs_rope = True

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.queries = QueryStatistics()

    def attend(self, layer, query, key, value, mask, scaling):
        if not layer.compressed:  # the prompt's queries, turned back to their un-rotated form
            new = layer.new_index()[:, :1]  # [B, 1, q]
            positions = layer.rope_pos.gather(-1, new)
            counted = layer.valid.gather(-1, new) & (layer.rank.gather(-1, new) >= self.config.n_sink)
            plain = query if layer.inv_freq is None else rotate_by(query, -positions, layer.inv_freq)
            self.queries.add(plain, counted[:, 0], self.config.use_covariance)
        return None

    def select(self, layer):
        config, stats = self.config, self.queries
        self.queries = QueryStatistics()
        keys, values, valid = layer.keys.float(), layer.values.float(), layer.valid
        sinks = sink_mask(layer, config.n_sink) & valid
        n_real = layer.valid[:, 0].sum(-1)
        heads, dim = keys.shape[1], keys.shape[-1]
        turn = AveragedRotation(n_real, config.n_future_positions, layer.inv_freq, dim)
        mean = turn(stats.mean)
        groups = mean.shape[1] // heads
        grouped = keys.repeat_interleave(groups, dim=1)  # [B, H_q, W, d]
        logits = (grouped @ mean[..., None]).squeeze(-1) / math.sqrt(dim)
        if config.use_covariance:
            covariance = turn(turn(stats.moment / stats.count[..., None].clamp(min=1)).transpose(-1, -2))
            logits = logits + ((grouped @ covariance) * grouped).sum(-1) / dim / 2
        scored = valid & ~sinks
        logits = logits.masked_fill(~scored.repeat_interleave(groups, dim=1), -torch.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (a sequence with nothing but sinks: no row)
        scores = probs.view(*keys.shape[:2], groups, -1).mean(2)
        if config.use_vnorm:
            scores = (scores + config.epsilon) * values.norm(dim=-1)
        return allocated_keep(self, layer, scores, sinks)


@dataclass(frozen=True)
class ExpectedAttentionConfig(ScorerConfig):
    """Keys scored by the attention future queries are expected to pay them, times the value norm; once."""

    n_future_positions: int = param(512, ints(1))  # future positions the query statistics are rotated to (averaged)
    n_sink: int = param(4, ints(0))  # first tokens always kept, their queries and keys left out of the statistics
    use_covariance: bool = True  # the queries' covariance term (False: the mean alone)
    use_vnorm: bool = True  # multiply by the value's L2 norm
    epsilon: float = param(0.0, number(0, 1e6))  # added to the expected attention before the value norm

    name = "expected_attention"
    paper = "https://arxiv.org/abs/2510.00636"
    policy_class = ExpectedAttentionPolicy
