"""Reference rules of the one-shot scorers (KeyDiff, expected attention) and of the budget allocations (uniform,
PyramidKV's per-layer schedule, AdaKV's per-head share), written from the documented rules (the module docstrings
of ``methods/keydiff.py``, ``methods/expected_attention.py``, ``methods/allocation.py``) and kvpress's formulas,
not from the library's code: plain Python and NumPy in float64, RoPE from ``reference.rope``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tests.references.reference import Rule, rope, top_keep
from tests.references.rules import OneShot, SnapKV, kept_count


def pyramid_budget(n: int, average: float, window: int, beta: int, layer: int, layers: int) -> int:
    """kvpress PyramidKVPress.get_layer_budget with ``q_len * (1 - compression_ratio)`` = ``average``."""
    max_capacity = window + average
    min_num = (max_capacity - window) / beta
    max_num = (max_capacity - window) * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = (max_capacity - window) * 2 - max_num
    if layers == 1 or not (n >= max_num >= min_num >= window):
        return max(1, min(n, round(average)))
    steps = (max_num - min_num) / (layers - 1)
    return max(1, min(n, round(max_num - layer * steps)))


class Allocated(OneShot):
    """A scorer's per-head ``score(h, tokens)`` and ``protected(tokens)``, shared out by ``allocation``."""

    window = 0  # the scorer's protected window, for the pyramid schedule

    def __init__(self, ctx, ratio=None, budget=None, allocation="uniform", beta=20, alpha_safeguard=0.2):
        super().__init__(ctx, ratio, budget)
        self.allocation, self.beta, self.alpha = allocation, beta, alpha_safeguard

    def protected(self, tokens):
        return []

    def end_prompt(self):
        self.prompt = False
        tokens = self.kept[0]  # every head holds the whole prompt before the compression
        n, heads = len(tokens), self.ctx.kv_heads
        keep = kept_count(n, self.ratio, self.budget)
        if self.allocation == "pyramid":
            average = n * self.ratio if self.ratio is not None else min(self.budget, n)
            keep = pyramid_budget(n, average, self.window, self.beta, self.ctx.layer, len(self.ctx.peers))
        scores = [self.score(h, tokens) for h in range(heads)]
        protected = self.protected(tokens)
        if self.allocation != "adakv":
            self.kept = [top_keep(tokens, scores[h], keep, protected) for h in range(heads)]
            return
        safe = max(1, math.floor(keep * self.alpha)) if self.alpha > 0 else 0  # kvpress 0.5.5's floor
        first = [set(top_keep(tokens, scores[h], safe, protected)) if safe else set() for h in range(heads)]
        pairs = [(t, h) for t in tokens for h in range(heads)]

        def rank(pair):  # ascending = first evicted: lowest score, then the older token, then the lower head
            t, h = pair
            if t in protected or t in first[h]:
                return (1, 0.0, t, h)
            return (0, float(scores[h][t]), t, h)

        stays = sorted(pairs, key=rank)[heads * n - heads * keep :]
        self.kept = [sorted(t for t, head in stays if head == h) for h in range(heads)]


class KeyDiff(Allocated):
    """``-cos(k_t, anchor)``, the anchor the mean of the head's normalised rotated prompt keys."""

    def score(self, h, tokens):
        keys = self.rotated_keys(h, tokens)
        unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
        anchor = unit.mean(0)
        cos = keys @ anchor / (np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor))
        return dict(zip(tokens, -cos, strict=True))

    def rotated_keys(self, h, tokens):
        keys = np.stack([self.ctx.keys[t][h] for t in tokens])
        return rope(keys, [self.ctx.position[t] for t in tokens], self.ctx.inv_freq)


def rotation_matrix(position: int, inv_freq: np.ndarray, dim: int) -> np.ndarray:
    """The RoPE rotation of ``position`` as a ``[d, d]`` matrix (``R @ x`` rotates ``x``)."""
    return rope(np.eye(dim), [position] * dim, inv_freq).T


