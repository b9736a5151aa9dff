"""What a cache was built for: the model's layer count, KV heads, head size, sliding windows and trained length.

A ``CompressedCache`` refuses another model's keys with a ``ValueError`` naming both shapes. Each layer's window is
read as transformers' own caches do: ``layer_types`` where the config declares them, else every layer when the
config has a ``sliding_window``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvcompress.core.rope import layer_types


@dataclass(frozen=True)
class ModelSpec:
    """``layers`` decoder layers with ``kv_heads`` KV heads of ``head_dim`` (``None``: not declared by the config),
    ``windows[i]`` the sliding window of layer ``i`` (``None``: global), ``max_positions`` the trained length."""

    model: str
    layers: int
    kv_heads: int | None
    head_dim: int | None
    windows: tuple[int | None, ...]
    max_positions: int | None

    @classmethod
    def of(cls, model: nn.Module) -> ModelSpec:
        config = model.config.get_text_config()
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        window = getattr(config, "sliding_window", None)
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types(config))
        trained = getattr(config, "max_position_embeddings", None)
        return cls(type(model).__name__, config.num_hidden_layers, kv_heads, head_dim, windows, trained)

    def describe(self) -> str:
        return f"{self.model} ({self.layers} layers, {self.kv_heads} KV heads of dimension {self.head_dim})"

    def check_layer(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Raise ``ValueError`` if keys ``[B, H_kv, q, d]`` for layer ``layer_idx`` cannot come from this model."""
        heads, dim = key_states.shape[1], key_states.shape[-1]
        if layer_idx >= self.layers:
            self.refuse(f"a model with more than {self.layers} layers (layer index {layer_idx})")
        if self.kv_heads is not None and layer_idx == 0 and (heads, dim) != (self.kv_heads, self.head_dim):
            self.refuse(f"a model with {heads} KV heads of dimension {dim}")

    def refuse(self, found: str) -> None:
        raise ValueError(
            f"this cache was built for {self.describe()} and is used with {found}: build one cache per model "
            "with kvcompress.cache_for(model, method, ...)"
        )


# what makes two models' keys and values interchangeable in a cache (the shapes first, as a refusal names them)
ARCHITECTURE_FIELDS = tuple(
    "num_hidden_layers num_key_value_heads head_dim model_type hidden_size num_attention_heads intermediate_size "
    "vocab_size max_position_embeddings rope_theta rope_parameters rope_scaling partial_rotary_factor sliding_window "
    "layer_types attention_bias hidden_act rms_norm_eps tie_word_embeddings".split()
)


def architecture(config: object) -> tuple:
    """The fields of a model's (text) config that decide what its keys mean (``ARCHITECTURE_FIELDS``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tuple((name, repr(getattr(text, name, None))) for name in ARCHITECTURE_FIELDS)


class ModelCheck:
    """The model a cache was built for, as every forward checks it: the same config object, or one of the same
    architecture (a copy or a reload); another model is refused with a ``ValueError`` naming what differs."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        self.spec = ModelSpec.of(model)
        self.fields = architecture(self.config)

    def check(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        if config is self.config or config is None:
            return
        fields = architecture(config)
        if fields == self.fields:
            self.config = config  # the same architecture: later forwards compare identities again
            return
        differ = [f"{a[0]} {a[1]} vs {b[1]}" for a, b in zip(self.fields, fields, strict=True) if a != b]
        raise ValueError(
            f"this cache was built for {self.spec.describe()} and is continued by {ModelSpec.of(model).describe()} "
            f"({'; '.join(differ[:3])}): build one cache per model with kvcompress.cache_for(model, ...)"
        )
