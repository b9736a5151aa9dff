"""``QuantizedLayer``: the slot layer with its keys and values stored in 8, 4 or 2 bits (KIVI), for any method.

Every method config takes ``kv_bits`` (16: the model's dtype, the default; 8, 4 or 2: quantized), ``kv_group``
(tokens per key group, channels per value group; KIVI's 32) and ``kv_residual`` (the newest tokens also kept exact;
KIVI's 128; 0 or a multiple of ``kv_group``). With ``kv_bits < 16`` a method whose layer is the standard
``CompressedLayer`` stores its kept tokens in ``QuantizedSlotBuffers`` (``core.quantized_slots`` says how keys
quantized per channel live in slots evicted one at a time); the method itself is unchanged: it selects on what
attention reads (the dequantized keys and values), and evicts as it would in full precision.

A method whose layer is a slot layer with extras has its own quantized subclass, which its config picks with
``kv_bits < 16`` (KVzip's ``KVzipQuantizedLayer``, LESS's ``LessQuantizedLayer``, PoD's ``PoDQuantizedLayer``: its
slots hold keys of some heads only, ``QuantizedSlotBuffers.key_heads``); ragged per-head storage (``RaggedLayer``)
quantizes its own pool when it moves into it (``core.ragged_quantized``). The cascade's rings and streaming's
circular ring have quantized layers too, which their configs pick (``methods.cascade.quantized``); a layer class
that holds codes says so (``holds_codes``), and any other storage of its own is refused with ``kv_bits < 16``. A
quantized layer does not replay as a captured CUDA graph (its step writes a ring entry and a key group chosen by
Python numbers): it decodes eagerly through ``DecodeGraph``.

``nbytes()`` counts what is held: the codes and per-token value parameters of the stored tokens, the key groups'
parameters covering them, and the residual window's exact keys and values.
"""

from __future__ import annotations

import torch

from kvcompress.core.contract import AttentionStats, MethodConfig, Policy, StatsRequest
from kvcompress.core.layer import CompressedLayer
from kvcompress.core.quantized_attention import quantized_chunk_attention, quantized_one_query
from kvcompress.core.quantized_slots import QuantizedSlotBuffers
from kvcompress.core.ragged_layer import RaggedLayer


