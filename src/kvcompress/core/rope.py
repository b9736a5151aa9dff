"""RoPE helpers: each layer's rotary frequencies, and re-rotating keys and queries already rotated at one position.

Methods that re-index positions inside the cache (``cache`` mode) rotate a copy of the stored keys by the difference
at attention time (rotations compose; the model's ``attention_scaling`` is not applied again). Each layer rotates
with its own layer type's frequencies read from the model's buffers (Gemma-3's ``full_attention_inv_freq`` and
``sliding_attention_inv_freq``), so every static RoPE type is exactly the model's; only the first
``2 * len(inv_freq)`` dimensions rotate (partial rotary). ``dynamic`` and ``longrope`` are refused in ``cache`` mode:
their frequencies switch past the trained length, so a key rotated before cannot be moved with those after.
"""

from __future__ import annotations

import torch
from torch import nn

POSITION_MODES: tuple[str, ...] = ("original", "cache")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def layer_types(text_config) -> list[str]:
    """Each decoder layer's type (``full_attention``, ``sliding_attention``, ...), as the config declares them."""
    declared = getattr(text_config, "layer_types", None)
    if declared:
        return list(declared)
    kind = "sliding_attention" if getattr(text_config, "sliding_window", None) else "full_attention"
    return [kind] * text_config.num_hidden_layers


def layer_inv_freqs(model: nn.Module) -> list[torch.Tensor]:
    """The inverse frequencies ``[rotary_dim / 2]`` (float32, on the model's device) each decoder layer rotates with;
    ``ValueError`` for a model without rotary embeddings and for length-dependent RoPE types."""
    config = model.config.get_text_config()
    buffers = {name: buffer for name, buffer in model.named_buffers() if ".rotary_emb." in f".{name}"}
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    found = []
    for layer_type in layer_types(config):
        params = rope[layer_type] if isinstance(rope.get(layer_type), dict) else rope  # per layer type, or shared
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"{type(model).__name__} uses rope_type={rope_type!r}, whose frequencies change with the sequence "
                "length: keys rotated before the change cannot be moved to cache positions after it, so "
                "position_mode='cache' is not supported; use position_mode='original' or a method keeping "
                "original positions"
            )
        name = next(
            (n for n in buffers if n.endswith((f"rotary_emb.{layer_type}_inv_freq", "rotary_emb.inv_freq"))), None
        )
        if name is None:
            raise ValueError(
                f"{type(model).__name__} has no rotary position embedding (no 'rotary_emb.inv_freq' buffer for "
                f"{layer_type} layers): position_mode='cache' re-rotates keys to their rank in the cache and needs a "
                "RoPE model; use position_mode='original' or a method keeping original positions"
            )
        found.append(buffers[name].detach().float())
    return found


def has_rotary(model: nn.Module) -> bool:
    """Whether ``model`` has rotary position embeddings (a ``rotary_emb`` buffer)."""
    return any(".rotary_emb." in f".{name}" for name, _ in model.named_buffers())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """Rotate ``x`` (``[..., L, head_dim]``, already RoPE-rotated) further by ``delta`` positions (``[..., L]``), the
    angles in float32 as the model's own unless ``exact`` (float64: a large ``delta`` as precise as a small one)."""
    rotary = 2 * inv_freq.shape[-1]
    if rotary < x.shape[-1]:
        rotated = rotate_by(x[..., :rotary], delta, inv_freq, exact)  # broadcast with ``delta``: pass the rest alike
        return torch.cat((rotated, x[..., rotary:].expand(*rotated.shape[:-1], -1)), dim=-1)
    precision = torch.float64 if exact else torch.float32
    angles = delta.to(precision)[..., None] * inv_freq.to(x.device, precision)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


def turn_in_place(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the keys at the start of ``rows`` (``[..., d + more]``) in place by the angles whose ``cos`` and ``sin``
    (``[..., h]``, broadcast against ``rows``) are given."""
    half = cos.shape[-1]
    first, second = rows[..., :half], rows[..., half : 2 * half]
    lost = first * sin
    first.mul_(cos).addcmul_(second, sin, value=-1)
    second.mul_(cos).add_(lost)


def counts_from(positions: torch.Tensor, first: int) -> bool:
    """Whether every row of ``positions`` ``[B or 1, q]`` is ``first, first + 1, ...`` (one host read)."""
    expected = torch.arange(first, first + positions.shape[-1], device=positions.device)
    return bool((positions == expected).all())
