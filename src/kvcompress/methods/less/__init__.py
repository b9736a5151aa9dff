"""LESS: any evicting method plus a learned constant-size low-rank state of what it evicts (see ``config``)."""

from kvcompress.methods.less.config import LessConfig, baseline_plus
from kvcompress.methods.less.layer import LessLayer
from kvcompress.methods.less.policy import LessPolicy

__all__ = ["LessConfig", "LessLayer", "LessPolicy", "baseline_plus"]