class ExpectedAttention(Allocated):
    """kvpress ExpectedAttentionPress: the prompt's pre-RoPE queries past the sinks summarised by mean and
    population covariance per query head, both turned by the rotation averaged over the next ``n_future_positions``
    positions; expected logit ``mu.k / sqrt(d) + k^T S k / (2 d)``, softmax over the non-sink keys, mean over the
    group, times ``|v|`` (plus ``epsilon`` first); the first ``n_sink`` tokens kept."""

    def __init__(self, ctx, n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0.0, **kw):
        super().__init__(ctx, **kw)
        self.future, self.n_sink, self.cov, self.vnorm, self.epsilon = (
            n_future_positions,
            n_sink,
            use_covariance,
            use_vnorm,
            epsilon,
        )

    def protected(self, tokens):
        return [t for t in tokens if self.ctx.position[t] < self.n_sink]

    def score(self, h, tokens):
        ctx, n = self.ctx, len(tokens)
        dim = ctx.keys[tokens[0]].shape[-1]
        sinks = set(self.protected(tokens))
        counted = [t for t in tokens if t not in sinks]
        rotation = np.mean([rotation_matrix(p, ctx.inv_freq, dim) for p in range(n, n + self.future)], axis=0)
        keys = rope(np.stack([ctx.keys[t][h] for t in counted]), [ctx.position[t] for t in counted], ctx.inv_freq)
        rows = []
        for g in range(h * ctx.groups, (h + 1) * ctx.groups):
            queries = np.stack([ctx.queries[t][g] for t in counted])
            mean = rotation @ queries.mean(0)
            logits = keys @ mean / math.sqrt(dim)
            if self.cov:
                covariance = rotation @ np.cov(queries.T, bias=True) @ rotation.T
                logits = logits + np.einsum("ni,ij,nj->n", keys, covariance, keys) / dim / 2
            probs = np.exp(logits - logits.max())
            rows.append(probs / probs.sum())
        scores = np.mean(rows, axis=0)
        if self.vnorm:
            scores = (scores + self.epsilon) * np.array([np.linalg.norm(ctx.values[t][h]) for t in counted])
        return {**dict(zip(counted, scores, strict=True)), **{t: 0.0 for t in sinks}}


class AllocatedSnapKV(Allocated):
    """SnapKV's pooled votes (``rules.SnapKV``) and window under an allocation; pyramid's window is SnapKV's."""

    def __init__(self, ctx, window=32, kernel=7, pooling="max", **kw):
        super().__init__(ctx, **kw)
        self.snap = SnapKV(ctx, budget=1, window=window, kernel=kernel, pooling=pooling)
        self.window = window

    def forward(self, new):
        if self.prompt and new:
            self.snap.last_new = new
        super().forward(new)

    def protected(self, tokens):
        return tokens[max(0, len(tokens) - self.window) :]

    def score(self, h, tokens):
        return self.snap.pooled(h, tokens)


