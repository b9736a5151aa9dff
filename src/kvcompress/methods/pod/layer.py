"""PoD's cache layer (see ``kvcompress.methods.pod.config`` for the method and its choices).

``PoDLayer`` is a slot layer (``kvcompress.core.layer.CompressedLayer``) whose slots hold the values of every token
for every KV head but keys only for the KV heads that start a block at this layer (``SlotBuffers.key_heads``); the
other KV heads keep the keys of their proximal tokens (sinks + recent window) packed beside the slots
(``prox_keys``, each entry's slot in ``prox_slot``), or in a ring while decoding (``kvcompress.methods.pod.ring``).
``pod_attention`` (``kvcompress.methods.pod.attention``) mixes this layer's logits on proximal tokens with the
block-start layer's logits on distant tokens.

The slots stay dense (stream order, the forward's tokens last): an eviction (a base method's selection, a sliding
window) compacts at once, and the packed proximal keys follow their tokens' new slots. Victims are chosen by the
core's one path (``kvcompress.core.eviction.victims_of_rule``) at each KV head's block-start layer, and every layer
of the block drops the same slots (``block_selection``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.capacity import grown_capacity
from kvcompress.core.contract import AttentionStats, Keep, KeepMask, Policy, Selection
from kvcompress.core.eviction import protects_forward, victims_of_rule
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.rope import counts_from
from kvcompress.core.slots import SlotBuffers
from kvcompress.methods.pod.budget import kept_for_request
from kvcompress.methods.pod.ring import ProximalRing
from kvcompress.methods.pod.ring_steps import RingSteps


@dataclass
class PoDStep:
    """What a layer exposes to the later layers of its blocks during one forward: its (positioned) query and the
    keys of its full-key KV heads (``full_pos[g]``: row of KV head ``g`` in ``keys``, -1 if it keeps proximal keys
    only)."""

    query: torch.Tensor  # [B, H_q, q, d]
    keys: torch.Tensor  # [B, S, L, d]
    full_pos: list[int]


@dataclass
class BlockEviction:
    """What the layers of a block drop, per KV head decided at its block-start layer: ``dropped`` ``[B, H_kv, W]``
    slots are freed; ``invalid`` ones (per-sequence counts: a sequence keeping fewer than the longest) stay stored
    but no longer count as kept, as ``CompressedLayer.apply`` treats a ``Keep`` rule."""

    dropped: torch.Tensor | None
    invalid: torch.Tensor | None


class PoDLayer(RingSteps, CompressedLayer):
    """A slot layer with PoD's storage: values of every token; for KV heads that start a block here the keys of
    every token (``keys``, ``[B, F, L, d]``); for the other KV heads the keys of proximal tokens only
    (``prox_keys``, ``[B, H - F, P, d]``, ``prox_slot`` = their slot in ``values``, -1 for padding entries)."""

    # the slots attention sees (the occupied ones: PoD's slots are always dense), kept as attributes set whenever
    # the slots change (``_new_views``): reading them writes no deferred bookkeeping and runs no Python
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        self.index = policy.layer_idx
        self.peers: list[PoDLayer] = []
        self.head_starts: tuple[int, ...] = ()
        self.step: PoDStep | None = None
        self.last_eviction: BlockEviction | None = None
        self.key_share = 1.0  # share of (layer, KV head) pairs storing distant keys (set by the config's connect)
        self.max_position = -1  # largest RoPE position given so far, read back only while below a full window
        self.on_stream = True  # every token stored at its stream index and position, no padding (``stream_masks``)
        self.forward_positions: torch.Tensor | None = None  # this forward's position_ids (shared by its layers)
        self.gate_counts = [0, 0]  # rows whose distant part the tau gate skipped, rows where it could
        self.ring: ProximalRing | None = None  # the proximal keys while decoding (``ring.py``)
        self.ring_plan = None  # RingPlan if decoding may use the ring, False if not (set by the first attention)
        self._query_layout: tuple | None = None  # (query heads, block start per query head, sharing query heads)
        self._pending = 0  # ring steps' tokens whose stream index, position and validity are not written yet
        self._ring_key: torch.Tensor | None = None  # this step's key for the ring, written once positions are known
        self.prox_keys = self.prox_slot = None

    def connect_block(self, peers: list[PoDLayer], index: int, head_starts: tuple[int, ...]) -> None:
        self.peers, self.index, self.head_starts = peers, index, tuple(head_starts)

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        kv_heads = key_states.shape[1]
        if len(self.head_starts) == 1:  # one partition for every head (block_size)
            self.head_starts = self.head_starts * kv_heads
        row = self.head_starts
        if len(row) % kv_heads:
            raise ValueError(f"pod starts have {len(row)} heads per layer; the model has {kv_heads} KV heads")
        groups = len(row) // kv_heads
        full = [g for g in range(kv_heads) if any(row[g * groups + k] == self.index for k in range(groups))]
        prox = [g for g in range(kv_heads) if g not in full]
        self.full_heads = torch.tensor(full, dtype=torch.long, device=self.device)
        self.prox_heads = torch.tensor(prox, dtype=torch.long, device=self.device)
        self.head_lists = {"full": full, "prox": prox}
        self.head_runs = {"full": _run(full), "prox": _run(prox)}  # (first, count) where the heads are consecutive
        self.full_pos = [full.index(g) if g in full else -1 for g in range(kv_heads)]
        self._head_index: dict[tuple[int, ...], torch.Tensor] = {}
        batch, dim = key_states.shape[0], key_states.shape[-1]
        slots = SlotBuffers.empty(value_states, value_states)  # (bookkeeping for every KV head)
        slots.tensors["keys"] = key_states.new_empty(batch, len(full), 0, dim)
        slots.key_heads = None if self.head_runs["full"] == (0, kv_heads) else self.full_heads
        self.slots = slots
        self.prox_keys = key_states.new_empty(batch, len(prox), 0, dim)
        self.prox_slot = torch.zeros(key_states.shape[0], len(prox), 0, dtype=torch.long, device=self.device)
        self.is_initialized = True
        self._new_views()

    def _new_views(self) -> None:
        """``keys`` and ``values``: views of the occupied slots, made again whenever the slots change."""
        if self.slots is not None:
            self.keys = self.slots.tensors["keys"].narrow(2, 0, self.occupied)
            self.values = self.slots.tensors["values"].narrow(2, 0, self.occupied)

    def evict(self, victims: torch.Tensor) -> None:
        """Free the slots ``victims`` ``[B, H, e]`` and compact at once: PoD's slots keep no holes."""
        self.evict_mask(
            torch.zeros(self.token_idx.shape, dtype=torch.bool, device=self.device).scatter_(-1, victims, True)
        )

    def query_layout(self, q_heads: int) -> tuple[tuple[int, ...], list[int]]:
        """Each query head's block start and the query heads that share from another layer (computed once)."""
        if self._query_layout is None or self._query_layout[0] != q_heads:
            kv_heads, starts = self.rows[1], self.head_starts
            if len(starts) == kv_heads:
                starts = tuple(s for s in starts for _ in range(q_heads // kv_heads))
            elif len(starts) != q_heads:
                raise ValueError(f"pod starts have {len(starts)} heads per layer; the model has {q_heads} query heads")
            self._query_layout = (q_heads, starts, [h for h in range(q_heads) if starts[h] != self.index])
        return self._query_layout[1], self._query_layout[2]

    def head_index(self, heads: list[int]) -> torch.Tensor:
        """``heads`` as a device tensor, made once per layer: a copy from host memory in every forward would make the
        host wait for the GPU's queue."""
        key = tuple(heads)
        if key not in self._head_index:
            self._head_index[key] = torch.tensor(key, dtype=torch.long, device=self.device)
        return self._head_index[key]

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new tokens' values, and their keys where this layer keeps them, into the slots (the proximal
        keys beside them); return this step's keys (tagged with the layer) and all values. PoD's attention
        (``pod_attention``) reads the layer's stores directly."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        ring_step = self._ring_step(count, key_states)
        if not ring_step:
            self.leave_ring()
        self.max_chunk = max(self.max_chunk, count)
        start, needed = self.occupied, self.occupied + count
        if needed > self.slots.tensors["values"].shape[2]:
            self.slots.grow(self._grown_capacity(needed))
        compressed_once = self.policy.one_shot and self.compressed  # its base never reads statistics again
        state = {} if compressed_once else self.policy.init_state(self, key_states)
        full_keys = self.heads_of(key_states, "full")
        if ring_step and self.ring is not None and not state:
            if not self._pending:
                self._pending_position = self.ring.position + 1  # the ring takes one position per step
            self._pending += count  # stream indices, positions and validity follow when read (``_settle``)
            self._stale = True
            self.slots.tensors["keys"].narrow(2, start, count).copy_(full_keys)
            self.slots.tensors["values"].narrow(2, start, count).copy_(value_states)
        else:
            if self._stale:
                self._settle()
            self.slots.write_range(start, full_keys, value_states, self.seen, state, self.all_valid)
            if ring_step and self.ring is not None:  # (a base's state to write) the position the ring takes
                self.slots.rope_pos[:, :, start].fill_(self.ring.position + 1)
        self.occupied = needed
        self._new_views()
        if ring_step:
            self._ring_key = self.heads_of(key_states, "prox")
        else:
            self._append_proximal(self.heads_of(key_states, "prox"))
        self.seen += count
        self.new_tokens = count
        self.step = None
        setattr(key_states, LAYER_ATTRIBUTE, self)
        return key_states, self.values

    def _grown_capacity(self, needed: int) -> int:
        """PoD's ``budget`` counts KV bytes, not slots: the slots grow as the core's do without a budget's cap."""
        return grown_capacity(self.slots.capacity, needed, self.max_chunk, None)

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        if self._ring_key is not None and self.ring is not None and padding is None:
            self.forward_positions = position_ids  # (the position was stored by update, from the ring's count)
            self._write_ring(position_ids)
            return
        if self._stale:
            self._settle()  # the ring steps' bookkeeping first: the model's positions and padding go over it
        super().register_new_tokens(position_ids, padding)
        config = self.policy.config
        if self.max_position < config.n_sink + config.n_recent:  # past it, distant tokens may exist: no more reads
            newest = self.seen - 1 if position_ids is None else self._largest(position_ids)
            self.max_position = max(self.max_position, newest)
        self.forward_positions = position_ids
        # a decoding step ends it without a read (its masks are small); one host read per chunk, shared by the layers
        first = self.seen - self.new_tokens
        dense = self.sliding_window is None and self.occupied == self.seen  # nothing expired or dropped
        self.on_stream = self.on_stream and dense and self.all_valid and self.new_tokens > 1
        self.on_stream = self.on_stream and (position_ids is None or self._counts_from(position_ids, first))
        if self._ring_key is not None:
            self._write_ring(position_ids)

    def end_forward(self) -> None:
        """After the forward's last layer: every layer lets go of what it shared with the later layers of its
        blocks during the forward (its query, its eviction and the forward's ``position_ids``, prompt-sized after a
        prefill)."""
        super().end_forward()
        if self.peers and self is self.peers[-1]:
            for layer in self.peers:
                layer.step, layer.forward_positions, layer.last_eviction = None, None, None

    def _counts_from(self, position_ids: torch.Tensor, first: int) -> bool:
        """Whether the new tokens' positions are the stream indices from ``first`` (cached for the other layers)."""

        def check() -> bool:
            positions = position_ids[..., -self.new_tokens :]
            return counts_from(positions[0] if positions.dim() == 3 else positions, first)

        return self.forward_pass.cached(("counts-from", first, self.new_tokens), check)

    def _largest(self, position_ids: torch.Tensor) -> int:
        """The forward's largest position (one host read per forward, shared by the layers)."""
        return self.forward_pass.cached("max-position", lambda: int(position_ids.max()))

    def _append_proximal(self, keys: torch.Tensor) -> None:
        """Append the new tokens' keys ``[B, S, q, d]`` (the last ``q`` slots) to the packed proximal keys."""
        batch, shared, count, _ = keys.shape
        length = self.occupied
        slots = torch.arange(length - count, length, device=self.device).expand(batch, shared, count)
        self.prox_keys = torch.cat([self.prox_keys, keys], dim=-2)
        self.prox_slot = torch.cat([self.prox_slot, slots], dim=-1)

    def heads_of(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """``tensor``'s KV heads of ``kind`` (``"full"`` or ``"prox"``) along dim 1: a view where they are
        consecutive, else a copy."""
        run = self.head_runs[kind]
        if run is not None:
            return tensor.narrow(1, *run)
        return tensor[:, self.full_heads if kind == "full" else self.prox_heads]

    def own_keys(self) -> torch.Tensor:
        """A transient ``[B, H_kv, L, d]`` key tensor: full keys where stored, proximal keys at their slots, zeros
        elsewhere (those slots are distant, never read with this layer's logits at this head). A layer keeping every
        KV head's keys returns them as stored (no copy)."""
        batch, heads, length, dim = self.values.shape
        if self.head_runs["full"] == (0, heads):
            return self.keys
        out = self.keys.new_zeros(batch, heads, length, dim)
        if len(self.full_heads):
            out = out.index_copy(1, self.full_heads, self.keys)
        if len(self.prox_heads):
            slot = torch.where(self.prox_slot >= 0, self.prox_slot, length)
            scattered = self.keys.new_zeros(batch, len(self.prox_heads), length + 1, dim)
            scattered = scattered.scatter(2, slot[..., None].expand(*slot.shape, dim), self.prox_keys)
            out = out.index_copy(1, self.prox_heads, scattered[:, :, :length])
        return out

    def _pack_proximal(self, keep: torch.Tensor, slot: torch.Tensor) -> None:
        """Keep the proximal entries marked in ``keep`` ``[B, H - S, P]`` (stream order), re-packed to the max count."""
        fewest = count = 0
        if keep.numel():  # one host read (the packed width is a shape): both counts in one number
            counts, width = keep.sum(-1), keep.shape[-1] + 1
            fewest, count = divmod(int(counts.amin() * width + counts.amax()), width)
        if keep.numel() and fewest == keep.shape[-1]:
            self.prox_slot = slot
            return
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :count]
        kept = keep.gather(-1, order)
        self.prox_slot = torch.where(kept, slot.gather(-1, order), -1)
        keys = self.prox_keys.gather(2, order[..., None].expand(*order.shape, self.prox_keys.shape[-1]))
        self.prox_keys = keys * kept[..., None].to(keys.dtype)

    def trim_proximal(self) -> None:
        """Drop the keys of tokens that left every future query's proximal window (non-start KV heads only)."""
        if self.ring is not None or not len(self.prox_heads) or not self.prox_slot.shape[-1]:
            return
        config = self.policy.config
        slot = self.prox_slot
        safe = slot.clamp(min=0)
        rope_pos = self.heads_of(self.rope_pos, "prox")
        pos = rope_pos.gather(-1, safe)
        real = (slot >= 0) & self.heads_of(self.valid, "prox").gather(-1, safe)
        newest = rope_pos[..., -1:]
        keep = real & ((pos < config.n_sink) | (newest - pos < config.n_recent))
        self._pack_proximal(keep, slot)

    def after_attention(self, stats: AttentionStats | None, alone: bool = False) -> None:
        super().after_attention(stats, alone)
        self.trim_proximal()

    def apply(self, rule: BlockEviction | Keep | KeepMask | Selection | None) -> None:
        """Evict as the block decided (``block_selection``), or as any rule (``CompressedLayer.apply``)."""
        if not isinstance(rule, BlockEviction):
            super().apply(rule)
            return
        if rule.invalid is not None:
            self.slots.valid[:, :, : self.view_width] &= ~rule.invalid
            self.all_valid = False
        if rule.dropped is not None:
            self.evict_mask(rule.dropped)

    def before_eviction(self, victims: torch.Tensor | None, dropped: torch.Tensor | None) -> None:
        self.leave_ring()

    def compact(self, shrink: bool = False) -> None:
        """Gather the kept tokens to the front (``CompressedLayer.compact``); the packed proximal keys follow their
        tokens to their new slots. PoD's slots are in stream order before every compaction (it keeps no holes), so
        a kept token's new slot is the count of kept tokens before it. Compaction writes the slots in place: keys
        this layer lends to later layers in the same forward (``step``) are copied first."""
        if self.slots is not None and not self.dense:
            self.leave_ring()
            self.on_stream = False
            if self.step is not None:  # the later layers of its blocks read its keys as attention saw them
                self.step.keys = self.step.keys.clone()
            if len(self.prox_heads):
                kept = self.heads_of(self.slots.token_idx.narrow(2, 0, self.view_width), "prox") >= 0
                moved = torch.where(kept, kept.cumsum(-1) - 1, -1)
                old = self.prox_slot
                new_slot = moved.gather(-1, old.clamp(min=0)).masked_fill_(old < 0, -1)
                self._pack_proximal(new_slot >= 0, new_slot)
        super().compact(shrink)
        self._new_views()

    def planned_keep(self) -> dict[str, torch.Tensor]:
        """``{"keep": [B] counts}`` for a config given ``ratio``/``budget`` (``pod.budget``), else nothing."""
        config = self.policy.config
        if not config.budgeted:
            return {}
        n_real = self.valid.sum(-1).amax(1)
        target = n_real * config.ratio if config.ratio is not None else torch.full_like(n_real, config.budget)
        return {"keep": kept_for_request(target, n_real, self.key_share, config.n_sink + config.n_recent)}

    def block_selection(self, base: Policy) -> BlockEviction | None:
        """The base method's eviction, per KV head taken from the head's block-start layer (decided there in this
        same step, earlier in the forward, by ``victims_of_rule``), so a block keeps one token set per KV head."""
        kv_heads = self.rows[1]
        groups = len(self.head_starts) // kv_heads
        starts = [self.head_starts[g * groups] for g in range(kv_heads)]
        own = self._own_eviction(base) if self.index in starts else None
        rows = [own if start == self.index else self.peers[start].last_eviction for start in starts]
        if all(r is None for r in rows):
            self.last_eviction = None
            return None
        if any(r is None for r in rows) or len({self._width(r) for r in rows}) != 1:
            raise RuntimeError("pod: the base method selected different token counts along a block")

        def per_head(name: str) -> torch.Tensor | None:
            parts = [getattr(r, name) for r in rows]
            if all(p is None for p in parts):
                return None
            width = self.view_width
            none = torch.zeros(*self.rows[:1], width, dtype=torch.bool, device=self.device)
            return torch.stack([none if p is None else p[:, g] for g, p in enumerate(parts)], dim=1)

        self.last_eviction = BlockEviction(per_head("dropped"), per_head("invalid"))
        return self.last_eviction

    @staticmethod
    def _width(eviction: BlockEviction) -> int:
        return (eviction.dropped if eviction.dropped is not None else eviction.invalid).shape[-1]

    def _own_eviction(self, base: Policy) -> BlockEviction | None:
        """This block-start layer's eviction under ``base``: the victims of a ``Keep`` rule (the core's one victim
        path), or the slots a ``KeepMask`` or ``Selection`` leaves out."""
        rule = base.select(self, **self.planned_keep())
        if rule is None:
            return None
        occupied = self.token_idx >= 0
        if isinstance(rule, Keep):
            victims, invalid = victims_of_rule(rule, self, protects_forward(base, rule, self.new_tokens))
            if invalid is not None and not bool(invalid.any()):  # per-sequence counts: once per prompt
                invalid = None
            if victims is None and invalid is None:
                return None
            dropped = None if victims is None else torch.zeros_like(occupied).scatter_(-1, victims, True)
            return BlockEviction(dropped, invalid)
        keep = rule.keep if isinstance(rule, KeepMask) else rule.as_mask(self.view_width)
        return BlockEviction(~keep & occupied, None)

    # --- transformers' layer API and accounting ------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.max_position, self.on_stream = -1, True
        self.prox_keys = self.prox_slot = self.ring = self._ring_key = self.ring_plan = self._query_layout = None
        self._pending = 0
        self.step = self.last_eviction = None
        self.keys = self.values = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.leave_ring()
        super().batch_select_indices(indices)
        self._new_views()
        if self.is_initialized:
            indices = indices.to(self.device)
            self.prox_keys = self.prox_keys.index_select(0, indices)
            self.prox_slot = self.prox_slot.index_select(0, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.leave_ring()
        super().batch_repeat_interleave(repeats)
        self._new_views()
        if self.is_initialized:
            self.prox_keys = self.prox_keys.repeat_interleave(repeats, dim=0)
            self.prox_slot = self.prox_slot.repeat_interleave(repeats, dim=0)

    def _proximal_nbytes(self) -> int:
        return 0 if self.prox_keys is None else self.prox_keys.numel() * self.prox_keys.element_size()

    def kv_nbytes(self) -> int:
        """The stored tokens' values and keys in the slots, with the packed proximal keys."""
        return super().kv_nbytes() + self._proximal_nbytes()

    def allocated_nbytes(self) -> int:
        """The slots as allocated (``core.capacity``) with the packed proximal keys."""
        return super().allocated_nbytes() + self._proximal_nbytes()

    def _proximal_metadata_nbytes(self) -> int:
        if self.ring is not None:
            return self.ring.metadata_nbytes()
        return 0 if self.prox_slot is None else self.prox_slot.numel() * self.prox_slot.element_size()

    def metadata_nbytes(self) -> int:
        return super().metadata_nbytes() + self._proximal_metadata_nbytes()

    def allocated_metadata_nbytes(self) -> int:
        return super().allocated_metadata_nbytes() + self._proximal_metadata_nbytes()


def _run(heads: list[int]) -> tuple[int, int] | None:
    """``(first, count)`` if ``heads`` are consecutive (``(0, 0)`` for none), else ``None``."""
    if not heads:
        return (0, 0)
    if heads != list(range(heads[0], heads[0] + len(heads))):
        return None
    return (heads[0], len(heads))


def pod_stats(cache) -> dict[str, float]:
    """τ-gate counters of a PoD cache: rows skipped, rows eligible (non-start heads with distant tokens), fraction."""
    skipped = sum(getattr(layer, "gate_counts", (0, 0))[0] for layer in cache.compressed_layers)
    eligible = sum(getattr(layer, "gate_counts", (0, 0))[1] for layer in cache.compressed_layers)
    return {"skipped": skipped, "eligible": eligible, "fraction": skipped / eligible if eligible else 0.0}
