"""Where vLLM's CPU attention kernel keeps each key element: learnt from vLLM's own cache writer, per layout.

vLLM's CPU KV cache is a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor whose content is laid
out for the kernel's ISA (``vec``, ``vec16``, ``amx``, ``neon``, ``vsx``, ``vxe``, ``rvv``: chosen by vLLM from the
CPU, the dtype, the block size and the head size), e.g. ``vec`` stores a ``[block, head]`` key slab transposed.
Block SnapKV needs the prompt's keys back (and the one-pass attention of the scored policies their values too), so
instead of assuming one layout, ``KeyLayout`` writes probe keys and values through vLLM's
``cpu_attn_reshape_and_cache`` for the layer's ISA and records where each ``(head, token, dim)`` key and value
element lands in a block: every layout vLLM can write is read back exactly, without knowing it.

The probe values are small integers (exact in bfloat16 and float16), one pass per base-128 digit of each
coordinate. The probe also checks what the block moves of ``kvcompress.vllm.snapkv`` rely on: each KV head's
keys and values lie inside its own ``[block, head]`` slab. A layout that breaks this, an ISA whose kernel this
vLLM build lacks, or a quantised (fp8) cache is refused with a ``ValueError`` naming it, when the engine builds
its attention metadata (start-up), not at the first compression.
"""

from __future__ import annotations

import torch

DIGIT = 128  # probe values 1..DIGIT are exact integers in every floating KV dtype vLLM's CPU cache uses


