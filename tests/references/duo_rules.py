"""DuoAttention's kept sets, recomputed plainly: the head pattern file read as JSON, the streaming heads chosen by
sorting (score, layer, head) triples, and a streaming head's prompt cut to its first ``sink_size`` and last
``recent_size`` real tokens once the prompt ends (every head keeps every token after that).

KVzip's head level (``KVzipHead``) is the same cut with the count of streaming heads found per sequence by trying
every count in turn, in exact fractions: the fewest whose kept pairs are at most the kept share of that sequence's
prompt (``ratio``, or ``budget`` over its real length), all of them where none is."""

from __future__ import annotations

import json
from fractions import Fraction

from tests.references.reference import Rule


def streaming_pairs(pattern: str, head_compression_ratio=None, threshold=None) -> set[tuple[int, int]]:
    """The (layer, KV head) pairs that are streaming heads under the pattern in the file ``pattern``."""
    with open(pattern, encoding="utf-8") as file:
        scores = json.load(file)["scores"]
    triples = [(score, layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row)]
    if threshold is not None:
        return {(layer, head) for score, layer, head in triples if score < threshold}
    ratio = 0.5 if head_compression_ratio is None else head_compression_ratio
    count = round(len(triples) * ratio)
    return {(layer, head) for _, layer, head in sorted(triples)[:count]}


class Duo(Rule):
    def __init__(self, ctx, pattern, head_compression_ratio=None, threshold=None, sink_size=None, recent_size=None):
        super().__init__(ctx)
        with open(pattern, encoding="utf-8") as file:
            data = json.load(file)
        self.sinks = data["sink_size"] if sink_size is None else sink_size
        self.recent = data["recent_size"] if recent_size is None else recent_size
        self.streaming = streaming_pairs(pattern, head_compression_ratio, threshold)

    def end_prompt(self):
        super().end_prompt()
        for h, tokens in enumerate(self.kept):  # a (sequence, layer)'s real prompt tokens, in stream order
            if (self.ctx.layer, h) in self.streaming:
                cut = max(len(tokens) - self.recent, 0)
                self.kept[h] = sorted(set(tokens[: self.sinks]) | set(tokens[cut:]))


def kvzip_head_streaming(scores, tokens: int, sinks: int, recent: int, ratio=None, budget=None):
    """The (layer, KV head) pairs KVzip's head level makes streaming for a prompt of ``tokens`` real tokens."""
    triples = sorted((score, layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row))
    total = len(triples)
    share = Fraction(ratio) if ratio is not None else min(Fraction(1), Fraction(budget, tokens))
    window = min(tokens, sinks + recent)
    count = next(
        (s for s in range(total + 1) if Fraction((total - s) * tokens + s * window, total * tokens) <= share), total
    )
    return {(layer, head) for _, layer, head in triples[:count]}


class KVzipHead(Rule):
    def __init__(self, ctx, pattern, ratio=None, budget=None, sink_size=None, recent_size=None):
        super().__init__(ctx)
        with open(pattern, encoding="utf-8") as file:
            data = json.load(file)
        assert data["format"] == "kvcompress-kvzip-head-scores"
        self.scores = data["scores"]
        self.sinks = data["sink_size"] if sink_size is None else sink_size
        self.recent = data["recent_size"] if recent_size is None else recent_size
        self.ratio, self.budget = ratio, budget

    def end_prompt(self):
        super().end_prompt()
        tokens = len(self.kept[0])  # this sequence's real prompt (every head holds it all until now)
        streaming = kvzip_head_streaming(self.scores, tokens, self.sinks, self.recent, self.ratio, self.budget)
        for h, kept in enumerate(self.kept):
            if (self.ctx.layer, h) in streaming:
                cut = max(len(kept) - self.recent, 0)
                self.kept[h] = sorted(set(kept[: self.sinks]) | set(kept[cut:]))
