"""NaCl's per-layer policies: proxy-query buffering, proxy scores, the hybrid top-k + random selection."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.profiler import record_function

from kvcompress.core.attention import attention_with_stats
from kvcompress.core.contract import Keep, Policy, StatsRequest
from kvcompress.core.hashing import hash_uniform
from kvcompress.core.selection import keep_top
from kvcompress.core.softmax import chunked_softmax

PROXY_CHUNK_ELEMENTS = 1 << 20  # proxy-score logits per chunk (4 MiB of float32), whatever the prompt length


class NaClSplit(NamedTuple):
    """How one sequence's budget is spent (tokens); ``kept == sinks + recent + top + random`` when evicting."""

    kept: int  # tokens kept per KV head (the prompt length when nothing is evicted)
    sinks: int  # first tokens always kept
    recent: int  # last tokens always kept
    top: int  # C_p: top tokens by proxy score
    random: int  # C_r: tokens sampled from softmax(score / temperature)
    proxy: int  # proxy queries scoring the prompt


class NaClPolicy(Policy):
    """One-shot NaCl: buffer the proxy queries during the prefill, score and select once, then append. The phases
    run under ``torch.profiler`` labels ``kvcompress.nacl.buffer``, ``.scores`` and ``.select``. (A policy belongs
    to one layer of one cache: the proxy-query buffer, freed at compression, and the decode counters live here.)"""

    one_shot = True

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.per_head = config.head_wise
        self.splits: list[NaClSplit] = []  # the split of each sequence, fixed when the layer compresses
        self.decode_steps = 0  # tokens decoded since the last eviction (decode_interval)
        self.decode_events = 0  # evictions while decoding so far (each draws fresh noise)
        self.clear_proxies()

    def clear_proxies(self) -> None:
        self.proxy_query: torch.Tensor | None = None  # [B, H_q, n, d] post-RoPE queries that may be proxies
        self.proxy_rows: torch.Tensor | None = None  # [n] their stream indices
        self.proxy_scaling: float | None = None

    def init_state(self, layer, keys):
        return {"score": torch.zeros(keys.shape[:3], device=keys.device)}

    def attend(self, layer, query, key, value, mask, scaling):
        """Prefill: buffer the queries that can still be proxies, attention stays SDPA. Decode: re-evict every ``m``
        steps."""
        if not layer.compressed:
            with record_function("kvcompress.nacl.buffer"):
                count = layer.new_tokens
                if layer.seen == count:  # first forward of this (possibly reset) layer
                    self.clear_proxies()
                rows = torch.arange(layer.seen - count, layer.seen, device=query.device)
                if self.proxy_query is not None:
                    query = torch.cat([self.proxy_query, query], dim=2)
                    rows = torch.cat([self.proxy_rows, rows])
                wanted = self._proxy_row_mask(layer, rows).any(0)
                self.proxy_query, self.proxy_rows = query[:, :, wanted], rows[wanted]
                self.proxy_scaling = scaling
            return None
        interval = self.config.decode_interval
        if interval is None or not self.splits:
            return None
        self.decode_steps += layer.new_tokens
        if self.decode_steps < interval:
            return None
        # Algorithm 1 lines 26-27: the same rule scored by this query's attention row, down to the prefill's budget
        output, stats = attention_with_stats(query, key, value, mask, scaling, StatsRequest(last_queries=1))
        self.decode_steps = 0
        self.decode_events += 1
        scores = reduce_groups(stats.last[:, :, :, -1], self.config.gqa_reduce)
        # the output above saw every key; eviction follows the attention as usual
        layer.apply(self.hybrid_selection(layer, scores, self.splits, event=self.decode_events))
        return output, None

    def _proxy_row_mask(self, layer, rows: torch.Tensor) -> torch.Tensor:
        """``[B, n]``: which stream rows are proxy queries of each sequence (before compression: stored == stream).
        A row wanted now may stop being wanted as the prompt grows, never the reverse: trimming is safe."""
        valid = layer.valid[:, 0]
        rank = valid.cumsum(-1) - 1  # rank of each token among the sequence's real tokens
        bounds = torch.tensor([self.config.proxy_bounds(n) for n in valid.sum(-1).tolist()], device=valid.device)
        row_rank = rank[:, rows]
        return valid[:, rows] & (row_rank >= bounds[:, :1]) & (row_rank < bounds[:, 1:])

    # --- the one eviction ----------------------------------------------------------------------------------
    def select(self, layer):
        n_real = layer.valid[:, 0].sum(-1).tolist()  # (one host read)
        self.splits = [self.config.split(n) for n in n_real]
        self.decode_steps = self.decode_events = 0
        if all(s.kept >= n for s, n in zip(self.splits, n_real, strict=True)) or self.proxy_query is None:
            self.clear_proxies()
            return None
        with record_function("kvcompress.nacl.scores"):
            layer.state["score"] = scores = self.proxy_scores(layer)
        self.clear_proxies()
        with record_function("kvcompress.nacl.select"):
            return self.hybrid_selection(layer, scores, self.splits, event=0)

    def proxy_scores(self, layer) -> torch.Tensor:
        """``[B, H_kv, L]`` float32: per KV head, the summed softmax rows of the proxy queries (Eq. proxy-score),
        in chunks of proxy rows (at most ``chunk x L`` logits per head)."""
        rows, causal = self.proxy_rows, self.config.proxy_causal
        key_visible, key_idx = layer.valid[:, :, None, :], layer.token_idx[:, :, None, :]

        def visible(start: int, stop: int) -> torch.Tensor:
            return key_visible & (key_idx <= rows[start:stop][None, None, :, None]) if causal else key_visible

        mask, weight = visible, self._proxy_row_mask(layer, rows)
        if causal and _last_rows_of_a_dense_layer(layer, rows):
            mask, weight = None, None  # plain causal attention of the last rows: only the diagonal block is masked
        query, keys = self.proxy_query.float(), layer.keys.float()
        parts = chunked_softmax(
            query, keys, mask, self.proxy_scaling, received=True, row_weight=weight, chunk_elements=PROXY_CHUNK_ELEMENTS
        )
        return reduce_groups(parts.received, self.config.gqa_reduce)

    # --- protected + top-C_p + sampled C_r, per sequence and head -------------------------------------------
    def hybrid_selection(self, layer, scores: torch.Tensor, splits: list[NaClSplit], event: int) -> Keep | None:
        """Keep, per sequence and KV head, sinks + recent + top-``C_p`` + ``C_r`` sampled (all, if not evicting)."""
        config = self.config
        heads = scores.shape[1] if config.head_wise else 1
        scores = scores if config.head_wise else scores.mean(dim=1, keepdim=True)
        valid = layer.valid[:, :heads]

        def per_sequence(name: str) -> torch.Tensor:
            return torch.tensor([getattr(s, name) for s in splits], device=valid.device)[:, None, None]

        rank = valid.cumsum(-1) - 1
        from_end = valid.flip(-1).cumsum(-1).flip(-1) - 1
        protected = valid & ((rank < per_sequence("sinks")) | (from_end < per_sequence("recent")))
        middle = valid & ~protected
        score = scores.to(torch.float64).masked_fill(~middle, -math.inf)
        top = middle & (descending_rank(score) < per_sequence("top"))
        rest = middle & ~top
        noise = gumbel(config.seed, self.layer_idx + 4096 * event, heads, layer.rope_pos[:, :heads])
        key = noise if config.sampling == "uniform" else score / config.temperature + noise
        sampled = rest & (descending_rank(key.masked_fill(~rest, -math.inf)) < per_sequence("random"))
        kept = per_sequence("kept")
        keep = torch.where(kept < valid.sum(-1, keepdim=True), protected | top | sampled, valid)
        return keep_top(layer, keep.to(torch.float64), kept[:, 0, 0])


