"""``QuantizedSlotBuffers`` with ``key_heads`` (the keys of some KV heads only, as PoD stores them): every read of
them equals, bit for bit, the same read of buffers holding every head's keys, at the key heads' rows. Quantization
works per (sequence, head) row, so the heads left out change nothing of the others'."""

from __future__ import annotations

import torch

from kvcompress.core.quantized_slots import QuantizedSlotBuffers

BITS, GROUP, RESIDUAL = 4, 4, 8
KEY_HEADS = torch.tensor([0, 2])


def _pair(keys: torch.Tensor, values: torch.Tensor) -> tuple[QuantizedSlotBuffers, QuantizedSlotBuffers]:
    every = QuantizedSlotBuffers.empty_quantized(keys[:, :, :1], values[:, :, :1], BITS, GROUP, RESIDUAL)
    some = QuantizedSlotBuffers.empty_quantized(
        keys[:, KEY_HEADS, :1], values[:, :, :1], BITS, GROUP, RESIDUAL, KEY_HEADS
    )
    return every, some


def _same(every: QuantizedSlotBuffers, some: QuantizedSlotBuffers, width: int) -> None:
    keys, values = every.view(width)
    some_keys, some_values = some.view(width)
    assert some_keys.shape[1] == len(KEY_HEADS)
    assert torch.equal(some_keys, keys[:, KEY_HEADS]) and torch.equal(some_values, values)
    index = torch.randint(0, width, (*every.token_idx.shape[:2], 5), generator=torch.Generator().manual_seed(width))
    read_keys, read_values = every.read_at(index, width)
    some_read_keys, some_read_values = some.read_at(index, width)
    assert torch.equal(some_read_keys, read_keys[:, KEY_HEADS]) and torch.equal(some_read_values, read_values)
    assert torch.equal(some_read_keys, some_keys.gather(2, index[:, KEY_HEADS, :, None].expand(-1, -1, -1, 16)))
    stream, some_stream = every.stream_view(width), some.stream_view(width)
    assert torch.equal(some_stream.keys, stream.keys[:, KEY_HEADS]) and torch.equal(some_stream.values, stream.values)
    assert torch.equal(some_stream.token_idx, stream.token_idx)
    assert torch.equal(some.keys, every.keys[:, KEY_HEADS])  # the codes themselves
    assert torch.equal(some.key_scale, every.key_scale[:, KEY_HEADS])
    assert torch.equal(some.key_min, every.key_min[:, KEY_HEADS])


def test_key_heads_read_as_every_heads_buffers_do():
    """A chunk, single tokens (the residual window moving a key group at a time), an eviction of different slots
    per head and the compaction that forms the key groups anew, then single tokens into the compacted slots."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 50, 16, generator=generator) * 3, torch.randn(2, 3, 50, 16, generator=generator)
    buffers = _pair(keys, values)
    for slots, own_keys in zip(buffers, (keys, keys[:, KEY_HEADS]), strict=True):
        slots.grow(64)
        slots.write_range(0, own_keys[:, :, :20], values[:, :, :20], 0, {})
    _same(*buffers, 20)
    for t in range(20, 33):
        for slots, own_keys in zip(buffers, (keys, keys[:, KEY_HEADS]), strict=True):
            slots.end_forward()
            slots.write_range(t, own_keys[:, :, t : t + 1], values[:, :, t : t + 1], t, {}, no_padding=True)
        _same(*buffers, t + 1)
    dropped = torch.rand(2, 3, 33, generator=generator) < 0.3  # different slots per sequence and head
    dropped[..., -RESIDUAL:] = False
    dropped[..., :4] = dropped[..., :4] | (torch.arange(3) == 1)[None, :, None]  # head 1 drops more: ragged rows
    for slots in buffers:
        slots.end_forward()
        slots.free_mask(dropped, 33)
        used, _ = slots.compact(33, True, False)
    _same(*buffers, used)
    for step, t in enumerate(range(33, 45)):
        for slots, own_keys in zip(buffers, (keys, keys[:, KEY_HEADS]), strict=True):
            slots.end_forward()
            slots.write_range(used + step, own_keys[:, :, t : t + 1], values[:, :, t : t + 1], t, {})
        _same(*buffers, used + step + 1)
