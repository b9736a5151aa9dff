"""DuoAttention (Xiao et al., 2024, arXiv:2410.10819): retrieval heads keep every token, streaming heads keep the
attention sinks and a recent window; which heads are which is calibrated once per model.

As kvpress 0.5.5's ``DuoAttentionPress`` applies it, once after the prompt: every (layer, KV head) pair has a
score (higher: it needs the whole context); the lowest-scored share ``head_compression_ratio`` of all the model's
pairs become streaming heads (or those scored below ``threshold``, the authors' rule), and after the prefill a
streaming head keeps the first ``sink_size`` and the last ``recent_size`` real tokens of each sequence's prompt
(everything when the prompt is no longer than both), a retrieval head everything. kvpress then only masks the
evicted keys; here they are freed: the layer moves its kept tokens into ragged storage
(``kvcompress.core.ragged``), so a streaming head stores its sinks and window only (plus at most one block of
slack per head; ``ragged=False`` keeps one slot buffer as wide as the retrieval heads instead, which frees
nothing in a layer with a retrieval head).

Choices where the sources differ or are silent:

- When it compresses: once after the prompt (kvpress). The paper's streaming heads also attend with a sink+window
  mask during the prefill and keep a constant window while decoding; here, as in kvpress, the prompt is prefilled
  with full attention in every head, and the tokens decoded after the compression are all kept (by every head).
  A prompt prefilled in one forward compresses each layer right after that layer's attention (only one layer
  holds its whole prompt at a time); a prompt prefilled in chunks is held whole until its last chunk.
- The head scores (``pattern``): by default the pattern shipped for the model (``kvcompress/data/duo``; SmolLM2-135M:
  ``smollm2-135m``), else a file given as ``pattern`` from ``kvcompress train duo-calibrate`` or the authors'
  ``full_attention_heads.tsv``. A model with no shipped pattern and no ``pattern`` is refused with the calibration
  command. The shipped pattern and ``duo-calibrate`` use kvpress's on-the-fly scoring
  (``duo_attention_on_the_fly``), not the paper's optimisation of gate values on synthetic passkey data (hours of
  training on long contexts): the mean query and key of each head over calibration texts, placed at positions
  ``0..q_len-1`` with RoPE, and the area under the cumulated attention of the last position, averaged over a KV
  head's query heads (``kvcompress.train.duo_calibrate`` says how, and where it differs from kvpress: its texts).
- Sizes: ``sink_size`` and ``recent_size`` default to the pattern's (kvpress's on-the-fly scoring: 128 and 256; the
  authors' files: their ``config.json``).
- The split's ties and rounding: ``kvcompress.methods.duo.patterns``.
- Sinks and window count real tokens (left padding is neither); positions stay the original ones (as kvpress).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcompress.core.checks import check_path, ints, number, param
from kvcompress.core.contract import KeepMask, MethodConfig, Policy
from kvcompress.core.forward import from_host
from kvcompress.core.ragged_layer import RaggedLayer
from kvcompress.core.selection import recent_mask, sink_mask
from kvcompress.methods.duo.patterns import (
    CALIBRATE,
    DuoPattern,
    load_pattern,
    resolve_path,
    shipped_path,
    streaming_heads,
)


class DuoPolicy(Policy):
    """Keeps every token of a retrieval head, the sinks and recent window of a streaming head (once)."""

    one_shot = True

    def __init__(self, config: DuoConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.streaming: np.ndarray | None = None  # [H_kv] this layer's streaming heads (set by DuoConfig.connect)
        self.sink_size = self.recent_size = 0
        self.pattern_file = ""
        self._mask: torch.Tensor | None = None

    def streaming_mask(self, layer) -> torch.Tensor:
        """``[H_kv]`` bool on the layer's device: the streaming heads (once per layer)."""
        heads = layer.token_idx.shape[1]
        if self.streaming is None or len(self.streaming) != heads:
            found = "none" if self.streaming is None else f"{len(self.streaming)} KV heads"
            raise ValueError(
                f"duo's head pattern {self.pattern_file or '(none)'} gives layer {self.layer_idx} {found}, but the "
                f"model has {heads}: it was calibrated for another model; calibrate this one with `{CALIBRATE}`"
            )
        if self._mask is None or self._mask.device != layer.token_idx.device:
            self._mask = from_host(self.streaming, layer.token_idx.device, None)
        return self._mask

    def streaming_rows(self, layer) -> torch.Tensor:
        """``[B or 1, H_kv, 1]`` bool: the streaming heads of each sequence (duo: the same for every sequence; KVzip's
        head level sets them per sequence from its prompt's length, ``kvcompress.methods.kvzip.head``)."""
        return self.streaming_mask(layer)[None, :, None]

    def select(self, layer) -> KeepMask:
        streaming = self.streaming_rows(layer)
        window = sink_mask(layer, self.sink_size) | recent_mask(layer, self.recent_size)
        return KeepMask(layer.valid & (~streaming | window))


