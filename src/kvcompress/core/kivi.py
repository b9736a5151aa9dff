"""KIVI's asymmetric integer quantization of keys and values (arXiv 2402.02750), in plain PyTorch ops.

Both tensors are quantized min-max, asymmetric, with ``bits`` bits (2, 4 or 8): a group of numbers ``x`` is stored
as codes ``q = round((x - min) / scale)`` clamped to ``[0, 2**bits - 1]``, with ``scale = (max - min) /
(2**bits - 1)`` and ``min`` kept per group, and read back as ``q * scale + min``: the arithmetic of KIVI's code
and of optimum-quanto's ``MaxOptimizer`` + ``quantize_weight`` (transformers' ``QuantizedCache`` quanto backend).
What forms a group differs, as in KIVI:

- **keys per channel**: each channel of ``group`` consecutive tokens (``quantize_keys`` over ``[..., n, group,
  d]``), since key outliers sit in fixed channels;
- **values per token**: each run of ``group`` consecutive channels of one token (``quantize_values``), so the
  head dimension must be a multiple of ``group``.

Scales and minima are computed in float32, rounded to the storage dtype (the model's), and the codes are computed
with those rounded parameters, so dequantizing with the stored parameters is what was meant. A group whose numbers
are all equal gets a zero scale and codes 0 (it reads back exactly). Codes of ``bits < 8`` are packed into bytes
along the last dimension, ``k = 8 // bits`` codes per byte (``pack``/``unpack``): a byte holds channels ``w / k``
apart, so each shift of the packed bytes gives a contiguous run of channels, dequantized in one op.

Choice: plain tensor ops rather than a library. optimum-quanto's and HQQ's quantized tensors (the backends of
transformers' ``QuantizedCache``) quantize a whole tensor at once and are rebuilt to change one token, while a
compressed cache rewrites single slots in place every step; torchao's ``quantize_affine`` computes the same
arithmetic with more dispatch per call and packs 4-bit codes only for its GPU layouts. The min-max arithmetic is
four tensor ops, packing one shift and one ``or`` per code in a byte.
"""

from __future__ import annotations

import torch

BITS = (2, 4, 8)


def packed_width(width: int, bits: int) -> int:
    """Bytes of ``width`` codes of ``bits`` bits (``width`` a multiple of ``8 // bits``)."""
    return width * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``[..., w]`` (each ``< 2**bits``) packed to ``[..., w * bits / 8]``: byte ``j`` holds codes
    ``j, j + w/k, j + 2w/k, ...`` (``k = 8 // bits`` codes per byte, the first in the low bits), so unpacking gives
    ``k`` contiguous runs of channels."""
    if bits == 8:
        return codes
    parts = codes.unflatten(-1, (8 // bits, -1))
    packed = parts[..., 0, :].clone()
    for index in range(1, 8 // bits):
        packed |= parts[..., index, :] << (bits * index)
    return packed


def unpacked_part(packed: torch.Tensor, bits: int, index: int) -> torch.Tensor:
    """Codes of the ``index``-th run of channels held in ``packed`` (``uint8``)."""
    if bits == 8:
        return packed
    shifted = packed >> (bits * index) if index else packed
    return shifted & ((1 << bits) - 1) if index < 8 // bits - 1 else shifted


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``unpack`` written into ``out`` ``[..., w * 8 / bits]`` of any dtype (a float buffer, a strided view): each
    run of channels in one op that reads the bytes and converts on writing (a mask for the first run, a shift for
    the last, both for the ones between), with no ``uint8`` intermediate of the unpacked size."""
    runs = 8 // bits
    if runs == 1:
        out.copy_(packed)
        return
    width = packed.shape[-1]
    mask = (1 << bits) - 1  # (Python numbers: a tensor made of one is two more operations a call)
    if out.device.type != "cpu":  # CUDA's bitwise kernels write integer outputs only: unpack, then convert
        for index in range(runs):
            out[..., index * width : (index + 1) * width] = unpacked_part(packed, bits, index)
        return
    for index in range(runs):
        target = out[..., index * width : (index + 1) * width]
        if index == 0:
            torch.bitwise_and(packed, mask, out=target)
        elif index == runs - 1:
            torch.bitwise_right_shift(packed, bits * index, out=target)
        else:
            torch.bitwise_and(packed >> (bits * index), mask, out=target)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack``: ``uint8`` codes ``[..., w]``."""
    if bits == 8:
        return packed
    return torch.cat([unpacked_part(packed, bits, index) for index in range(8 // bits)], dim=-1)


def _min_scale(
    low: torch.Tensor, high: torch.Tensor, bits: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and scale of groups spanning ``[low, high]`` (float32), rounded to ``dtype``."""
    scale = (high - low) / ((1 << bits) - 1)
    return low.to(dtype), scale.to(dtype)


def _codes(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """``round((x - low) / scale)`` in float32 with the stored (rounded) parameters, clamped, as ``uint8``."""
    low, scale = low.float(), scale.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x.float() - low) / safe).clamp_(0, (1 << bits) - 1)
    return codes.to(torch.uint8)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``values`` ``[..., d]`` in groups of ``group`` channels: packed codes ``[..., d *
    bits / 8]``, ``scale`` and ``min`` ``[..., d / group]`` in ``values``' dtype."""
    grouped = values.float().unflatten(-1, (-1, group))
    low, scale = _min_scale(grouped.amin(-1), grouped.amax(-1), bits, values.dtype)
    codes = _codes(grouped, low[..., None], scale[..., None], bits)
    return pack(codes.flatten(-2), bits), scale, low


def dequantize_values(
    packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., d]`` values back from ``quantize_values``' output (written into ``out`` when given): the codes
    unpacked into ``out``, then scaled and shifted there (no other copy of the output's size)."""
    groups = scale.shape[-1]
    width = packed.shape[-1] * 8 // bits
    if out is None:
        out = scale.new_empty(*packed.shape[:-1], width)
    unpack_into(packed, bits, out)
    grouped = out.unflatten(-1, (groups, -1))
    torch.addcmul(low[..., None], grouped, scale[..., None], out=grouped)
    return out


def quantize_keys(
    keys: torch.Tensor, bits: int, occupied: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel quantization of ``keys`` ``[..., n, G, d]``: each channel of each group of ``G`` tokens gets its
    own scale and minimum (``[..., n, d]``, ``keys``' dtype); codes ``[..., n, G, d * bits / 8]``.

    ``occupied`` ``[..., n, G]``: tokens to count in the range (free slots are left out; a group with none gets a
    zero scale and minimum)."""
    x = keys.float()
    if occupied is None:
        low, high = x.amin(-2), x.amax(-2)
    else:
        inside = occupied[..., None]
        low = torch.where(inside, x, torch.inf).amin(-2)
        high = torch.where(inside, x, -torch.inf).amax(-2)
        empty = ~occupied.any(-1)[..., None]
        low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    low, scale = _min_scale(low, high, bits, keys.dtype)
    codes = _codes(x, low[..., None, :], scale[..., None, :], bits)
    return pack(codes, bits), scale, low


def dequantize_keys(
    packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., n, G, d]`` keys back from ``quantize_keys``' output (written into ``out`` when given), as
    ``dequantize_values`` does."""
    if out is None:
        out = scale.new_empty(*packed.shape[:-1], scale.shape[-1])
    unpack_into(packed, bits, out)
    torch.addcmul(low[..., None, :], out, scale[..., None, :], out=out)
    return out
