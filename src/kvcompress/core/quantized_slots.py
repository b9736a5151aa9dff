"""Slot buffers whose keys and values are stored quantized (KIVI, ``core.kivi``), written and evicted in place.

Every slot keeps its token's codes and, for values (quantized per token, in groups of ``group`` channels), its own
scales and minima, so the slot machinery (writes into victims' slots, compaction, growth, batch reordering) moves a
quantized token like any other per-slot tensor. Keys are quantized per channel over groups of ``group`` tokens,
which clashes with slots that are evicted and rewritten one at a time. The choice made here:

- **Key groups are groups of ``group`` consecutive slots** (``capacity`` is kept a multiple of ``group``), with one
  scale and minimum per channel and group (``key_scale``, ``key_min`` ``[B, H, C / group, d]``). Writing a token
  into a slot re-quantizes that slot's group: its members are read back (exactly where they are still in the
  residual window, dequantized otherwise), the new key put in, the range taken over the occupied slots only, and
  the group quantized again. So a decoding step at the budget re-quantizes one group per row (``group`` keys, work
  independent of the cache's size); members outside the residual window are rounded again only when the group's
  range changes (a new token outside it, or an evicted extreme). Compaction (after a prompt chunk that evicted, a
  one-shot compression) re-forms the groups in stream order and quantizes each from what attention saw (exact
  values for the forward's own and the residual's tokens).
- **Residual window**: the newest ``residual`` tokens of the stream (the forward's own tokens included) are also
  kept in full precision in a ring indexed by stream index modulo ``residual`` (as KIVI and transformers'
  ``QuantizedCache`` keep their newest tokens unquantized); what attention reads for a stored token in that window
  is its exact key and value. Evicted tokens in the window stay in the ring until their entry is reused; nothing
  reads them (a slot is looked up by the stream index it holds). Unlike KIVI, whose residual fills up to
  ``residual`` tokens and is then quantized at once, the window here slides by one token per step, and the newest
  tokens' codes are written at once (their group is re-quantized then, not when they leave the window): they
  cost their codes besides their exact copy, which ``nbytes`` counts.
- **The forward's own tokens are read exactly**: while a forward runs, its new keys and values are what attention
  reads for them (transformers' ``QuantizedCache`` and KIVI attend to the prompt in full precision too), so a
  prompt's attention and the statistics a method takes of it are those of the full cache; later forwards read the
  stored (dequantized) tokens, and scores and statistics are computed on exactly what attention reads.

With no eviction and ``residual >= group`` every key group is quantized for the last time when its last token
arrives, from exact values: the stored codes are KIVI's for groups of ``group`` tokens in stream order
(``tests/references/kivi.py``).

``view`` gives what attention reads as a dequantized copy of the layer's slots, built once per forward (kept until
``end_forward``), for the methods that read keys or attend their own way; the default attention reads the codes
instead (``core.quantized_attention``), and compaction re-quantizes a block at a time (``compact``), so a forward
of the default attention holds no float copy of the layer's keys and values.

**Keys of some heads only** (``key_heads``, as ``SlotBuffers`` has it: PoD keeps the keys of the KV heads starting a
block at the layer): the key codes, the key groups' parameters and the residual window's exact keys are then those
of the ``K`` key heads (``[B, K, ...]``), the values' and the bookkeeping of every head; a key row follows the
bookkeeping of its head (``_key_rows``). The codes readers of ``core.quantized_attention`` take every head's keys:
such buffers are read through ``view``.
"""

from __future__ import annotations

import math

import torch

from kvcompress.core.kivi import (
    dequantize_keys,
    dequantize_values,
    packed_width,
    quantize_keys,
    quantize_values,
    unpack_into,
)
from kvcompress.core.slots import SlotBuffers, StreamView

SEAL_BLOCK = 1024  # slots sealed at a time by a forward of several tokens (``QuantizedSlotBuffers._seal``)


