"""``CompressedCache``: a ``transformers`` ``Cache`` of one compressed layer per decoder layer, one method for all."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from kvcompress.core.contract import LayerView, MethodConfig
from kvcompress.core.forward import ForwardPass
from kvcompress.core.grad_mode import recorded_as_computed
from kvcompress.core.joint_eviction import connect as connect_joint_evictions
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.model_spec import ModelCheck, ModelSpec
from kvcompress.core.quantized_layer import quantized_layer_class
from kvcompress.core.rope import has_rotary, layer_inv_freqs

HOOKED = "_kvcompress_input_check"


def watch_inputs(model: nn.Module) -> None:
    """Check every forward of ``model`` that carries a ``CompressedCache`` (``check_inputs``): one pre-hook."""
    if getattr(model, HOOKED, None) is None and hasattr(model, "register_forward_pre_hook"):
        setattr(model, HOOKED, model.register_forward_pre_hook(check_inputs, with_kwargs=True))


def check_inputs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """``ValueError`` unless the model is the one the cache was built for (or of the same architecture and
    configuration), the forward brings at least one token, and a 2D ``attention_mask`` covers every token."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, CompressedCache):
        return
    cache.model_check.check(model)
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    new = ids.shape[-1] if isinstance(ids, torch.Tensor) else embeds.shape[1] if embeds is not None else None
    if new == 0:
        raise ValueError(
            f"input_ids is empty (shape {list(ids.shape)}): a forward through a compressed cache needs at least one "
            "new token"
        )
    positions = kwargs.get("position_ids")
    if new is not None and isinstance(positions, torch.Tensor) and positions.shape[-1] != new:
        raise ValueError(
            f"position_ids cover {positions.shape[-1]} tokens but the forward brings {new} (generate derives them from "
            "attention_mask: is it of another length than input_ids?)"
        )
    mask = kwargs.get("attention_mask")
    seen = cache.get_seq_length()
    if new is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] != seen + new:
        before = f" ({seen} the cache has seen + {new} new)" if seen else ""
        raise ValueError(
            f"attention_mask covers {mask.shape[-1]} tokens but the forward needs {seen + new}{before}: give a mask "
            "of every token, or none"
        )


