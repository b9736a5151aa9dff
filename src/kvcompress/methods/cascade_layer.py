"""The Cascading KV Cache's storage: sinks and ``N`` circular sub-caches in one buffer allocated once.

See ``kvcompress.methods.cascade`` for the method, the paper and the choices. This module holds only the cache
layer (it subclasses ``CompressedLayer``, which cannot be imported while the method registry is being built).

Slot layout of one layer (per sequence; every KV head uses the same slots, homogeneous policy):
``[0, S)`` sinks, then cascade ``i`` in ``[S + i W, S + (i + 1) W)``, a ring whose oldest token sits at offset
``start[i]`` and which holds ``count[i]`` tokens. Beside the keys and values, per slot: the token's stream index
(``-1`` = empty), the RoPE position the model gave it, and its attention EMA (fp32). Per sequence: sinks stored,
real tokens seen (the clock), and ``start``/``count`` per cascade. One insertion moves at most one token per
cascade: the moves of all cascades are decided from the counters first, then done with one gather and one
scatter per tensor (no loop over cascades, sequences or heads).

Keys are stored un-rotated: the model's rotation is undone with the exact cosines and sines it used, and every
attention rotates the stored keys to their current rank from a small table (ranks never exceed ``S + |C|``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.cache import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.methods.base import AttentionStats, Selection
from kvcompress.positions import rotate_by

_MAX_PERIOD = 1 << 62  # acceptance periods beyond this are never reached (no overflow for large base^i)


@dataclass
class _Pending:
    """Tokens handed to ``update`` and not inserted yet (they are inserted when they attend)."""

    keys: torch.Tensor  # [B, H_kv, q, d] as the model gave them (rotated at ``pos``)
    values: torch.Tensor  # [B, H_kv, q, d]
    tok: torch.Tensor  # [q] stream indices (padding included)
    pos: torch.Tensor | None = None  # [B, q] RoPE positions; None = the stream indices
    real: torch.Tensor | None = None  # [B, q] bool; None = every token is real


class CascadeLayer(CompressedLayer):
    """One layer of a Cascading KV Cache (a ``CompressedLayer`` with circular storage)."""

    def __init__(self, policy, inv_freq: torch.Tensor | None = None) -> None:
        self._kv: torch.Tensor | None = None
        super().__init__(policy, inv_freq)
        config = policy.config
        self.sinks, self.cascades, self.width = config.sinks, config.cascades, config.width
        self.capacity = config.budget
        self._pending: _Pending | None = None
        self._all_real = True
        self.force_tensor_path = False  # tests: always take the per-sequence tensor path of ``_insert``

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        slots, cascades = self.capacity, self.cascades
        long = {"dtype": torch.long, "device": self.device}
        self._key_dim = key_dim
        # keys (rotated at their slot index) and values side by side; slot ``slots`` is scratch space
        self._kv = key_states.new_zeros(batch, heads, slots + 1, key_dim + value_states.shape[-1])
        # per slot: [stream index of the token (-1 = empty), RoPE position the model gave it]
        self._meta = torch.stack(
            [torch.full((batch, slots + 1), -1, **long), torch.zeros(batch, slots + 1, **long)], -1
        )
        self._score = torch.zeros(batch, slots + 1, dtype=torch.float32, device=self.device)  # attention EMA
        # tensor path only (see _in_step below): sinks stored, real tokens seen (the acceptance clock), per cascade
        # the ring's start and count, and two flags: every sequence has all its sinks (then the sink column is
        # skipped), eager fill is over for every sequence
        self._sinks_full = self.sinks == 0
        self._filled = not self.policy.config.eager_fill
        base = self.policy.config.base
        self._period = torch.tensor([min(base**i, _MAX_PERIOD) for i in range(cascades)], **long)
        self._first_slot = self.sinks + torch.arange(cascades, **long) * self.width
        self._ring = torch.arange(self.width, **long)
        self._sink_slots = torch.arange(self.sinks, **long)
        if self.inv_freq is not None:  # cos / sin of every slot-to-slot move, [2 (S + |C|) + 1, d / 2]
            delta = torch.arange(-slots, slots + 1, dtype=torch.float64, device=self.device)
            angles = delta[:, None] * self.inv_freq.to(self.device, torch.float64)
            self._turn_cos, self._turn_sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        # "in step": every sequence has taken the same number of real tokens so far (no padding yet). Then the
        # counters are the same for the whole batch (only selection outcomes differ), so they are kept as Python
        # integers and every move is a slice of the buffer; the first padded forward switches to the tensor path
        self._in_step = True
        self._py_count, self._py_start, self._py_seen = [0] * cascades, [0] * cascades, 0
        self._py_tensors: tuple[torch.Tensor, ...] | None = None
        self.is_initialized = True

    # per-sequence counters: tensors, or built from the Python integers while the batch is in step
    def _counters(self) -> tuple[torch.Tensor, ...]:
        if self._py_tensors is None:
            batch, long = self._kv.shape[0], {"dtype": torch.long, "device": self.device}
            seen = self._py_seen
            self._py_tensors = (
                torch.tensor([self._py_count], **long).expand(batch, -1),
                torch.tensor([self._py_start], **long).expand(batch, -1),
                torch.full((batch,), min(seen, self.sinks), **long),
                torch.full((batch,), seen, **long),
            )
        return self._py_tensors

    def _leave_step(self) -> None:
        """Switch to per-sequence counter tensors (the batch is no longer in step)."""
        if self._in_step:
            count, start, n_sink, n_real = (t.clone() for t in self._counters())
            self._in_step = False
            self._count_t, self._start_t, self._n_sink_t, self._n_real_t = count, start, n_sink, n_real
            self._sinks_full = self.sinks == 0 or self._py_seen >= self.sinks
            self._filled = not self.policy.config.eager_fill or self._py_seen >= self.capacity

    def _counter(index: int, name: str):  # noqa: N805 (a property factory used in the class body)
        def get(self) -> torch.Tensor:
            return self._counters()[index] if self._in_step else getattr(self, name)

        def put(self, value: torch.Tensor) -> None:
            self._leave_step()
            setattr(self, name, value)

        return property(get, put)

    _count = _counter(0, "_count_t")
    _start = _counter(1, "_start_t")
    _n_sink = _counter(2, "_n_sink_t")
    _n_real = _counter(3, "_n_real_t")
    del _counter

    @property
    def _k(self) -> torch.Tensor:
        """Stored keys ``[B, H_kv, S + |C|, d]`` in slot order, each rotated at its slot index."""
        return self._kv[:, :, : self.capacity, : self._key_dim]

    @property
    def _v(self) -> torch.Tensor:
        return self._kv[:, :, : self.capacity, self._key_dim :]

    @property
    def _tok(self) -> torch.Tensor:
        return self._meta[:, : self.capacity, 0]

    @property
    def _pos(self) -> torch.Tensor:
        return self._meta[:, : self.capacity, 1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the new tokens; they are inserted when they attend (``cascade_attention``), as in the paper.

        Returns the slot buffers (slot order is not stream order; attention does not depend on it).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:  # the previous forward never attended: insert those tokens now
            self._insert_pending()
        count = key_states.shape[2]
        tok = torch.arange(self.seen, self.seen + count, device=self.device)
        self._pending = _Pending(key_states, value_states, tok)
        self.seen += count
        self.new_tokens = count
        keys = self._k
        setattr(keys, LAYER_ATTRIBUTE, self)
        return keys, self._v

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        pending, count = self._pending, self.new_tokens
        if pending is None:
            return
        batch = self._kv.shape[0]
        if position_ids is not None:
            positions = position_ids[..., -count:].to(self.device)
            if positions.dim() == 3:  # multimodal RoPE sections: the text positions are the first
                positions = positions[0]
            pending.pos = positions.expand(batch, -1).long()
        if padding is not None:
            pending.real = padding[:, -count:].to(self.device, torch.bool)

    def _prepared(self, pending: _Pending) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending tokens as slot items: ``kv`` ``[B, H, q, dk + dv]`` with un-rotated keys, ``meta``
        ``[B, q, 2]``, RoPE positions ``[B, q]`` and the real-token mask ``[B, q]``."""
        batch, count = self._kv.shape[0], pending.keys.shape[2]
        pos = pending.tok.expand(batch, -1) if pending.pos is None else pending.pos
        real = pending.real
        self._all_real = real is None or bool(real.all())  # no padding in this forward
        if real is None:
            real = torch.ones(batch, count, dtype=torch.bool, device=self.device)
        keys, values = pending.keys, pending.values.to(pending.keys.dtype)
        if self.inv_freq is None:
            kv = torch.cat([keys, values], -1)
        else:  # undo the model's rotation with the very angles it used (rotate_half convention, by -angle)
            angles = pos[:, None, :, None].to(torch.float32) * self.inv_freq.to(self.device)
            cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
            half = keys.shape[-1] // 2
            first, second = keys[..., :half], keys[..., half:]
            kv = torch.cat([first * cos + second * sin, second * cos - first * sin, values], -1)
        meta = torch.stack([pending.tok.expand(batch, -1), pos], -1)
        return kv, meta, pos, real

    def _insert_pending(self, scores: torch.Tensor | None = None) -> None:
        pending, self._pending = self._pending, None
        kv, meta, _, real = self._prepared(pending)
        for m in range(kv.shape[2]):
            score = None if scores is None else scores[:, m]
            self._insert(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m], score)

    def _insert(self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None) -> None:
        if self._in_step and self._all_real and not self.force_tensor_path:
            self._insert_in_step(kv, meta, score)
        else:
            self._insert_tensors(kv, meta, real, score)

    def _turn(self, rows: torch.Tensor, delta: int) -> None:
        """Rotate the keys of ``rows`` (``[..., dk + dv]`` slot items) in place by ``delta`` positions."""
        if self.inv_freq is None or delta == 0:
            return
        half = self._key_dim // 2
        cos, sin = self._turn_cos[delta + self.capacity], self._turn_sin[delta + self.capacity]
        first, second = rows[..., :half], rows[..., half : self._key_dim]
        lost = first * sin
        first.mul_(cos).addcmul_(second, sin, value=-1)
        second.mul_(cos).add_(lost)

    def _insert_in_step(self, kv: torch.Tensor, meta: torch.Tensor, score: torch.Tensor | None) -> None:
        """``_insert`` while every sequence is in step: Algorithm 1 on Python integers (the same schedule for
        the whole batch), then the moves as slices of the buffer, deepest cascade first so that every token is
        read before its slot is overwritten. Only a selection (d) depends on the sequence: there the arriving
        token is written where it wins."""
        sinks, width, p = self.sinks, self.width, self._py_seen
        self._py_seen, self._py_tensors = p + 1, None
        if p < sinks:  # sinks fill first
            self._put(p, None, kv, meta, score)
            return
        count, start, config = self._py_count, self._py_start, self.policy.config
        eager = config.eager_fill and p < self.capacity
        moves: list[tuple[int, bool]] = []  # (destination slot, selection?) per cascade the token reaches
        for i in range(self.cascades):
            first = sinks + i * width
            if eager or (p - sinks) % config.base**i == 0:
                if count[i] < width:  # (a) append
                    moves.append((first + (start[i] + count[i]) % width, False))
                    count[i] += 1
                    break
                moves.append((first + start[i], False))  # (b) overwrite the oldest, carry it on
                start[i] = (start[i] + 1) % width
            elif count[i] == 0:  # (c) eager add into an empty cascade
                moves.append((first + start[i], False))
                count[i] = 1
                break
            else:  # (d) selection against the newest token
                moves.append((first + (start[i] + count[i] - 1) % width, self.policy.needs_scores))
                break
        for column in range(len(moves) - 1, -1, -1):
            dest, select = moves[column]
            self._put(dest, moves[column - 1][0] if column else None, kv, meta, score, select)

    def _put(self, dest: int, source: int | None, kv, meta, score, select: bool = False) -> None:
        """Write the new token (``source=None``) or the token at slot ``source`` into slot ``dest`` (its key
        rotated at ``dest``); with ``select``, only in the sequences where its score beats the resident's (tie
        rule of the config)."""
        buffer, scores = self._kv, self._score
        if select:  # only the sequences where the arriving token wins write it
            arriving = scores[:, source] if source is not None else self._new_score(score)
            resident = scores[:, dest]
            wins = arriving >= resident if self.policy.config.tie == "incoming" else arriving > resident
            winners = wins.nonzero().flatten()
            if winners.numel() == 0:
                return
            if winners.numel() == wins.numel():  # everywhere: a plain write
                self._put(dest, source, kv, meta, score)
                return
            # the winners' rows: index_select on the slot column (advanced indexing of the 4-d buffer is 2-3x
            # slower on CPU); the result is a fresh tensor, rotated in place
            items, moved_meta = (
                (kv[:, :, 0], meta[:, 0]) if source is None else (buffer[:, :, source], self._meta[:, source])
            )
            rows = items.index_select(0, winners)
            self._turn(rows, dest - (source or 0))
            buffer[:, :, dest].index_copy_(0, winners, rows)
            self._meta[:, dest].index_copy_(0, winners, moved_meta.index_select(0, winners))
            scores[:, dest].index_copy_(0, winners, arriving.index_select(0, winners))
            return
        rows = buffer[:, :, dest]
        if source is None:
            rows.copy_(kv[:, :, 0])
            self._turn(rows, dest)  # the new key arrives un-rotated
            self._meta[:, dest] = meta[:, 0]
            if self.policy.needs_scores:
                scores[:, dest] = 0.0 if score is None else score
        else:
            rows.copy_(buffer[:, :, source])
            self._turn(rows, dest - source)
            self._meta[:, dest] = self._meta[:, source]
            if self.policy.needs_scores:
                scores[:, dest] = scores[:, source]

    def _new_score(self, score: torch.Tensor | None) -> torch.Tensor:
        return self._score.new_zeros(self._score.shape[0]) if score is None else score.float()

    def _insert_tensors(
        self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None
    ) -> None:
        """Insert one token per sequence: ``kv`` ``[B, H_kv, 1, dk + dv]`` (key un-rotated), ``meta`` ``[B, 1, 2]``,
        ``real`` ``[B]`` (False: padding, nothing happens), ``score`` ``[B]`` initial EMA (None: 0).

        Algorithm 1 (spec §1.5). The token travels down the cascades while each one is accepting and full
        (overwrite the oldest slot, pass the evicted token on: b); it stops at the first cascade that appends (a),
        eager-adds into an empty ring (c) or selects between the arriving token and its newest one (d).
        Every cascade is touched at most once, so all decisions come from the counters before the step.
        """
        self._leave_step()
        sinks, width, slots = self.sinks, self.width, self.capacity
        config = self.policy.config
        seen, count, start = self._n_real, self._count, self._start
        batch = seen.shape[0]
        into_cascades = real if self._sinks_full else real & (seen >= sinks)
        accepting = ((seen - sinks)[:, None] % self._period) == 0  # the global clock, spec §1.4
        if not self._filled:
            accepting = accepting | (seen < slots)[:, None]
        full = count == width
        passes = accepting & full  # (b): evict the oldest, carry it on to the next cascade
        select = ~accepting & (count > 0)  # (d)
        if self.cascades > 1:
            reached = torch.cat([into_cascades[:, None], passes[:, :-1]], 1).cumprod(1).bool()
        else:
            reached = into_cascades[:, None]
        self._count = count + (reached & ~(passes | select)).long()
        self._start = (start + (reached & passes).long()) % width
        depth = int(reached.sum(1).max())  # cascades the deepest sequence reaches: only those columns move
        reached, select = reached[:, :depth], select[:, :depth]
        # (b) oldest slot = start + count (mod W) when full; (a) next free; (c) start; (d) newest slot
        first_slot, start, count = self._first_slot[:depth], start[:, :depth], count[:, :depth]
        dest = first_slot + (start + count - select.long()) % width  # [B, depth]
        evicted = first_slot[:-1] + start[:, :-1]  # [B, depth - 1]: the oldest slots the chain passes through
        write = reached
        new_score = torch.zeros(batch, 1, device=self.device) if score is None else score.float()[:, None]
        if self.policy.needs_scores and depth:
            scores, seq = self._score.view(-1), self._bases()[1][:, None]
            evicted_score = scores[seq + evicted]
            arriving = torch.cat([new_score, evicted_score], 1)
            resident = scores[seq + dest]
            loses = arriving < resident if config.tie == "incoming" else arriving <= resident
            write = reached & ~(select & loses)
        dest = torch.where(write, dest, slots)  # columns that write nothing write the scratch slot
        lead = 1 if depth else 0  # columns that take the new token
        if not self._sinks_full:
            to_sink = real & (seen < sinks)
            dest = torch.cat([torch.where(to_sink, seen, slots)[:, None], dest], 1)
            self._n_sink = self._n_sink + to_sink.long()
            lead += 1  # the new token is also the item of the sink column
            self._sinks_full = bool((self._n_sink == sinks).all())
        self._n_real = seen + real.long()
        if not self._filled:
            self._filled = bool((self._n_real >= slots).all())
        if not lead:
            return  # padding only
        # items: the new token (lead columns), then the tokens evicted from cascades 0..N-2; moved as whole rows of
        # flattened buffers (index_select / index_copy_ copy contiguous rows, unlike gather / scatter)
        heads, width_kv = self._kv.shape[1], self._kv.shape[-1]
        rows, seq = self._bases()
        kv_rows = self._kv.view(-1, width_kv)
        items = kv.expand(batch, heads, lead, width_kv)
        if depth > 1:
            moved = kv_rows.index_select(0, (rows[:, :, None] + evicted[:, None, :]).flatten())
            items = torch.cat([items, moved.view(batch, heads, -1, width_kv)], 2)
        if self.inv_freq is not None:  # rotate each key from where it was (0 for the new one) to its slot
            source = torch.cat([torch.zeros_like(dest[:, :lead]), evicted], 1)
            keys = rotate_by(items[..., : self._key_dim], (dest - source)[:, None], self.inv_freq)
            items = torch.cat([keys, items[..., self._key_dim :]], -1)
        kv_rows.index_copy_(0, (rows[:, :, None] + dest[:, None, :]).flatten(), items.reshape(-1, width_kv))
        meta_rows = self._meta.view(-1, 2)
        meta_items = meta.expand(batch, lead, 2)
        if depth > 1:
            moved = meta_rows.index_select(0, (seq[:, None] + evicted).flatten()).view(batch, -1, 2)
            meta_items = torch.cat([meta_items, moved], 1)
        meta_rows.index_copy_(0, (seq[:, None] + dest).flatten(), meta_items.reshape(-1, 2))
        if self.policy.needs_scores and depth:
            score_items = torch.cat([new_score.expand(batch, lead), evicted_score], 1)
            self._score.view(-1).index_copy_(0, (seq[:, None] + dest).flatten(), score_items.flatten())

    def _bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row offsets of each (sequence, head) in the flattened key/value buffer and of each sequence in the
        flattened per-slot buffers (cached per batch size)."""
        batch, heads = self._kv.shape[:2]
        if getattr(self, "_bases_for", None) != batch:
            slots = self.capacity + 1
            sequences = torch.arange(batch, device=self.device)
            self._row_base = (sequences[:, None] * heads + torch.arange(heads, device=self.device)) * slots
            self._seq_base = sequences * slots
            self._bases_for = batch
        return self._row_base, self._seq_base

    # --- positions and attention ----------------------------------------------------------------------------
    def ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot ``[B, S + |C|]``: the rank (RoPE position) of its token inside the cache, and whether the slot
        is occupied. Sinks come first, then the cascades from the oldest (last) to the newest, each in ring order
        (spec §1.8); the ranks of the occupied slots are ``0 .. stored - 1``."""
        count, start = self._count, self._start
        older = count.flip(1).cumsum(1).flip(1) - count  # tokens in the older cascades
        ring = (self._ring - start[:, :, None]) % self.width  # [B, N, W]: age order inside each ring
        rank = (self._n_sink[:, None, None] + older[:, :, None] + ring).flatten(1)
        if self.sinks:
            rank = torch.cat([self._sink_slots.expand(rank.shape[0], -1), rank], 1)
        return rank, self._tok >= 0

    def _cache_logits(self, query: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, H_kv, G, n, S + |C|]`` of un-rotated queries ``[B, H_kv, G, n, d]`` at ranks ``top``
        ``[B, n]`` against the stored keys at their ranks.

        Keys are stored rotated at their slot index. Inside one cascade, rank = slot + shift for ring offsets at
        or after the start and slot + shift + W before it (one shift per cascade), so instead of re-rotating every
        key each step, each query is rotated to ``top - shift`` and ``top - shift - W`` (RoPE depends only on the
        difference) and each slot takes the logit of its group: ``O(N)`` small rotations instead of ``O(|C|)``.
        """
        keys = self._k
        batch, kv_heads, groups, count, dim = query.shape
        slots = self.capacity
        if self.inv_freq is None:
            logits = query.reshape(batch, kv_heads, groups * count, dim) @ keys.transpose(-1, -2)
            return logits.view(batch, kv_heads, groups, count, slots)
        cascades, width, sinks = self.cascades, self.width, self.sinks
        older = self._count.flip(1).cumsum(1).flip(1) - self._count
        shift = self._n_sink[:, None] + older - self._first_slot - self._start  # [B, N]
        wrapped = self._ring < self._start[:, :, None]  # [B, N, W]: rank = slot + shift + W
        at = top[:, :, None] - shift[:, None, :]  # [B, n, N]
        pairs = torch.stack([at, at - width], -1).flatten(2)  # [B, n, 2N]: both groups of each cascade
        positions = torch.cat([top[:, :, None], pairs], 2)  # [B, n, 1 + 2N]
        rotated = rotate_by(query[:, :, :, :, None, :], positions[:, None, None], self.inv_freq)  # [B,H,G,n,V,d]
        rows = rotated.permute(0, 1, 4, 2, 3, 5).reshape(batch, kv_heads, 1 + 2 * cascades, groups * count, dim)
        blocks = [rows[:, :, 0] @ keys[:, :, :sinks].transpose(-1, -2)] if sinks else []
        for i in range(cascades):  # one matmul per cascade over views of the buffer: nothing is copied
            first = sinks + i * width
            pair = rows[:, :, 1 + 2 * i : 3 + 2 * i].reshape(batch, kv_heads, 2 * groups * count, dim)
            both = (pair @ keys[:, :, first : first + width].transpose(-1, -2)).view(batch, kv_heads, 2, -1, width)
            blocks.append(torch.where(wrapped[:, i, None, None, :], both[:, :, 1], both[:, :, 0]))
        return torch.cat(blocks, -1).view(batch, kv_heads, groups, count, slots)

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key  # positions are assigned inside cascade_attention, token by token

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> None:
        self._sliding_window = sliding_window  # applied inside cascade_attention, by stream index as the model does
        return None  # built inside cascade_attention from the occupied slots

    def _in_window(self, query_tok: torch.Tensor) -> torch.Tensor | None:
        """``[B, n, S + |C|]``: stored keys inside the model's sliding window of queries at stream indices
        ``query_tok`` ``[B, n]`` (``None``: no sliding window in this layer)."""
        window = getattr(self, "_sliding_window", None)
        if window is None:
            return None
        return self._tok[:, None, :] > query_tok[:, :, None] - window

    def _grouped_queries(self, query: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, q, d]`` queries as the model rotated them -> un-rotated ``[B, H_kv, G, q, d]``."""
        batch, q_heads, count, dim = query.shape
        if self.inv_freq is not None:
            query = rotate_by(query, -pos[:, None, :], self.inv_freq)
        kv_heads = self._kv.shape[1]
        return query.reshape(batch, kv_heads, q_heads // kv_heads, count, dim)

    def cascade_attention(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Insert this forward's tokens, attend, update the EMA; returns ``[B, H, q, d]``.

        ``prefill="exact"``: token by token (insert, attend, EMA), identical to feeding one token at a time.
        ``prefill="chunked"`` with several tokens: the later official strided variant (module docstring).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("cascade_attention() needs the tokens of this forward: call update() first")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        kv, meta, pos, real = self._prepared(pending)
        queries = self._grouped_queries(query, pos)
        if (self.policy.config.prefill == "chunked" and query.shape[2] > 1) or self.policy.attend_first:
            return self._chunk_attention(queries, kv, meta, real, scale)
        outputs = []
        for m in range(query.shape[2]):
            self._insert(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m], None)
            outputs.append(self._attend(queries[:, :, :, m : m + 1], real[:, m], meta[:, m : m + 1, 0], scale))
        batch, q_heads, count, dim = query.shape
        return torch.cat(outputs, 3).reshape(batch, q_heads, count, -1)

    def _attend(self, query: torch.Tensor, real: torch.Tensor, query_tok: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per sequence (``[B, H_kv, G, 1, d]`` un-rotated, stream index ``query_tok`` ``[B, 1]``) over
        the cache, at the newest rank; folds its attention into the EMA. Returns ``[B, H_kv, G, 1, d_v]``."""
        occupied = self._tok >= 0
        top = (occupied.sum(1, keepdim=True) - 1).clamp(min=0)  # the query's rank: its own key's, the largest
        logits = self._cache_logits(query, top).float() * scale  # [B, H_kv, G, 1, L]
        window = self._in_window(query_tok)
        if window is not None:
            occupied = occupied & window[:, 0]
        visible = occupied | ~real[:, None]  # a padding query (stored nowhere) reads anything finite
        probs = logits.masked_fill(~visible[:, None, None, None], float("-inf")).softmax(-1)
        batch, kv_heads, groups = probs.shape[:3]
        output = probs.to(self._kv.dtype).view(batch, kv_heads, groups, -1) @ self._v
        if self.policy.needs_scores:
            self._fold_scores(probs[:, :, :, 0], real)
        return output[:, :, :, None]

    def _fold_scores(self, probs: torch.Tensor, real: torch.Tensor | None) -> None:
        """EMA step ``mu <- gamma mu + (1 - gamma) rho(s)`` over the cascade slots (sinks have no score).
        ``probs`` is ``[B, H_kv, G, S + |C|]``."""
        gamma = self.policy.gamma
        cascade = self._score[:, self.sinks : self.capacity]
        if self.policy.config.reduction == "mean":  # the sum, with 1 / heads folded into the EMA weight
            received = probs[..., self.sinks :].flatten(1, 2).sum(1)
            weight = (1.0 - gamma) / (probs.shape[1] * probs.shape[2])
        else:
            received, weight = self.policy.reduce_heads(probs[..., self.sinks :]), 1.0 - gamma
        if real is None or self._all_real:
            cascade.mul_(gamma).add_(received, alpha=weight)
        else:
            cascade.copy_(torch.where(real[:, None], cascade * gamma + received * weight, cascade))

    def _chunk_attention(
        self, queries: torch.Tensor, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The later official strided prefill (not v1): the chunk attends to the frozen cache and causally to
        itself, the EMA advances in closed form, then the chunk is inserted token by token."""
        batch, kv_heads, groups, count, dim = queries.shape
        slots = self.capacity
        stored = (self._tok >= 0).sum(1)
        rank = stored[:, None] + (real.long().cumsum(1) - 1).clamp(min=0)  # [B, q]
        chunk_keys, values = kv[..., : self._key_dim], kv[..., self._key_dim :]
        chunk_queries = queries
        if self.inv_freq is not None:
            chunk_keys = rotate_by(chunk_keys, rank[:, None], self.inv_freq)
            chunk_queries = rotate_by(queries, rank[:, None, None], self.inv_freq)
        cache_logits = self._cache_logits(queries, rank)  # [B, H_kv, G, q, L]
        own_logits = chunk_queries.reshape(batch, kv_heads, groups * count, dim) @ chunk_keys.transpose(-1, -2)
        own_logits = own_logits.view(batch, kv_heads, groups, count, count)
        logits = torch.cat([cache_logits, own_logits], -1).float() * scale
        step = torch.arange(count, device=self.device)
        causal = (step[None, :] <= step[:, None])[None] & (real[:, None, :] | (step[None, :] == step[:, None]))
        stored = (self._tok >= 0)[:, None, :].expand(-1, count, -1)
        window = self._in_window(meta[:, :, 0])
        if window is not None:
            stored = stored & window
            causal = causal & (step[None, :] > step[:, None] - self._sliding_window)[None]
        visible = torch.cat([stored, causal], 2)  # [B, q, L + q]
        probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
        weights = probs.to(self._kv.dtype).reshape(batch, kv_heads, groups * count, slots + count)
        output = weights[..., :slots] @ self._v + weights[..., slots:] @ values
        scores = None
        if self.policy.needs_scores:
            gamma = self.policy.gamma
            received = self.policy.reduce_heads(probs)  # [B, q, L + q]
            later = real.sum(1, keepdim=True) - real.long().cumsum(1)  # real queries after query m
            weight = real * (1.0 - gamma) * gamma ** later.float()  # [B, q]
            decay = gamma ** real.sum(1).float()
            cascade = self._score[:, self.sinks : slots]
            into_cache = torch.einsum("bq,bql->bl", weight, received[:, :, self.sinks : slots])
            cascade.copy_(cascade * decay[:, None] + into_cache)
            scores = torch.einsum("bq,bqj->bj", weight, received[:, :, slots:])
        for m in range(count):
            score = None if scores is None else scores[:, m]
            self._insert(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m], score)
        return output.reshape(batch, kv_heads * groups, count, -1)

    def after_attention(self, stats: AttentionStats | None) -> None:
        """For callers that drive the layer by hand (tests, benchmarks): insert tokens that did not attend
        through ``cascade_attention``, then fold ``stats.received`` (``[B, H_kv, G, S + |C|]``) into the EMA."""
        if self._pending is not None:
            self._insert_pending()
        if stats is not None and stats.received is not None and self.policy.needs_scores:
            self._fold_scores(stats.received.float(), None)

    def apply(self, selection: Selection) -> None:
        raise NotImplementedError("a cascade layer evicts while inserting; it takes no Selection")

    # --- views in stream order (the CompressedLayer contract) ---------------------------------------------------
    def _order(self) -> torch.Tensor:
        return self._tok.argsort(dim=1, stable=True)  # empty slots (-1) first, then stream order

    def _view(self, slot_values: torch.Tensor) -> torch.Tensor:
        """A per-slot ``[B, S + |C|]`` tensor in stream order, expanded to ``[B, H_kv, S + |C|]``."""
        ordered = slot_values.gather(1, self._order())
        return ordered[:, None].expand(-1, self._kv.shape[1], -1)

    @property
    def keys(self) -> torch.Tensor | None:
        """Stored keys in stream order, rotated at ``rope_pos`` as the model wrote them (a copy)."""
        if self._kv is None:
            return None
        order = self._order()
        keys = self._k.gather(2, order[:, None, :, None].expand(-1, self._kv.shape[1], -1, self._key_dim))
        if self.inv_freq is None:
            return keys
        keys = rotate_by(keys, -order[:, None], self.inv_freq)  # stored at the slot index
        return rotate_by(keys, self._pos.gather(1, order)[:, None], self.inv_freq)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("CascadeLayer.keys is a read-only view of the slot buffer")
        self._kv = None

    @property
    def values(self) -> torch.Tensor | None:
        if self._kv is None:
            return None
        values = self._v
        return values.gather(2, self._order()[:, None, :, None].expand(-1, values.shape[1], -1, values.shape[-1]))

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("CascadeLayer.values is a read-only view of the slot buffer")
        self._kv = None

    @property
    def token_idx(self) -> torch.Tensor:
        """Stream indices in stream order; the ``E`` empty slots come first, numbered ``-E .. -1``."""
        ordered = self._tok.gather(1, self._order())
        empty = ordered < 0
        filler = torch.arange(ordered.shape[1], device=self.device) - empty.sum(1, keepdim=True)
        return torch.where(empty, filler, ordered)[:, None].expand(-1, self._kv.shape[1], -1)

    @property
    def valid(self) -> torch.Tensor:
        return self._view(self._tok >= 0)

    @property
    def rope_pos(self) -> torch.Tensor:
        return self._view(torch.where(self._tok >= 0, self._pos, torch.zeros_like(self._pos)))

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {"score": self._view(self._score[:, : self.capacity])}

    def cascade_tokens(self) -> list[list[list[int]]]:
        """Per sequence, per cascade: the stream indices it holds, oldest first (sinks not included)."""
        result = []
        for b in range(self._tok.shape[0]):
            rows = []
            for i in range(self.cascades):
                first, start, count = i * self.width + self.sinks, int(self._start[b, i]), int(self._count[b, i])
                ring = [first + (start + r) % self.width for r in range(count)]
                rows.append([int(self._tok[b, slot]) for slot in ring])
            result.append(rows)
        return result

    # --- transformers' layer API -----------------------------------------------------------------------------
    def stored_length(self) -> int:
        return self.capacity if self.is_initialized else 0

    def reset(self) -> None:
        self._kv = None
        self._pending = None
        self.is_initialized = False
        self.seen = self.new_tokens = 0

    _PER_SEQUENCE = ("_kv", "_meta", "_score", "_n_sink_t", "_n_real_t", "_count_t", "_start_t")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._leave_step()
        indices = indices.to(self.device)
        for name in self._PER_SEQUENCE:
            setattr(self, name, getattr(self, name).index_select(0, indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        self._leave_step()
        for name in self._PER_SEQUENCE:
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))

    # --- accounting ------------------------------------------------------------------------------------------
    def kv_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()  # scratch excluded

    def metadata_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        names = ("_meta", "_score", "_n_sink", "_n_real", "_count", "_start")
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)


