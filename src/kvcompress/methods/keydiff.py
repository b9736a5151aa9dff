"""KeyDiff (Park et al., 2025, arXiv:2504.15364): keep the keys least similar to the layer's mean key.

Each KV head scores its stored tokens by the negative cosine similarity of the key to an anchor, the mean of the
head's L2-normalised keys (kvpress 0.5.5's ``KeyDiffPress``: ``-cos(k, mean(k / |k|))``), and keeps the highest
scores: distinctive keys stay, keys close to the common direction go. No attention statistics are needed (plain SDPA
speed) and no query is involved, so the selection does not depend on a question.

Choices where the sources leave room:

- One-shot, like kvpress: the prompt (the context, when it is prefilled alone) is compressed once after its prefill
  and decoding appends. The paper's block-wise variant (scoring each incoming block against the kept keys, a cache
  that never exceeds its budget) is kvpress's ``BlockPress`` around this scorer; a chunked ``prefill`` here still
  compresses once, after the last chunk, over every prompt token.
- The keys are the stored, RoPE-rotated keys, as kvpress scores them; the anchor averages a sequence's real tokens
  only (left padding never enters it). Scores are computed in float32.
- Budget: ``ratio`` keeps ``max(1, floor(ratio * n))`` of a sequence's ``n`` prompt tokens per layer and KV head
  (kvpress's ``int(n * (1 - compression_ratio))``), or a token ``budget``; ``allocation`` shares it among layers
  (``pyramid``) or heads (``adakv``), see ``kvcompress.methods.allocation``. No token is protected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcompress.core.contract import Policy
from kvcompress.methods.allocation import ScorerConfig, allocated_keep


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` scores ``-cos(k, anchor)`` of keys ``[B, H, W, d]``, the anchor the mean of the ``valid``
    tokens' normalised keys."""
    keys = keys.float()
    unit = F.normalize(keys, p=2, dim=-1) * valid[..., None]
    anchor = unit.sum(dim=2, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)[..., None]
    return -F.cosine_similarity(keys, anchor, dim=-1)


class KeyDiffPolicy(Policy):
    one_shot = True

    def select(self, layer):
        return allocated_keep(self, layer, keydiff_scores(layer.keys, layer.valid), None)


@dataclass(frozen=True)
class KeyDiffConfig(ScorerConfig):
    """Keep the keys least similar to the mean key, once after the prompt."""

    name = "keydiff"
    paper = "https://arxiv.org/abs/2504.15364"
    policy_class = KeyDiffPolicy
