"""PoD's layer with its slots stored in 8, 4 or 2 bits (``kv_bits`` below 16; KIVI, ``kvcompress.core.kivi``).

PoD's slots hold every KV head's values but keys only for the KV heads starting a block at the layer
(``SlotBuffers.key_heads``); quantized, they are ``QuantizedSlotBuffers`` with the same ``key_heads``: the values of
every head quantized per token, the key-head keys per channel in groups of ``kv_group`` slots, the newest
``kv_residual`` tokens also kept exact (``kvcompress.core.quantized_slots``). Choices:

- **Proximal keys exact.** The other heads' keys of their sinks and last ``n_recent`` tokens (``prox_keys``, or the
  ring while decoding) are kept in the model's dtype: they are few (at most ``n_sink + n_recent`` per head, the
  residual window's role for those heads), and PoD's own logits at a sharing head read only them. Their values
  are the slots' (quantized outside the residual window), as every other value.
- **Attention over the dequantized view.** PoD's attention (``kvcompress.methods.pod.attention``, every path: the
  explicit softmax, the fused calls, the ring's step) reads ``layer.keys`` and ``layer.values`` as the 16-bit layer
  does; here they are the slots' dequantized view (``QuantizedSlotBuffers.view``: exact in the residual window and
  for the forward's own tokens), built once per forward and state of the slots and dropped when the forward ends.
  The keys a block start lends its block's later layers (``PoDStep``) are that view too, so they are dequantized
  once per forward. The view is the one buffer of a decoding step as large as the layer (as the quantized slot
  layer's one-query attention unpacks the codes into one float buffer per step); reading PoD's two parts from the
  codes instead would need the codes readers of ``core.quantized_attention`` per part, with the block start's keys
  under this layer's values.
- **The ring's values.** The ring keeps a copy of its entries' values in the 16-bit layer; here an entry's value
  changes when its token leaves the residual window (it is then read dequantized), so a decoding step gathers the
  entries' values from the view instead (``ring_values``: one gather of the ring's width).
- **A decoding step writes through the slots** (``QuantizedSlotBuffers.write_range``: the token's bookkeeping,
  the residual window's entry, a key group sealed when the window moves) rather than copying its key and value in
  and deferring the bookkeeping as the 16-bit ring step does: the codes are written when sealed.
- PoD compacts at every eviction, so each eviction forms the key groups anew from what attention read (as the
  quantized slot layer's compaction does). Not replayable as a CUDA graph (``DecodeGraph`` decodes it eagerly).

``nbytes()`` counts the key heads' codes and the values' codes, the values' scales and minima per token, the key
groups' scales and minima (key heads only), the residual window's exact keys (key heads) and values (every head),
and the exact proximal keys.
"""

from __future__ import annotations

import torch

from kvcompress.core.layer import CompressedLayer
from kvcompress.core.quantized_layer import QuantizedLayer
from kvcompress.core.quantized_slots import QuantizedSlotBuffers
from kvcompress.methods.pod.layer import PoDLayer


class PoDQuantizedLayer(PoDLayer, QuantizedLayer):
    """``PoDLayer`` over ``QuantizedSlotBuffers`` with ``key_heads``: ``keys`` ``[B, F, L, d]`` and ``values``
    ``[B, H, L, d]`` are the dequantized view of the slots (built once per forward), ``prox_keys`` exact."""

    slots: QuantizedSlotBuffers | None

    defers_ring_writes = False  # (a ring step's write seals key groups and fills the residual window)

    keys = property(lambda self: None if self.slots is None else self._read()[0], CompressedLayer._only_none)
    values = property(lambda self: None if self.slots is None else self._read()[1], CompressedLayer._only_none)

    def empty_slots(
        self, key_states: torch.Tensor, value_states: torch.Tensor, key_heads: torch.Tensor | None
    ) -> QuantizedSlotBuffers:
        config = self.policy.config
        return QuantizedSlotBuffers.empty_quantized(
            key_states, value_states, config.kv_bits, config.kv_group, config.kv_residual, key_heads
        )

    def _new_views(self) -> None:
        """(The views are the slots' dequantized view, read when asked for.)"""

    def ring_values(self) -> torch.Tensor:
        """The ring entries' values gathered from the view (one gather; an unwritten entry reads slot 0, masked)."""
        values, slot = self.values, self.ring.slot
        batch, shared = slot.shape[:2]
        rows = self._ring_rows
        if rows is None or rows[0].shape[0] != batch:
            device = slot.device
            rows = (torch.arange(batch, device=device)[:, None, None], self.prox_heads.view(1, shared, 1))
            self._ring_rows = rows
        return values[rows[0], rows[1], slot]

    _ring_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        super().reset()
        self._ring_rows = None
