"""PoD's cache layer (the method and its choices: ``config``).

Slots hold every KV head's values ``[B, H, L, d]`` but keys ``[B, F, L, d]`` only for the F KV heads starting a block
here (``SlotBuffers.key_heads``); the others keep their proximal tokens' keys packed beside the slots (``prox_keys``
``[B, H - F, P, d]``, each entry's slot in ``prox_slot``, -1: none), or in a ring while decoding (``ring``). The
slots stay dense in stream order: an eviction compacts at once, the packed proximal keys following. A base method's
victims are chosen at each KV head's block-start layer (``core.eviction``), the block's layers dropping the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.core.capacity import grown_capacity
from kvcompress.core.contract import AttentionStats, Policy
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer, Eviction
from kvcompress.core.rope import counts_from
from kvcompress.core.slots import SlotBuffers
from kvcompress.methods.pod.budget import kept_for_request
from kvcompress.methods.pod.ring import ProximalRing


@dataclass
class PoDStep:
    """What a layer lends its blocks' later layers for one forward (``keys``: row ``full_pos[g]`` for KV head g)."""

    query: torch.Tensor  # [B, H_q, q, d]
    keys: torch.Tensor  # [B, F, L, d]


@dataclass(frozen=True)
class QueryLayout:
    """A layer's query heads: each one's block start, those sharing from another layer and, when every sharing KV
    head shares all its query heads from one block start, the runs of them the block start holds side by side."""

    groups: int  # query heads per KV head
    starts: tuple[int, ...]  # block start per query head
    sharing: list[int]  # query heads whose block starts at another layer
    share_idx: torch.Tensor  # ``sharing`` on the device
    runs: tuple[tuple[int, int, int, int, int], ...] | None  # (first sharing index, count, KV head, start, key row)
    ordered: str | None  # "full-first" / "shared-first": the two parts concatenate into head order; None: scatter


