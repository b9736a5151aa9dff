"""KVzip's context-independent head-level eviction (``kvzip`` with ``level="head"``; arXiv:2505.23416, Section 3,
and the official code's ``--level head`` with ``load_score=True``): one importance score per (layer, KV head),
calibrated once per model; the top-scoring heads keep every token, the others their sinks and recent window, with
DuoAttention's machinery (``kvcompress.methods.duo``: its policy, head-score files and ragged storage).

The head scores. The paper computes a head's score as "the maximum pair-level scores across the sequence
dimension"; the official code (``test.py --save_head_score``) saves, per calibration context, the ``[layers, KV
heads]`` maximum over the context's tokens of KVzip's reconstruction scores (``kv.score``: each pair's largest
attention probability from a reconstruction query of its head's group), and ``load_head_score`` takes the maximum
over the saved contexts. ``kvcompress train kvzip-calibrate`` (``kvcompress.train.kvzip_calibrate``) does the same
with this package's KVzip scoring; its contexts and template are stated there. A file of those scores is JSON in
DuoAttention's pattern layout (``kvcompress.methods.duo.patterns``) with its own format string,
``kvcompress-kvzip-head-scores``: read as JSON, nothing in it runs, and a DuoAttention pattern is not taken for one.

The split, where the official code and the paper leave room:

- Which heads keep everything. ``ratio`` is the kept share of the context's (layer, KV head, token) pairs, as for
  the pair level: each sequence's prompt of ``n`` real tokens keeps the heads of highest score whole and the rest
  their first ``sink_size`` and last ``recent_size`` tokens, with the fewest streaming heads that keep at most
  ``ratio`` of its pairs (``kvcompress.methods.duo.patterns.ratio_for``; every head streaming when even that keeps
  more, a prompt no longer than the window keeping everything). A token ``budget`` stands for the share
  ``budget / n``. The official code ranks the head scores repeated over the context with its pair threshold
  (``_threshold``: scores strictly above the ``int(N * ratio) - 1``-th largest of the ``N`` pairs), which keeps
  one head fewer than ``ratio`` of them whenever ``ratio`` times the head count is a whole number; here the count
  is the arithmetic above. Equal scores make the earlier (layer, head) pair streaming first (a stable sort, as
  ``duo``).
- What the other heads keep. The official code's head level keeps none of their context tokens (only its system
  prompt, which precedes the context, and the later query tokens); its README points to DuoAttention's engine for
  these scores, and here they keep DuoAttention's sinks and recent window (``sink_size`` and ``recent_size``,
  default the file's: 128 and 256, kvpress's on-the-fly DuoAttention sizes, those of ``duo``'s shipped pattern),
  so ``kvzip`` ``level="head"`` and ``duo`` differ only in their head scores.
- When: once after the prompt, as ``duo`` (no reconstruction runs, so its prefill costs a plain prefill's; a
  prompt prefilled in one forward compresses each layer right after its attention). The split depends on each
  sequence's prompt length: a left-padded batch reads the real lengths to the host once per layer at that moment
  (never while decoding).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcompress.core.forward import from_host
from kvcompress.methods.duo import DuoPolicy
from kvcompress.methods.duo.patterns import PatternKind, ratio_for

CALIBRATE = "kvcompress train kvzip-calibrate --model <model> --out <file.json>"
KIND = PatternKind("kvcompress-kvzip-head-scores", "kvzip", "kvzip (level='head')", "KVzip head scores", CALIBRATE)


def head_ranks(scores: np.ndarray) -> np.ndarray:
    """``[layers, kv_heads]``: each pair's place in the model-wide ascending order of scores (stable: among equal
    scores the earlier layer, then head, first). The ``s`` pairs ranked below ``s`` are the streaming heads."""
    order = np.argsort(scores, axis=None, kind="stable")
    ranks = np.empty(scores.size, dtype=np.int64)
    ranks[order] = np.arange(scores.size)
    return ranks.reshape(scores.shape)


def streaming_count(fraction: float, tokens: int, sink_size: int, recent_size: int, heads: int) -> int:
    """Streaming heads among ``heads`` so that a ``tokens``-token prompt keeps at most ``fraction`` of its pairs
    (the fewest that do; all where none do)."""
    return round(ratio_for(fraction, tokens, sink_size, recent_size, heads) * heads)


class KVzipHeadPolicy(DuoPolicy):
    """DuoAttention's split with KVzip's head scores; the streaming heads chosen per sequence from its prompt's
    length and the kept share (set by ``KVzipConfig.connect``: ``ranks``, the sizes)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.ranks: np.ndarray | None = None  # [H_kv] this layer's pairs' model-wide ranks (``head_ranks``)
        self.total = 0  # (layer, KV head) pairs of the model

    def streaming_rows(self, layer) -> torch.Tensor:
        batch, heads = layer.rows
        if self.ranks is None or len(self.ranks) != heads:
            found = "none" if self.ranks is None else f"{len(self.ranks)} KV heads"
            raise ValueError(
                f"kvzip's head scores {self.pattern_file or '(none)'} give layer {self.layer_idx} {found}, but the "
                f"model has {heads}: they were calibrated for another model; calibrate this one with `{CALIBRATE}`"
            )
        if layer.all_valid:
            lengths = [layer.seen] * batch
        else:  # (once, when the prompt ends: one host read of the real lengths)
            lengths = layer.real_count().reshape(batch, -1)[:, 0].tolist()
        config = self.config
        counts = [
            streaming_count(config.kept_share(n), n, self.sink_size, self.recent_size, self.total) for n in lengths
        ]
        rows = self.ranks[None, :] < np.asarray(counts)[:, None]
        return from_host(rows, layer.device, None)[:, :, None]
