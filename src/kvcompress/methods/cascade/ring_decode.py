"""One decoding token of the ring storage in a fixed handful of ops, planned from the schedule.

While the batch is in step (no padding so far) every sequence has the same layout (``schedule.Rings``: Python
integers). Keys sit at their ring's angle (``schedule.angles``), so a ring's rank is its angle plus one offset per
ring and the sinks share the oldest ring's: a decoding step needs the query rotated to one target per ring (one
matmul with a rotation matrix built once per forward and shared by the layers, ``kvcompress.core.rotation``), then
the logits of every frame for every slot (one matmul and a gather; one matmul per run of slots past
``DENSE_FRAME_SLOTS``), one softmax over the buffer's slots in slot order (empty slots at ``-inf``), one matmul
with the values and one for the EMA. The Python side of a step (moves, turns, frames) is the same for every layer
of a forward and planned once (``_plan_decode_step``), and the old tokens' moves of every layer are done at once by
the first (``ring_moves``); both through the executor. One ring (the circular sink cache) is a single frame: its
step is one SDPA.
"""

from __future__ import annotations

import torch

from kvcompress.core.forward import from_host
from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import rotation_to, turn
from kvcompress.core.sdpa import scaled_dot_product_attention
from kvcompress.core.softmax import head_matmul
from kvcompress.methods.cascade.executor import apply_moves
from kvcompress.methods.cascade.ring_moves import moved_every_ring
from kvcompress.methods.cascade.schedule import Rings, advance, offsets

Run = tuple[int, int, int]  # slots [lo, hi) whose keys the query sees in frame ``index``
# frames x stored slots up to which the logits of every frame are computed for every slot by one matmul. On the CPU
# (SmolLM2 shapes, budget 512, 9 frames) a decoding step takes the same time either way, so larger products take
# one matmul per run (fewer multiply-adds); on a GPU each op is a kernel launch that costs more than the matmul
DENSE_FRAME_SLOTS = {"cpu": 4_608, "cuda": 1 << 22}
# and, on the CPU, multiply-adds of that one matmul (query rows x frames x stored slots x head dim) up to which it is
# taken: it does ``frames`` times the work of the runs' matmuls, which a large batch or many heads pays for. Measured
# with one thread (4 frames, logits and softmax): SmolLM2-135M at batch 1 and 512 slots (1.2M) 0.6x the per-run time;
# 4.7M-9.4M (batch 4-8 or 2,048 slots) 0.95x; 8 KV heads x 4 queries of dim 128 at 512 slots (8.4M) 1.3x; the
# Cascading KV paper's Table 4 shapes (batch 8, 32 heads, dim 128, 1,028 slots: 135M) 1.16x
DENSE_MULTIPLY_ADDS = {"cpu": 1 << 22}


