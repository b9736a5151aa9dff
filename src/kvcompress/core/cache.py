"""``CompressedCache``: a ``transformers`` ``Cache`` of one compressed layer per decoder layer, one method for all."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from transformers.cache_utils import Cache

from kvcompress.core.contract import MethodConfig
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.rope import find_inv_freq


class CompressedCache(Cache):
    """A ``transformers`` ``Cache`` applying one method to every layer of a model.

    Build it with ``kvcompress.cache_for(model, method, **params)``, which also prepares the model's attention.
    """

    def __init__(self, model: nn.Module, config: MethodConfig) -> None:
        text_config = model.config.get_text_config()
        layers = text_config.num_hidden_layers
        needs_rope = any(config.policy(i).position_mode == "cache" for i in range(layers))
        inv_freq = find_inv_freq(model) if needs_rope else None
        layer_class = config.layer_class() or CompressedLayer
        super().__init__(layers=[layer_class(config.policy(i), inv_freq) for i in range(layers)])
        self.config = config
        config.connect(self.compressed_layers)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def nbytes(self) -> int:
        """Bytes of keys and values really stored, all layers together."""
        return sum(layer.kv_nbytes() for layer in self.compressed_layers)

    def metadata_nbytes(self) -> int:
        """Bytes of positions and method statistics stored beside the keys and values."""
        return sum(layer.metadata_nbytes() for layer in self.compressed_layers)

    def tokens_seen(self) -> int:
        return self.compressed_layers[0].seen

    def tokens_stored(self) -> list[int]:
        """Stored slots per layer (the physical length, the same for every head of a layer)."""
        return [layer.stored_length() for layer in self.compressed_layers]

    @contextmanager
    def deferred_compression(self) -> Iterator[CompressedCache]:
        """Within this block one-shot methods do not compress; they compress once when it ends."""
        for layer in self.compressed_layers:
            layer.defer_compression = True
        try:
            yield self
        finally:
            for layer in self.compressed_layers:
                layer.compress()