class CircularSinkLayer(CascadeLayer):
    """``streaming`` (StreamingLLM, positions re-indexed in the cache) on the cascade storage with ``N = 1``: the
    sinks plus one ring of ``budget - sinks`` slots, allocated once, one slot written per token.

    ``streaming`` evicts *after* attending (a forward's tokens attend to the stored ones and causally to each
    other, then the oldest non-sink tokens beyond the budget go), while the cascade inserts each token before it
    attends. So this layer runs every forward, one token or many, the way the cascade's chunked prefill does:
    attend to the frozen ring and causally inside the forward, at ranks ``stored, stored + 1, ...``, then insert the
    tokens one by one (the ring keeps the sinks and the ``budget - sinks`` newest). That is the generic
    ``streaming`` layer's attention set, order and positions (``tests/methods/test_cascade.py`` checks logits and
    stored tokens against it); only the float rounding differs. The policy the cache built is replaced by a
    ``CascadePolicy`` of ``CascadeConfig(budget, sinks, cascades=1)``; scores are never computed.
    """

    def __init__(self, policy, inv_freq: torch.Tensor | None = None) -> None:
        from kvcompress.methods.cascade import CascadeConfig

        config = policy.config
        circular = CascadeConfig(budget=config.budget, sinks=config.sinks, cascades=1, prefill="chunked")
        inner = circular.policy(policy.layer_idx)
        inner.attend_first = True
        super().__init__(inner, inv_freq)
        self.method_config = config  # the streaming config this layer runs
