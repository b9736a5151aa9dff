"""``prefill="exact"``: a forward's tokens one after the other through the decoding step.

Each token of the forward is inserted, attends and folds its attention into the EMA before the next one, exactly
what feeding the tokens one at a time does (v1 of the paper); the MLPs still run on the whole forward.

The schedule of the steps depends only on the token count, so every layer of a forward takes the same steps. In the
steady state (the batch in step, every token pushing older ones down the rings, scores
kept with the paper's mean over heads) the Python side of every step of the forward is planned once, by the first
layer, and shared (``ForwardPass.cached``); each layer then runs the steps as a short, fixed list of ops on views made
once per forward (``_lean_tokens``):

- once per forward: the new keys turned from the model's positions to their angles, and the queries to each
  of their frames, all at once;
- per token: its moves by the executor (``executor.apply_moves``: one gather of the tokens it pushes on, their
  keys turned, one write per tensor, a selection's loser into the scratch slot); the logits of every frame for
  every slot by one matmul and an index (one matmul per run where that product is large), one softmax, one matmul
  with the values and one for the EMA.

Anything else (the first forward, sinks or rings still filling, padding, another head reduction) takes
``_decode_step`` token by token, which handles every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.forward import from_host
from kvcompress.core.rope import rotate_by
from kvcompress.core.rotation import frames_along, turn_along
from kvcompress.methods.cascade.executor import apply_moves
from kvcompress.methods.cascade.schedule import Rings, sink_shift


@dataclass(frozen=True)
class _TokenStep:
    """The planned step of one token, shared by the layers of a forward (tensors on the layer's device)."""

    read: torch.Tensor  # [m - 1] slots whose tokens move on
    written: torch.Tensor  # [m] slots written: the new token's, then each moved token's
    cos: torch.Tensor  # [m, 1, 1, d / 2] turning each column's key (the new key's column: no turn)
    sin: torch.Tensor
    select: bool  # the last column is a selection against the slot's resident
    sinks_shift: int | None  # the sinks' new angle shift, when the oldest ring's frame moved on
    logit: torch.Tensor  # [stored]: where each slot's logit is among the logits of every frame for every slot
    empty: torch.Tensor | None  # [stored] slots between the runs (none: ``None``)
    stored: int  # slots up to the last occupied one
    runs: tuple  # (first slot, end, frame) of each run, in slot order


@dataclass(frozen=True)
class _Plan:
    """The steps of a forward's tokens and what the layers do once per forward."""

    steps: list[_TokenStep]
    shift: torch.Tensor  # [B, q]: how far each new key turns, from the model's position to its ring angle
    frames: tuple[torch.Tensor, ...]  # each query to each of its F frames, scaled (``frames_along``)
    dense: bool  # one matmul for the logits of every frame for every slot (else one matmul per run)
    after: Rings  # the layout after the forward


class RingExact:
    """Mixin of ``CascadeLayer``: ``prefill="exact"`` (see the module docstring)."""

    def _decode_tokens(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """The forward's tokens one after the other through the decoding step (``[B, H, q, d]`` in and out). Each
        token's position tensor is a view made once per forward, so the layers share each step's plan as they do
        while decoding; old tokens are moved layer by layer (every layer takes all the tokens before the next layer
        takes the first)."""
        count = query.shape[2]
        split = lambda: pending.source[..., -count:].split(1, -1)  # noqa: E731 (the forward's last positions)
        tokens = self.forward_pass.cached(("token-sources", count, pending.source.device), split)
        plan = self._lean_plan(query, pending, tokens, scale)
        if plan is not None:
            return self._lean_tokens(query, pending, plan, tokens)
        outputs = []
        for m, source in enumerate(tokens):
            pos = None if pending.pos is None else pending.pos[:, m : m + 1]
            keys, values = pending.keys[:, :, m : m + 1], pending.values[:, :, m : m + 1]
            token = type(pending)(keys, values, pending.first + m, pos, None, source)
            outputs.append(self._decode_step(query[:, :, m : m + 1], token, scale, grouped=False))
        return torch.cat(outputs, 2)

    # --- planning, once per forward -------------------------------------------------------------------------------
    def _lean_plan(self, query: torch.Tensor, pending, tokens, scale: float) -> _Plan | None:
        """The steps of every token of the forward and the counters after them, or ``None`` when the lean path does
        not apply (then ``_decode_step`` takes each token)."""
        rows = pending.source.shape[0]
        if not self.rule.needs_scores or self.rule.config.reduction != "mean" or rows not in (1, self._kv.shape[0]):
            return None
        state = self._shared
        shape = (*self._kv.shape[:2], query.shape[1], query.dtype, scale)
        key = ("exact-plan", state, len(tokens), self.capacity, id(self.rule.config), shape, self.device)
        return self.forward_pass.cached(key, lambda: self._plan_tokens(query, pending, tokens, scale))

    def _plan_tokens(self, query: torch.Tensor, pending, tokens, scale: float) -> _Plan | None:
        """Plan each token's step from the counters as they will be (the layer's own counters are left as they
        are), or ``None`` if some step is not a push down the rings or its logits would take one matmul per
        run."""
        saved = self._rings
        steps, angles, targets = [], [], []
        try:
            for source in tokens:
                step, angle, frames = self._plan_token(source)
                if step is None:
                    return None
                steps.append(step)
                angles.append(angle)
                targets.append(frames)
            after = self._shared
        finally:
            self._rings = saved
        frames = max(map(len, targets))
        dense = self._dense_logits(frames, max(step.stored for step in steps), query.shape[0] * query.shape[1])
        if not dense and any(step.empty is not None for step in steps):
            return None  # (one matmul per run leaves no empty slot between the runs)
        shift = from_host(angles, self.device)[None, :] - pending.pos
        targets = [(*row, *row[-1:] * (frames - len(row))) for row in targets]  # (an unused frame pads a row)
        frames = frames_along(pending.source, targets, self.inv_freq, self._key_dim, query.dtype, scale)
        return _Plan(steps, shift, frames, dense, after)

    def _plan_token(self, source: torch.Tensor) -> tuple[_TokenStep | None, int, tuple[int, ...]]:
        """One token's step (``_plan_decode_step``), its new key's angle and its query's frames, advancing the
        layer's counters."""
        before = self._shared
        moves, angle, turns, after, targets, runs = self._plan_decode_step()
        self._set_shared(after)
        sinks_shift = sink_shift(self._layout, after)
        sinks_shift = None if sinks_shift == sink_shift(self._layout, before) or not self.sinks else sinks_shift
        if len(moves) < 2:
            return None, angle, targets
        dests = [dest for dest, _ in moves]
        read, written, cos, sin = self._shared_move_tables(dests, turns)
        stored = runs[-1][1]
        key = ("slot-logits", tuple(runs), self.device)
        logit, empty = self.forward_pass.cached(key, lambda: self._slot_logits(runs))
        step = _TokenStep(read, written, cos, sin, moves[-1][1], sinks_shift, logit, empty, stored, tuple(runs))
        return step, angle, targets

    def _slot_logits(self, runs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per slot, where its logit is among the logits of every frame for every slot (``frame * stored +
        slot``), and the empty slots between the runs (``None`` when the runs cover every slot)."""
        frame, empty = self._slot_frames(runs, 1, 1, 1)
        stored = frame.shape[-1]
        return frame.view(-1) * stored + torch.arange(stored, device=self.device), empty

    # --- the steps ------------------------------------------------------------------------------------------------
    def _lean_tokens(self, query: torch.Tensor, pending, plan: _Plan, tokens) -> torch.Tensor:
        """Run the planned steps of the forward's tokens (see the module docstring); ``[B, H, q, d]`` out."""
        batch, q_heads, count, dim = query.shape
        kv_heads, rows = self._kv.shape[1], plan.frames[0].shape[0] // count
        keys = rotate_by(pending.keys, plan.shift[:, None], self.inv_freq, exact=True)
        arriving = torch.cat([keys, pending.values.to(keys.dtype)], -1).permute(2, 0, 1, 3)
        meta = self._shared_meta(pending)
        zero = self._score.new_zeros(batch)
        ones = self._score.new_ones(batch, 1, q_heads)
        gamma = self.rule.gamma
        queries = query.permute(2, 0, 1, 3).reshape(count * rows, -1, dim)  # [q rows, B H / rows, d]
        turned = turn_along(queries, *plan.frames).view(count, batch * kv_heads, -1, dim)  # [q, B H_kv, G F, d]
        views, outputs = None, []
        buffers, tie = (self._kv, self._meta, self._score), self.rule.config.tie
        for m, step in enumerate(plan.steps):
            new = (arriving[m][:, :, None], meta[:, m : m + 1], zero)
            apply_moves(buffers, step.read, step.written, (step.cos, step.sin), step.select, tie, new)
            if step.sinks_shift is not None:
                self._place_sinks(step.sinks_shift)
            if views is None or views[0] != step.stored:
                stored = step.stored
                views = (stored, *self._step_views(stored), self._score[:, None, self.sinks : stored])
            stored, keys_t, values, folded = views
            if plan.dense:
                every = torch.bmm(turned[m], keys_t)  # [B H_kv, G F, stored]
                logits = every.view(batch * q_heads, -1).index_select(1, step.logit).float()
            else:
                by_run = self._logits_by_run(turned[m], keys_t, step.runs, q_heads // kv_heads)
                logits = by_run.view(batch * q_heads, stored).float()
            if step.empty is not None:
                logits.masked_fill_(step.empty, float("-inf"))
            probs = logits.view(batch * kv_heads, -1, stored).softmax(-1)
            outputs.append(torch.bmm(probs.to(values.dtype), values))
            received = probs.view(batch, -1, stored)[..., self.sinks :]
            folded.baddbmm_(ones, received, beta=gamma, alpha=(1.0 - gamma) / q_heads)
        self._set_shared(plan.after)
        self._all_real = True
        return torch.stack(outputs, 2).view(batch, q_heads, count, -1)

    @staticmethod
    def _logits_by_run(turned: torch.Tensor, keys_t: torch.Tensor, runs: tuple, groups: int) -> torch.Tensor:
        """``[B H_kv, G, stored]``: each run's logits with its frame's queries (``turned`` ``[B H_kv, G F, d]``,
        ``keys_t`` ``[B H_kv, d, stored]``), one matmul per run."""
        per_frame = turned.view(turned.shape[0], groups, -1, turned.shape[-1])  # [B H_kv, G, F, d]
        return torch.cat([torch.bmm(per_frame[:, :, frame], keys_t[..., lo:hi]) for lo, hi, frame in runs], -1)
