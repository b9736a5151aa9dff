"""``CompressedCache``: a ``transformers`` ``Cache`` of one compressed layer per decoder layer, one method for all."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from kvcompress.core.contract import MethodConfig
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.layer_batch import LayerBatch
from kvcompress.core.model_spec import ModelSpec
from kvcompress.core.rope import has_rotary, layer_inv_freqs


def layer_class_for(config: MethodConfig, window: int | None) -> type[CompressedLayer]:
    """The layer class of ``config``'s method on a layer with this sliding ``window`` (``None``: a global layer).

    On a sliding-window layer the choice is the config's when it depends on its parameters (``sliding_layer_class``:
    the cascade keeps the window itself when its budget holds it), else the layer class's (a class that cannot drop
    tokens by age names the one to use), else the method's usual class."""
    layer_class = config.layer_class() or CompressedLayer
    if window is None:
        return layer_class
    by_config = getattr(config, "sliding_layer_class", None)
    return by_config(window) if by_config is not None else getattr(layer_class, "sliding_layer_class", layer_class)


class CompressedCache(Cache):
    """A ``transformers`` ``Cache`` applying one method to every layer of a model.

    Build it with ``kvcompress.cache_for(model, method, **params)``, which also prepares the model's attention.
    """

    def __init__(self, model: nn.Module, config: MethodConfig) -> None:
        spec = ModelSpec.of(model)
        policies = [config.policy(i) for i in range(spec.layers)]
        for policy in policies:
            policy.layer_count = spec.layers
        needs_rope = any(policy.position_mode == "cache" for policy in policies)
        needs_rope = needs_rope or (any(policy.needs_rope for policy in policies) and has_rotary(model))
        inv_freqs = layer_inv_freqs(model) if needs_rope else [None] * spec.layers
        layers = []
        for policy, inv_freq, window in zip(policies, inv_freqs, spec.windows, strict=True):
            layers.append(layer_class_for(config, window)(policy, inv_freq))
            layers[-1].sliding_window = window  # sliding layers store at most their window
        super().__init__(layers=layers)
        self.config = config
        self.model_spec = spec
        # warn once past the trained length if some layer keeps original positions
        self._warn_after = spec.max_positions if any(p.position_mode == "original" for p in policies) else None
        config.connect(self.compressed_layers)
        LayerBatch.connect(self.compressed_layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values (``Cache.update``), refusing keys of another model."""
        if layer_idx == 0 or layer_idx >= self.model_spec.layers:
            self._check_forward(layer_idx, key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_forward(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Once per forward (layer 0): the shapes match, the previous forward reached the last layer (else the model
        has fewer layers than the cache), and a warning once past the trained length."""
        spec = self.model_spec
        spec.check_layer(layer_idx, key_states)
        first, last = self.layers[0], self.layers[-1]
        if first.is_initialized and not last.is_initialized:
            spec.refuse(f"a model whose forward stopped before layer {spec.layers - 1}")
        seen = first.get_seq_length() + key_states.shape[2]
        if self._warn_after is not None and seen > self._warn_after:
            spec.warn_past_trained_length(seen, self.config.name)
            self._warn_after = None

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if hasattr(layer, "policy")]

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
        """Within this block one-shot methods do not compress; they compress once when it ends. Blocks nest: an
        inner block (``prefill`` of several chunks inside a caller's block) leaves the compression to the outer."""
        outer = not any(layer.defer_compression for layer in self.compressed_layers)
        for layer in self.compressed_layers:
            layer.defer_compression = True
        try:
            yield self
        finally:
            if outer:
                for layer in self.compressed_layers:
                    layer.compress()

    @contextmanager
    def more_prompt(self) -> Iterator[CompressedCache]:
        """Declare the forwards within this block prompt chunks that more prompt chunks follow before a one-shot
        method compresses (``prefill`` wraps every chunk but the last): a method whose statistics are those of the
        latest forward only (SnapKV's observation window) skips computing them there. Inside a
        ``deferred_compression`` block only: a compression right after such a forward would find no statistics."""
        for layer in self.compressed_layers:
            layer.more_prompt = True
        try:
            yield self
        finally:
            for layer in self.compressed_layers:
                layer.more_prompt = False
