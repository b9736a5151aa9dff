"""The Cascading KV Cache's storage: sinks and ``N`` circular sub-caches in one buffer.

See ``kvcompress.methods.cascade.config`` for the method, the paper and the choices. The layer has three parts: the
schedule (``schedule``: Algorithm 1 on Python integers, each sequence's layout ``Rings`` and a token's slot moves),
the executor (``executor.apply_moves``: a step's moves on every sequence, head and tensor at once) and the
attention over the rings (``ring_attention``; the decoding step planned from the schedule, ``ring_decode``; the
exact prefill's steps, ``ring_exact``). The stream-order views are in ``ring_views``.

Slot layout of one layer (per sequence; every KV head uses the same slots, homogeneous policy): ``[0, S)`` sinks,
then cascade ``i`` in ``[S + i W, S + (i + 1) W)``, a ring whose oldest token sits at offset ``start[i]`` and which
holds ``count[i]`` tokens (``schedule.Rings``). Beside the keys and values, per slot: the token's stream index
(``-1`` = empty), the RoPE position the model gave it, and its attention EMA (fp32). The layout is a function of the
sequence's real-token count only, so while the batch has no padding it is one ``Rings`` for every sequence (the
batch "in step"); after padding (or a reordered batch) the schedule runs once per sequence.

Keys are stored rotated at one *angle* convention (``schedule.angles``): the model's rotation is undone with the
exact cosines and sines it used, and the key is rotated to its ring's running index (the ``k``-th token ever
written to ring ``i`` at ``S + i W + k``), so inside a ring rank - angle is one number (``schedule.offsets``) and a
query attends to a ring's keys with one rotation; a key is turned only when it moves to another ring. The sinks are
kept at ``j + sink_shift`` (the oldest ring's frame), rewritten from a copy at angle ``j`` whenever that shift moves
(no accumulated rounding). With one ring a ring token's angle is its index among the sequence's real tokens, so the
whole buffer is one frame. Angles grow with the stream, so rotations by them are computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.contract import Policy
from kvcompress.core.forward import from_host
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import frame_rotation
from kvcompress.methods.cascade.executor import apply_moves
from kvcompress.methods.cascade.policy import CascadePolicy
from kvcompress.methods.cascade.ring_attention import RingAttention
from kvcompress.methods.cascade.ring_capacity import RingCapacity
from kvcompress.methods.cascade.ring_chunk_insert import RingChunkInsert
from kvcompress.methods.cascade.ring_decode import RingDecode
from kvcompress.methods.cascade.ring_exact import RingExact
from kvcompress.methods.cascade.ring_views import RingViews
from kvcompress.methods.cascade.schedule import Layout, Rings, advance, angles, offsets, sink_shift
from kvcompress.methods.cascade.schedule import turns as schedule_turns


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
        eager_until = self.full_capacity if config.eager_fill else 0
        self._layout = Layout(self.sinks, self.width, self.cascades, config.base, eager_until)
        self._pending: _Pending | None = None
        self._all_real = True
        self.force_tensor_path = False  # tests: always take the per-sequence tensor path of ``_insert``

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, count, key_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.cascades == 1:
            self._set_capacity(min(self.full_capacity, max(self.sinks + 1, count)))
        slots = self.capacity
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
        self._sink_slots = torch.arange(self.sinks, **long)
        # the sinks' keys at angle j (their own index), copied as they are stored: the sinks are rewritten from it
        # whenever their angle moves (no accumulated rounding); ``_sinks_full``: every sequence has all its sinks
        self._sink_keys = key_states.new_zeros(batch, heads, self.sinks, key_dim)
        self._sinks_full = self.sinks == 0
        self._build_tables()
        # the layout of each sequence (``schedule.Rings``: Python integers). "In step": one schedule for the whole
        # batch (every sequence has taken the same number of real tokens: no padding so far), every entry the same
        # object; the first padded forward (or a reordered batch) runs the schedule once per sequence from then on
        self._in_step = True
        self._rings: list[Rings] = [Rings.empty(self._layout)] * batch
        self._counter_tensors: tuple | None = None
        self.is_initialized = True

    # the counters: Python integers per sequence (``_rings``); as tensors for the per-slot views
    @property
    def _shared(self) -> Rings:
        """The layout of every sequence while the batch is in step."""
        return self._rings[0]

    def _set_shared(self, rings: Rings) -> None:
        self._rings = [rings] * len(self._rings)

    def _counters(self) -> tuple[torch.Tensor, ...]:
        """``count``, ``start`` and ``passed`` ``[B, N]``, sinks stored and real tokens seen ``[B]`` and each
        frame's rank minus angle ``[B, 1 + N]`` (``schedule``; made when the layouts change, from one row while in
        step)."""
        cached = self._counter_tensors
        if cached is None or cached[0] is not self._rings:
            layout, rows = self._layout, self._rings[:1] if self._in_step else self._rings
            values = [
                [*r.count, *r.start, *r.passed, min(r.seen, self.sinks), r.seen, *offsets(layout, r)] for r in rows
            ]
            table = from_host(values, self.device).expand(len(self._rings), -1)
            n = self.cascades
            parts = table[:, :n], table[:, n : 2 * n], table[:, 2 * n : 3 * n], table[:, 3 * n], table[:, 3 * n + 1]
            cached = self._counter_tensors = (self._rings, *parts, table[:, 3 * n + 2 :])
        return cached[1:]

    def _angles(self) -> torch.Tensor:
        """Each slot's key angle ``[B, slots]`` (``schedule.angles``; for the stream-order views and a chunk's
        attention, not per token)."""
        rows = self._rings[:1] if self._in_step else self._rings
        values = [angles(self._layout, rings)[: self.capacity] for rings in rows]
        return from_host(values, self.device).expand(len(self._rings), -1)

    _count = property(lambda self: self._counters()[0])
    _start = property(lambda self: self._counters()[1])
    _n_sink = property(lambda self: self._counters()[3])
    _n_real = property(lambda self: self._counters()[4])

    def _frame(self) -> torch.Tensor:
        """Per sequence ``[B]``, the tokens the first ring overwrote (with one ring: the frame ``F``, real tokens
        past the ring's width)."""
        return self._counters()[2][:, 0]

    def _leave_step(self) -> None:
        """Run the schedule once per sequence from now on (the batch is no longer in step)."""
        if self._in_step:
            self._in_step = False
            self._rings = list(self._rings)

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
        meta = torch.stack([tok, pos], -1)
        return kv, meta, pos, real

    def _insert_pending(self, scores: torch.Tensor | None = None) -> None:
        pending, self._pending = self._pending, None
        kv, meta, _, real = self._prepared(pending)
        for m in range(kv.shape[2]):
            score = None if scores is None else scores[:, m]
            self._insert(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m], score)

    def _insert(self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None) -> None:
        """Insert one token per sequence (``kv`` ``[B, H_kv, 1, dk + dv]``, the key un-rotated; ``meta``
        ``[B, 1, 2]``; ``real`` ``[B]``, False: padding, nothing happens; ``score`` ``[B]`` its initial EMA, None:
        0): the schedule once for the batch while it is in step, else once per sequence."""
        before = self._rings
        if self._in_step and self._all_real and not self.force_tensor_path:
            moves, turns = self._plan_in_step()
            self._move_together(moves, kv, meta, score, turns)
        else:
            self._insert_each(kv, meta, real, score)
        self._sync_sinks(before)

    def _insert_each(self, kv: torch.Tensor, meta: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None):
        """``_insert`` with the schedule run once per sequence (``real`` read on the host: one read per token of a
        padded forward), the moves of every sequence applied together, columns a sequence does not use pointing at
        the scratch slot."""
        self._leave_step()
        layout, rings, steps = self._layout, list(self._rings), []
        for row, is_real in enumerate(real.tolist()):
            if is_real:
                after, moves = advance(layout, rings[row])
                steps.append((moves, schedule_turns(layout, rings[row], after, moves)))
                rings[row] = after
            else:
                steps.append(None)
        self._rings = rings
        columns = max((len(step[0].dests) for step in steps if step is not None), default=0)
        if not columns:
            return  # padding only
        scratch, select_on = self.capacity, self.rule.needs_scores
        read, written, turns, select = [], [], [], []
        for step in steps:
            dests, turned, chosen = (step[0].dests, step[1], step[0].select) if step else ((), (), False)
            pad = columns - len(dests)
            written.append([*dests, *[scratch] * pad])
            read.append([*dests[:-1], *[scratch] * (pad if dests else pad - 1)])
            turns.append([*turned, *[0] * pad])
            select.append([False] * (len(dests) - 1) + [chosen and select_on] * bool(dests) + [False] * pad)
        turn = None if self.inv_freq is None else self._turn_table(from_host(turns, self.device)[:, None])
        buffers = (self._kv, self._meta, self._score if select_on else None)
        new = (kv, meta, self._new_score(score) if select_on else None)
        read_t, written_t = from_host(read, self.device), from_host(written, self.device)
        select_t = from_host(select, self.device, torch.bool)
        apply_moves(buffers, read_t, written_t, turn, select_t, self.rule.config.tie, new)

    def _turn_table(self, turns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[..., d / 2]`` of whole-number turns ``[...]`` (angles grow with the stream: float64)."""
        angles = turns.to(torch.float64)[..., None] * self.inv_freq.to(self.device, torch.float64)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    # --- the sinks, in the oldest ring's frame --------------------------------------------------------------------
    def _sync_sinks(self, before: list[Rings]) -> None:
        """After an insertion from the layouts ``before``: copy the sinks just stored to ``_sink_keys`` at angle
        ``j`` and rewrite the sinks from that copy where their angle moved (the oldest ring overwrote a token).
        A sink is stored at ``j`` + the shift of a layout with empty rings (the rings stay empty until the sinks
        are full); the paths that store many tokens at once store their sinks there too."""
        if not self.sinks or self.inv_freq is None:
            return
        layout, after, filled = self._layout, self._rings, self._sinks_full
        fill = (self.cascades - 1) * layout.width  # ``sink_shift`` of empty rings
        if self._in_step:
            old, new = sink_shift(layout, before[0]) if filled else fill, sink_shift(layout, after[0])
            if not filled:
                rotation = frame_rotation(self.forward_pass, -fill, self.inv_freq, self._key_dim, self.dtype)
                self._sink_keys = self._kv[:, :, : self.sinks, : self._key_dim] @ rotation
                self._sinks_full = after[0].seen >= self.sinks
            if new != old:
                self._place_sinks(new)
            return
        sinks = self._kv[:, :, : self.sinks, : self._key_dim]
        old = [sink_shift(layout, rings) if rings.seen >= self.sinks else fill for rings in before]
        new = [sink_shift(layout, rings) for rings in after]
        if not filled:
            filling = from_host([rings.seen < self.sinks for rings in before], self.device, torch.bool)
            copy = rotate_by(sinks, torch.full_like(self._sink_slots, -fill), self.inv_freq, exact=True)
            self._sink_keys = torch.where(filling[:, None, None, None], copy, self._sink_keys)
            self._sinks_full = all(rings.seen >= self.sinks for rings in after)
        if new != old:
            moved = from_host([a != b for a, b in zip(old, new, strict=True)], self.device, torch.bool)
            shift = from_host(new, self.device)[:, None, None].expand(-1, 1, self.sinks)
            placed = rotate_by(self._sink_keys, shift, self.inv_freq, exact=True)
            sinks.copy_(torch.where(moved[:, None, None, None], placed, sinks))

    def _place_sinks(self, shift: int) -> None:
        """Write the sinks' keys at angle ``j + shift`` from their copy at angle ``j`` (a batch in step; the
        rotation shared by the layers of a forward)."""
        rotation = frame_rotation(self.forward_pass, shift, self.inv_freq, self._key_dim, self.dtype)
        self._kv[:, :, : self.sinks, : self._key_dim] = self._sink_keys @ rotation

    def _plan_in_step(self) -> tuple[list[tuple[int, bool]], tuple[int, ...]]:
        """Advance the batch's layout by one real token (``schedule.advance``): its moves as ``(slot,
        selection?)`` per column (a selection only where scores are kept) and each column's turn."""
        before = self._shared
        after, moves = advance(self._layout, before)
        self._set_shared(after)
        select = moves.select and self.rule.needs_scores
        columns = [(dest, False) for dest in moves.dests[:-1]] + [(moves.dests[-1], select)]
        return columns, schedule_turns(self._layout, before, after, moves)

    def _new_score(self, score: torch.Tensor | None) -> torch.Tensor:
        return self._score.new_zeros(self._score.shape[0]) if score is None else score.float()