class CompressedCache(Cache):
    """A ``transformers`` ``Cache`` applying one method to every layer of a model: ``kvcompress.cache_for(model,
    method, **params)``, which also prepares the model's attention."""

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
            layer_class = config.layer_class() or CompressedLayer
            if window is not None:  # a sliding layer's: the config's ``sliding_layer_class(window)``, else the class's
                sliding = getattr(config, "sliding_layer_class", None)
                layer_class = sliding(window) if sliding else getattr(layer_class, "sliding_layer_class", layer_class)
            layers.append(quantized_layer_class(config, layer_class)(policy, inv_freq))  # (itself at kv_bits=16)
            layers[-1].sliding_window = window
        super().__init__(layers=layers)
        self.config = config
        self.model_spec = spec
        self._generated = False  # a ``generate`` call has used this cache (see ``_is_user_defined``)
        self.model_check = ModelCheck(model)
        watch_inputs(model)
        self._keeps_original_positions = any(p.position_mode == "original" for p in policies)
        self._warn_after = spec.max_positions if self._keeps_original_positions else None
        self.forward_pass = ForwardPass(layers)
        for layer in layers:
            layer.forward_pass = self.forward_pass
        config.connect(self.compressed_layers)
        connect_joint_evictions(self.compressed_layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values (``Cache.update``), refusing keys of another model."""
        if layer_idx == 0 or layer_idx >= self.model_spec.layers:
            self._check_forward(layer_idx, key_states)
        layer = self.layers[layer_idx]
        layer.forward_pass.begin(layer)
        with recorded_as_computed():
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_forward(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Once per forward: the shapes match, the previous forward reached the last layer, and a warning once past
        the trained length (a method keeping original positions)."""
        spec = self.model_spec
        spec.check_layer(layer_idx, key_states)
        first, last = self.layers[0], self.layers[-1]
        if first.is_initialized and not last.is_initialized:
            spec.refuse(f"a model whose forward stopped before layer {spec.layers - 1}")
        seen = first.get_seq_length() + key_states.shape[2]
        if self._warn_after is not None and seen > self._warn_after:
            warnings.warn(
                f"{spec.model} was trained on {spec.max_positions} positions and {self.config.name!r} keeps original "
                f"positions: after {seen} tokens the model sees positions it was not trained on and its predictions "
                "degrade (use a method re-indexing positions inside the cache, e.g. streaming or cascade)",
                UserWarning,
                stacklevel=3,
            )
            self._warn_after = None

    # transformers' ``generate`` marks a cache handed to it with ``cache._is_user_defined = True`` when it starts:
    # here that refuses a second generate on a cache an earlier one filled (its tokens would be taken as the prompt's
    # start and the new prompt cut or dropped), while a generate after ``prefill`` continues that prompt as intended.
    @property
    def _is_user_defined(self) -> bool:
        return self._generated

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if value and self._generated and self.get_seq_length() > 0:
            raise ValueError(
                f"this cache already holds the {self.get_seq_length()} tokens of an earlier generate: call "
                "cache.reset() before generating again, or build a fresh one with kvcompress.cache_for(model, ...) "
                "(one cache per generation)"
            )
        self._generated = bool(value)

    def reset(self) -> None:
        """Empty every layer: the cache is as built, for a new generation."""
        super().reset()
        self.forward_pass.reset()
        self._generated = False
        self._warn_after = self.model_spec.max_positions if self._keeps_original_positions else None

    @property
    def compressed_layers(self) -> list[LayerView]:
        """The layers, one per decoder layer (each a ``LayerView``)."""
        return list(self.layers)

    def nbytes(self) -> int:
        """Bytes of keys and values really stored, all layers together."""
        return sum(layer.kv_nbytes() for layer in self.compressed_layers)

    def metadata_nbytes(self) -> int:
        """Bytes of positions and method statistics stored beside the keys and values."""
        return sum(layer.metadata_nbytes() for layer in self.compressed_layers)

    def allocated_nbytes(self) -> int:
        """Bytes allocated for keys and values: ``nbytes()`` plus the room kept for new tokens (``core.capacity``)."""
        return sum(layer.allocated_nbytes() for layer in self.compressed_layers)

    def allocated_metadata_nbytes(self) -> int:
        """``metadata_nbytes()`` plus the same room."""
        return sum(layer.allocated_metadata_nbytes() for layer in self.compressed_layers)

    def tokens_seen(self) -> int:
        return self.compressed_layers[0].seen

    def tokens_stored(self) -> list[int]:
        """Stored slots per layer."""
        return [layer.stored_length() for layer in self.compressed_layers]

    @contextmanager
    def deferred_compression(self) -> Iterator[CompressedCache]:
        """Within this block one-shot methods do not compress; they compress once when it ends (an inner block leaves
        it to the outer)."""
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
        """The forwards within this block are prompt chunks that more chunks follow (``prefill`` wraps every chunk
        but the last): a method whose statistics are the latest forward's only skips them there. Inside a
        ``deferred_compression`` block only: a compression right after such a forward would find no statistics."""
        for layer in self.compressed_layers:
            layer.more_prompt = True
        try:
            yield self
        finally:
            for layer in self.compressed_layers:
                layer.more_prompt = False

    def fork(self) -> CompressedCache:
        """An independent copy of this cache (a context compressed once, then one fork per question): copies of every
        tensor, only the method's and the model's configs shared (read-only), no observers. Fork outside autograd (a
        cache filled with gradients enabled is refused: its tensors cannot be copied) and outside a captured decoding
        graph."""
        memo: dict[int, object] = {id(self.config): self.config, id(self.model_check.config): self.model_check.config}
        memo.update({id(layer.observers): [] for layer in self.compressed_layers})
        try:
            return copy.deepcopy(self, memo)
        except RuntimeError as error:  # PyTorch copies only tensors without autograd history ("graph leaves")
            if "graph leaves" not in str(error):
                raise
            raise ValueError(
                "cannot fork a cache whose keys and values were recorded for a backward pass (a forward ran with "
                "gradients enabled): fill it under torch.no_grad(), as generate() does, to fork it"
            ) from None
