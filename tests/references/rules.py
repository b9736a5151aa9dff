"""Reference rules, one class per method, written from the methods' documented rules (module docstrings), not from
their code: plain Python over lists of stream indices, statistics from ``Context.attention`` (NumPy).

Conventions every rule shares with the documentation: budgets count real tokens per layer and KV head; a token's
statistics start when it arrives; "ties to the newer token" unless a method documents otherwise (BUZZ hives and
NaCl top-k: to the earlier token); a decode-time method never evicts the tokens of the forward being processed when
they fit in the budget beside what the method protects (``decode_keep``).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from kvcompress.core.hashing import hash_uniform
from tests.references.reference import Rule, top_keep

# --- no statistics ------------------------------------------------------------------------------------------------


class Window(Rule):
    def __init__(self, ctx, budget):
        super().__init__(ctx)
        self.budget = budget

    def forward(self, new):
        self.kept = [(kept + new)[-self.budget :] for kept in self.kept]


def sinks_and_recent(tokens: list[int], keep: int, sinks: int) -> list[int]:
    """The first ``sinks`` tokens and the most recent ones, ``keep`` in all."""
    if len(tokens) <= keep:
        return tokens
    recent = keep - sinks
    return tokens[:sinks] + (tokens[len(tokens) - recent :] if recent else [])


class Streaming(Rule):
    def __init__(self, ctx, budget, sinks=4):
        super().__init__(ctx)
        self.budget, self.sinks = budget, sinks

    def forward(self, new):
        self.kept = [sinks_and_recent(kept + new, self.budget, self.sinks) for kept in self.kept]


def decode_keep(tokens: list[int], score, budget: int, new: list[int], protected=()) -> list[int]:
    """``top_keep`` for a decode-time method: when the forward's own (real) tokens ``new`` fit in the budget, they
    rank below the method's ``protected`` tokens and above every other one (the older first to go among them); a
    forward longer than the budget (a prompt chunk) is ranked like every other token."""
    if len(new) > budget:
        return top_keep(tokens, score, budget, protected)
    protected, new = set(protected), set(new)

    def rank(t: int):
        tier = 0 if t in protected else 1 if t in new else 2
        return (tier, 0.0 if tier < 2 else -float(score[t]), -t)

    return sorted(sorted(tokens, key=rank)[: min(budget, len(tokens))])


class Random(Rule):
    """The documented draw: a token's score is ``hash_uniform(seed, layer, KV head, RoPE position)``; keep the
    ``budget`` highest. The draw function is the library's (the documented deterministic draw); the selection on
    top of it is this reference's."""

    def __init__(self, ctx, budget, seed=0):
        super().__init__(ctx)
        self.budget, self.seed = budget, seed
        self.draws = [dict() for _ in range(ctx.kv_heads)]

    def forward(self, new):
        positions = torch.tensor([self.ctx.position[t] for t in new], dtype=torch.long)
        for h, kept in enumerate(self.kept):
            draws = hash_uniform(self.seed, self.ctx.layer, torch.tensor(h), positions).tolist()
            self.draws[h].update(zip(new, draws, strict=True))
            self.kept[h] = decode_keep(kept + new, self.draws[h], self.budget, new)


def newest(tokens: list[int], count: int) -> list[int]:
    return tokens[len(tokens) - count :] if count > 0 else []


class Knorm(Rule):
    """Per KV head: keep the lowest key norms (the norm of the key is RoPE-invariant: the pre-RoPE key's norm);
    the ``recent`` newest tokens are protected (while decoding, at least the forward's own tokens when they fit)."""

    def __init__(self, ctx, budget, recent=8):
        super().__init__(ctx)
        self.budget, self.recent = budget, recent

    def select(self, tokens, h, new):
        score = {t: -float(np.linalg.norm(self.ctx.keys[t][h])) for t in tokens}
        recent = max(self.recent, len(new)) if len(new) <= self.budget else self.recent
        return decode_keep(tokens, score, self.budget, new, newest(tokens, min(recent, self.budget)))

    def forward(self, new):
        self.kept = [self.select(kept + new, h, new) for h, kept in enumerate(self.kept)]


# --- attention statistics while decoding ------------------------------------------------------------------------