@dataclass(frozen=True)
class DuoConfig(MethodConfig):
    """DuoAttention: retrieval heads keep everything, streaming heads their sinks and recent window (once)."""

    head_compression_ratio: float | None = param(None, number(0, 1))  # streaming share of all KV heads (None: 0.5)
    threshold: float | None = param(None, number(-1e9, 1e9))  # or: a head scored below it streams (authors' rule)
    pattern: str | None = None  # head scores: a shipped name or a duo-calibrate / full_attention_heads.tsv file
    sink_size: int | None = param(None, ints(0))  # first tokens a streaming head keeps (None: the pattern's)
    recent_size: int | None = param(None, ints(0))  # last prompt tokens a streaming head keeps (None: the pattern's)
    ragged: bool = True  # heads store their own counts (False: one slot buffer as wide as the fullest head)

    name = "duo"
    paper = "https://arxiv.org/abs/2410.10819"
    policy_class = DuoPolicy

    def validate(self) -> None:
        if self.threshold is not None and self.head_compression_ratio is not None:
            raise ValueError("duo takes head_compression_ratio or threshold, not both")
        if self.pattern is not None and shipped_path(str(self.pattern)) is None:
            check_path(self.pattern, "pattern", "file", f"a head pattern from `{CALIBRATE}`")
            load_pattern(str(self.pattern))  # read now: a bad file is refused before a model loads

    @property
    def ratio(self) -> float:
        """The head compression ratio in force (0.5 unless given; unused under ``threshold``)."""
        return 0.5 if self.head_compression_ratio is None else self.head_compression_ratio

    def layer_class(self):
        return RaggedLayer if self.ragged else None

    def resolve(self, layers: int) -> tuple[DuoPattern, np.ndarray, str]:
        """The pattern for a model of ``layers`` layers, its streaming heads ``[layers, H_kv]``, and its file."""
        path = resolve_path(self.pattern, layers)
        pattern = load_pattern(str(path))
        if pattern.layers != layers:
            raise ValueError(
                f"duo's head pattern {path} has {pattern.layers} layers, but the model has {layers}: it was "
                f"calibrated for another model; calibrate this one with `{CALIBRATE}`"
            )
        threshold = self.threshold
        return (
            pattern,
            streaming_heads(pattern.scores, None if threshold is not None else self.ratio, threshold),
            str(path),
        )

    def connect(self, layers) -> None:
        pattern, streaming, path = self.resolve(len(layers))
        sink = pattern.sink_size if self.sink_size is None else self.sink_size
        recent = pattern.recent_size if self.recent_size is None else self.recent_size
        for index, layer in enumerate(layers):
            policy = layer.policy
            policy.streaming, policy.sink_size, policy.recent_size = streaming[index], sink, recent
            policy.pattern_file = path
