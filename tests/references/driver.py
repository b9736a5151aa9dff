"""Drive a method on a tiny model through the public API only, and record what an independent reference needs.

``run_method`` builds the cache with ``kvcompress.cache_for``, feeds a prompt with ``kvcompress.generation.prefill``
(chunked, optionally with left padding) and then decodes fixed tokens one forward at a time (as ``generate`` does:
growing 2D mask, positions from the mask). Forward hooks on the model's own modules record, per forward and layer,

- the pre-RoPE queries and keys (outputs of ``q_proj`` / ``k_proj``) and the values (``v_proj``), from which the
  reference computes attention itself (NumPy, its own RoPE, its own causal mask over the tokens *it* kept), and
- the kept token set right after that layer's attention: stream indices per sequence and KV head, read from the
  contract views ``layer.token_idx`` where ``layer.valid`` (sorted, so no storage order is assumed).

Nothing here reads a method's state, a storage layout or a private attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import kvcompress
from kvcompress.generation import cache_argument, prefill

Kept = list[list[list[int]]]  # [sequence][KV head] -> sorted stream indices


def kept_sets(layer) -> Kept:
    """Sorted stream indices of the real tokens a layer holds, per sequence and KV head."""
    token_idx, valid = layer.token_idx.tolist(), layer.valid.tolist()
    return [
        [sorted(t for t, v in zip(row_t, row_v, strict=True) if v) for row_t, row_v in zip(seq_t, seq_v, strict=True)]
        for seq_t, seq_v in zip(token_idx, valid, strict=True)
    ]


@dataclass
class Forward:
    """One model call as the reference sees it."""

    start: int  # stream index of the first token of this forward
    real: np.ndarray  # [B, q] bool: real tokens (False: left padding)
    phase: str  # "prefill" or "decode"
    queries: list[np.ndarray] = field(default_factory=list)  # per layer [B, q, H_q, d] float64, before RoPE
    keys: list[np.ndarray] = field(default_factory=list)  # per layer [B, q, H_kv, d] float64, before RoPE
    values: list[np.ndarray] = field(default_factory=list)  # per layer [B, q, H_kv, d] float64
    kept: list[Kept] = field(default_factory=list)  # per layer, right after that layer's attention

    @property
    def count(self) -> int:
        return self.real.shape[1]


@dataclass
class Run:
    forwards: list[Forward]
    after_prefill: list[Kept]  # per layer, once ``prefill`` has returned (one-shot methods have compressed)
    ids: torch.Tensor  # [B, T] every token fed, padding included
    mask: torch.Tensor  # [B, T] 1 = real


class Recorder:
    """Forward hooks on every decoder layer's attention projections and attention module."""

    def __init__(self, model, cache) -> None:
        self.cache = cache
        self.forwards: list[Forward] = []
        self.pending: tuple[int, np.ndarray, str] | None = None
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.handles = []
        for index, block in enumerate(model.model.layers):
            attention = block.self_attn
            self.handles.append(attention.q_proj.register_forward_hook(self._projection(index, "queries")))
            self.handles.append(attention.k_proj.register_forward_hook(self._projection(index, "keys")))
            self.handles.append(attention.v_proj.register_forward_hook(self._projection(index, "values")))
            self.handles.append(attention.register_forward_hook(self._snapshot(index)))

    def expect(self, start: int, real: torch.Tensor, phase: str) -> None:
        """Announce the next model call(s): their first stream index, real-token mask and phase."""
        self.pending = (start, real.bool().numpy(), phase)

    def _projection(self, index: int, name: str):
        def hook(module, args, output):
            if index == 0 and name == "queries":
                start, real, phase = self.pending
                count = output.shape[1]
                self.forwards.append(Forward(start, real[:, :count], phase))
                self.pending = (start + count, real[:, count:], phase)
            values = output.detach().double().numpy()
            values = values.reshape(*values.shape[:2], -1, self.head_dim)
            getattr(self.forwards[-1], name).append(values)

        return hook

    def _snapshot(self, index: int):
        def hook(module, args, output):  # after the last layer's attention every eviction of the forward is done
            layers = self.cache.compressed_layers  # (a decoding step's may run together there: ``joint_eviction``)
            if index == len(layers) - 1:
                self.forwards[-1].kept.extend(kept_sets(layer) for layer in layers)

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def token_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """Distinct non-special ids per sequence: no token repeats, so no two keys of layer 0 tie exactly (a tie broken
    by float rounding would make a reference's tie rule meaningless)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(125, generator=generator)[:length] + 3 for _ in range(batch)])


@torch.no_grad()
def run_method(
    model,
    method,
    params: dict | None = None,
    *,
    prompt: int = 19,
    pads: tuple[int, ...] = (0,),
    chunk: int | None = 5,
    steps: int = 22,
    seed: int = 0,
) -> Run:
    """Prefill ``prompt`` stream tokens per sequence (sequence ``b`` left-padded with ``pads[b]`` pad tokens) in
    chunks of ``chunk``, then decode ``steps`` fixed tokens one forward each."""
    batch = len(pads)
    cache = kvcompress.cache_for(model, method, **(params or {}))
    ids = token_ids(batch, prompt + steps, seed)
    mask = torch.ones(batch, prompt + steps, dtype=torch.long)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    recorder = Recorder(model, cache)
    try:
        recorder.expect(0, mask[:, :prompt], "prefill")
        prefill(model, ids[:, :prompt], cache, attention_mask=mask[:, :prompt], chunk_size=chunk)
        after_prefill = [kept_sets(layer) for layer in cache.compressed_layers]
        for step in range(prompt, prompt + steps):
            recorder.expect(step, mask[:, step : step + 1], "decode")
            positions = (mask[:, : step + 1].cumsum(-1) - 1).clamp(min=0)[:, -1:]
            model(
                input_ids=ids[:, step : step + 1],
                attention_mask=mask[:, : step + 1],
                position_ids=positions,
                **cache_argument(model, cache),
                use_cache=True,
            )
    finally:
        recorder.close()
    return Run(recorder.forwards, after_prefill, ids, mask)