def _last_rows_of_a_dense_layer(layer, rows: torch.Tensor) -> bool:
    """Whether the proxy ``rows`` are the last stream rows and every slot holds the real token of its own index
    (each proxy then sees exactly the keys up to its own). Two host reads per layer and compression."""
    length = layer.keys.shape[2]
    if not layer.all_valid or rows.numel() == 0 or rows.numel() > length:
        return False
    stream = torch.arange(length, device=rows.device)
    return bool(torch.equal(rows, stream[length - rows.numel() :]) and (layer.token_idx == stream).all())


def reduce_groups(scores: torch.Tensor, how: str) -> torch.Tensor:
    """``[B, H_kv, G, L]`` -> ``[B, H_kv, L]`` over the query heads sharing a KV head."""
    return getattr(scores, "amax" if how == "max" else how)(dim=2)  # "sum", "mean" or "max"


def descending_rank(values: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim, largest first; equal values rank the earlier entry first."""
    return values.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1)  # the inverse permutation


def gumbel(seed: int, stream: int, heads: int, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, heads, L]`` from a hash of (seed, stream, head, RoPE position)."""
    head = torch.arange(heads, device=positions.device)[None, :, None]
    uniform = hash_uniform(seed, stream, head, positions) + 2.0**-32  # in (0, 1)
    return -torch.log(-torch.log(uniform))


class NaClGreedyPolicy(NaClPolicy):
    """Table 3 "− Global Eviction": the hybrid rule after every forward, scored by accumulated attention."""

    one_shot = False
    stats = StatsRequest(received=True)

    attend = Policy.attend  # the default attention: no proxy queries buffered (every query scores)

    def observe(self, layer, stats):
        layer.state["score"].add_(reduce_groups(stats.received, self.config.gqa_reduce))

    def select(self, layer):
        splits = [self.config.split(n) for n in layer.valid[:, 0].sum(-1).tolist()]
        return self.hybrid_selection(layer, layer.state["score"], splits, event=0)
