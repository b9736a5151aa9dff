"""BUZZ: sinks + sliding window + segmented local heavy hitters (see ``config``)."""

from kvcompress.methods.buzz.config import BuzzConfig
from kvcompress.methods.buzz.policy import BuzzPolicy

__all__ = ["BuzzConfig", "BuzzPolicy"]