class Compactor(Allocated):
    """kvpress CompactorPress, from the documented rule: the prompt's first ``sink_size_start`` and last
    ``sink_size_end`` tokens kept and left out; between them, per layer, ``blending * z(leverage) + z(attention)``
    with z over all KV heads and tokens (unbiased deviation). Leverage: pre-RoPE keys centred, times the documented
    sketch (``torch.randn(H_kv, d, k)`` from a generator seeded ``seed + layer``, over ``sqrt(k)``), ``x^T (X^T X +
    0.01 I)^-1 x``. Attention: chunks of ``chunk_size`` (the last zero-padded: padding keys logit 0, padding
    queries uniform over the chunk), unscaled softmax of rotated ``q . k`` within a chunk summed over its queries,
    group mean, times ``|v|``, width-3 average with zero borders. Float64 NumPy."""

    def __init__(
        self, ctx, sink_size_start=8, sink_size_end=4, chunk_size=256, sketch_dimension=48, blending=None, seed=0, **kw
    ):
        super().__init__(ctx, **kw)
        self.start, self.end, self.chunk = sink_size_start, sink_size_end, chunk_size
        self.sketch_dimension, self.blending, self.seed = sketch_dimension, blending, seed
        self.table = None

    def protected(self, tokens):
        n = len(tokens)
        left = min(self.start, n)
        right = min(self.end, n - left)
        return tokens[:left] + tokens[n - right :]

    def score(self, h, tokens):
        if self.table is None:
            self.table = self.all_scores(tokens)
        return self.table[h]

    def all_scores(self, tokens):
        ctx, heads = self.ctx, self.ctx.kv_heads
        sinks = set(self.protected(tokens))
        middle = [t for t in tokens if t not in sinks]
        zeros = {t: 0.0 for t in sinks}
        if not middle:
            return [dict(zeros) for _ in range(heads)]
        positions = [ctx.position[t] for t in middle]
        dim = ctx.keys[middle[0]].shape[-1]
        generator = torch.Generator().manual_seed(self.seed + ctx.layer)
        sketch = torch.randn(heads, dim, self.sketch_dimension, generator=generator).double().numpy()
        sketch = sketch / math.sqrt(self.sketch_dimension)
        leverage, attention = [], []
        for h in range(heads):
            keys = np.stack([ctx.keys[t][h] for t in middle])  # pre-RoPE
            x = (keys - keys.mean(0)) @ sketch[h]
            gram = x.T @ x + 0.01 * np.eye(x.shape[1])
            leverage.append(np.maximum(np.einsum("ni,ni->n", x, np.linalg.solve(gram, x.T).T), 0))
            rotated = rope(keys, positions, ctx.inv_freq)
            values = np.linalg.norm(np.stack([ctx.values[t][h] for t in middle]), axis=-1)
            received = np.mean([self.chunked(g, middle, positions, rotated) for g in self.group(h)], axis=0)
            scored = received * values
            padded = np.concatenate([[0.0], scored, [0.0]])
            attention.append((padded[:-2] + padded[1:-1] + padded[2:]) / 3)
        n = len(tokens)
        blending = self.blending
        if blending is None:
            blending = 1 - self.ratio if self.ratio is not None else 1 - min(self.budget, n) / n
        total = blending * zscore(np.array(leverage)) + zscore(np.array(attention))
        return [{**dict(zip(middle, total[h], strict=True)), **zeros} for h in range(heads)]

    def group(self, h):
        return range(h * self.ctx.groups, (h + 1) * self.ctx.groups)

    def chunked(self, g, middle, positions, keys):
        queries = rope(np.stack([self.ctx.queries[t][g] for t in middle]), positions, self.ctx.inv_freq)
        received = np.zeros(len(middle))
        for start in range(0, len(middle), self.chunk):
            q, k = queries[start : start + self.chunk], keys[start : start + self.chunk]
            pad = self.chunk - len(k)
            logits = np.concatenate([q @ k.T, np.zeros((len(q), pad))], 1)  # padding keys: logit 0
            probs = np.exp(logits - logits.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
            received[start : start + len(k)] += probs[:, : len(k)].sum(0) + pad / self.chunk  # padding queries
        return received


def zscore(x: np.ndarray) -> np.ndarray:
    spread = max(x.std(ddof=1), 1e-6) if x.size > 1 else 1.0
    return (x - x.mean()) / spread


class Periodic(Rule):
    """kvpress DecodingPress: after the prompt, each forward is a step; after every ``interval``-th step (or a
    forward of at least ``budget`` tokens) each KV head keeps its ``budget`` best stored tokens, by KeyDiff over the
    head's stored rotated keys (``keydiff``) or by the lowest key norm (``knorm``)."""

    def __init__(self, ctx, budget=2048, interval=512, scorer="keydiff"):
        super().__init__(ctx)
        self.budget, self.interval, self.scorer = budget, interval, scorer
        self.steps = 0

    def forward(self, new):
        super().forward(new)
        if self.prompt:
            return
        self.steps += 1
        if self.steps < self.interval and len(new) < self.budget:
            return
        self.steps = 0
        self.kept = [top_keep(tokens, self.score(h, tokens), self.budget) for h, tokens in enumerate(self.kept)]

    def score(self, h, tokens):
        if self.scorer == "knorm":
            return {t: -float(np.linalg.norm(self.ctx.keys[t][h])) for t in tokens}
        return KeyDiff.score(self, h, tokens)

    rotated_keys = KeyDiff.rotated_keys
