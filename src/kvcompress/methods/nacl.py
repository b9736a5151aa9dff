"""NaCl (Chen et al., ACL 2024, arXiv:2408.03675): one-shot prefill eviction with proxy tokens and random sampling.

Idea. Right after a layer's (exact) prefill attention, every KV head of that layer keeps, independently:
(a) a protected set: the first ``sinks`` tokens and the most recent tokens of the prompt;
(b) the top ``C_p`` tokens by *proxy score*, the column sums of the softmax attention rows of a few proxy queries
(by default the last tokens of the prompt, where the question sits; or an explicit span) — Eq. proxy-score, §5.1;
(c) ``C_r`` tokens sampled without replacement from the rest with probability ``softmax(score / temperature)``
("Random Possibility Sampling", §5.2), drawn with Gumbel-top-k (exactly successive sampling without replacement).
Everything else is evicted once; decoding then appends (the official code never evicts again; Algorithm 1's
re-eviction every ``m`` steps is ``decode_interval``).

Spec followed: ``shared/specs/nacl.md`` §1.4–1.7 (algorithm), §1.9 (proxy scores by re-computation from the proxy
queries only), §1.12 (pseudo-code) and the recommended decisions of §3:

- Budget (A7, Table 4). The kept count is ``max(1, floor(ratio * L))`` of the prompt's real tokens (the same count
  as every other ratio method here) or an explicit ``budget`` in tokens. It is split with the Table 4 shares:
  protected = ``protect_share`` of it (at least 2: token 0 and the last prompt token), the rest divided between
  top-k and random by ``random_share`` (e.g. 20 %: 2 % + 6 % + 12 % of the prompt, proxy window 18 %). Deriving
  the parts from the kept count instead of flooring each Table 4 fraction keeps ``|kept| == budget`` exactly; the
  parts equal the code's floors whenever those are exact (spec test vector: L = 3500 at 20 % -> 70/210/420).
  Ratios outside Table 4 and token budgets use the 20 % row's proportions (10 % protected, 2/3 of the rest
  random, proxy window 0.9 x the budget). ``preset="official-128k"`` is the official code's 128K setting
  (1 % protected, 1 % proxy window, 12 % top-k, 7 % random, 256 sinks, no eviction below 2048 tokens).
- Proxies (A1, A2, A4): the suffix window of Table 4's "No-protect Proxy" size (or ``proxy_tokens``, or
  ``proxy_span``) only scores; proxies are not kept unless they fall in the protected tail or win a place.
  Causal proxy attention by default (the rows the model really computed); ``proxy_causal=False`` is the code's.
- Sum over proxies, temperature 1 (A5); GQA: scores of the query heads of a KV group averaged (A6, ``gqa_reduce``).
- Determinism (A14): the Gumbel noise of a token is a hash of (seed, layer, KV head, RoPE position), so every
  layer and head draws an independent stream, the same seed gives the same sets, and a sequence gets the same draw
  alone or in a padded batch. Top-k ties go to the earlier token (A15).
- Proxy scores are computed when the layer compresses, from the buffered post-RoPE proxy queries against the
  stored keys, in chunks of proxy rows: an ``n_chunk x L`` block per head at a time, never ``L x L`` (the
  re-computation path of Appx A.7). The buffer holds only the queries that can still be proxies, so a chunked
  prefill gives exactly the scores of a one-pass prefill.
- Table 3 ablations: ``random_share=1`` (no proxy top-k part), ``random_share=0`` (no random part),
  ``sampling="uniform"`` (no probability sampling), ``eviction="greedy"`` (step-by-step: after every forward the
  same hybrid rule down to ``budget``, scored by the attention accumulated from every query, H2O-like, since the
  greedy setting has no separate proxy window), ``head_wise=False`` (one selection per layer: scores averaged over
  heads, one draw, shared by all heads).
- Not implemented: the paper's literal "proxies always kept" (``∪ P``) variant, which cannot respect the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcompress.methods.base import (
    AttentionStats,
    MethodConfig,
    Policy,
    Selection,
    StatsRequest,
    check_budget,
    check_choice,
    check_int_range,
    check_ratio,
    keep_top,
    ratio_budget,
)
from kvcompress.methods.random import hash_uniform

# Table 4 (Appx A.6): kept ratio -> (Protect Proxy, No-protect Proxy window, Proxy-Tokens Eviction, Random Eviction),
# all fractions of the prompt; the official code's first release used the 20 % row.
TABLE4: dict[float, tuple[float, float, float, float]] = {
    0.10: (0.01, 0.03, 0.02, 0.07),
    0.20: (0.02, 0.18, 0.06, 0.12),
    0.30: (0.015, 0.20, 0.105, 0.18),
}
# Official code, 128K InfiniteBench setting (commit 8eb45a14): same four fractions, plus sinks and minimum length.
OFFICIAL_128K: tuple[float, float, float, float] = (0.01, 0.01, 0.12, 0.07)
PRESET_SINKS = {"table4": 4, "official-128k": 256}
PRESET_MIN_EVICT = {"table4": 0, "official-128k": 2048}
PROXY_CHUNK_ELEMENTS = 1 << 22  # proxy-score logits per chunk (16 MiB of float32), whatever the prompt length
EPS = 1e-9  # guards floors against float error (0.1 * 700 = 70.00000000000001 is fine, 0.29 * 100 is not)


class NaClSplit(NamedTuple):
    """How one sequence's budget is spent (tokens); ``kept == sinks + recent + top + random`` when evicting."""

    kept: int  # tokens kept per KV head (the prompt length when nothing is evicted)
    sinks: int  # first tokens always kept
    recent: int  # last tokens always kept
    top: int  # C_p: top tokens by proxy score
    random: int  # C_r: tokens sampled from softmax(score / temperature)
    proxy: int  # proxy queries scoring the prompt