class QuantizedSlotBuffers(SlotBuffers):
    """``SlotBuffers`` holding packed codes: ``tensors["keys"]`` and ``tensors["values"]`` are ``uint8`` ``[B, H, C,
    d * bits / 8]``; ``value_scale``/``value_min`` ``[B, H, C, d / group]`` per slot; ``key_scale``/``key_min``
    ``[B, H, C / group, d]`` per group of slots; ``ring_keys``/``ring_values`` ``[B, H, residual, d]`` exact
    (with ``key_heads``, ``[K]``: the keys, their groups' parameters and ``ring_keys`` of those heads only)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        real_seen: torch.Tensor,
        *,
        bits: int,
        group: int,
        residual: int,
        key_params: tuple[torch.Tensor, torch.Tensor],
        ring: tuple[torch.Tensor, torch.Tensor] | None,
        key_heads: torch.Tensor | None = None,
    ) -> None:
        super().__init__(tensors, state, real_seen, key_heads)
        self.bits, self.group, self.residual = bits, group, residual
        self.key_scale, self.key_min = key_params
        self.ring = ring
        # the slot each ring entry's token was written to (checked against ``token_idx`` when read)
        self.ring_slot = (
            None if ring is None else torch.zeros(ring[1].shape[:3], dtype=torch.long, device=ring[1].device)
        )
        # the stream index each entry holds (the same in every row; -1: none): a pass taken back (KVzip's
        # reconstruction rewinds the tokens seen) leaves entries holding tokens no longer in the stream
        self.ring_token = None if ring is None else torch.full(ring[0].shape[2:3], -1, device=ring[0].device)
        self.stream_seen = 0  # stream index of the next token (the ring's clock)
        self.stream_order = True  # every token so far sits in the slot of its stream index (nothing moved)
        # (keys, values, where) of the forward being run: ``where`` is the first slot of a range or [B, H, q] slots
        self.fresh: tuple[torch.Tensor, torch.Tensor, int | torch.Tensor] | None = None
        self._view_cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def empty_quantized(
        cls,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        bits: int,
        group: int,
        residual: int,
        key_heads: torch.Tensor | None = None,
    ) -> QuantizedSlotBuffers:
        """Empty buffers for keys and values shaped like ``key_states`` and ``value_states`` ``[B, H, q, d]``
        (``key_heads`` ``[K]``: the heads whose keys are stored, ``key_states`` ``[B, K, q, d]`` theirs)."""
        batch, heads, _, value_dim = value_states.shape
        key_rows, key_dim = key_states.shape[1], key_states.shape[-1]
        check_dims(key_dim, value_dim, bits, group)
        device, dtype = key_states.device, key_states.dtype
        long = {"dtype": torch.long, "device": device}
        codes = {"dtype": torch.uint8, "device": device}
        tensors = {
            "keys": torch.empty(batch, key_rows, 0, packed_width(key_dim, bits), **codes),
            "values": torch.empty(batch, heads, 0, packed_width(value_dim, bits), **codes),
            "value_scale": value_states.new_empty(batch, heads, 0, value_dim // group),
            "value_min": value_states.new_empty(batch, heads, 0, value_dim // group),
            "token_idx": torch.empty(batch, heads, 0, **long),
            "rope_pos": torch.empty(batch, heads, 0, **long),
            "rank": torch.empty(batch, heads, 0, **long),
            "valid": torch.empty(batch, heads, 0, dtype=torch.bool, device=device),
        }
        key_params = tuple(key_states.new_zeros(batch, key_rows, 0, key_dim) for _ in range(2))
        ring = None
        if residual:
            ring = (
                torch.zeros(batch, key_rows, residual, key_dim, dtype=dtype, device=device),
                value_states.new_zeros(batch, heads, residual, value_dim),
            )
        return cls(
            tensors,
            {},
            torch.zeros(batch, **long),
            bits=bits,
            group=group,
            residual=residual,
            key_params=key_params,
            ring=ring,
            key_heads=key_heads,
        )

    # --- capacity and batch ------------------------------------------------------------------------------------
    def resize(self, capacity: int, keep: int) -> None:
        """As ``SlotBuffers.resize``, the capacity rounded up to whole key groups."""
        capacity = -(-capacity // self.group) * self.group
        super().resize(capacity, keep)
        groups, kept = capacity // self.group, min(-(-keep // self.group), capacity // self.group)
        params = []
        for tensor in (self.key_scale, self.key_min):
            fresh = tensor.new_zeros(*tensor.shape[:2], groups, tensor.shape[-1])
            fresh[:, :, :kept] = tensor[:, :, :kept]
            params.append(fresh)
        self.key_scale, self.key_min = params
        self._view_cache = None

    def map_batch(self, fn) -> None:
        super().map_batch(fn)
        self.key_scale, self.key_min = fn(self.key_scale), fn(self.key_min)
        if self.ring is not None:
            self.ring = (fn(self.ring[0]), fn(self.ring[1]))
            self.ring_slot = fn(self.ring_slot)
        self.fresh, self._view_cache = None, None

    # --- writes ----------------------------------------------------------------------------------------------
    def _key_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` ``[B, H, ...]`` at the rows of the stored key heads (itself when every head's keys are)."""
        return tensor if self.key_heads is None else tensor.index_select(1, self.key_heads)

    def _stream_index(self, seen: int | torch.Tensor) -> int:
        if not isinstance(seen, int):
            raise NotImplementedError("quantized storage takes no device-side token count (no captured decoding)")
        return seen

    def _write_ring(self, keys: torch.Tensor, values: torch.Tensor, seen: int, slots: int | torch.Tensor) -> None:
        """Put the forward's last ``min(q, residual)`` tokens in their ring entries (stream index mod residual),
        with the slots they were written to (``slots``: the first of a range, or ``[B, H, q]``)."""
        if self.ring is None:
            return
        count = keys.shape[2]
        kept = min(count, self.residual)
        ring_keys, ring_values = self.ring
        if kept == 1:
            entry = (seen + count - 1) % self.residual
            ring_keys[:, :, entry] = keys[:, :, -1]
            ring_values[:, :, entry] = values[:, :, -1]
            if isinstance(slots, int):  # (fill_: a Python number assigned by index is a host copy that waits)
                self.ring_slot[:, :, entry].fill_(slots + count - 1)
            else:
                self.ring_slot[:, :, entry] = slots[:, :, -1]
            self.ring_token[entry : entry + 1].fill_(seen + count - 1)
            return
        entries = torch.arange(seen + count - kept, seen + count, device=keys.device) % self.residual
        self.ring_token.index_copy_(0, entries, torch.arange(seen + count - kept, seen + count, device=keys.device))
        ring_keys.index_copy_(2, entries, keys[:, :, -kept:])
        ring_values.index_copy_(2, entries, values[:, :, -kept:])
        if isinstance(slots, int):
            written = torch.arange(slots + count - kept, slots + count, device=keys.device)
            self.ring_slot.index_copy_(2, entries, written.expand(*self.ring_slot.shape[:2], -1))
        else:
            self.ring_slot.index_copy_(2, entries, slots[:, :, -kept:])

    def _reindex_ring(self, width: int) -> None:
        """After slots moved (compaction): each ring entry's slot found again from ``token_idx``."""
        if self.ring is None:
            return
        token_idx = self.token_idx[:, :, :width]
        in_ring = self._holds(token_idx)
        entry = torch.where(in_ring, token_idx.remainder(self.residual), self.residual)
        slot = torch.arange(width, device=token_idx.device).expand_as(token_idx)
        found = self.ring_slot.new_zeros(*self.ring_slot.shape[:2], self.residual + 1).scatter_(2, entry, slot)
        self.ring_slot = found[:, :, : self.residual].contiguous()

    def _holds(self, token_idx: torch.Tensor) -> torch.Tensor:
        """Whether the ring holds the exact copy of each token ``token_idx`` (``-1``: none)."""
        return (token_idx >= 0) & (self.ring_token[token_idx.remainder(self.residual)] == token_idx)

    def window_start(self, seen: int) -> int:
        """The first stream index read exactly after ``seen`` tokens: a multiple of ``group`` (tokens leave the
        exact window a group at a time), so the window holds the newest ``residual - group + 1`` to ``residual``
        tokens (all of them up to ``residual``); ``seen`` itself without a residual."""
        if not self.residual:
            return seen
        return max(0, -(-(seen - self.residual) // self.group) * self.group)

    # The writes leave the new tokens' slots' codes as they were (``writes_kv``): nothing reads a token's codes
    # before it is sealed (``_seal``: every read takes a new token, and a token in the exact window, exactly), and
    # sealing writes them; so a decoding step writes no codes at all (before: zeros, two ops a layer).
    writes_kv = False

    def write_range(self, start, keys, values, seen, state, no_padding=False) -> None:
        seen = self._stream_index(seen)
        super().write_range(start, keys, values, seen, state, no_padding)
        self._after_write(keys, values, seen, start)

    def write_at(self, slots, keys, values, seen, state, reused_real=False) -> None:
        seen = self._stream_index(seen)
        super().write_at(slots, keys, values, seen, state, reused_real)
        self.stream_order = False
        self._after_write(keys, values, seen, slots)

    def _after_write(self, keys: torch.Tensor, values: torch.Tensor, seen: int, where: int | torch.Tensor) -> None:
        """Seal what leaves the exact window with this write (before the ring entries are reused), then put the
        new tokens in the ring.

        A decoding step (one token) seals only when the window moves: every ``group`` steps the key groups of the
        tokens leaving it (one group while the slots are in stream order); without a residual, the new token's
        group. A forward of several tokens seals every group (such a forward is O(cache) anyway), a block of groups
        at a time."""
        count = keys.shape[2]
        if isinstance(where, int) and where != seen:
            self.stream_order = False
        before, after = self.window_start(seen), self.window_start(seen + count)
        self.stream_seen = seen + count
        new = (keys, values, seen, before)
        if count > 1:
            self._seal(None, *new)
        elif self.ring is None:
            slot = where if isinstance(where, torch.Tensor) else self.token_idx.new_full((*values.shape[:2], 1), where)
            self._seal(slot // self.group, *new)
        elif after > before:
            if self.stream_order:  # the leaving tokens fill slots [before, after): whole groups
                index = torch.arange(before // self.group, after // self.group, device=keys.device)
                self._seal(index.expand(*values.shape[:2], -1), *new)
            else:
                entries = torch.arange(before, after, device=keys.device) % self.residual
                self._seal(self.ring_slot[:, :, entries] // self.group, *new)
        self._write_ring(keys, values, seen, where)
        self.fresh, self._view_cache = (keys, values, where), None

    def _seal(
        self,
        groups: torch.Tensor | None,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        seen: int,
        window: int,
    ) -> None:
        """Quantize again the key groups ``groups`` ``[B, H, n]`` (``None``: every group) from their members'
        exact keys where known (the window before this write and the new tokens, stream indices from ``seen``)
        and dequantized keys otherwise, the range over the occupied slots only; and quantize the values of the
        members known exactly. Listing a group twice is harmless (the same result is written twice).

        Every group (a forward of several tokens) is sealed ``SEAL_BLOCK`` slots at a time, so the float copies
        this takes (the members' keys read back, their exact keys and values, the quantizer's intermediates) are
        those of a block, not of the layer: a long prompt's chunk adds no full-layer float copy beside the one
        its attention reads."""
        if groups is None:
            total = self.capacity // self.group
            block = max(1, SEAL_BLOCK // self.group)
            for first in range(0, total, block):
                self._seal_groups((first, min(total, first + block)), new_keys, new_values, seen, window)
            return
        self._seal_groups(groups, new_keys, new_values, seen, window)

    def _seal_groups(
        self,
        groups: torch.Tensor | tuple[int, int],
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        seen: int,
        window: int,
    ) -> None:
        """``_seal`` of the groups ``groups``: ``[B, H, n]``, or a range ``(first, stop)`` of groups."""
        group, key_rows = self.group, self._key_rows
        if isinstance(groups, tuple):
            first, stop = groups
            count = stop - first
            members = None
            span = slice(first * group, stop * group)
            token_idx = self.token_idx[:, :, span]
            key_codes = self.keys[:, :, span]
            scale, minimum = self.key_scale[:, :, first:stop], self.key_min[:, :, first:stop]
            value_parts = [self.tensors[name][:, :, span] for name in ("values", "value_scale", "value_min")]
        else:
            count = groups.shape[-1]
            members = (groups[..., None] * group + torch.arange(group, device=groups.device)).flatten(2)
            token_idx = self.token_idx.gather(2, members)
            key_codes = _take(self.keys, key_rows(members))
            key_groups = key_rows(groups)
            scale, minimum = _take(self.key_scale, key_groups), _take(self.key_min, key_groups)
            value_parts = [_take(self.tensors[name], members) for name in ("values", "value_scale", "value_min")]
        keys = dequantize_keys(key_codes.unflatten(2, (count, group)), scale, minimum, self.bits).flatten(2, 3)
        is_new = token_idx >= seen
        offset = (token_idx - seen).clamp(0, new_keys.shape[2] - 1)
        exact_keys, exact_values = _take(new_keys, key_rows(offset)), _take(new_values, offset)
        exact = is_new
        if self.ring is not None:
            entry = token_idx.remainder(self.residual)
            if members is None:
                slots = torch.arange(span.start, span.stop, device=entry.device)
            else:
                slots = members
            # in the window, and its ring entry still holds it (a pass that was taken back, KVzip's reconstruction,
            # may have reused entries: those tokens were sealed then)
            in_ring = (token_idx >= window) & ~is_new & (self.ring_slot.gather(2, entry) == slots)
            in_ring &= self._holds(token_idx)
            ring_keys = _take(self.ring[0], key_rows(entry))
            exact_keys = torch.where(key_rows(in_ring)[..., None], ring_keys, exact_keys)
            exact_values = torch.where(in_ring[..., None], _take(self.ring[1], entry), exact_values)
            exact = exact | in_ring
        keys = torch.where(key_rows(exact)[..., None], exact_keys, keys).detach()  # (the quantizer passes no gradient)
        exact_values = exact_values.detach()
        occupied = key_rows(token_idx >= 0).unflatten(2, (count, group))
        codes, scale, minimum = quantize_keys(keys.unflatten(2, (count, group)), self.bits, occupied)
        values = quantize_values(exact_values, self.bits, group)
        values = [torch.where(exact[..., None], fresh, old) for fresh, old in zip(values, value_parts, strict=True)]
        if members is None:
            self.keys[:, :, span] = codes.flatten(2, 3)
            self.key_scale[:, :, first:stop], self.key_min[:, :, first:stop] = scale, minimum
            for name, value in zip(("values", "value_scale", "value_min"), values, strict=True):
                self.tensors[name][:, :, span] = value
            return
        _put(self.keys, key_rows(members), codes.flatten(2, 3))
        _put(self.key_scale, key_groups, scale)
        _put(self.key_min, key_groups, minimum)
        for name, value in zip(("values", "value_scale", "value_min"), values, strict=True):
            _put(self.tensors[name], members, value)

    # --- what attention reads ----------------------------------------------------------------------------------
    def view(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, width)`` as attention reads them (``[B, H, width, d]``, the model's
        dtype): dequantized, exact in the residual window and for the forward's own tokens. Built once per
        forward and state of the slots, into buffers one slot wider than read (exact copies of tokens no longer
        stored land there, so every write is one ``index_copy_`` without a host read)."""
        key = (width, self.stream_seen, id(self.fresh))
        if self._view_cache is not None and self._view_cache[0] == key:
            return self._view_cache[1]
        tensors, group, key_rows = self.tensors, self.group, self._key_rows
        batch, heads = self.token_idx.shape[:2]
        rows = -(-(width + 1) // group) * group  # whole key groups, one slot more than read
        quantized = min(rows, self.capacity) // group
        keys = self.key_scale.new_empty(batch, self.key_scale.shape[1], rows, self.key_scale.shape[-1])
        codes = self.keys[:, :, : quantized * group].unflatten(2, (quantized, group))
        scale, minimum = self.key_scale[:, :, :quantized], self.key_min[:, :, :quantized]
        dequantize_keys(codes, scale, minimum, self.bits, out=keys[:, :, : quantized * group].unflatten(2, (-1, group)))
        values = tensors["value_scale"].new_empty(batch, heads, width + 1, self.ring_values_dim())
        dequantize_values(
            tensors["values"][:, :, :width],
            tensors["value_scale"][:, :, :width],
            tensors["value_min"][:, :, :width],
            self.bits,
            out=values[:, :, :width],
        )
        if self.ring is not None and self.stream_seen:
            read = self.ring_targets(width)
            into = (self._row_offsets(rows, keys.shape[1]) + key_rows(read)).flatten()
            keys.view(-1, keys.shape[-1]).index_copy_(0, into, self.ring[0].flatten(0, 2))
            read = self._row_offsets(width + 1) + read
            values.view(-1, values.shape[-1]).index_copy_(0, read.flatten(), self.ring[1].flatten(0, 2))
        if self.fresh is not None:
            new_keys, new_values, where = self.fresh
            if isinstance(where, int):
                keys[:, :, where : where + new_keys.shape[2]] = new_keys
                values[:, :, where : where + new_values.shape[2]] = new_values
            else:
                keys.view(-1, keys.shape[-1]).index_copy_(
                    0, (self._row_offsets(rows, keys.shape[1]) + key_rows(where)).flatten(), new_keys.flatten(0, 2)
                )
                values.view(-1, values.shape[-1]).index_copy_(
                    0, (self._row_offsets(width + 1) + where).flatten(), new_values.flatten(0, 2)
                )
        result = (keys[:, :, :width], values[:, :, :width])
        self._view_cache = (key, result)
        return result

    def read_at(
        self, index: torch.Tensor, width: int, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, n, d]`` of the slots ``index`` ``[B, H, n]`` (below ``width``) as ``view(width)``
        reads them, bit for bit, without building the view: their codes dequantized with their key groups' and
        their own value parameters, then the exact copies put over them (the residual window's, then the forward's
        own tokens'). Work proportional to ``n`` (and to the forward's tokens, when not all in the ring).

        ``targets``: ``ring_targets(width)`` when the caller has it (the step's attention computed it), else the
        slots are matched with the ring entries directly."""
        key_rows, key_index = self._key_rows, self._key_rows(index)
        keys = self.key_scale.new_empty(*key_index.shape, 1, self.key_scale.shape[-1])  # [B, H, n, 1, d]: groups of 1
        key_group = key_index // self.group
        dequantize_keys(
            _take(self.keys, key_index)[:, :, :, None],
            _take(self.key_scale, key_group),
            _take(self.key_min, key_group),
            self.bits,
            out=keys,
        )
        keys = keys[:, :, :, 0]
        tensors = self.tensors
        values = dequantize_values(
            _take(tensors["values"], index),
            _take(tensors["value_scale"], index),
            _take(tensors["value_min"], index),
            self.bits,
        )
        fresh = self.fresh
        if self.ring is not None and self.stream_seen:
            # slot by slot what ``ring_targets`` says entry by entry: a slot reads its token's ring entry (stream
            # index mod ``residual``) when the token is in the exact window and the entry holds it, written to that
            # slot (the entry's newest token is the slot's only then: no other entry can name it)
            seen, token = self.stream_seen, self.token_idx.gather(2, index)
            entry = token.remainder(self.residual)
            if targets is not None:  # (a slot is some entry's target only if it holds that entry's token)
                held = targets.gather(2, entry) == index
            else:
                held = (token >= self.window_start(seen)) & (token < seen) & (self.ring_token[entry] == token)
                held &= self.ring_slot.gather(2, entry) == index
            keys = torch.where(key_rows(held)[..., None], _take(self.ring[0], key_rows(entry)), keys)
            values = torch.where(held[..., None], _take(self.ring[1], entry), values)
            if fresh is not None and fresh[0].shape[2] <= seen - self.window_start(seen):
                fresh = None  # the forward's tokens are all in the window: the ring holds them, as they are
        if fresh is not None:  # (copied over the ring's: in ``view`` the forward's own tokens come last)
            new_keys, new_values, where = fresh
            if isinstance(where, int):
                where = torch.arange(where, where + new_keys.shape[2], device=index.device).expand(*index.shape[:2], -1)
            match = index[..., :, None] == where[..., None, :]  # [B, H, n, q]
            found, entry = match.any(-1), match.to(torch.int8).argmax(-1)
            keys = torch.where(key_rows(found)[..., None], _take(new_keys, key_rows(entry)), keys)
            values = torch.where(found[..., None], _take(new_values, entry), values)
        return keys, values

    def ring_values_dim(self) -> int:
        return self.tensors["value_scale"].shape[-1] * self.group

    def _row_offsets(self, rows: int, heads: int | None = None) -> torch.Tensor:
        """``[B, H, 1]`` offsets of each (sequence, head) row in a ``[B, H, rows, d]`` buffer seen as rows
        (``heads``: of that many heads instead, the key heads')."""
        batch = self.token_idx.shape[0]
        heads = self.token_idx.shape[1] if heads is None else heads
        return (torch.arange(batch * heads, device=self.token_idx.device) * rows).view(batch, heads, 1)

    def ring_newest(self) -> torch.Tensor:
        """``[residual]``: the stream index each ring entry holds after ``stream_seen`` tokens if it is in the exact
        window, else -2 (the same for every layer of a forward: a decoding step computes it once)."""
        seen, residual = self.stream_seen, self.residual
        entry = torch.arange(residual, device=self.ring_slot.device)
        newest = seen - 1 - (seen - 1 - entry).remainder(residual)
        return torch.where(newest >= self.window_start(seen), newest, -2)

    def ring_targets(self, width: int, newest: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, residual]``: the slot each ring entry's exact copy is read into; ``width`` (the spare slot) for
        an entry whose token is no longer stored there or not written yet."""
        newest = self.ring_newest() if newest is None else newest
        slot = self.ring_slot.clamp(max=width - 1) if width else self.ring_slot.clamp(max=0)
        holds = (self.token_idx[:, :, : max(width, 1)].gather(2, slot) == newest) & (self.ring_token == newest)
        return torch.where(holds & (self.ring_slot < width), self.ring_slot, width)

    def end_forward(self) -> None:
        """The forward is over: its tokens are read from storage from now on; the dequantized copy goes."""
        self.fresh, self._view_cache = None, None

    # --- compaction and inspection -----------------------------------------------------------------------------
    def compact(self, width: int, ordered: bool, shrink: bool, used: int | None = None) -> tuple[int, bool]:
        """As ``SlotBuffers.compact``; the key groups are then formed anew in stream order and quantized from what
        attention read (exact for the forward's and the residual window's tokens), ``SEAL_BLOCK`` slots at a time.

        What attention read of each slot is marked before the slots move (the slot it came from, the ring entry or
        the forward's token copied over it in ``view``) and read back after, a block of new key groups at a time
        (the moved codes dequantized with their former group's scale and minimum): the keys are those of
        ``view``, bit for bit, with no float copy of the layer's keys."""
        marks = self._read_marks(width)
        fresh, old_params = self.fresh, (self.key_scale, self.key_min)
        self.tensors.update(marks)
        used, ragged = super().compact(width, ordered, False, used)
        read = {name: self.tensors.pop(name)[:, :, :used] for name in marks}
        self.fresh, self._view_cache, self.stream_order = None, None, False
        count = -(-used // self.group)
        if count:
            new_params = [tensor.new_empty(*tensor.shape[:2], count, tensor.shape[-1]) for tensor in old_params]
            block = max(1, SEAL_BLOCK // self.group)
            for first in range(0, count, block):
                groups = (first, min(count, first + block))
                self._requantize(groups, used, read, old_params, fresh, new_params)
            self.key_scale[:, :, :count], self.key_min[:, :, :count] = new_params
        self._reindex_ring(used)
        if shrink:
            self.shrink(used + 1)
        return used, ragged

    def _read_marks(self, width: int) -> dict[str, torch.Tensor]:
        """``[B, H, width]`` per slot, moved with the slots by a compaction: ``read_slot`` the slot itself,
        ``read_ring`` the ring entry ``view`` copies over it (-1: none), ``read_fresh`` the forward's token it
        copies over it (its offset in the forward; -1: none)."""
        batch, heads = self.token_idx.shape[:2]
        device = self.token_idx.device
        marks = {"read_slot": torch.arange(width, device=device).expand(batch, heads, -1).contiguous()}
        exact = []
        if self.ring is not None and self.stream_seen:
            exact.append(("read_ring", self.ring_targets(width)))
        if self.fresh is not None:
            keys, _, where = self.fresh
            if isinstance(where, int):
                where = torch.arange(where, where + keys.shape[2], device=device).expand(batch, heads, -1)
            exact.append(("read_fresh", where.clamp(max=width)))
        for name, targets in exact:
            entries = torch.arange(targets.shape[-1], device=device).expand_as(targets)
            mark = torch.full((batch, heads, width + 1), -1, dtype=torch.long, device=device)
            marks[name] = mark.scatter_(2, targets, entries)[:, :, :width]
        return marks

    def _requantize(
        self,
        groups: tuple[int, int],
        used: int,
        read: dict[str, torch.Tensor],
        old_params: tuple[torch.Tensor, torch.Tensor],
        fresh: tuple[torch.Tensor, torch.Tensor, int | torch.Tensor] | None,
        new_params: list[torch.Tensor],
    ) -> None:
        """Quantize the compacted slots' key groups ``groups`` (a range) from the keys attention read of them:
        slots past ``used`` count as free zeros, as the key groups' padding."""
        group = self.group
        first, stop = groups[0] * group, groups[1] * group
        filled = min(stop, used) - first
        old_scale, old_min = old_params
        keys = old_scale.new_zeros(*old_scale.shape[:2], stop - first, old_scale.shape[-1])
        part = keys[:, :, :filled]
        unpack_into(self.keys[:, :, first : first + filled], self.bits, part)
        key_rows = self._key_rows
        former = key_rows(read["read_slot"][:, :, first : first + filled]) // group
        torch.addcmul(_take(old_min, former), part, _take(old_scale, former), out=part)
        sources = [("read_ring", None if self.ring is None else self.ring[0])]
        sources.append(("read_fresh", None if fresh is None else fresh[0]))
        for name, exact in sources:
            if name in read:
                index = key_rows(read[name][:, :, first : first + filled])
                part.copy_(torch.where(index[..., None] >= 0, _take(exact, index.clamp(min=0)), part))
        keys = keys.detach().unflatten(2, (-1, group))  # (the quantizer passes no gradient)
        occupied = key_rows(self.token_idx[:, :, first:stop] >= 0).unflatten(2, (-1, group))
        codes, scale, minimum = quantize_keys(keys, self.bits, occupied)
        self.keys[:, :, first:stop] = codes.flatten(2, 3)
        new_params[0][:, :, groups[0] : groups[1]], new_params[1][:, :, groups[0] : groups[1]] = scale, minimum

    def free_at(self, slots: torch.Tensor) -> None:
        super().free_at(slots)
        self._view_cache = None

    def free_mask(self, dropped: torch.Tensor, width: int) -> None:
        super().free_mask(dropped, width)
        self._view_cache = None

    def stream_view(self, width: int) -> StreamView:
        keys, values = self.view(width)
        token_idx = self.token_idx[:, :, :width]
        key = torch.where(token_idx >= 0, token_idx, token_idx.new_tensor(torch.iinfo(torch.long).max))
        order = key.argsort(dim=-1)[..., : int((token_idx >= 0).sum(-1).max()) if width else 0]

        def take(tensor: torch.Tensor, rows: torch.Tensor = order) -> torch.Tensor:
            index = rows.view(*rows.shape, *[1] * (tensor.dim() - 3)).expand(*rows.shape, *tensor.shape[3:])
            return tensor[:, :, :width].gather(2, index)

        return StreamView(
            keys=take(keys, self._key_rows(order)),
            values=take(values),
            token_idx=take(self.token_idx),
            rope_pos=take(self.rope_pos),
            valid=take(self.valid),
            rank=take(self.rank),
            state={name: take(value) for name, value in self.state.items()},
        )

    # --- accounting ------------------------------------------------------------------------------------------
    def kv_bytes_per_slot(self) -> int:
        """Codes of a slot's key and value, and its value's scales and minima."""
        names = ("keys", "values", "value_scale", "value_min")
        return sum(self._bytes_per_slot(self.tensors[name]) for name in names)

    def key_params_nbytes(self, slots: int) -> int:
        """Bytes of the key groups' scales and minima covering ``slots`` slots."""
        per_group = 2 * self.key_scale[:, :, :1].numel() * self.key_scale.element_size()
        return math.ceil(slots / self.group) * per_group

    def ring_nbytes(self, allocated: bool) -> int:
        """Bytes of the residual window's exact keys and values (held, or as allocated)."""
        if self.ring is None:
            return 0
        entries = self.residual if allocated else min(self.stream_seen, self.residual)
        return sum(entries * t[:, :, :1].numel() * t.element_size() for t in self.ring)


def check_dims(key_dim: int, value_dim: int, bits: int, group: int) -> None:
    """``ValueError`` unless values split into channel groups and both pack into whole bytes."""
    if value_dim % group:
        raise ValueError(
            f"kv_group must divide the value head dimension ({value_dim}) for kv_bits={bits}'s per-token value "
            f"groups; got {group}"
        )
    per_byte = 8 // bits
    if key_dim % per_byte or value_dim % per_byte:
        raise ValueError(f"kv_bits={bits} packs {per_byte} codes per byte: head dimensions must be multiples of it")


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[B, H, C, ...]`` at ``index`` ``[B, H, n]`` along the slots."""
    return tensor.gather(2, index.view(*index.shape, *[1] * (tensor.dim() - 3)).expand(*index.shape, *tensor.shape[3:]))


def _put(tensor: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` ``[B, H, n, ...]`` into ``tensor`` at ``index`` ``[B, H, n]`` along the slots."""
    tensor.scatter_(2, index.view(*index.shape, *[1] * (tensor.dim() - 3)).expand_as(value), value)