class H2O(Rule):
    """Per KV head: mass received, summed over the group's query heads and over every query since arrival; keep
    the ``budget - heavy`` most recent plus the heaviest (``heavy = int(budget * heavy_ratio)``)."""

    def __init__(self, ctx, budget, heavy_ratio=0.5):
        super().__init__(ctx)
        self.budget, self.recent = budget, budget - int(budget * heavy_ratio)
        self.mass = [dict() for _ in range(ctx.kv_heads)]

    def observe(self, new):
        for h, kept in enumerate(self.kept):
            stored = kept + new
            received = self.ctx.attention(h, new, stored).sum(axis=(0, 1))
            for t, m in zip(stored, received, strict=True):
                self.mass[h][t] = self.mass[h].get(t, 0.0) + m
        return [kept + new for kept in self.kept]

    def forward(self, new):
        stored = self.observe(new) if new else self.kept
        for h, tokens in enumerate(stored):
            self.kept[h] = decode_keep(tokens, self.mass[h], self.budget, new, newest(tokens, self.recent))


class TOVA(Rule):
    """Per layer: attention of the last query, averaged over every query head; keep the ``budget`` highest."""

    def __init__(self, ctx, budget):
        super().__init__(ctx)
        self.budget = budget

    def current(self, stored, new):
        rows = np.concatenate([self.ctx.attention(h, new[-1:], stored) for h in range(self.ctx.kv_heads)])
        return dict(zip(stored, rows[:, 0].mean(0), strict=True))

    def forward(self, new):
        if not new:
            return
        stored = self.kept[0] + new
        keep = decode_keep(stored, self.current(stored, new), self.budget, new)
        self.kept = [keep] * self.ctx.kv_heads


class Scissorhands(Rule):
    """Per KV head: over the last ``history`` queries of the stream, count how often a token was below its row's
    average (``1 / visible keys``, rows averaged over the group); keep the ``recent`` newest plus the fewest counts
    (ties to the newer token)."""

    def __init__(self, ctx, budget, history=256, recent=None):
        super().__init__(ctx)
        self.budget, self.recent = budget, budget // 4 if recent is None else recent
        self.window = deque(maxlen=history)  # per query: one set of low tokens per KV head

    def observe(self, new):
        lows = [[] for _ in new]
        for h, kept in enumerate(self.kept):
            stored = kept + new
            rows = self.ctx.attention(h, new, stored).mean(0)  # [n, L]
            for i, s in enumerate(new):
                visible = [t <= s for t in stored]
                average = 1.0 / sum(visible)
                lows[i].append({t for t, v, p in zip(stored, visible, rows[i], strict=True) if v and p < average})
        self.window.extend(lows)

    def low_counts(self, h):
        counts: dict[int, int] = {}
        for low in self.window:
            for t in low[h]:
                counts[t] = counts.get(t, 0) + 1
        return counts

    def select(self, h, tokens, keep, recent, new=()):
        counts = self.low_counts(h)
        score = {t: -counts.get(t, 0) for t in tokens}
        return decode_keep(tokens, score, keep, list(new), newest(tokens, recent))  # one-shot: no ``new``

    def forward(self, new):
        if new:
            self.observe(new)
        self.kept = [self.select(h, kept + new, self.budget, self.recent, new) for h, kept in enumerate(self.kept)]


class Buzz(Rule):
    """Per KV head ``[k sinks | old | new | w window]``; when ``old + new > T``: old thinned to every ŝ-th
    (ŝ = (s + 1) // 2), new cut into hives of ``s`` from the oldest, each keeping its highest accumulated score
    (ties: earliest); survivors thinned by ŝ again while more than ``T`` ("loop"). A forward of ``q`` tokens with
    ``w < q <= w + T`` is kept whole: for its step the window stretches to ``q`` and the threshold shrinks to
    ``T - (q - w)`` (no survivor at all when that is 0)."""

    def __init__(self, ctx, sinks, window, threshold, stride, position_mode="original"):
        super().__init__(ctx)
        self.k, self.w, self.limit, self.s = sinks, window, threshold, stride
        self.small = (stride + 1) // 2
        self.cache_positions = position_mode == "cache"
        self.score = [dict() for _ in range(ctx.kv_heads)]
        self.old = [set() for _ in range(ctx.kv_heads)]

    def forward(self, new):
        w, limit = self.w, self.limit
        if 0 < len(new) - w <= limit:
            w, limit = len(new), limit - (len(new) - w)
        for h, kept in enumerate(self.kept):
            stored = kept + new
            if new:
                ranks = {t: i for i, t in enumerate(stored)} if self.cache_positions else None
                received = self.ctx.attention(h, new, stored, ranks).sum(axis=(0, 1))
                for t, m in zip(stored, received, strict=True):
                    self.score[h][t] = self.score[h].get(t, 0.0) + m
            self.kept[h] = self.evict(h, stored, w, limit)

    def evict(self, h, stored, w, limit):
        k = self.k
        if len(stored) - k - w <= limit:
            return stored
        middle = stored[k : len(stored) - w]
        old = [t for t in middle if t in self.old[h]]
        fresh = [t for t in middle if t not in self.old[h]]
        survivors = old[:: self.small]
        for start in range(0, len(fresh), self.s):
            hive = fresh[start : start + self.s]
            survivors.append(max(hive, key=lambda t: (self.score[h][t], -t)))
        survivors.sort()
        while len(survivors) > limit:
            survivors = survivors[:: self.small] if limit else []
        self.old[h] = set(survivors)
        return stored[:k] + survivors + stored[len(stored) - w :]