class RingDecode:
    """Mixin of ``CascadeLayer``: the in-step decoding step of the circular sink cache and of the cascade."""

    def _decodes_alone(self, query: torch.Tensor, pending) -> bool:
        """Whether ``_decode_step`` applies: one real token of a batch in step, RoPE positions given by the model,
        no sliding window."""
        return query.shape[2] == 1 and self._steps_alone(pending)

    def _steps_alone(self, pending) -> bool:
        """Whether ``_decode_step`` applies to each of the pending tokens in turn (the conditions above, any count)."""
        return (
            self._in_step
            and not self.force_tensor_path
            and pending.real is None
            and pending.source is not None
            and self.inv_freq is not None
            and getattr(self, "_sliding_window", None) is None
        )

    def _decode_step(self, query: torch.Tensor, pending, scale: float, grouped: bool = True) -> torch.Tensor:
        """Attend and insert one token (``[B, H, 1, d]`` in, the same out); ``grouped``: the first layer of the
        forward may move the old tokens of every layer (``ring_moves``)."""
        if self.attend_first:
            return self._decode_circular(query, pending, scale)
        batch, q_heads, _, dim = query.shape
        before, rings = self._shared, self._rings
        plan = self.forward_pass.cached(
            ("cascade-step", before, self.capacity, id(self.rule.config)), self._plan_decode_step
        )
        moves, angle, turns, after, targets, runs = plan
        item = self._new_item(pending, angle)
        meta = self._shared_meta(pending)
        dests = [dest for dest, _ in moves]
        moved = grouped and self.ring_layers is not None
        if moved and moved_every_ring(self, before, dests, turns, moves[-1][1], meta):
            self._kv[:, :, dests[0] : dests[0] + 1] = item  # the first layer moved the old tokens of every layer
        else:
            self._move_together(moves, item, meta, None, turns)
        self._set_shared(after)
        self._all_real = True
        self._sync_sinks(rings)
        probs = self._softmax(query, pending, targets, runs, scale)  # [B, H_kv, G, stored]
        stored = runs[-1][1]
        output = torch.bmm(probs.flatten(0, 1).to(self._kv.dtype), self._step_views(stored)[1])
        if self.rule.needs_scores:
            self._fold_step(probs)
        return output.view(batch, q_heads, 1, -1)

    def _step_views(self, stored: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B H_kv, d, stored]`` (transposed) and values ``[B H_kv, stored, d_v]`` of the first ``stored``
        slots: views of the buffer, made again only when the buffer or ``stored`` changes."""
        views = getattr(self, "_views", None)
        if views is None or views[0] is not self._kv or views[1] != stored:
            rows, dim = self._kv[:, :, :stored].flatten(0, 1), self._key_dim
            views = self._views = (self._kv, stored, rows[..., :dim].transpose(1, 2), rows[..., dim:])
        return views[2], views[3]

    def _fold_step(self, probs: torch.Tensor) -> None:
        """``_fold_scores`` of one decoding token over the ``stored`` first slots (empty slots after them have no
        score to decay); with the mean over heads (the paper's), the heads' sum and the decay are one batched
        matmul (the row of ones shared by the forward's layers)."""
        if self.rule.config.reduction != "mean":
            pad = self.capacity - probs.shape[-1]
            self._fold_scores(torch.nn.functional.pad(probs, (0, pad)) if pad else probs, None)
            return
        batch, stored, gamma = probs.shape[0], probs.shape[-1], self.rule.gamma
        rows = probs.view(batch, -1, stored)[..., self.sinks :]  # [B, H_kv G, stored - S]
        key = ("ones", *rows.shape[:2], rows.dtype, rows.device)
        ones = self.forward_pass.cached(key, lambda: rows.new_ones(batch, 1, rows.shape[1]))
        cascade = self._score[:, None, self.sinks : stored]
        cascade.baddbmm_(ones, rows, beta=gamma, alpha=(1.0 - gamma) / rows.shape[1])

    def _plan_decode_step(self) -> tuple:
        """The Python side of a decoding step, the same for every layer of a forward in the same state (shared
        through ``ForwardPass.cached``): the moves, the new key's angle (it is written there as it comes), how far
        each column's key turns (0 for the new one), the layout after the step and the attention frames."""
        moves, turns = self._plan_in_step()
        targets, runs = self._frames(self._shared.stored(self._layout) - 1)
        return moves, turns[0], (0, *turns[1:]), self._shared, targets, runs

    def _decode_circular(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """The circular sink cache attends before inserting (the oldest ring token is still seen), so the new
        token first goes to a spare slot: its own slot while the ring fills, else the scratch slot after the ring;
        once attended, it is copied over the oldest ring token. One ring is one frame (``CascadeLayer``): the new
        key, at its real-token index ``p``, and the query, at rank + ``F`` = ``p``, are rotated by the same factors, and
        the query attends to the occupied slots with one SDPA (no mask: they are a prefix of the buffer)."""
        if self.seen_tensor is not None:  # bound to a captured step (``ring_replay``)
            return self._decode_circular_replayable(query, pending, scale)
        seen, rings = self._shared.seen, self._rings
        after, moves = advance(self._layout, self._shared)
        dest = moves.dests[0]  # a sink, an append or the oldest ring token's slot (``schedule``)
        spare = self.capacity if moves.passed else dest  # the ring is full: the scratch slot until attended
        dim, q_heads, kv_heads = pending.keys.shape[-1], query.shape[1], pending.keys.shape[1]
        rotation = self._rotation(pending, (seen,), dim, pending.keys.dtype)
        self._kv[:, :, spare : spare + 1, :dim] = turn(pending.keys, rotation)  # (no out=: compiled graphs refuse it)
        self._kv[:, :, spare : spare + 1, dim:] = pending.values
        turned = turn(query, self._rotation(pending, (seen,), dim, query.dtype))
        stored = self._kv[:, :, : spare + 1]
        output = scaled_dot_product_attention(
            turned, stored[..., :dim], stored[..., dim:], scale=scale, enable_gqa=q_heads != kv_heads
        )
        if dest != spare:
            self._kv[:, :, dest] = self._kv[:, :, spare]
        meta = self._shared_meta(pending)
        self._meta[:, dest] = meta[:, 0]
        self._set_shared(after)
        self._sync_sinks(rings)
        return output

    def _softmax(self, query: torch.Tensor, pending, targets: tuple[int, ...], runs: list[Run], scale: float):
        """Attention probabilities ``[B, H_kv, G, slots]`` of one query over the runs (slot order).

        With few frames and slots, one matmul gives every frame's logits for every stored slot and each slot takes
        its frame's row (a gather with a per-forward table): ``frames`` times the multiply-adds, but three ops
        instead of four per run (each a dispatch, or a kernel launch on a GPU); with many, one matmul per run."""
        batch, q_heads, _, dim = query.shape
        kv_heads, frames, stored = self._kv.shape[1], len(targets), runs[-1][1]
        rotations = self._rotation(pending, targets, dim, query.dtype, scale)
        turned = turn(query, rotations).view(batch, kv_heads, -1, frames, dim)  # scaled (as SDPA scales q)
        if not self._dense_logits(frames, stored, batch * q_heads):
            logits = self._run_logits(turned, runs)
            return (logits[0] if len(logits) == 1 else torch.cat(logits, -1)).float().softmax(-1)
        groups = turned.shape[2]
        every = torch.bmm(turned.view(batch * kv_heads, groups * frames, dim), self._step_views(stored)[0])
        key = ("frame-of-slot", tuple(runs), self.device, batch, kv_heads, groups)
        frame, empty = self.forward_pass.cached(key, lambda: self._slot_frames(runs, batch, kv_heads, groups))
        if frames > 1:
            every = every.view(batch, kv_heads, groups, frames, stored).gather(3, frame)
        logits = every.view(batch, kv_heads, groups, stored).float()  # (one frame: each slot's logit is its own)
        if empty is not None:
            logits.masked_fill_(empty, float("-inf"))
        return logits.softmax(-1)

    def _dense_logits(self, frames: int, stored: int, rows: int) -> bool:
        """Whether one matmul gives the logits of every frame for every slot (else one matmul per run); ``rows``:
        query rows (batch x query heads)."""
        device = self.device.type
        if frames * stored > DENSE_FRAME_SLOTS.get(device, DENSE_FRAME_SLOTS["cpu"]):
            return False
        limit = DENSE_MULTIPLY_ADDS.get(device)
        return limit is None or rows * frames * stored * self._key_dim <= limit

    def _slot_frames(self, runs: list[Run], *shape: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, H_kv, G, 1, slots]`` (``shape`` = B, H_kv, G): the frame of each slot up to the last run's end, and
        the empty slots between runs (``None`` when the runs cover every slot)."""
        stored = runs[-1][1]
        frame, empty = [0] * stored, [True] * stored
        for lo, hi, index in runs:
            frame[lo:hi] = [index] * (hi - lo)
            empty[lo:hi] = [False] * (hi - lo)
        frames = from_host(frame, self.device).view(1, 1, 1, 1, stored).expand(*shape, 1, stored)
        return frames, from_host(empty, self.device, torch.bool) if any(empty) else None

    def _frames(self, top: int) -> tuple[tuple[int, ...], list[Run]]:
        """The query's rotation targets and the runs of stored slots, in slot order, for a query at rank ``top``:
        one frame per ring (``schedule.offsets``), the sinks in the oldest ring's once it holds tokens."""
        shared, sinks, width = self._shared, self.sinks, self._layout.width
        offset = offsets(self._layout, shared)
        n_sink = min(shared.seen, sinks)
        pieces = [(0, n_sink, top - offset[0])] if n_sink else []
        for i, (count, start) in enumerate(zip(shared.count, shared.start, strict=True)):
            if not count:
                continue
            first, target = sinks + i * width, top - offset[1 + i]
            if start + count > width:  # the ring's newest tokens wrapped to its first offsets
                pieces.append((first, first + start + count - width, target))
            pieces.append((first + start, first + min(start + count, width), target))
        targets: dict[int, int] = {}
        runs: list[Run] = []
        for lo, hi, target in pieces:
            index = targets.setdefault(target, len(targets))
            if runs and runs[-1][1] == lo and runs[-1][2] == index:
                runs[-1] = (runs[-1][0], hi, index)
            else:
                runs.append((lo, hi, index))
        return tuple(targets) or (top,), runs  # nothing stored yet: one (unused) frame

    def _run_logits(self, turned: torch.Tensor, runs: list[Run]) -> list[torch.Tensor]:
        """Logits of each run (``-inf`` for the empty slots between runs), in slot order."""
        keys, logits, end = self._kv[..., : self._key_dim], [], 0  # the scratch slot after the rings included
        batch, kv_heads, groups = turned.shape[:3]
        for lo, hi, index in runs:
            if lo > end:
                logits.append(turned.new_full((1, 1, 1, 1), float("-inf")).expand(batch, kv_heads, groups, lo - end))
            logits.append(head_matmul(turned[:, :, :, index], keys[:, :, lo:hi].transpose(-1, -2)))
            end = hi
        return logits

    def _move_together(self, moves: list[tuple[int, bool]], kv, meta, score, turns: tuple[int, ...]) -> None:
        """The moves of one in-step insertion by the executor (``executor.apply_moves``): column 0 takes the new
        token (``placed``, or one ring: its key is rotated at its destination already), column ``c`` the token of
        the slot column ``c - 1`` writes. ``turns``: how far each column's key turns."""
        dests = [dest for dest, _ in moves]
        read, written, cos, sin = self._shared_move_tables(dests, turns)
        buffers = (self._kv, self._meta, self._score if self.rule.needs_scores else None)
        new = (kv, meta, self._new_score(score) if self.rule.needs_scores else None)
        turn = None if cos is None else (cos, sin)
        apply_moves(buffers, read, written, turn, moves[-1][1], self.rule.config.tie, new)

    def _shared_move_tables(self, dests: list[int], turns: tuple[int, ...]) -> tuple:
        """``_move_tables``, shared by the layers of a forward."""
        key = ("moves", tuple(dests), turns, self.capacity, self.device, self.dtype)
        return self.forward_pass.cached(key, lambda: self._move_tables(dests, turns))

    def _move_tables(self, dests: list[int], turns: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
        """Slots read, slots written and the cos / sin ``[m, 1, 1, d / 2]`` turning each column's key by its
        ``turns`` positions."""
        read, written = from_host(dests[:-1], self.device), from_host(dests, self.device)
        if self.inv_freq is None:
            return read, written, None, None
        cos, sin = self._turn_table(from_host(list(turns), self.device))
        return read, written, cos[:, None, None], sin[:, None, None]

    def _new_item(self, pending, angle: int) -> torch.Tensor:
        """The new token as a slot item ``[B, H_kv, 1, dk + dv]``, its key rotated from the model's position to
        ``angle``."""
        dtype = pending.keys.dtype
        key = turn(pending.keys, self._rotation(pending, (angle,), self._key_dim, dtype))
        return torch.cat([key, pending.values.to(key.dtype)], -1)

    def _rotation(self, pending, targets: tuple[int, ...], dim: int, dtype: torch.dtype, scale: float = 1.0):
        """``rotation_to`` from the pending tokens' positions to ``targets``, shared by the forward's layers (keyed
        by the tokens' first stream index too: ``prefill="exact"`` steps each token of a forward in turn)."""
        return rotation_to(
            pending.source,
            targets,
            self.inv_freq,
            dim,
            dtype,
            scale,
            forward=self.forward_pass,
            tag=(pending.first, pending.keys.shape[2]),
        )

    def _shared_meta(self, pending) -> torch.Tensor:
        """``_new_meta``, shared by the layers of a forward."""
        key = ("new-meta", pending.first, pending.keys.shape[2], self.device)
        return self.forward_pass.cached(key, lambda: self._new_meta(pending))

    def _new_meta(self, pending) -> torch.Tensor:
        """``[B, 1, 2]``: the new token's stream index and RoPE position."""
        return torch.stack([pending.tok.expand_as(pending.pos), pending.pos], -1)

    # --- a whole forward into one ring ----------------------------------------------------------------------------
    def _fills_in_order(self) -> bool:
        """Whether a forward's tokens can be inserted at once: one ring without scores, the batch in step and
        every token real (then the sinks take the first tokens and the ring the last ``W`` of the stream, the
        ``k``-th ring token at ring offset ``k mod W``)."""
        return (
            self.cascades == 1
            and not self.rule.needs_scores
            and self._in_step
            and self._all_real
            and not self.force_tensor_path
        )

    def _insert_in_order(self, kv: torch.Tensor, meta: torch.Tensor) -> None:
        """Insert ``q`` tokens (``kv`` ``[B, H_kv, q, dk + dv]``, keys un-rotated; ``meta`` ``[B, q, 2]``) as ``q``
        one-token insertions would, with at most three slice writes per tensor instead of ``q`` insertions."""
        sinks, width, seen, count, rings = self.sinks, self.width, self._shared.seen, kv.shape[2], self._rings
        if self.inv_freq is not None:  # one ring: each key at its real-token index (``schedule.angles``)
            angle = torch.arange(seen, seen + count, device=self.device)
            keys = rotate_by(kv[..., : self._key_dim], angle.expand(kv.shape[0], 1, -1), self.inv_freq, exact=True)
            kv = torch.cat([keys, kv[..., self._key_dim :]], -1)
        to_sinks = max(0, min(sinks, seen + count) - seen)
        if to_sinks:
            self._write_slots(seen, kv[:, :, :to_sinks], meta[:, :to_sinks])
        before = max(0, seen - sinks)  # ring tokens before this forward
        total = before + count - to_sinks
        kept = min(width, count - to_sinks)  # only the last ``W`` of the forward's ring tokens survive
        first = total - kept  # ring index of the first surviving token
        split = min(total, (first // width + 1) * width)  # the surviving tokens wrap at most once
        for lo, hi in ((first, split), (split, total)):
            if hi > lo:
                m = count - (total - lo)
                self._write_slots(sinks + lo % width, kv[:, :, m : m + hi - lo], meta[:, m : m + hi - lo])
        self._set_shared(Rings(seen + count, (min(width, total),), (max(0, total - width),), self._layout.width))
        self._sync_sinks(rings)

    def _write_slots(self, slot: int, kv: torch.Tensor, meta: torch.Tensor) -> None:
        """Write items (one ring: keys at their angle already) into the consecutive slots from ``slot``."""
        count = kv.shape[2]
        self._kv[:, :, slot : slot + count] = kv
        self._meta[:, slot : slot + count] = meta
