"""The Cascading KV Cache's storage (the method and its choices: ``config``): sinks and ``N`` rings in one buffer.

Tokens enter the rings by the schedule's moves (``schedule``, one ``Rings`` layout per sequence) applied by the
executor. While the batch has no padding it is "in step" (one layout for all) and a forward's tokens that attend in
turn are planned once for every layer (``ring_decode``); other forwards insert (``_insert_tokens``) and attend
(``_attention``) here. Per slot, beside key and value: stream index (``-1``: empty), RoPE position, EMA (fp32).

Keys are stored at the schedule's angles: the model's rotation undone with the very cosines and sines it used, a key
turned only when it changes ring. The sinks, in the oldest ring's frame, are rewritten from a copy at angle ``j``
whenever that frame moves (no accumulated rounding). Angles grow with the stream: rotations by them in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from kvcompress.core.contract import AttentionStats, Policy
from kvcompress.core.forward import from_host
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import frame_rotation, frame_rotation_at
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.slots import StreamView
from kvcompress.methods.cascade import schedule
from kvcompress.methods.cascade.executor import Columns, Executor, arrival_wins
from kvcompress.methods.cascade.policy import CascadePolicy
from kvcompress.methods.cascade.ring_decode import STACKED, RingDecode


@dataclass
class _Pending:
    """Tokens handed to ``update``, inserted when they attend."""

    keys: torch.Tensor  # [B, H_kv, q, d] as the model gave them (rotated at ``pos``)
    values: torch.Tensor  # [B, H_kv, q, d]
    first: int  # stream index of the first token (padding included)
    pos: torch.Tensor | None = None  # [B, q] RoPE positions; None = the stream indices
    real: torch.Tensor | None = None  # [B, q] bool; None = every token is real
    source: torch.Tensor | None = None  # the model's ``position_ids`` ``[B or 1, q]`` (None: not given as such)

    tok = property(lambda self: torch.arange(self.first, self.first + self.keys.shape[2], device=self.keys.device))


class CascadeLayer(RingDecode, CompressedLayer):
    """``rule``: the ``CascadePolicy`` driving the storage (the layer's policy unless another method runs on it, as
    ``streaming`` does); ``attend_first``: attend, then insert."""

    attend_first = False

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None, rule: CascadePolicy | None = None) -> None:
        self._kv: torch.Tensor | None = None
        self.ring_layers: list | None = None  # the cache's cascade layers (``CascadeConfig.connect``, ``ring_decode``)
        super().__init__(policy, inv_freq)
        self.rule: CascadePolicy = rule or policy
        config = self.rule.config
        self.sinks, self.cascades, self.width = config.sinks, config.cascades, config.width
        self.full_capacity = self.capacity = config.used_budget  # one ring starts smaller and grows (``_grow``)
        eager = self.full_capacity if config.eager_fill else 0  # (every ring accepts below: ``eager_fill``)
        self._layout = schedule.Layout(self.sinks, self.width, self.cascades, config.base, eager)
        self._pending: _Pending | None = None
        self._forward_unpadded = True
        self._fold: tuple | None = None  # ``_fold_scores``'s row of ones and the scores' view

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, count, key_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.cascades == 1:
            self._set_capacity(min(self.full_capacity, max(self.sinks + 1, count)))
        slots, self._key_dim = self.capacity, key_dim
        # keys and values side by side, then one scratch slot; per slot (stream index, RoPE position) and the EMA
        self._kv = key_states.new_zeros(batch, heads, slots + 1, key_dim + value_states.shape[-1])
        self._meta = torch.full((batch, slots + 1, 2), -1, dtype=torch.long, device=self.device)
        self._score = torch.zeros(batch, slots + 1, dtype=torch.float32, device=self.device)
        self._sink_keys = key_states.new_zeros(batch, heads, self.sinks, key_dim)  # at angle j: the sinks' copy
        self._in_step = True
        self._rings: list[schedule.Rings] = [schedule.Rings.empty(self._layout)] * batch
        self.is_initialized = True

    _shared = property(lambda self: self._rings[0])  # the layout of every sequence while the batch is in step

    def _set_shared(self, rings: schedule.Rings) -> None:
        self._rings = [rings] * len(self._rings)

    def _rows(self) -> list[schedule.Rings]:
        return self._rings[:1] if self._in_step else self._rings

    _k = property(lambda self: self._kv[:, :, : self.capacity, : self._key_dim])  # keys at their angles
    _v = property(lambda self: self._kv[:, :, : self.capacity, self._key_dim :])
    _tok = property(lambda self: self._meta[:, : self.capacity, 0])
    _pos = property(lambda self: self._meta[:, : self.capacity, 1])

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the new tokens (inserted when they attend, as in the paper); returns the slots in slot order."""
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
        if position_ids is not None:
            positions = position_ids if position_ids.shape[-1] == count else position_ids[..., -count:]
            if positions.dim() == 3:  # multimodal RoPE sections: the text positions are the first
                positions = positions[0]
            if positions.device != self.device or positions.dtype != torch.long:
                positions = positions.to(self.device, torch.long)
            pending.pos = positions.expand(self._kv.shape[0], -1)
            pending.source = position_ids if position_ids.dim() == 2 else None
        if padding is not None:
            pending.real = padding[:, -count:].to(self.device, torch.bool)

    def _prepared(self, pending: _Pending) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending tokens as slot items: ``kv`` ``[B, H, q, dk + dv]`` (keys un-rotated), ``meta`` ``[B, q, 2]``,
        positions and real-token mask ``[B, q]``."""
        batch, count = self._kv.shape[0], pending.keys.shape[2]
        tok = pending.tok.expand(batch, -1)
        pos = tok if pending.pos is None else pending.pos
        real = pending.real
        self._forward_unpadded = real is None or bool(real.all())  # no padding in this forward
        if real is None:
            real = torch.ones(batch, count, dtype=torch.bool, device=self.device)
        keys, values = pending.keys, pending.values.to(pending.keys.dtype)
        if self.inv_freq is not None:  # undo the model's rotation with the very angles it used (float32)
            keys = rotate_by(keys, -pos[:, None], self.inv_freq)
        return torch.cat([keys, values], -1), torch.stack([tok, pos], -1), pos, real

    def _insert_pending(self) -> None:
        pending, self._pending = self._pending, None
        kv, meta, _, real = self._prepared(pending)
        self._insert_tokens(kv, meta, real, None)

    def _set_capacity(self, slots: int) -> None:
        """Slots allocated; one ring's width follows them while it grows (the layout keeps the budget's)."""
        self.capacity = slots
        self.width = (slots - self.sinks) // self.cascades

    def _grow(self, needed: int) -> None:
        """One ring (``N = 1``) is allocated for the tokens seen (before its first wrap it holds them in order from
        its first slot: growing copies them, by a quarter at least, up to the budget); several are allocated whole."""
        if self.cascades != 1 or self.capacity >= self.full_capacity or needed <= self.capacity:
            return
        used = self.capacity
        self._set_capacity(min(self.full_capacity, max(needed, used + max(used // 4, 16))))
        pad = (0, 0, 0, self.capacity + 1 - used)  # (the last slot is scratch space)
        self._kv = torch.nn.functional.pad(self._kv[:, :, :used], pad)
        self._meta = torch.nn.functional.pad(self._meta[:, :used], pad, value=-1)
        self._score = torch.nn.functional.pad(self._score[:, :used], pad[2:])

    # --- tokens into the rings: the schedule's moves, applied by the executor ------------------------------------
    def _insert_tokens(self, kv, meta, real, scores: torch.Tensor | None) -> None:
        """Insert ``q`` tokens with no attention between them, as ``q`` one-token insertions would (``kv`` ``[B, H_kv,
        q, dk + dv]``, keys un-rotated; ``meta`` ``[B, q, 2]``; ``real`` ``[B, q]``, padding never stored; initial
        ``scores`` ``[B, q]``, None: 0). One token's selection is left to the executor; several tokens' selections
        are decided on the host (scores read once), each sequence playing its own moves (the layouts stay equal)."""
        count, before, slots, layout = kv.shape[2], self._rings, self.capacity, self._layout
        needs = self.rule.needs_scores
        wins = None if needs else lambda *_: True  # no token selection: the arriving token always wins
        in_step = self._in_step and self._forward_unpadded
        if in_step and (count == 1 or not needs):  # the same moves for every sequence and layer of the forward
            key = ("cascade-play", before[0], count, slots, needs, id(self.rule.config))
            plan = self.forward_pass.cached(key, lambda: schedule.play(layout, before[0], range(count), slots, wins))
            self._set_shared(plan[0])
            columns = self._columns(before[0], plan, count)
        else:
            tokens = [range(count)] * len(before)
            if not in_step:
                self._in_step = False  # the schedule runs once per sequence from now on
                tokens = [[m for m, is_real in enumerate(row) if is_real] for row in real.tolist()]
            host: list = []  # the pool's scores on the host, read at the first selection decided there

            def host_wins(row: int, arriving: int, resident: int) -> bool:
                if not host:
                    fresh = kv.new_zeros(kv.shape[0], count, dtype=torch.float32) if scores is None else scores
                    host.append(torch.cat([self._score[:, : slots + 1], fresh.float()], 1).tolist())
                return arrival_wins(host[0][row][arriving], host[0][row][resident], self.rule.config.tie)

            decide = (lambda b: partial(host_wins, b)) if needs and count > 1 else lambda b: wins
            plans = [schedule.play(layout, before[b], mine, slots, decide(b)) for b, mine in enumerate(tokens)]
            self._rings = [plan[0] for plan in plans]
            columns = self._sequence_columns(before, plans)
        if columns is not None:
            executor = Executor(self._kv, self._meta, self._score if needs else None, self.rule.config.tie)
            self._apply_moves(executor, columns, (kv, meta, scores))
        self._sync_sinks(before)

    def _apply_moves(self, executor: Executor, columns: Columns, new: tuple) -> None:
        executor.apply(columns, *new)  # (a hook: the quantized layer notes the slots written)

    def _columns(self, before: schedule.Rings, plan: tuple, count: int, rotated: bool = False) -> Columns | None:
        """The batch's move tables (``None``: no move), built once per forward for the layers in the same state: the
        ``count`` new tokens' columns first; ``rotated``: the new keys come at their angles already."""
        after, moves, select = plan
        slots, layout = self.capacity, self._layout
        fresh = [move for move in moves if move[1] > slots]
        stored = [move for move in moves if move[1] <= slots]  # (a selection, last, always moves a stored token)
        if not moves:
            return None
        turns = [0 if rotated else schedule.move_turn(layout, before, after, *move, slots) for move in fresh]
        turns += [schedule.move_turn(layout, before, after, *move, slots) for move in stored]
        taken = [item - slots - 1 for _, item in fresh]
        key = ("cascade-columns", before, tuple(moves), select, count, rotated, slots, self.device, self.dtype)

        def build() -> Columns:
            take = None if taken == list(range(count)) else from_host(taken, self.device)
            read = from_host([item for _, item in stored], self.device)
            dests = [dest for dest, _ in fresh + stored]
            written = from_host(dests, self.device)
            cos, sin = self._turn_table(turns, (len(turns), 1, 1))
            lost = from_host([*dests[:-1], slots], self.device) if select else None  # (slots: the scratch slot)
            first = fresh[0][0] if fresh else -1
            return Columns(read, written, cos, sin, select, take, len(fresh), first, lost, dests[-1])

        return self.forward_pass.cached(key, build)

    def _sequence_columns(self, before: list[schedule.Rings], plans: list) -> Columns | None:
        """The executor's tables of moves per sequence ``[B, m]``, padded with the scratch slot."""
        slots, layout = self.capacity, self._layout
        width = max(len(plan[1]) for plan in plans)
        if not width:
            return None
        read, written, turns, select = [], [], [], []
        for rings, (after, moves, selects) in zip(before, plans, strict=True):
            pad = width - len(moves)
            read.append([item for _, item in moves] + [slots] * pad)
            written.append([dest for dest, _ in moves] + [slots] * pad)
            turns.append([schedule.move_turn(layout, rings, after, *move, slots) for move in moves] + [0] * pad)
            select.append([False] * (len(moves) - 1) + [selects] * bool(moves) + [False] * pad)
        cos, sin = self._turn_table(turns, (len(turns), 1, width))
        read_t, written_t = from_host(read, self.device), from_host(written, self.device)
        return Columns(read_t, written_t, cos, sin, from_host(select, self.device, torch.bool))

    def _turn_table(self, turns: list, shape: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos / sin ``[*shape, d / 2]`` of whole-number turns (float64 angles); ``None`` without RoPE."""
        if self.inv_freq is None:
            return None, None
        angle = from_host(turns, self.device).view(shape).to(torch.float64)[..., None]
        angle = angle * self.inv_freq.to(self.device, torch.float64)
        return angle.cos().to(self.dtype), angle.sin().to(self.dtype)

    # --- the sinks, in the oldest ring's frame --------------------------------------------------------------------
    def _sync_sinks(self, before: list[schedule.Rings], changes: list | None = None) -> None:
        """After an insertion from the layouts ``before``: copy new sinks to ``_sink_keys`` at angle ``j`` (stored at
        ``j`` plus the empty rings' shift, ``schedule.move_turn``) and rewrite the sinks from that copy where their
        angle moved (``schedule.sinks_after``; ``changes``: as planned already)."""
        if not self.sinks or self.inv_freq is None:
            return
        rows, layout, dim = self._rows(), self._layout, self._key_dim
        if changes is None:
            changes = [schedule.sinks_after(layout, old, new) for old, new in zip(before, rows, strict=False)]
        if any(copy for copy, _ in changes):
            copied = self._turned_sinks(self._kv[:, :, : self.sinks, :dim], [-layout.fill] * len(rows))
            self._sink_keys = self._where([copy for copy, _ in changes], copied, self._sink_keys)
        if any(shift is not None for _, shift in changes):
            placed = self._turned_sinks(self._sink_keys, [schedule.sink_shift(layout, rings) for rings in rows])
            sinks = self._kv[:, :, : self.sinks, :dim]
            sinks.copy_(self._where([shift is not None for _, shift in changes], placed, sinks))

    def _turned_sinks(self, keys: torch.Tensor, shifts: list[int]) -> torch.Tensor:
        """``keys`` ``[B, H, S, d]`` rotated further by each sequence's shift (float64 angles; one matrix shared by
        a forward's layers where the shifts agree)."""
        dim, dtype = self._key_dim, self.dtype
        if len(set(shifts)) == 1:
            return keys @ frame_rotation(self.forward_pass, shifts[0], self.inv_freq, dim, dtype)
        return keys @ frame_rotation_at(from_host(shifts, self.device)[:, None], self.inv_freq, dim, dtype)[:, None]

    def _where(self, rows: list[bool], new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` in the sequences ``rows``, ``old`` elsewhere."""
        if all(rows):
            return new
        return torch.where(from_host(rows, self.device, torch.bool)[:, None, None, None], new, old)

    # --- attention where the planned steps do not apply: per-sequence layouts (padding, a reordered batch), a -------
    # sliding window, no RoPE; ``prefill="chunked"`` and streaming's forwards of several tokens
    def attend(self, query, key, value, mask, scaling) -> tuple[torch.Tensor, None]:
        return self.cascade_attention(query, scaling), None

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return query, key  # positions are assigned inside cascade_attention, token by token

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> None:
        self._sliding_window = sliding_window  # applied inside cascade_attention, by stream index as the model does

    def cascade_attention(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Insert this forward's tokens, attend, update the EMA; returns ``[B, H, q, d]``. ``prefill="exact"``: token
        by token (the planned steps while the batch is in step); ``"chunked"`` with several tokens, and streaming:
        the forward attends to the frozen cache and causally to itself, then is inserted (``config``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("cascade_attention() needs the tokens of this forward: call update() first")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        batch, q_heads, count, dim = query.shape
        if self._steps_alone(pending) and (count == 1 or self.rule.config.prefill == "exact"):
            step = self._decode_circular if self.attend_first else self._step_tokens  # (streaming is "chunked")
            return step(query, pending, scale)
        kv, meta, pos, real = self._prepared(pending)
        if self.inv_freq is not None:
            query = rotate_by(query, -pos[:, None, :], self.inv_freq)
        queries = query.reshape(batch, self._kv.shape[1], -1, count, dim)  # un-rotated [B, H_kv, G, q, d]
        if (self.rule.config.prefill == "chunked" and count > 1) or self.attend_first:
            rank = (self._tok >= 0).sum(1, keepdim=True) + (real.long().cumsum(1) - 1).clamp(min=0)
            output, scores = self._attention(queries, rank, self._visible(meta, real, True), real, scale, kv)
            self._insert_tokens(kv, meta, real, scores)
            return output.reshape(batch, q_heads, count, -1)
        outputs = []
        for m in range(count):
            self._insert_tokens(kv[:, :, m : m + 1], meta[:, m : m + 1], real[:, m : m + 1], None)
            top = ((self._tok >= 0).sum(1, keepdim=True) - 1).clamp(min=0)  # the query's rank: its own key's
            visible = self._visible(meta[:, m : m + 1], real[:, m : m + 1], False)
            outputs.append(self._attention(queries[:, :, :, m : m + 1], top, visible, real[:, m : m + 1], scale)[0])
        return torch.cat(outputs, 3).reshape(batch, q_heads, count, -1)

    def _visible(self, meta: torch.Tensor, real: torch.Tensor, chunk: bool) -> torch.Tensor:
        """What queries at stream indices ``meta[..., 0]`` ``[B, q]`` see: stored keys inside the sliding window, if
        any, and with ``chunk`` the forward's own keys causally (``[B, q, L + q]``; a padding query sees itself);
        without, ``[B, q, L]``, a padding query (stored nowhere) seeing any slot (a finite output)."""
        count = meta.shape[1]
        stored = (self._tok >= 0)[:, None, :]
        window = getattr(self, "_sliding_window", None)
        if window is not None:
            stored = stored & (self._tok[:, None, :] > meta[:, :, None, 0] - window)
        if not chunk:
            return stored | ~real[:, :, None]
        step = torch.arange(count, device=self.device)
        causal = (step[None, :] <= step[:, None])[None] & (real[:, None, :] | (step[None, :] == step[:, None]))
        if window is not None:
            causal = causal & (step[None, :] > step[:, None] - window)[None]
        return torch.cat([stored.expand(-1, count, -1), causal], 2)

    def _attention(self, queries, rank, visible, real, scale, chunk=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Un-rotated queries ``[B, H_kv, G, q, d]`` at ranks ``rank`` ``[B, q]`` over the stored keys turned from their
        angles to their ranks (their frame's offset, ``schedule.offsets``) and, given ``chunk`` ``[B, H_kv, q, dk +
        dv]`` (keys un-rotated), its own keys at ``rank``. Without scores: one SDPA; with them the explicit softmax and
        the EMA in closed form, query ``m`` weighted ``(1 - gamma) gamma^(real queries after m)``. Returns ``[B, H_kv,
        G, q, d_v]`` and the chunk's initial scores (or None)."""
        batch, kv_heads, groups, count, dim = queries.shape
        slots, keys, values = self.capacity, self._k, self._v
        if self.inv_freq is not None:
            queries = rotate_by(queries, rank[:, None, None], self.inv_freq)
            offsets = from_host([schedule.offsets(self._layout, r) for r in self._rows()], self.device)
            sizes = from_host([self.sinks] + [self.width] * self.cascades, self.device)
            turns = offsets.expand(len(self._rings), -1).repeat_interleave(sizes, 1, output_size=slots)
            keys = rotate_by(keys, turns[:, None], self.inv_freq, exact=True)
        if chunk is not None:
            chunk_keys = chunk[..., :dim]
            if self.inv_freq is not None:
                chunk_keys = rotate_by(chunk_keys, rank[:, None], self.inv_freq)
            keys, values = torch.cat([keys, chunk_keys], 2), torch.cat([values, chunk[..., dim:].to(values.dtype)], 2)
        if not self.rule.needs_scores:
            turned = queries.reshape(batch, kv_heads * groups, count, dim)
            if groups > 1:  # heads repeated here: SDPA's ``enable_gqa`` takes the CPU's math path (q x L weights)
                keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            output = scaled_dot_product_attention(turned, keys, values, attn_mask=visible[:, None], scale=scale)
            return output.view(batch, kv_heads, groups, count, -1), None
        logits = queries.reshape(batch, kv_heads, groups * count, dim) @ keys.transpose(-1, -2)
        # (in place: ``logits`` is this call's own tensor, and a chunk's rows are its largest buffer)
        logits = logits.float().mul_(scale).view(batch, kv_heads, groups, count, -1)
        probs = logits.masked_fill_(~visible[:, None, None], float("-inf")).softmax(-1)
        output = probs.to(self._kv.dtype).reshape(batch, kv_heads, groups * count, -1) @ values
        gamma, received = self.rule.gamma, self.rule.reduce_heads(probs)  # [B, q, L (+ q)]
        later = real.sum(1, keepdim=True) - real.long().cumsum(1)  # real queries after query m
        weight = real * (1.0 - gamma) * gamma ** later.float()  # [B, q]
        cascade = self._score[:, self.sinks : slots]
        into_cache = torch.einsum("bq,bql->bl", weight, received[:, :, self.sinks : slots])
        cascade.copy_(cascade * (gamma ** real.sum(1).float())[:, None] + into_cache)
        scores = None if chunk is None else torch.einsum("bq,bqj->bj", weight, received[:, :, slots:])
        return output.view(batch, kv_heads, groups, count, -1), scores

    def _fold_scores(self, probs: torch.Tensor) -> None:
        """EMA step ``mu <- gamma mu + (1 - gamma) rho(s)`` of one query's ``probs`` ``[B, H_kv, G, L]`` (or ``[B H_kv,
        G, L]``) over the first ``L`` slots (sinks have no score); with the mean over heads (the paper's) one
        ``baddbmm_`` (the row of ones shared by a forward's layers)."""
        batch, stored, gamma = self._score.shape[0], probs.shape[-1], self.rule.gamma
        if self.rule.config.reduction != "mean":
            received = self.rule.reduce_heads(probs.reshape(batch, self._kv.shape[1], -1, stored)[..., self.sinks :])
            self._score[:, self.sinks : stored].mul_(gamma).add_(received, alpha=1.0 - gamma)
            return
        rows = probs.reshape(batch, -1, stored)[..., self.sinks :]  # [B, H_kv G, stored - S]
        fold = self._fold  # (the row of ones and the scores' view, kept while the buffer and ``stored`` stay)
        if fold is None or fold[0] is not self._score or fold[1] != stored or fold[2].shape[2] != rows.shape[1]:
            ones = rows.new_ones(batch, 1, rows.shape[1])
            fold = self._fold = (self._score, stored, ones, self._score[:, None, self.sinks : stored])
        fold[3].baddbmm_(fold[2], rows, beta=gamma, alpha=(1.0 - gamma) / rows.shape[1])

    def after_attention(self, stats: AttentionStats | None) -> None:
        """Driven by hand (tests, benchmarks): insert tokens that did not attend, fold ``stats.received`` ``[B, H_kv,
        G, S + |C|]`` into the EMA."""
        if self._pending is not None:
            self._insert_pending()
        if stats is not None and stats.received is not None and self.rule.needs_scores:
            self._fold_scores(stats.received.float())

    def apply(self, rule) -> None:
        raise NotImplementedError("a cascade layer evicts while inserting; it takes no eviction rule")

    # --- views in stream order (the ``CompressedLayer`` contract), batch operations, accounting -------------------
    def _order(self) -> torch.Tensor:
        return self._tok.argsort(dim=1, stable=True)  # empty slots (-1) first, then stream order

    def _view(self, slot_values: torch.Tensor) -> torch.Tensor:
        """A per-slot ``[B, S + |C|]`` tensor in stream order, expanded to ``[B, H_kv, S + |C|]``."""
        return slot_values.gather(1, self._order())[:, None].expand(-1, self._kv.shape[1], -1)

    def _gathered(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return rows.gather(2, order[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[-1]))

    def _drop(self, value: None) -> None:
        if value is not None:
            raise AttributeError("a cascade layer's keys and values are read-only views of its slot buffer")
        self._leave_group()
        self._kv = None

    def _keys(self) -> torch.Tensor | None:
        """Stored keys rotated at ``rope_pos`` as the model wrote them."""
        if self._kv is None:
            return None
        order = self._order()
        keys = self._gathered(self._k, order)
        if self.inv_freq is None:
            return keys
        angles = [[schedule.slot_angle(self._layout, r, s) for s in range(self.capacity)] for r in self._rows()]
        turn = (self._pos - from_host(angles, self.device)).gather(1, order)  # from the stored angle to the position
        return rotate_by(keys, turn[:, None], self.inv_freq, exact=True)

    keys = property(_keys, _drop)
    values = property(lambda self: None if self._kv is None else self._gathered(self._v, self._order()), _drop)
    valid = property(lambda self: self._view(self._tok >= 0))
    rope_pos = property(lambda self: self._view(torch.where(self._tok >= 0, self._pos, 0)))
    state = property(lambda self: {"score": self._view(self._score[:, : self.capacity])})
    rows = property(lambda self: (self._tok.shape[0], self._kv.shape[1]))
    view_width = property(lambda self: self._tok.shape[1] if self.is_initialized else 0)

    # each real token's rank among the stored ones of its sequence (the empty slots, first, at ``-1``)
    rank = property(lambda self: self.valid.cumsum(-1) - 1)

    @property
    def token_idx(self) -> torch.Tensor:
        """Stream indices in stream order, the ``E`` empty slots first, numbered ``-E .. -1``."""
        ordered = self._tok.gather(1, self._order())
        empty = ordered < 0
        filler = torch.arange(ordered.shape[1], device=self.device) - empty.sum(1, keepdim=True)
        return torch.where(empty, filler, ordered)[:, None].expand(-1, self._kv.shape[1], -1)

    # occupied slots of the fullest sequence (the generic layer's ``stored_length``: a host read for accounting, the
    # rings never read it); the generic layer's initialisation and reset write 0 here: nothing to keep
    occupied = property(lambda self: int((self._tok >= 0).sum(-1).max()) if self.is_initialized else 0, lambda *_: None)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view_width + query_length, 0  # (the mask is built from the slots: any size, no host read)

    def kept(self) -> StreamView:
        return StreamView(self.keys, self.values, self.token_idx, self.rope_pos, self.valid, self.rank, self.state)

    def reset(self) -> None:
        super().reset()
        self._drop(None)
        self._pending = None

    def move_batch(self, move) -> None:
        """A reordered or repeated batch: the schedule runs once per sequence from now on."""
        if not self.is_initialized:
            return
        self._in_step = False
        self._leave_group()
        rows = move(torch.arange(len(self._rings), device=self.device)).tolist()  # (one host read per reorder)
        self._rings = [self._rings[row] for row in rows]
        for name in ("_kv", "_meta", "_score", "_sink_keys"):
            setattr(self, name, move(getattr(self, name)))

    def _leave_group(self) -> None:
        """Give up the cascade layers' stacked buffers (``ring_decode``): this layer's are about to be replaced."""
        if self.ring_layers is not None:
            for name in STACKED:
                self.forward_pass.unstack(name)

    # --- accounting (the scratch slot excluded from the keys and values) --------------------------------------
    def kv_nbytes(self) -> int:
        """Bytes of the stored tokens' keys and values (occupied slots of the fullest sequence)."""
        return self.allocated_nbytes() * self.stored_length() // self.capacity if self.is_initialized else 0

    def allocated_nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes if self.is_initialized else 0

    def metadata_nbytes(self) -> int:
        """Per slot the stream index, RoPE position and EMA; per sequence the rings' counts and starts, the sinks
        stored and the real tokens seen (int64). Held whole: ``allocated_metadata_nbytes`` is the same."""
        if not self.is_initialized:
            return 0
        return self._meta.nbytes + self._score.nbytes + len(self._rings) * (2 * self.cascades + 2) * 8

    allocated_metadata_nbytes = metadata_nbytes