class Cascade(Rule):
    """Algorithm 1 of the Cascading KV Cache, token by token: sinks, then ``N`` rings of ``W`` slots; ring ``i``
    accepts a token when ``(p - S) mod b^i == 0`` (``p``: real tokens before it); a full accepting ring passes its
    oldest token on; an empty one takes the token; otherwise the token competes with the ring's newest one by
    attention EMA (the incoming one wins ties). Each token is inserted, then attends over the cache at ranks
    ``0..n-1`` in stream order, then every ring token's EMA becomes ``γ μ + (1 - γ) mean over query heads``."""

    def __init__(self, ctx, budget, sinks, cascades, base=2):
        super().__init__(ctx)
        self.sinks_n, self.n, self.base = sinks, cascades, base
        self.width = (budget - sinks) // cascades
        self.gamma = math.exp(-math.log(100.0) / self.width)
        self.sinks: list[int] = []
        self.rings = [deque() for _ in range(cascades)]  # items [token, score], oldest first
        self.count = 0

    def insert(self, t):
        p = self.count
        self.count += 1
        if p < self.sinks_n:
            self.sinks.append(t)
            return
        arriving = [t, 0.0]
        for i, ring in enumerate(self.rings):
            if (p - self.sinks_n) % self.base**i == 0:
                if len(ring) < self.width:
                    ring.append(arriving)
                    return
                ring.append(arriving)
                arriving = ring.popleft()
            elif not ring:
                ring.append(arriving)
                return
            else:
                if arriving[1] >= ring[-1][1]:
                    ring[-1] = arriving
                return

    def tokens(self):
        return sorted(self.sinks + [item[0] for ring in self.rings for item in ring])

    def forward(self, new):
        for t in new:
            self.insert(t)
            stored = self.tokens()
            ranks = {s: i for i, s in enumerate(stored)}
            rows = np.concatenate([self.ctx.attention(h, [t], stored, ranks) for h in range(self.ctx.kv_heads)])
            attention = dict(zip(stored, rows[:, 0].mean(0), strict=True))
            for ring in self.rings:
                for item in ring:
                    item[1] = self.gamma * item[1] + (1 - self.gamma) * attention[item[0]]
        self.kept = [self.tokens()] * self.ctx.kv_heads


# --- one-shot: compress once after the prompt, then append --------------------------------------------------------


def kept_count(n: int, ratio, budget) -> int:
    return min(n, budget) if budget is not None else min(n, max(1, math.floor(ratio * n)))


class OneShot(Rule):
    """Observe during the prompt, select once when it ends, append afterwards."""

    def __init__(self, ctx, ratio=None, budget=None):
        super().__init__(ctx)
        self.ratio, self.budget = ratio, budget
        self.last_new: list[int] = []

    def forward(self, new):
        if self.prompt and new:
            self.observe(new)
            self.last_new = new
        super().forward(new)

    def observe(self, new):
        pass

    def end_prompt(self):
        super().end_prompt()
        keep = kept_count(len(self.kept[0]), self.ratio, self.budget)
        self.kept = [self.select(h, tokens, keep) for h, tokens in enumerate(self.kept)]


class SnapKV(OneShot):
    """The last ``window`` queries of the prompt's last forward vote (rows summed, averaged over the group); the
    votes of the prefix (the tokens before the window) are pooled with width ``kernel`` over the prefix only, zero
    beyond its ends (max, or average counting the zeros); top tokens + the window kept."""

    def __init__(self, ctx, budget=None, ratio=None, window=32, kernel=7, pooling="max"):
        super().__init__(ctx, ratio, budget)
        self.window, self.kernel, self.pooling = window, kernel, pooling

    def pooled(self, h, tokens):
        voters = self.last_new[-self.window :]
        votes = self.ctx.attention(h, voters, tokens).sum(1).mean(0)
        prefix, r = max(0, len(tokens) - self.window), self.kernel // 2
        pooled = dict(zip(tokens, votes, strict=True))
        for i, t in enumerate(tokens[:prefix]):
            around = list(votes[max(0, i - r) : min(prefix, i + r + 1)])
            around += [0.0] * (self.kernel - len(around))  # the zero border beyond the prefix's ends
            pooled[t] = max(around) if self.pooling == "max" else sum(around) / self.kernel
        return pooled

    def select(self, h, tokens, keep):
        return top_keep(tokens, self.pooled(h, tokens), keep, tokens[max(0, len(tokens) - self.window) :])


