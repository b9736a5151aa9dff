"""One-shot attention sink (StreamingLLM, Xiao et al., 2023, arXiv:2309.17453) applied once, after the prompt.

NaCl's "Attention Sink" baseline at the same ratio budget: the first ``sinks`` tokens plus
the most recent prompt tokens are kept, once, right after the prefill; decoding then appends without eviction.
Positions are re-indexed inside the cache as in StreamingLLM (``position_mode="cache"``) unless ``original``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompress.core.checks import ints, one_of, param
from kvcompress.core.rope import POSITION_MODES
from kvcompress.core.selection import keep_top, sink_mask
from kvcompress.methods.oneshot import OneShotConfig, kept_per_sequence, prompt_lengths
from kvcompress.methods.streaming import StreamingPolicy


class OneShotStreamingPolicy(StreamingPolicy):
    one_shot = True

    def select(self, layer):
        keep = kept_per_sequence(prompt_lengths(layer), self.config.ratio, self.config.budget)
        return keep_top(layer, layer.token_idx[:, :1], keep, sink_mask(layer, self.config.sinks))


@dataclass(frozen=True)
class OneShotStreamingConfig(OneShotConfig):
    """Attention sinks + the most recent prompt tokens (``budget`` counts the sinks), once after the prompt."""

    sinks: int = param(4, ints(0))  # first tokens always kept (the paper's 4 attention sinks)
    position_mode: str = one_of(*POSITION_MODES, default="cache")  # re-indexed in the cache (paper) or kept

    name = "streaming_oneshot"
    paper = "https://arxiv.org/abs/2309.17453"
    policy_class = OneShotStreamingPolicy