class NaClPolicy(Policy):
    """One-shot NaCl: buffer the proxy queries during the prefill, score and select once, then append.

    A policy belongs to one layer of one cache, so the proxy-query buffer (freed when the layer compresses) and
    the decode counters live here, beside the layer that owns keys, values and per-token state.
    """

    one_shot = True

    def __init__(self, config: NaClConfig, layer_idx: int) -> None:
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
        """Prefill: buffer the proxy candidates, attention stays SDPA. Decode: re-evict every ``m`` steps."""
        if not layer.compressed:
            self._buffer_proxy_queries(layer, query, scaling)
            return None
        interval = self.config.decode_interval
        if interval is None or not self.splits:
            return None
        self.decode_steps += layer.new_tokens
        if self.decode_steps < interval:
            return None
        from kvcompress.attention import attention_with_stats

        output, stats = attention_with_stats(query, key, value, mask, scaling, StatsRequest(last_queries=1))
        selection = self.reselect(layer, stats)
        if selection is not None:
            layer.apply(selection)  # the output above saw every key; eviction follows the attention as usual
        return output, None

    # --- prefill: keep the queries that can still be proxies ------------------------------------------------
    def _buffer_proxy_queries(self, layer, query, scaling):
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

    def _proxy_row_mask(self, layer, rows: torch.Tensor) -> torch.Tensor:
        """``[B, n]``: which stream rows are proxy queries of each sequence (before compression: stored == stream).

        A row wanted now may stop being wanted as the prompt grows, never the reverse, so trimming is safe.
        """
        valid = layer.valid[:, 0]
        rank = valid.cumsum(-1) - 1  # rank of each token among the sequence's real tokens
        n_real = valid.sum(-1)
        bounds = torch.tensor([self.config.proxy_bounds(int(n)) for n in n_real], device=valid.device)
        row_rank = rank[:, rows]
        return valid[:, rows] & (row_rank >= bounds[:, :1]) & (row_rank < bounds[:, 1:])

    # --- the one eviction ----------------------------------------------------------------------------------
    def select(self, layer):
        n_real = layer.valid[:, 0].sum(-1)
        self.splits = [self.config.split(int(n)) for n in n_real]
        self.decode_steps = self.decode_events = 0
        if all(s.kept >= int(n) for s, n in zip(self.splits, n_real, strict=True)) or self.proxy_query is None:
            self.clear_proxies()
            return None
        scores = self.proxy_scores(layer)
        layer.state["score"] = scores
        self.clear_proxies()
        return self.hybrid_selection(layer, scores, self.splits, event=0)

    def proxy_scores(self, layer) -> torch.Tensor:
        """``[B, H_kv, L]`` float32: per KV head, the summed softmax rows of the proxy queries (Eq. proxy-score).

        Computed in chunks of proxy rows from the buffered queries, so at most ``chunk x L`` logits per head exist.
        """
        query, rows = self.proxy_query, self.proxy_rows
        keys = layer.keys.float()
        batch, q_heads, n_rows, dim = query.shape
        kv_heads, length = keys.shape[1], keys.shape[2]
        groups = q_heads // kv_heads
        scale = dim**-0.5 if self.proxy_scaling is None else self.proxy_scaling
        is_proxy = self._proxy_row_mask(layer, rows)  # [B, n]
        key_valid, key_idx = layer.valid[:, :, None, None, :], layer.token_idx[:, :, None, None, :]
        total = torch.zeros(batch, kv_heads, groups, length, device=keys.device)
        chunk = max(1, PROXY_CHUNK_ELEMENTS // max(1, batch * q_heads * length))
        no_padding = bool(layer.valid.all())  # then stored index == stream index and every row sees a key
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            grouped = query[:, :, start:stop].float().reshape(batch, kv_heads, groups, stop - start, dim) * scale
            logits = grouped @ keys[:, :, None].transpose(-1, -2)  # [B, H_kv, G, c, L]
            row_idx = rows[start:stop][None, None, None, :, None]
            if no_padding:  # causal masking only touches the columns from this chunk's first row on
                if self.config.proxy_causal:
                    first = int(rows[start])
                    future = key_idx[..., first:] > row_idx
                    logits[..., first:].masked_fill_(future, float("-inf"))
            else:
                hidden = ~key_valid
                if self.config.proxy_causal:
                    hidden = hidden | (key_idx > row_idx)
                logits.masked_fill_(hidden, float("-inf"))
            # sum over rows of softmax = (1 / row sums) @ exp(logits - row max): no normalised copy is made
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            weight = is_proxy[:, None, None, start:stop].to(logits.dtype) / logits.sum(dim=-1)
            weight = weight.nan_to_num_(0.0)  # rows with no visible key (padding) count for nothing
            if not no_padding:
                logits.nan_to_num_(0.0)
            total += (weight[..., None, :] @ logits).squeeze(-2)
        return reduce_groups(total, self.config.gqa_reduce)

    # --- Algorithm 1 lines 26-27: optional re-eviction while decoding ---------------------------------------
    def reselect(self, layer, stats: AttentionStats) -> Selection | None:
        """The same rule scored by the current query's attention row, back down to the prefill's budget."""
        self.decode_steps = 0
        self.decode_events += 1
        scores = reduce_groups(stats.last[:, :, :, -1], self.config.gqa_reduce)
        return self.hybrid_selection(layer, scores, self.splits, event=self.decode_events)

    # --- protected + top-C_p + sampled C_r, per sequence and head -------------------------------------------
    def hybrid_selection(self, layer, scores: torch.Tensor, splits: list[NaClSplit], event: int) -> Selection | None:
        """Keep, per sequence and KV head, sinks + recent + top-``C_p`` + ``C_r`` sampled (all, if not evicting)."""
        config = self.config
        heads = scores.shape[1] if config.head_wise else 1
        if not config.head_wise:
            scores = scores.mean(dim=1, keepdim=True)
        valid = layer.valid[:, :heads]
        device = valid.device

        def per_sequence(name: str) -> torch.Tensor:
            return torch.tensor([getattr(s, name) for s in splits], device=device)[:, None, None]

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


def reduce_groups(scores: torch.Tensor, how: str) -> torch.Tensor:
    """``[B, H_kv, G, L]`` -> ``[B, H_kv, L]`` over the query heads sharing a KV head."""
    if how == "mean":
        return scores.mean(dim=2)
    if how == "sum":
        return scores.sum(dim=2)
    return scores.amax(dim=2)


def descending_rank(values: torch.Tensor) -> torch.Tensor:
    """Rank of each entry along the last dim, largest first; equal values rank the earlier entry first."""
    order = values.sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous())
    return ranks


