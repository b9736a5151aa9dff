"""RoPE rotations built once per forward and shared by every layer that rotates alike (the cascade's rings).

A layer that stores keys at one position and attends at another rotates a query or a key from the position the
model rotated it with (``position_ids``) to target positions (Python integers: nothing is read back to the host).
All use the ``rotate_half`` convention; only the first ``2 len(inv_freq)`` dimensions rotate (partial rotary); the
angles are computed in float64: a target can lie far from the position, and a float32 angle that large is off by
~1e-5 rad, which the model's own rotations at the true positions are not.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvcompress.core.forward import ForwardPass, from_host


def rotation_to(
    position_ids: torch.Tensor,
    targets: tuple[int | torch.Tensor, ...],
    inv_freq: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    scale: float = 1.0,
    forward: ForwardPass | None = None,
    tag: Hashable = None,
) -> torch.Tensor:
    """``[B, 1, d, k d]``: for ``x`` ``[B, H, 1, d]`` rotated at ``position_ids[b, -1]``, ``turn(x, rotation_to(...))``
    holds ``x`` rotated to each of the ``targets`` (ints, or 0-dim integer tensors: a replayed step's), times
    ``scale``. Built once per ``forward`` where it is given; ``tag`` tells apart position tensors of one forward (one
    per token where its tokens are stepped in turn)."""

    def build() -> torch.Tensor:
        positions = position_ids[..., -1].reshape(-1)
        delta = torch.stack([target - positions for target in targets], 1)  # [B, k]
        cos, sin, swap = _cos_sin(delta, inv_freq, dim, scale)  # [B, k, d]
        index = torch.arange(dim, device=cos.device)
        # output dimension j (of target f) = x_j cos_fj + x_swap(j) sin_fj, rows the input dimensions; written entry
        # by entry (no dense intermediates), sin first: a pass-through dimension (swap(j) = j, sin 0) keeps its cos
        rotation = torch.zeros(cos.shape[0], dim, cos.shape[1], dim, dtype=dtype, device=cos.device)  # [B, d, k, d]
        rotation[:, swap, :, index] = sin.permute(2, 0, 1).to(dtype)
        rotation[:, index, :, index] = cos.permute(2, 0, 1).to(dtype)
        return rotation.view(cos.shape[0], 1, dim, -1)

    key = ("rotation-to", tag, targets, inv_freq.data_ptr(), dim, dtype, scale)
    return build() if forward is None else forward.cached(key, build)


def frames_along(
    position_ids: torch.Tensor,
    targets: list[tuple[int, ...]],
    inv_freq: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``turn_along`` needs to rotate each of the last ``q = len(targets)`` positions of ``position_ids``
    (``[rows, >= q]``) to its own ``k`` targets ``targets[m]``: ``cos``, ``sin`` ``[q rows, 1, k, d]`` (``m`` major,
    times ``scale``) and the dimension each output dimension pairs with (``d`` times smaller than ``rotation_to``)."""
    rows, count = position_ids.shape[0], len(targets)
    positions = position_ids[:, -count:].t().reshape(-1)  # [q rows]
    per_row = from_host(targets, position_ids.device).repeat_interleave(rows, 0)  # [q rows, k]
    delta = per_row - positions[:, None]
    cos, sin, swap = _cos_sin(delta, inv_freq, dim, scale)
    return cos[:, None].to(dtype), sin[:, None].to(dtype), swap


def turn_along(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, n, d]`` rotated to each of the ``k`` targets of ``frames_along``: ``[N, n, k, d]``."""
    return torch.addcmul(x[:, :, None] * cos, x.index_select(-1, swap)[:, :, None], sin)


def turn(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, 1, d]`` rotated by ``rotation_to`` to each target: ``[B, H, k, d]`` (one matmul)."""
    batch, heads, _, dim = x.shape
    rows = rotation.shape[0]  # B, or 1 for position_ids shared by the batch
    return torch.bmm(x.reshape(rows, -1, dim), rotation.view(rows, dim, -1)).view(batch, heads, -1, dim)


def _cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor, dim: int, scale: float) -> tuple[torch.Tensor, ...]:
    """For turns by ``delta`` positions (``[...]`` integers): ``cos``, ``sin`` ``[..., d]`` (float64, times
    ``scale``) and ``swap`` ``[d]`` such that output dimension ``j`` = ``x_j cos_j + x_swap(j) sin_j``."""
    angles = delta.double()[..., None] * inv_freq.to(delta.device, torch.float64)  # [..., h]
    cos, sin = angles.cos(), angles.sin()
    half = cos.shape[-1]
    rest = dim - 2 * half  # partial rotary: these dimensions pass through
    cos = torch.cat([cos, cos, cos.new_ones(*cos.shape[:-1], rest)], -1) * scale
    sin = torch.cat([-sin, sin, sin.new_zeros(*sin.shape[:-1], rest)], -1) * scale
    index = torch.arange(dim, device=delta.device)
    swap = torch.cat([index[half : 2 * half], index[:half], index[2 * half :]])
    return cos, sin, swap


def frame_rotation(
    forward: ForwardPass, delta: int, inv_freq: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[d, d]``: ``x @ M`` rotates ``x`` further by ``delta`` positions, shared by the layers of a forward."""
    key = ("frame", delta, inv_freq.data_ptr(), dim, dtype)
    return forward.cached(key, lambda: frame_rotation_at(delta, inv_freq, dim, dtype))


def frame_rotation_at(delta: int | torch.Tensor, inv_freq: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``frame_rotation`` of a ``delta`` held on the device (a 0-dim integer tensor), or of an int, not shared."""
    angles = inv_freq.to(torch.float64) * delta
    cos, sin = torch.diag_embed(angles.cos()), torch.diag_embed(angles.sin())
    rotation = torch.cat([torch.cat([cos, sin], -1), torch.cat([-sin, cos], -1)], -2)
    rotary = rotation.shape[-1]
    if rotary < dim:
        rotation = torch.nn.functional.pad(rotation, (0, dim - rotary, 0, dim - rotary))
        rotation[..., rotary:, rotary:] = torch.eye(dim - rotary, device=rotation.device)
    return rotation.to(dtype)
