"""Cascading KV Cache: sinks + N circular sub-caches with attention-EMA token selection (see ``config``)."""

from kvcompress.methods.cascade.config import CascadeConfig
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.policy import CascadePolicy

__all__ = ["CascadeConfig", "CascadeLayer", "CascadePolicy"]
