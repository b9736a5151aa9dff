"""KVzip's cache layers: a reconstruction forward attends over the stored context without storing itself.

While ``KVzipPolicy.scoring`` is set (one reconstruction chunk's forward, ``compress_by_reconstruction``), a layer's
``update`` keeps the chunk's keys and values aside for the attention (``KVzipPolicy.chunk``) and returns the stored
context's keys and values as they are: nothing is written into the cache, its buffers do not grow, and the chunk's
keys and values live only while the layer's attention runs (as the official code's ``update_cache=False``). The
layer's bookkeeping (positions, masks) is left alone: the reconstruction's queries see every stored context token
and their own chunk causally (``score_chunk``). Outside a reconstruction the layers are the plain slot layer
(``allocation="uniform"`` or ``ragged=False``; quantized with ``kv_bits`` below 16) or the ragged one (``global``,
``layer``).
"""

from __future__ import annotations

import torch

from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.quantized_layer import QuantizedLayer
from kvcompress.core.ragged_layer import RaggedLayer


class ReconstructionLayer:
    """Mixin before a ``CompressedLayer`` class: a reconstruction forward's tokens are attended to, never stored."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.policy.scoring is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.policy.chunk = key_states, value_states
        keys, values = self.context()
        setattr(keys, LAYER_ATTRIBUTE, self)
        return keys, values

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored context's keys and values as attention reads them."""
        return self.keys, self.values

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        if self.policy.scoring is None:
            super().register_new_tokens(position_ids, padding)

    def attention_mask(self, query_count: int, sliding_window: int | None = None):
        if self.policy.scoring is None:
            return super().attention_mask(query_count, sliding_window)
        return None


class KVzipLayer(ReconstructionLayer, CompressedLayer):
    """The slot layer (``allocation="uniform"``, or ``ragged=False``) with reconstruction forwards."""


class KVzipRaggedLayer(ReconstructionLayer, RaggedLayer):
    """The ragged layer (``global`` and ``layer`` allocations) with reconstruction forwards."""


class KVzipQuantizedLayer(ReconstructionLayer, QuantizedLayer):
    """The quantized slot layer (``kv_bits`` below 16) with reconstruction forwards."""

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read()  # (one read of the quantized buffers for both)
