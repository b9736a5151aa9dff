"""PoD's cache layer (see ``kvcompress.methods.pod.config`` for the method and its choices).

``PoDLayer`` stores values of every token in every layer, keys of every token only for the KV heads that start a
block at this layer, and keys of proximal tokens (sinks + recent window) for the other KV heads. ``pod_attention``
(``kvcompress.methods.pod.attention``) mixes this layer's logits on proximal tokens with the block-start layer's
logits on distant tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.append_buffer import AppendBuffer
from kvcompress.core.contract import AttentionStats, Keep, Policy, Selection
from kvcompress.core.gather_layer import GatherLayer, keep_selection, protects_forward
from kvcompress.core.layer import LAYER_ATTRIBUTE
from kvcompress.core.rope import counts_from
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


class PoDLayer(RingSteps, GatherLayer):
    """A cache layer with PoD's storage: values of every token; for KV heads that start a block here the keys of
    every token (``keys``, ``[B, S, L, d]``); for the other KV heads the keys of proximal tokens only
    (``prox_keys``, ``[B, H - S, P, d]``, ``prox_slot`` = their slot in ``values``, -1 for padding entries)."""

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        self.index = policy.layer_idx
        self.peers: list[GatherLayer] = []
        self.head_starts: tuple[int, ...] = ()
        self.step: PoDStep | None = None
        self.last_selection: Selection | None = None
        self.key_share = 1.0  # share of (layer, KV head) pairs storing distant keys (set by the config's connect)
        self.all_real = True  # no padding stored (known on the host: no mask is built for a decoding step)
        self.max_position = -1  # largest RoPE position given so far, read back only while below a full window
        self.on_stream = True  # every token stored at its stream index and position, no padding (``stream_masks``)
        self.forward_positions: torch.Tensor | None = None  # this forward's position_ids (shared by its layers)
        self.gate_counts = [0, 0]  # rows whose distant part the tau gate skipped, rows where it could
        self.ring: ProximalRing | None = None  # the proximal keys while decoding (``ring.py``)
        self.ring_plan = None  # RingPlan if decoding may use the ring, False if not (set by the first attention)
        self._query_layout: tuple | None = None  # (query heads, block start per query head, sharing query heads)
        self._pending = 0  # ring steps' tokens not yet in token_idx, rope_pos and valid
        self._ring_key: torch.Tensor | None = None  # this step's key for the ring, written once positions are known
        self._room = {"keys": AppendBuffer(), "values": AppendBuffer()}  # appends write in place, not cat
        self.max_chunk = 1  # the most tokens one forward brought (the room an append buffer may keep ahead)

    def connect_block(self, peers: list[GatherLayer], index: int, head_starts: tuple[int, ...]) -> None:
        self.peers, self.index, self.head_starts = peers, index, tuple(head_starts)

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
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
        self.keys = key_states[:, self.full_heads, :0]
        self.prox_keys = key_states[:, self.prox_heads, :0]
        self.prox_slot = torch.zeros(key_states.shape[0], len(prox), 0, dtype=torch.long, device=self.device)
        self._head_index: dict[tuple[int, ...], torch.Tensor] = {}

    def query_layout(self, q_heads: int) -> tuple[tuple[int, ...], list[int]]:
        """Each query head's block start and the query heads that share from another layer (computed once)."""
        if self._query_layout is None or self._query_layout[0] != q_heads:
            kv_heads, starts = self.values.shape[1], self.head_starts
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

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        if self._ring_key is not None and self.ring is not None and padding is None:
            self.forward_positions = position_ids  # (the position was stored by update, from the ring's count)
            self._write_ring(position_ids)
            return
        super().register_new_tokens(position_ids, padding)
        self.all_real = self.all_real and padding is None  # padding is passed only when some new token is padding
        config = self.policy.config
        if self.max_position < config.n_sink + config.n_recent:  # past it, distant tokens may exist: no more reads
            newest = self.seen - 1 if position_ids is None else self._largest(position_ids)
            self.max_position = max(self.max_position, newest)
        self.forward_positions = position_ids
        # a decoding step ends it without a read (its masks are small); one host read per chunk, shared by the layers
        first = self.seen - self.new_tokens
        dense = self.sliding_window is None and self.values.shape[2] == self.seen  # nothing expired or dropped
        self.on_stream = self.on_stream and dense and self.all_real and self.new_tokens > 1
        self.on_stream = self.on_stream and (position_ids is None or self._counts_from(position_ids, first))
        if self._ring_key is not None:
            self._write_ring(position_ids)

    def end_forward(self) -> None:
        """After the forward's last layer: every layer lets go of what it shared with the later layers of its
        blocks during the forward (its query and the forward's ``position_ids``, prompt-sized after a prefill)."""
        if self.peers and self is self.peers[-1]:
            for layer in self.peers:
                layer.step, layer.forward_positions = None, None
            self.peers[0]._new_index_tables = None

    def _counts_from(self, position_ids: torch.Tensor, first: int) -> bool:
        """Whether the new tokens' positions are the stream indices from ``first`` (cached for the other layers)."""

        def check() -> bool:
            positions = position_ids[..., -self.new_tokens :]
            return counts_from(positions[0] if positions.dim() == 3 else positions, first)

        return self.forward_pass.cached(("counts-from", first, self.new_tokens), check)

    def _largest(self, position_ids: torch.Tensor) -> int:
        """The forward's largest position (one host read per forward, shared by the layers)."""
        return self.forward_pass.cached("max-position", lambda: int(position_ids.max()))

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> torch.Tensor | None:
        if sliding_window is None and (self.on_stream or (query_count == 1 and self.all_real)):
            return None  # plain causal: the stream as it came, or one query without padding (every stored token)
        return super().attention_mask(query_count, sliding_window)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store values of the new tokens, their keys where this layer keeps them; return this step's keys (tagged
        with the layer) and all values. PoD's attention (``pod_attention``) reads the layer's stores directly."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, count, _ = key_states.shape
        ring_step = self._ring_step(count, key_states)
        if not ring_step:
            self.leave_ring()
        self.max_chunk = max(self.max_chunk, count)
        self.values = self._room["values"].append(self.values, value_states, self.max_chunk)
        if ring_step and self.ring is not None:
            if not self._pending:
                self._pending_position = self.ring.position + 1  # the ring takes one position per step
            self._pending += count  # stream indices, positions and validity follow when read (``_settle``)
        else:
            self._settle()
            new_idx, real = self._new_indices(batch, heads, count)
            self.token_idx = torch.cat([self.token_idx, new_idx], dim=-1)
            self.rope_pos = torch.cat([self.rope_pos, new_idx], dim=-1)  # the model's: ``register_new_tokens``
            self.valid = torch.cat([self.valid, real], dim=-1)
        if self.policy.one_shot and self.compressed:
            self.state = {}  # a one-shot base that compressed never reads its statistics again
        else:
            for name, value in self.policy.init_state(self, key_states).items():
                previous = self.state.get(name)
                self.state[name] = value if previous is None else torch.cat([previous, value], dim=2)
        self.keys = self._room["keys"].append(self.keys, self.heads_of(key_states, "full"), self.max_chunk)
        if ring_step:
            self._ring_key = self.heads_of(key_states, "prox")
        else:
            self._append_proximal(self.heads_of(key_states, "prox"))
        self.seen += count
        self.new_tokens = count
        self.step = None
        setattr(key_states, LAYER_ATTRIBUTE, self)
        return key_states, self.values

    def _new_indices(self, batch: int, heads: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' stream indices ``[B, H, q]`` and validity (all True), made by the forward's first layer
        and read by the others (every layer of a forward stores the same tokens; nothing writes into them)."""
        key = (self.seen, count, batch, heads, self.device)
        owner = self.peers[0] if self.peers else self
        tables = getattr(owner, "_new_index_tables", None)
        if tables is None or tables[0] != key:
            new_idx = torch.arange(self.seen, self.seen + count, device=self.device).expand(batch, heads, count)
            tables = (key, new_idx, torch.ones_like(new_idx, dtype=torch.bool))
            owner._new_index_tables = tables
        return tables[1], tables[2]

    def _append_proximal(self, keys: torch.Tensor) -> None:
        """Append the new tokens' keys ``[B, S, q, d]`` (the last ``q`` slots) to the packed proximal keys."""
        batch, shared, count, _ = keys.shape
        length = self.values.shape[2]
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

    def after_attention(self, stats: AttentionStats | None) -> None:
        super().after_attention(stats)
        self.trim_proximal()

    def apply(self, selection: Selection) -> None:
        self.leave_ring()
        self._release_room()
        index = selection.indices
        length = self.values.shape[2]

        def take(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            shaped = rows.reshape(*rows.shape, *([1] * (tensor.dim() - 3)))
            return tensor.gather(2, shaped.expand(*rows.shape, *tensor.shape[3:]))

        prox_index = index[:, self.prox_heads]
        self.on_stream = False
        self.values = take(self.values, index)
        self.token_idx, self.rope_pos, self.valid = (
            take(self.token_idx, index),
            take(self.rope_pos, index),
            take(self.valid, index),
        )
        if selection.valid is not None:
            self.valid = self.valid & selection.valid
            self.all_real = self.all_real and bool(selection.valid.all())  # once per selection, not per step
        self.state = {name: take(value, index) for name, value in self.state.items()}
        self.keys = take(self.keys, index[:, self.full_heads])
        if len(self.prox_heads):
            inverse = torch.full((*prox_index.shape[:2], length + 1), -1, dtype=torch.long, device=self.device)
            positions = torch.arange(prox_index.shape[-1], device=self.device).expand_as(prox_index)
            inverse = inverse.scatter(2, prox_index, positions)
            old = torch.where(self.prox_slot >= 0, self.prox_slot, length)
            new_slot = inverse.gather(2, old)
            self._pack_proximal(new_slot >= 0, new_slot)

    def planned_keep(self) -> dict[str, torch.Tensor]:
        """``{"keep": [B] counts}`` for a config given ``ratio``/``budget`` (``pod.budget``), else nothing."""
        config = self.policy.config
        if not config.budgeted:
            return {}
        n_real = self.valid.sum(-1).amax(1)
        target = n_real * config.ratio if config.ratio is not None else torch.full_like(n_real, config.budget)
        return {"keep": kept_for_request(target, n_real, self.key_share, config.n_sink + config.n_recent)}

    def block_selection(self, base: Policy) -> Selection | None:
        """The base method's selection, per KV head taken from the head's block-start layer (computed there in this
        same step, earlier in the forward), so a block keeps one token set per KV head."""
        kv_heads = self.values.shape[1]
        groups = len(self.head_starts) // kv_heads
        starts = [self.head_starts[g * groups] for g in range(kv_heads)]
        own = base.select(self, **self.planned_keep()) if self.index in starts else None
        if isinstance(own, Keep):
            own = keep_selection(self, own, protects_forward(base, own, self.new_tokens))
        rows = [own if start == self.index else self.peers[start].last_selection for start in starts]
        if all(r is None for r in rows):
            self.last_selection = None
            return None
        if any(r is None for r in rows) or len({r.indices.shape[-1] for r in rows}) != 1:
            raise RuntimeError("pod: the base method selected different token counts along a block")
        indices = torch.stack([r.indices[:, g] for g, r in enumerate(rows)], dim=1)
        valids = [
            r.valid[:, g] if r.valid is not None else torch.ones_like(indices[:, g], dtype=torch.bool)
            for g, r in enumerate(rows)
        ]
        self.last_selection = Selection(indices=indices, valid=torch.stack(valids, dim=1))
        return self.last_selection

    # --- transformers' layer API and accounting ------------------------------------------------------------
    def _release_room(self) -> None:
        """Let the append buffers go: the stores are about to be replaced (a gather, a batch reorder, a reset)."""
        for room in self._room.values():
            room.release()

    def reset(self) -> None:
        self._release_room()
        super().reset()
        self.all_real, self.max_position, self.on_stream, self.max_chunk = True, -1, True, 1
        self.prox_keys = self.prox_slot = self.ring = self._ring_key = self.ring_plan = self._query_layout = None
        self._pending = 0
        self.step = self.last_selection = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.leave_ring()
        self._release_room()
        super().batch_select_indices(indices)
        if self.is_initialized:
            indices = indices.to(self.device)
            self.prox_keys = self.prox_keys.index_select(0, indices)
            self.prox_slot = self.prox_slot.index_select(0, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.leave_ring()
        self._release_room()
        super().batch_repeat_interleave(repeats)
        if self.is_initialized:
            self.prox_keys = self.prox_keys.repeat_interleave(repeats, dim=0)
            self.prox_slot = self.prox_slot.repeat_interleave(repeats, dim=0)

    def kv_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.prox_keys))

    def allocated_nbytes(self) -> int:
        """The stored keys and values with the room their append buffers keep (at most one forward more)."""
        if not self.is_initialized:
            return 0
        allocated = self._room["keys"].nbytes(self.keys) + self._room["values"].nbytes(self.values)
        return allocated + self.prox_keys.numel() * self.prox_keys.element_size()

    def metadata_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        if self.ring is not None:
            return super().metadata_nbytes() + self.ring.metadata_nbytes()
        return super().metadata_nbytes() + self.prox_slot.numel() * self.prox_slot.element_size()


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
