"""``RaggedLayer``: the slot layer of a one-shot method with per-head budgets, moved into ragged storage once it has
compressed.

Until its one-shot compression the layer is a ``CompressedLayer`` (the prompt fills slots, the method scores them).
When the compression keeps a per-head set (a ``KeepMask``: AdaKV's allocation, KVzip's head-level budgets), the
kept real tokens move into a ``RaggedPool`` (``core.ragged``): the layer then holds the sum of its heads' counts
plus at most one block of slack per head, instead of heads x the fullest head, and ``nbytes()`` says so. From then
on the layer only appends (these methods evict once) and attends over the pool. With ``kv_bits < 16`` the pool
holds KIVI codes (``core.ragged_quantized``: quantized as the kept tokens move; until then the slot layer keeps
the prompt in the model's dtype, so the method scores it as at 16 bits).

A forward after the move writes its tokens into the pool in ``update`` (returning them to the model as they came,
so the attention function finds the layer) and attends in ``attend``; nothing else of the slot machinery runs.
``token_idx``, ``valid``, ``keys`` and the other views stay available for inspection as copies ``[B, H, W]`` padded
to the fullest head (``W``), never used by a step. Beam search and ``num_return_sequences > 1`` reorder or repeat
the batch: the pool copies the blocks of the sequence each new one comes from. On a model's sliding-window layers the
slot layer is used (its tokens expire by age).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcompress.core.contract import AttentionStats, KeepMask
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.ragged import RaggedPool
from kvcompress.core.ragged_quantized import QuantizedRaggedPool
from kvcompress.core.ragged_stream import StreamRecord
from kvcompress.core.slots import StreamView


class RaggedLayer(CompressedLayer):
    """A ``CompressedLayer`` that moves into ragged storage after a one-shot per-head compression."""

    sliding_layer_class = CompressedLayer

    def __init__(self, policy, inv_freq=None) -> None:
        self.pool: RaggedPool | None = None
        super().__init__(policy, inv_freq)
        self._flat: torch.Tensor | None = None  # slots of this forward's tokens in the pool
        self._padded_forward = False  # some token of this forward is padding

    @property
    def ragged(self) -> bool:
        return self.pool is not None

    # --- the move ------------------------------------------------------------------------------------------
    def apply(self, rule) -> None:
        """A one-shot per-head compression (a ``KeepMask``) moves the kept real tokens straight into the pool: the
        slot layout is read in place, not compacted first (no second copy of the layer while it moves)."""
        if not (isinstance(rule, KeepMask) and self.policy.one_shot and self.slots is not None):
            return super().apply(rule)
        self._settle()
        if not (self.dense and self.ordered):  # (a one-shot layer has only appended: its slots are in stream order)
            super().apply(rule)
            return self.to_ragged()
        occupied = self.token_idx >= 0
        self.before_eviction(None, ~rule.keep & occupied)
        self.to_ragged(rule.keep & self.valid)

    def to_ragged(self, kept: torch.Tensor | None = None) -> None:
        """Move the real tokens ``kept`` ``[B, H, W]`` marks (default: every real token stored) into a ragged pool
        and drop the slot buffers (once, after compression)."""
        self._settle()
        slots, width = self.slots, self.view_width
        kept = slots.valid[:, :, :width] if kept is None else kept
        record, owns = self._shared_record(slots.keys.shape[0])
        if record is None:
            token_idx = slots.token_idx[:, :, :width]
            record = StreamRecord.from_slots(
                token_idx, slots.rope_pos[:, :, :width], slots.rank[:, :, :width], slots.real_seen, self.seen
            )
        config = self.policy.config
        if config.kv_bits == 16:
            self.pool = RaggedPool.from_rows(slots.keys, slots.values, slots.token_idx, kept, record, owns)
        else:
            options = {"bits": config.kv_bits, "group": config.kv_group, "residual": config.kv_residual}
            self.pool = QuantizedRaggedPool.from_rows(
                slots.keys, slots.values, slots.token_idx, kept, record, owns, seen=self.seen, **options
            )
        self.slots = None
        self.occupied = int(self.pool.row_counts().max()) if self.pool.rows else 0
        self.dense, self.ordered, self._free, self._new = True, True, None, None

    def _shared_record(self, batch: int) -> tuple[StreamRecord | None, bool]:
        """The cache's stream record, held by another layer's pool of the same stream (``None`` if none yet:
        this layer's pool then makes it, and counts its bytes)."""
        for layer in getattr(getattr(self, "forward_pass", None), "layers", ()):
            pool = getattr(layer, "pool", None)
            if layer is not self and pool is not None:
                record = pool.record
                if record.batch == batch and record.length == self.seen and record.device == self.device:
                    return record, False
        return None, True

    def compact(self, shrink: bool = False, used: int | None = None) -> None:
        if not self.ragged:
            super().compact(shrink, used)

    # --- a forward over the pool ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.ragged:
            return super().update(key_states, value_states, *args, **kwargs)
        count = key_states.shape[2]
        self.max_chunk = max(self.max_chunk, count)
        self._flat = self.pool.append(key_states, value_states)
        self.seen += count
        self.new_tokens = count
        self.occupied += count
        setattr(key_states, LAYER_ATTRIBUTE, self)
        return key_states, value_states

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        if not self.ragged:
            return super().register_new_tokens(position_ids, padding)
        count = self.new_tokens
        positions = None
        if position_ids is not None:
            positions = position_ids if position_ids.shape[-1] == count else position_ids[..., -count:]
            positions = positions[0] if positions.dim() == 3 else positions
            positions = positions if positions.device == self.device else positions.to(self.device)
        real = None
        if padding is not None:
            real = padding[:, -count:].to(self.device, torch.bool)
            self.all_valid = False
        self._padded_forward = real is not None
        self.pool.register(self._flat, self.seen - count, positions, real)

    def attention_mask(self, query_count: int, sliding_window: int | None = None):
        return None if self.ragged else super().attention_mask(query_count, sliding_window)

    def attend(self, query, key, value, mask, scaling) -> tuple[torch.Tensor, AttentionStats | None] | None:
        if not self.ragged:
            return super().attend(query, key, value, mask, scaling)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        count = query.shape[2]
        plain = count == 1 and not self._padded_forward
        return self.pool.attend(query, scale, plain, self.seen - count), None

    def end_forward(self) -> None:
        super().end_forward()
        if self.pool is not None:
            self.pool.end_forward()

    def replay_steady(self) -> bool:
        return False if self.ragged else super().replay_steady()

    # --- views for inspection ------------------------------------------------------------------------------
    def _dense(self, index: int) -> torch.Tensor:
        return self.pool.dense()[index]

    keys = property(
        lambda self: self._dense(0) if self.ragged else CompressedLayer.keys.fget(self), CompressedLayer._only_none
    )
    values = property(
        lambda self: self._dense(1) if self.ragged else CompressedLayer.values.fget(self), CompressedLayer._only_none
    )
    token_idx = property(lambda self: self._dense(2) if self.ragged else CompressedLayer.token_idx.fget(self))
    rope_pos = property(lambda self: self._dense(3) if self.ragged else CompressedLayer.rope_pos.fget(self))
    rank = property(lambda self: self._dense(4) if self.ragged else CompressedLayer.rank.fget(self))
    valid = property(lambda self: self._dense(5) if self.ragged else CompressedLayer.valid.fget(self))

    rows = property(lambda self: (self.pool.batch, self.pool.heads) if self.ragged else CompressedLayer.rows.fget(self))
    # the methods stored ragged keep no per-token state once compressed
    state = property(lambda self: {} if self.ragged else CompressedLayer.state.fget(self))

    def kept(self) -> StreamView:
        if not self.ragged:
            return super().kept()
        keys, values, token_idx, rope_pos, rank, valid = self.pool.dense()
        return StreamView(keys, values, token_idx, rope_pos, valid, rank, {})

    def real_count(self) -> torch.Tensor:
        return self.pool.real_seen[:, None] if self.ragged else super().real_count()

    # --- transformers' layer API ---------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.pool, self._flat = None, None

    def move_batch(self, move) -> None:
        """Select, reorder or repeat the batch (``move`` applied to each per-sequence tensor): the pool copies the
        blocks of the sequence each new one comes from (``RaggedPool.move_batch``; one host read of their indices)."""
        if not self.ragged:
            return super().move_batch(move)
        self.pool.move_batch(np.asarray(move(torch.arange(self.pool.batch, device=self.device)).tolist()))
        self.occupied = int(self.pool.row_counts().max()) if self.pool.rows else 0

    # --- accounting ----------------------------------------------------------------------------------------
    def kv_nbytes(self) -> int:
        """Bytes of the keys and values held: the blocks in use (stored tokens + each head's last block's slack)."""
        return self.pool.kv_nbytes() if self.ragged else super().kv_nbytes()

    def allocated_nbytes(self) -> int:
        """Bytes of the key and value blocks as allocated (the pool's capacity)."""
        if not self.ragged:
            return super().allocated_nbytes()
        return self.pool.allocated_kv_nbytes()

    def allocated_metadata_nbytes(self) -> int:
        """Bytes of the blocks' bookkeeping as allocated (owner, bias and stream index of the pool's capacity; the
        stream record where this layer counts it)."""
        if not self.ragged:
            return super().allocated_metadata_nbytes()
        pool = self.pool
        return pool.owner.nbytes + pool.bias.nbytes + pool.token.nbytes + pool.record_nbytes(allocated=True)

    def metadata_nbytes(self) -> int:
        if not self.ragged:
            return super().metadata_nbytes()
        return self.pool.held_slots() * self.pool.metadata_bytes_per_slot() + self.pool.record_nbytes()

    def stored_tokens(self) -> int:
        """Real and padding tokens stored, all heads together (the sum of the heads' counts)."""
        return self.pool.stored_tokens() if self.ragged else int((self.token_idx >= 0).sum())