def gumbel(seed: int, stream: int, heads: int, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, heads, L]`` from a hash of (seed, stream, head, RoPE position)."""
    head = torch.arange(heads, device=positions.device)[None, :, None]
    uniform = hash_uniform(seed, stream, head, positions) + 2.0**-32  # in (0, 1)
    return -torch.log(-torch.log(uniform))


class NaClGreedyPolicy(NaClPolicy):
    """Table 3 "− Global Eviction": the hybrid rule after every forward, scored by accumulated attention."""

    one_shot = False
    stats = StatsRequest(received=True)

    def attend(self, layer, query, key, value, mask, scaling):
        return None

    def observe(self, layer, stats):
        layer.state["score"] += reduce_groups(stats.received, self.config.gqa_reduce)

    def select(self, layer):
        n_real = layer.valid[:, 0].sum(-1)
        splits = [self.config.split(int(n)) for n in n_real]
        return self.hybrid_selection(layer, layer.state["score"], splits, event=0)


@dataclass(frozen=True)
class NaClConfig(MethodConfig):
    """Proxy-token top-k + random possibility sampling, per KV head, once after the prompt."""

    ratio: float | None = None  # kept fraction of the prompt, in (0, 1]; 0.1/0.2/0.3 use Table 4 (give this or budget)
    budget: int | None = None  # or: tokens kept per layer and KV head (split with the 20 % row's proportions)
    preset: str = "table4"  # "table4" (paper, Appx A.6) or "official-128k" (official code's 128K setting, ratio 0.2)
    protect_share: float | None = None  # share of the budget kept as sinks + recent ("Protect Proxy"); None = preset
    random_share: float | None = None  # share of the rest that is sampled (C_r / (C_p + C_r)); None = preset
    proxy_ratio: float | None = None  # proxy window, last fraction of the prompt ("No-protect Proxy"); None = preset
    proxy_tokens: int | None = None  # proxy window in tokens (the last ones), instead of proxy_ratio
    proxy_span: tuple[int, int | None] | None = None  # explicit proxies [start, stop) of the prompt; < 0 from the end
    sinks: int | None = None  # first tokens inside the protected part; None = preset (4; official 128K: 256)
    proxy_causal: bool = True  # proxy rows see only earlier keys, as in the prefill (official code: False)
    gqa_reduce: str = "mean"  # how the query heads of a KV group combine their scores: mean, sum or max
    temperature: float = 1.0  # sampling probabilities softmax(score / temperature) (paper: 1)
    sampling: str = "softmax"  # "softmax" (paper) or "uniform" (Table 3 "− Probability Sampling")
    head_wise: bool = True  # False: one selection per layer shared by all heads (Table 3 "− Head-wise Eviction")
    eviction: str = "one_shot"  # "one_shot" (paper) or "greedy" (Table 3 "− Global Eviction"; needs budget)
    decode_interval: int | None = None  # re-evict every m decode steps (Algorithm 1 l. 26-27); None = never (code)
    min_evict_len: int | None = None  # prompts this short are not evicted; None = preset (0; official 128K: 2048)
    seed: int = 0  # seed of the random part (streams per layer and KV head)

    name = "nacl"
    paper = "https://arxiv.org/abs/2408.03675"
    policy_class = NaClPolicy

    def policy(self, layer_idx: int) -> Policy:
        return (NaClGreedyPolicy if self.eviction == "greedy" else NaClPolicy)(self, layer_idx)

    # --- budget arithmetic ---------------------------------------------------------------------------------
    def preset_fractions(self) -> tuple[float, float, float, float] | None:
        """The preset's (protect, proxy window, top-k, random) fractions of the prompt, or None (generic split)."""
        if self.preset == "official-128k":
            return OFFICIAL_128K
        if self.ratio is not None:
            for ratio, row in TABLE4.items():
                if abs(ratio - self.ratio) < 1e-9:
                    return row
        return None

    def shares(self) -> tuple[float, float]:
        """(protected share of the budget, random share of the rest)."""
        row = self.preset_fractions()
        protect, random = (0.1, 2 / 3) if row is None else (row[0] / (row[0] + row[2] + row[3]), row[3] / sum(row[2:]))
        return (
            protect if self.protect_share is None else self.protect_share,
            random if self.random_share is None else self.random_share,
        )

    def kept_tokens(self, n_tokens: int) -> int:
        if self.budget is not None:
            return min(self.budget, n_tokens)
        return min(n_tokens, int(ratio_budget(torch.tensor(n_tokens), self.ratio)))

    def split(self, n_tokens: int) -> NaClSplit:
        """How a prompt of ``n_tokens`` real tokens is split (the kept count is exact)."""
        proxy = self.proxy_bounds(n_tokens)
        kept = self.kept_tokens(n_tokens)
        min_len = PRESET_MIN_EVICT[self.preset] if self.min_evict_len is None else self.min_evict_len
        if kept >= n_tokens or n_tokens <= min_len:
            return NaClSplit(n_tokens, n_tokens, 0, 0, 0, proxy[1] - proxy[0])
        protect_share, random_share = self.shares()
        protected = max(min(2, kept), math.floor(protect_share * kept + EPS))
        rest = kept - protected
        random = math.floor(random_share * rest + 0.5)
        sinks = min(PRESET_SINKS[self.preset] if self.sinks is None else self.sinks, max(0, protected - 1))
        return NaClSplit(kept, sinks, protected - sinks, rest - random, random, proxy[1] - proxy[0])

    def proxy_bounds(self, n_tokens: int) -> tuple[int, int]:
        """Proxy queries ``[start, stop)`` among a sequence's ``n_tokens`` real prompt tokens (at least one)."""
        if self.proxy_span is not None:
            start, stop = self.proxy_span
            start = start + n_tokens if start < 0 else start
            stop = n_tokens if stop is None else stop + n_tokens if stop < 0 else stop
            start = min(max(start, 0), max(0, n_tokens - 1))
            return (start, min(max(stop, start + 1), n_tokens))
        if self.proxy_tokens is not None:
            window = self.proxy_tokens
        elif self.proxy_ratio is not None:
            window = math.floor(self.proxy_ratio * n_tokens + EPS)
        elif (row := self.preset_fractions()) is not None:
            window = math.floor(row[1] * n_tokens + EPS)
        else:
            window = math.floor(0.9 * self.kept_tokens(n_tokens) + EPS)
        return (max(0, n_tokens - max(1, window)), n_tokens)

    def validate(self) -> None:
        check_choice(self.preset, "preset", ("table4", "official-128k"))
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("nacl needs exactly one of ratio (in (0, 1]) or budget (tokens, >= 1)")
        if self.budget is not None:
            check_budget(self.budget)
        if self.ratio is not None:
            check_ratio(self.ratio)
        for name in ("protect_share", "random_share"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 0 <= value <= 1):
                raise ValueError(f"{name} must be a share of the budget in [0, 1] or None (preset), got {value!r}")
        if self.proxy_ratio is not None:
            check_ratio(self.proxy_ratio, "proxy_ratio")
        if self.proxy_tokens is not None:
            check_int_range(self.proxy_tokens, "proxy_tokens", 1)
        if self.proxy_span is not None:
            span = self.proxy_span
            if not isinstance(span, (tuple, list)) or len(span) != 2 or not isinstance(span[0], int):
                raise ValueError(f"proxy_span must be (start, stop) token indices, stop int or None; got {span!r}")
            if span[1] is not None and not isinstance(span[1], int):
                raise ValueError(f"proxy_span stop must be an integer or None, got {span[1]!r}")
        if sum(x is not None for x in (self.proxy_ratio, self.proxy_tokens, self.proxy_span)) > 1:
            raise ValueError("give at most one of proxy_ratio, proxy_tokens, proxy_span")
        if self.sinks is not None:
            check_int_range(self.sinks, "sinks", 0)
        check_choice(self.gqa_reduce, "gqa_reduce", ("mean", "sum", "max"))
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        check_choice(self.sampling, "sampling", ("softmax", "uniform"))
        check_choice(self.eviction, "eviction", ("one_shot", "greedy"))
        if self.eviction == "greedy" and self.budget is None:
            raise ValueError("eviction='greedy' needs budget (tokens kept while the prompt streams in), not ratio")
        if self.decode_interval is not None:
            check_int_range(self.decode_interval, "decode_interval", 1)
            if self.eviction == "greedy":
                raise ValueError("decode_interval applies to eviction='one_shot' (greedy evicts at every step)")
        if self.min_evict_len is not None:
            check_int_range(self.min_evict_len, "min_evict_len", 0)
        check_int_range(self.seed, "seed", 0)
