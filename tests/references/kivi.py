"""An independent reference of KIVI's quantized cache (arXiv 2402.02750) with no eviction: what attention reads.

It keeps every key and value exactly and, at each forward, returns them as KIVI's cache would hand them to
attention: keys quantized per channel over groups of ``group`` tokens in stream order, values per token over groups
of ``group`` channels, min-max asymmetric with ``bits`` bits (``code = round((x - min) / scale)``, ``scale = (max -
min) / (2**bits - 1)``, both parameters rounded to the model's dtype, read back as ``code * scale + min``), and the
newest tokens exact: the forward's own, and those from the residual window's start on, which moves a whole group at
a time (the first multiple of ``group`` at or after ``T - residual``, ``T`` the tokens seen). Plain loops over
groups and tokens, no packing, no slots: nothing of ``kvcompress.core.kivi`` or ``core.quantized_slots``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


def minmax_roundtrip(block: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``block`` quantized min-max over ``dim`` and read back (parameters in ``block``'s dtype)."""
    x = block.float()
    low = x.amin(dim, keepdim=True).to(block.dtype)
    scale = ((x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / (2**bits - 1)).to(block.dtype)
    divisor = torch.where(scale > 0, scale.float(), torch.ones_like(scale.float()))
    codes = torch.round((x - low.float()) / divisor).clamp(0, 2**bits - 1)
    return codes.to(block.dtype) * scale + low


def kivi_read(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int, residual: int, fresh: int):
    """What attention reads of the exact ``keys``/``values`` ``[B, H, T, d]`` after a forward of ``fresh`` tokens."""
    total = keys.shape[2]
    window = max(0, -(-(total - residual) // group) * group) if residual else total
    exact_from = min(total - fresh, window)
    keys_read, values_read = keys.clone(), values.clone()
    for start in range(0, exact_from, group):
        stop = start + group
        assert stop <= total, "a token outside the residual window in an incomplete group (residual < group?)"
        upto = min(stop, exact_from)
        keys_read[:, :, start:upto] = minmax_roundtrip(keys[:, :, start:stop], bits, dim=2)[:, :, : upto - start]
    for token in range(exact_from):
        for channel in range(0, values.shape[-1], group):
            block = values[:, :, token, channel : channel + group]
            values_read[:, :, token, channel : channel + group] = minmax_roundtrip(block, bits, dim=-1)
    return keys_read, values_read


class KiviReferenceLayer(DynamicLayer):
    def __init__(self, bits: int, group: int, residual: int) -> None:
        super().__init__()
        self.bits, self.group, self.residual = bits, group, residual

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return kivi_read(keys, values, self.bits, self.group, self.residual, key_states.shape[2])


class KiviReferenceCache(Cache):
    """A ``transformers`` cache of ``layers`` ``KiviReferenceLayer``s."""

    def __init__(self, layers: int, bits: int, group: int, residual: int) -> None:
        super().__init__(layers=[KiviReferenceLayer(bits, group, residual) for _ in range(layers)])
