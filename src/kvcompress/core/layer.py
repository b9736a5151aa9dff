"""The compressed cache: a ``transformers`` ``Cache`` whose layers really store only what their method keeps.

Each ``CompressedLayer`` holds, per sequence and KV head, the kept keys and values (``[B, H_kv, L, d]``) and
beside them, aligned token by token (``[B, H_kv, L]``):

- ``token_idx``: the token's index in the stream (tokens seen so far, padding included), used for causality;
- ``rope_pos``: the RoPE position the key was rotated with (the model's ``position_ids``);
- ``valid``: whether the slot holds a real token (left padding and filler slots are not real and never count
  against a budget);
- ``state``: the method's per-token statistics (accumulated attention, EMA scores, ...).

Stored tokens stay in stream order. ``update()`` appends and returns what the current step attends to, as in
``DynamicLayer``; eviction is a separate step (``apply``) run by the attention function after the layer's
attention, when this forward's statistics are known.

``get_seq_length()`` returns the logical length (tokens seen), as ``DynamicSlidingWindowLayer`` does: that is what
``generate`` and the model use to place new tokens. ``stored_length()`` is the physical length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcompress.core.contract import AttentionStats, Policy, Selection
from kvcompress.core.rope import rotate_by

LAYER_ATTRIBUTE = "_kvcompress_layer"


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's compressed KV store, driven by a method ``Policy``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, policy: Policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.inv_freq = inv_freq
        self.seen = 0
        self.new_tokens = 0
        self.compressed = False
        self.defer_compression = False
        # called with this layer after each forward's attention and eviction (inspection, experiments)
        self.observers: list[Callable[[CompressedLayer], None]] = []

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

    def apply(self, selection: Selection) -> None:
        """Keep only the selected tokens (a gather per sequence and head, so tensors stay rectangular)."""
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
        self.policy.observe(self, stats)
        if self.policy.one_shot:
            if self.compressed or self.defer_compression or self.new_tokens < 2:
                return
            self.compressed = True
        selection = self.policy.select(self)
        if selection is not None:
            self.apply(selection)

    def compress(self) -> None:
        """Run a one-shot method's compression now (after a deferred, chunked prefill)."""
        self.defer_compression = False
        if self.policy.one_shot and not self.compressed and self.is_initialized:
            self.compressed = True
            selection = self.policy.select(self)
            if selection is not None:
                self.apply(selection)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling
    ) -> tuple[torch.Tensor, AttentionStats | None] | None:
        """This layer's own attention, or ``None`` for the default; layers with their own layout override it."""
        return self.policy.attend(self, query, key, value, mask, scaling)

    # --- what attention sees -------------------------------------------------------------------------------
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

    def metadata_nbytes(self) -> int:
        """Bytes of the bookkeeping stored beside the keys (positions, validity, method statistics)."""
        if not self.is_initialized:
            return 0
        tensors = [self.token_idx, self.rope_pos, self.valid, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
