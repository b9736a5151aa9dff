"""Periodic re-compression while decoding (kvpress 0.5.5's ``DecodingPress``): every ``interval`` decoding steps, a
key scorer compresses the whole cache back to ``budget`` tokens per layer and KV head.

For long generations (reasoning models) whose prompt is short: the prompt is stored whole, then the cache grows by
one token per decoding step, and after each ``interval``-th step (every forward after the prompt counts as one,
counted per layer since the last compression; a forward of at least ``budget`` tokens compresses at once) the layer
keeps its ``budget`` highest-scoring tokens, the step's own tokens among the candidates.
Between compressions a step does no eviction work at all; the compression step ranks every stored token once.
Memory thus stays between ``budget`` and ``budget + interval`` tokens per layer and head once the cache reaches it.

``scorer`` picks the scores, computed from the stored keys alone as kvpress's presses compute them on the cache's
keys: ``keydiff`` (``KeyDiffPress``: ``-cos(k, mean of the normalised keys)``, see ``kvcompress.methods.keydiff``)
or ``knorm`` (``KnormPress``: ``-|k|``). Defaults are kvpress's ``DecodingPress``: ``interval=512``
(``compression_interval``), ``budget=2048`` (``target_size``).

Choices where the source leaves room:

- The prompt is the first forward into the empty cache (kvpress's ``is_prefilling``), or every chunk of a prompt
  ``kvcompress.generation.prefill`` feeds in chunks; it is stored whole and is no step. A later forward of several
  tokens (a question after a compressed context) is one step, as in kvpress. To compress the prompt too, use a
  one-shot scorer for the prompt (kvpress's ``PrefillDecodingPress``): not combined here.
- Scorers that need the decoding queries (expected attention, SnapKV, Compactor: kvpress buffers the last
  decoding steps' hidden states for them, and Compactor refuses decoding) are not offered; budgets are uniform
  (kvpress also accepts an ``AdaKVPress`` there).
- The step's own token is ranked with the others, as kvpress scores every key of the cache (kvcompress's decode-time
  methods otherwise never evict the token of the step being processed). A compression step reads the kept count
  back to the host once (the per-sequence count path); the steps between compressions do no device work here.
- Ties evict the older token first, as everywhere in kvcompress. Padding is never kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.checks import check_budget, ints, one_of, param
from kvcompress.core.contract import MethodConfig, Policy
from kvcompress.core.selection import keep_top
from kvcompress.methods.keydiff import keydiff_scores


def knorm_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` scores ``-|k|`` (the lowest-norm keys kept)."""
    return -keys.float().norm(dim=-1)


SCORERS = {"keydiff": keydiff_scores, "knorm": knorm_scores}


class PeriodicPolicy(Policy):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.steps = 0  # decoding steps since the last compression (a Python counter: no device work per step)

    def select(self, layer):
        if layer.seen == layer.new_tokens:  # the first forward (of a new or reset cache): the prompt, no step
            self.steps = 0
            return None
        if layer.defer_compression:  # a chunk of a prompt that ``prefill`` feeds in chunks
            return None
        self.steps += 1
        if self.steps < self.config.interval and layer.new_tokens < self.config.budget:
            return None
        self.steps = 0
        scores = SCORERS[self.config.scorer](layer.keys, layer.valid)
        # counts per sequence: the step's own token is ranked with the others (an int count would protect it)
        counts = torch.full((scores.shape[0],), self.config.budget, device=scores.device)
        return keep_top(layer, scores, counts)


@dataclass(frozen=True)
class PeriodicConfig(MethodConfig):
    """Every ``interval`` decoding steps, the whole cache compressed back to ``budget`` tokens by a key scorer."""

    budget: int = param(2048, check_budget)  # kept per layer and KV head after each compression (kvpress target_size)
    interval: int = param(512, ints(1))  # decoding steps between compressions (kvpress compression_interval)
    scorer: str = one_of(*SCORERS)  # keydiff or knorm

    name = "periodic"
    paper = "https://github.com/NVIDIA/kvpress"
    policy_class = PeriodicPolicy
