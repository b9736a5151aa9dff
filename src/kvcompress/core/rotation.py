"""RoPE rotations as matrices, built once per forward and shared by every layer that rotates alike.

A layer that stores keys at one position and attends at another (the circular sink cache) rotates a query or a key
from the position the model rotated it with (``position_ids``) to a target position. Every layer of a forward gets
the same ``position_ids`` tensor and layers in the same state want the same targets, so the rotations are built
once, as one ``[B, d, k d]`` matrix per set of targets (``x @ M`` gives ``x`` rotated to each of the ``k`` targets
in one matmul), and kept on the ``position_ids`` tensor for the layers that follow. Nothing is read back to the
host: the targets are Python integers and the positions stay on the device. (A ``position_ids`` tensor is assumed
not to be modified in place between forwards; transformers builds a new one for every forward.)
"""

from __future__ import annotations

import torch

from kvcompress.core.forward_cache import forward_cached


def rotation_matrices(
    position_ids: torch.Tensor, targets: tuple[int, ...], inv_freq: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[B, d, k d]``: for a vector ``x`` rotated at ``position_ids[b, -1]``, ``x @ M[b]`` holds ``x`` rotated to
    each of the ``targets`` (``rotate_half`` convention; only the first ``2 len(inv_freq)`` dimensions rotate)."""
    key = ("rotations", targets, inv_freq.data_ptr(), dim, dtype)
    return forward_cached(
        position_ids, key, lambda: _build(position_ids[..., -1].reshape(-1), targets, inv_freq, dim, dtype)
    )


def frame_rotation(
    position_ids: torch.Tensor | None, delta: int, inv_freq: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[d, d]``: ``x @ M`` rotates ``x`` further by ``delta`` positions, whatever its position (angles in float64,
    so a large ``delta`` is as precise as a small one). Shared by the layers of a forward when ``position_ids`` is
    given, built on the spot otherwise."""
    key = ("frame", delta, inv_freq.data_ptr(), dim, dtype)

    def build() -> torch.Tensor:
        angles = delta * inv_freq.to(torch.float64)
        return _matrix(angles.cos(), angles.sin(), dim).to(dtype)

    return build() if position_ids is None else forward_cached(position_ids, key, build)


def _build(
    positions: torch.Tensor, targets: tuple[int, ...], inv_freq: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    delta = torch.stack([target - positions for target in targets], 1)  # [B, k]
    angles = delta.float()[..., None] * inv_freq.to(positions.device)  # [B, k, h], as the model computes them
    rotation = _matrix(angles.cos(), angles.sin(), dim)  # [B, k, d, d]
    batch, count = delta.shape
    return rotation.permute(0, 2, 1, 3).reshape(batch, dim, count * dim).to(dtype)


def _matrix(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """``[..., d, d]`` rotation matrices from ``cos``, ``sin`` ``[..., h]``, input dimension ``i`` (rows) to output
    ``j`` (columns): ``out[:h] = x[:h] cos - x[h:] sin``, ``out[h:] = x[h:] cos + x[:h] sin``; dimensions past
    ``2 h`` pass through (partial rotary)."""
    cos, sin = torch.diag_embed(cos), torch.diag_embed(sin)
    rotation = torch.cat([torch.cat([cos, sin], -1), torch.cat([-sin, cos], -1)], -2)
    rotary = rotation.shape[-1]
    if rotary < dim:
        rotation = torch.nn.functional.pad(rotation, (0, dim - rotary, 0, dim - rotary))
        rotation[..., rotary:, rotary:] = torch.eye(dim - rotary, device=rotation.device)
    return rotation
