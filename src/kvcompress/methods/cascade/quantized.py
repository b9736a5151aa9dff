"""The cascade's rings and streaming's circular ring stored in 8, 4 or 2 bits (KIVI, ``core.kivi``): ``kv_bits``,
``kv_group`` and ``kv_residual`` for ``cascade`` and for ``streaming`` with ``circular=true``.

**What is held between forwards**: codes, and exact only what KIVI keeps exact or what has no place among codes:

- **values per token** in groups of ``kv_group`` channels (codes, scale and minimum per slot), quantized once
  (KIVI's axis for values): with one ring when the token's key group is sealed (until then it is read from the
  residual window: one quantization of ``kv_group`` values every ``kv_group`` steps rather than one per step),
  with several rings when the token is written;
- **keys, one ring** (streaming's circular ring, a cascade with ``cascades=1``): KIVI's per-channel key groups, a
  group being ``kv_group`` consecutive ring slots (the last group of a ring whose width is not a multiple of
  ``kv_group`` has the rest). The ring is written one slot at a time in stream order, each key turned once, when
  written, into the ring's frame, so the tokens of a group are ``kv_group`` consecutive tokens of the stream and
  are never turned again: a group is quantized (sealed) when its last slot is written, from the exact keys of its
  tokens (all in the residual window, which is at least a group long), and its codes and parameters are not
  touched until the ring comes round and writes its last slot again. Meanwhile the group's slots already
  rewritten are read from the residual window and the others from the former codes with their (unchanged)
  parameters, so every key is rounded exactly once, as KIVI rounds groups of the stream;
- **keys, several rings** (``cascades > 1``): per token, in groups of ``kv_group`` channels as the values. A
  token moves from ring to ring and its key is turned by each move (``schedule.move_turn``), and a ring other than
  the first is written at every ``b^i``-th token and by selections that overwrite its newest token, so groups of
  ring slots would be re-formed at every move; per token, a move re-quantizes the moved key alone (from its
  dequantized, turned value) and rounds it once more: a key in ring ``i`` has been rounded at most ``i + 1`` times
  (once when written to the first ring, once per move; one fewer when it left the first ring inside the exact
  window). Applying the turns at read time instead would keep one rounding but turn every stored key at every
  step (a rotation per slot, where the rings turn one query per frame). The moved token's value is quantized
  again from its dequantized value too: the same codes and minimum (its minimum reads back exactly and its
  maximum onto the top code), the scale within a rounding of the stored one;
- **the sinks** exact (``sinks`` tokens, rewritten from an exact copy whenever the oldest ring's frame moves, as
  in full precision);
- **the residual window**: the newest ``min(kv_residual, W)`` real tokens, exact (``W``: a ring's width), as KIVI
  keeps its newest tokens. Every token enters the first ring, which holds the ``W`` newest, and a token keeps its
  key's angle while it stays there, so the window is the first ring's newest tokens: an exact copy of each, in an
  entry indexed by its real-token index modulo the window, read over its slot. A window longer than a ring's
  width would reach tokens moved to other rings (turned since), so it stops at ``W``. With one ring it must hold a
  whole key group: ``kv_residual=0`` is refused there (``ValueError``).

**What a forward reads**: the layer's keys and values dequantized into a buffer of the model's dtype shaped as the
full-precision layer's (``_kv``: sinks and rings side by side), with the exact sinks and the residual window
copied over their slots, built when the forward's tokens arrive (``update``); the rings' own code then runs on
it unchanged (its moves, its attention, the EMA of the cascade's scores), and once the forward has attended the
slots it wrote are quantized back (``_commit``) and the buffer is handed back. So a forward's attention is exactly
the full-precision rings' attention over the dequantized storage, and what is kept and moved is what the schedule
decides at 16 bits: the schedule depends on the token count only, except the cascade's selections, decided by
EMA scores taken from attention over the dequantized keys (they may then differ from 16 bits'). Streaming's ring
has no scores.

**A decoding step of streaming's ring** (one token, the batch in step, no gradient, the ring not growing) builds
no such buffer: it attends from the codes (``_decode_codes``), unpacked and dequantized in place into a float32
buffer of the cache (keys and values apart, each contiguous), the exact sinks, residual window and new token
copied over their rows, two products and a softmax in float32, as ``core.quantized_attention`` reads the slot
layer's codes; then it writes what ``_commit`` would (the token's exact row, the sinks, a sealed key group). Its
logits are those of the step over the dequantized storage up to float rounding, and it stores the same codes.
Its float32 buffer is the cache's buffer below where the model's dtype is float32, else a second one shared the
same way (working memory as well: as large as the largest layer's keys and values in float32).

Costs: per forward and layer the dequantization (one unpack and one multiply-add per tensor over the layer's
slots, then the exact rows copied over theirs) into one buffer of the cache, as large as the largest layer's keys
and values in the model's dtype, which every quantized ring layer of the cache uses in turn and which is kept
between forwards (working memory, as the slot layer's decoding step's float32 buffer, not counted by ``nbytes``);
per decoding step the codes of one value (and of one key per move with several rings) are written, and a key
group (one ring) every ``kv_group`` steps. A quantized ring does not replay as a captured CUDA graph
(``replay_steady`` is False: ``DecodeGraph`` decodes it eagerly), and the decoding steps of several cascade layers
move their tokens one layer at a time (``ring_decode`` stacks buffers that live across steps).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from kvcompress.core.forward import from_host
from kvcompress.core.kivi import (
    dequantize_keys,
    dequantize_values,
    packed_width,
    quantize_keys,
    quantize_values,
    unpack_into,
)
from kvcompress.core.quantized_slots import check_dims
from kvcompress.core.rotation import turn
from kvcompress.methods.cascade.layer import CascadeLayer
from kvcompress.methods.cascade.schedule import Rings, advance

# per cache (its ``ForwardPass``): the buffer a forward dequantizes a layer into, reused by its layers and forwards
_SCRATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class QuantizedRings:
    """The quantized storage of a cascade layer (mixed in before ``CascadeLayer`` or ``CircularSinkLayer``; see the
    module docstring). ``_kv`` is the dequantized buffer while a forward runs (``_live``), else a stand-in of the
    same shape holding nothing."""

    holds_codes = True  # (``core.quantized_layer.quantized_layer_class`` takes it as it is)

    def __init__(self, *args, **kwargs) -> None:
        self._codes: dict[str, torch.Tensor] | None = None
        self._live = False
        self._written: list[torch.Tensor] = []  # [B or 1, m] slots the executor wrote this forward (several rings)
        self._code_view_cache: tuple | None = None  # ``_code_views``: what they were made from, and the views
        super().__init__(*args, **kwargs)
        config = self.policy.config
        self.bits, self.group, self.residual = config.kv_bits, config.kv_group, config.kv_residual
        self.per_channel = self.cascades == 1  # keys in per-channel groups of ring slots (one ring), else per token
        self.window = min(self.residual, self._layout.width)  # the exact window (the first ring's newest tokens)
        if self.per_channel and self.residual == 0:
            raise ValueError(
                f"kv_residual=0 is not supported by {config.name!r} on its ring (cascades=1): the ring's key groups "
                f"are sealed from the exact window, which needs kv_residual >= kv_group ({self.group})"
            )

    # the decoding steps of several layers are not moved together (their buffers live for one forward)
    ring_layers = property(lambda self: None, lambda self, value: None)

    def replay_steady(self) -> bool:
        return False

    # --- storage ---------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # the first forward's buffer: zeros, as the codes
        batch, heads = key_states.shape[:2]
        key_dim, value_dim, bits, group = key_states.shape[-1], value_states.shape[-1], self.bits, self.group
        check_dims(key_dim, value_dim, bits, group)
        if not self.per_channel and key_dim % group:
            raise ValueError(
                f"kv_group must divide the key head dimension ({key_dim}) for per-token key groups "
                f"(cascades > 1); got {group}"
            )
        self._value_dim = value_dim
        codes = {"dtype": torch.uint8, "device": self.device}
        slots = self.capacity + 1
        # per slot, per token: the value (one ring), the key and the value side by side as in ``_kv`` (several rings:
        # one quantization and one dequantization of the whole row, its key's channel groups, then its value's)
        width = value_dim if self.per_channel else key_dim + value_dim
        self._codes = {
            "values": torch.zeros(batch, heads, slots, packed_width(width, bits), **codes),
            "value_scale": key_states.new_zeros(batch, heads, slots, width // group),
            "value_min": key_states.new_zeros(batch, heads, slots, width // group),
        }
        if self.per_channel:
            groups = self._key_groups() + 1  # (the last: a scratch group)
            self._codes["keys"] = torch.zeros(batch, heads, groups * group, packed_width(key_dim, bits), **codes)
            self._codes["key_scale"] = key_states.new_zeros(batch, heads, groups, key_dim)
            self._codes["key_min"] = key_states.new_zeros(batch, heads, groups, key_dim)
        width = key_dim + value_dim
        self._exact = key_states.new_zeros(batch, heads, self.window + 1, width)  # (the last entry: scratch)
        self._sink_exact = key_states.new_zeros(batch, heads, self.sinks, width)
        self._live, self._base = True, list(self._rows())

    def _key_groups(self) -> int:
        """Key groups covering the ring slots allocated (one ring)."""
        return -(-(self.capacity - self.sinks) // self.group)

    def _stub(self) -> torch.Tensor:
        """A stand-in for ``_kv`` between forwards: its shape, no storage (made again when the shape changes)."""
        batch, heads = self._codes["values"].shape[:2]
        shape = (batch, heads, self.capacity + 1, self._key_dim + self._value_dim)
        stub = getattr(self, "_stub_kv", None)
        if stub is None or stub.shape != shape:
            stub = self._stub_kv = self._codes["value_scale"].new_zeros(1, 1, 1, 1).expand(shape)
        return stub

    def _dequantized(self, shared: bool = False) -> torch.Tensor:
        """The storage as a forward reads it: ``[B, H, slots + 1, dk + dv]`` in the model's dtype, the exact sinks
        and residual window over their slots (the last slot, scratch, zeros). ``shared``: into the cache's buffer
        for this (``_buffer``), else a new one."""
        codes, bits, group, sinks, dim = self._codes, self.bits, self.group, self.sinks, self._key_dim
        batch, heads = codes["values"].shape[:2]
        slots = self.capacity + 1
        rows = slots
        if self.per_channel:
            groups = self._key_groups()
            rows = max(rows, sinks + groups * group)
        shape = (batch, heads, rows, dim + self._value_dim)
        buffer = self._buffer(shape) if shared else codes["value_scale"].new_empty(shape)
        kv = buffer[:, :, :slots]
        if self.per_channel:
            if groups:
                dequantize_keys(
                    codes["keys"][:, :, : groups * group].unflatten(2, (groups, group)),
                    codes["key_scale"][:, :, :groups],
                    codes["key_min"][:, :, :groups],
                    bits,
                    out=buffer[:, :, sinks : sinks + groups * group, :dim].unflatten(2, (groups, group)),
                )
        rows_read = kv[..., dim:] if self.per_channel else kv  # (several rings: keys and values in one)
        dequantize_values(codes["values"], codes["value_scale"], codes["value_min"], bits, out=rows_read)
        kv[:, :, -1] = 0
        grad = torch.is_grad_enabled() and (self._sink_exact.requires_grad or self._exact.requires_grad)
        if grad:  # (a forward recorded for a backward pass: the exact parts carry a gradient, put out of place)
            kv = kv.clone()
        if sinks:
            kv = torch.cat([self._sink_exact, kv[:, :, sinks:]], 2) if grad else kv
            if not grad:
                kv[:, :, :sinks] = self._sink_exact
        if self.window:
            where = self._window_slots()  # [B or 1, window]: the slot each entry's token sits in (scratch: none)
            exact = self._exact[:, :, : self.window]
            if grad:
                kv = kv.scatter(2, where[:, None, :, None].expand(batch, heads, -1, kv.shape[-1]), exact)
            else:  # one ``index_copy_`` of every entry (the scratch one too) into the buffer seen as rows
                into = self._window_rows(where, batch, heads, rows, slots)
                buffer.view(-1, buffer.shape[-1]).index_copy_(0, into, self._exact.reshape(-1, self._exact.shape[-1]))
        return kv

    def _window_rows(self, where: torch.Tensor, batch: int, heads: int, rows: int, slots: int) -> torch.Tensor:
        """``[B H (window + 1)]``: the row of a buffer ``[B, H, rows, ...]`` seen as rows that each entry of the
        residual window (the scratch one last, to the scratch slot ``slots - 1``) is copied to (``where``:
        ``_window_slots``)."""
        key = ("q-window-rows", where.data_ptr(), batch, heads, rows, slots)

        def build() -> torch.Tensor:
            offsets = torch.arange(0, batch * heads * rows, rows, device=self.device).view(batch, heads, 1)
            scratch = where.new_full((where.shape[0], 1), slots - 1)
            return (offsets + torch.cat([where, scratch], 1)[:, None, :]).flatten()

        return self.forward_pass.cached(key, build)

    # --- a decoding step of streaming's ring read from the codes ----------------------------------------------------
    def _decode_codes(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """``CircularSinkLayer._decode_circular`` of the quantized ring with no dequantized storage built for it:
        the ring's codes are unpacked straight into a float32 buffer of the cache (keys ``[B, H, rows, dk]`` and
        values ``[B, H, rows, dv]``, each contiguous) and dequantized in place (``core.kivi``: one multiply-add per
        tensor), the exact sinks and residual window copied over their rows (one ``index_copy_`` each for keys and
        values), the new token (its key turned to its angle in the model's dtype, as the full-precision ring stores
        it) into the spare row; one product gives the logits, one softmax the probabilities, one product the output,
        in float32 (as ``core.quantized_attention`` reads the slot layer's codes), cast to the query's dtype. Then,
        as ``_commit`` does after a forward over the dequantized storage: the token's exact key and value into its
        window entry, the sinks rewritten where the frame moved, and the key group sealed by the token quantized.
        What this saves against that forward: the model-dtype buffer interleaving keys and values (dequantized
        through strided views), its scratch row zeroed, the token's row written and moved, the copies of the sinks
        and of the new rows back, and the SDPA call (one query: its CPU kernel costs more than the two products)."""
        bits, sinks, dim, before = self.bits, self.sinks, self._key_dim, self._shared
        after, moves = advance(self._layout, before)
        seen, dest = before.seen, moves.dests[0]
        spare = self.capacity if before.count[0] == self._layout.width else dest  # a full ring: the scratch slot
        view = self._code_views(spare)
        if view.key_codes is not None:
            unpack_into(view.key_codes, bits, view.key_out)
            torch.addcmul(view.key_min, view.key_out, view.key_scale, out=view.key_out)
            unpack_into(view.value_codes, bits, view.value_out)  # (``dequantize_values`` on the cached views)
            torch.addcmul(view.value_min, view.value_grouped, view.value_scale, out=view.value_grouped)
        if sinks:
            view.sink_keys.copy_(view.exact_sink_keys)
            view.sink_values.copy_(view.exact_sink_values)
        into = self._window_rows(self._window_slots(), *view.shape, self.capacity + 1)
        view.key_rows.index_copy_(0, into, view.exact_keys)
        view.value_rows.index_copy_(0, into, view.exact_values)
        new_key = turn(pending.keys, self._rotation(pending, (seen,), dim, pending.keys.dtype))  # [B, H, 1, dk]
        new_value = pending.values.to(new_key.dtype)
        view.spare_key.copy_(new_key)
        view.spare_value.copy_(new_value)

        turned = turn(query.float(), self._rotation(pending, (seen,), dim, torch.float32, scale))
        logits = torch.bmm(turned.view(view.key_t.shape[0], -1, dim), view.key_t)
        output = torch.bmm(logits.softmax(-1), view.value_t)
        output = output.view(*query.shape[:3], -1).to(query.dtype)

        self._set_shared(after)
        self._meta[:, dest] = self._shared_meta(pending)[:, 0]
        if sinks:  # (the frame moved: the sinks rewritten from their copy, in their exact rows)
            stand_in, self._kv = self._kv, self._sink_exact
            try:
                self._sync_sinks([before])
            finally:
                self._kv = stand_in
        entry = seen % self.window
        self._exact[:, :, entry, :dim] = new_key[:, :, 0]
        self._exact[:, :, entry, dim:] = new_value[:, :, 0]
        if any(self._sealed([before], [after])):
            keys, values = view.keys, view.values
            if dest != spare:
                keys[:, :, dest] = keys[:, :, spare]
                values[:, :, dest] = values[:, :, spare]
            self._seal(keys, values, [before], [after])
        self._views = self._returned = None  # (as after a forward over the dequantized storage)
        return output

    def _code_views(self, spare: int) -> _CodeViews:
        """The views ``_decode_codes`` works on, made again when the buffer, the storage or the spare slot changes
        (per step a few dozen views fewer, each a dispatch on the CPU: the same step once the ring is full)."""
        codes, sinks, group, dim, value_dim = self._codes, self.sinks, self.group, self._key_dim, self._value_dim
        batch, heads = codes["values"].shape[:2]
        slots, groups = self.capacity + 1, self._key_groups()
        rows = max(slots, sinks + groups * group)
        size = batch * heads * rows
        flat = self._buffer((size * (dim + value_dim),), torch.float32, held=False)  # (free again on return)
        found = getattr(self, "_code_view_cache", None)
        numbers, tensors = (flat.data_ptr(), flat.numel(), spare), (self._exact, self._sink_exact, *codes.values())
        if found is not None and found[0] == numbers and all(a is b for a, b in zip(found[1], tensors, strict=True)):
            return found[2]
        keys, values = flat[: size * dim].view(batch, heads, rows, dim), flat[size * dim :].view(batch, heads, rows, -1)
        ring = min(spare, self.capacity) - sinks  # ring slots read from the codes (then the window over them)
        used, ring_slots = -(-ring // group), slice(sinks, sinks + ring)
        exact = self._exact.flatten(0, 2)
        stored = spare + 1
        grouped = values[:, :, ring_slots].unflatten(-1, (codes["value_scale"].shape[-1], -1))
        view = _CodeViews(
            shape=(batch, heads, rows),
            keys=keys,
            values=values,
            key_codes=codes["keys"][:, :, : used * group].unflatten(2, (used, group)) if used else None,
            key_out=keys[:, :, sinks : sinks + used * group].unflatten(2, (used, group)),
            key_scale=codes["key_scale"][:, :, :used, None, :],
            key_min=codes["key_min"][:, :, :used, None, :],
            value_codes=codes["values"][:, :, ring_slots],
            value_out=values[:, :, ring_slots],
            value_grouped=grouped,
            value_scale=codes["value_scale"][:, :, ring_slots, :, None],
            value_min=codes["value_min"][:, :, ring_slots, :, None],
            sink_keys=keys[:, :, :sinks],
            sink_values=values[:, :, :sinks],
            exact_sink_keys=self._sink_exact[..., :dim],
            exact_sink_values=self._sink_exact[..., dim:],
            key_rows=keys.view(-1, dim),
            value_rows=values.view(-1, value_dim),
            exact_keys=exact[:, :dim].float(),  # (float32: the storage itself; else a copy, made per step)
            exact_values=exact[:, dim:].float(),
            spare_key=keys[:, :, spare : spare + 1],
            spare_value=values[:, :, spare : spare + 1],
            key_t=keys.view(-1, rows, dim)[:, :stored].transpose(1, 2),
            value_t=values.view(-1, rows, value_dim)[:, :stored],
        )
        if view.exact_keys.data_ptr() != exact.data_ptr():  # (a copy: not kept, it would go stale)
            self._code_view_cache = None
            return view
        self._code_view_cache = (numbers, tensors, view)
        return view

    def _window_slots(self) -> torch.Tensor:
        """``[B or 1, window]``: per entry of the residual window, the first-ring slot of the token it holds (the
        newest real token ``p`` with ``p mod window`` the entry), or the scratch slot where that token is a sink
        or not seen yet."""
        rows = tuple(rings.seen for rings in self._rows())
        sinks, width, slots = self.sinks, self._layout.width, self.capacity

        def build() -> torch.Tensor:
            seen = from_host(list(rows), self.device)[:, None]
            entry = torch.arange(self.window, device=self.device)
            token = seen - 1 - (seen - 1 - entry).remainder(self.window)
            return torch.where(token >= sinks, sinks + (token - sinks).remainder(width), slots)

        return self.forward_pass.cached(("q-window", rows, self.window, sinks, width, slots, self.device), build)

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype | None = None, held: bool = True) -> torch.Tensor:
        """A buffer of ``shape`` for this forward's dequantized storage: the cache's, which every quantized ring
        layer of the cache uses in turn (a layer's buffer lives from its ``update`` to the end of its attention, so
        no two layers of a forward hold it at once; one that does, a forward that never attended, gets its own),
        grown when a layer needs more: no allocation per step once the largest layer has run. ``dtype`` (float32
        for a decoding step read from the codes, ``_decode_codes``), where it is not the model's: a second buffer of
        the cache, shared the same way. ``held``: the buffer is held past the call (``_materialize``: until the
        layer's attention), so that a layer that finds it held by another gets its own."""
        holder = _SCRATCH.setdefault(self.forward_pass, {})
        owner = holder.get("owner")
        owner = None if owner is None else owner()
        model_dtype, size = self._codes["value_scale"].dtype, math.prod(shape)
        dtype = model_dtype if dtype is None else dtype
        name = "buffer" if dtype == model_dtype else f"buffer-{dtype}"
        if owner is not None and owner is not self and owner._live and name == "buffer":
            return self._codes["value_scale"].new_empty(shape, dtype=dtype)
        found = holder.get(name)
        if found is None or found.numel() < size or found.dtype != dtype or found.device != self.device:
            found = holder[name] = self._codes["value_scale"].new_empty(size, dtype=dtype)
        if name == "buffer" and held:
            holder["owner"] = weakref.ref(self)
        return found[:size].view(shape)

    # --- a forward: dequantized in, written slots quantized back ----------------------------------------------
    def _materialize(self) -> None:
        self._kv = self._dequantized(shared=True)
        self._live, self._base, self._written = True, list(self._rows()), []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and not self._live and not self._codes_step_possible(key_states.shape[2]):
            self._materialize()
        return super().update(key_states, value_states, *args, **kwargs)

    def _codes_step_possible(self, count: int) -> bool:
        """Whether this forward may be a decoding step of streaming's ring read from the codes (``_decode_codes``):
        then ``update`` leaves the storage quantized, and ``cascade_attention`` either reads the codes or, where the
        step turns out not to qualify (``_steps_alone``), dequantizes it then (the layout has not changed since)."""
        return (
            count == 1
            and self.attend_first
            and self.per_channel
            and self._pending is None
            and self._in_step
            and self.inv_freq is not None
            and not torch.is_grad_enabled()
            and self._shared.seen >= self.sinks  # (the token is not a sink)
            and (self.capacity >= self.full_capacity or self.seen + 1 <= self.capacity)  # (the ring does not grow)
        )

    def _apply_moves(self, executor, columns, new) -> None:
        super()._apply_moves(executor, columns, new)
        if not self.per_channel:
            written = columns.written
            self._written.append(written[None] if written.dim() == 1 else written)

    def cascade_attention(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        if not self._live and self._pending is not None:  # (``update`` left the storage quantized)
            pending = self._pending
            if query.shape[2] == 1 and self._steps_alone(pending) and not torch.is_grad_enabled():
                self._pending = None
                scale = query.shape[-1] ** -0.5 if scaling is None else scaling
                return self._decode_codes(query, pending, scale)
            self._materialize()
        output = super().cascade_attention(query, scaling)
        self._commit()
        return output

    def after_attention(self, stats) -> None:
        if not self._live and self._pending is not None and self._codes is not None:
            self._materialize()  # (a forward that did not attend through ``cascade_attention``)
        super().after_attention(stats)
        self._commit()

    def _commit(self) -> None:
        """Quantize back what this forward wrote and let the dequantized buffer go (see the module docstring)."""
        if not self._live:
            return
        kv, sinks = self._kv, self.sinks
        if sinks:
            self._sink_exact.copy_(kv[:, :, :sinks])
        before, after = self._base, self._rows()
        if len(before) < len(after):  # the batch left step during the forward
            before = before * len(after)
        new = self._new_tokens(before, after)  # [B or 1, n]: (slot, window entry) of the new tokens still stored
        if new is not None:
            slots, entries = new
            if self.window:
                batch, heads = kv.shape[:2]
                rows = kv.gather(2, slots[:, None, :, None].expand(batch, heads, -1, kv.shape[-1]))
                self._exact.scatter_(2, entries[:, None, :, None].expand_as(rows), rows)
        if self.per_channel:
            self._seal(kv[..., : self._key_dim], kv[..., self._key_dim :], before, after)
        elif self._written:
            written = torch.cat([w.expand(kv.shape[0], -1) for w in self._written], 1)
            self._quantize_values(kv, written)
        self._kv, self._live, self._written = self._stub(), False, []
        self._views = self._returned = None  # (they hold the buffer)
        holder = _SCRATCH.get(self.forward_pass)
        if holder is not None and holder.get("owner") is not None and holder["owner"]() is self:
            holder["owner"] = None

    def _new_tokens(self, before: list[Rings], after: list[Rings]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``[B or 1, n]``: the first-ring slots of the real tokens this forward brought that the first ring holds,
        and their entries in the residual window (the scratch entry for those outside it); padded with the scratch
        slot. ``None``: no new token past the sinks."""
        sinks, width, window, slots = self.sinks, self._layout.width, self.window, self.capacity
        spans = [(max(old.seen, sinks, now.seen - width), now.seen) for old, now in zip(before, after, strict=True)]
        count = max(stop - start for start, stop in spans)
        if count <= 0:
            return None

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            bounds = from_host(spans, self.device)  # [rows, 2]
            token = bounds[:, :1] + torch.arange(count, device=self.device)
            real = token < bounds[:, 1:]
            slot = torch.where(real, sinks + (token - sinks).remainder(width), slots)
            inside = real & (token >= bounds[:, 1:] - window)
            entry = torch.where(inside, token.remainder(max(window, 1)), window)
            return slot, entry

        return self.forward_pass.cached(("q-new", tuple(spans), sinks, width, window, slots, self.device), build)

    def _quantize_values(self, part: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize the values of ``slots`` ``[B or 1, n]`` of ``part`` (per token: with one ring the values, with
        several the keys and values side by side) into their codes."""
        batch, heads = part.shape[:2]
        index = slots[:, None, :, None].expand(batch, heads, -1, part.shape[-1])
        rows = part.gather(2, index).detach().to(self.dtype)  # (the quantizer passes no gradient)
        packed, scale, low = quantize_values(rows, self.bits, self.group)
        codes = self._codes
        for name, tensor in (("values", packed), ("value_scale", scale), ("value_min", low)):
            codes[name].scatter_(2, index[..., : tensor.shape[-1]], tensor)

    def _sealed(self, before: list[Rings], after: list[Rings]) -> list[list[int]]:
        """Per sequence, the key groups whose last slot this forward wrote (one ring; once per forward)."""
        sinks, width, group = self.sinks, self._layout.width, self.group
        spans = tuple((max(old.seen, sinks), now.seen) for old, now in zip(before, after, strict=True))

        def build() -> list[list[int]]:
            rows = []
            for first, seen in spans:
                groups = []
                if seen - first == 1:  # a decoding step: the group of the token's slot if it is the group's last
                    offset = (first - sinks) % width
                    if offset % group == group - 1 or offset == width - 1:
                        groups.append(offset // group)
                elif seen > first:
                    for index in range(-(-width // group)):
                        last = min((index + 1) * group, width) - 1  # the group's last ring offset
                        token = seen - 1 - (seen - 1 - sinks - last) % width  # the newest token written there
                        if token >= first:
                            groups.append(index)
                rows.append(groups)
            return rows

        return self.forward_pass.cached(("q-sealed", spans, sinks, width, group), build)

    def _seal(self, keys: torch.Tensor, values: torch.Tensor, before: list[Rings], after: list[Rings]) -> None:
        """Quantize the key groups completed by this forward from the keys ``[B, H, slots, dk]`` and values of their
        slots (exact: see the module docstring; in the model's dtype or float32 holding its numbers), one
        ``quantize_keys`` for all of them."""
        sealed = self._sealed(before, after)
        count = max(len(row) for row in sealed)
        if not count:
            return
        group, sinks, width, slots = self.group, self.sinks, self._layout.width, self.capacity
        scratch = self._codes["key_scale"].shape[2] - 1
        key = ("q-seal", tuple(map(tuple, sealed)), group, sinks, width, slots, scratch, self.device)

        def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            groups = [row + [scratch] * (count - len(row)) for row in sealed]
            offset = [[[index * group + j for j in range(group)] for index in row] for row in groups]
            member = [
                [[o < width and index != scratch for o in run] for run, index in zip(row, indices, strict=True)]
                for row, indices in zip(offset, groups, strict=True)
            ]
            offsets, occupied = from_host(offset, self.device), from_host(member, self.device, torch.bool)
            return from_host(groups, self.device), torch.where(occupied, sinks + offsets, slots), occupied

        groups, members, occupied = self.forward_pass.cached(key, build)  # [B or 1, k], [B or 1, k, G] twice
        batch, heads, dim = keys.shape[0], keys.shape[1], self._key_dim
        self._quantize_values(values, members.flatten(1))  # (the group's values are in the exact window until now)
        index = members.flatten(1)[:, None, :, None].expand(batch, heads, -1, dim)
        rows = keys.gather(2, index).unflatten(2, (count, group)).detach().to(self.dtype)  # [B, H, k, G, d]
        packed, scale, low = quantize_keys(rows, self.bits, occupied[:, None].expand(batch, heads, -1, -1))
        codes = self._codes
        at = groups[:, None, :, None].expand(batch, heads, -1, dim)
        codes["key_scale"].scatter_(2, at, scale)
        codes["key_min"].scatter_(2, at, low)
        grouped = codes["keys"].unflatten(2, (-1, group))
        grouped.scatter_(2, at[..., None, :1].expand(-1, -1, -1, group, packed.shape[-1]), packed)

    # --- the buffers: growth, batch operations, reads between forwards ----------------------------------------
    def _grow(self, needed: int) -> None:
        used = self.capacity
        super()._grow(needed)
        if self.capacity == used:
            return
        self._code_view_cache = None  # (they hold the storage: let the replaced one go)
        codes, pad_to = self._codes, self.capacity + 1
        for name in ("values", "value_scale", "value_min"):
            codes[name] = _padded(codes[name], used, pad_to)
        if self.per_channel:
            old = codes["key_scale"].shape[2] - 1
            groups = self._key_groups()
            for name in ("key_scale", "key_min"):
                codes[name] = _padded(codes[name], old, groups + 1)
            codes["keys"] = _padded(codes["keys"], old * self.group, (groups + 1) * self.group)

    def move_batch(self, move) -> None:
        if not self.is_initialized:
            return
        if not self._live:
            self._kv = self._kv[:, :1, :1, :1]  # (the stand-in: nothing to reorder)
        super().move_batch(move)
        for name, tensor in self._codes.items():
            self._codes[name] = move(tensor)
        self._exact, self._sink_exact = move(self._exact), move(self._sink_exact)
        self._code_view_cache = None
        self._base = list(self._rows())
        if not self._live:
            self._kv = self._stub()

    def _drop(self, value: None) -> None:
        super()._drop(value)
        self._codes, self._live, self._written, self._code_view_cache = None, False, [], None

    def _read(self, read):
        """``read()`` with the dequantized buffer in place (built for the call between forwards)."""
        if self._live or self._codes is None:
            return read()
        self._kv = self._dequantized()
        try:
            return read()
        finally:
            self._kv = self._stub()

    keys = property(lambda self: self._read(lambda: CascadeLayer._keys(self)), CascadeLayer._drop)
    values = property(lambda self: self._read(lambda: CascadeLayer.values.fget(self)), CascadeLayer._drop)

    # --- accounting ------------------------------------------------------------------------------------------
    def _per_token_bytes(self) -> int:
        """Bytes of one stored ring token over all rows: key and value codes, value (and per-token key) parameters."""
        codes = self._codes
        total = sum(codes[name][:, :, :1].nbytes for name in ("values", "value_scale", "value_min"))
        if self.per_channel:
            total += codes["keys"][:, :, :1].nbytes
        return total

    def _quantized_nbytes(self, stored: int, seen: int) -> int:
        """Bytes held for ``stored`` tokens (sinks included) after ``seen`` real tokens (the fullest sequence)."""
        sinks = min(stored, self.sinks)
        ring = stored - sinks
        exact_row = self._exact[:, :, :1].nbytes
        total = ring * self._per_token_bytes() + sinks * exact_row
        total += min(ring, self.window, max(0, seen - self.sinks)) * exact_row
        if self.per_channel:
            per_group = self._codes["key_scale"][:, :, :1].nbytes + self._codes["key_min"][:, :, :1].nbytes
            total += math.ceil(ring / self.group) * per_group
        return total

    def kv_nbytes(self) -> int:
        """Codes and parameters of the stored ring tokens (the fullest sequence), the key groups covering them (one
        ring), the exact residual window and sinks."""
        if not self.is_initialized or self._codes is None:
            return 0
        return self._quantized_nbytes(self.stored_length(), max(rings.seen for rings in self._rings))

    def allocated_nbytes(self) -> int:
        """As ``kv_nbytes`` for every slot allocated (the scratch slot and group excluded), the whole window."""
        if not self.is_initialized or self._codes is None:
            return 0
        return self._quantized_nbytes(self.capacity, self.capacity + self.window)


@dataclass
class _CodeViews:
    """Views of the float32 buffer, the codes and the exact rows that a decoding step read from the codes uses."""

    shape: tuple[int, int, int]
    keys: torch.Tensor
    values: torch.Tensor
    key_codes: torch.Tensor | None
    key_out: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    value_codes: torch.Tensor
    value_out: torch.Tensor
    value_grouped: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    exact_sink_keys: torch.Tensor
    exact_sink_values: torch.Tensor
    key_rows: torch.Tensor
    value_rows: torch.Tensor
    exact_keys: torch.Tensor
    exact_values: torch.Tensor
    spare_key: torch.Tensor
    spare_value: torch.Tensor
    key_t: torch.Tensor
    value_t: torch.Tensor


def _padded(tensor: torch.Tensor, used: int, size: int) -> torch.Tensor:
    """``tensor``'s first ``used`` rows along dim 2, zero-padded to ``size`` rows (the last: scratch)."""
    pad = (0, 0, 0, size - used)
    return torch.nn.functional.pad(tensor[:, :, :used], pad)


class QuantizedCascadeLayer(QuantizedRings, CascadeLayer):
    """The Cascading KV Cache with its rings stored quantized (``kv_bits`` below 16)."""
