"""Ragged storage holding codes: a ``RaggedPool`` whose keys and values are quantized (KIVI, ``core.kivi``).

The quantized form of ``core.ragged``'s pool (``kv_bits`` 8, 4 or 2 with a per-head budget: AdaKV's allocation,
KVzip's head-level budgets, DuoAttention). Blocks hold packed codes, ``[N, BLOCK, d * bits / 8]`` ``uint8``, for
keys and values; values are quantized per token in groups of ``group`` channels (``value_scale``, ``value_min``
``[N, BLOCK, d_v / group]``), keys per channel over key groups of ``group`` consecutive slots of a block
(``key_scale``, ``key_min`` ``[N, BLOCK / group, d]``). The choices made here:

- **Blocks of whole key groups.** ``BLOCK`` is the plain pool's block size rounded up to a multiple of ``group``
  (at least one group: 32 tokens with KIVI's group, where the plain pool may take 16), so a key group never spans
  two blocks and keeps KIVI's ``group`` tokens; a row's slack is then at most a block of the larger size.
- **Rows in step with the stream.** Each row starts with ``(seen - count) mod group`` empty slots (``offsets``,
  fewer than ``group``), so that every row's next token falls at the same offset in its key group: numbering a
  row's tokens as if they were the stream's last ``count`` (a row's *virtual index*: its token's place plus
  ``seen - offsets - count``, a multiple of ``group``), every token appended after the move has its stream index
  as virtual index in every row. So the exact window, its ring and the key groups leaving it are the same Python
  numbers for all rows, as in the slot storage (``core.quantized_slots``): a decoding step seals one key group per
  row every ``group`` steps, in one batch of operations, and writes its token into one ring column. A row that kept
  every token has no empty slots, and its key groups are KIVI's groups of ``group`` stream indices (the reference
  ``tests/references/kivi.py`` holds for it).
- **The exact window**: the tokens of virtual index from ``window_start(seen)`` on (the newest ``residual - group
  + 1`` to ``residual``, as the slot storage's) are also kept exact in a ring ``[R, residual, d]`` per row, column
  ``virtual index mod residual``; ``ring_target`` ``[R, residual]`` is the pool slot (plus one; 0: none) each
  column's exact token is read into. A row with fewer tokens than the window holds no token at the window's oldest
  indices: its columns there read into nothing. The codes of a key group are written when it leaves the window
  (``_seal``: from the ring's exact keys and values, once); until then they are not read.
- **The move quantizes** (``from_rows``): the kept tokens are read exact from the slot layout, and every key group
  is quantized from them (those still in the window again when they leave it, with the new tokens of their group).
  Until its one-shot compression the layer is the slot layer in the model's dtype: a method scores the prompt as
  it would at 16 bits (the kept sets are those of ``kv_bits=16`` when the prompt is prefilled before the
  compression), and the prompt's peak memory is a 16-bit cache's.
- **The forward's own tokens are read exactly** (as the slot storage and KIVI do): a forward of several tokens
  attends to its own keys and values as given, even those it pushed out of the window; later forwards read them
  as stored.
- ``residual=0``: a forward's tokens are quantized when written; a key group is quantized again from its members
  read back (dequantized) and the new tokens at each write into it, and a token's value once.

Attention reads the codes: the owned blocks are unpacked into a float32 buffer and dequantized in place (one
multiply-add each for keys and values, as ``core.quantized_attention`` does for slots), the ring's exact tokens
copied over their slots (one ``index_copy_``, a column that holds no token lands in a spare row), and the plain
pool's softmax over blocks runs on it in float32; a forward of several tokens dequantizes once for all its query
chunks. That float32 buffer (the layer's keys and values, dequantized) exists while a layer attends: per step the
memory that grows with the cache is that buffer and the logits, as for quantized slots.

Padding tokens of a padded forward are stored (as in the plain pool) and counted in their key group's range.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcompress.core.forward import from_host
from kvcompress.core.kivi import (
    dequantize_keys,
    packed_width,
    quantize_keys,
    quantize_values,
    unpack_into,
)
from kvcompress.core.quantized_slots import check_dims
from kvcompress.core.ragged import RaggedPool, block_size
from kvcompress.core.ragged_stream import StreamRecord


class QuantizedRaggedPool(RaggedPool):
    """A ``RaggedPool`` of codes (see the module docstring): ``keys``/``values`` hold packed codes."""

    BLOCK_TENSORS = (*RaggedPool.BLOCK_TENSORS, "key_scale", "key_min", "value_scale", "value_min")

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        counts: np.ndarray,
        like: torch.Tensor,
        record: StreamRecord,
        owns_record: bool = True,
        *,
        bits: int,
        group: int,
        residual: int,
        seen: int,
    ) -> None:
        check_dims(head_dim, value_dim, bits, group)
        self.bits, self.group, self.residual = bits, group, residual
        self.stream = seen  # stream index of the next token (the window's clock; a Python number)
        super().__init__(batch, heads, head_dim, value_dim, counts, like, record, owns_record)
        # each row's virtual index minus its place (a multiple of ``group``), and its first token's virtual index
        self.shift = seen - self.counts  # [R] (host)
        self.first_virtual = from_host(seen - (self.counts - self.offsets), self.device, None)  # [R]
        self.ring_keys = like.new_zeros(self.rows, residual, head_dim)
        self.ring_values = like.new_zeros(self.rows, residual, value_dim)
        self.ring_target = torch.zeros(self.rows, residual, dtype=torch.long, device=self.device)
        # the forward's own tokens, read exactly while it runs: keys, values [R q, d] and their slots
        self.fresh: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _plan(self, counts: np.ndarray) -> tuple[int, np.ndarray]:
        block = -(-block_size(counts) // self.group) * self.group
        return block, (self.stream - counts) % self.group

    def _allocate(self, capacity: int, like: torch.Tensor, head_dim: int, value_dim: int) -> None:
        codes = {"dtype": torch.uint8, "device": like.device}
        block, groups = self.block, self.block // self.group
        self.keys = torch.empty(capacity, block, packed_width(head_dim, self.bits), **codes)
        self.values = torch.empty(capacity, block, packed_width(value_dim, self.bits), **codes)
        self.key_scale = like.new_empty(capacity, groups, head_dim)
        self.key_min = like.new_empty(capacity, groups, head_dim)
        self.value_scale = like.new_empty(capacity, block, value_dim // self.group)
        self.value_min = like.new_empty(capacity, block, value_dim // self.group)

    def _clear(self, taken: slice) -> None:
        """Zero codes and parameters (a slot not written yet reads back as 0, never as uninitialised memory)."""
        for name in ("keys", "values", "key_scale", "key_min", "value_scale", "value_min"):
            getattr(self, name)[taken].zero_()

    def move_batch(self, sequences: np.ndarray) -> None:
        """``RaggedPool.move_batch``, with each row's window: its exact ring and virtual indices are copied, and the
        ring's targets (pool slots) follow their blocks to where the copies lie."""
        held = np.arange(self.table.shape[1]) < self.row_blocks[:, None]
        place = np.zeros(self.used, dtype=np.int64)  # each owned block's place among its row's blocks
        place[self.table[held]] = np.nonzero(held)[1]
        source = self.rows_of(sequences)
        rows = from_host(source, self.device, None)
        target = self.ring_target[rows]  # a slot + 1 of the old blocks (0: none)
        super().move_batch(sequences)
        self.shift = self.shift[source]
        self.first_virtual = self.first_virtual[rows]
        self.ring_keys, self.ring_values = self.ring_keys[rows], self.ring_values[rows]
        slot = (target - 1).clamp(min=0)
        column = from_host(place, self.device, None)[slot // self.block]
        moved = from_host(self.table, self.device, None).gather(1, column) * self.block + slot % self.block
        self.ring_target = torch.where(target > 0, moved + 1, 0)

    @property
    def head_dim(self) -> int:
        return self.key_scale.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.value_scale.shape[-1] * self.group

    def window_start(self, seen: int) -> int:
        """The first virtual index read exactly after ``seen`` tokens (``core.quantized_slots``' rule: a multiple
        of ``group``, the newest ``residual - group + 1`` to ``residual`` tokens; ``seen`` without a residual)."""
        if not self.residual:
            return seen
        return max(0, -(-(seen - self.residual) // self.group) * self.group)

    # --- the move ------------------------------------------------------------------------------------------
    def _write_blocks(self, start, stop, flat_keys, flat_values, source, filled, place) -> None:
        """Quantize the moved tokens (keys per key group of the blocks, values per token) and put those in the
        exact window into the ring."""
        blocks, block, group = stop - start, self.block, self.group
        keys = flat_keys.index_select(0, source).detach().view(blocks, block // group, group, -1)
        values = flat_values.index_select(0, source).detach().view(blocks, block, -1)
        codes, scale, minimum = quantize_keys(keys, self.bits, filled.view(blocks, block // group, group))
        self.keys[start:stop] = codes.flatten(1, 2)
        self.key_scale[start:stop], self.key_min[start:stop] = scale, minimum
        codes, scale, minimum = quantize_values(values, self.bits, group)
        self.values[start:stop], self.value_scale[start:stop], self.value_min[start:stop] = codes, scale, minimum
        if not self.residual:
            return
        owner = self.owner[start:stop][:, None]
        virtual = place + from_host(self.shift, self.device, None)[owner]
        exact = (filled & (virtual >= self.window_start(self.stream))).view(-1)  # (one host read, once)
        column = (owner * self.residual + virtual.remainder(self.residual)).view(-1)[exact]
        self.ring_keys.view(-1, self.head_dim).index_copy_(0, column, keys.view(-1, keys.shape[-1])[exact])
        self.ring_values.view(-1, self.value_dim).index_copy_(0, column, values.view(-1, values.shape[-1])[exact])
        slot = torch.arange(start * block, stop * block, device=self.device)[exact]
        self.ring_target.view(-1).index_copy_(0, column, slot + 1)

    # --- appending -----------------------------------------------------------------------------------------
    def _write_new(self, flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Seal the key groups that leave the exact window with these tokens (before their ring columns are
        reused), then put those still in the window in the ring. Writes no codes otherwise: a decoding step
        writes three ring entries per row (key, value, slot) and, every ``group`` steps, seals one key group."""
        count = keys.shape[2]
        keys = keys.detach().reshape(self.rows, count, -1)  # (stored codes pass no gradient, nor the ring)
        values = values.detach().reshape(self.rows, count, -1)
        before, after = self.stream, self.stream + count
        window_before, window_after = self.window_start(before), self.window_start(after)
        if self.residual:
            first, stop = window_before // self.group, window_after // self.group
        else:
            first, stop = before // self.group, -(-after // self.group)
        if stop > first:
            self._seal(first, stop, keys, values, before)
        if not self.residual:
            codes, scale, minimum = quantize_values(values, self.bits, self.group)
            self.values.view(-1, self.values.shape[-1]).index_copy_(0, flat, codes.flatten(0, 1))
            self.value_scale.view(-1, scale.shape[-1]).index_copy_(0, flat, scale.flatten(0, 1))
            self.value_min.view(-1, minimum.shape[-1]).index_copy_(0, flat, minimum.flatten(0, 1))
        else:
            kept = min(count, after - window_after)  # (the forward's tokens still in the window after it)
            if kept == 1:
                column = (after - 1) % self.residual
                self.ring_keys[:, column] = keys[:, -1]
                self.ring_values[:, column] = values[:, -1]
                torch.add(flat.view(self.rows, count)[:, -1], 1, out=self.ring_target[:, column])
            else:
                columns = torch.arange(after - kept, after, device=self.device) % self.residual
                self.ring_keys.index_copy_(1, columns, keys[:, -kept:])
                self.ring_values.index_copy_(1, columns, values[:, -kept:])
                self.ring_target.index_copy_(1, columns, flat.view(self.rows, count)[:, -kept:] + 1)
        self.stream = after
        self.fresh = (keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1]), flat)

    def _seal(self, first: int, stop: int, keys: torch.Tensor, values: torch.Tensor, before: int) -> None:
        """Quantize the key groups of virtual indices ``[first * group, stop * group)`` of every row that holds
        them, from their exact keys (the ring's, or the forward's ``keys`` ``[R, q, d]`` from stream index
        ``before``; without a residual, its other members read back), the range over the row's tokens only; with
        a residual, their members' values too. Where the groups are is host bookkeeping (one index per group)."""
        group, count = self.group, stop - first
        low, high = first * group, stop * group
        virtual = np.arange(first, stop) * group
        place = virtual[None, :] - self.shift[:, None]  # [R, n] each group's first place in its row
        held = place >= 0  # (a row with fewer tokens than the window has none at its oldest indices)
        column = np.take_along_axis(self.table, np.maximum(place, 0) // self.block, axis=1)
        key_group = (column * self.block + np.maximum(place, 0) % self.block) // group  # [R, n]
        every = bool(held.all())
        target = from_host(key_group[held] if not every else key_group.reshape(-1), self.device, None)
        pick = None
        if not every:
            rows, index = np.nonzero(held)
            pick = from_host(rows * count + index, self.device, None)

        def members(exact_ring: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            """``[R, n * group, d]``: each member's exact copy (zeros where none)."""
            out = new.new_zeros(self.rows, count * group, new.shape[-1])
            ring_stop = min(before, high)
            if self.residual and ring_stop > low:
                columns = torch.arange(low, ring_stop, device=self.device) % self.residual
                out[:, : ring_stop - low] = exact_ring.index_select(1, columns)
            new_stop = min(before + new.shape[1], high)
            if new_stop > max(before, low):
                out[:, max(before, low) - low : new_stop - low] = new[:, max(before, low) - before : new_stop - before]
            return out

        def selected(tensor: torch.Tensor) -> torch.Tensor:
            """``[R, n * group, ...]`` as ``[P, group, ...]``, the groups rows hold."""
            tensor = tensor.reshape(self.rows * count, group, *tensor.shape[2:])
            return tensor if pick is None else tensor.index_select(0, pick)

        exact_keys = selected(members(self.ring_keys, keys))
        stream = torch.arange(low, high, device=self.device)
        occupied = (stream >= self.first_virtual[:, None]) & (stream < before + keys.shape[1])
        occupied = selected(occupied)  # [P, group]
        key_codes = self.keys.view(-1, group, self.keys.shape[-1])
        key_scale = self.key_scale.view(-1, self.head_dim)
        key_min = self.key_min.view(-1, self.head_dim)
        if low < min(before, self.window_start(before)):  # members no longer exact: read back (no residual)
            read = dequantize_keys(
                key_codes.index_select(0, target),
                key_scale.index_select(0, target),
                key_min.index_select(0, target),
                self.bits,
            )
            old = selected((stream < min(before, self.window_start(before))).expand(self.rows, -1))
            exact_keys = torch.where(old[..., None], read, exact_keys)
        codes, scale, minimum = quantize_keys(exact_keys, self.bits, occupied)
        key_codes.index_copy_(0, target, codes)
        key_scale.index_copy_(0, target, scale)
        key_min.index_copy_(0, target, minimum)
        if self.residual:
            exact_values = selected(members(self.ring_values, values))
            codes, scale, minimum = quantize_values(exact_values, self.bits, group)
            self.values.view(-1, group, self.values.shape[-1]).index_copy_(0, target, codes)
            self.value_scale.view(-1, group, scale.shape[-1]).index_copy_(0, target, scale)
            self.value_min.view(-1, group, minimum.shape[-1]).index_copy_(0, target, minimum)
            # the sealed columns hold no token of the window any more
            self.ring_target.index_fill_(1, (stream[: min(before, high) - low] % self.residual), 0)

    def end_forward(self) -> None:
        """The forward is over: its tokens are read as stored from now on."""
        self.fresh = None

    # --- attention -----------------------------------------------------------------------------------------
    def read_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[used, BLOCK, d]`` and values ``[used, BLOCK, d_v]`` (float32) of the owned blocks as attention
        reads them: the codes dequantized, the exact window's tokens and the forward's own over them."""
        used, block, group, bits = self.used, self.block, self.group, self.bits
        slots = used * block
        keys = self.key_scale.new_empty(1 + slots, self.head_dim, dtype=torch.float32)  # row 0: the spare row
        values = self.key_scale.new_empty(1 + slots, self.value_dim, dtype=torch.float32)
        unpack_into(self.keys[:used].view(slots, -1), bits, keys[1:])
        grouped_keys = keys[1:].view(used, block // group, group, self.head_dim)
        key_min, key_scale = self.key_min[:used, :, None].float(), self.key_scale[:used, :, None].float()
        torch.addcmul(key_min, grouped_keys, key_scale, out=grouped_keys)
        unpack_into(self.values[:used].view(slots, -1), bits, values[1:])
        grouped_values = values[1:].view(slots, self.value_dim // group, group)
        value_min = self.value_min[:used].view(slots, -1, 1).float()
        torch.addcmul(value_min, grouped_values, self.value_scale[:used].view(slots, -1, 1).float(), out=grouped_values)
        if self.residual:
            target = self.ring_target.view(-1)
            keys.index_copy_(0, target, self.ring_keys.view(-1, self.head_dim).float())
            values.index_copy_(0, target, self.ring_values.view(-1, self.value_dim).float())
        if self.fresh is not None and not (self.residual and self.fresh[2].shape[0] == self.rows):
            fresh_keys, fresh_values, flat = self.fresh  # (a step's one token is in the ring already)
            target = flat + 1
            keys.index_copy_(0, target, fresh_keys.float())
            values.index_copy_(0, target, fresh_values.float())
        return keys[1:].view(used, block, self.head_dim), values[1:].view(used, block, self.value_dim)

    def attend(self, query: torch.Tensor, scale: float, plain: bool, first: int) -> torch.Tensor:
        """As ``RaggedPool.attend``, over the dequantized blocks, in float32; the output in the query's dtype."""
        if plain:
            return self._step(query, scale)
        return super().attend(query.float(), scale, False, first).to(query.dtype)

    def _step(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        batch, q_heads, _, dim = query.shape
        if torch.is_grad_enabled():
            self._views()
        keys, values = self.read_blocks()
        owner = self._owner_used
        groups = q_heads // self.heads
        rows = (query.reshape(self.rows, groups, dim).float() * scale).index_select(0, owner)  # [n, G, d]
        logits = torch.bmm(rows, keys.transpose(1, 2)).add_(self._bias_used)  # [n, G, BLOCK]
        output = self._step_output(logits, owner, values, groups)
        return output.view(batch, q_heads, 1, -1).to(query.dtype)

    # --- accounting ----------------------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of one slot: its key's and value's codes, its value's scales and minima."""
        codes = self.keys.shape[-1] + self.values.shape[-1]
        return codes + 2 * self.value_scale.shape[-1] * self.value_scale.element_size()

    def key_group_bytes(self) -> int:
        """Bytes of one key group's scales and minima."""
        return 2 * self.head_dim * self.key_scale.element_size()

    def ring_nbytes(self) -> int:
        """Bytes of the exact window: ``residual`` columns per row once the stream is that long."""
        columns = min(self.stream, self.residual)
        return self.rows * columns * (self.head_dim + self.value_dim) * self.ring_keys.element_size()

    def kv_nbytes(self) -> int:
        """Codes and value parameters of the owned blocks' slots, their key groups' parameters, the ring."""
        slots = self.held_slots()
        return slots * self.slot_bytes() + slots // self.group * self.key_group_bytes() + self.ring_nbytes()

    def allocated_kv_nbytes(self) -> int:
        slots = self.capacity * self.block
        ring = self.ring_keys.nbytes + self.ring_values.nbytes + self.ring_target.nbytes
        return slots * self.slot_bytes() + slots // self.group * self.key_group_bytes() + ring

    def token_bytes(self) -> int:
        """Bytes per slot, the key groups' parameters shared out (the ring apart)."""
        return self.slot_bytes() + math.ceil(self.key_group_bytes() / self.group)
