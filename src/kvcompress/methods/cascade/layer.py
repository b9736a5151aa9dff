"""The Cascading KV Cache's storage: sinks and ``N`` circular sub-caches in one buffer allocated once.

See ``kvcompress.methods.cascade.config`` for the method, the paper and the choices. Insertion lives here (its
per-sequence tensor path in ``ring_insert``); the attention over the rings is in ``ring_attention`` and the
stream-order views in ``ring_views``.

Slot layout of one layer (per sequence; every KV head uses the same slots, homogeneous policy):
``[0, S)`` sinks, then cascade ``i`` in ``[S + i W, S + (i + 1) W)``, a ring whose oldest token sits at offset
``start[i]`` and which holds ``count[i]`` tokens. Beside the keys and values, per slot: the token's stream index
(``-1`` = empty), the RoPE position the model gave it, and its attention EMA (fp32). Per sequence: sinks stored,
real tokens seen (the clock), and ``start``/``count`` per cascade. One insertion moves at most one token per
cascade: the moves of all cascades are decided from the counters first, then done with one gather and one
scatter per tensor (no loop over cascades, sequences or heads).

Keys are stored rotated at an *angle* from which attention finds their rank with few rotations: the model's rotation
is undone with the exact cosines and sines it used, and the key is rotated to its angle.

- Several cascades: the angle is the slot index. Inside one cascade rank = slot + shift, plus the ring width for
  the slots before the ring's start, so a query is rotated once per such frame (``RingAttention._cache_logits``)
  and a token moving between cascades is re-rotated by the slot difference (a small table). While a batch decodes
  in step the rings hold ring angles instead (``ring_angles``: one frame per ring), turned back to slot angles
  before any other path reads them.
- One ring (``N = 1``, the circular sink cache): a single frame. A ring token's angle is its index among the
  sequence's real tokens, and with ``F`` = ring tokens overwritten so far, its rank is its angle minus ``F``; the
  sinks are kept at angle ``j + F`` (rewritten from a copy at ``j`` whenever ``F`` changes, ``_sync_sinks``: one
  rotation each time, no accumulated rounding). Every stored key then has angle rank + ``F``, so a query rotated
  to its own rank + ``F`` attends to the whole buffer at once (one SDPA while decoding), and a new token is written
  once, at its real-token index, never re-rotated. Angles grow with the stream, so they are computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.contract import Policy
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.rope import rotate_by, turn_in_place
from kvcompress.core.rotation import frame_rotation
from kvcompress.methods.cascade.policy import CascadePolicy
from kvcompress.methods.cascade.ring_angles import RingAngles
from kvcompress.methods.cascade.ring_attention import RingAttention
from kvcompress.methods.cascade.ring_capacity import RingCapacity
from kvcompress.methods.cascade.ring_chunk_insert import RingChunkInsert
from kvcompress.methods.cascade.ring_decode import RingDecode
from kvcompress.methods.cascade.ring_exact import RingExact
from kvcompress.methods.cascade.ring_insert import RingInsert
from kvcompress.methods.cascade.ring_views import RingViews

_MAX_PERIOD = 1 << 62  # acceptance periods beyond this are never reached (no overflow for large base^i)


@dataclass
class _Pending:
    """Tokens handed to ``update`` and not inserted yet (they are inserted when they attend)."""

    keys: torch.Tensor  # [B, H_kv, q, d] as the model gave them (rotated at ``pos``)
    values: torch.Tensor  # [B, H_kv, q, d]
    first: int  # stream index of the first token (padding included)
    pos: torch.Tensor | None = None  # [B, q] RoPE positions; None = the stream indices
    real: torch.Tensor | None = None  # [B, q] bool; None = every token is real
    source: torch.Tensor | None = None  # the model's ``position_ids`` ``[B or 1, q]`` (None: not given as such)

    @property
    def tok(self) -> torch.Tensor:
        """``[q]`` stream indices (built when asked: a decoding step of one ring never needs them)."""
        return torch.arange(self.first, self.first + self.keys.shape[2], device=self.keys.device)


class CascadeLayer(
    RingExact,
    RingDecode,
    RingAngles,
    RingInsert,
    RingChunkInsert,
    RingAttention,
    RingViews,
    RingCapacity,
    CompressedLayer,
):
    """One layer of a Cascading KV Cache. ``rule``: the ``CascadePolicy`` driving the storage (the layer's policy
    unless another method runs on this storage, as ``streaming`` does); ``attend_first``: attend, then insert."""

    attend_first = False

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None, rule: CascadePolicy | None = None) -> None:
        self._kv: torch.Tensor | None = None
        # the cascade layers of this layer's cache (``CascadeConfig.connect``), whose old tokens the first of a
        # decoding step moves for all (``ring_moves``); None: this layer moves its own
        self.ring_layers: list | None = None
        super().__init__(policy, inv_freq)
        self.rule: CascadePolicy = rule or policy
        config = self.rule.config
        self.sinks, self.cascades, self.width = config.sinks, config.cascades, config.width
        self.full_capacity = config.used_budget  # slots at the budget
        self.capacity = self.full_capacity  # slots allocated; one ring starts smaller and grows (``_grow``)
        self._pending: _Pending | None = None
        self._all_real = True
        self.force_tensor_path = False  # tests: always take the per-sequence tensor path of ``_insert``

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, count, key_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.cascades == 1:
            self._set_capacity(min(self.full_capacity, max(self.sinks + 1, count)))
        slots, cascades = self.capacity, self.cascades
        long = {"dtype": torch.long, "device": self.device}
        self._key_dim = key_dim
        # keys (rotated at their slot index) and values side by side; slot ``slots`` is scratch space; per slot: the
        # stream index of the token (-1 = empty) and the RoPE position the model gave it; the attention EMA (fp32)
        kv_shape = (batch, heads, slots + 1, key_dim + value_states.shape[-1])
        self._kv = key_states.new_zeros(kv_shape)
        self._meta = torch.stack(
            [torch.full((batch, slots + 1), -1, **long), torch.zeros(batch, slots + 1, **long)], -1
        )
        self._score = torch.zeros(batch, slots + 1, dtype=torch.float32, device=self.device)
        # tensor path only (see _in_step below): sinks stored, real tokens seen (the acceptance clock), per cascade
        # the ring's start and count, and two flags: every sequence has all its sinks (then the sink column is
        # skipped), eager fill is over for every sequence
        self._sinks_full = self.sinks == 0
        self._filled = not self.rule.config.eager_fill
        base = self.rule.config.base
        self._period = torch.tensor([min(base**i, _MAX_PERIOD) for i in range(cascades)], **long)
        self._sink_slots = torch.arange(self.sinks, **long)
        # one ring: the sinks' keys at angle j (their own index), and the frame F they were last written at (a
        # Python integer while the batch is in step, then per sequence)
        self._sink_keys = key_states.new_zeros(batch, heads, self.sinks, key_dim)
        self._sink_frame = 0
        self._build_tables()
        # "in step": every sequence has taken the same number of real tokens so far (no padding yet). Then the
        # counters are the same for the whole batch (only selection outcomes differ), so they are kept as Python
        # integers and every move is a slice of the buffer; the first padded forward switches to the tensor path
        self._in_step = True
        self._py_count, self._py_start, self._py_seen = [0] * cascades, [0] * cascades, 0
        self._py_tensors: tuple[torch.Tensor, ...] | None = None
        self._laps = None  # keys at slot angles (``RingAngles``)
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
        self.to_slot_angles()
        if self._in_step:
            count, start, n_sink, n_real = (t.clone() for t in self._counters())
            self._in_step = False
            self._count_t, self._start_t, self._n_sink_t, self._n_real_t = count, start, n_sink, n_real
            self._sink_frame = torch.full_like(n_real, self._sink_frame)  # per sequence from now on
            self._sinks_full = self.sinks == 0 or self._py_seen >= self.sinks
            self._filled = not self.rule.config.eager_fill or self._py_seen >= self.full_capacity

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
        count = key_states.shape[2]
        self._grow(self.seen + count)  # an upper bound of any sequence's stored tokens after this forward
        if self._pending is not None:  # the previous forward never attended: insert those tokens now
            self._insert_pending()
        self._pending = _Pending(key_states, value_states, self.seen)
        self.seen += count
        self.new_tokens = count
        returned = getattr(self, "_returned", None)
        if returned is None or returned[0] is not self._kv or returned[1] != self.capacity:
            keys = self._k
            setattr(keys, LAYER_ATTRIBUTE, self)
            returned = self._returned = (self._kv, self.capacity, keys, self._v)
        return returned[2], returned[3]

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        pending, count = self._pending, self.new_tokens
        if pending is None:
            return
        batch = self._kv.shape[0]
        if position_ids is not None:
            positions = position_ids if position_ids.shape[-1] == count else position_ids[..., -count:]
            if positions.dim() == 3:  # multimodal RoPE sections: the text positions are the first
                positions = positions[0]
            if positions.device != self.device or positions.dtype != torch.long:
                positions = positions.to(self.device, torch.long)
            pending.pos = positions.expand(batch, -1)
            pending.source = position_ids if position_ids.dim() == 2 else None
        if padding is not None:
            pending.real = padding[:, -count:].to(self.device, torch.bool)

    def _prepared(self, pending: _Pending) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending tokens as slot items: ``kv`` ``[B, H, q, dk + dv]`` with un-rotated keys, ``meta``
        ``[B, q, 2]``, RoPE positions ``[B, q]`` and the real-token mask ``[B, q]``."""
        batch, count = self._kv.shape[0], pending.keys.shape[2]
        tok = pending.tok.expand(batch, -1)
        pos = tok if pending.pos is None else pending.pos
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
            half = self.inv_freq.shape[-1]  # partial rotary: dimensions past 2 * half pass through
            first, second, rest = keys[..., :half], keys[..., half : 2 * half], keys[..., 2 * half :]
            kv = torch.cat([first * cos + second * sin, second * cos - first * sin, rest, values], -1)
        if self.cascades == 1 and self.inv_freq is not None:  # one frame: each key at its real-token index
            angle = self._n_real[:, None] + real.long().cumsum(1) - real.long()
            keys = rotate_by(kv[..., : self._key_dim], angle[:, None], self.inv_freq, exact=True)
            kv = torch.cat([keys, kv[..., self._key_dim :]], -1)
        meta = torch.stack([tok, pos], -1)
        return kv, meta, pos, real

    def _insert_pending(self, scores: torch.Tensor | None = None) -> None:
        pending, self._pending = self._pending, None
        kv, meta, _, real = self._prepared(pending)
        for m in range(kv.shape[2]):
            score = None if scores is None else scores[:, m]
            self._insert(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m], score)
        self._sync_sinks()

    def _insert(self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None) -> None:
        self.to_slot_angles()
        if self._in_step and self._all_real and not self.force_tensor_path:
            self._insert_in_step(kv, meta, score)
        else:
            self._insert_tensors(kv, meta, real, score)

    # --- the single frame of one ring (N = 1) -------------------------------------------------------------------
    def _py_frame(self) -> int:
        """``F`` while the batch is in step: ring tokens overwritten so far (every real token after the sinks
        enters the ring)."""
        return max(0, self._py_seen - self.sinks) - self._py_count[0]

    def _frame(self) -> torch.Tensor:
        """``F`` per sequence ``[B]``."""
        return (self._n_real - self.sinks).clamp(min=0) - self._count[:, 0]

    def _sync_sinks(self) -> None:
        """One ring: rewrite the sinks' keys at angle ``j + F`` from their copy at angle ``j`` (once per change of
        ``F``; the rotation shared by the layers of a forward)."""
        if self.cascades != 1 or not self.sinks or self.inv_freq is None:
            return
        sinks = self._kv[:, :, : self.sinks, : self._key_dim]
        if self._in_step:
            frame = self._py_frame()
            if frame == self._sink_frame:
                return
            if self._sink_frame == 0:  # until the ring first overwrites, the stored sinks are at angle j
                self._sink_keys.copy_(sinks)
            self._sink_frame = frame
            rotation = frame_rotation(self.forward_pass, frame, self.inv_freq, self._key_dim, self.dtype)
            sinks.copy_(self._sink_keys @ rotation)
            return
        frame = self._frame()
        own = (self._sink_frame == 0)[:, None, None, None]  # these sequences' stored sinks are still at angle j
        self._sink_keys = torch.where(own, sinks, self._sink_keys)
        sinks.copy_(rotate_by(self._sink_keys, frame[:, None, None], self.inv_freq, exact=True))
        self._sink_frame = frame

    def _turn(self, rows: torch.Tensor, delta: int) -> None:
        """Rotate the keys of ``rows`` (``[..., dk + dv]`` slot items) in place by ``delta`` positions."""
        if self.inv_freq is not None and delta != 0:
            turn_in_place(rows, self._turn_cos[delta + self.capacity], self._turn_sin[delta + self.capacity])

    def _insert_in_step(self, kv: torch.Tensor, meta: torch.Tensor, score: torch.Tensor | None, placed=False) -> None:
        """``_insert`` while every sequence is in step: Algorithm 1 on Python integers (the same schedule for
        the whole batch, ``_plan_in_step``), then the moves as slices of the buffer, every token read before its
        slot is overwritten. Only a selection (d) depends on the sequence: there the arriving token is written where
        it wins. ``placed``: the new key is rotated at
        its destination already (else, with several cascades, it arrives un-rotated)."""
        moves = self._plan_in_step()
        if len(moves) > 1:
            self._move_together(moves, kv, meta, score, placed)
            return
        dest, select = moves[0]
        self._put(dest, None, kv, meta, score, select, placed)

    def _plan_in_step(self) -> list[tuple[int, bool]]:
        """Advance the Python counters by one real token and return its moves: ``(destination slot, selection?)``
        per cascade the token reaches (column ``c > 0`` takes the token evicted by column ``c - 1``; one column:
        a sink, an append, an eager add or a selection)."""
        sinks, width, p = self.sinks, self.width, self._py_seen
        self._py_seen, self._py_tensors = p + 1, None
        if p < sinks:  # sinks fill first
            return [(p, False)]
        count, start, config = self._py_count, self._py_start, self.rule.config
        eager = config.eager_fill and p < self.full_capacity
        moves: list[tuple[int, bool]] = []
        for i in range(self.cascades):
            first = sinks + i * width
            if eager or (p - sinks) % config.base**i == 0:
                if count[i] < width:  # (a) append
                    moves.append((first + (start[i] + count[i]) % width, False))
                    count[i] += 1
                    break
                moves.append((first + start[i], False))  # (b) overwrite the oldest, carry it on
                start[i] = (start[i] + 1) % width
                if start[i] == 0 and self._laps is not None:  # a lap of ring angles (``RingAngles``)
                    self._laps[i] += width
            elif count[i] == 0:  # (c) eager add into an empty cascade
                moves.append((first + start[i], False))
                count[i] = 1
                break
            else:  # (d) selection against the newest token
                moves.append((first + (start[i] + count[i] - 1) % width, self.rule.needs_scores))
                break
        return moves

    def _put(self, dest: int, source: int | None, kv, meta, score, select: bool = False, placed: bool = False) -> None:
        """Write the new token (``source=None``) or the token at slot ``source`` into slot ``dest`` (its key
        rotated at ``dest``, unless ``placed`` says the new key is there already); with ``select``, only in the
        sequences where its score beats the resident's (tie rule of the config)."""
        turn_new = 0 if placed or self.cascades == 1 else dest  # one ring: the new key is at its angle already
        buffer, scores = self._kv, self._score
        if select:  # only the sequences where the arriving token wins write it (a where: no host read)
            arriving = scores[:, source] if source is not None else self._new_score(score)
            resident = scores[:, dest]
            wins = arriving >= resident if self.rule.config.tie == "incoming" else arriving > resident
            items, moved_meta = (
                (kv[:, :, 0], meta[:, 0]) if source is None else (buffer[:, :, source], self._meta[:, source])
            )
            items = items.clone()
            self._turn(items, turn_new if source is None else dest - source)
            buffer[:, :, dest] = torch.where(wins[:, None, None], items, buffer[:, :, dest])
            self._meta[:, dest] = torch.where(wins[:, None], moved_meta, self._meta[:, dest])
            scores[:, dest] = torch.where(wins, arriving, resident)
            return
        rows = buffer[:, :, dest]
        if source is None:
            rows.copy_(kv[:, :, 0])
            self._turn(rows, turn_new)
            self._meta[:, dest] = meta[:, 0]
            if self.rule.needs_scores:
                scores[:, dest] = 0.0 if score is None else score
        else:
            rows.copy_(buffer[:, :, source])
            self._turn(rows, dest - source)
            self._meta[:, dest] = self._meta[:, source]
            if self.rule.needs_scores:
                scores[:, dest] = scores[:, source]

    def _new_score(self, score: torch.Tensor | None) -> torch.Tensor:
        return self._score.new_zeros(self._score.shape[0]) if score is None else score.float()