class OneShotKnorm(OneShot):
    """``knorm`` with ``one_shot=True``: the prompt compressed once to the lowest key norms, the ``recent`` newest
    prompt tokens protected; decoding appends."""

    def __init__(self, ctx, budget, recent=8):
        super().__init__(ctx, None, budget)
        self.recent = recent

    def select(self, h, tokens, keep):
        score = {t: -float(np.linalg.norm(self.ctx.keys[t][h])) for t in tokens}
        return top_keep(tokens, score, keep, newest(tokens, min(self.recent, keep)))


class OneShotH2O(OneShot):
    def __init__(self, ctx, ratio=None, budget=None, heavy_ratio=0.5):
        super().__init__(ctx, ratio, budget)
        self.heavy_ratio = heavy_ratio
        self.mass = [dict() for _ in range(ctx.kv_heads)]

    def observe(self, new):
        for h, kept in enumerate(self.kept):
            stored = kept + new
            for t, m in zip(stored, self.ctx.attention(h, new, stored).sum(axis=(0, 1)), strict=True):
                self.mass[h][t] = self.mass[h].get(t, 0.0) + m

    def select(self, h, tokens, keep):
        recent = keep - math.floor(keep * self.heavy_ratio)
        return top_keep(tokens, self.mass[h], keep, tokens[len(tokens) - recent :] if recent else [])


class OneShotTOVA(OneShot):
    def select(self, h, tokens, keep):
        return top_keep(tokens, TOVA.current(self, tokens, self.last_new), keep)


class OneShotScissorhands(OneShot):
    def __init__(self, ctx, ratio=None, budget=None, history=256, recent_share=0.25):
        super().__init__(ctx, ratio, budget)
        self.recent_share = recent_share
        self.window = deque(maxlen=history)

    observe = Scissorhands.observe
    low_counts = Scissorhands.low_counts

    def select(self, h, tokens, keep):
        return Scissorhands.select(self, h, tokens, keep, math.floor(keep * self.recent_share))


class OneShotStreaming(OneShot):
    def __init__(self, ctx, ratio=None, budget=None, sinks=4):
        super().__init__(ctx, ratio, budget)
        self.sinks = sinks

    def select(self, h, tokens, keep):
        return sinks_and_recent(tokens, keep, self.sinks)


class NaCl(OneShot):
    """Per KV head: protected = ``sinks`` first + ``recent`` last tokens; top ``top`` of the rest by proxy score
    (the last ``proxy`` prompt queries' softmax rows summed, group-averaged; ties: earlier token); then ``random``
    of the remainder by Gumbel-top-k of ``score + g``, ``g = -log(-log(u))``, ``u = hash_uniform(seed, layer, KV
    head, RoPE position) + 2^-32`` (the documented deterministic draw). ``split``: (sinks, recent, top, random)."""

    def __init__(self, ctx, budget, split, proxy, seed=0):
        super().__init__(ctx, None, budget)
        self.split, self.proxy, self.seed = split, proxy, seed

    def select(self, h, tokens, keep):
        sinks, recent, top, sampled = self.split
        if len(tokens) <= keep:
            return tokens
        score = dict(zip(tokens, self.ctx.attention(h, tokens[-self.proxy :], tokens).sum(1).mean(0), strict=True))
        protected = set(tokens[:sinks] + tokens[len(tokens) - recent :])
        middle = [t for t in tokens if t not in protected]
        best = sorted(middle, key=lambda t: (-score[t], t))[:top]
        rest = [t for t in middle if t not in best]
        positions = torch.tensor([self.ctx.position[t] for t in rest])
        uniform = hash_uniform(self.seed, self.ctx.layer, torch.tensor(h), positions) + 2.0**-32
        noise = (-torch.log(-torch.log(uniform))).tolist()
        keyed = {t: score[t] + g for t, g in zip(rest, noise, strict=True)}
        drawn = sorted(rest, key=lambda t: (-keyed[t], t))[:sampled]
        return sorted(protected | set(best) | set(drawn))


# --- composition ------------------------------------------------------------------------------------------------


class BlockShared(Rule):
    """A layer that keeps, per KV head, what the block's first layer (layer 0) keeps (PoD + base, block_size 2)."""

    def forward(self, new):
        self.kept = [list(kept) for kept in self.ctx.peers[0].kept]

    def end_prompt(self):
        super().end_prompt()
        self.forward([])
