"""NaCl (Chen et al., ACL 2024, arXiv:2408.03675): one-shot prefill eviction with proxy tokens and random sampling.

After a layer's (exact) prefill attention every KV head keeps, independently: (a) a protected set, the first
``sinks`` and the most recent prompt tokens; (b) the top ``C_p`` tokens by *proxy score*, the column sums of the
softmax rows of a few proxy queries (default: the prompt's last tokens, where the question sits; or a span), §5.1;
(c) ``C_r`` tokens sampled without replacement from the rest with probability ``softmax(score / temperature)``
("Random Possibility Sampling", §5.2) by Gumbel-top-k (exactly successive sampling). The rest is evicted once;
decoding appends (as the official code; Algorithm 1's re-eviction every ``m`` steps is ``decode_interval``).

As in the paper (§5, Algorithm 1, Table 4) and its official code, proxy scores re-computed from the proxy queries
only (Appx A.7). Choices where the paper is silent or ambiguous:

- Budget (Table 4): ``max(1, floor(ratio * L))`` of the prompt's real tokens (as every ratio method here) or
  ``budget`` tokens, split by Table 4's shares: protected = ``protect_share`` of it (at least 2: token 0 and the
  last prompt token), the rest between top-k and random by ``random_share`` (20 %: 2 % + 6 % + 12 % of the
  prompt, proxy window 18 %). Parts derived from the kept count (not each fraction floored) keep ``|kept| ==
  budget`` exactly, equal to the code's floors where those are exact (L = 3500 at 20 % -> 70/210/420). Other
  ratios and token budgets use the 20 % row's proportions (10 % protected, 2/3 of the rest random, proxy window
  0.9 x the budget). ``preset="official-128k"``: the code's 128K setting (1 % protected, 1 % proxy window, 12 %
  top-k, 7 % random, 256 sinks, no eviction below 2048 tokens).
- Proxies: a suffix window of Table 4's "No-protect Proxy" size (or ``proxy_tokens``, ``proxy_span``), only
  scoring (kept only in the protected tail or by winning a place). Causal proxy attention by default (the rows
  the model computed); ``proxy_causal=False`` is the code's.
- Sum over proxies, temperature 1; GQA: a KV group's query heads' scores averaged (``gqa_reduce``).
- Determinism: a token's Gumbel noise hashes (seed, layer, KV head, RoPE position): independent streams per layer
  and head, the same sets for a seed, the same draw alone or in a padded batch. Top-k ties go to the earlier token.
- Proxy scores are computed when the layer compresses, from the buffered post-RoPE proxy queries, in chunks of
  ``n_chunk x L`` per head, never ``L x L`` (Appx A.7). The buffer holds only queries that can still be proxies,
  so a chunked prefill gives a one-pass prefill's scores.
- Table 3 ablations: ``random_share=1`` (no top-k), ``random_share=0`` (no random part), ``sampling="uniform"``,
  ``eviction="greedy"`` (after every forward the same hybrid rule down to ``budget``, scored by attention
  accumulated from every query, H2O-like: no separate proxy window), ``head_wise=False`` (one selection per layer:
  scores averaged over heads, one draw shared by all heads).
- Not implemented: the literal "proxies always kept" (``∪ P``) variant, which cannot respect the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.core.checks import MAX_SEED, check_budget, check_ratio, ints, number, one_of, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.methods.nacl.policy import NaClGreedyPolicy, NaClPolicy, NaClSplit
from kvcompress.methods.oneshot import check_ratio_or_budget, kept_per_sequence

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
SHARE = number(0, 1, "[]", " (a share of the budget) or None (preset)")  # protect_share, random_share
EPS = 1e-9  # guards floors against float error (0.1 * 700 = 70.00000000000001 is fine, 0.29 * 100 is not)


@dataclass(frozen=True)
class NaClConfig(MethodConfig):
    """Proxy-token top-k + random possibility sampling, per KV head, once after the prompt."""

    ratio: float | None = param(None, check_ratio)  # kept fraction of the prompt; 0.1/0.2/0.3 use Table 4 (or budget)
    budget: int | None = param(None, check_budget)  # or: tokens per layer and KV head (split as the 20 % row)
    preset: str = one_of("table4", "official-128k")  # paper (Appx A.6) or official code's 128K setting (ratio 0.2)
    protect_share: float | None = param(None, SHARE)  # budget share of sinks + recent (Protect Proxy); None = preset
    random_share: float | None = param(None, SHARE)  # share of the rest sampled (C_r / (C_p + C_r)); None = preset
    proxy_ratio: float | None = param(None, check_ratio)  # proxy window, last part of the prompt (No-protect Proxy)
    proxy_tokens: int | None = param(None, ints(1))  # proxy window in tokens (the last ones), instead of proxy_ratio
    proxy_span: tuple[int, int | None] | None = None  # explicit proxies [start, stop) of the prompt; < 0 from the end
    sinks: int | None = param(None, ints(0))  # first tokens in the protected part; None = preset (4; 128K: 256)
    proxy_causal: bool = True  # proxy rows see only earlier keys, as in the prefill (official code: False)
    gqa_reduce: str = one_of("mean", "sum", "max")  # how a KV group's query heads combine scores
    temperature: float = param(1.0, number(0, math.inf, "()"))  # softmax(score / temperature), paper: 1
    sampling: str = one_of("softmax", "uniform")  # paper or Table 3 "− Probability Sampling"
    head_wise: bool = True  # False: one selection per layer shared by all heads (Table 3 "− Head-wise Eviction")
    eviction: str = one_of("one_shot", "greedy")  # paper or Table 3 "− Global Eviction" (needs budget)
    decode_interval: int | None = param(None, ints(1))  # re-evict every m decode steps (Alg. 1 l. 26-27); None: never
    min_evict_len: int | None = param(None, ints(0))  # shorter prompts are not evicted; None = preset (0; 128K: 2048)
    seed: int = param(0, ints(0, MAX_SEED))  # seed of the random part (streams per layer and KV head)

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
        return next((row for r, row in TABLE4.items() if self.ratio is not None and abs(r - self.ratio) < EPS), None)

    def kept_tokens(self, n_tokens: int) -> int:
        return int(kept_per_sequence(torch.tensor(n_tokens, device="cpu"), self.ratio, self.budget))  # on the host

    def split(self, n_tokens: int) -> NaClSplit:
        """How a prompt of ``n_tokens`` real tokens is split (the kept count is exact)."""
        proxy = self.proxy_bounds(n_tokens)
        kept = self.kept_tokens(n_tokens)
        min_len = PRESET_MIN_EVICT[self.preset] if self.min_evict_len is None else self.min_evict_len
        if kept >= n_tokens or n_tokens <= min_len:
            return NaClSplit(n_tokens, n_tokens, 0, 0, 0, proxy[1] - proxy[0])
        row = self.preset_fractions()  # the protected share of the budget, the random share of the rest
        shares = (0.1, 2 / 3) if row is None else (row[0] / (row[0] + row[2] + row[3]), row[3] / sum(row[2:]))
        protect_share = shares[0] if self.protect_share is None else self.protect_share
        protected = max(min(2, kept), math.floor(protect_share * kept + EPS))
        rest = kept - protected
        random = math.floor((shares[1] if self.random_share is None else self.random_share) * rest + 0.5)
        sinks = min(PRESET_SINKS[self.preset] if self.sinks is None else self.sinks, max(0, protected - 1))
        return NaClSplit(kept, sinks, protected - sinks, rest - random, random, proxy[1] - proxy[0])

    def proxy_bounds(self, n_tokens: int) -> tuple[int, int]:
        """Proxy queries ``[start, stop)`` among a sequence's ``n_tokens`` real prompt tokens (at least one)."""
        if self.proxy_span is not None:
            start, stop, _ = slice(*self.proxy_span).indices(n_tokens)  # a negative index counts from the end
            start = min(start, max(0, n_tokens - 1))
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
        check_ratio_or_budget(self.name, self.ratio, self.budget)
        span = self.proxy_span
        pair = isinstance(span, (tuple, list)) and len(span) == 2 and isinstance(span[0], int)
        if span is not None and not (pair and (span[1] is None or isinstance(span[1], int))):
            raise ValueError(f"proxy_span must be (start, stop) token indices, stop int or None; got {span!r}")
        if sum(x is not None for x in (self.proxy_ratio, self.proxy_tokens, self.proxy_span)) > 1:
            raise ValueError("give at most one of proxy_ratio, proxy_tokens, proxy_span")
        if self.eviction == "greedy" and self.budget is None:
            raise ValueError("eviction='greedy' needs budget (tokens kept while the prompt streams in), not ratio")
        if self.decode_interval is not None and self.eviction == "greedy":
            raise ValueError("decode_interval applies to eviction='one_shot' (greedy evicts at every step)")
