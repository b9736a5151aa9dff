"""The compressed cache layer: slots written in place, eviction by victims, no copy of the cache per step.

Each ``CompressedLayer`` owns ``core.slots.SlotBuffers``; left padding is stored but never counts against a budget.
Eviction marks the victims' slots free and the next token is written where a victim was, so slot order is stream
order only while the layer is *dense* (before its first eviction, and after a compaction); a decoding layer at its
budget is *holed*. A compaction (one gather) happens only after a multi-token forward that evicted, a one-shot
compression, a holed layer's forward of another size, and every eviction in ``position_mode="cache"`` (which needs
stream order). ``get_seq_length()`` is the tokens seen (by which ``generate`` places new tokens); ``stored_length()``
the slots in use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress.core.capacity import grown_capacity
from kvcompress.core.contract import AttentionStats, Keep, KeepMask, Policy
from kvcompress.core.eviction import protects_forward, victims_of_rule
from kvcompress.core.forward import ForwardPass
from kvcompress.core.joint_eviction import defer_eviction
from kvcompress.core.replay import SlotReplay
from kvcompress.core.rope import counts_from, rotate_by
from kvcompress.core.slots import SlotBuffers, StreamView

LAYER_ATTRIBUTE = "_kvcompress_layer"


class StateView(Mapping):
    """``layer.state``: the method's per-token tensors (``buffers``, every slot) as views through ``view``."""

    def __init__(self, buffers: dict[str, torch.Tensor], view: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.buffers, self.view = buffers, view

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.view(self.buffers[name])

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self[name].copy_(value)  # broadcast over heads where ``value`` has one

    def __iter__(self):
        return iter(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)


class Eviction(NamedTuple):
    """Slots to evict: ``victims`` ``[B, H, e]`` freed (the same count in every row), ``invalid`` ``[B, H, W]`` left
    stored but no longer counted, ``dropped`` ``[B, H, W]`` freed (counts may differ between rows); None: none."""

    victims: torch.Tensor | None = None
    invalid: torch.Tensor | None = None
    dropped: torch.Tensor | None = None


class CompressedLayer(SlotReplay, CacheLayerMixin):
    """One decoder layer's compressed KV store, driven by a method ``Policy``."""

    is_sliding = False  # (transformers' mixin: not compileable, not croppable)
    holds_codes = False  # True: a layer storing quantized keys and values (``core.quantized_layer``)
    sliding_window: int | None = None  # the model's window on this layer (set by the cache; None: global layer)

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.inv_freq = inv_freq
        self.seen = self.new_tokens = 0
        self.compressed = self.defer_compression = self.more_prompt = False
        # called with this layer after each forward's attention and eviction (inspection)
        self.observers: list[Callable[[CompressedLayer], None]] = []
        self.forward_pass = ForwardPass([self])  # the cache's, shared by its layers (``core.forward``), or its own
        self.joint_eviction = False  # the cache's layers may evict together at a decoding step
        self.slots: SlotBuffers | None = None
        self.occupied = 0  # slots holding a token (real or padding), the same count in every row
        self.dense = True  # slots [0, occupied) hold tokens in stream order; the rest is free
        self.ordered = True  # the occupied slots are in stream order (a dense layer, or one with holes only)
        self.all_valid = True  # no padding stored (while a forward runs, every slot in the view holds a token)
        self.stream_positions = True  # every token so far came with its stream index as RoPE position
        self.max_chunk = 0  # largest forward so far (tokens)
        self._free: torch.Tensor | None = None  # [B, H, e] slots freed by the last eviction of a holed layer
        # ``_free`` still holds the victims' bookkeeping: the next token overwrites it, any other read frees it first
        self._stale = False
        self._new: torch.Tensor | None = None  # [B, H, q] slots of this forward's tokens (holed layer)
        # the model's ``position_ids`` ``[B or 1, q]`` when they are exactly the new tokens' (shared by the layers)
        self.new_positions: torch.Tensor | None = None

    # --- views of the slots attention sees ---------------------------------------------------------------------
    @property
    def view_width(self) -> int:
        return self.occupied if self.dense else self.slots.capacity

    def _view(self, tensor: torch.Tensor) -> torch.Tensor:
        self._settle()
        width = self.view_width
        return tensor if width == tensor.shape[2] else tensor[:, :, :width]

    def _settle(self) -> None:
        """Mark the last decoding step's victims free, if not yet."""
        if self._stale:
            self._stale = False
            self.slots.free_at(self._free)

    def _only_none(self, value: None) -> None:  # transformers' base class sets keys/values to None
        if value is not None:
            raise AttributeError("keys and values are written through update()")

    keys = property(lambda self: None if self.slots is None else self._view(self.slots.keys), _only_none)
    values = property(lambda self: None if self.slots is None else self._view(self.slots.values), _only_none)
    token_idx = property(lambda self: self._view(self.slots.token_idx))
    rope_pos = property(lambda self: self._view(self.slots.rope_pos))
    valid = property(lambda self: self._view(self.slots.valid))
    rank = property(lambda self: self._view(self.slots.rank))
    rows = property(lambda self: tuple(self.slots.token_idx.shape[:2]))  # (B, H_kv)

    @property
    def state(self) -> StateView:
        return StateView(self.slots.state, self._view)

    def real_count(self) -> torch.Tensor:
        return self.slots.real_seen[:, None]

    def new_index(self) -> torch.Tensor:
        if self._new is not None:
            return self._new
        shape = self.slots.token_idx.shape[:2]
        return torch.arange(self.occupied - self.new_tokens, self.occupied, device=self.device).expand(*shape, -1)

    def kept(self) -> StreamView:
        """The stored tokens in stream order, for inspection."""
        self._settle()
        return self.slots.stream_view(self.view_width)

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.slots = SlotBuffers.empty(key_states, value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens into free slots and return every slot this step attends to."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        self.max_chunk = max(self.max_chunk, count)
        if not self.dense and (self._free is None or self._free.shape[-1] != count):
            self.compact()
        needed = self.occupied + count
        if needed > self.slots.capacity:
            budget = getattr(self.policy.config, "budget", None)
            budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
            self.slots.grow(grown_capacity(self.slots.capacity, needed, self.max_chunk, budget))
        state = self.policy.init_state(self, key_states)
        seen = self.seen_step
        if self.seen_tensor is not None:
            seen = seen.add_(count) - count
        if self.dense:
            self._new = None
            self.slots.write_range(self.occupied, key_states, value_states, seen, state, self.all_valid)
        else:
            self._new, self._free = self._free, None
            reused, self._stale = self._stale, False
            # a reused slot of a layer without padding is already marked real: only its token changes
            self.slots.write_at(self._new, key_states, value_states, seen, state, reused and self.all_valid)
            self.ordered = False
        self.occupied = needed
        self.seen += count
        self.new_tokens = count
        keys, values = self.attended()
        setattr(keys, LAYER_ATTRIBUTE, self)
        return keys, values

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns: every slot's keys and values (a layer whose ``attend`` reads its storage itself
        may return stand-ins)."""
        return self.keys, self.values

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        """Record the RoPE positions (``[B, q]``) and validity (``[B, q]``, True = real) of the new tokens."""
        count, positions = self.new_tokens, None
        exact = position_ids is not None and position_ids.shape[-1] == count and position_ids.dim() == 2
        self.new_positions = position_ids if exact and position_ids.device == self.device else None
        if position_ids is not None:
            positions = position_ids if position_ids.shape[-1] == count else position_ids[..., -count:]
            positions = positions if positions.device == self.device else positions.to(self.device)
            if positions.dim() == 3:  # multimodal RoPE sections: the text positions are the first
                positions = positions[0]
        # the caller passes ``padding`` only when some new token is padding
        real = None if padding is None else padding[:, -count:].to(self.device, torch.bool)
        self.all_valid = self.all_valid and padding is None
        one = self.dense and count == 1 and real is None  # one token appended: its slot as an integer
        self.slots.register(self.occupied - 1 if one else self.new_index(), positions, real)

    # --- eviction ------------------------------------------------------------------------------------------
    def after_attention(self, stats: AttentionStats | None, alone: bool = False) -> None:
        """Update the method's statistics and evict (at a decoding step maybe with every layer, unless ``alone``)."""
        if self.policy.one_shot and self.compressed:
            return  # compressed once: decoding appends
        if not alone and self.joint_eviction and defer_eviction(self, stats):
            return
        if self.policy.wants_stats(self):
            self.policy.observe(self, stats)
        if not self.policy.one_shot:
            self.apply(self.policy.select(self))
        elif not (self.defer_compression or self.new_tokens < 2):
            self.compress()

    def compress(self) -> None:
        """Run a one-shot method's deferred compression now."""
        self.defer_compression = False
        if self.policy.one_shot and not self.compressed and self.is_initialized:
            self.compressed = True
            self.apply(self.policy.select(self))
            self.compact(shrink=True)

    def apply(self, rule: Keep | KeepMask | Eviction | None) -> None:
        """Evict what ``rule`` does not keep (``eviction_of``), or what an ``Eviction`` names."""
        if rule is None:
            return
        victims, invalid, dropped = rule if isinstance(rule, Eviction) else self.eviction_of(rule, self.policy)
        if invalid is not None:
            self.slots.valid[:, :, : self.view_width] &= ~invalid
            self.all_valid = False
        if victims is not None:
            self.evict(victims)
        if dropped is not None:
            self.evict_mask(dropped)

    def eviction_of(self, rule: Keep | KeepMask, policy: Policy) -> Eviction:
        """What ``rule`` (``policy``'s) evicts: the lowest-scoring tokens of a ``Keep``, the occupied ``False`` slots
        of a ``KeepMask``."""
        if isinstance(rule, KeepMask):
            return Eviction(dropped=~rule.keep & (self.token_idx >= 0))
        victims, invalid = victims_of_rule(rule, self, protects_forward(policy, rule, self.new_tokens))
        # per-sequence counts (once per prompt): the tokens a sequence keeping fewer than the longest stops counting
        return Eviction(victims, invalid if invalid is not None and bool(invalid.any()) else None)

    def evict(self, victims: torch.Tensor) -> None:
        """Free the slots ``victims`` ``[B, H, e]`` (positions in the views), the same count in every row: the next
        token takes the slot while decoding one token at the budget; otherwise the layer compacts and shrinks."""
        self.before_eviction(victims, None)
        width = self.view_width
        self.occupied -= victims.shape[-1]
        decoding = self.new_tokens == 1 and victims.shape[-1] == 1 and self.policy.position_mode != "cache"
        was_dense, self.dense = self.dense, False
        if decoding and (not was_dense or self._at_capacity(width)):
            self._free = victims if self.free_buffer is None else self.free_buffer.copy_(victims)
            self._stale = True
            return
        self.slots.free_at(victims)
        self.ordered = self.ordered and was_dense
        # a dense layer held ``occupied`` slots in every row, each row lost as many
        self.compact(shrink=not self.more_prompt, used=self.occupied if was_dense else None)

    def _at_capacity(self, width: int) -> bool:
        """Whether a dense layer of ``width`` slots has no room left."""
        return width == self.slots.capacity

    def evict_mask(self, dropped: torch.Tensor) -> None:
        """Free the slots where ``dropped`` ``[B, H, W]`` is True (counts may differ between rows)."""
        self.before_eviction(None, dropped)
        self.slots.free_mask(dropped, self.view_width)
        self.ordered, self.dense = self.ordered and self.dense, False
        self.compact(shrink=not self.more_prompt)

    def expire_window(self) -> None:
        """On a sliding-window layer, free the tokens no later query can see (all but the last ``window - 1``, as
        transformers' sliding layers keep), whatever the method kept; they are not folded or scored."""
        window = self.sliding_window
        if window is None or self.slots is None or self.seen < window:
            return
        self.slots.free_mask((self.token_idx >= 0) & (self.token_idx <= self.seen - window), self.view_width)
        self.ordered, self.dense = self.ordered and self.dense, False
        self.compact(shrink=not self.more_prompt)

    def end_forward(self) -> None:
        """Let go of the forward's ``position_ids``: none outlives it."""
        self.new_positions = None

    def before_eviction(self, victims: torch.Tensor | None, dropped: torch.Tensor | None) -> None:
        """Hook for layers that keep something of what they evict (LESS folds it into its low-rank state)."""

    def compact(self, shrink: bool = False, used: int | None = None) -> None:
        """Gather the occupied slots to the front in stream order; ``shrink`` also gives back the unused capacity
        (keeping room for one token). ``used``: every row holds that many occupied slots (known: no host read)."""
        if self.slots is None or self.slots.capacity == 0:
            return
        self._settle()
        if not self.dense:
            self.occupied, ragged = self.slots.compact(self.view_width, self.ordered, shrink, used)
            self.all_valid = self.all_valid and not ragged
        elif shrink:
            self.slots.shrink(self.occupied + 1)
        self.dense, self.ordered, self._free = True, True, None

    # --- what attention sees -------------------------------------------------------------------------------
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling
    ) -> tuple[torch.Tensor, AttentionStats | None] | None:
        """This layer's own attention, or ``None`` for the default; layers with their own layout override it."""
        return self.policy.attend(self, query, key, value, mask, scaling)

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """Boolean ``[B, H_kv or 1, q, W]`` mask for the last ``query_count`` tokens, or ``None`` if all visible.

        A key is visible if it is real and not in the query's future; a padding query sees itself only, so no row is
        empty. ``None`` also for plain causal attention (dense, no padding: the new tokens are the last slots), whose
        mask the caller builds once per forward."""
        every_slot_real = self.all_valid and self.occupied == self.view_width and sliding_window is None
        if every_slot_real and (self.dense or query_count == 1):
            return None
        heads = 1 if not self.policy.per_head else self.slots.token_idx.shape[1]
        keys = self.token_idx[:, :heads, None, :]
        queries = torch.arange(self.seen - query_count, self.seen, device=self.device)[None, None, :, None]
        mask = (keys <= queries) & (self.valid[:, :heads, None, :] | (keys == queries))
        if sliding_window is not None:
            mask &= keys > queries - sliding_window
        return mask

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In ``cache`` position mode, rotate queries and keys to their rank inside the cache (dense: a real token's
        rank is the count of real tokens before it)."""
        if self.policy.position_mode != "cache" or self._ranks_are_positions():
            return query, key
        valid = self.valid
        rank = valid.cumsum(-1) - 1
        delta = torch.where(valid, rank - self.rope_pos, torch.zeros_like(rank))
        key = rotate_by(key, delta, self.inv_freq)
        groups = query.shape[1] // key.shape[1]
        new = slice(self.view_width - self.new_tokens, self.view_width)
        query_delta = (rank[..., new] - self.rope_pos[..., new]).repeat_interleave(groups, dim=1)
        return rotate_by(query, query_delta, self.inv_freq), key

    def _ranks_are_positions(self) -> bool:
        """Whether every stored key already sits at its rank: nothing dropped, no padding, and every position was the
        token's stream index (checked once per forward)."""
        if not (self.dense and self.all_valid and self.occupied == self.seen and self.stream_positions):
            return False
        positions, first = self.new_positions, self.seen - self.new_tokens
        read = lambda: counts_from(positions, first)  # noqa: E731
        self.stream_positions = positions is not None and self.forward_pass.cached(("stream-positions", first), read)
        return self.stream_positions

    # --- transformers' layer API ---------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.seen

    def stored_length(self) -> int:
        return self.occupied

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.occupied + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.slots = None
        self.is_initialized = False
        self.seen = self.new_tokens = self.occupied = self.max_chunk = 0
        self.compressed = self._stale = False
        self.dense = self.ordered = self.all_valid = self.stream_positions = True
        self._free = self._new = self.new_positions = None
        self.replay_binding = self.seen_tensor = self.free_buffer = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.move_batch(lambda t: t.index_select(0, indices.to(self.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.move_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def move_batch(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (select, repeat) to everything stored per sequence."""
        if self.is_initialized:
            self.slots.map_batch(move)
            self._free = None if self._free is None else move(self._free)

    def crop(self, tokens_to_remove: int) -> None:
        gone = "a compressed cache cannot be cropped: evicted tokens are gone"
        raise NotImplementedError(f"{gone} (assisted decoding and contrastive search need a DynamicCache)")

    # --- accounting (bytes of keys and values, or of bookkeeping and method state, stored or allocated) ------
    def kv_nbytes(self) -> int:
        return self.side_nbytes(False) + (0 if self.slots is None else self.occupied * self.slots.kv_bytes_per_slot())

    def allocated_nbytes(self) -> int:
        slots = self.slots
        return self.side_nbytes(False) + (0 if slots is None else slots.capacity * slots.kv_bytes_per_slot())

    def allocated_metadata_nbytes(self) -> int:
        slots = self.slots
        return self.side_nbytes(True) + (0 if slots is None else slots.capacity * slots.metadata_bytes_per_slot())

    def metadata_nbytes(self) -> int:
        slots = self.slots
        return self.side_nbytes(True) + (0 if slots is None else self.occupied * slots.metadata_bytes_per_slot())

    def side_nbytes(self, metadata: bool) -> int:
        """Bytes a layer holds beside its slots, in both stored and allocated counts: with the keys and values
        (PoD's proximal keys, LESS's ``H``) or with the metadata (``metadata``); none here."""
        return 0