class PoDLayer(CompressedLayer):
    """PoD's slot layer: every head's values, the block-start heads' keys, the others' proximal keys (module doc)."""

    # views of the occupied slots, set whenever the slots change (``_new_views``)
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    defers_ring_writes = True  # a ring step copies its key and value into the slots, its bookkeeping deferred
    _releases: list[int] | None = None  # block starts whose step this layer is the last to read (made once)

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        self.index = policy.layer_idx
        self.peers: list[PoDLayer] = []
        self.head_starts: tuple[int, ...] = ()
        self.step: PoDStep | None = None
        self.last_eviction: Eviction | None = None
        self.key_share = 1.0  # share of (layer, KV head) pairs storing distant keys (set by the config's connect)
        self.max_position = -1  # largest RoPE position given so far, read back only while below a full window
        self.on_stream = True  # every token stored at its stream index and position, no padding (``stream_biases``)
        self.forward_positions: torch.Tensor | None = None  # this forward's position_ids (shared by its layers)
        self.gate_counts = [0, 0]  # rows whose distant part the tau gate skipped, rows where it could
        self.ring: ProximalRing | None = None  # the proximal keys while decoding (``ring.py``)
        self.ring_plan = None  # the layout if decoding may use the ring, False if not (set by the first attention)
        self.layout: QueryLayout | None = None
        self._pending = 0  # ring steps' tokens whose stream index, position and validity are not written yet
        self._ring_key: torch.Tensor | None = None  # this step's key for the ring, written once positions are known
        self.prox_keys = self.prox_slot = None

    def connect_block(self, peers: list[PoDLayer], index: int, head_starts: tuple[int, ...]) -> None:
        self.peers, self.index, self.head_starts = peers, index, tuple(head_starts)
        self._releases = None

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
        self.full_heads, self.prox_heads = (torch.tensor(h, dtype=torch.long, device=self.device) for h in (full, prox))
        self.head_lists = {"full": full, "prox": prox}
        self.head_runs = {"full": _run(full), "prox": _run(prox)}  # (first, count) where the heads are consecutive
        self.full_pos = [full.index(g) if g in full else -1 for g in range(kv_heads)]
        key_heads = None if self.head_runs["full"] == (0, kv_heads) else self.full_heads
        self.slots = self.empty_slots(self.heads_of(key_states, "full"), value_states, key_heads)
        self.prox_keys = key_states.new_empty(key_states.shape[0], len(prox), 0, key_states.shape[-1])
        self.prox_slot = torch.zeros(key_states.shape[0], len(prox), 0, dtype=torch.long, device=self.device)
        self.is_initialized = True
        self._new_views()

    def empty_slots(self, key_states, value_states, key_heads: torch.Tensor | None) -> SlotBuffers:
        """Empty slots: values of every KV head, keys of ``key_heads`` (None: every head)."""
        slots = SlotBuffers.empty(value_states, value_states)  # (bookkeeping for every KV head)
        slots.tensors["keys"] = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[-1])
        slots.key_heads = key_heads
        return slots

    def _new_views(self) -> None:
        if self.slots is not None:
            self.keys = self.slots.tensors["keys"].narrow(2, 0, self.occupied)
            self.values = self.slots.tensors["values"].narrow(2, 0, self.occupied)

    def query_layout(self, q_heads: int) -> QueryLayout:
        """The layout of the layer's ``q_heads`` query heads (made at its first attention)."""
        if self.layout is not None and len(self.layout.starts) == q_heads:
            return self.layout
        kv_heads, starts = self.rows[1], self.head_starts
        groups = q_heads // kv_heads
        if len(starts) == kv_heads:
            starts = tuple(s for s in starts for _ in range(groups))
        elif len(starts) != q_heads:
            raise ValueError(f"pod starts have {len(starts)} heads per layer; the model has {q_heads} query heads")
        sharing = [h for h in range(q_heads) if starts[h] != self.index]
        full, prox = self.head_lists["full"], self.head_lists["prox"]
        runs, ordered = None, None
        if {h // groups for h in sharing} == set(prox) and all(starts[h] == starts[h - h % groups] for h in sharing):
            runs = []
            for index, head in enumerate(prox):
                start = starts[head * groups]
                row = self.peers[start].full_pos[head]
                last = runs[-1] if runs else None
                if last and last[3] == start and last[2] + last[1] == head and last[4] + last[1] == row:
                    last[1] += 1
                else:
                    runs.append([index, 1, head, start, row])
            runs = tuple(tuple(run) for run in runs)
        if self.head_runs["full"] is not None and self.head_runs["prox"] is not None:
            ordered = "full-first" if not prox or (full and full[-1] < prox[0]) else "shared-first"
        share_idx = torch.tensor(sharing, dtype=torch.long, device=self.device)  # (once: no host copy per forward)
        self.layout = QueryLayout(groups, starts, sharing, share_idx, runs, ordered)
        return self.layout

    def shared_step(self, start: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distant logits' query (``query_source``: the block start's or ``query``) and the keys that layer
        ``start`` (a block start of this layer) lent in this forward."""
        step = self.peers[start].step
        if step is None or step.keys.shape[2] != self.values.shape[2]:
            raise RuntimeError(f"pod: layer {start} (block start of layer {self.index}) has no matching step")
        return step.query if self.policy.config.query_source == "block_start" else query, step.keys

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new tokens (values; keys where kept; proximal keys beside); return this step's keys (tagged
        with the layer) and all values (PoD's attention reads the stores directly)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        ring_step = self._ring_step(count, key_states)
        if not ring_step:
            self.leave_ring()
        self.max_chunk = max(self.max_chunk, count)
        start, needed = self.occupied, self.occupied + count
        if needed > self.slots.tensors["values"].shape[2]:
            # PoD's ``budget`` counts KV bytes, not slots: the slots grow as the core's do without a budget's cap
            self.slots.grow(grown_capacity(self.slots.capacity, needed, self.max_chunk, None))
        compressed_once = self.policy.one_shot and self.compressed  # its base never reads statistics again
        state = {} if compressed_once else self.policy.init_state(self, key_states)
        full_keys = self.heads_of(key_states, "full")
        if ring_step and self.ring is not None and not state and self.defers_ring_writes:
            if not self._pending:
                self._pending_position = self.ring.position + 1  # the ring takes one position per step
            self._pending += count  # stream indices, positions and validity follow when read (``_settle``)
            self.slots.tensors["keys"].narrow(2, start, count).copy_(full_keys)
            self.slots.tensors["values"].narrow(2, start, count).copy_(value_states)
        else:
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

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        if self._ring_key is not None and self.ring is not None and padding is None:
            self.forward_positions = position_ids  # (the position was stored by update, from the ring's count)
            self._write_ring(position_ids)
            return
        self._settle()  # the ring steps' bookkeeping first: the model's positions and padding go over it
        super().register_new_tokens(position_ids, padding)
        config, forward = self.policy.config, self.forward_pass
        if self.max_position < config.n_sink + config.n_recent:  # past it, distant tokens may exist: no more reads
            newest = self.seen - 1  # else one host read per forward, shared by the layers
            if position_ids is not None:
                newest = forward.cached("max-position", lambda: int(position_ids.max()))
            self.max_position = max(self.max_position, newest)
        self.forward_positions = position_ids
        # a decoding step ends it without a read (its masks are small); one host read per chunk, shared by the layers
        first, count = self.seen - self.new_tokens, self.new_tokens
        dense = self.sliding_window is None and self.occupied == self.seen  # nothing expired or dropped
        self.on_stream = self.on_stream and dense and self.all_valid and count > 1
        if self.on_stream and position_ids is not None:
            positions = position_ids[..., -count:]
            positions = positions[0] if positions.dim() == 3 else positions
            self.on_stream = forward.cached(("counts-from", first, count), lambda: counts_from(positions, first))
        if self._ring_key is not None:
            self._write_ring(position_ids)

    def end_forward(self) -> None:
        """A block start's step goes after the last layer reading it (over quantized slots, a dequantized copy);
        after the forward's last layer every layer lets go of what it lent."""
        super().end_forward()
        if not self.peers:
            return
        if self._releases is None:  # the starts whose last reader (a start reads itself) is this layer
            starts = {start for layer in self.peers for start in layer.head_starts}
            last = {start: max(layer.index for layer in self.peers if start in layer.head_starts) for start in starts}
            self._releases = [start for start, reader in last.items() if reader == self.index]
        for start in self._releases:
            self.peers[start].step = None
        if self is self.peers[-1]:
            for layer in self.peers:
                layer.step, layer.forward_positions, layer.last_eviction = None, None, None

    def _append_proximal(self, keys: torch.Tensor) -> None:
        """Append the new tokens' keys ``[B, S, q, d]`` (the last ``q`` slots) to the packed proximal keys."""
        batch, shared, count, _ = keys.shape
        slots = torch.arange(self.occupied - count, self.occupied, device=self.device).expand(batch, shared, count)
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
        """``[B, H_kv, L, d]``: full keys where stored, proximal keys at their slots, zeros elsewhere (never read
        with this layer's logits); no copy if all are stored."""
        batch, heads, length, dim = self.values.shape
        if self.head_runs["full"] == (0, heads):
            return self.keys
        out = self.keys.new_zeros(batch, heads, length, dim).index_copy(1, self.full_heads, self.keys)
        slot = torch.where(self.prox_slot >= 0, self.prox_slot, length)  # (some head is proximal here)
        scattered = self.keys.new_zeros(batch, len(self.prox_heads), length + 1, dim)
        scattered = scattered.scatter(2, slot[..., None].expand(*slot.shape, dim), self.prox_keys)
        return out.index_copy(1, self.prox_heads, scattered[:, :, :length])

    def _pack_proximal(self, keep: torch.Tensor, slot: torch.Tensor) -> None:
        """Keep the proximal entries ``keep`` ``[B, H - S, P]``, re-packed to the max count."""
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

    def after_attention(self, stats: AttentionStats | None, alone: bool = False) -> None:
        """Evict as the core does, then drop the proximal keys of tokens that left every future query's window."""
        super().after_attention(stats, alone)
        if self.ring is not None or not len(self.prox_heads) or not self.prox_slot.shape[-1]:
            return
        config, (_, rope_pos, _, pos, real) = self.policy.config, self.proximal_entries()
        near = (pos < config.n_sink) | (rope_pos[..., -1:] - pos < config.n_recent)
        self._pack_proximal(real & near, self.prox_slot)

    def proximal_entries(self) -> tuple[torch.Tensor, ...]:
        """The packed proximal keys' slots (-1 read as 0), the sharing heads' positions and validity ``[B, S, L]``,
        each entry's position and whether it holds a real token ``[B, S, P]``."""
        safe, rope_pos, valid = self.prox_slot.clamp(min=0), self.heads_of(self.rope_pos, "prox"), self.valid
        valid = self.heads_of(valid, "prox")
        return safe, rope_pos, valid, rope_pos.gather(-1, safe), (self.prox_slot >= 0) & valid.gather(-1, safe)

    def before_eviction(self, victims: torch.Tensor | None, dropped: torch.Tensor | None) -> None:
        self.leave_ring()

    def compact(self, shrink: bool = False, used: int | None = None) -> None:
        """Gather the kept tokens to the front, the packed proximal keys following (a kept token's new slot: the
        kept tokens before it). Keys lent for this forward (``step``) are copied first: compaction is in place."""
        if self.slots is not None and not self.dense:
            self.leave_ring()
            self.on_stream = False
            if self.step is not None:
                self.step.keys = self.step.keys.clone()
            if len(self.prox_heads):
                kept = self.heads_of(self.slots.token_idx.narrow(2, 0, self.view_width), "prox") >= 0
                moved = torch.where(kept, kept.cumsum(-1) - 1, -1)
                old = self.prox_slot
                new_slot = moved.gather(-1, old.clamp(min=0)).masked_fill_(old < 0, -1)
                self._pack_proximal(new_slot >= 0, new_slot)
        super().compact(shrink, used)
        self._new_views()

    def block_selection(self, base: Policy) -> Eviction | None:
        """The base method's eviction, per KV head as its block-start layer decided it earlier in this forward."""
        kv_heads = self.rows[1]
        groups = len(self.head_starts) // kv_heads
        starts = [self.head_starts[g * groups] for g in range(kv_heads)]
        own = self._own_eviction(base) if self.index in starts else None
        rows = [own if start == self.index else self.peers[start].last_eviction for start in starts]
        if all(r is None for r in rows):
            self.last_eviction = None
            return None
        widths = {(r.dropped if r.dropped is not None else r.invalid).shape[-1] for r in rows if r is not None}
        if any(r is None for r in rows) or len(widths) != 1:
            raise RuntimeError("pod: the base method selected different token counts along a block")

        def per_head(name: str) -> torch.Tensor | None:
            parts = [getattr(r, name) for r in rows]
            if all(p is None for p in parts):
                return None
            none = torch.zeros(self.rows[0], self.view_width, dtype=torch.bool, device=self.device)
            return torch.stack([none if p is None else p[:, g] for g, p in enumerate(parts)], dim=1)

        self.last_eviction = Eviction(None, per_head("invalid"), per_head("dropped"))
        return self.last_eviction

    def _own_eviction(self, base: Policy) -> Eviction | None:
        """This block start's eviction under ``base``: a ``Keep`` rule's victims, or the slots a ``KeepMask``
        leaves out (with ``ratio``/``budget``, keeping the count ``budget`` plans)."""
        config, keep = self.policy.config, {}
        if config.budgeted:
            n_real = self.valid.sum(-1).amax(1)
            target = n_real * config.ratio if config.ratio is not None else torch.full_like(n_real, config.budget)
            keep = {"keep": kept_for_request(target, n_real, self.key_share, config.n_sink + config.n_recent)}
        rule = base.select(self, **keep)
        victims, invalid, dropped = Eviction() if rule is None else self.eviction_of(rule, base)
        if victims is not None:
            dropped = torch.zeros_like(self.token_idx, dtype=torch.bool).scatter_(-1, victims, True)
        return None if dropped is None and invalid is None else Eviction(None, invalid, dropped)

    # --- the proximal keys in a ring while decoding (``ring.py``) ------------------------------------------------
    def _ring_step(self, count: int, key_states: torch.Tensor) -> bool:
        """Whether the new key goes to the ring: one token, no padding, a global layer, no statistics asked, no
        autograd, past the first distant position."""
        config = self.policy.config
        return (
            count == 1
            and bool(self.ring_plan)
            and self.all_valid
            and self.sliding_window is None
            and not (self.policy.wants_stats(self) and self.policy.stats.any)
            and not key_states.requires_grad
            and self.max_position >= config.n_sink + config.n_recent
        )

    def _write_ring(self, position_ids: torch.Tensor | None) -> None:
        key, self._ring_key = self._ring_key, None
        if not self.all_valid:  # a padding token came: the packed keys, which the masks read
            self.leave_ring()
            self._append_proximal(key)
            return
        if self.ring is None:
            position = self.seen - 1
            if position_ids is not None:  # the new token's position if every row has the same (one read per forward)
                positions = position_ids[..., -1]
                positions = positions[0] if position_ids.dim() == 3 else positions
                smallest, largest = self.forward_pass.cached(
                    "pod-decoding-position", lambda: torch.stack(torch.aminmax(positions)).tolist()
                )
                position = largest if largest == smallest else None
            if position is None:  # rows at different positions: the packed keys, from now on
                self.ring_plan = False
                self._append_proximal(key)
                return
            self.ring = ProximalRing(self, position)
            self.prox_keys, self.prox_slot = self.ring.keys, None
        length = self.values.shape[2]
        self.ring.advance(key, self.heads_of(self.values, "prox").narrow(2, length - 1, 1), length - 1, length)

    def ring_values(self) -> torch.Tensor:
        """``[B, S, W, d]``: the ring entries' values (the ring's copy)."""
        return self.ring.values

    def leave_ring(self) -> None:
        """Turn the ring back into the packed proximal keys."""
        if self.ring is not None:
            self._settle()
            held = self.ring.bias[:, :, 0] == 0
            self.prox_keys, self.prox_slot = self.ring.keys, torch.where(held, self.ring.slot, -1)
            self.ring = None

    def _settle(self) -> None:
        """Write the ring steps' bookkeeping into the last ``_pending`` slots: stream indices, consecutive positions,
        all real (PoD compacts at once: no evicted slot waits)."""
        count, self._pending = self._pending, 0
        if not count:
            return
        slots, span, first = self.slots, slice(self.occupied - count, self.occupied), self.seen - count
        index = torch.arange(first, self.seen, device=self.device)
        slots.token_idx[:, :, span] = index
        slots.rope_pos[:, :, span] = index + (self._pending_position - first)
        slots.valid[:, :, span] = True
        slots.rank[:, :, span] = index  # no padding stored: a real token's rank is its stream index
        slots.real_seen += count

    # --- transformers' layer API and accounting ------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.max_position, self.on_stream, self._pending = -1, True, 0
        self.prox_keys = self.prox_slot = self.ring = self._ring_key = self.ring_plan = self.layout = None
        self.step = self.last_eviction = self.keys = self.values = None

    def move_batch(self, move) -> None:
        """The packed proximal keys and their slots follow the slots' batch rows."""
        self.leave_ring()
        super().move_batch(move)
        self._new_views()
        if self.is_initialized:
            self.prox_keys, self.prox_slot = move(self.prox_keys), move(self.prox_slot)

    def side_nbytes(self, metadata: bool) -> int:
        """The packed proximal keys, or their slots (``metadata``; the ring's bookkeeping while it lives)."""
        if metadata and self.ring is not None:
            return self.ring.metadata_nbytes()
        tensor = self.prox_slot if metadata else self.prox_keys
        return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _run(heads: list[int]) -> tuple[int, int] | None:
    """``(first, count)`` if ``heads`` are consecutive (``(0, 0)`` for none), else ``None``."""
    if heads and heads != list(range(heads[0], heads[0] + len(heads))):
        return None
    return (heads[0], len(heads)) if heads else (0, 0)


def pod_stats(cache) -> dict[str, float]:
    """τ-gate counters: rows skipped, rows eligible (non-start heads with distant tokens), fraction."""
    skipped = sum(getattr(layer, "gate_counts", (0, 0))[0] for layer in cache.compressed_layers)
    eligible = sum(getattr(layer, "gate_counts", (0, 0))[1] for layer in cache.compressed_layers)
    return {"skipped": skipped, "eligible": eligible, "fraction": skipped / eligible if eligible else 0.0}
