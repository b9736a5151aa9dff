"""PoD: proximal tokens exact in every layer, distant keys shared along calibrated layer blocks (see ``config``)."""

from kvcompress.methods.pod.config import PoDConfig, PoDPolicy
from kvcompress.methods.pod.layer import PoDLayer, pod_stats

__all__ = ["PoDConfig", "PoDLayer", "PoDPolicy", "pod_stats"]
