"""PoD's per-layer policy: PoD attention, plus the base method's selection shared along blocks when composed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcompress.core.contract import Policy, StatsRequest
from kvcompress.methods.pod.attention import pod_attention

if TYPE_CHECKING:  # annotations only: the config module imports this one
    from kvcompress.methods.pod.config import PoDConfig


class PoDPolicy(Policy):
    """PoD attention (``attend``) plus, when composed, the base method's token selection shared along blocks."""

    position_mode = "original"
    per_head = True

    def __init__(self, config: PoDConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.base = config.base.policy(layer_idx) if config.base is not None else None
        if self.base is not None:
            self.stats = self.base.stats
            self.one_shot = self.base.one_shot
            self.latest_stats_only = self.base.latest_stats_only

    def init_state(self, layer, keys):
        return {} if self.base is None else self.base.init_state(layer, keys)

    def observe(self, layer, stats):
        if self.base is not None:
            self.base.observe(layer, stats)

    def select(self, layer):
        if self.base is None:
            return None
        return layer.block_selection(self.base)

    def attend(self, layer, query, key, value, mask, scaling):
        # a one-shot base (SnapKV) that already compressed needs no statistics: decoding takes the fused path
        request = self.stats if self.wants_stats(layer) else StatsRequest()
        return pod_attention(layer, query, mask, scaling, self.config, request)
