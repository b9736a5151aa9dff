"""One decoding token of the ring storage in a fixed handful of ops, planned from Python integers.

While the batch is in step (no padding so far) every sequence has the same ring layout: sinks stored, and per
cascade its count and start, all Python integers. Keys sit rotated at their slot index, and inside one ring a
slot's rank (its RoPE position in the cache) is its slot index plus one shift per cascade, plus the ring width for
the slots before the ring's start (``RingAttention._cache_logits``). So a decoding step needs the query rotated to
one target per such *frame*: one matmul by rotation matrices built once per forward and shared by the layers
(``kvcompress.core.rotation``), then one logits matmul per contiguous run of slots in the same frame, one softmax
over the buffer's slots in slot order (empty slots at ``-inf``) and one matmul with the values.
"""

from __future__ import annotations

import torch

from kvcompress.core.rotation import rotation_matrices

Run = tuple[int, int, int]  # slots [lo, hi) whose keys the query sees in frame ``index``


class RingDecode:
    """Mixin of ``CascadeLayer``: the in-step decoding step of the circular sink cache and of the cascade."""

    def _decodes_alone(self, query: torch.Tensor, pending) -> bool:
        """Whether ``_decode_step`` applies: one real token of a batch in step, RoPE positions given by the model,
        no sliding window."""
        return (
            query.shape[2] == 1
            and self._in_step
            and not self.force_tensor_path
            and pending.real is None
            and pending.source is not None
            and self.inv_freq is not None
            and getattr(self, "_sliding_window", None) is None
        )

    def _decode_step(self, query: torch.Tensor, pending, scale: float) -> torch.Tensor:
        """Attend and insert one token; the circular sink cache (``attend_first``) attends before the insertion,
        scoring its own key in the model's frame (relative position 0), the cascade inserts it first."""
        batch, q_heads, _, dim = query.shape
        kv_heads = self._kv.shape[1]
        if not self.attend_first:
            self._insert_in_step(self._new_item(pending, batch, kv_heads, dim), self._new_meta(pending), None)
            self._all_real = True
        top = min(self._py_seen, self.sinks) + sum(self._py_count) - (0 if self.attend_first else 1)
        targets, runs = self._frames(top)
        rotations = rotation_matrices(pending.source, targets, self.inv_freq, dim, query.dtype)
        turned = (query.reshape(batch, q_heads, dim) @ rotations).view(batch, kv_heads, -1, len(targets), dim)
        logits = self._run_logits(turned, runs)
        own_value = None
        if self.attend_first:
            own_value = pending.values.reshape(batch, kv_heads, 1, pending.values.shape[-1])
            logits.append(query.reshape(batch, kv_heads, -1, dim) @ pending.keys.reshape(batch, kv_heads, dim, 1))
        probs = (torch.cat(logits, -1).float() * scale).softmax(-1)
        stored = runs[-1][1] if runs else 0
        weights = probs.to(self._kv.dtype)
        output = weights[..., :stored] @ self._v[:, :, :stored]
        if own_value is not None:
            output = output + weights[..., stored:] * own_value
            self._insert_in_step(self._new_item(pending, batch, kv_heads, dim), self._new_meta(pending), None)
        elif self.rule.needs_scores:
            if stored < self.capacity:  # empty slots at the end received nothing
                probs = torch.nn.functional.pad(probs, (0, self.capacity - stored))
            self._fold_scores(probs, None)
        return output.view(batch, q_heads, 1, -1)

    def _frames(self, top: int) -> tuple[tuple[int, ...], list[Run]]:
        """The query's rotation targets and the runs of stored slots, in slot order, for a query at rank ``top``
        (sinks, then each cascade's wrapped part before its part from ``start`` on: ascending slots)."""
        sinks, width = self.sinks, self.width
        counts, starts = self._py_count, self._py_start
        n_sink = min(self._py_seen, sinks)
        pieces = [(0, n_sink, top)] if n_sink else []
        older = sum(counts)
        for i, (count, start) in enumerate(zip(counts, starts, strict=True)):
            older -= count
            if not count:
                continue
            first = sinks + i * width
            target = top - (n_sink + older - first - start)
            if start + count > width:  # wrapped: the ring offsets before ``start`` are one width later
                pieces.append((first, first + start + count - width, target - width))
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
        keys, logits, end = self._k, [], 0
        batch, kv_heads, groups = turned.shape[:3]
        for lo, hi, index in runs:
            if lo > end:
                logits.append(turned.new_full((1, 1, 1, 1), float("-inf")).expand(batch, kv_heads, groups, lo - end))
            logits.append(turned[:, :, :, index] @ keys[:, :, lo:hi].transpose(-1, -2))
            end = hi
        return logits

    def _new_item(self, pending, batch: int, kv_heads: int, dim: int) -> torch.Tensor:
        """The new token as a slot item ``[B, H_kv, 1, dk + dv]``, its key un-rotated (rotated to position 0)."""
        unrotate = rotation_matrices(pending.source, (0,), self.inv_freq, dim, pending.keys.dtype)
        key = pending.keys.reshape(batch, kv_heads, 1, dim) @ unrotate.unsqueeze(1)
        return torch.cat([key, pending.values.reshape(batch, kv_heads, 1, -1).to(key.dtype)], -1)

    def _new_meta(self, pending) -> torch.Tensor:
        """``[B, 1, 2]``: the new token's stream index and RoPE position."""
        return torch.stack([pending.tok.expand_as(pending.pos), pending.pos], -1)
