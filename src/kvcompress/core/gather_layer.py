"""The append-and-gather cache layer: new tokens are concatenated, eviction gathers the kept tokens.

This was the core's layer before slots; it stays for PoD, whose storage (values in every layer, keys only where a
layer block starts) is built on it (PoD appends its stores in place instead, ``core.append_buffer``), and as a
reference the slot layer is tested against. Stored tokens stay in stream order. ``update()`` appends and returns
what the current step attends to; eviction (``apply``) gathers the kept tokens per sequence and head, so tensors
stay rectangular and memory really shrinks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress.core.contract import AttentionStats, Keep, KeepMask, Policy, Selection
from kvcompress.core.eviction import protects_forward
from kvcompress.core.forward import ForwardPass
from kvcompress.core.layer import LAYER_ATTRIBUTE, CompressedLayer
from kvcompress.core.rope import rotate_by
from kvcompress.core.slots import StreamView


class GatherLayer(CacheLayerMixin):
    """One decoder layer's KV store in stream order, appended by ``cat`` and evicted by ``gather``."""

    is_sliding = False
    is_compileable = False
    all_valid = False  # selection helpers take their padding-free shortcuts only on the slot layer
    dense = True  # (``LayerView``) stored in stream order, the forward's tokens last
    seen_tensor = None  # (``LayerView``) never replayed by ``decode_graph``
    new_positions = None  # shared per-forward positions: a slot-layer shortcut (``CompressedLayer.new_positions``)
    is_croppable = False
    sliding_window: int | None = None  # the model's window on this layer (set by the cache; None: global layer)

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.inv_freq = inv_freq
        self.seen = 0
        self.new_tokens = 0
        self.compressed = False
        self.defer_compression = self.more_prompt = False
        # called with this layer after each forward's attention and eviction (inspection, experiments)
        self.observers: list[Callable[[GatherLayer], None]] = []
        self.forward_pass = ForwardPass([self])  # the cache's forward, shared by its layers (``core.forward``)
        self.ordered = True

    # --- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        empty = torch.zeros(batch, heads, 0, dtype=torch.long, device=self.device)
        self.token_idx, self.rope_pos = empty, empty.clone()
        self.valid = empty.bool()
        self.state: dict[str, torch.Tensor] = {}
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens and return everything this step attends to."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, count, _ = key_states.shape
        new_idx = torch.arange(self.seen, self.seen + count, device=self.device).expand(batch, heads, count)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.token_idx = torch.cat([self.token_idx, new_idx], dim=-1)
        self.rope_pos = torch.cat([self.rope_pos, new_idx], dim=-1)
        self.valid = torch.cat([self.valid, torch.ones_like(new_idx, dtype=torch.bool)], dim=-1)
        for name, value in self.policy.init_state(self, key_states).items():
            old = self.state.get(name)
            self.state[name] = value if old is None else torch.cat([old, value], dim=2)
        self.seen += count
        self.new_tokens = count
        setattr(self.keys, LAYER_ATTRIBUTE, self)
        return self.keys, self.values

    def register_new_tokens(self, position_ids: torch.Tensor | None, padding: torch.Tensor | None) -> None:
        """Record the RoPE positions (``[B, q]``) and validity (``[B, q]``, True = real) of the new tokens."""
        count = self.new_tokens
        if position_ids is not None:
            positions = position_ids[..., -count:].to(self.device)
            if positions.dim() == 3:  # multimodal RoPE sections: the text positions are the first
                positions = positions[0]
            self.rope_pos[..., -count:] = positions.expand(self.keys.shape[0], -1)[:, None, :]
        if padding is not None:
            self.valid[..., -count:] = padding[:, -count:].to(self.device, torch.bool)[:, None, :]

    def end_forward(self) -> None:
        """This layer's part of the forward is done (nothing per-forward is kept here; see ``CompressedLayer``)."""

    # --- the views the policies read ------------------------------------------------------------------------
    @property
    def occupied(self) -> int:
        return self.stored_length()

    @property
    def rank(self) -> torch.Tensor:
        """Rank of each stored real token among the stored real tokens of its row (``-1`` for padding)."""
        return torch.where(self.valid, self.valid.cumsum(-1) - 1, -1)

    def kept(self) -> StreamView:
        """The stored tokens in stream order (as they are stored)."""
        return StreamView(self.keys, self.values, self.token_idx, self.rope_pos, self.valid, self.rank, self.state)

    @property
    def view_width(self) -> int:
        return self.token_idx.shape[-1]

    @property
    def rows(self) -> tuple[int, int]:
        return tuple(self.token_idx.shape[:2])

    def new_index(self) -> torch.Tensor:
        """``[B, H, q]`` positions of this forward's tokens in the views (the last ``q``)."""
        width = self.view_width
        return torch.arange(width - self.new_tokens, width, device=self.device).expand(*self.rows, -1)

    def real_count(self) -> torch.Tensor:
        """``[B, H]`` real tokens stored per row."""
        return self.valid.sum(-1)

    def apply(self, selection: Keep | KeepMask | Selection | None) -> None:
        """Keep only the selected tokens (a gather per sequence and head, so tensors stay rectangular)."""
        if selection is None:
            return
        if isinstance(selection, Keep):
            selection = keep_selection(self, selection, protects_forward(self.policy, selection, self.new_tokens))
            if selection is None:
                return
        if isinstance(selection, KeepMask):
            selection = mask_selection(selection.keep)
        index = selection.indices

        def take(tensor: torch.Tensor) -> torch.Tensor:
            shaped = index.reshape(*index.shape, *([1] * (tensor.dim() - 3)))
            return tensor.gather(2, shaped.expand(*index.shape, *tensor.shape[3:]))

        self.keys, self.values = take(self.keys), take(self.values)
        self.token_idx, self.rope_pos, self.valid = (
            take(self.token_idx),
            take(self.rope_pos),
            take(self.valid),
        )
        if selection.valid is not None:
            self.valid = self.valid & selection.valid
        self.state = {name: take(value) for name, value in self.state.items()}

    def after_attention(self, stats: AttentionStats | None) -> None:
        """Update the method's statistics, then evict what the method no longer keeps."""
        if self.policy.one_shot and self.compressed:
            return  # compressed once: decoding appends (attention computed no statistics)
        if self.policy.wants_stats(self):
            self.policy.observe(self, stats)
        if self.policy.one_shot:
            if self.defer_compression or self.new_tokens < 2:
                return
            self.compressed = True
        selection = self.policy.select(self)
        if selection is not None:
            self.apply(selection)

    def expire_window(self) -> None:
        """On a sliding-window layer, drop the tokens no later query can see (all but the last ``window - 1``, as
        transformers' sliding layers keep), whatever the method kept (as ``CompressedLayer.expire_window``)."""
        window = self.sliding_window
        if window is None or not self.is_initialized or self.seen < window:
            return
        keep = self.token_idx > self.seen - window
        if not bool(keep.all()):
            self.apply(mask_selection(keep))

    def compress(self) -> None:
        """Run a one-shot method's compression now (after a deferred, chunked prefill)."""
        self.defer_compression = False
        if self.policy.one_shot and not self.compressed and self.is_initialized:
            self.compressed = True
            selection = self.policy.select(self)
            if selection is not None:
                self.apply(selection)

    attend = CompressedLayer.attend  # the policy's own attention, or None for the default

    # --- what attention sees -------------------------------------------------------------------------------
    def causal_prefix(self, sliding_window: int | None = None) -> bool:
        return False  # the oracle always builds its mask from the stored token indices

    def attention_mask(self, query_count: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """Boolean ``[B, H_kv or 1, q, L]`` mask for the last ``query_count`` tokens, or ``None`` if all visible.

        A key is visible if it is real and not in the query's future; a padding query sees itself only, so no
        row is empty.
        """
        heads = 1 if not self.policy.per_head else self.token_idx.shape[1]
        token_idx, valid = self.token_idx[:, :heads], self.valid[:, :heads]
        length = token_idx.shape[-1]
        no_padding = bool(valid.all())
        if no_padding and sliding_window is None and query_count == 1:
            return None
        query_idx = torch.arange(self.seen - query_count, self.seen, device=self.device)
        keys = token_idx[:, :, None, :]
        queries = query_idx[None, None, :, None]
        mask = (keys <= queries) & (valid[:, :, None, :] | (keys == queries))
        if sliding_window is not None:
            mask &= keys > queries - sliding_window
        if no_padding and sliding_window is None and length == query_count:
            return None  # plain causal prefill: the caller uses is_causal
        return mask

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In ``cache`` position mode, rotate queries and keys to their rank inside the cache."""
        if self.policy.position_mode != "cache":
            return query, key
        rank = self.valid.cumsum(-1) - 1  # [B, H_kv, L]; positions of real tokens inside the cache
        delta = torch.where(self.valid, rank - self.rope_pos, torch.zeros_like(rank))
        key = rotate_by(key, delta, self.inv_freq)
        groups = query.shape[1] // key.shape[1]
        query_delta = (rank[..., -self.new_tokens :] - self.rope_pos[..., -self.new_tokens :]).repeat_interleave(
            groups, dim=1
        )
        return rotate_by(query, query_delta, self.inv_freq), key

    # --- transformers' layer API ---------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        """Tokens seen (logical length); see the module docstring for why this is not the stored length."""
        return self.seen

    def stored_length(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.seen = self.new_tokens = 0
        self.compressed = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        indices = indices.to(self.device)
        for name in ("keys", "values", "token_idx", "rope_pos", "valid"):
            setattr(self, name, getattr(self, name).index_select(0, indices))
        self.state = {name: value.index_select(0, indices) for name, value in self.state.items()}

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        for name in ("keys", "values", "token_idx", "rope_pos", "valid"):
            setattr(self, name, getattr(self, name).repeat_interleave(repeats, dim=0))
        self.state = {name: value.repeat_interleave(repeats, dim=0) for name, value in self.state.items()}

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a compressed cache cannot be cropped: evicted tokens are gone (assisted decoding and "
            "contrastive search need a DynamicCache)"
        )

    # --- accounting ----------------------------------------------------------------------------------------
    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values."""
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def allocated_nbytes(self) -> int:
        """Bytes of the key and value tensors as allocated: this layer's tensors hold exactly what it stores."""
        return self.kv_nbytes()

    def metadata_nbytes(self) -> int:
        """Bytes of the bookkeeping stored beside the keys (positions, validity, method statistics)."""
        if not self.is_initialized:
            return 0
        tensors = [self.token_idx, self.rope_pos, self.valid, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def allocated_metadata_nbytes(self) -> int:
        """The bookkeeping is held as stored (concatenated, no room)."""
        return self.metadata_nbytes()


def keep_selection(layer: GatherLayer, rule: Keep, protect_new: bool = False) -> Selection | None:
    """The kept indices of a ``Keep`` rule: per row the ``count`` highest-scoring valid tokens, protected first,
    equal scores to the newer token (a stable sort over the reversed stream order). ``protect_new``: this forward's
    tokens (the last stored) rank above every unprotected token, as ``CompressedLayer`` ranks them."""
    valid = layer.valid
    n_valid = valid.sum(-1).amax(1)  # [B]; equal across heads
    keep = torch.minimum(torch.as_tensor(rule.count, device=valid.device).expand_as(n_valid), n_valid)
    if bool((n_valid <= keep).all()) and valid.shape[-1] == int(keep.max()):
        return None
    scores = rule.scores.to(torch.float64).expand(-1, valid.shape[1], -1)
    ranked = scores.masked_fill(~valid, -math.inf)
    if protect_new and layer.new_tokens:
        new = slice(ranked.shape[-1] - layer.new_tokens, None)
        ranked[..., new] = ranked[..., new].masked_fill(valid[..., new], torch.finfo(ranked.dtype).max)
    if rule.protected is not None:
        ranked = ranked.masked_fill(rule.protected & valid, math.inf)
    k = int(keep.max())
    length = ranked.shape[-1]
    newest_first = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    order = length - 1 - newest_first  # best first
    slot_ok = torch.arange(k, device=valid.device)[None, None, :] < keep[:, None, None]
    indices, perm = order.sort(dim=-1)
    slot_ok = slot_ok.expand_as(order).gather(-1, perm) & valid.gather(-1, indices)
    return Selection(indices=indices, valid=slot_ok)


def mask_selection(keep: torch.Tensor) -> Selection:
    """A ``Selection`` of the ``True`` slots of ``keep`` ``[B, H, L]``; short rows are filled with invalid slots."""
    length = keep.shape[-1]
    position = torch.arange(length, device=keep.device)
    order = torch.where(keep, position, position + length)  # kept slots first, then filler, each in stream order
    count = int(keep.sum(-1).max())
    indices = order.argsort(dim=-1)[..., :count].sort(dim=-1).values
    return Selection(indices=indices, valid=keep.gather(-1, indices))
