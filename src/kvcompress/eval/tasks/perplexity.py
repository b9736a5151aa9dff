"""Perplexity through a bounded cache: ``stream-ppl`` (long book streams, PG19-style) and ``ppl`` (WikiText-2).

Both feed text through the compressed cache ``chunk_size`` tokens at a time with ``generation.stream_nll``: the
cache evicts after every forward, so each token is predicted from what the method kept of everything before it
(plus the other tokens of its own chunk). Scores per sample: ``ppl`` = exp(mean next-token NLL) and ``nll``.

- ``stream-ppl``: sample ``i`` is a stream of ``length`` tokens from book ``i mod (number of books)`` (Gutenberg
  licence stripped) starting at a random (seeded) offset between 10% and 90% of the book, at a line start.
  Rows also hold the mean NLL of every ``bin`` consecutive predicted tokens, from which the report draws
  perplexity along the stream.
- ``ppl``: sample ``i`` is a window of ``length`` tokens of the WikiText-2 raw test split starting at fraction
  ``v(i)`` of the split, ``v`` the van der Corput sequence 0, 1/2, 1/4, 3/4, ... (windows spread evenly whatever
  the sample count; the seed does not change them), as in the LESS / BUZZ perplexity setting of a
  cache compressed while the window is processed.
"""

from __future__ import annotations

import math
import random
from functools import cached_property

import torch

from kvcompress.eval.data import Document, gutenberg_books, wikitext_test
from kvcompress.eval.tasks.base import Result, Sample, Task, check_positive_int, van_der_corput
from kvcompress.eval.tasks.prompting import encode
from kvcompress.generation import stream_nll


def bin_means(values: torch.Tensor, size: int) -> list[float]:
    """Means of consecutive groups of ``size`` values (the last group may be shorter), rounded to 4 places."""
    return [round(float(values[i : i + size].mean()), 4) for i in range(0, values.numel(), size)]


class _PerplexityTask(Task):
    metrics = ("ppl", "nll")
    higher_is_better = False

    def validate(self) -> None:
        check_positive_int(self.params["length"], "length", 2)
        check_positive_int(self.params["chunk_size"], "chunk_size")

    def evaluate(self, sample, config, cache, mode):
        losses = stream_nll(self.model, sample.inputs["ids"], cache, chunk_size=self.params["chunk_size"])
        nll = float(losses.mean())
        extra = {"nll_bins": bin_means(losses, self.params["bin"])} if "bin" in self.params else {}
        return Result(scores={"ppl": math.exp(nll), "nll": nll}, extra=extra)


class StreamPerplexityTask(_PerplexityTask):
    name = "stream-ppl"
    description = "perplexity of book streams fed through the cache"
    defaults = {"length": 2048, "chunk_size": 16, "bin": 64, "books": None, "data": None}

    def validate(self) -> None:
        super().validate()
        check_positive_int(self.params["bin"], "bin")

    @cached_property
    def _books(self) -> list[Document]:
        """The books the streams are read from (loaded once)."""
        return gutenberg_books(self.params["books"], self.params["data"])

    def build_sample(self, index: int, rng: random.Random) -> Sample:
        """Sample ``index``: ``length`` tokens of book ``index mod (number of books)`` from a random line start."""
        book, length = self._books[index % len(self._books)], self.params["length"]
        text = book.text
        start = rng.randint(len(text) // 10, len(text) * 9 // 10)
        start = text.rfind("\n", 0, start) + 1  # a line start
        ids = encode(self.tokenizer, text[start : start + 8 * length])[:, :length]
        if ids.shape[1] < length:
            ids = encode(self.tokenizer, text[max(0, len(text) - 8 * length) :])[:, -length:]
        if ids.shape[1] < length:
            raise ValueError(f"book {book.name!r} has fewer than length={length} tokens")
        return Sample(
            id=f"stream-{index:03d}",
            inputs={"ids": ids},
            info={"book": book.name, "char_offset": start, "tokens": length},
        )


class WikitextPerplexityTask(_PerplexityTask):
    name = "ppl"
    description = "perplexity of WikiText-2 test windows, cache compressed along each window"
    defaults = {"length": 1024, "chunk_size": 16, "text": None, "data": None}

    def build_samples(self, count: int) -> list[Sample]:
        ids = encode(self.tokenizer, wikitext_test(self.params["text"], self.params["data"]))
        length = self.params["length"]
        total = ids.shape[1]
        if total < length:
            raise ValueError(f"the text has {total} tokens, fewer than length={length}")
        span = total - length
        starts = [round(van_der_corput(i) * span) for i in range(count)]
        return [
            Sample(id=f"window-{i:03d}", inputs={"ids": ids[:, s : s + length]}, info={"token_offset": s})
            for i, s in enumerate(starts)
        ]