class QuantizedLayer(CompressedLayer):
    """A ``CompressedLayer`` whose slots hold quantized keys and values (``QuantizedSlotBuffers``)."""

    holds_codes = True

    slots: QuantizedSlotBuffers | None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        config = self.policy.config
        self.dtype, self.device = key_states.dtype, key_states.device
        self.slots = QuantizedSlotBuffers.empty_quantized(
            key_states, value_states, config.kv_bits, config.kv_group, config.kv_residual
        )
        self.is_initialized = True

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._settle()
        self.slots.stream_seen = self.seen  # (a pass taken back, KVzip's reconstruction, rewinds ``seen``)
        return self.slots.view(self.view_width)

    keys = property(lambda self: None if self.slots is None else self._read()[0], CompressedLayer._only_none)
    values = property(lambda self: None if self.slots is None else self._read()[1], CompressedLayer._only_none)

    _reads_codes = False  # this forward's attention reads the codes (``core.quantized_attention``)
    # what this decoding step's attention from the codes found of the residual window (``ring_targets``) and the
    # state it holds for (width, tokens seen, the slots' ring and token tensors), until the step's eviction is done
    # (which may come after ``end_forward``: the layers' evictions joined at the forward's end)
    _ring_read: tuple | None = None

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward with no gradient, the method's attention the default and keys at their stored positions
        attends from the codes in ``attend`` (a decoding step in one pass, ``quantized_one_query``; several tokens
        a block of slots at a time, ``quantized_chunk_attention``): ``update`` returns stand-ins shaped like the
        slots read (one NaN each, expanded: nothing else may read them) instead of building the dequantized view.
        (A method that reads ``layer.keys`` or ``layer.values`` itself still builds the view then.)"""
        self._reads_codes, self._ring_read = self.codes_readable(), None
        if not self._reads_codes:
            return super().attended()
        self._settle()
        self.slots.stream_seen = self.seen
        batch, heads = self.slots.token_idx.shape[:2]
        width = self.view_width
        stand_in = self.forward_pass.cached(("nan-stand-in", self.slots.key_scale.dtype, self.device), self._nan)
        key_dim, value_dim = self.slots.key_scale.shape[-1], self.slots.ring_values_dim()
        return stand_in.expand(batch, heads, width, key_dim), stand_in.expand(batch, heads, width, value_dim)

    def _nan(self) -> torch.Tensor:
        """One NaN of the stored parameters' dtype (``[1, 1, 1, 1]``), made once per forward for every layer."""
        return self.slots.key_scale.new_full((1, 1, 1, 1), float("nan"))

    def codes_readable(self) -> bool:
        """Whether this forward's attention reads the codes: no gradient, the method's attention the default, keys
        at their stored positions (a method's quantized layer that reads the codes its own way says so itself)."""
        policy = self.policy
        return not torch.is_grad_enabled() and type(policy).attend is Policy.attend and policy.position_mode != "cache"

    def attend(self, query, key, value, mask, scaling) -> tuple[torch.Tensor, AttentionStats | None] | None:
        if not self._reads_codes:
            return super().attend(query, key, value, mask, scaling)
        request = self.policy.stats if self.policy.wants_stats(self) else StatsRequest()
        return self.attend_codes(query, mask, scaling, request)

    def attend_codes(
        self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, request: StatsRequest
    ) -> tuple[torch.Tensor, AttentionStats | None]:
        """This forward's attention read from the codes, with the statistics ``request`` asks for."""
        slots, width = self.slots, self.view_width
        if self.new_tokens > 1:
            keys, values, where = slots.fresh
            if isinstance(where, int):
                where = torch.arange(where, where + keys.shape[2], device=self.device).expand(*keys.shape[:3])
            exact = [(keys, values, where)]
            if slots.ring is not None:  # (the ring first: the forward's own tokens are copied over it)
                exact.insert(0, (*slots.ring, slots.ring_targets(width)))
            return quantized_chunk_attention(slots, width, query, mask, scaling, request, exact)
        if slots.ring is not None:  # (the step's token is in the ring)
            key = ("ring-newest", self.seen, slots.residual, slots.group, self.device)
            newest = self.forward_pass.cached(key, slots.ring_newest)
            exact = (*slots.ring, slots.ring_targets(width, newest))
            self._ring_read = (width, self.seen, slots.ring_slot, slots.token_idx, exact[2])  # (``read_slots``)
        else:
            keys, values, where = slots.fresh
            if isinstance(where, int):
                where = slots.token_idx.new_full((*keys.shape[:2], 1), where)
            exact = (keys, values, where)
        return quantized_one_query(slots, width, query, mask, scaling, request, exact)

    _span = 0  # a holed layer's view: the slots it had when it stopped being dense (capacity may be wider)

    @property
    def view_width(self) -> int:
        return self.occupied if self.dense else (self._span or self.slots.capacity)

    def _keep_span(self) -> None:
        if self.dense:
            self._span = self.occupied

    def evict(self, victims: torch.Tensor) -> None:
        self._keep_span()
        super().evict(victims)
        self._ring_read = None

    def evict_mask(self, dropped: torch.Tensor) -> None:
        self._keep_span()
        super().evict_mask(dropped)
        self._ring_read = None

    def read_slots(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H_kv, n, d]`` of the slots ``index`` ``[B, H_kv, n]`` as attention reads them, from
        the codes (``QuantizedSlotBuffers.read_at``), with the exact window's slots this step's attention found."""
        self._settle()
        self.slots.stream_seen = self.seen
        slots, width, read = self.slots, self.view_width, self._ring_read
        same = read is not None and read[:2] == (width, self.seen)
        same = same and read[2] is slots.ring_slot and read[3] is slots.token_idx
        return slots.read_at(index, width, read[4] if same else None)

    def expire_window(self) -> None:
        self._keep_span()
        super().expire_window()

    def reset(self) -> None:
        super().reset()
        self._span, self._ring_read = 0, None

    def _at_capacity(self, width: int) -> bool:
        """Capacity is whole key groups: a layer is full when less than a group of room is left (else a decoding
        step at the budget would compact and reallocate every time instead of reusing the victim's slot); the
        holed layer's view stays the slots it had (``_span``), so every slot it shows holds a token."""
        return width + self.slots.group > self.slots.capacity

    def compact(self, shrink: bool = False, used: int | None = None) -> None:
        if self.slots is not None:
            self.slots.stream_seen = self.seen
        super().compact(shrink, used)

    def kept(self):
        if self.slots is not None:
            self.slots.stream_seen = self.seen
        return super().kept()

    def end_forward(self) -> None:
        super().end_forward()
        self._reads_codes = False
        if self.slots is not None:
            self.slots.end_forward()

    def replay_steady(self) -> bool:
        return False

    # --- accounting ----------------------------------------------------------------------------------------
    def kv_nbytes(self) -> int:
        """Codes, value parameters, key-group parameters of the stored tokens, and the exact residual window."""
        if self.slots is None:
            return self.side_nbytes(False)
        slots = self.slots
        return (
            self.occupied * slots.kv_bytes_per_slot()
            + slots.key_params_nbytes(self.occupied)
            + slots.ring_nbytes(False)
            + self.side_nbytes(False)
        )

    def allocated_nbytes(self) -> int:
        if self.slots is None:
            return self.side_nbytes(False)
        slots = self.slots
        return (
            slots.capacity * slots.kv_bytes_per_slot()
            + slots.key_params_nbytes(slots.capacity)
            + slots.ring_nbytes(True)
            + self.side_nbytes(False)
        )


def quantized_layer_class(config: MethodConfig, layer_class: type) -> type:
    """The layer class storing ``config``'s method with ``config.kv_bits``: ``layer_class`` itself at 16 bits, the
    quantized slot layer for the standard layer; ``ValueError`` naming the way out for any other storage."""
    if config.kv_bits == 16 or layer_class.holds_codes:  # (a method's own quantized layer, its config's choice)
        return layer_class
    if issubclass(layer_class, RaggedLayer):  # (quantizes its pool itself: ``core.ragged_quantized``)
        return layer_class
    if layer_class is CompressedLayer:
        return QuantizedLayer
    raise ValueError(
        f"kv_bits={config.kv_bits} is not supported by method {config.name!r} with its storage "
        f"{layer_class.__name__}; kv_bits=16 keeps the model's dtype"
    )
