"""NaCl: one-shot proxy-token top-k + random possibility sampling, per KV head (see ``config``)."""

from kvcompress.methods.nacl.config import NaClConfig
from kvcompress.methods.nacl.policy import NaClGreedyPolicy, NaClPolicy, NaClSplit

__all__ = ["NaClConfig", "NaClGreedyPolicy", "NaClPolicy", "NaClSplit"]