class KeyLayout:
    """The offsets, in one block of the CPU KV cache, of each key and value element ``[head, token, dim]``."""

    def __init__(self, isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_size: int) -> None:
        self.isa = isa
        if not dtype.is_floating_point:
            raise ValueError(
                f"kvcompress: snapkv reads keys back from the KV cache and needs a floating-point cache "
                f"(--kv-cache-dtype auto), not {dtype}"
            )
        self.shape = (num_kv_heads, block_size, head_size)
        self.offsets = self._learn("key", dtype)  # offset in the block of key element (head, token, dim), row-major
        self.value_offsets = self._learn("value", dtype)  # the same for the values
        self.strides = {False: self._affine(self.offsets), True: self._affine(self.value_offsets)}

    def _affine(self, offsets: torch.Tensor) -> tuple[int, int, int, int] | None:
        """``(base, head, token, dim)`` strides when ``offsets`` are ``base + head * h + token * t + dim * d`` (a
        strided view of the cache reads them without an index per element: ``vec`` and ``vec16`` are), else None."""
        heads, block_size, head_size = self.shape
        grid = offsets.view(self.shape)
        base = int(grid[0, 0, 0])
        strides = [int(grid[1, 0, 0]) - base if heads > 1 else 0]
        strides.append(int(grid[0, 1, 0]) - base if block_size > 1 else 0)
        strides.append(int(grid[0, 0, 1]) - base if head_size > 1 else 0)
        h, t, d = torch.meshgrid(*(torch.arange(n) for n in self.shape), indexing="ij")
        if torch.equal(grid, base + h * strides[0] + t * strides[1] + d * strides[2]) and min(strides) >= 0:
            return base, strides[0], strides[1], strides[2]
        return None

    def _learn(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        """Where vLLM's writer puts each ``part`` (``"key"`` or ``"value"``) element of a block, probed digit by digit;
        checked one to one and inside the element's ``[block, head]`` slab."""
        num_kv_heads, block_size, head_size = self.shape
        coordinates = torch.stack(
            torch.meshgrid(*(torch.arange(n) for n in self.shape), indexing="ij"), dim=-1
        ).reshape(-1, 3)  # [(head, token, dim)] of every element
        offsets = None
        decoded = torch.zeros_like(coordinates)  # at each cache offset, the coordinates of the element written there
        for axis, size in enumerate(self.shape):
            scale = 1
            while scale < size:
                digit = (coordinates[:, axis] // scale) % DIGIT + 1
                probe, zeros = digit.reshape(self.shape), torch.zeros(self.shape)
                block = self._write(probe, zeros, dtype) if part == "key" else self._write(zeros, probe, dtype)
                written = block.nonzero().flatten()
                if offsets is None:
                    offsets = written
                    if len(offsets) != len(coordinates):
                        self._refuse(f"{len(offsets)} cache positions hold {len(coordinates)} {part} elements")
                elif not torch.equal(written, offsets):
                    self._refuse(f"{part} positions depend on the {part} values")
                decoded[:, axis] += (block[offsets].long() - 1) * scale
                scale *= DIGIT
        order = decoded[:, 0] * (block_size * head_size) + decoded[:, 1] * head_size + decoded[:, 2]
        if not torch.equal(order.sort().values, torch.arange(len(coordinates))):
            self._refuse(f"{part} elements do not map one to one onto cache positions")
        result = torch.empty_like(offsets)
        result[order] = offsets
        slab = block_size * 2 * head_size  # elements of one [block, head] slab
        heads = result.view(num_kv_heads, -1) // slab
        if not torch.equal(heads, torch.arange(num_kv_heads).unsqueeze(1).expand_as(heads)):
            self._refuse(f"a KV head's {part}s leave its [block, head] slab")
        return result

    def _write(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One block written by vLLM's cache writer for this ISA, flattened (float32)."""
        from vllm import _custom_ops as ops

        heads, block_size, head_size = self.shape
        cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
        try:
            ops.cpu_attn_reshape_and_cache(
                keys.transpose(0, 1).to(dtype).contiguous(),
                values.transpose(0, 1).to(dtype).contiguous(),
                key_cache,
                value_cache,
                torch.arange(block_size),
                self.isa,
            )
        except RuntimeError as error:
            self._refuse(f"this vLLM build cannot write it ({str(error).splitlines()[0]})")
        return cache.flatten().float()

    def _refuse(self, why: str) -> None:
        heads, block_size, head_size = self.shape
        raise ValueError(
            f"kvcompress: snapkv cannot read keys back in vLLM's {self.isa!r} CPU KV layout ({heads} KV heads, "
            f"block size {block_size}, head size {head_size}): {why}"
        )

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[num_kv_heads, num_tokens, head_size]`` float32 keys of the first ``num_tokens`` tokens of ``blocks``."""
        return self.read_blocks(kv_cache, blocks)[:, :num_tokens]

    def read_blocks(self, kv_cache: torch.Tensor, blocks: torch.Tensor, values: bool = False) -> torch.Tensor:
        """float32 keys (``values``: values) of ``blocks`` (``[..., n]`` block ids): ``[..., num_kv_heads,
        n * block_size, head_size]``.

        Only the key (or value) elements are gathered (one indexed read of the cache), not the other half.
        """
        heads, block_size, head_size = self.shape
        affine = self.strides[values]
        if affine is not None and kv_cache.is_contiguous():  # a strided view, then whole [head, token, dim] slabs
            base, head_stride, token_stride, dim_stride = affine
            per_block = kv_cache[0].numel()
            view = kv_cache.as_strided(
                (kv_cache.shape[0], heads, block_size, head_size),
                (per_block, head_stride, token_stride, dim_stride),
                kv_cache.storage_offset() + base,
            )
            keys = view[blocks].transpose(-4, -3)  # [..., heads, n, block, dim]
            return keys.reshape(*blocks.shape[:-1], heads, -1, head_size).float()
        offsets = (self.value_offsets if values else self.offsets).to(kv_cache.device)
        keys = kv_cache.view(kv_cache.shape[0], -1)[blocks.unsqueeze(-1), offsets]  # [..., n, heads*block*dim]
        keys = keys.view(*blocks.shape, heads, block_size, head_size).transpose(-4, -3)
        return keys.reshape(*blocks.shape[:-1], heads, -1, head_size).float()
