"""Scissorhands (Liu et al., 2023, arXiv:2305.17118): the persistence of importance.

Each KV head counts, over a history window of the last ``history`` queries, how often a token received less than
the average attention of its row (``1 / visible keys``); the tokens with the most such low-importance counts are
evicted first and the ``recent`` newest tokens are always kept. A token counts as low only for queries that could
see it. With grouped-query attention the row is averaged over the query heads of a KV head.

Choices where the paper is silent for our setting: eviction runs every step down to the budget (the paper drops a
batch of ``m`` tokens when the buffer is full; a batch drop needs a cache larger than the budget), ties go to the
newer token, and ``recent`` defaults to a quarter of the budget. The score is kept up to date as one float64
per token (stream index − 2^32 × low count): exact, and ordered as (fewer low counts, newer) for streams of fewer
than 2^32 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, ints, param
from kvcompress.core.contract import MethodConfig, Policy, StatsRequest
from kvcompress.core.replay import last_index, put_last_index
from kvcompress.core.selection import keep_top, recent_mask
from kvcompress.core.slots import stream_range

MAX_HISTORY = 8192  # each stored token keeps one bit per query of the history window, per KV head
LOW_WEIGHT = float(2**32)  # one low bit outweighs any stream index (< 2^32); counts * weight stay exact in float64


class ScissorhandsPolicy(Policy):
    batchable = True  # a decoding step's update and selection work per row on the state: run for all layers at once

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.stats = StatsRequest(last_queries=config.history)

    def init_state(self, layer, keys):
        batch, heads, count = keys.shape[:3]
        new = stream_range(layer.seen_step, count, keys.device, torch.float64)  # the new tokens' stream indices
        return {
            "low": torch.zeros(batch, heads, count, self.config.history, dtype=torch.bool, device=keys.device),
            # the eviction score, kept up to date: the token's stream index minus LOW_WEIGHT times its low bits
            # summed over the window. Fewer low counts rank higher, and among equal counts the newer token (the
            # index breaks ties, so every score is distinct); exact in float64
            "score": new.expand(batch, heads, count),
        }

    def observe(self, layer, stats):
        """The history window is a ring of ``history`` columns: the query of stream index ``t`` writes column
        ``t % history`` (a forward's queries are the stream indices before ``seen``), so it holds the bits of the
        last ``history`` queries and needs no counter of its own."""
        rows = stats.last.mean(dim=2)  # [B, H_kv, n, L]
        if stats.last_visible is None:  # one query that sees every key: the average is 1 / L
            low = (rows < 1.0 / rows.shape[-1]).transpose(-1, -2)  # [B, H_kv, L, n]
        else:
            visible = stats.last_visible.expand_as(rows)
            average = 1.0 / visible.sum(dim=-1, keepdim=True).clamp(min=1)
            low = (visible & (rows < average)).transpose(-1, -2)
        history, window = self.config.history, layer.state["low"]
        if low.shape[-1] == 1:  # one query: the count changes by the new bit minus the one it overwrites
            column = (layer.seen_step - 1) % history  # (an int, or a device scalar: ``core.replay``)
            layer.state["score"].add_(last_index(window, column), alpha=LOW_WEIGHT).add_(low[..., 0], alpha=-LOW_WEIGHT)
            put_last_index(window, column, low[..., 0])
        else:
            rows_kept = min(low.shape[-1], history)  # the window holds the last ``history`` queries
            columns = torch.arange(layer.seen - rows_kept, layer.seen, device=low.device) % history
            window.index_copy_(-1, columns, low[..., -rows_kept:])
            layer.state["score"] = layer.token_idx.double() - LOW_WEIGHT * window.sum(dim=-1).double()

    def select(self, layer):
        recent = self.config.budget // 4 if self.config.recent is None else self.config.recent
        protected = recent_mask(layer, recent)
        return keep_top(layer, layer.state["score"], self.config.budget, protected, newest_kept=recent, distinct=True)


@dataclass(frozen=True)
class ScissorhandsConfig(MethodConfig):
    """Evict the tokens most often below average attention within a history window."""

    budget: int = param(1024, check_budget)  # tokens kept per layer and KV head
    history: int = param(256, ints(1, MAX_HISTORY))  # queries in the history window
    recent: int | None = param(None, ints(0, "budget"))  # newest tokens always kept; None = budget // 4

    name = "scissorhands"
    paper = "https://arxiv.org/abs/2305.17118"
    policy_class = ScissorhandsPolicy
