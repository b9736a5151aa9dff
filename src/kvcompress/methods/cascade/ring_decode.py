"""A forward's tokens in turn through the rings while the batch is in step: decoding steps and ``prefill="exact"``.

Each token's step (the executor's tables, the sinks' update, the query's frames) is planned once per forward by the
first layer (``ForwardPass.cached``). The query is turned to one target per ring (``schedule.offsets``; one token:
a rotation matrix, ``core.rotation``; several: elementwise), then one matmul and an index give every frame's logits
for every slot (or one matmul per run of slots, past the ``DENSE_*`` limits), one softmax in slot order (empty slots
at ``-inf``), one matmul with the values and one for the EMA.

In a decoding step the schedule depends only on the token count, so while every cascade layer is in the same in-step
state the forward's first one moves the old tokens of all of them (one gather, rotation and scatter per tensor) and
each layer writes its new key and value. The layers' buffers are then views of one buffer per tensor
(``ForwardPass.stacked``, ``[L B, ...]``), stacked at the end of the first in-step forward finding them apart, given
back when a layer replaces its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from kvcompress.core.forward import agree, from_host
from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import frames_along, rotation_to, turn, turn_along
from kvcompress.methods.cascade.executor import Columns, Executor
from kvcompress.methods.cascade.schedule import Rings, move_turn, offsets, play, sinks_after

Run = tuple[int, int, int]  # slots [lo, hi) whose keys the query sees in frame ``index``
# Every frame's logits for every slot by one matmul while frames x stored slots stay below DENSE_FRAME_SLOTS and, on
# the CPU, its multiply-adds (query rows x frames x slots x head dim) below DENSE_MULTIPLY_ADDS; else one matmul per
# run (``frames`` times fewer multiply-adds; on a GPU a launch costs more than the matmul). Timings: docs/core-lines.md
DENSE_FRAME_SLOTS = {"cpu": 4_608, "cuda": 1 << 22}
DENSE_MULTIPLY_ADDS = {"cpu": 1 << 22}


@dataclass(frozen=True)
class Step:
    """One token's planned step, shared by a forward's layers."""

    before: Rings
    after: Rings
    columns: Columns | None  # the executor's tables (the new key comes at its angle already)
    angle: int  # the new key's angle
    sinks: list | None  # ``schedule.sinks_after``, for the batch (None: no change)
    targets: tuple[int, ...]  # the query's rotation targets, one per frame
    runs: tuple[Run, ...]  # the stored slots seen in each frame, in slot order
    logit: torch.Tensor | None  # [stored]: each slot's logit among every frame's (None: one matmul per run)
    empty: torch.Tensor | None  # [stored] slots between the runs (None: none, or per-run logits)
    stored: int  # the slots up to the last stored one


class RingDecode:
    """Mixin of ``CascadeLayer``: a forward's tokens one after the other while the batch is in step."""

    def _steps_alone(self, pending) -> bool:
        """Whether ``_step_tokens`` applies: in step, no padding, RoPE with ``position_ids`` (one row or one per
        sequence), no sliding window."""
        return (
            self._in_step
            and pending.real is None
            and pending.source is not None
            and pending.source.shape[0] in (1, self._kv.shape[0])
            and self.inv_freq is not None
            and getattr(self, "_sliding_window", None) is None
        )

    def _step_tokens(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """Attend and insert each token of the forward in turn (``[B, H, q, d]`` in, the same out)."""
        batch, q_heads, count, dim = query.shape
        kv_heads = self._kv.shape[1]
        rows = batch * q_heads
        key = ("cascade-steps", self._shared, count, self.capacity, id(self.rule.config), rows, self.device)
        steps = self.forward_pass.cached(key, lambda: self._plan_steps(count, rows))
        items, turned = self._rotated(query, pending, steps, scale)
        meta = self._shared_meta(pending)
        grouped = count == 1 and self.ring_layers is not None
        executor = Executor(self._kv, self._meta, self._score if self.rule.needs_scores else None, self.rule.config.tie)
        outputs = []
        for m, step in enumerate(steps):
            if grouped and moved_every_ring(self, step, meta):
                self._kv[:, :, step.columns.fresh : step.columns.fresh + 1] = items[m]  # the rest moved for all
            elif step.columns is not None:
                self._apply_moves(executor, step.columns, (items[m], meta[:, m : m + 1]))
            if step.sinks is not None:
                self._set_shared(step.after)
                self._sync_sinks([step.before], step.sinks)
            keys_t, values = self._step_views(step.stored)
            if step.logit is not None:
                logits = torch.bmm(turned[m], keys_t).view(rows, -1)  # every frame's logits for every slot
                logits = logits if logits.shape[1] == step.stored else logits.index_select(1, step.logit)
            else:
                logits = self._run_logits(turned[m], keys_t, step.runs, q_heads // kv_heads).view(rows, -1)
            logits = logits.float()
            if step.empty is not None:
                logits.masked_fill_(step.empty, float("-inf"))
            probs = logits.view(batch * kv_heads, -1, step.stored).softmax(-1)
            outputs.append(torch.bmm(probs.to(values.dtype), values))
            if self.rule.needs_scores:
                self._fold_scores(probs)
        self._set_shared(steps[-1].after)
        self._forward_unpadded = True
        return (outputs[0] if count == 1 else torch.stack(outputs, 2)).view(batch, q_heads, count, -1)

    def _plan_steps(self, count: int, rows: int) -> list[Step]:
        """Each token's step from the layout as it will be (once per forward)."""
        rings, slots, steps = self._shared, self.capacity, []
        for _ in range(count):
            plan = play(self._layout, rings, (0,), slots, None if self.rule.needs_scores else lambda a, r: True)
            after, columns = plan[0], self._columns(rings, plan, 1, rotated=True)  # (one token: always a move)
            targets, runs = self._frames(after.stored(self._layout) - 1, after)
            key = ("slot-logits", tuple(runs), len(targets), rows, self.device)
            logit, empty = self.forward_pass.cached(key, partial(self._slot_logits, runs, len(targets), rows))
            angle = move_turn(self._layout, rings, after, columns.fresh, slots + 1, slots)  # (a new item's: its angle)
            copy, shift = sinks_after(self._layout, rings, after)
            sinks = [(copy, shift)] if copy or shift is not None else None  # (None: the sinks stay as they are)
            steps.append(Step(rings, after, columns, angle, sinks, targets, tuple(runs), logit, empty, runs[-1][1]))
            rings = after
        return steps

    def _slot_logits(self, runs: list[Run], frames: int, rows: int) -> tuple[torch.Tensor | None, ...]:
        """Within ``DENSE_*`` (``rows``: batch x query heads): per slot, its logit's index among every frame's
        (``frame * stored + slot``) and the empty slots between the runs (or None). Else ``None, None``: per run."""
        stored, device = runs[-1][1], self.device.type
        wide = frames * stored > DENSE_FRAME_SLOTS.get(device, DENSE_FRAME_SLOTS["cpu"])
        if wide or rows * frames * stored * self._key_dim > DENSE_MULTIPLY_ADDS.get(device, float("inf")):
            return None, None
        logit, empty = list(range(stored)), [True] * stored  # (an empty slot's logit: any, it is masked)
        for lo, hi, index in runs:
            logit[lo:hi] = range(index * stored + lo, index * stored + hi)
            empty[lo:hi] = [False] * (hi - lo)
        return from_host(logit, self.device), from_host(empty, self.device, torch.bool) if any(empty) else None

    def _frames(self, top: int, rings: Rings) -> tuple[tuple[int, ...], list[Run]]:
        """A query at rank ``top`` of ``rings``: its rotation targets, one per ring (the sinks share the oldest
        ring's), and the runs of stored slots in slot order."""
        sinks, width = self.sinks, self._layout.width
        offset = offsets(self._layout, rings)
        n_sink = min(rings.seen, sinks)
        pieces = [(0, n_sink, top - offset[0])] if n_sink else []
        for i, (count, start) in enumerate(zip(rings.count, rings.start, strict=True)):
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

    def _rotated(self, query: torch.Tensor, pending, steps: list[Step], scale: float):
        """Per token, the new token as a slot item ``[B, H_kv, 1, dk + dv]`` (its key turned to its angle) and the
        query turned to each frame, scaled, ``[B H_kv, G F, d]`` (one token: rotation matrices; else elementwise)."""
        batch, q_heads, count, dim = query.shape
        kv_heads, dtype = self._kv.shape[1], pending.keys.dtype
        if count == 1:
            step = steps[0]
            keys = turn(pending.keys, self._rotation(pending, (step.angle,), dim, dtype))
            items = torch.cat([keys, pending.values.to(keys.dtype)], -1)
            turned = turn(query, self._rotation(pending, step.targets, dim, query.dtype, scale))
            return (items,), (turned.view(batch * kv_heads, -1, dim),)
        frames = max(len(step.targets) for step in steps)
        targets = [(*step.targets, *step.targets[-1:] * (frames - len(step.targets))) for step in steps]
        key = ("cascade-frames", steps[0].before, count, pending.first, query.dtype, scale, self.device)
        build = lambda: frames_along(pending.source, targets, self.inv_freq, dim, query.dtype, scale)  # noqa: E731
        along = self.forward_pass.cached(key, build)
        shift = from_host([step.angle for step in steps], self.device)[None, :] - pending.pos
        keys = rotate_by(pending.keys, shift[:, None], self.inv_freq, exact=True)
        items = torch.cat([keys, pending.values.to(keys.dtype)], -1).permute(2, 0, 1, 3).contiguous()[:, :, :, None]
        per_row = along[0].shape[0] // count  # position rows: 1 or B
        queries = query.permute(2, 0, 1, 3).reshape(count * per_row, -1, dim)  # [q rows, B H / rows, d]
        return items, turn_along(queries, *along).view(count, batch * kv_heads, -1, dim)

    def _run_logits(self, turned: torch.Tensor, keys_t: torch.Tensor, runs: tuple, groups: int) -> torch.Tensor:
        """``[B H_kv, G, stored]``: one matmul per run, the empty slots between runs at ``-inf``."""
        per_frame = turned.view(turned.shape[0], groups, -1, turned.shape[-1])  # [B H_kv, G, F, d]
        logits, end = [], 0
        for lo, hi, frame in runs:
            if lo > end:
                logits.append(turned.new_full((1, 1, 1), float("-inf")).expand(turned.shape[0], groups, lo - end))
            logits.append(torch.bmm(per_frame[:, :, frame], keys_t[..., lo:hi]))
            end = hi
        return logits[0] if len(logits) == 1 else torch.cat(logits, -1)

    def _step_views(self, stored: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B H_kv, d, stored]`` and values ``[B H_kv, stored, d_v]`` of the first ``stored`` slots (views)."""
        views = getattr(self, "_views", None)
        if views is None or views[0] is not self._kv or views[1] != stored:
            rows, dim = self._kv[:, :, :stored].flatten(0, 1), self._key_dim
            views = self._views = (self._kv, stored, rows[..., :dim].transpose(1, 2), rows[..., dim:])
        return views[2], views[3]

    def _rotation(self, pending, targets: tuple[int, ...], dim: int, dtype: torch.dtype, scale: float = 1.0):
        """``rotation_to`` from the pending token's position to ``targets``, shared by a forward's layers."""
        tag = (pending.first, pending.keys.shape[2])
        return rotation_to(pending.source, targets, self.inv_freq, dim, dtype, scale, self.forward_pass, tag)

    def _shared_meta(self, pending) -> torch.Tensor:
        """``[B, q, 2]``: the new tokens' stream indices and positions, shared by a forward's layers."""
        key = ("new-meta", pending.first, pending.keys.shape[2], self.device)
        build = lambda: torch.stack([pending.tok.expand_as(pending.pos), pending.pos], -1)  # noqa: E731
        return self.forward_pass.cached(key, build)


STACKED = ("ring-kv", "ring-meta", "ring-score")  # the names of the cascade layers' stacked buffers


def moved_every_ring(layer, step, meta: torch.Tensor) -> bool:
    """Whether the forward's first layer moved every cascade layer's old tokens for ``step``; ``meta`` ``[B, 1, 2]``:
    the new token's slot record."""
    forward, rings = layer.forward_pass, layer.ring_layers
    return forward.cached(("ring-moves", step.before), lambda: _move_all(rings, layer, step, meta))


def _move_all(rings: list, trigger, step, meta: torch.Tensor) -> bool:
    if trigger is not rings[0] or not all(_ready(layer, trigger, step.before) for layer in rings):
        return False
    forward, per_layer = trigger.forward_pass, [(layer._kv, layer._meta, layer._score) for layer in rings]
    joint = [forward.stacked(name, [buffers[i] for buffers in per_layer], make=False) for i, name in enumerate(STACKED)]
    if any(found is None for found in joint):  # not views of one buffer yet: stacked once this forward is over
        forward.at_end("ring-stack", lambda: stack_rings(rings))
        return False
    kv, meta_buffer, score = (buffer for buffer, _ in joint)  # [L B, ...]
    new_meta = meta.expand(len(rings), -1, -1, -1).flatten(0, 1)  # [L B, 1, 2]
    executor = Executor(kv, meta_buffer, score if trigger.rule.needs_scores else None, trigger.rule.config.tie)
    executor.apply(step.columns, None, new_meta)
    return True


def stack_rings(rings: list) -> None:
    """Make the cascade layers' buffers views of one buffer per tensor (one copy) where they agree in shape."""
    if not all(layer.is_initialized and layer._kv is not None for layer in rings):
        return
    forward = rings[0].forward_pass
    per_layer = [(layer._kv, layer._meta, layer._score) for layer in rings]
    if not all(agree([buffers[i] for buffers in per_layer]) for i in range(len(STACKED))):
        return
    views = [forward.stacked(name, [buffers[i] for buffers in per_layer])[1] for i, name in enumerate(STACKED)]
    for layer, kv, meta, score in zip(rings, *views, strict=True):
        layer._kv, layer._meta, layer._score = kv, meta, score


def _ready(layer, trigger, state) -> bool:
    """Whether ``layer`` takes this step in the trigger's state (whose counters moved on already)."""
    return (
        layer.is_initialized
        and layer._kv is not None
        and layer._in_step
        and layer._forward_unpadded
        and getattr(layer, "_sliding_window", None) is None
        and (layer is trigger or (layer._pending is None and layer._shared == state))
    )
