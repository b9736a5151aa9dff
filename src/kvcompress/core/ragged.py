"""Ragged storage: a layer whose KV heads keep different numbers of tokens holds their sum, in fixed-size blocks.

After a one-shot compression with per-head budgets (AdaKV's allocation, KVzip's head-level budgets) the heads of a
layer keep different counts. A slot buffer ``[B, H, C, d]`` holds ``C`` = the fullest head's count for every head;
this pool holds, per layer, blocks of ``BLOCK`` tokens, each owned by one (sequence, KV head) row:

- ``keys``, ``values`` ``[N, BLOCK, d]``: the blocks (``N``: the pool's capacity; the first ``used`` are owned);
- ``owner`` ``[N]`` (int64, the index type of ``index_add``/``scatter_reduce``: int32 indices measured ~2x and
  ~1.3x slower on torch 2.13 CPU): the row ``b * H + h`` a block belongs to;
- ``bias`` ``[N, 1, BLOCK]`` (the model's dtype): 0 for a slot holding a real token, ``-inf`` for an empty one
  (the additive mask of a decoding step, read by the logits' product itself);
- ``token`` ``[N, BLOCK]`` int32: each slot's stream index (``-1`` for an empty slot), for multi-token masks and
  inspection. A token's RoPE position and rank among its sequence's real tokens depend on its sequence and stream
  index only: they are read from the cache's one ``StreamRecord`` (``core.ragged_stream``), shared by its pools.

So a stored slot's bookkeeping is its mask entry and its int32 stream index (8 bytes in float32, 6 in bfloat16),
plus ``8 / BLOCK`` bytes of its block's owner; the record adds 8 bytes per sequence and stream index for the whole
cache.

A row's tokens fill its blocks in stream order; only its last block may be partly filled, so the pool holds the sum
of the rows' counts plus at most ``BLOCK - 1`` slots of slack per row. Blocks are never freed (the methods that use
this storage evict once, then only append); new tokens go to each row's last block and a new block is taken only
when it is full. Where the blocks are is bookkeeping on the host (``numpy``): every row receives the same number of
tokens per forward, so the host knows, without reading the device, which slot each new token takes and which rows
need a new block; the slots are handed to the device as one index tensor per forward. The pool grows geometrically
(by an eighth, at least one block per row), copying its blocks once per growth, never per step; it starts with
one spare block per row. Spare blocks are allocated, not written (``torch.empty``); a block is cleared when a row
takes it. On the CPU the pages of a large buffer that were never written are not resident, so the process holds
the blocks in use; on an accelerator its allocator holds the whole capacity, which ``allocated_nbytes`` counts.

Attention over the pool computes every head at once: each block takes its row's queries (``index_select`` by
``owner``; the query heads of a KV head share its blocks, GQA), one batched product gives a block's logits, and a
softmax per (sequence, query head) segment is assembled from per-block pieces: the row's maximum by
``scatter_reduce``, the exponentials' sums and the value products by ``index_add``. It is the same softmax as over
a row's tokens in one piece (exact up to float32 summation order). A decoding step (``_step``: one query per row,
no padding) reads views of the owned blocks made once per block taken, not per step, and no mask beyond the slots'
bias. A forward of several tokens (a question after
the compressed context) has written them to the pool before it attends: each query sees the slots whose token is
not in its future (and itself, even as padding), so one pass covers the compressed context and the new tokens.

The move into the pool (``from_rows``) reads the slot layout in place (the kept tokens of each row, in stream
order, need not be compacted first) and writes the blocks directly, in chunks of rows: its temporaries are one
chunk's indices, never a copy of the layer's keys and values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcompress.core.forward import from_host
from kvcompress.core.ragged_stream import INDEX, StreamRecord
from kvcompress.core.softmax import CHUNK_ELEMENTS

SMALLEST_BLOCK, LARGEST_BLOCK = 16, 256
SLACK_SHARE = 32  # a block is at most 1/32 of a row's mean count (so the mean slack, half a block, is <= ~1.6 %)


def block_size(counts: np.ndarray) -> int:
    """Tokens per block for rows holding ``counts`` tokens: the largest power of two from 16 to 256 that is at most
    ``mean / 32`` (larger blocks make fewer, larger products; the slack is at most a block per row)."""
    mean = float(counts.mean()) if counts.size else 0.0
    block = SMALLEST_BLOCK
    while block * 2 <= mean / SLACK_SHARE and block < LARGEST_BLOCK:
        block *= 2
    return block


EMPTY = -1
GROWTH = 8  # the pool grows by an eighth (at least a block per row): allocated <= 1.125 x held + a block per row
CONVERSION_ELEMENTS = 1 << 20  # slots of the slot layout whose indices one chunk of the move computes at once


class RaggedPool:
    """The blocks of one layer (see the module docstring). Built from a slot layout by ``from_rows``."""

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
    ) -> None:
        self.batch, self.heads, self.rows = batch, heads, batch * heads
        counts = counts.astype(np.int64)
        self.block, self.offsets = self._plan(counts)
        # [R] places filled per row: its empty leading slots (``offsets``) and its tokens (host; plus ``_lag``
        # single-token steps)
        self.counts = self.offsets + counts
        self._lay_out(-(-self.counts // self.block))  # ceil
        capacity = self.used + self.rows  # room for one more block per row before the first growth
        self.device, self.dtype = like.device, like.dtype
        # allocated, not written: ``from_rows`` writes the owned blocks, ``_take_blocks`` clears a block taken
        self._allocate(capacity, like, head_dim, value_dim)
        self.owner = torch.empty(capacity, dtype=torch.long, device=self.device)
        self._own()
        self.bias = like.new_empty(capacity, 1, self.block)
        self.token = torch.empty(capacity, self.block, dtype=INDEX, device=self.device)
        self.record = record  # positions and ranks by stream index (shared by the cache's pools)
        self.owns_record = owns_record  # the pool whose accounting counts the record (one per record)
        self._lag = 0  # single-token forwards since ``counts`` was last written
        self._follow(self.counts)
        self._views()

    def _lay_out(self, blocks: np.ndarray) -> None:
        """Give the rows ``blocks`` ``[R]`` blocks each, side by side in row order (``row_blocks``, ``used`` and the
        ``table`` ``[R, width]`` of each row's block ids, in order; host)."""
        self.row_blocks, self.used = blocks.copy(), int(blocks.sum())
        width = max(1, int(blocks.max()) if self.rows else 1)
        self.table = (np.cumsum(blocks) - blocks)[:, None] + np.arange(width)

    def _own(self) -> None:
        """Write the owner of each block ``_lay_out`` gave out."""
        owners = np.repeat(np.arange(self.rows), self.row_blocks)
        self.owner[: self.used] = from_host(owners, self.device, None)

    def _plan(self, counts: np.ndarray) -> tuple[int, np.ndarray]:
        """Tokens per block, and the empty slots each row starts with (none: a row's first token in its first
        slot) for rows of ``counts`` tokens."""
        return block_size(counts), np.zeros_like(counts)

    def _allocate(self, capacity: int, like: torch.Tensor, head_dim: int, value_dim: int) -> None:
        """The key and value blocks (``capacity`` of them, not written)."""
        self.keys = like.new_empty(capacity, self.block, head_dim)
        self.values = like.new_empty(capacity, self.block, value_dim)

    BLOCK_TENSORS = ("keys", "values", "owner", "bias", "token")  # the tensors of one entry per block (grown)

    @property
    def capacity(self) -> int:
        return self.owner.shape[0]

    def _views(self) -> None:
        """The views of the owned blocks a decoding step reads (``_owner_used``, ``_keys_t``, ``_values_used``,
        ``_bias_used``), made once per change of ``used`` or of the buffers, not per step. Views of the pool's own
        storage: writes in place show through them, and a fork or a saved cache keeps them views of its own buffers.
        Only read: writes go through views made at the write (a view made under ``no_grad`` cannot be written in
        place with gradients on)."""
        used = self.used
        self._owner_used, self._bias_used = self.owner[:used], self.bias[:used]
        self._keys_t, self._values_used = self.keys[:used].transpose(1, 2), self.values[:used]

    # --- conversion ----------------------------------------------------------------------------------------
    @classmethod
    def from_rows(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_idx: torch.Tensor,
        valid: torch.Tensor,
        record: StreamRecord,
        owns_record: bool = True,
        **options,
    ) -> RaggedPool:
        """The pool holding the tokens ``valid`` ``[B, H, W]`` marks in a slot layout (``keys``, ``values``,
        ``token_idx`` ``[B, H, C, ...]``, ``C >= W`` slots per row; each row's tokens in stream order, as a slot
        layer that has only appended stores them, compacted or not). Once per compression: one host read of the
        counts; the blocks are written in chunks of rows (temporaries: one chunk's indices)."""
        batch, heads, capacity, head_dim = keys.shape
        rows, width = batch * heads, valid.shape[-1]
        valid = valid.reshape(rows, width)
        counts = valid.sum(-1)
        sizes = np.asarray(counts.tolist())  # (a host read: the pool's size)
        pool = cls(batch, heads, head_dim, values.shape[-1], sizes, keys, record, owns_record, **options)
        if not pool.used:
            return pool
        # the slot buffers as one row of slots each (views: a slot layer's buffers are contiguous)
        flat_keys = keys.contiguous().view(rows * capacity, head_dim)
        flat_values = values.contiguous().view(rows * capacity, values.shape[-1])
        flat_token = token_idx.contiguous().view(rows * capacity)
        counts = counts.to(pool.device)
        offsets = from_host(pool.offsets, pool.device, None)
        ends = np.cumsum(pool.row_blocks)
        first_block = from_host(pool.table[:, 0], pool.device, None)
        slot = torch.arange(pool.block, device=pool.device)
        step = max(1, CONVERSION_ELEMENTS // max(1, width))
        for top in range(0, rows, step):  # (once per compression: chunks of rows bound the temporaries)
            bottom = min(rows, top + step)
            start, stop = int(ends[top] - pool.row_blocks[top]), int(ends[bottom - 1])
            if start == stop:
                continue
            # each row's kept tokens first, in stream order (a stable sort of "not kept")
            order = (~valid[top:bottom]).to(torch.uint8).argsort(dim=-1, stable=True)  # [rows of the chunk, W]
            owner = pool.owner[start:stop]
            place = (torch.arange(start, stop, device=pool.device) - first_block[owner])[:, None] * pool.block + slot
            index = place - offsets[owner][:, None]  # [blocks, BLOCK]: a slot's token among its row's
            filled = (index >= 0) & (index < counts[owner][:, None])  # the slot holds a token
            source = order[(owner - top)[:, None], index.clamp(0, width - 1)] + (owner * capacity)[:, None]
            source = source.view(-1)
            blocks = stop - start
            pool._write_blocks(start, stop, flat_keys, flat_values, source, filled, place)
            pool.bias[start:stop].zero_()
            pool.bias[start:stop, 0].masked_fill_(~filled, float("-inf"))
            pool.token[start:stop] = (
                flat_token.index_select(0, source).view(blocks, pool.block).masked_fill(~filled, EMPTY)
            )
        return pool

    def _write_blocks(
        self,
        start: int,
        stop: int,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        source: torch.Tensor,
        filled: torch.Tensor,
        place: torch.Tensor,
    ) -> None:
        """Write blocks ``[start, stop)`` of the move: slot ``i`` takes row ``source[i]`` of the slot layout's keys
        and values where ``filled`` (``[blocks, BLOCK]``; zeros elsewhere); ``place``: each slot's place in its row."""
        head_dim, value_dim = flat_keys.shape[-1], flat_values.shape[-1]
        if flat_keys.requires_grad or flat_values.requires_grad:  # autograd records a copy, not an ``out=`` write
            self.keys[start:stop].view(-1, head_dim).copy_(flat_keys.index_select(0, source))
            self.values[start:stop].view(-1, value_dim).copy_(flat_values.index_select(0, source))
        else:
            torch.index_select(flat_keys, 0, source, out=self.keys[start:stop].view(-1, head_dim))
            torch.index_select(flat_values, 0, source, out=self.values[start:stop].view(-1, value_dim))
        self.keys[start:stop].masked_fill_(~filled[..., None], 0)
        self.values[start:stop].masked_fill_(~filled[..., None], 0)

    # --- appending -----------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``q`` new tokens per row (``[B, H, q, d]``) after each row's last token; returns their flat slot
        indices ``[R * q]`` (row-major). Real until ``register`` says otherwise.

        While every row's last block has room for them (``room``: the least room of any row, known on the host), the
        slots are the previous forward's plus ``q`` (one device add); otherwise the host places them."""
        count = keys.shape[2]
        if count == 1 and self._room >= 1:
            flat = self._next
            self._next = flat + 1
            self._room -= 1
            self._lag += 1
        else:
            flat = self._place(count)
        self._write_new(flat, keys, values)
        self.bias.view(-1).index_fill_(0, flat, 0.0)
        return flat

    def _write_new(self, flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the new tokens' keys and values ``[B, H, q, d]`` at their slots ``flat``."""
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, keys.reshape(-1, keys.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(0, flat, values.reshape(-1, values.shape[-1]))

    def _place(self, count: int) -> torch.Tensor:
        """The slots of ``count`` new tokens per row, blocks taken where rows need them (host bookkeeping)."""
        before = self.counts + self._lag
        self._lag = 0
        after = before + count
        needed = -(-after // self.block) - self.row_blocks
        total = int(needed.sum())
        if total:
            self._take_blocks(needed, total)
        self.counts = after
        place = before[:, None] + np.arange(count)  # [R, q] a token's place in its row
        block = np.take_along_axis(self.table, place // self.block, axis=1)
        flat = from_host((block * self.block + place % self.block).reshape(-1), self.device, None)
        self._follow(after)
        return flat

    def _follow(self, counts: np.ndarray) -> None:
        """Set the next single token's slots (``_next``) and the room every row has left in its last block."""
        within = counts % self.block
        last = np.take_along_axis(self.table, np.maximum(self.row_blocks - 1, 0)[:, None], axis=1)[:, 0]
        has_room = (within > 0) & (self.row_blocks > 0)
        self._room = int((self.block - within).min()) if bool(has_room.all()) else 0
        self._next = from_host(last * self.block + within, self.device, None)

    def row_counts(self) -> np.ndarray:
        """``[R]`` tokens per row (host)."""
        return self.counts + self._lag - self.offsets

    def _take_blocks(self, needed: np.ndarray, total: int) -> None:
        """Give each row ``needed[r]`` new blocks (``total`` in all) from the top of the pool, growing it first;
        the blocks taken are cleared (zero keys and values, empty slots)."""
        if self.used + total > self.capacity:
            self._grow(self.used + total + max(self.rows, self.capacity // GROWTH))
        rows = np.repeat(np.arange(self.rows), needed)
        ids = self.used + np.arange(total)
        column = self.row_blocks[rows] + (np.arange(total) - np.repeat(np.cumsum(needed) - needed, needed))
        width = int(column.max()) + 1
        if width > self.table.shape[1]:
            grown = max(width, self.table.shape[1] + max(1, self.table.shape[1] // 4))
            self.table = np.pad(self.table, ((0, 0), (0, grown - self.table.shape[1])))
        self.table[rows, column] = ids
        taken = slice(self.used, self.used + total)
        self.owner[taken] = from_host(rows, self.device, None)
        self._clear(taken)
        self.bias[taken].fill_(float("-inf"))
        self.token[taken].fill_(EMPTY)
        self.row_blocks = self.row_blocks + needed
        self.used += total
        self._views()

    def _clear(self, taken: slice) -> None:
        """Zero the keys and values of the blocks ``taken``."""
        self.keys[taken].zero_()
        self.values[taken].zero_()

    def _grow(self, capacity: int) -> None:
        """Reallocate every tensor with ``capacity`` blocks, copying the used ones (the new ones are written when
        taken)."""

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            fresh = tensor.new_empty((capacity, *tensor.shape[1:]))
            fresh[: self.used] = tensor[: self.used]
            return fresh

        for name in self.BLOCK_TENSORS:
            setattr(self, name, grown(getattr(self, name)))
        self._views()

    # --- the batch -----------------------------------------------------------------------------------------
    def move_batch(self, sequences: np.ndarray) -> None:
        """Hold, as sequence ``i``, a copy of sequence ``sequences[i]`` ``[B']`` (a selection, reordering or
        repetition of the batch: beam search, ``num_return_sequences``). Each new row gets copies of its old row's
        blocks, side by side as after the move into the pool, plus room for one more block per row; the record
        moves once, with the pool that counts it. Like a ``DynamicCache``'s ``index_select``, it copies what is
        held (once per call, not per step of a decoding without reordering)."""
        source = self.rows_of(sequences)
        held = np.arange(self.table.shape[1]) < self.row_blocks[source][:, None]
        taken = from_host(self.table[source][held], self.device, None)  # the old blocks, in their new order
        self.counts, self._lag = (self.counts + self._lag)[source], 0
        self.offsets = self.offsets[source]
        self.batch, self.rows = len(sequences), len(source)
        self._lay_out(self.row_blocks[source])
        for name in self.BLOCK_TENSORS:
            tensor = getattr(self, name)
            fresh = tensor.new_empty((self.used + self.rows, *tensor.shape[1:]))
            fresh[: self.used] = tensor.index_select(0, taken)
            setattr(self, name, fresh)
        self._own()
        self._follow(self.counts)
        self._views()
        if self.owns_record:
            self.record.move_batch(from_host(sequences, self.device, None))

    def rows_of(self, sequences: np.ndarray) -> np.ndarray:
        """The rows ``b * H + h`` of the sequences ``sequences``, in their order."""
        return (sequences[:, None] * self.heads + np.arange(self.heads)).reshape(-1)

    @property
    def real_seen(self) -> torch.Tensor:
        """``[B]`` real tokens seen per sequence."""
        return self.record.real_seen

    def register(
        self, flat: torch.Tensor, first: int, positions: torch.Tensor | None, real: torch.Tensor | None
    ) -> None:
        """Record the new tokens' stream indices (``first ..``), RoPE positions ``[B, q]`` (``None``: their stream
        indices) and realness ``[B, q]`` (``None``: all real) at the slots ``flat`` that ``append`` returned (the
        positions and ranks in the cache's record, once for all its pools).

        A decoding step's token (one real token per row) is one ``index_fill_`` of its stream index: written at
        once, it measured as fast as remembering the steps and writing them together every 64 steps (0.4 % of a
        step on SmolLM2, within the noise; ``docs/results/frontier.md``)."""
        count = flat.shape[0] // self.rows
        self.record.record(first, count, positions, real)
        if count == 1 and real is None:
            self.token.view(-1).index_fill_(0, flat, first)
            return
        if real is not None:
            hidden = torch.zeros(real.shape, dtype=self.dtype, device=self.device)
            hidden.masked_fill_(~real, float("-inf"))
            self.bias.view(-1).index_copy_(0, flat, hidden[:, None].expand(-1, self.heads, -1).reshape(-1))
        stream = torch.arange(first, first + count, dtype=INDEX, device=self.device)
        self.token.view(-1).index_copy_(0, flat, stream.repeat(self.rows))  # ``flat`` is row-major [R, q]

    def end_forward(self) -> None:
        """The forward is over (nothing kept per forward here)."""

    # --- attention -----------------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, scale: float, plain: bool, first: int) -> torch.Tensor:
        """Attention of ``query`` ``[B, H_q, q, d]`` over the pool (the new tokens already in it), ``[B, H_q, q, d]``.

        ``plain``: one query per row that sees every stored token (a decoding step without padding; the slots' bias
        is the whole mask); otherwise query ``i`` (stream index ``first + i``) sees the real tokens up to itself,
        and itself."""
        if plain:
            return self._step(query, scale)
        batch, q_heads, count, dim = query.shape
        groups = q_heads // self.heads
        rows = query.reshape(batch, self.heads, groups, count, dim).transpose(2, 3)  # [B, H, q, G, d]
        outputs = []
        keys, values = self.read_blocks()
        step = max(1, CHUNK_ELEMENTS // max(1, self.used * self.block * groups))
        for start in range(0, count, step):  # query chunks bound the logits (one chunk while decoding)
            stop = min(count, start + step)
            part = rows[:, :, start:stop].reshape(self.rows, (stop - start) * groups, dim)
            outputs.append(self._attend_rows(part, scale, first + start, stop - start, groups, keys, values))
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return output.view(batch, self.heads, count, groups, -1).transpose(2, 3).reshape(batch, q_heads, count, -1)

    def _step(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """A decoding step's attention, ``query`` ``[B, H_q, 1, d]`` -> ``[B, H_q, 1, d_v]``: one query per row, every
        stored token visible (the slots' bias is the whole mask). The softmax of ``_attend_rows`` in fewer
        operations: every row holds the step's new token, so each segment's maximum is finite and written by the
        reduction itself (no initial value, no guard), and the step's views are the pool's (``_views``)."""
        batch, q_heads, _, dim = query.shape
        if torch.is_grad_enabled():  # views that carry the buffers' autograd history as it is now
            self._views()
        owner = self._owner_used
        groups = q_heads // self.heads
        rows = query.reshape(self.rows, groups, dim).index_select(0, owner)  # [n, G, d]
        logits = torch.baddbmm(self._bias_used, rows, self._keys_t, alpha=scale)  # [n, G, BLOCK]
        return self._step_output(logits, owner, self._values_used, groups).view(batch, q_heads, 1, -1)

    def _step_output(
        self, logits: torch.Tensor, owner: torch.Tensor, values: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """A decoding step's output ``[R, G, d_v]`` from the owned blocks' ``logits`` ``[n, G, BLOCK]`` (masked by
        the slots' bias) and ``values`` ``[n, BLOCK, d_v]``: the per-row softmax assembled from the blocks."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        top = logits.amax(dim=-1)  # [n, G]
        segment = top.new_empty(self.rows, groups).scatter_reduce_(
            0, owner.unsqueeze(1).expand(-1, groups), top, "amax", include_self=False
        )
        weights = logits.sub_(segment.index_select(0, owner).unsqueeze(-1)).exp_()
        norm = top.new_zeros(self.rows, groups).index_add_(0, owner, weights.sum(dim=-1))
        if weights.dtype != values.dtype:
            weights = weights.to(values.dtype)
        parts = torch.bmm(weights, values)  # [n, G, d_v]
        output = parts.new_zeros(self.rows, groups, parts.shape[-1]).index_add_(0, owner, parts)
        norm = norm.unsqueeze(-1)
        return output.div_(norm if norm.dtype == output.dtype else norm.to(output.dtype))

    def read_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[used, BLOCK, d]`` and values ``[used, BLOCK, d_v]`` of the owned blocks as attention reads them."""
        return self.keys[: self.used], self.values[: self.used]

    def _attend_rows(
        self,
        rows: torch.Tensor,
        scale: float,
        first: int,
        count: int,
        groups: int,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """``rows`` ``[R, q * G, d]`` (queries of stream index ``first ..``, token-major) -> ``[R, q * G, d_v]``, each
        query seeing the real tokens up to itself, and itself (a decoding step: ``_step``), over the owned blocks'
        ``keys`` and ``values`` (``read_blocks``)."""
        used = self.used
        owner = self.owner[:used]
        block_rows = rows.index_select(0, owner)  # [n, q G, d]
        logits = torch.bmm(block_rows, keys.transpose(1, 2)).mul_(scale)
        token = self.token[:used]  # [n, block]
        queries = torch.arange(first, first + count, device=self.device)[None, :, None]
        seen = (token[:, None, :] <= queries) & ((self.bias[:used] == 0) | (token[:, None, :] == queries))
        seen = seen[:, :, None].expand(used, count, groups, self.block).reshape(used, count * groups, self.block)
        logits.masked_fill_(~seen, float("-inf"))
        if logits.dtype != torch.float32:
            logits = logits.float()
        width = logits.shape[1]
        top = logits.amax(dim=-1)  # [n, q G]
        segment = torch.full((self.rows, width), float("-inf"), device=self.device)
        segment.scatter_reduce_(0, owner[:, None].expand(used, width), top, "amax")
        shift = segment.index_select(0, owner)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # a block no query sees
        weights = logits.sub_(shift[..., None]).exp_()
        norm = torch.zeros(self.rows, width, device=self.device).index_add_(0, owner, weights.sum(dim=-1))
        parts = torch.bmm(weights.to(values.dtype), values)  # [n, q G, d_v]
        output = torch.zeros(self.rows, width, parts.shape[-1], dtype=parts.dtype, device=self.device)
        output.index_add_(0, owner, parts)
        return output.div_(norm[..., None].to(output.dtype))

    # --- inspection and accounting -------------------------------------------------------------------------
    def dense(self) -> tuple[torch.Tensor, ...]:
        """Keys, values, token_idx, rope_pos, rank, valid as ``[B, H, W, ...]`` (``W`` the fullest row), each row in
        stream order and padded with empty slots: for inspection (a copy of the pool, never used by a step)."""
        counts = self.row_counts()
        width = int(counts.max()) if self.rows else 0
        offsets = from_host(self.offsets, self.device, None)[:, None]
        place = offsets + torch.arange(width, device=self.device)  # [R, W] (past a row's empty leading slots)
        table = from_host(self.table, self.device, None)
        column = (place // self.block).clamp(max=table.shape[1] - 1)
        flat = table.gather(1, column) * self.block + place % self.block  # [R, W]
        filled = place < offsets + from_host(counts, self.device, None)[:, None]
        flat = torch.where(filled, flat, 0)
        keys, values = self.read_blocks()

        def take(tensor: torch.Tensor, fill: float) -> torch.Tensor:
            slots = tensor.reshape(-1, *tensor.shape[2:])[flat]
            mask = filled.view(*filled.shape, *[1] * (slots.dim() - 2))
            return slots.masked_fill(~mask, fill).view(self.batch, self.heads, width, *tensor.shape[2:])

        token = take(self.token, EMPTY).long()
        sequence = torch.arange(self.batch, device=self.device)[:, None, None].expand_as(token)
        rope_pos, rank = self.record.lookup(token, sequence)
        valid = take(self.bias.view(-1, self.block), float("-inf")) == 0
        return take(keys, 0).to(self.dtype), take(values, 0).to(self.dtype), token, rope_pos, rank, valid

    def token_bytes(self) -> int:
        """Bytes of one slot's key and value."""
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values held: the owned blocks (stored tokens + each row's unfilled slots)."""
        return self.held_slots() * self.token_bytes()

    def allocated_kv_nbytes(self) -> int:
        """Bytes of the key and value blocks as allocated (the pool's capacity)."""
        return self.capacity * self.block * self.token_bytes()

    def held_slots(self) -> int:
        """Slots in owned blocks: the stored tokens plus each row's unfilled part of its last block."""
        return self.used * self.block

    def stored_tokens(self) -> int:
        return int(self.row_counts().sum())

    def metadata_bytes_per_slot(self) -> int:
        """Bookkeeping bytes per slot: its mask entry, its stream index and a share of its block's owner (the
        record's bytes are the record's, ``record_nbytes``)."""
        owner = math.ceil(self.owner.element_size() / self.block)
        return self.bias.element_size() + self.token.element_size() + owner

    def record_nbytes(self, allocated: bool = False) -> int:
        """The record's bytes (recorded or allocated) where this pool counts them, else 0 (one pool per record)."""
        if not self.owns_record:
            return 0
        return self.record.allocated_nbytes() if allocated else self.record.nbytes()
