"""The LESS cache layer: a ``CompressedLayer`` that folds every token it evicts into a low-rank state first.

Per sequence and KV head it keeps ``low_rank_h`` ``[B, H_kv, R, D]`` (``H``) and ``low_rank_z`` ``[B, H_kv, R]``
(``z``), float32. ``before_eviction`` computes ψ of the real tokens being evicted, adds ``ψ(k)ᵀ v`` to ``H``
(Eqs. 4–5), then gathers the kept tokens as usual. The policy (``kvcompress.methods.less.policy``) reads the
state in its attention term.
"""

from __future__ import annotations

import torch

from kvcompress.core.layer import CompressedLayer


class LessLayer(CompressedLayer):
    """Compressed keys/values plus LESS's state ``H``, ``z`` of everything evicted."""

    def __init__(self, policy, inv_freq: torch.Tensor | None = None) -> None:
        super().__init__(policy, inv_freq)
        self.low_rank_h: torch.Tensor | None = None
        self.low_rank_z: torch.Tensor | None = None
        self.folded = False  # something was evicted (and folded) since the last reset

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, dim = value_states.shape
        rank = self.policy.config.state_rank
        self.low_rank_h = torch.zeros(batch, heads, rank, dim, dtype=torch.float32, device=self.device)
        self.low_rank_z = torch.zeros(batch, heads, rank, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def before_eviction(self, victims: torch.Tensor | None, dropped: torch.Tensor | None) -> None:
        """Add ``ψ(k)ᵀ v`` and ``ψ(k)`` of the real tokens about to be evicted to ``H`` and ``z`` (Eqs. 4–5):
        the ``victims`` ``[B, H_kv, e]`` slots, or the ``dropped`` ``[B, H_kv, W]`` ones."""
        kernels = self.policy.kernels
        if kernels is None:  # evicting before any attention (not reached through the attention function)
            raise RuntimeError("LESS kernels are set at the layer's first attention; evict only after attention")
        if victims is None:
            evicted = dropped & self.valid
            count = int(evicted.sum(-1).max()) if evicted.numel() else 0
            if count == 0:
                return
            victims = evicted.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :count]
        weight = self.valid.gather(-1, victims).float()  # [B, H_kv, e]: 0 for padding and free slots
        index = victims[..., None].expand(*victims.shape, self.keys.shape[-1])
        keys, values = self.keys.gather(2, index), self.values.gather(2, index)
        features = kernels.psi(keys) * weight[..., None]  # [B, H_kv, e, R]
        self.low_rank_h += features.transpose(-1, -2) @ values.float()
        self.low_rank_z += features.sum(-2)
        self.folded = True

    def reset(self) -> None:
        super().reset()
        self.low_rank_h = self.low_rank_z = None
        self.folded = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.is_initialized:
            indices = indices.to(self.device)
            self.low_rank_h = self.low_rank_h.index_select(0, indices)
            self.low_rank_z = self.low_rank_z.index_select(0, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.is_initialized:
            self.low_rank_h = self.low_rank_h.repeat_interleave(repeats, dim=0)
            self.low_rank_z = self.low_rank_z.repeat_interleave(repeats, dim=0)

    def kv_nbytes(self) -> int:
        """Stored keys and values plus the state ``H`` (it stands in for the evicted keys and values)."""
        if not self.is_initialized:
            return 0
        return super().kv_nbytes() + self.low_rank_h.numel() * self.low_rank_h.element_size()

    def metadata_nbytes(self) -> int:
        """Positions and statistics plus the normaliser ``z``."""
        if not self.is_initialized:
            return 0
        return super().metadata_nbytes() + self.low_rank_z.numel() * self.low_rank_z.element_size()
